"""The installed package wins over a directory named ``ktinject`` in the current directory (issue 45).

A ``git clone`` of the repository is a directory named ``ktinject`` with no ``__init__.py`` at its top. Run from its
parent, the current directory comes first on ``sys.path``, so Python saw the clone as a namespace-package portion
``ktinject``. setuptools' default editable install (an import hook on ``sys.meta_path``, consulted only after the
path finder) then lost to it: ``ktinject.injection.rules`` was the clone's ``rules/`` folder (``python -m ktinject.chat``:
"cannot import name 'FAMILIES'") and ``ktinject.plan`` did not exist (the README snippet). With every package where
its name says (pyproject.toml: ``package-dir = {"" = "."}``, ``ktinject/rulefiles`` a symlink to ``../rules``), an
editable install is a ``.pth`` entry on ``sys.path`` instead, where the regular package beats a namespace portion,
as a normal install in site-packages always did.

The check runs against the installed ``ktinject``: an editable install made before the fix still has the import
hook and fails here until it is reinstalled (``pip install -e .``).
"""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib.resources, importlib.util
import ktinject
from ktinject.injection.rules import FAMILIES
import ktinject.injection.rules
print(ktinject.__file__)
print(ktinject.injection.rules.__file__)
print(importlib.util.find_spec("ktinject.injection.plan").origin)
print(callable(getattr(ktinject, "__getattr__", None)))  # ktinject.plan, ktinject.inject, ... resolve through it
print((importlib.resources.files("ktinject.rulefiles") / "common.yaml").is_file())
"""


def _installed() -> bool:
    try:
        importlib.metadata.distribution("ktinject")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _probe(cwd: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}  # cwd first on sys.path
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (
        f"`import ktinject` run from {cwd} failed; an editable install made with setuptools' import hook (before "
        f"issue 45's fix) needs `pip install -e .` again:\n{proc.stdout}{proc.stderr}")
    return proc.stdout.split()


def test_rulefiles_link():
    """ktinject/rulefiles is rules/ (the symlink pyproject.toml relies on: the rules ship as ktinject.rulefiles)."""
    link = ROOT / "ktinject" / "rulefiles"
    assert link.is_symlink() and link.resolve() == (ROOT / "rules").resolve(), \
        "ktinject/rulefiles must be a symlink to ../rules (git config core.symlinks true)"


@pytest.mark.skipif(not _installed(), reason="ktinject is not installed (pip install -e .)")
def test_clone_parent_imports_installed_package(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    expected = _probe(elsewhere)  # where the installed package is, with nothing named ktinject in the cwd

    clone = tmp_path / "ktinject"  # the clone's top level as the parent directory sees it: no __init__.py
    clone.mkdir()
    (clone / "rules").symlink_to(ROOT / "rules", target_is_directory=True)  # a package: rules/__init__.py
    (clone / "README.md").write_text("ktinject\n")

    package, rules, plan, getattr_, rulefiles = _probe(tmp_path)
    assert package == expected[0], f"from the clone's parent, `import ktinject` gave {package}, not {expected[0]}"
    assert Path(package).parent == Path(rules).parents[1] == Path(plan).parents[1], (package, rules, plan)
    assert getattr_ == "True" and rulefiles == "True"
