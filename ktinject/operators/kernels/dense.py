"""Triton kernels for the dense parts of a decode step around attention, each with its torch reference.

- ``add_rms_norm``: the decoder layer's ``residual + x`` and the RMSNorm of the sum in one kernel (one program
  per row), returning both (the sum is the next residual). Roundings as the modules: the sum rounded to the
  input dtype (torch's add), then ``round(x * rsqrt(mean(x^2) + eps) * w)`` (FusedRMSNorm's torch.rms_norm and
  GptOssRMSNorm: one rounding) or ``round(w * round(x * rsqrt(...)))`` (the other HF RMSNorm classes). Without a
  residual it is the norm alone; without a weight the sum alone. ``collect_add_rms_norm``: the same for one row
  whose x is the CPU experts' output still in pinned host memory, waiting for its done word first (the decode
  step's collect in the same launch).
- ``linear``: y = x @ W^T (+ bias) (+ residual) for a few rows (decode), W [N, K] streamed once by N / BN
  programs: for one row a multiply-add over [BN, BK] tiles summed at the end, for more rows a tensor-core
  product with the rows padded to 16. cuBLAS picks split-K for such shapes (o_proj of Qwen3-30B-A3B: 2048 x
  4096, a GEMV and a reduction kernel, before the residual add's own kernel); here the residual add is the
  epilogue (HF rounds the projection, then the sum: so does this). Which of cuBLAS and the Triton configs runs a
  shape is measured on the device on first use (``choose``), L2 flushed before each timed run as in a decode
  step, where the weights were evicted by the layers before: the kernel only where it beats cuBLAS.
Legend: B rows (batch), H hidden, N outputs, K inputs.
"""
from __future__ import annotations

import functools
import logging
import math
import statistics

import torch
import torch.nn.functional as F

from ktinject import envs
from ktinject.operators.kernels import common as fused
from ktinject.operators.kernels.common import on_device, pow2

log = logging.getLogger(__name__)


