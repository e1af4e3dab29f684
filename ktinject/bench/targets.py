"""The decode targets judged from ``bench decode``'s rows, so that every run says itself whether it met them.

Rows are the bench's table rows (what, tok/s, ms/token, note), numbers as printed ("1,071.5"). The targets are of
the whole model (48 layers) at batch 1 on the GPU machine, the speed and the GPU part at a short context (a prompt
of at most ``SHORT_PROMPT`` tokens, where the targets were set: attention over 16K tokens is GPU time the targets
do not count); other runs get no verdict:

- int4 >= 90 and int8 >= 55 tok/s through ``generate`` (the median of the ``--defer 0`` rounds where they ran, else
  the median of the graph runs in turns with the read loop, else the one graph run, said so);
- bf16 >= 80% of the run's roofline (bytes of experts a token / the read bandwidth measured at the run's start:
  the best of every read variant's and torch's sum's median pass over >= 32x the LLC, bench.memory), by the same
  figure; the share of the roofline alongside (``bench.decode``: three passes a variant, in turns with the graph
  runs) is printed beside it but does not judge: on a shared host a few passes swing with the other tenants;
- the GPU part of a step (muted replay) <= 2 ms, the card named;
- with ``--noise``: one busy core keeps >= 85% of the quiet speed, and each level's runs lie within 15% of their
  median (3 runs or more a level).

And the deferral target (``--defer 0,...`` with graphs, whole model, batch 1): int4 at its best d > 0 at
least 1.25x of d = 0 and at least 80% of the bound (CPU + GPU) / max(CPU, GPU) of the run; bf16 is reported the
same way, unjudged. Where the bound itself is below 1.25x the verdict says so: overlap cannot reach it there, and a
longer context (``--prompt 16384``) gives the GPU part more to hide.
"""
from __future__ import annotations

import math
import statistics

import torch

from ktinject.bench.model import DEFAULT_SHAPES, SHAPES, real_layers, shapes_of

TARGET_TOK_S = {"int4": 90.0, "int8": 55.0}
ROOFLINE_SHARE = 0.8
ROOF_RUNS = 3  # graph decode runs in turns with read-loop passes (bench.decode's roofline alongside)
GPU_PART_S = 2.0e-3
NOISE_SHARE, SPREAD = 0.85, 0.15
DEFER_SPEEDUP, DEFER_BOUND_SHARE = 1.25, 0.8
SHORT_PROMPT = 512

#: the rows whose tok/s is ktinject's decode figure (targets, the peer comparison), in order of preference: the
#: median of the rounds at d = 0 (``--defer 0,...``), the median of the runs in turns with the read loop, the one run
OUR_ROWS = ("defer 0: graph decode", "ktinject graph, in turns with the read loop", "ktinject graph")


def _row(rows, what: str):
    return next((r for r in rows if r[0] == what), None)


def _number(text) -> float | None:
    """A number as the table prints it ("1,071.5"), None where it is not one ("n/a", "failed")."""
    try:
        return float(text.replace(",", ""))
    except (ValueError, AttributeError):
        return None


def _cell(rows, what: str, col: int) -> float | None:
    """The number in column ``col`` of the row named ``what`` (None where absent or not a number)."""
    r = _row(rows, what)
    return None if r is None else _number(r[col])


def our_rate(rows) -> tuple[str, float] | None:
    """(row, tok/s) of ktinject's decode in one quant's ``rows`` (``OUR_ROWS``), None where none ran."""
    for want in OUR_ROWS:
        r = _row(rows, want)
        if r is not None:
            rate = _number(r[1])
            return None if rate is None else (want, rate)
    return None


def _whole_model(args) -> bool:
    return (not args.tiny and shapes_of(args) is SHAPES[DEFAULT_SHAPES] and args.layers == real_layers(args)
            and args.batch == 1)


def target_rows(quant: str, rows, args) -> list[tuple[str, str, str, str]]:
    """The decode targets that this run measured, for one quant's ``rows``, each judged: "met" / "NOT met"."""
    out = []
    if not _whole_model(args) or getattr(args, "prompt", 32) > SHORT_PROMPT:
        return out
    mine = our_rate(rows)
    want = TARGET_TOK_S.get(quant)
    if mine is not None and want is not None:
        rounds = getattr(args, "defer_rounds", 3)
        how = {OUR_ROWS[0]: f"median of {rounds} runs", OUR_ROWS[1]: f"median of {ROOF_RUNS} runs, in turns with the "
               f"read loop"}.get(mine[0], "one run; --defer 0 gives the median of 3")
        out.append((f"target: {quant} >= {want:g} tok/s through generate", f"{mine[1]:,.1f}", "",
                    f"{'met' if mine[1] >= want else 'NOT met'} ({how})"))
    roof = next((r for r in rows if r[0].startswith("roofline:")), None)
    roof_rate = None if roof is None else _number(roof[1])
    along = next((r for r in rows if r[0].startswith("roofline alongside:")), None)
    along_rate = None if along is None else _number(along[1])
    turns = _cell(rows, "ktinject graph, in turns with the read loop", 1)
    if quant == "bf16" and roof_rate and mine is not None:
        ours = mine[1]
        share = ours / roof_rate
        what = (f"median of {ROOF_RUNS} graph runs {ours:,.1f}" if mine[0] == OUR_ROWS[1] else f"graph {ours:,.1f}")
        beside = (f"; {100 * turns / along_rate:.0f}% of the roofline alongside, {along[1]} tok/s"
                  if along_rate and turns is not None else "")
        out.append((f"target: bf16 >= {100 * ROOFLINE_SHARE:.0f}% of the roofline", f"{ours:,.1f}", "",
                    f"{'met' if share >= ROOFLINE_SHARE else 'NOT met'}: {100 * share:.0f}% ({what} vs roofline "
                    f"{roof[1]} tok/s, this run{beside})"))
    gpu = _cell(rows, "split: GPU + handshakes (experts muted)", 2)
    if gpu is None:
        gpu = _cell(rows, "defer: GPU + handshakes (experts muted, d=0)", 2)
    if gpu is not None:
        card = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
        out.append((f"target: GPU part (muted replay) <= {GPU_PART_S * 1e3:g} ms", "", f"{gpu:.2f}",
                    f"{'met' if gpu <= GPU_PART_S * 1e3 else 'NOT met'} ({card})"))
    return out


