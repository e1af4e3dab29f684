"""The eager MoE path's CPU task left running while the host goes on (prompts on the CPU path: ``HybridMoE._experts``).

A forward of T tokens through the native kernels held the host until the CPU's task was done, and only then did
the host queue the next layer's dense part (HF's attention of a prompt chunk: milliseconds of launches a layer),
so those launches ran after the experts instead of beside them. Where ``usable`` says so, the task raises a
pinned signal word once its output is written (``native.Task.signal``), a one-warp kernel waits for the word on the
stream before the output's copy to the device (``fused.wait_word``), and the host returns; the next MoE forward
waits for the task (raising its run's error) before it stages its own inputs (``settle``; by then the host has
queued that layer's attention and routing, the launches this is for), so the buffers the task used are free.
The model's last MoE block waits as before, and so does a block whose chain successor is on another device (that
device's stream would not be ordered after this one's wait). Every MoE forward settles what is left first, wherever
it runs (this path, graph decode's warm-up and capture, the deferral path, streamed prefill), and a failed run's
error is raised there, never dropped: a forward that stopped before its next block (an exception, an early exit)
leaves it to the next MoE forward. KTINJECT_PREFILL_OVERLAP=0 turns this off, with streamed prefill's
(``gpu_experts/prefill/split.py``). One stream, one forward at a time (as the staging buffers assume).
"""
from __future__ import annotations

import torch

from ktinject import envs, native
from ktinject.operators.kernels import common as fused

_LEFT: list = []  # [(task, block)]: the task left running, at most one (one forward at a time)
COUNTS = {"left": 0, "settled": 0}  # tasks left running / waited for by settle, since import (tests, probes)


def enabled() -> bool:
    """KTINJECT_PREFILL_OVERLAP (default 1), read per forward."""
    return envs.get("KTINJECT_PREFILL_OVERLAP")


def usable(block, x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``block``'s task for x may be left running: x on CUDA, the output buffer page-locked, the kernels
    available (Triton; ``fused.available``), a block of a linked chain (``deferral.link``) that is not its last and
    whose successor is on x's device."""
    chain = getattr(block, "defer_chain", None)
    if not (x.is_cuda and enabled() and out.is_pinned() and chain is not None and not chain.is_last(block)):
        return False
    nxt = chain.blocks[block.chain_pos + 1]
    return _same_device(getattr(nxt, "device", "cpu"), x.device) and fused.available(x)


def _same_device(a, b) -> bool:
    """Whether two devices are one ("cuda" is the current CUDA device)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def word(task: native.Task) -> torch.Tensor:
    """Pinned int32 [1]: ``task``'s signal word, made and registered on first use, reset to 0 for the next run."""
    w = task.__dict__.get("_overlap_word")
    if w is None:
        w = task.__dict__["_overlap_word"] = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        task.signal(w)
    w.zero_()
    return w


def leave(task: native.Task, block) -> None:
    """``block``'s submitted ``task`` is left running (its output's copy queued behind the wait kernel)."""
    _LEFT.append((task, block))
    COUNTS["left"] += 1


def settle() -> None:
    """Wait for the task left running, if any, raising its run's error (the forward that left it may have ended:
    the error then surfaces in the next MoE forward, not never)."""
    while _LEFT:
        task, _ = _LEFT.pop()
        COUNTS["settled"] += 1
        task.wait()