def _build(triton, tl):
    global rms_norm_row, gemv_tile  # a jit helper is found through the module's globals (not the closure)
    global gdc_wait, gdc_launch_dependents
    gdc_wait, gdc_launch_dependents = fused.gdc_functions()

    @triton.jit
    def gemv_tile(wrow, x, k0, nm, K, BK: tl.constexpr):
        """One row's products with the weight tile [BN, BK] at column k0, in float32."""
        k = k0 + tl.arange(0, BK)
        wv = tl.load(wrow + k[None, :], mask=nm[:, None] & (k < K)[None, :], other=0.0)
        xv = tl.load(x + k, mask=k < K, other=0.0)
        return wv.to(tl.float32) * xv.to(tl.float32)[None, :]

    @triton.jit
    def rms_norm_row(v, w, offs, inside, H, eps, dt: tl.constexpr, ROUND2: tl.constexpr):
        """RMSNorm of one float32 row v, in dt: one rounding, or two (ROUND2; see the module docstring)."""
        r = tl.rsqrt(tl.sum(v * v, axis=0) / H + eps)
        wv = tl.load(w + offs, mask=inside, other=0.0).to(tl.float32)
        if ROUND2:
            return ((v * r).to(dt).to(tl.float32) * wv).to(dt)
        return (v * r * wv).to(dt)

    @triton.jit
    def add_norm_k(x, res, w, s_out, n_out, H, eps, s_x, s_r, s_s, s_n, RES: tl.constexpr, NORM: tl.constexpr,
                   ROUND2: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BH)
        inside = offs < H
        dt = x.dtype.element_ty
        v = tl.load(x + row * s_x + offs, mask=inside, other=0.0).to(tl.float32)
        if RES:
            v = (v + tl.load(res + row * s_r + offs, mask=inside, other=0.0).to(tl.float32)).to(dt)
            tl.store(s_out + row * s_s + offs, v, mask=inside)
            v = v.to(tl.float32)
        if NORM:
            tl.store(n_out + row * s_n + offs, rms_norm_row(v, w, offs, inside, H, eps, dt, ROUND2), mask=inside)

    @triton.jit
    def collect_norm_k(host, flag, host2, flag2, x, res, w, s_out, n_out, H, eps, ROUND2: tl.constexpr,
                       BH: tl.constexpr, DEF: tl.constexpr = False, PDL: tl.constexpr = False):
        # add_norm_k (RES, NORM) for one row whose x is still in pinned host memory, ready once flag is 1 (a kernel
        # of its own: the wait in add_norm_k's code made ptxas spill its plain variant); ordering: fused.copy's.
        # DEF (expert deferral): x is host + host2 (the previous MoE layer's deferred experts, ready once flag2 is
        # 1), summed in x's dtype as the MoE block's `routed + prev` would.
        # With PDL the next layer's qkv GEMV starts now and loads its weights while this one waits for the CPU
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        offs = tl.arange(0, BH)
        inside = offs < H
        dt = x.dtype.element_ty
        while tl.load(flag, volatile=True, cache_modifier=".cv") != 1:
            pass
        v = tl.load(host + offs, mask=inside, other=0.0, cache_modifier=".cv").to(dt)
        if DEF:
            while tl.load(flag2, volatile=True, cache_modifier=".cv") != 1:
                pass
            p = tl.load(host2 + offs, mask=inside, other=0.0, cache_modifier=".cv").to(dt)
            v = (v.to(tl.float32) + p.to(tl.float32)).to(dt)
        tl.store(x + offs, v, mask=inside)  # as the collect's copy (and the add of the deferred part) would have
        tl.debug_barrier()  # every thread is past the wait (and has its x) before the word goes back to 0
        tl.store(flag, 0)
        if DEF:
            tl.store(flag2, 0)
        v = (v.to(tl.float32) + tl.load(res + offs, mask=inside, other=0.0).to(tl.float32)).to(dt)
        tl.store(s_out + offs, v, mask=inside)
        tl.store(n_out + offs, rms_norm_row(v.to(tl.float32), w, offs, inside, H, eps, dt, ROUND2), mask=inside)

    @triton.jit
    def linear_k(x, w, bias, res, out, nw, n_out, cnt, N, K, s_x, s_w, s_r, s_o, s_n, eps, NPROG, B: tl.constexpr,
                 BB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BIAS: tl.constexpr, RES: tl.constexpr,
                 NORM: tl.constexpr, ROUND2: tl.constexpr, BH: tl.constexpr, PREC: tl.constexpr,
                 RED: tl.constexpr = False, PDL: tl.constexpr = False):
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nm = n < N
        wrow = w + n[:, None].to(tl.int64) * s_w
        rows = tl.arange(0, BB)
        dt = out.dtype.element_ty
        if B == 1:  # the first tile loaded before the wait (weights: no kernel writes them), the rest after
            k = tl.arange(0, BK)
            wv = tl.load(wrow + k[None, :], mask=nm[:, None] & (k < K)[None, :], other=0.0)
            if PDL:
                gdc_wait()
            xv = tl.load(x + k, mask=k < K, other=0.0)
            first = wv.to(tl.float32) * xv.to(tl.float32)[None, :]
            if RED:  # each tile summed as it comes: [BN] accumulators, room for wide tiles
                acc1 = tl.sum(first, axis=1)
                for k0 in range(BK, K, BK):
                    acc1 += tl.sum(gemv_tile(wrow, x, k0, nm, K, BK), axis=1)
                acc = acc1[None, :] + tl.zeros([BB, BN], tl.float32)
            else:
                acc2 = first
                for k0 in range(BK, K, BK):
                    acc2 += gemv_tile(wrow, x, k0, nm, K, BK)
                acc = tl.sum(acc2, axis=1)[None, :] + tl.zeros([BB, BN], tl.float32)  # [BB, BN], row 0 real
        else:
            if PDL:
                gdc_wait()
            acc = tl.zeros([BB, BN], tl.float32)
            for k0 in range(0, K, BK):
                k = k0 + tl.arange(0, BK)
                wv = tl.load(wrow + k[None, :], mask=nm[:, None] & (k < K)[None, :], other=0.0)  # [BN, BK]
                xv = tl.load(x + rows[:, None] * s_x + k[None, :], mask=(rows < B)[:, None] & (k < K)[None, :],
                             other=0.0)  # [BB, BK]
                acc += tl.dot(xv, tl.trans(wv), input_precision=PREC)
        if PDL:  # the next kernel's programs may take SMs now: this one's are all started or done
            gdc_launch_dependents()
        if BIAS:
            acc += tl.load(bias + n, mask=nm, other=0.0).to(tl.float32)[None, :]
        y = acc.to(dt)  # the projection, rounded as F.linear's output
        om = (rows < B)[:, None] & nm[None, :]
        if RES:
            y = (y.to(tl.float32) + tl.load(res + rows[:, None] * s_r + n[None, :], mask=om, other=0.0)
                 .to(tl.float32)).to(dt)
        tl.store(out + rows[:, None] * s_o + n[None, :], y, mask=om)
        if NORM:  # the program that finishes last normalizes the rows (fused.py's last-program pattern)
            tl.debug_barrier()
            if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == NPROG - 1:
                offs = tl.arange(0, BH)
                inside = offs < N
                for b in tl.static_range(B):
                    v = tl.load(out + b * s_o + offs, mask=inside, other=0.0, cache_modifier=".cg").to(tl.float32)
                    tl.store(n_out + b * s_n + offs, rms_norm_row(v, nw, offs, inside, N, eps, dt, ROUND2), mask=inside)
                tl.atomic_xchg(cnt, 0)

    return add_norm_k, linear_k, collect_norm_k


