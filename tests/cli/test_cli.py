"""The ``ktinject`` command: subcommands dispatched to the programs' mains, --version, --help."""
from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def ktinject(env, *args, module: str = "ktinject.cli.main", timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def _version() -> str:
    try:
        return metadata.version("ktinject")
    except metadata.PackageNotFoundError:
        import ktinject

        return ktinject.__version__


@pytest.mark.parametrize("args", [["--version"], ["chat", "--version"]])
def test_version(demo_env, args):
    r = ktinject(demo_env, *args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"ktinject {_version()}"


def test_version_falls_back_to_the_package(monkeypatch):
    import ktinject
    from ktinject.cli import options as cli

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert cli.version() == ktinject.__version__


def test_help_lists_the_commands(demo_env):
    r = ktinject(demo_env, "--help")
    assert r.returncode == 0, r.stderr
    for name in ("chat", "serve", "eval", "info", "bench", "calibrate", "finetune"):
        assert f"\n  {name} " in r.stdout, r.stdout


@pytest.mark.parametrize("name, needle", [
    ("chat", "--max-new-tokens"), ("serve", "--max-context"), ("eval", "--configs"), ("bench", "benchmarks:"),
    ("calibrate", "--prompts"), ("finetune", "--target-modules"),
])
def test_subcommand_help_is_the_programs(demo_env, name, needle):
    r = ktinject(demo_env, name, "--help")
    assert r.returncode == 0, r.stderr
    assert needle in r.stdout, r.stdout


def test_info_runs(demo_env):
    r = ktinject(demo_env, "info")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ktinject"), r.stdout


def test_unknown_command_and_errors_keep_their_exit_codes(demo_env, tmp_path):
    r = ktinject(demo_env, "nope")
    assert r.returncode == 2 and "invalid choice: 'nope'" in r.stderr
    r = ktinject(demo_env, "chat", "--model", str(tmp_path / "missing"))  # the chat's own error and exit code
    assert r.returncode == 2 and "ktinject.chat: error: model directory not found" in r.stderr, r.stderr


def test_python_m_ktinject(demo_env):
    r = ktinject(demo_env, "--version", module="ktinject")
    assert r.returncode == 0 and r.stdout.strip() == f"ktinject {_version()}", r.stderr


def test_console_script_is_declared_and_installed():
    text = (REPO / "pyproject.toml").read_text()
    assert '[project.scripts]\nktinject = "ktinject.cli.main:main"' in text
    script = shutil.which("ktinject")
    if script is None:
        pytest.skip("the ktinject script is not on PATH (pip install -e . puts it there)")
    r = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().startswith("ktinject "), r.stderr
