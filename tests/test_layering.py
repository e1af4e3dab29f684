"""Layering: one package per layer, each importing only the layers below it; no import cycles in the package; no
module using another's private names; a native core whose files below the API never call back into it.

Python: every module of ``ktinject`` is parsed (ast, nothing imported) for ``import ktinject...`` / ``from
ktinject... import ...``, at module level, inside functions and under ``if TYPE_CHECKING:`` alike (an annotation's
import is a dependency too). Every import goes to the importer's own layer or one below it (``LAYERS``); the
module-level imports form no cycle (Python would run a half-initialized module), and with the function-level and
TYPE_CHECKING ones none either, except for the few edges listed in ``LAZY_CYCLE_EDGES`` with the reason each is lazy.

C: ``native/src/**/*.c`` by the functions each file defines and calls: ``api.c`` (the public entry points) is called
by no other file, ``error.c`` (the error state) calls none; by folder (``FOLDER_CALLS``), ``moe/`` calls ``runtime/``
and ``kernels/``, ``runtime/`` calls ``kernels/`` only (the pool runs a task's job through a function pointer),
``kernels/`` calls neither, and the folders' calls form no circle; every internal function is named for its file
(``ktki_<file>`` or ``ktki_<file>_*``; the ISA kernel folders export the kernel ABI's ``ktk_*`` names instead).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ktinject"

#: the layers, bottom first: a module may import its own layer's modules and those of the layers before it. The
#: package's root modules (the lazy public names, ``python -m`` entry modules) are the front door, above them all.
LAYERS = (
    ("ktinject.envs", "ktinject.compat", "ktinject.tiny_models"),
    ("ktinject.native", "ktinject.native.library", "ktinject.native.build", "ktinject.native.cuda_driver"),
    ("ktinject.operators",),
    ("ktinject.gpu_experts",),
    ("ktinject.decode",),
    ("ktinject.injection",),
    ("ktinject.train",),
    ("ktinject.serve",),
    ("ktinject.demo",),
    ("ktinject.cli",),
    ("ktinject.bench",),
)
FRONT_DOOR = ("ktinject", "ktinject.__main__", "ktinject.chat", "ktinject.eval", "ktinject.calibrate", "ktinject.info",
              "ktinject.finetune", "ktinject.serve.__main__")


def layer_of(module: str) -> int | None:
    """Index in LAYERS of ``module``'s layer; None for the front door. Importing the package itself means using its
    public names, whose homes reach up to ``ktinject.cli`` (``ktinject.info``): the command-line layer."""
    if module == "ktinject":
        return next(i for i, p in enumerate(LAYERS) if "ktinject.cli" in p)
    if module in FRONT_DOOR:
        return None
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS in tests/test_layering.py")


#: (importer, imported) function-level edges that close a cycle, and why they stay lazy
LAZY_CYCLE_EDGES: dict[tuple[str, str], str] = {}

#: (importer, module, private name): uses of another module's private names that are accepted, and why
PRIVATE_USES: dict[tuple[str, str, str], str] = {
    # native.py is the public face of _nativelib, its implementation module: it re-exports the argument checks
    # and the library handle that its own wrappers use
    **{("ktinject.native", "ktinject.native.library", n): "re-export" for n in ("_check", "_cint", "_native", "_ptr",
                                                                             "_tensor")},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _targets(node: ast.AST, importer: str) -> list[tuple[str, str | None]]:
    """(module, imported name or None) for each ktinject module an import statement names."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names if a.name.split(".")[0] == "ktinject"]
    base = node.module or ""
    if node.level:  # relative: resolved against the importer's package
        package = importer if MODULES[importer].name == "__init__.py" else importer.rpartition(".")[0]
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
    if base.split(".")[0] != "ktinject":
        return []
    return [(f"{base}.{a.name}", None) if f"{base}.{a.name}" in MODULES else (base, a.name) for a in node.names]


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(test)


