"""Triton kernels for the decode step on CUDA: chains of small kernels as one each; where the kernels run.

A decode step on the GPU is a chain of small dependent kernels, each costing its launch gap; with the routed
experts on the CPU that chain is on the step's critical path. The kernels live by topic: ``attention.py`` (q/k
norm + rotary + KV-cache write, attention over the static cache), ``dense.py`` (residual add + RMSNorm,
GEMV with the residual add), and here the router of the MoE operator and a copy between device and pinned host
memory:

- ``router_topk``: for each token, the router logits (programs of ``ROUTER_BLOCK_E`` experts of one warp each:
  the 128 x 2048 float32 weight of Qwen3-30B-A3B read by 128 programs), and in the program that finishes a
  token's logits last (an atomic counter per token) the top k by k rounds of argmax and the softmax of the k; optionally in the same kernel the
  routed-pair statistics (``counts[id] += 1``) and the copies the CPU experts need (hidden row, ids, weights)
  written straight into pinned host buffers (device-accessible under unified addressing): one kernel instead of
  logits, top-k, index_add and three device-to-host copies. With ``go`` the kernel also raises the CPU's go word
  (``ktinject.operators.handshake``) once every token's inputs are written: each token's last program counts the
  token done with a system-scope release (a fence making its own host writes, and those of the token's programs it
  acquired through the token's counter, visible to the CPU first: release is cumulative in PTX's memory model),
  and the one that counts last stores go = 1 after that atomic returned: the stream's write-value node a layer is
  gone. Without ``go`` the stream's write-value does it (it fences all earlier work of the stream).

- ``copy``: one tensor into another across device and pinned host memory (cast), optionally waiting for a
  pinned done word first (the kernel polls it: no wait node before it) and resetting it (the decode step's
  collect of the CPU experts' output).

Programmatic dependent launch (``pdl``; Hopper and later, KTINJECT_PDL=0 turns it off): every kernel of the decode
chain is launched so that it may start while the kernel before it still runs, and waits (``griddepcontrol.wait``,
which also makes that kernel's writes visible) before it reads or writes anything another kernel touches; before
the wait it reads only what no kernel writes (weights), so the GEMVs load their weight tiles while the kernel
before them (attention; the collect, which waits for the CPU) still runs. A kernel lets the next one start
(``griddepcontrol.launch_dependents``: the next one starts once every program of this one has said so or exited)
right after its own wait, or, in the GEMV, after its main loop (earlier, the next kernel's weight loads would
compete with this one's last wave for memory bandwidth). Two rules keep the chain ordered: every program of every
such kernel waits before it exits (even one with nothing to read), and triggers only after its wait. Then while
kernel n + 1 runs the code before its wait only kernel n can still be running, and n + 1's wait returns once n
has completed, n having waited for n - 1. A torch or cuBLAS kernel between two of ours is launched without the
attribute and waits for ours to complete; a copy, event or stream memory operation before one of ours is an
ordinary full dependency (only a kernel before a kernel overlaps). What a kernel reads before its wait must be
written by no kernel of the step: the callers pass static weights (``linear``, ``router_topk``).

"Last program" pattern (here and in attention.py): each program stores its part, ``tl.debug_barrier()`` (all its
threads' stores issued), then one acq_rel atomic increment of a counter; the program that sees count - 1 reads the
parts (``.cg``: not from L1) and finishes, then resets the counter to 0 for the next launch. Counters live in
per-device workspaces (``workspace``).

``available(t, head_dim)`` says where the kernels run; elsewhere torch ops run. Triton is imported at the first
call, not at import. With ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (tests/operators/test_fused_kernels.py).
Legend: T tokens, E experts, H hidden, k experts per token.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch

from ktinject import envs

log = logging.getLogger(__name__)


@functools.cache
def triton_language():
    """(triton, triton.language), or None when Triton is missing or broken here (torch ops run instead)."""
    try:
        import triton
        import triton.language as tl

        return triton, tl
    except Exception as e:  # ImportError, a Triton build that fails to load
        log.info("fused: Triton unavailable (%s); the decode step uses torch ops", e)
        return None


def interpreting() -> bool:
    """Triton's interpreter runs the kernels (on CPU tensors): set TRITON_INTERPRET=1 before the first kernel."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def on_device(t: torch.Tensor):
    """The context a launch for ``t`` runs in: Triton launches on the current CUDA device's current stream."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def define(build):
    """``build(triton, tl)``'s kernels, once per ``build`` (callers cache), or None without Triton."""
    tt = triton_language()
    if tt is None:
        return None
    try:
        return build(*tt)
    except Exception as e:  # sources missing for the JIT, an unsupported Triton release
        log.info("fused: Triton kernels unavailable (%s); the decode step uses torch ops", e)
        return None


