"""The layering of ``ktinject.serve``: its modules form no import cycle, and none inherits its behaviour from a class
of another of its files (the engine *has* a scheduler and a model runner; it is neither). Exceptions may subclass
across files (``errors.py`` at the bottom).

Every module is parsed (ast, nothing imported): an import counts wherever it is, at module level, under
``if TYPE_CHECKING:`` or inside a function, so a circle cannot hide behind a lazy or a typing-only import.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import ktinject.serve

PACKAGE = "ktinject.serve"
ROOT = Path(ktinject.serve.__file__).resolve().parent
MODULES = {(PACKAGE if p.stem == "__init__" else f"{PACKAGE}.{p.stem}"): p for p in sorted(ROOT.glob("*.py"))}


def _imported(node: ast.AST, importer: str) -> list[tuple[str, str | None]]:
    """(serve module, name imported from it or None) for each module of the package an import statement names."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names if a.name in MODULES]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative to the package (serve has no subpackages)
        base = ".".join([PACKAGE] + ([base] if base else []))
    out = []
    for a in node.names:
        if f"{base}.{a.name}" in MODULES:
            out.append((f"{base}.{a.name}", None))  # from ktinject.serve import protocol
        elif base in MODULES:
            out.append((base, a.name))
    return out


def _graph() -> dict[str, set[str]]:
    """importer -> the serve modules it imports, at any level."""
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = {m for node in ast.walk(tree) for m, _ in _imported(node, name) if m != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_module_of_serve_imports_one_that_imports_it_back():
    graph = _graph()
    assert "ktinject.serve.scheduler" in graph["ktinject.serve.engine"]  # the parser sees the imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_bottom_of_serve_imports_nothing_above_it():
    graph = _graph()
    assert graph["ktinject.serve.errors"] == set()
    assert graph["ktinject.serve.types"] <= {"ktinject.serve.errors", "ktinject.serve.sampling",
                                             "ktinject.serve.detokenizer"}


def test_no_class_of_serve_subclasses_one_of_another_serve_file_but_exceptions():
    """Behaviour is composed, not inherited across files; the two kinds of base that carry none may be shared:
    exceptions, and the request bodies' pydantic base (its configuration and null handling, request_model.py)."""
    from ktinject.serve.request_model import RequestModel

    bad = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        names = {}  # a local name -> (serve module, the name in it or None for the module itself)
        for node in ast.walk(tree):
            for module, imported in _imported(node, name):
                for a in node.names:
                    if imported is None and module.endswith(f".{a.name}"):
                        names[a.asname or a.name] = (module, None)
                    elif imported == a.name:
                        names[a.asname or a.name] = (module, a.name)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for base in cls.bases:
                if isinstance(base, ast.Name) and base.id in names and names[base.id][1] is not None:
                    module, attr = names[base.id]
                elif (isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name)
                      and names.get(base.value.id, ("", "x"))[1] is None and base.value.id in names):
                    module, attr = names[base.value.id][0], base.attr
                else:
                    continue
                parent = getattr(importlib.import_module(module), attr)
                if not (isinstance(parent, type) and (issubclass(parent, BaseException) or parent is RequestModel)):
                    bad.append(f"{name}.{cls.name}({module}.{attr})")
    assert not bad, f"subclasses across serve files: {bad}"