@functools.cache
def _kernels():
    return fused.define(_build)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                 round_twice: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(residual + x, RMSNorm of it) for x [..., H] (last dims contiguous): (x itself when ``residual`` is None,
    None when ``weight`` is None). ``round_twice``: the HF RMSNorm classes' rounding (see the module docstring)."""
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    R = x2.shape[0]
    s = x2 if residual is None else torch.empty_like(x2)
    y = None if weight is None else torch.empty_like(x2)
    r2 = x2 if residual is None else residual.reshape(-1, H)
    if x2.stride(-1) != 1 or r2.stride(-1) != 1:
        raise ValueError("add_rms_norm: x and residual need a contiguous last dim")
    if R:
        with on_device(x):
            _kernels()[0][(R,)](x2, r2, x2 if weight is None else weight, s, x2 if y is None else y, H, float(eps),
                                x2.stride(0), r2.stride(0), s.stride(0), H, RES=residual is not None,
                                NORM=weight is not None, ROUND2=bool(round_twice), BH=pow2(H, 16),
                                num_warps=4 if H <= 2048 else 8, **fused.pdl_kwargs(x))
    return x if residual is None else s.view(x.shape), None if y is None else y.view(x.shape)


def collect_add_rms_norm(host: torch.Tensor, flag: torch.Tensor, x: torch.Tensor, residual: torch.Tensor,
                         weight: torch.Tensor, eps: float, round_twice: bool = False,
                         deferred: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """``add_rms_norm(x, residual, weight, ...)`` for one row whose x is still in pinned host memory: the kernel
    waits until ``flag`` (one pinned int32 word) is 1, writes ``x`` = host cast to x's dtype (what
    ``fused.copy`` would have), then the sum and its norm as add_rms_norm, and sets flag to 0: the decode step's
    collect of the CPU experts' output and the residual add + next norm as one launch (``operators.handshake``).
    ``deferred`` = (host2, flag2), expert deferral: x is host + host2 instead (each cast to x's dtype, summed and
    rounded to it: the MoE block's ``routed + prev``), host2 read once flag2 is 1, which goes back to 0 too.
    host, host2 [1, H] (float32 or x's dtype), x and residual [1, H] of the model's dtype on the device."""
    H = x.shape[-1]
    host2, flag2 = deferred if deferred is not None else (host, flag)
    if host.numel() != H or host2.numel() != H or x.numel() != H or residual.numel() != H or not (
            host.is_contiguous() and host2.is_contiguous() and x.is_contiguous() and residual.is_contiguous()):
        raise ValueError(f"collect_add_rms_norm: one contiguous row of H={H} each, got host {list(host.shape)}, "
                         f"host2 {list(host2.shape)}, x {list(x.shape)}, residual {list(residual.shape)}")
    for f in (flag, flag2):
        if f.dtype != torch.int32 or f.numel() != 1:
            raise ValueError(f"collect_add_rms_norm: flags must be one int32 word, got {f.dtype} x {f.numel()}")
    s, y = torch.empty_like(x), torch.empty_like(x)
    with on_device(x):
        _kernels()[2][(1,)](host, flag, host2, flag2, x, residual, weight, s, y, H, float(eps),
                            ROUND2=bool(round_twice), BH=pow2(H, 16), DEF=deferred is not None,
                            num_warps=4 if H <= 2048 else 8, **fused.pdl_kwargs(x))
    return s, y


#: candidate (BN, BK, warps[, RED]) for one row and for a few rows. One row: the configs that came out best in a
#: sweep of cold GEMVs of Qwen3-30B-A3B's qkv (5120 x 2048) and o_proj (2048 x 4096 + residual + norm); those that
#: were never the best are not listed (the sweep: docs/history/performance-log.md). Wide tiles also load more of
#: the weights before a launch's wait (fused.pdl)
CONFIGS_1 = ((16, 512, 4), (4, 2048, 4), (8, 512, 4), (16, 1024, 8), (8, 2048, 8), (2, 4096, 4, True),
             (2, 2048, 2, True))
CONFIGS_N = ((32, 128, 4), (64, 128, 4), (16, 256, 4))
_CHOICE: dict[tuple, tuple | None] = {}  # shape key -> config, or None for cuBLAS
#: what a one-row kernel gains inside the decode chain over its time alone, where PDL is on: it starts while the
#: kernel before it (the collect, waiting for the CPU) runs and loads its first weight tile then, which a timing in
#: isolation does not see. For Qwen3-30B-A3B's q/k/v in the decode graph that gain was about this much a layer,
#: where the timing alone had picked cuBLAS in some runs and the kernel in others (docs/performance.md). Given to
#: one-row projections without a residual or a norm (q/k/v's shape: o_proj's, with its norm fused, had the kernel
#: already) where no config has the first tile ``decide`` wants (``pick``'s first_tile)
PDL_CREDIT_US = 3.0
MEASURE_FROM = 1 << 20  # weights smaller than this stay with cuBLAS unmeasured (launch-bound either way)
WHOLE_ROW_BYTES = 64 << 20  # ``pick``'s first-tile rule up to this (about a Hopper GPU's registers + shared memory)
WHOLE_ROW_SLACK = 2.0  # ... for a config at most this many times cuBLAS's time alone (a guard for untried shapes)
#: the first tile's width (BK) ``decide`` wants of a one-row projection in the PDL chain: the whole row up to this.
#: In decode graphs with the choice forced, o_proj (2048 x 4096 + residual + norm) ran fastest with a first tile
#: 2048 wide: loading all of K first (after attention the wait is shorter), narrower tiles and cuBLAS + the norm's
#: kernel were slower, and timings alone picked a different config from one process to another
#: (docs/performance.md).
FIRST_TILE_K = 2048


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                  config: tuple, norm: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x [B, K] @ weight [N, K]^T (+ bias [N]) (+ residual [B, N]), its RMSNorm or None) by the kernel with
    ``config`` (BN, BK, warps[, RED]: one row's tiles summed as they come, for wide tiles); ``norm``: (weight [N],
    eps, round_twice) as ``add_rms_norm``, computed by the program that finishes last."""
    B, K = x.shape
    N = weight.shape[0]
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("linear: x, weight and residual need contiguous last dims")
    out = torch.empty((B, N), dtype=x.dtype, device=x.device)
    normed = None if norm is None else torch.empty_like(out)
    BN, BK, warps, *red = config
    r = residual if residual is not None else out
    nw, eps, round2 = norm if norm is not None else (out, 0.0, False)
    cnt = fused.workspace("linear_counter", 1, torch.int32, x.device, zero=True) if norm is not None else out
    nprog = -(-N // BN)
    bh = pow2(N, 16) if norm is not None else 16  # the norm's block only: one compile for the shapes without one
    with on_device(x):
        _kernels()[1][(nprog,)](x, weight, weight if bias is None else bias, r, out, nw, out if normed is None else
                                normed, cnt, N, K, x.stride(0), weight.stride(0), r.stride(0), out.stride(0),
                                out.stride(0), float(eps), nprog, B=B, BB=1 if B == 1 else pow2(B, 16), BN=BN, BK=BK,
                                BIAS=bias is not None, RES=residual is not None, NORM=norm is not None,
                                ROUND2=bool(round2), BH=bh, PREC=fused.dot_precision(x.dtype),
                                RED=bool(red and red[0]) and B == 1, num_warps=warps, **fused.pdl_kwargs(x))
    return out, normed


def linear_torch(x, weight, bias, residual):
    """The reference: F.linear (cuBLAS on CUDA), then the residual add, as HF's modules do."""
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, norm: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """((residual +) x [B, K] @ weight^T (+ bias), the RMSNorm of that or None) by whichever of cuBLAS and the
    kernel ``choose`` measured faster for this shape on this device (cuBLAS off CUDA, for weights under
    ``MEASURE_FROM`` elements, during capture before any measurement and with KTINJECT_GEMV=torch;
    KTINJECT_GEMV=triton: the kernel's first config, no measurement). ``norm``: (weight, eps, round_twice): the
    kernel normalizes the result too (its last program); with cuBLAS the norm comes back None (the caller's).
    ``weight`` must be written by no kernel of the step (a parameter): the kernel reads it before its PDL wait."""
    config = choose(x, weight, bias, residual, norm) if fused.available(x) else None
    if config is None:
        return linear_torch(x, weight, bias, residual), None
    return linear_triton(x, weight, bias, residual, config, norm)


