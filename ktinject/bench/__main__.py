"""python -m ktinject.bench NAME [options]: run one registered benchmark (see ktinject.bench.BENCHES)."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from ktinject.bench import BENCHES


def _summary(module: str) -> str:
    """First docstring line of a benchmark module, read without importing it (no torch import for --help)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return ""
    import ast
    with open(spec.origin, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        prog="python -m ktinject.bench",
        description="ktinject benchmarks. `python -m ktinject.bench NAME --help` shows a benchmark's options.",
        epilog="benchmarks:\n" + "\n".join(f"  {n:10s} {_summary(m)}" for n, m in BENCHES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(BENCHES), metavar="NAME", help="benchmark: " + ", ".join(sorted(BENCHES)))
    ap.add_argument("args", nargs=argparse.REMAINDER, help="options of that benchmark")
    ns = ap.parse_args(argv[:1])
    module = importlib.import_module(BENCHES[ns.name])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
