"""The eager MoE path's CPU task left running while the host goes on (prompts on the CPU path: ``HybridMoE._experts``).

A forward of T tokens through the native kernels held the host until the CPU's task was done, and only then did
the host queue the next layer's dense part (HF's attention of a 512-token chunk: ~2 ms of launches a layer on the
H100), so those launches ran after the experts instead of beside them. Where ``usable`` says so, the task raises a
pinned signal word once its output is written (``native.Task.signal``), a one-warp kernel waits for the word on the
stream before the output's copy to the device (``fused.wait_word``), and the host returns; the next MoE block's
forward waits for the task (raising its run's error) once its own routing sync has passed that copy (``settle``),
so the staging buffers the task used are free by then. The model's last MoE block waits as before: nothing after it
would raise a failed run's error. KTINJECT_PREFILL_OVERLAP=0 turns this off, with streamed prefill's
(``gpu_experts/split.py``). One stream a device, one forward at a time (as the staging buffers assume).
"""
from __future__ import annotations

import logging
import os

import torch

from ktinject import native
from ktinject.operators import fused

log = logging.getLogger(__name__)

_LEFT: dict[str, tuple] = {}  # device -> (task, block) of the forward left running there


def enabled() -> bool:
    """KTINJECT_PREFILL_OVERLAP (default 1), read per forward."""
    return os.environ.get("KTINJECT_PREFILL_OVERLAP", "1") != "0"


def usable(block, x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``block``'s task for x may be left running: x on CUDA, the output buffer page-locked, the kernels
    available (Triton; ``fused.available``), a block of a linked chain (``deferral.link``) that is not its last."""
    chain = getattr(block, "defer_chain", None)
    return (x.is_cuda and enabled() and out.is_pinned() and chain is not None and not chain.is_last(block)
            and fused.available(x))


def word(task: native.Task) -> torch.Tensor:
    """Pinned int32 [1]: ``task``'s signal word, made and registered on first use, reset to 0 for the next run."""
    w = task.__dict__.get("_overlap_word")
    if w is None:
        w = task.__dict__["_overlap_word"] = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        task.signal(w)
    w.zero_()
    return w


def leave(device: torch.device, task: native.Task, block) -> None:
    """``block``'s submitted ``task`` is left running on ``device`` (its output's copy queued behind the wait)."""
    _LEFT[str(device)] = (task, block)


def settle(device: torch.device, block) -> None:
    """Wait for the task left running on ``device``, if any: its error raised where it was the block before
    ``block`` in the chain, logged where it belonged to an abandoned forward (another position)."""
    left = _LEFT.pop(str(device), None)
    if left is None:
        return
    task, prev = left
    chain = getattr(block, "defer_chain", None)
    if chain is None or prev.defer_chain is not chain or prev.chain_pos != block.chain_pos - 1:
        try:
            task.wait()
        except native.NativeError as e:
            log.warning("moe: the CPU task of an abandoned forward (%s) failed: %s", prev.class_name, e)
        return
    task.wait()
