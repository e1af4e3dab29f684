"""``ktinject finetune`` / ``python -m ktinject.finetune``: train a LoRA adapter on an injected model.

    ktinject finetune --model DIR --data chats.jsonl [--text notes.txt] --out ADAPTER_DIR [--steps N | --epochs E]

The loop is ``ktinject.train.loop`` (the routed experts frozen on the CPU, PEFT's adapters on the attention
projections by default), the data ``ktinject.train.data``. ``--model demo`` (or no --model) is the demo model and
``--text demo`` the packaged lighthouse text (docs/finetune.md). The adapter loads back with ``chat --lora DIR``,
``serve --lora DIR`` or ``from_pretrained(..., lora=DIR)``. A bad option or data file is one line on stderr, exit
code 2.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ktinject.cli import options as cli
from ktinject.cli.options import CliError, positive

PROG = "ktinject finetune"


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Train a LoRA adapter on an injected model (routed experts "
                                                       "frozen on the CPU).")
    cli.add_version(p)
    p.add_argument("--model", help="checkpoint directory, or 'demo' (default: the built-in demo model)")
    p.add_argument("--data", action="append", default=[], metavar="FILE.jsonl",
                   help='JSONL training data: {"messages": [...]} chats (loss on the assistant turns) or {"text": '
                        '...} lines; may be repeated')
    p.add_argument("--text", action="append", default=[], metavar="FILE.txt",
                   help="a plain text file to train on ('demo': the packaged lighthouse text); may be repeated")
    p.add_argument("--out", required=True, metavar="DIR", help="where the adapter is saved (PEFT's format)")
    p.add_argument("--seq-len", type=positive, default=256, help="tokens per packed sequence (default 256)")
    p.add_argument("--rank", type=positive, default=8, help="LoRA rank r (default 8)")
    p.add_argument("--alpha", type=_positive_float, default=16.0, help="LoRA alpha: scaling alpha / r (default 16)")
    p.add_argument("--dropout", type=_fraction, default=0.05, help="LoRA dropout (default 0.05)")
    p.add_argument("--target-modules", metavar="NAMES",
                   help="comma-separated module names to adapt, e.g. q_proj,v_proj; 'experts': the routed "
                        "experts' gate, up and down projections (per-expert adapters on the CPU) (default: every "
                        "linear projection of the attention modules)")
    p.add_argument("--lr", type=_positive_float, default=2e-4, help="learning rate of AdamW (default 0.0002)")
    p.add_argument("--steps", type=positive, help="optimizer steps (default: one epoch)")
    p.add_argument("--epochs", type=_positive_float, help="passes over the training blocks (instead of --steps)")
    p.add_argument("--batch", type=positive, default=4, help="sequences per micro-batch (default 4)")
    p.add_argument("--grad-accum", type=positive, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the adapters' initialization and the shuffle "
                                                       "(default 0)")
    p.add_argument("--eval-fraction", type=_fraction, default=0.1,
                   help="share of the sequences held out for perplexity before and after (default 0.1; 0: none)")
    p.add_argument("--save-every", type=positive, metavar="N", help="also save the adapter every N steps to "
                                                                    "OUT/checkpoint-N")
    p.add_argument("--save-merged", metavar="DIR", help="also write the checkpoint with the adapter merged to DIR")
    p.add_argument("--quant", choices=["bf16", "int8", "int4", "fp8", "mxfp4"],
                   help="format of the frozen routed experts (default: the checkpoint's own)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each layer's activations in the backward (less memory, more time)")
    p.add_argument("--threads", type=positive, help="CPU threads for the experts and for torch")
    p.add_argument("--gpu", help='device for the dense part (default "cuda" if available, else "cpu")')
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="logs and tracebacks")
    return p


def _model_dir(name: str | None) -> Path:
    if name in (None, "demo"):
        from ktinject.demo import demo_model_dir

        return demo_model_dir()
    path = Path(name).expanduser()
    if not path.is_dir():
        raise CliError(f"--model {name}: not a model directory")
    return path


def _text_files(names: list[str]) -> list[Path]:
    out = []
    for name in names:
        if name == "demo" and not Path(name).exists():
            from ktinject.demo import finetune_text

            out.append(finetune_text())
        else:
            out.append(Path(name).expanduser())
    return out


def config_from(args: argparse.Namespace, device: str):
    """The FinetuneConfig of the parsed options (a CliError for settings that cannot run)."""
    from ktinject.train.loop import FinetuneConfig, FinetuneError

    targets = [t.strip() for t in args.target_modules.split(",") if t.strip()] if args.target_modules else None
    try:
        return FinetuneConfig(
            model=_model_dir(args.model), out=Path(args.out).expanduser(), data=[Path(d) for d in args.data],
            text=_text_files(args.text), seq_len=args.seq_len, rank=args.rank, alpha=args.alpha,
            dropout=args.dropout, target_modules=targets, lr=args.lr, steps=args.steps, epochs=args.epochs,
            batch=args.batch, grad_accum=args.grad_accum, seed=args.seed, eval_fraction=args.eval_fraction,
            save_every=args.save_every, save_merged=args.save_merged, device=device, quant=args.quant,
            gradient_checkpointing=args.gradient_checkpointing)
    except FinetuneError as e:
        raise CliError(str(e)) from None


def _main(args: argparse.Namespace) -> int:
    if args.steps is not None and args.epochs is not None:
        raise CliError("give --steps or --epochs, not both")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if not args.verbose:
        cli.quiet_transformers()
    try:
        import peft  # noqa: F401
    except ImportError:
        raise CliError("fine-tuning needs PEFT: pip install 'ktinject[finetune]'") from None
    from ktinject.injection.lora import LoraError
    from ktinject.train.data import DataError
    from ktinject.train.loop import FinetuneError, finetune

    config = config_from(args, cli.device(args))
    try:
        finetune(config, progress=not args.no_progress and sys.stderr.isatty(),
                 report=lambda line: print(line, flush=True))
    except (DataError, FinetuneError, LoraError) as e:
        if args.verbose:
            raise
        raise CliError(str(e)) from None
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, _main, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