def _imports(name: str) -> tuple[list[tuple[str, str | None, int]], list[tuple[str, str | None, int]]]:
    """(module-level, function-level) imports of module ``name``: (module, name or None, line)."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    top, inner = [], []

    def visit(node: ast.AST, in_function: bool) -> None:
        if _type_checking(node):  # annotations only, never executed, but a dependency: counted with the lazy ones
            in_function = True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            (inner if in_function else top).extend((m, n, node.lineno) for m, n in _targets(node, name))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return top, inner


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = walk(w)
                if found:
                    return found
        state[v] = 2
        stack.pop()
        return None

    for v in sorted(graph):
        if v not in state:
            found = walk(v)
            if found:
                return found
    return None


def _graphs() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    top: dict[str, set[str]] = {m: set() for m in MODULES}
    full: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        outer, inner = _imports(m)
        for target, _, _ in outer:
            if target in MODULES and target != m:
                top[m].add(target)
                full[m].add(target)
        for target, _, _ in inner:
            if target in MODULES and target != m and (m, target) not in LAZY_CYCLE_EDGES:
                full[m].add(target)
    return top, full


def test_no_cycle_of_module_level_imports():
    top, _ = _graphs()
    cycle = _cycle(top)
    assert cycle is None, f"module-level import cycle: {' -> '.join(cycle)}"


def test_no_cycle_hidden_in_function_level_imports():
    _, full = _graphs()
    cycle = _cycle(full)
    assert cycle is None, (f"import cycle through imports inside functions: {' -> '.join(cycle)}; import at module "
                           f"level and move what both sides need to a module below them")


def test_lazy_cycle_edges_are_still_needed():
    """An entry of LAZY_CYCLE_EDGES whose import is gone must be dropped from the list."""
    for importer, target in LAZY_CYCLE_EDGES:
        inner = {t for t, _, _ in _imports(importer)[1]}
        assert target in inner, f"LAZY_CYCLE_EDGES lists {importer} -> {target}, which imports it no more"


def test_every_module_is_in_a_layer():
    for m in MODULES:
        layer_of(m)


def test_layers_import_only_the_layers_below():
    """At module level, inside functions and under TYPE_CHECKING: no import reaches a layer above the importer's."""
    bad = []
    for m in MODULES:
        mine = None if m == "ktinject" else layer_of(m)
        if mine is None:
            continue
        for t, _, line in sum(_imports(m), []):
            if t not in MODULES or t == m:
                continue
            theirs = layer_of(t)
            if theirs is None or theirs > mine:
                bad.append(f"{MODULES[m].relative_to(ROOT)}:{line}: {m} imports {t}")
    assert not bad, "imports of a layer above (move the shared part down, or invert the call):\n" + "\n".join(bad)


def _package(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def test_no_cycle_between_packages():
    """Packages (ktinject.gpu_experts.hot, .prefill, ktinject.injection.formats, ...) import each other one way only,
    counting every import (module level, inside functions, TYPE_CHECKING); the package root's lazy front door aside."""
    graph: dict[str, set[str]] = {}
    for m in MODULES:
        if m in FRONT_DOOR:
            continue
        for t, _, _ in sum(_imports(m), []):
            if t in MODULES and t not in FRONT_DOOR and _package(t) != _package(m):
                graph.setdefault(_package(m), set()).add(_package(t))
    cycle = _cycle(graph)
    assert cycle is None, f"package import cycle: {' -> '.join(cycle)}"


def _private_uses(name: str) -> list[tuple[str, str, int]]:
    """(module, private name, line) that module ``name`` takes from another ktinject module: ``from m import _x``
    and ``alias._x`` where ``alias`` is bound to a ktinject module by an import."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    out, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for (module, imported, ), alias in zip(_targets(node, name), node.names):
                bound = alias.asname or alias.name.split(".")[0]
                if imported is None and module != name:
                    aliases[bound] = module if isinstance(node, ast.ImportFrom) or alias.asname else "ktinject"
                elif imported.startswith("_") and not imported.startswith("__") and module != name:
                    out.append((module, imported, node.lineno))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                out.append((aliases[node.value.id], node.attr, node.lineno))
    return out


def test_no_module_uses_another_modules_private_names():
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line}: {target}.{attr}" for m in MODULES
           for target, attr, line in _private_uses(m) if (m, target, attr) not in PRIVATE_USES]
    assert not bad, "private names used across modules (make them public or move the code):\n" + "\n".join(bad)


def test_every_package_is_installed():
    """pyproject.toml lists packages explicitly: a new subpackage missing there is missing from the wheel."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")  # (tomllib is 3.11+; the project runs on 3.10)
    listed = set(re.findall(r'"([^"]+)"', re.search(r"^packages = \[(.*?)\]", text, re.S | re.M).group(1)))
    packages = {m for m, path in MODULES.items() if path.name == "__init__.py"}
    assert packages <= listed, f"add {sorted(packages - listed)} to [tool.setuptools] packages in pyproject.toml"


