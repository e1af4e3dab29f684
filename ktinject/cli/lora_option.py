"""``--lora DIR`` of the chat and the server: a PEFT LoRA adapter merged into the loaded model's weights.

``add_lora_option(parser)`` adds it; ``read_adapter(args)`` reads and checks the adapter before the model loads (a
bad directory fails at once); ``merge(model, adapter, args)`` merges it once the model is loaded, as
``from_pretrained(..., lora=DIR)`` does (``ktinject.injection.lora``): a mismatch with the model is a one-line
CliError (with -v the traceback).
"""
from __future__ import annotations

import argparse

from ktinject.cli.options import CliError


def add_lora_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", metavar="DIR",
                   help="a LoRA adapter (PEFT's format, e.g. from ktinject finetune) merged into the model's weights "
                        "at load")


def read_adapter(args: argparse.Namespace):
    """The adapter of --lora (None without it), checked before the model loads."""
    if getattr(args, "lora", None) is None:
        return None
    from ktinject.injection.lora import LoraError, read_adapter as read

    try:
        return read(args.lora)
    except LoraError as e:
        raise CliError(f"--lora {args.lora}: {e}") from None


def load_text(args: argparse.Namespace, merged: list[str]) -> str:
    """The load line's part about --lora (empty without one)."""
    if getattr(args, "lora", None) is None:
        return ""
    return f", LoRA {args.lora} ({len(merged)} modules)"


def merge(model, adapter, args: argparse.Namespace) -> list[str]:
    """Merge ``adapter`` (from ``read_adapter``) into the loaded ``model``; the merged modules' names."""
    if adapter is None:
        return []
    from ktinject.injection.lora import LoraError, merge_adapter

    try:
        return merge_adapter(model, adapter)
    except LoraError as e:
        if args.verbose:
            raise
        raise CliError(f"--lora {args.lora}: {e}") from None
