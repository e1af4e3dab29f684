"""The README stays a front door and the docs site stays whole: cheap structural checks (no mkdocs needed). CI also
builds the site with ``mkdocs build --strict`` (.ci/run), which checks every link and anchor; the last test here
does the same where mkdocs-material is installed (``pip install -e .[docs]``) and is skipped otherwise."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
MKDOCS = REPO / "mkdocs.yml"
MAX_README_LINES = 200
MAX_CELL = 150


def table_cells(text: str):
    """(line number, cell) of every cell of every markdown table row in ``text`` (outside code blocks)."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("|"):
            continue
        for cell in re.split(r"(?<!\\)\|", line.strip().strip("|")):
            yield n, cell.strip()


def nav_files(nav) -> list[str]:
    """The page paths named anywhere in mkdocs.yml's nav."""
    out = []
    for item in nav if isinstance(nav, list) else [nav]:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            for value in item.values():
                out.extend(nav_files(value) if isinstance(value, (list, dict)) else [value])
    return [p for p in out if not re.match(r"[a-z]+://", p)]


def load_mkdocs() -> dict:
    import yaml

    class Loader(yaml.SafeLoader):  # mkdocs.yml may hold !!python/name tags (superfences' mermaid fence)
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    return yaml.load(MKDOCS.read_text(), Loader=Loader)


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, \
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move the detail into docs/"
    long = [(n, len(c), c[:60]) for n, c in table_cells(README.read_text()) if len(c) > MAX_CELL]
    assert not long, f"README.md table cells over {MAX_CELL} characters (line, length, start): {long}"


def test_readme_ci_block_is_there():
    """.ci/run reads the install + test commands from the block after this marker."""
    text = README.read_text()
    assert text.count("<!-- ci:test -->") == 1
    block = text.split("<!-- ci:test -->", 1)[1].lstrip().split("\n```\n", 1)[0]
    assert block.startswith("```bash\n") and "pytest" in block, block


def test_readme_links_exist():
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text()):
        if "://" not in target:
            assert (REPO / target).exists(), f"README.md links to {target}, which does not exist"


def test_mkdocs_nav_files_exist():
    cfg = load_mkdocs()
    assert cfg.get("docs_dir", "docs") == "docs"
    pages = nav_files(cfg["nav"])
    assert "index.md" in pages and "internals/environment.md" in pages
    missing = [p for p in pages if not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml's nav names pages that do not exist: {missing}"
    assert len(pages) == len(set(pages)), "a page appears twice in the nav"
    outside = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")
                     if str(p.relative_to(DOCS)) not in pages and not str(p.relative_to(DOCS)).startswith("history/"))
    assert not outside, f"pages in docs/ missing from mkdocs.yml's nav: {outside}"


def test_docs_relative_links_exist():
    """Links between pages (outside the history, kept as written) point to files that exist."""
    for page in DOCS.rglob("*.md"):
        if page.relative_to(DOCS).parts[0] == "history":
            continue
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).resolve().exists(), f"{page.relative_to(REPO)} links to {target}"


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("material", reason="mkdocs-material is in the docs extra: pip install -e .[docs]")
    mkdocs = shutil.which("mkdocs")
    cmd = [mkdocs] if mkdocs else [sys.executable, "-m", "mkdocs"]
    r = subprocess.run([*cmd, "build", "--strict", "-q", "-d", str(tmp_path / "site")], cwd=REPO,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