def noise_targets(times: dict[int, list[float]], args) -> list[tuple[str, str, str, str]]:
    """The interference targets from ``times`` (noise level -> seconds a token of each run; 0 = quiet): one
    busy core keeps >= NOISE_SHARE of the quiet speed (medians), and each level's runs lie within SPREAD of their
    median. Judged for the whole model at batch 1 with 3 runs or more a level (the targets' setting), else none."""
    runs = min(len(v) for v in times.values())
    if not _whole_model(args) or runs < 3 or 0 not in times:
        return []
    out = []
    quiet = statistics.median(times[0])
    if 1 in times:
        share = quiet / statistics.median(times[1])
        out.append((f"target: one core busy (--noise 1) >= {100 * NOISE_SHARE:.0f}% of the quiet speed", "", "",
                    f"{'met' if share >= NOISE_SHARE else 'NOT met'}: {100 * share:.0f}%"))
    spreads = {n: (max(v) - min(v)) / statistics.median(v) for n, v in times.items()}
    worst = max(spreads, key=spreads.get)
    out.append((f"target: each level's runs within {100 * SPREAD:.0f}% of their median", "", "",
                f"{'met' if spreads[worst] <= SPREAD else 'NOT met'}: the widest {100 * spreads[worst]:.0f}% (noise "
                f"{worst}, {len(times[worst])} runs)"))
    return out


DEFER_TARGET = (f"target: int4 deferral >= {DEFER_SPEEDUP:g}x of d=0 and >= {100 * DEFER_BOUND_SHARE:.0f}% of the "
                f"bound")
LONG_CONTEXT = 16384  # the context the deferral runs take when the bound is short at the default one


def _floor_pct(x: float) -> str:
    """A share as a percentage rounded down to a tenth (79.97% is not printed as a met 80%)."""
    return f"{math.floor(1000 * x) / 10:.1f}%"


def defer_targets(quant: str, speedups: dict, bound: float | None, args, cpu_s: float | None = None,
                  gpu_s: float | None = None) -> list[tuple[str, str, str, str]]:
    """The deferral target from ``speedups`` (setting -> median tok/s over d = 0's, d = 0 included) and the
    run's ``bound`` (from ``cpu_s`` and ``gpu_s``, the CPU's and the GPU's part of a step, which word the advice):
    judged for int4 (bf16 reported), whole model at batch 1 with graphs, else none."""
    later = {d: up for d, up in speedups.items() if d}
    if not _whole_model(args) or not later or not bound or quant not in ("int4", "bf16"):
        return []
    best = max(later, key=later.get)
    up = later[best]
    what = (f"defer {best}: {up:.3f}x of d=0, {_floor_pct(up / bound)} of the bound {bound:.3f}x (prompt "
            f"{args.prompt} tokens)")
    if quant != "int4":
        return [(f"report: {quant} deferral, best setting", "", "", what)]
    met = up >= DEFER_SPEEDUP and up >= DEFER_BOUND_SHARE * bound
    why = ""
    if bound < DEFER_SPEEDUP:
        why = f"; the bound is below {DEFER_SPEEDUP:g}x here"
        if cpu_s is not None and gpu_s is not None:
            if gpu_s < cpu_s:
                why += (f" (the GPU part, {gpu_s * 1e3:.2f} ms, is under a quarter of the CPU's {cpu_s * 1e3:.2f}): "
                        + (f"a longer context (--prompt {LONG_CONTEXT}) gives overlap more to hide"
                           if args.prompt < LONG_CONTEXT else "out of reach at this context"))
            else:
                why += f" (the CPU part, {cpu_s * 1e3:.2f} ms, is under a quarter of the GPU's {gpu_s * 1e3:.2f})"
    return [(DEFER_TARGET, "", "", f"{'met' if met else 'NOT met'}: {what}{why}")]


def defer_failed(quant: str, why: str, args) -> list[tuple[str, str, str, str]]:
    """The deferral target's row where the run could not measure it (int4, whole model, batch 1), else none."""
    return [(DEFER_TARGET, "", "", f"NOT met: {why}")] if quant == "int4" and _whole_model(args) else []
