"""The registry of ``KTINJECT_*`` variables (ktinject/envs.py) against the code that reads them and the docs page.

(a) docs/internals/environment.md is what ``envs.markdown()`` writes; (b) every variable read anywhere (Python in
ktinject/ through ``envs``, native/src by ``getenv``, the build, the tests) is registered, and no module but envs.py
and the build reads ``os.environ`` for a ``KTINJECT_*`` name; (c) every entry is read where its ``read_by`` says;
(d) malformed values raise errors naming the variable; and importing envs does nothing else.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from ktinject import envs

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "internals" / "environment.md"
REGENERATE = "python -m ktinject.envs --markdown > docs/internals/environment.md"
NAME = re.compile(r"\bKTINJECT_[A-Z0-9_]+\b")
#: KTINJECT_* tokens that are no variable: an attention implementation's name, the C header's include guard
NOT_VARIABLES = {"KTINJECT_SDPA", "KTINJECT_H"}
ACCESSORS = {"get", "raw", "is_set", "env_int", "overridden"}
SELF = {REPO / "ktinject" / "envs.py", Path(__file__).resolve()}  # the registry, and this file's made-up names


def _is_build(path: Path) -> bool:
    """The native build's files (run by setuptools before the package can be imported: they read os.environ)."""
    return path.name == "_build.py" or path.as_posix().endswith("native/build.py")


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) and (
        node.value.id == "os")