def choose(x, weight, bias, residual, norm=None) -> tuple | None:
    """The kernel config for this shape, or None for cuBLAS: measured once per shape and device outside graph
    capture (during capture, before any measurement: cuBLAS)."""
    B, K = x.shape
    mode = envs.get("KTINJECT_GEMV")
    configs = CONFIGS_1 if B == 1 else CONFIGS_N
    if mode == "torch" or B > 16 or (mode != "triton" and weight.numel() < MEASURE_FROM):
        return None
    if mode == "triton":
        return configs[0]
    key = (B, weight.shape[0], K, x.dtype, bias is not None, residual is not None, norm is not None, str(x.device))
    if key not in _CHOICE:
        if torch.cuda.is_current_stream_capturing():
            return None
        _CHOICE[key] = _measure(x, weight, bias, residual, norm, configs)
    return _CHOICE[key]


def choices_line(rows: int = 1) -> str:
    """The measured choice of each shape of ``rows`` rows, for a benchmark's note ("N x K [+ residual][+ norm]:
    cuBLAS | (BN, BK, warps[, RED])", by descending weight size), or "none measured": the GPU part of a decode step
    moves with them."""
    # one sort, by weight size only: two keys of one shape (another dtype or bias) would compare their choices,
    # None against a tuple
    got = sorted(((k[1], k[2], k[5], k[6], c) for k, c in _CHOICE.items() if k[0] == rows),
                 key=lambda g: -g[0] * g[1])
    if not got:
        return "none measured"
    return "; ".join(f"{n} x {k}{' + residual' if res else ''}{' + norm' if norm else ''}: "
                     f"{'cuBLAS' if c is None else c}" for n, k, res, norm, c in got)


