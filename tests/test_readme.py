"""The README and the docs say what the code does: the README's Python API block runs as written, and the chat
page's options table (docs/chat.md) lists the chat's options with their choices and defaults."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CHAT_DOC = REPO / "docs" / "chat.md"


def section(title: str, path: Path = README) -> str:
    """The text of the section ``## title`` of ``path`` (up to the next ``## `` heading)."""
    text = path.read_text()
    head = f"\n## {title}\n"
    assert head in text, f"{path.relative_to(REPO)} has no '## {title}' section"
    return text.split(head, 1)[1].split("\n## ", 1)[0]


def test_python_api_block_runs_as_written(demo_env, tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", section("Python API"), re.S)
    assert len(blocks) == 1, "the README's Python API section should have exactly one ```python block"
    script = tmp_path / "readme_api.py"
    script.write_text(blocks[0])
    r = subprocess.run([sys.executable, str(script)], env=demo_env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Qwen3MoeSparseMoeBlock" in r.stdout and "moe" in r.stdout, r.stdout  # the plan was printed
    assert r.stdout.rstrip().splitlines()[-1].startswith("Hello"), r.stdout  # prompt + the generated tokens


def readme_options() -> dict[str, tuple[str, str]]:
    """{option: (its argument as written, the row's meaning)} from the chat page's options table."""
    out = {}
    for row in section("Options", CHAT_DOC).splitlines():
        if not row.startswith("| `"):
            continue
        first, meaning = row.strip("| ").split(" | ", 1)
        for span in re.findall(r"`([^`]+)`", first):
            option, _, argument = span.replace("\\|", "|").partition(" ")
            out[option] = (argument, meaning)
    return out


def test_chat_options_table_matches_the_parser():
    from ktinject.cli.chat import build_parser

    table = readme_options()
    fix = "; update the option table under '## Options' in docs/chat.md"
    listed = set()
    for action in build_parser()._actions:
        if "-h" in action.option_strings or "--version" in action.option_strings:  # every program's, not the chat's
            continue
        names = [n for n in action.option_strings if n in table]
        assert names, f"{'/'.join(action.option_strings)} is missing from docs/chat.md's options table{fix}"
        listed.update(names)
        argument, meaning = table[names[0]]
        if action.choices:
            assert argument.split("|") == list(action.choices), \
                f"{names[0]}: docs/chat.md lists {argument!r}, the parser's choices are {'|'.join(action.choices)}{fix}"
        if action.default not in (None, False, argparse.SUPPRESS):  # SUPPRESS: --version, --help
            assert re.search(rf"default:? `?{re.escape(str(action.default))}\b", meaning), \
                f"{names[0]}: docs/chat.md does not say its default, {action.default}{fix}"
    stale = sorted(set(table) - listed)
    assert not stale, f"docs/chat.md's options table lists {stale}, which the chat does not have{fix}"
