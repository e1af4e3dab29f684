"""A split prefill layer's activations between the GPU and page-locked host memory moved by kernels, not by copies
(streamed prefill).

Why: a split or ahead layer copies its GPU experts host-to-device on the ring's copy stream (hundreds of MB) while
the CPU computes the rest. The small copies of the layer's own activations (its inputs device-to-host
for the CPU, the CPU's output host-to-device) queued behind those expert copies on the copy engines: each layer's
routing sync returned only when the next layer's expert copy had ended (timeline of benchmarks/probe_split.py,
int8 512 tokens), so the copies could not run during the host's own work of a layer. Kernels that read and write
the pinned buffers directly (device-accessible under unified addressing, as ``operators.fused.router_topk``
writes the decode step's) use the SMs and the PCIe bandwidth the expert copies leave, not a copy engine.

    to_host(src, dst)                              dst (pinned host) = src (device), cast to dst's dtype
                                                   (operators.fused.copy's kernel)
    combine(o, streamed, extra, dtype, done=None)  on the device: ((extra + streamed) + o as dtype) as dtype, the
      -> [T, H]                                    sum ``split.total`` forms from o copied to the device; with the
                                                   CPU task's done word, after a one-warp kernel has seen it raised
                                                   (the host need not wait for the task: ``split``'s overlap)

Both bit-identical to the copies they replace. Triton is imported at the first call. Legend: T tokens, H hidden.
"""
from __future__ import annotations

import functools

import torch

from ktinject import envs
from ktinject.operators.kernels import common as fused

BLOCK, WARPS = fused.COPY_BLOCK, fused.COPY_WARPS


def _build(triton, tl):
    @triton.jit
    def combine_k(o, s, e, out, N, HAS_S: tl.constexpr, HAS_E: tl.constexpr, FRESH: tl.constexpr,
                  BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        if FRESH:  # o written by the CPU since the last kernel read it: read past the caches (fused.copy's)
            routed = tl.load(o + i, mask=m, cache_modifier=".cv").to(out.dtype.element_ty)
        else:
            routed = tl.load(o + i, mask=m).to(out.dtype.element_ty)  # as copied into the output dtype
        if HAS_S and HAS_E:
            acc = tl.load(e + i, mask=m) + tl.load(s + i, mask=m)
        elif HAS_S:
            acc = tl.load(s + i, mask=m)
        elif HAS_E:
            acc = tl.load(e + i, mask=m)
        if HAS_S or HAS_E:
            tl.store(out + i, (acc + routed.to(tl.float32)).to(out.dtype.element_ty), mask=m)
        else:
            tl.store(out + i, routed, mask=m)

    return combine_k


@functools.cache
def _kernels():
    return fused.define(_build)


def usable(device: torch.device, *host: torch.Tensor) -> bool:
    """Whether the kernels can serve a CUDA ``device`` with these ``host`` buffers: page-locked and contiguous,
    Triton importable, KTINJECT_FUSED not 0 (read per call)."""
    if torch.device(device).type != "cuda" or not envs.get("KTINJECT_FUSED"):
        return False
    if not all(t.is_pinned() and t.is_contiguous() for t in host):
        return False
    return _kernels() is not None


def _grid(n: int) -> tuple[int]:
    return (max(1, -(-n // BLOCK)),)


def to_host(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst = src cast to dst's dtype (as ``dst.copy_(src)``), one launch on the current stream of src's device; src
    on the device, dst pinned host memory of the same shape (both contiguous). The host may read dst once the
    stream has passed this (an event)."""
    fused.copy(src, dst)  # (checks the shapes)


def combine(o: torch.Tensor, streamed: torch.Tensor | None, extra: torch.Tensor | None, dtype: torch.dtype,
            device: torch.device, done: torch.Tensor | None = None, reset: bool = False) -> torch.Tensor:
    """[T, H] of ``dtype`` on ``device``: the CPU experts' output ``o`` (pinned host, [T, H]) read in place, plus
    the float32 [T, H] ``streamed`` and ``extra`` (either may be None) on the device, summed in split.total's
    order: ((extra + streamed) + o as dtype), rounded once to dtype. ``done`` (one pinned int32 word): a kernel of
    one warp first waits until it is 1, the CPU task's signal that ``o`` is written (``native.Task.signal``), so
    the host need not wait for the task; the word is left as it is (its owner resets it before the next submit), or
    with ``reset`` stored back to 0 by the waiting kernel (a watched task's done word: ``fused.wait_word``)."""
    out = torch.empty(o.shape, dtype=dtype, device=device)
    n = o.numel()
    if streamed is None and extra is None and done is None:  # nothing to add: o as dtype
        fused.copy(o, out)
        return out
    for t in (streamed, extra):
        if t is not None and (t.shape != o.shape or t.dtype != torch.float32 or not t.is_contiguous()):
            raise ValueError(f"hostio.combine: the device parts must be contiguous float32 {list(o.shape)}, got "
                             f"{t.dtype} {list(t.shape)}")
    if done is not None:
        fused.wait_word(done, out.device, reset=reset)
    with fused.on_device(out):
        if n:
            s = streamed if streamed is not None else (extra if extra is not None else o)
            e = extra if extra is not None else s
            _kernels()[_grid(n)](o, s, e, out, n, HAS_S=streamed is not None, HAS_E=extra is not None,
                                FRESH=done is not None, BLOCK=BLOCK, num_warps=WARPS)
    return out