def _fastest_kernel(times: dict) -> tuple | None:
    """The kernel config of ``times`` (config -> median time; None: cuBLAS) with the least time, or None."""
    return min((c for c in times if c is not None), key=times.get, default=None)


def pick(times: dict, credit: float = 0.0, first_tile: int | None = None) -> tuple | None:
    """From ``times`` (config -> median time; None: cuBLAS), the fastest kernel config where its time less
    ``credit`` (PDL_CREDIT_US, same unit) is at most cuBLAS's, else None (cuBLAS). ``first_tile`` (a width, for a
    one-row projection in the PDL chain whose weights the SMs can hold, ``decide``): the fastest config whose
    first tile is that wide (BK == first_tile) where there is one within WHOLE_ROW_SLACK x cuBLAS's time. Such a
    kernel loads that much of its weights during the wait of the kernel before it, and no timing alone predicts the
    chain: in decode graphs with the choice forced, q/k/v ran fastest with BK = K, ahead of cuBLAS and of
    narrower or wider-warped configs, while timings alone picked cuBLAS in most processes even with credit
    (docs/performance.md); o_proj's: FIRST_TILE_K."""
    if first_tile is not None:
        cap = WHOLE_ROW_SLACK * times[None] if None in times else math.inf
        wide = {c: t for c, t in times.items() if c is not None and c[1] == first_tile and t <= cap}
        if wide:
            return min(wide, key=wide.get)
    kernel = _fastest_kernel(times)
    if kernel is None or (None in times and times[kernel] - credit > times[None]):
        return None
    return kernel


