"""cffi builder of the native core: module ``ktinject.native._core`` (API mode; calls release the GIL).

The cdef is derived from ``native/include/ktinject.h`` at build time, so the header stays the single source: comments
and preprocessor lines are dropped, ``#define NAME <integer expression>`` lines are evaluated to integers (cffi only
takes literal values), and ``#ifdef __cplusplus`` blocks are skipped. Sources are every ``native/src/**/*.c``; the
ISA files carry their own ``#pragma GCC target`` / target attributes, so one build with plain flags (no
-march=native) holds every variant. Extra flags: ``KTINJECT_CFLAGS`` (split on spaces).

Used by setuptools through ``cffi_modules`` in pyproject.toml; ``python ktinject/native/build.py`` builds in place.
"""
from __future__ import annotations

import ast
import operator
import os
import re
from pathlib import Path

from cffi import FFI

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file: ktinject/native/build.py)
HEADER = ROOT / "native" / "include" / "ktinject.h"

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_INT_SUFFIX = re.compile(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b")
_BINOPS = {ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitOr: operator.or_,
           ast.BitAnd: operator.and_, ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _eval_int(expr: str, known: dict[str, int]) -> int | None:
    """Value of a C integer constant expression made of literals, earlier defines and << >> | & + - *; else None."""
    try:
        tree = ast.parse(_INT_SUFFIX.sub(r"\1", expr.strip()), mode="eval")
    except SyntaxError:
        return None

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in known:
            return known[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(ast.dump(node))

    try:
        return ev(tree.body)
    except ValueError:
        return None


def cdef_from_header(text: str) -> str:
    """The header's declarations in the form cffi's cdef takes."""
    text = _COMMENT.sub(" ", text)
    out: list[str] = []
    known: dict[str, int] = {}
    skip_depth = 0  # inside #ifdef __cplusplus
    depth = 0
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#"):
            directive = s[1:].strip()
            if directive.startswith(("if", "ifdef", "ifndef")):
                depth += 1
                if skip_depth == 0 and "__cplusplus" in directive:
                    skip_depth = depth
            elif directive.startswith("endif"):
                if skip_depth == depth:
                    skip_depth = 0
                depth -= 1
            elif directive.startswith("define") and skip_depth == 0:
                parts = directive.split(None, 2)
                if len(parts) == 3 and "(" not in parts[1]:
                    value = _eval_int(parts[2], known)
                    if value is not None:
                        known[parts[1]] = value
                        out.append(f"#define {parts[1]} {value}")
            continue
        if skip_depth == 0 and s:
            out.append(line)
    return "\n".join(out) + "\n"


def _sources() -> list[str]:
    """native/src/**/*.c, relative to the working directory when possible (setuptools prefers relative paths)."""
    files = sorted((ROOT / "native" / "src").rglob("*.c"))
    cwd = Path.cwd().resolve()
    return [os.path.relpath(f, cwd) if f.is_relative_to(cwd) else str(f) for f in files]


def _rel(p: Path) -> str:
    cwd = Path.cwd().resolve()
    return os.path.relpath(p, cwd) if p.is_relative_to(cwd) else str(p)


def make_builder() -> FFI:
    ffi = FFI()
    ffi.cdef(cdef_from_header(HEADER.read_text()))
    flags = ["-O3", "-std=c11", "-pthread", "-fno-strict-aliasing", "-Wall"]
    flags += os.environ.get("KTINJECT_CFLAGS", "").split()
    ffi.set_source(
        "ktinject.native._core",
        '#include "ktinject.h"\n',
        sources=_sources(),
        include_dirs=[_rel(ROOT / "native" / "include"), _rel(ROOT / "native" / "src")],
        extra_compile_args=flags,
        extra_link_args=["-pthread"],
        libraries=["m"],
    )
    return ffi


ffibuilder = make_builder()

if __name__ == "__main__":
    os.chdir(ROOT)
    ffibuilder.compile(tmpdir=str(ROOT), verbose=True)
