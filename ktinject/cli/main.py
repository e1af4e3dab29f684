"""The ``ktinject`` command: ``ktinject chat|serve|eval|info|bench|calibrate|finetune [options]`` runs that program's
``main`` with the options (the same as ``python -m ktinject.<name> [options]``); ``ktinject --version`` prints the
version."""
from __future__ import annotations

import argparse
import importlib
import sys

from ktinject.cli.options import add_version


#: the ``ktinject`` command's subcommands: name -> (module whose main(argv) runs it, what it does)
COMMANDS = {
    "chat": ("ktinject.cli.chat", "chat with a model in the terminal"),
    "serve": ("ktinject.cli.serve", "serve a model with an OpenAI-compatible API"),
    "eval": ("ktinject.cli.eval", "perplexity and next-token agreement of the injected formats"),
    "info": ("ktinject.cli.info", "the CPU, the ISA chosen, the native library and the versions"),
    "bench": ("ktinject.bench.__main__", "benchmarks (ktinject bench NAME --help)"),
    "calibrate": ("ktinject.cli.calibrate", "expert statistics for hot-expert placement"),
    "finetune": ("ktinject.cli.finetune", "train a LoRA adapter (experts frozen on the CPU)"),
}


def main(argv: list[str] | None = None) -> int:
    """``ktinject COMMAND [options]``: COMMAND's ``main`` with the options (``python -m ktinject.COMMAND``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(
        prog="ktinject", description="ktinject: MoE models with the routed experts on the CPU.",
        epilog="commands:\n" + "\n".join(f"  {name:10s} {what}" for name, (_, what) in COMMANDS.items())
        + "\n\n`ktinject COMMAND --help` shows a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version(p)
    p.add_argument("command", choices=list(COMMANDS), metavar="COMMAND", help=", ".join(COMMANDS))
    p.add_argument("args", nargs=argparse.REMAINDER, help="the command's options")
    split = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    ns = p.parse_args(argv[:split + 1])  # the options before COMMAND, and COMMAND; the rest is COMMAND's
    module = importlib.import_module(COMMANDS[ns.command][0])
    rest = argv[split + 1:]
    if ns.command == "info":  # no options of its own
        if rest in (["-h"], ["--help"]):
            print(f"usage: ktinject info\n\n{COMMANDS['info'][1]}")
            return 0
        if rest:
            p.error(f"info takes no options, got {' '.join(rest)}")
        module.main()
        return 0
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