# ---------------------------------------------------------------------------------------------- C


NATIVE_SRC = ROOT / "native" / "src"
#: the folders of native/src and the folders each may call into (besides its own files and error.c, which every file
#: may call); api.c (the top) may call every folder.
FOLDER_CALLS = {"kernels": set(), "runtime": {"kernels"}, "moe": {"runtime", "kernels"}}
#: the ISA kernel folders: their files export kernel-ABI names (ktk_*), not ktki_<file>_*
ISA_DIRS = ("kernels/generic", "kernels/avx2", "kernels/avx512", "kernels/amx")


def _c_calls() -> tuple[dict[str, str], dict[str, set[str]]]:
    """(function -> defining file, file -> functions it calls) for native/src/**/*.c, files as paths relative to
    native/src (comments and strings removed)."""
    defined, calls = {}, {}
    for path in sorted(NATIVE_SRC.rglob("*.c")):
        name = path.relative_to(NATIVE_SRC).as_posix()
        text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", path.read_text(encoding="utf-8"), flags=re.S)
        text = re.sub(r'"(\\.|[^"\\])*"', '""', text)
        for m in re.finditer(r"^(?!static\b|KTK_AI\b)[A-Za-z_][\w \t\*]*?\b(\w+)\s*\([^;{)]*\)\s*\{", text, flags=re.M):
            defined[m.group(1)] = name
        calls[name] = set(re.findall(r"\b(\w+)\s*\(", text))
    return defined, calls


def _folder(file: str) -> str:
    """native/src's folder of a file (its first component), or the file itself at the top (api.c, error.c)."""
    return file.split("/")[0]


def test_native_files_below_the_api_do_not_call_it():
    defined, calls = _c_calls()
    assert defined.get("ktk_last_error") == "api.c" and defined.get("ktki_error") == "error.c"
    into_api = sorted(f"{f} calls {fn}" for f, called in calls.items() if f != "api.c"
                      for fn in called if defined.get(fn) == "api.c")
    assert not into_api, "native files below api.c call into it: " + "; ".join(into_api)
    from_error = sorted(fn for fn in calls["error.c"] if defined.get(fn, "error.c") != "error.c")
    assert not from_error, f"error.c calls other files: {from_error}"


def test_native_folders_call_only_the_folders_below_them():
    defined, calls = _c_calls()
    folders = {_folder(f) for f in calls if "/" in f}
    assert folders == set(FOLDER_CALLS), f"native/src folders {sorted(folders)}: list each in FOLDER_CALLS"
    edges: dict[str, set[str]] = {}
    bad = []
    for f, called in calls.items():
        src = _folder(f)
        for fn in called:
            dst = _folder(defined.get(fn, f))
            if dst in (src, "error.c"):
                continue
            edges.setdefault(src, set()).add(dst)
            if src != "api.c" and dst not in FOLDER_CALLS.get(src, set()):
                bad.append(f"{f} calls {fn} ({defined[fn]})")
    assert not bad, "native calls across folders that FOLDER_CALLS does not allow:\n" + "\n".join(sorted(bad))

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(n == b or (n not in seen and reaches(n, b, seen | {n})) for n in edges.get(a, ()))

    circles = sorted(f for f in edges if reaches(f, f, {f}))
    assert not circles, f"native folders in a call circle: {circles} ({edges})"


def test_native_functions_are_named_for_their_files():
    defined, _ = _c_calls()
    bad = []
    for fn, f in defined.items():
        stem = Path(f).stem
        if f == "api.c":
            ok = fn.startswith("ktk_")
        elif f.startswith(ISA_DIRS):
            ok = fn.startswith("ktk_")
        else:
            ok = fn == f"ktki_{stem}" or fn.startswith(f"ktki_{stem}_")
        if not ok:
            bad.append(f"{f}: {fn}")
    assert not bad, ("native functions not named for their file (api.c: ktk_*; ISA kernels: ktk_*; else "
                     "ktki_<file>[_*]): " + "; ".join(sorted(bad)))