class _Reads(ast.NodeVisitor):
    """A module's environment reads: ``direct`` (os.environ / os.getenv with a KTINJECT_* key: name, line) and
    ``through`` (names passed to envs' accessors); ``unresolved``: accessor calls whose name is not a literal or a
    module-level constant."""

    def __init__(self, tree: ast.Module):
        self.constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                          and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                          for t in n.targets if isinstance(t, ast.Name)}
        self.direct: list[tuple[str, int]] = []
        self.through: set[str] = set()
        self.unresolved: list[int] = []
        self.visit(tree)

    def _key(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return self.constants.get(node.id)
        return None

    def _direct(self, key_node: ast.AST, line: int) -> None:
        key = self._key(key_node)
        if key and key.startswith("KTINJECT_"):
            self.direct.append((key, line))

    def visit_Subscript(self, node: ast.Subscript):
        if _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            self._direct(node.slice, node.lineno)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare):
        if any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and any(map(_is_environ, node.comparators)):
            self._direct(node.left, node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute) and node.args:
            if f.attr == "get" and _is_environ(f.value) or (
                    f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os"):
                self._direct(node.args[0], node.lineno)
            elif f.attr in ACCESSORS and isinstance(f.value, ast.Name) and f.value.id == "envs":
                self._through(node)
        elif isinstance(f, ast.Name) and f.id == "env_int" and node.args:
            self._through(node)
        self.generic_visit(node)

    def _through(self, node: ast.Call) -> None:
        key = self._key(node.args[0])
        if key is None:
            self.unresolved.append(node.lineno)
        else:
            self.through.add(key)


@cache
def _python_reads(root: str) -> dict[Path, _Reads]:
    """Every module under REPO/root but envs.py, parsed."""
    return {p: _Reads(ast.parse(p.read_text(), str(p))) for p in sorted((REPO / root).rglob("*.py"))
            if p not in SELF}


@cache
def _native_reads() -> dict[str, list[str]]:
    """name -> the native/src files that getenv it."""
    out: dict[str, list[str]] = {}
    for p in sorted((REPO / "native" / "src").rglob("*.[ch]")):
        for name in re.findall(r'getenv\(\s*"(KTINJECT_[A-Z0-9_]+)"\s*\)', p.read_text()):
            out.setdefault(name, []).append(str(p.relative_to(REPO)))
    return out


def _readers() -> dict[str, set[str]]:
    """name -> where it is read: python (ktinject/ through envs), native, build, tests (tests/ through envs or
    os.environ)."""
    got: dict[str, set[str]] = {}
    for p, r in _python_reads("ktinject").items():
        for name, _ in r.direct:
            got.setdefault(name, set()).add("build" if _is_build(p) else "python")
        for name in r.through:
            got.setdefault(name, set()).add("python")
    for name in _native_reads():
        got.setdefault(name, set()).add("native")
    for r in _python_reads("tests").values():
        for name in {n for n, _ in r.direct} | r.through:
            got.setdefault(name, set()).add("tests")
    return got


# ---- (a) the docs page ----
def test_docs_page_is_generated_from_the_registry():
    assert PAGE.read_text() == envs.markdown(), f"docs/internals/environment.md is stale: run {REGENERATE}"


# ---- (b) every read is registered, and Python reads go through envs ----
def test_no_module_reads_ktinject_variables_from_os_environ():
    bad = [f"{p.relative_to(REPO)}:{line}: {name}" for p, r in _python_reads("ktinject").items() if not _is_build(p)
           for name, line in r.direct]
    assert not bad, ("read these through ktinject.envs (envs.get / envs.raw), not os.environ: " + "; ".join(bad))


def test_accessor_calls_name_their_variable():
    bad = [f"{p.relative_to(REPO)}:{line}" for root in ("ktinject", "tests") for p, r in _python_reads(root).items()
           for line in r.unresolved]
    assert not bad, "envs accessors called with a name that is no literal or module constant: " + "; ".join(bad)


def test_every_variable_read_is_registered():
    unknown = {name: sorted(where) for name, where in _readers().items() if name not in envs.VARIABLES}
    assert not unknown, f"read but not in ktinject/envs.py's table (add a Var): {unknown}"


def test_read_by_says_where_each_is_read():
    readers = _readers()
    wrong = {v.name: (v.read_by, sorted(readers.get(v.name, ()))) for v in envs.VARIABLES.values()
             if set(v.read_by) != readers.get(v.name, set()) - ({"tests"} if "tests" not in v.read_by else set())}
    assert not wrong, f"read_by (registered, found) disagree: {wrong}"


def test_tests_benchmarks_and_docs_name_only_variables_that_exist():
    """Code that sets or names a variable (tests, benchmarks, the native tests) names a registered one; docs may
    also name a retired one (docs/history is left as written)."""
    code, prose = [], []
    for root in ("tests", "benchmarks", "native", "ktinject"):
        for p in (REPO / root).rglob("*"):
            if p in SELF:
                continue
            if p.suffix in (".py", ".c", ".h", ".sh"):
                code += [(p, n) for n in NAME.findall(p.read_text(errors="replace"))]
            elif p.suffix == ".md":
                prose += [(p, n) for n in NAME.findall(p.read_text(errors="replace"))]
    for p in [REPO / "README.md", *(REPO / "docs").rglob("*.md")]:
        if p.exists() and "history" not in p.relative_to(REPO).parts and p != PAGE:
            prose += [(p, n) for n in NAME.findall(p.read_text())]
    retired_ok = {(p, n) for p, n in code if n in envs.RETIRED and p.suffix in (".c", ".h")}  # "is retired" notes
    bad = sorted({f"{p.relative_to(REPO)}: {n}" for p, n in code if n not in envs.VARIABLES and n not in NOT_VARIABLES
                  and (p, n) not in retired_ok})
    bad += sorted({f"{p.relative_to(REPO)}: {n}" for p, n in prose if n not in envs.VARIABLES
                   and n not in envs.RETIRED and n not in NOT_VARIABLES})
    assert not bad, f"names no registered variable (a typo, or set after it was retired): {bad}"


# ---- (c) no stale entries ----
def test_every_entry_is_read_somewhere():
    readers = _readers()
    stale = [v.name for v in envs.VARIABLES.values() if not readers.get(v.name)]
    assert not stale, f"registered but read nowhere (retire them: move to envs.RETIRED): {stale}"


def test_registry_shape():
    assert not set(envs.VARIABLES) & set(envs.RETIRED)
    for v in envs.VARIABLES.values():
        assert v.meaning and (v.audience == "developer") == bool(v.why), v.name
        if v.default is not None and v.type in BAD:  # the default, written out, parses to itself
            assert v.parse(str(int(v.default)) if v.type == "bool" else str(v.default)) == v.default, v.name


def test_choices_match_the_code():
    from ktinject import native
    from ktinject.bench import defer

    assert envs.VARIABLES["KTINJECT_INT4_GROUP"].choices == tuple(map(str, native.GROUP_SIZES))
    assert envs.VARIABLES["KTINJECT_ISA"].choices == tuple(native.ISA_NAMES)
    assert envs.VARIABLES["KTINJECT_DEFER_PHASES"].choices == defer.LAYOUTS
    assert envs.VARIABLES["KTINJECT_DEFER_PHASES"].default == defer.DEFAULT_LAYOUT


# ---- (d) values ----
BAD = {"int": "many", "float": "fast", "bool": "maybe", "choice": "bogus"}


@pytest.mark.parametrize("var", [v for v in envs.VARIABLES.values() if v.type in BAD], ids=lambda v: v.name)
def test_malformed_values_name_the_variable(var, monkeypatch):
    monkeypatch.setenv(var.name, BAD[var.type])
    with pytest.raises(ValueError, match=rf"^{var.name}='{BAD[var.type]}' .*unset it for the default"):
        envs.get(var.name)
    if var.minimum is not None:
        monkeypatch.setenv(var.name, str(var.minimum - 1))
        with pytest.raises(ValueError, match=rf"^{var.name}={var.minimum - 1} is below {var.minimum}"):
            envs.get(var.name)


def test_values_parse(monkeypatch):
    monkeypatch.delenv("KTINJECT_READAHEAD_MB", raising=False)
    assert envs.get("KTINJECT_READAHEAD_MB") == 256
    monkeypatch.setenv("KTINJECT_READAHEAD_MB", " 8 ")
    assert envs.get("KTINJECT_READAHEAD_MB") == 8
    monkeypatch.setenv("KTINJECT_READAHEAD_MB", "")
    assert envs.get("KTINJECT_READAHEAD_MB") == 256  # empty: the default
    monkeypatch.setenv("KTINJECT_FUSED", "0")
    assert envs.get("KTINJECT_FUSED") is False
    monkeypatch.setenv("KTINJECT_STREAM_SYNC", "HostFn")
    assert envs.get("KTINJECT_STREAM_SYNC") == "hostfn"
    monkeypatch.setenv("KTINJECT_CACHE", "~/x")
    assert envs.get("KTINJECT_CACHE") == str(Path.home() / "x")
    with pytest.raises(KeyError, match="KTINJECT_NOPE is not a registered"):
        envs.get("KTINJECT_NOPE")
    with pytest.raises(KeyError, match="retired: .*one native task"):
        envs.raw("KTINJECT_DEFER_SPLIT")


def test_overridden_restores(monkeypatch):
    monkeypatch.setenv("KTINJECT_PIPE", "1")
    with envs.overridden("KTINJECT_PIPE", "0"):
        assert envs.get("KTINJECT_PIPE") is False
        with envs.overridden("KTINJECT_PIPE", None):
            assert not envs.is_set("KTINJECT_PIPE")
    assert envs.raw("KTINJECT_PIPE") == "1"


def test_unknown_names_stale_variables(monkeypatch):
    monkeypatch.setenv("KTINJECT_DEFER_SPLIT", "0")
    monkeypatch.setenv("KTINJECT_THREADZ", "4")
    got = envs.unknown()
    assert "one native task" in got["KTINJECT_DEFER_SPLIT"] and "typo" in got["KTINJECT_THREADZ"]
    assert "KTINJECT_THREADZ: ignored" in envs._report()


def test_import_does_nothing_else():
    code = ("import sys; import ktinject.envs; "
            "print(sorted(m for m in sys.modules if m.startswith(('ktinject', 'torch'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "['ktinject', 'ktinject.envs']", r.stdout + r.stderr