def decide(times_ms: dict, one_row_pdl: bool, K: int, weight_bytes: int, epilogue: bool = False) -> tuple | None:
    """``pick`` for ``_measure``'s medians (ms). A one-row projection where PDL is on (``one_row_pdl``): the first
    tile min(K, FIRST_TILE_K) wide where the weights are at most WHOLE_ROW_BYTES (what the SMs can load during a
    wait: q/k/v and o_proj, not an LM head, whose timing alone is its time in the chain), else PDL_CREDIT_US of
    credit; no credit with a residual or norm fused (``epilogue``: cuBLAS's time then includes their kernel).
    Plain otherwise."""
    if not one_row_pdl:
        return pick(times_ms)
    return pick(times_ms, 0.0 if epilogue else PDL_CREDIT_US / 1e3, first_tile(K, weight_bytes))


def first_tile(K: int, weight_bytes: int) -> int | None:
    """The first tile's width ``decide`` wants of a one-row projection in the PDL chain: min(K, FIRST_TILE_K), or
    None where the weights are past WHOLE_ROW_BYTES (more than the SMs load during a wait)."""
    return min(K, FIRST_TILE_K) if weight_bytes <= WHOLE_ROW_BYTES else None


def _measure(x, weight, bias, residual, norm, configs, reps: int = 15) -> tuple | None:
    """Median GPU time of cuBLAS (with the norm kernel after it where ``norm`` is asked for) and of each config,
    each run after a 256 MiB write that evicts L2 (and keeps the GPU busy while the run is queued, so launch time
    does not count); the fastest (``pick``), None for cuBLAS."""
    try:
        flush = torch.empty(256 << 20, dtype=torch.uint8, device=x.device)
    except torch.cuda.OutOfMemoryError:
        log.info("fused_dense: no room to measure the linear kernels (256 MiB); cuBLAS runs")
        return None

    def run(c):
        if c is not None:
            return linear_triton(x, weight, bias, residual, c, norm)[0]
        y = linear_torch(x, weight, bias, residual)
        if norm is not None:
            add_rms_norm(y, None, *norm)
        return y

    cands = [None, *configs]
    times: dict = {c: [] for c in cands}
    want = run(None).float()
    for c in configs:  # compile each, and drop one that fails or disagrees with cuBLAS
        try:
            got = run(c).float()
        except Exception as e:  # noqa: BLE001 - a config this GPU cannot compile (resources): skip it, not the decode
            log.info("fused_dense: linear config %s unavailable here: %s", c, e)
            cands.remove(c)
            continue
        if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
            log.warning("fused_dense: linear config %s disagrees with cuBLAS; not used", c)
            cands.remove(c)
    for _ in range(reps):
        for c in cands:
            flush.zero_()
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            run(c)
            t1.record()
            times[c].append((t0, t1))
    torch.cuda.synchronize(x.device)
    med = {c: statistics.median(a.elapsed_time(b) for a, b in times[c]) for c in cands}  # (dropped: not timed)
    one_row, epilogue = x.shape[0] == 1 and fused.pdl(x), residual is not None or norm is not None
    credit = PDL_CREDIT_US / 1e3 if one_row and not epilogue else 0.0
    K, nbytes = weight.shape[1], weight.numel() * weight.element_size()
    best = decide(med, one_row, K, nbytes, epilogue)
    kernel = _fastest_kernel(med)
    wide = first_tile(K, nbytes) if one_row else None
    tile = f", first tile {wide} wanted" if wide is not None else ""
    log.info("fused_dense: linear %s x %s%s: cuBLAS %.1f us, best kernel %s %.1f us (PDL credit %.1f us%s); using %s",
             tuple(x.shape), tuple(weight.shape), " + norm" if norm else "", med[None] * 1e3, kernel,
             med[kernel] * 1e3 if kernel is not None else float("nan"), credit * 1e3, tile,
             "cuBLAS" if best is None else best)
    return best
