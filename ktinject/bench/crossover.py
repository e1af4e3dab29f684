"""Crossover sweep of the kernels bench: the few-token path (ISA avx512) against the many-token path (ISA amx) by
rows per expert, and the dispatcher's threshold next to the measured crossover.

Routing: every one of the E' built experts gets exactly `rows` rows: T = rows * E' / k tokens, token t routed to
experts (t k + j) mod E', j < k (k distinct experts per token since k divides E'). Each forward reads every built
expert once (E' x gate+up+down in the stored format: cache-cold when that is several times the LLC).
Figures per (quant, ISA, rows): TFLOPS (TOPS for integer quants) = 2 T k 3 H I / time, GB/s = stored bytes of the E'
experts / time, time of one forward (median).

The amx ISA dispatches by rows inside each call: below its threshold (AMX_MIN_ROWS) it runs the same AVX-512
kernels, so there both columns time the same code (their ratio shows the run's noise), and a crossover below the
threshold cannot show. The raw tile entry points (ktk_amx_gemm_*_tiles) are not exported by the native module; the
sweep times the dispatched path, which is what users get. ISAs are timed interleaved (see _time_interleaved).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

# Rows from which the amx ISA uses AMX tiles, per quant: compile-time constants of the native kernels, not exported
# by the native module (keep in step): KTK_AMX_MIN_ROWS_BF16 / _INT8 in native/src/kernels/amx/amx.h,
# KTK_AMX_INT4_DEQUANT_ROWS there too (int4: dequantize to bf16, then the bf16 AMX path).
AMX_MIN_ROWS = {"bf16": 8, "int8": 12, "int4": 32}
ROWS_FULL = (1, 2, 4, 6, 8, 10, 12, 16, 24, 32, 48, 64)
ROWS_QUICK = (1, 2, 4, 8, 12, 16, 32, 64)
FEW, MANY = "avx512", "amx"
MARGIN = 0.02  # "faster" = at least 2% less time (below the threshold both ISAs run the same code)


@dataclass(frozen=True)
class Point:
    quant: str
    isa: str
    rows: int     # rows per expert
    tokens: int   # T
    seconds: float
    flops: float  # 2 T k 3 H I
    nbytes: int   # stored bytes of the E' experts


def sweep_isas(available: list[str], extra: list[str] = ()) -> list[str]:
    """ISAs swept: avx512 and amx where available, plus any of `extra` (e.g. avx2, generic) the CPU has."""
    isas = [i for i in (FEW, MANY) if i in available] or available[-1:]
    return isas + [i for i in extra if i in available and i not in isas]


def routing(rows: int, experts: int, top_k: int) -> torch.Tensor:
    """ids [T, k] int64, T = rows * experts / k: each expert gets exactly `rows` rows."""
    if experts % top_k:
        raise ValueError(f"sweep: top_k {top_k} must divide the experts built ({experts})")
    t = rows * experts // top_k
    return (torch.arange(t).view(t, 1) * top_k + torch.arange(top_k).view(1, top_k)) % experts


def _time_interleaved(fns: dict, repeats: int) -> dict:
    """Median seconds of each zero-argument function, runs interleaved (a, b, a, b, ...) after one warm-up each, so
    a slow phase of a shared machine hits every ISA alike."""
    for fn in fns.values():
        fn()
    times = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(t) for key, t in times.items()}


def sweep(native, ex, quant: str, rows_list, isas, top_k: int, pool, repeats: int, seed: int = 5) -> list[Point]:
    """Time ex.forward (native.Experts, E' experts) for each rows count and ISA (ISAs interleaved); restores the ISA
    in use."""
    g = torch.Generator().manual_seed(seed)
    E, H, I = ex.num_experts, ex.hidden, ex.intermediate
    isa0 = native.isa()
    points = []

    def run(isa, x, ids, w, out):
        native.set_isa(isa)
        ex.forward(x, ids, w, out=out, pool=pool)

    try:
        for rows in rows_list:
            ids = routing(rows, E, top_k)
            t = ids.shape[0]
            x = torch.randn(t, H, generator=g).to(torch.bfloat16)
            w = torch.softmax(torch.randn(t, top_k, generator=g), dim=-1)
            out = torch.empty(t, H, dtype=torch.bfloat16)
            fns = {isa: (lambda isa=isa: run(isa, x, ids, w, out)) for isa in isas}
            for isa, s in _time_interleaved(fns, repeats).items():
                points.append(Point(quant, isa, rows, t, s, 2.0 * t * top_k * 3 * H * I, ex.nbytes))
    finally:
        native.set_isa(isa0)
    return points


def crossover(points: list[Point], quant: str, few: str = FEW, many: str = MANY) -> int | None:
    """First rows count from which `many` is faster (by MARGIN) than `few` at it and every larger count swept."""
    t = {(p.isa, p.rows): p.seconds for p in points if p.quant == quant}
    rows = sorted({r for (_, r) in t})
    if not all((few, r) in t and (many, r) in t for r in rows):
        return None
    first = None
    for r in reversed(rows):
        if t[(many, r)] < (1 - MARGIN) * t[(few, r)]:
            first = r
        else:
            break
    return first


def _cell(p: Point) -> str:
    unit = "TFLOPS" if p.quant == "bf16" else "TOPS"
    return f"{p.flops / p.seconds / 1e12:.2f} {unit} {p.nbytes / p.seconds / 1e9:.0f} GB/s {p.seconds * 1e3:.2f} ms"


def report(points: list[Point], describe: str, amx_available: bool) -> list[str]:
    """The sweep table (a row per rows count, a column per quant x ISA), the measured crossovers and thresholds."""
    cols = list(dict.fromkeys((p.quant, p.isa) for p in points))
    rows = sorted({p.rows for p in points})
    by = {(p.quant, p.isa, p.rows): p for p in points}
    tokens = {p.rows: p.tokens for p in points}
    head = ["rows/expert", "tokens"] + [f"{q} {i}" for q, i in cols]
    body = [[str(r), str(tokens[r])] + [_cell(by[(q, i, r)]) if (q, i, r) in by else "-" for q, i in cols]
            for r in rows]
    widths = [max(len(line[c]) for line in [head] + body) for c in range(len(head))]
    fmt = lambda line: "  ".join(s.ljust(w) for s, w in zip(line, widths)).rstrip()  # noqa: E731
    lines = [f"crossover sweep: {describe}", fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body]
    quants = list(dict.fromkeys(p.quant for p in points))
    thresholds = ", ".join(f"{q} {AMX_MIN_ROWS[q]}" for q in quants if q in AMX_MIN_ROWS)
    thr_txt = (f"dispatcher thresholds (rows from which the amx ISA uses tiles; KTK_AMX_MIN_ROWS_* in "
               f"native/src/kernels/amx/amx.h, and KTK_AMX_INT4_DEQUANT_ROWS): "
               f"{thresholds or 'none for these quants'}")
    if not amx_available:
        lines.append("AMX: not available on this CPU/OS/build: the sweep shows the few-token path only, no crossover "
                     "measured; " + thr_txt)
        return lines
    found = []
    for q in quants:
        c = crossover(points, q)
        found.append(f"{q} {c if c is not None else f'none up to {max(rows)}'}"
                     + (f" (threshold {AMX_MIN_ROWS[q]})" if q in AMX_MIN_ROWS else " (no threshold listed)"))
        many = {p.rows: p.seconds for p in points if p.quant == q and p.isa == MANY}
        few = {p.rows: p.seconds for p in points if p.quant == q and p.isa == FEW}
        lines.append(f"{q} time amx / avx512 by rows/expert: "
                     + " ".join(f"{r}:{many[r] / few[r]:.2f}" for r in rows if r in many and r in few))
    lines.append(f"measured crossover (first rows/expert from which amx is >= {MARGIN:.0%} faster than avx512 there "
                 f"and at every larger count): {', '.join(found)}")
    lines.append(thr_txt + "; below a threshold both columns run the same AVX-512 kernels (raw AMX tile entry points "
                 "are not exported), so a crossover below it cannot show and the ratio there is the run's noise")
    return lines