_WORKSPACES: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown workspaces: graphs captured with them still write there


def workspace(name: str, numel: int, dtype: torch.dtype, device: torch.device, zero: bool = False) -> torch.Tensor:
    """A buffer of at least ``numel`` elements kept for the process, one per (name, dtype, device), made or grown
    only outside graph capture (graphs keep the addresses they saw, so an outgrown buffer is kept too). ``zero``:
    zeroed when made (the counters of the last-program pattern, which every launch leaves at zero). One per
    device, not per stream: ktinject's decode steps on a device run one after another."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one buffer, not two
        device = torch.device("cuda", torch.cuda.current_device())
    key = (name, dtype, str(device))
    buf = _WORKSPACES.get(key)
    if buf is None or buf.numel() < numel:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"fused: workspace {name!r} made during graph capture (run the step once first)")
        if buf is not None:
            _RETIRED.append(buf)
        buf = (torch.zeros if zero else torch.empty)(max(numel, 1), dtype=dtype, device=device)
        _WORKSPACES[key] = buf
    return buf


def available(t: torch.Tensor, head_dim: int | None = None) -> bool:
    """Whether the kernels can run for ``t``: on a CUDA device of compute capability >= 8.0 (bf16), Triton
    importable, no autograd to record (the kernels have no backward), KTINJECT_FUSED not 0 (read per call; a
    captured graph keeps what was chosen at capture); with ``head_dim``: an even one (rotary halves)."""
    if not t.is_cuda or not envs.get("KTINJECT_FUSED") or (torch.is_grad_enabled() and t.requires_grad):
        return False
    if head_dim is not None and (head_dim < 2 or head_dim % 2):
        return False
    return _capable(t.device.index if t.device.index is not None else torch.cuda.current_device()) and (
        _kernels() is not None)


@functools.cache
def _capable(device: int) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


def pow2(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor)."""
    return max(floor, 1 << (max(int(n), 1) - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """The kernels' tl.dot ``input_precision`` for operands of ``dtype``: no TF32 for float32 models."""
    return "ieee" if dtype == torch.float32 else "tf32"


def gdc_functions():
    """(griddepcontrol.wait, griddepcontrol.launch_dependents) as Triton functions, or (None, None) where this
    Triton has no grid dependency control (``pdl`` is then off; kernels reference them under ``PDL`` only)."""
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:
        return None, None
    return gdc_wait, gdc_launch_dependents


def pdl(t: torch.Tensor) -> bool:
    """Whether the decode chain's kernels for ``t`` launch with programmatic dependent launch: CUDA compute
    capability >= 9.0, a driver of CUDA >= 12.3, this Triton has grid dependency control, not interpreting,
    KTINJECT_PDL not 0 (read per launch; a captured graph keeps what its capture launched)."""
    if not t.is_cuda or not envs.get("KTINJECT_PDL") or interpreting():
        return False
    return _pdl_capable(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_kwargs(t: torch.Tensor) -> dict:
    """A decode-chain kernel's launch keywords for ``t``: the ``PDL`` constexpr and Triton's ``launch_pdl`` option
    where ``pdl(t)``, else none (a Triton without that launch option, older than 3.4, never sees it)."""
    return {"PDL": True, "launch_pdl": True} if pdl(t) else {}


#: the driver that captures programmatically dependent launches into CUDA graphs (CUDA 12.3); with an older one a
#: decode graph's capture would fail and every step run eagerly
PDL_MIN_DRIVER = 12030


@functools.cache
def _pdl_capable(device: int) -> bool:
    if torch.cuda.get_device_capability(device) < (9, 0) or gdc_functions()[0] is None:
        return False
    from ktinject.native import cuda_driver

    version = cuda_driver.driver_version()
    if version < PDL_MIN_DRIVER:
        log.info("fused: programmatic dependent launch off (CUDA driver %d.%d; graphs capture it from 12.3)",
                 version // 1000, version % 1000 // 10)
        return False
    return True


def _build(triton, tl):
    global gdc_wait, gdc_launch_dependents, router_x  # found through the module's globals by the jit (fused_dense)
    gdc_wait, gdc_launch_dependents = gdc_functions()

    @triton.jit
    def router_x(xrow, h, H, h_host, t, pe, STAGE: tl.constexpr):
        """Block h of token t's hidden row as float32; staged for the CPU experts by the token's first program."""
        xv = tl.load(xrow + h, mask=h < H, other=0.0)
        if STAGE:
            if pe == 0:  # the hidden row for the CPU experts, in the host buffer's dtype
                tl.store(h_host + t.to(tl.int64) * H + h, xv.to(h_host.dtype.element_ty), mask=h < H)
        return xv.to(tl.float32)

    @triton.jit
    def router_k(x, w, logits, w_out, i_out, cnt, counts, h_host, w_host, i_host, go, T, H, E, NPE, s_x,
                 K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_H: tl.constexpr, COUNT: tl.constexpr, STAGE: tl.constexpr, GO: tl.constexpr,
                 SCOPE: tl.constexpr = "gpu", PDL: tl.constexpr = False):
        t = tl.program_id(0)
        pe = tl.program_id(1)
        xrow = x + t.to(tl.int64) * s_x
        e = pe * BLOCK_E + tl.arange(0, BLOCK_E)
        h = tl.arange(0, BLOCK_H)  # the first block of the weights loaded before the wait (no kernel writes them)
        wv = tl.load(w + e[:, None] * H + h[None, :], mask=(e[:, None] < E) & (h[None, :] < H), other=0.0)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        acc = wv.to(tl.float32) * router_x(xrow, h, H, h_host, t, pe, STAGE)[None, :]
        for h0 in range(BLOCK_H, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            wv = tl.load(w + e[:, None] * H + h[None, :], mask=(e[:, None] < E) & (h[None, :] < H), other=0.0)
            acc += wv.to(tl.float32) * router_x(xrow, h, H, h_host, t, pe, STAGE)[None, :]
        tl.store(logits + t * E + e, tl.sum(acc, axis=1), mask=e < E)
        tl.debug_barrier()  # every thread's logits stored before the counter says so
        if tl.atomic_add(cnt + t, 1, sem="acq_rel", scope=SCOPE) == NPE - 1:  # the token's last program
            offs = tl.arange(0, BLOCK)
            slot = tl.arange(0, KP)
            lg = tl.load(logits + t * E + offs, mask=offs < E, other=float("-inf"), cache_modifier=".cg")
            top = tl.max(lg, axis=0)
            p = tl.zeros([KP], tl.float32)
            ids = tl.zeros([KP], tl.int64)
            for i in tl.static_range(K):  # the k largest, one at a time (ties: the lowest index first)
                m = tl.max(lg, axis=0)
                j = tl.argmax(lg, axis=0)
                p = tl.where(slot == i, tl.exp(m - top), p)
                ids = tl.where(slot == i, j.to(tl.int64), ids)
                lg = tl.where(offs == j, float("-inf"), lg)
            p = p / tl.sum(p, axis=0)
            tl.store(w_out + t * K + slot, p, mask=slot < K)
            tl.store(i_out + t * K + slot, ids, mask=slot < K)
            if STAGE:
                tl.store(w_host + t * K + slot, p.to(w_host.dtype.element_ty), mask=slot < K)
                tl.store(i_host + t * K + slot, ids, mask=slot < K)
            if COUNT:
                tl.atomic_add(counts + ids, tl.full([KP], 1, tl.int64), mask=slot < K)
            tl.atomic_xchg(cnt + t, 0)
            if GO:  # every token's inputs written (counter cnt[T]): raise the CPU's go word
                tl.debug_barrier()  # every thread's w_host / i_host stores before the release below
                if tl.atomic_add(cnt + T, 1, sem="acq_rel", scope="sys") == T - 1:
                    tl.atomic_xchg(cnt + T, 0)
                    tl.store(go, 1)

    return router_k


def _build_copy(triton, tl):
    global gdc_wait, gdc_launch_dependents
    gdc_wait, gdc_launch_dependents = gdc_functions()

    @triton.jit
    def copy_k(src, dst, flag, cnt, N, BLOCK: tl.constexpr, FLAG: tl.constexpr, WAIT: tl.constexpr,
               PDL: tl.constexpr = False):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        pid = tl.program_id(0)
        i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        if WAIT:  # poll the done word (volatile: LDG.STRONG.SYS; Triton drops the .cv), then read src (see copy)
            while tl.load(flag, volatile=True, cache_modifier=".cv") != 1:
                pass
            v = tl.load(src + i, mask=m, cache_modifier=".cv")
        else:
            v = tl.load(src + i, mask=m)
        tl.store(dst + i, v.to(dst.dtype.element_ty), mask=m)
        if FLAG:
            if WAIT:  # reset by the last program: every program has seen done == 1 by then
                tl.debug_barrier()
                if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
                    tl.atomic_xchg(cnt, 0)
                    tl.store(flag, 0)
            elif pid == 0:
                tl.store(flag, 0)

    @triton.jit
    def wait_k(word, RESET: tl.constexpr = False):
        # one program of one warp polls the pinned word: each poll is a read across PCIe, and one per program of a
        # wide kernel would compete with other transfers (streamed prefill's expert copies) for the link
        while tl.load(word, volatile=True, cache_modifier=".cv") != 1:
            pass
        if RESET:  # consumed: 0 again before any later kernel's write (PCIe keeps the GPU's writes in order)
            tl.store(word, 0)

    @triton.jit
    def raise_k(word):
        # after every earlier kernel of the stream: their writes to host memory are ahead of this one on the link
        tl.atomic_xchg(word, 1, sem="release", scope="sys")

    return copy_k, wait_k, raise_k


@functools.cache
def _kernels():
    return define(_build)


@functools.cache
def _copy_kernel():
    return define(_build_copy)


COPY_BLOCK, COPY_WARPS = 2048, 4


def copy(src: torch.Tensor, dst: torch.Tensor, flag: torch.Tensor | None = None, wait: bool = False) -> None:
    """dst = src cast to dst's dtype (bit-identical to ``dst.copy_(src)``), one launch on the current stream of the
    CUDA side's device, where either side may be page-locked host memory read or written in place (unified
    addressing); with ``flag`` (one int32 word of page-locked host memory) also flag[0] = 0 in the same kernel: the
    decode step's CPU output brought to the device and its done word reset (``operators.handshake``: one graph node in
    place of a write-value and a host-to-device copy); with ``wait`` too, the kernel first polls until flag[0] == 1
    (the CPU's done: no wait node before it; like that node it waits for as long as the word stays 0). Also moves
    streamed prefill's activations (``gpu_experts.prefill.host_io``).
    Ordering with ``wait`` (a review's finding): the poll is a relaxed volatile load and src's loads are
    plain ones issued after it (Triton emits no .cv): correct on today's GPUs, which do not issue a load before the
    branch it follows resolves, and whose L1 holds no line of src at the kernel's start; not an acquire in PTX's
    model (``ld.acquire.sys`` or ``fence.acq_rel.sys`` by inline asm would make it one: not yet timed on the GPU).
    The counters live in per-device workspaces: one decode step at a time on a device, as everywhere here."""
    if src.shape != dst.shape or not src.is_contiguous() or not dst.is_contiguous():
        raise ValueError(f"fused.copy: src {list(src.shape)} and dst {list(dst.shape)} must be contiguous and of one "
                         f"shape")
    if flag is not None and (flag.dtype != torch.int32 or flag.numel() != 1):
        raise ValueError(f"fused.copy: flag must be one int32 word, got {flag.dtype} x {flag.numel()}")
    if wait and flag is None:
        raise ValueError("fused.copy: wait=True needs the flag to wait on")
    n = src.numel()
    if n == 0 and flag is None:
        return
    dev = dst if dst.is_cuda else src
    cnt = workspace("copy_counter", 1, torch.int32, dev.device, zero=True) if wait else dst
    with on_device(dev):
        _copy_kernel()[0][(max(1, -(-n // COPY_BLOCK)),)](src, dst, dst if flag is None else flag, cnt, n,
                                                       BLOCK=COPY_BLOCK, FLAG=flag is not None, WAIT=bool(wait),
                                                       num_warps=COPY_WARPS, **pdl_kwargs(dev))


def _check_word(what: str, word: torch.Tensor, device: torch.device) -> None:
    if word.dtype != torch.int32 or word.numel() != 1 or word.device.type != "cpu" or (
            device.type == "cuda" and not word.is_pinned()):
        raise ValueError(f"fused.{what}: the word must be one pinned int32 word of host memory, got {word.dtype} "
                         f"x {word.numel()} on {word.device}{'' if word.is_pinned() else ', not pinned'}")


def wait_word(word: torch.Tensor, device: torch.device, reset: bool = False) -> None:
    """Queue on the current stream of ``device`` a kernel that waits until ``word`` (one int32 of page-locked host
    memory) is 1, e.g. a native task's signal that its output is written (``native.Task.signal``): work queued after
    it runs once the CPU is done, while the host goes on. The word is left as it is (its owner resets it), or with
    ``reset`` stored back to 0 by the kernel once seen (a watched task's done word: the host cannot tell when the
    stream has seen it). What the CPU wrote before raising the word is read by later kernels past the caches (.cv)
    or by copies."""
    device = torch.device(device)
    _check_word("wait_word", word, device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _copy_kernel()[1][(1,)](word, RESET=bool(reset), num_warps=1)


def raise_word(word: torch.Tensor, device: torch.device) -> None:
    """Queue on the current stream of ``device`` a kernel that stores 1 to ``word`` (one int32 of page-locked host
    memory) once every kernel queued before it is done: a watched native task's go (``native.Task.watch``), raised
    when its inputs have reached the host (their writes precede the word's on the link)."""
    device = torch.device(device)
    _check_word("raise_word", word, device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _copy_kernel()[2][(1,)](word, num_warps=1)


#: experts a program, warps a program: one expert of one warp a program (128 programs at Qwen3-30B-A3B's router)
#: beat two experts of four warps (docs/performance.md): the top-k's k rounds of argmax are shuffles within one
#: warp, no shared-memory round trips
ROUTER_BLOCK_E, ROUTER_WARPS = 1, 1
ROUTER_BLOCK_H = 1024  # hidden elements a step: half of Qwen3-30B-A3B's router row loaded before the wait (PDL)
_ROUTER_SCOPE = "gpu"  # the per-token counters' scope (the go one's "sys" release is cumulative); the go one's: "sys"


def router_topk(x: torch.Tensor, weight: torch.Tensor, k: int, counts: torch.Tensor | None = None,
                stage: tuple | None = None, go: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the k largest of x [T, H] @ weight [E, H] (float32, contiguous): (weights [T, k] float32, ids
    [T, k] int64), the ids in descending logit order, in one kernel. ``counts``: int64 [E] on x's device, += 1 per
    routed pair; ``stage``: (hidden [T, H], ids [T, k] int64, weights [T, k]) pinned host buffers (contiguous)
    that get copies of x, ids and weights, in their dtypes; ``go`` (with ``stage``): one pinned int32 word set to 1
    once all of them are written (the CPU experts' go, ``operators.handshake``). ``weight`` must be written by no kernel
    of the step (a parameter): the kernel reads it before its PDL wait (``pdl``)."""
    T, H = x.shape
    E = weight.shape[0]
    w = torch.empty((T, k), dtype=torch.float32, device=x.device)
    ids = torch.empty((T, k), dtype=torch.int64, device=x.device)
    if T == 0:
        return w, ids
    if x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError("router_topk: x needs a contiguous last dim and the router weight must be contiguous")
    if stage is not None and not (stage[0].shape == (T, H) and all(s.is_contiguous() for s in stage)
                                  and stage[1].shape == stage[2].shape == (T, k)):
        raise ValueError(f"router_topk: staging buffers must be contiguous [{T}, {H}], [{T}, {k}], [{T}, {k}]")
    if go is not None and (stage is None or go.dtype != torch.int32 or go.numel() != 1):
        raise ValueError(f"router_topk: go must be one int32 word and comes with stage, got {go.dtype} x "
                         f"{go.numel()}, stage {'given' if stage is not None else 'None'}")
    block_e = ROUTER_BLOCK_E
    npe = -(-E // block_e)
    logits = workspace("router_logits", T * E, torch.float32, x.device)
    cnt = workspace("router_counters", T + 1, torch.int32, x.device, zero=True)  # per token; [T]: tokens done
    h_host, i_host, w_host = stage if stage is not None else (x, ids, w)  # not written without STAGE
    with on_device(x):
        _kernels()[(T, npe)](x, weight, logits, w, ids, cnt, ids if counts is None else counts, h_host, w_host,
                             i_host, cnt if go is None else go, T, H, E, npe, x.stride(0), K=k, KP=pow2(k, 2),
                             BLOCK=pow2(E, 16), BLOCK_E=block_e, BLOCK_H=ROUTER_BLOCK_H, COUNT=counts is not None,
                             STAGE=stage is not None, GO=go is not None, SCOPE=_ROUTER_SCOPE, num_warps=ROUTER_WARPS,
                             **pdl_kwargs(x))
    return w, ids
