"""Who computes a prefill forward's routed experts, the CPU (native kernels) or the GPU (experts streamed over PCIe):
the ``prefill`` option and a tiny cost model with pure functions of it. ``stream.PrefillStreamer`` measures the
costs and acts on the answers.

Per layer, for the experts that are neither GPU-resident (hot) nor idle, with ``rows`` routed (token, slot) pairs:

    CPU   cpu_expert_s * experts + cpu_row_s * rows          (reading each expert's weights + work per routed row)
    GPU   experts * (expert_bytes / h2d + gpu_expert_s)      (copy over PCIe, dequantize on the device)
          + rows * gpu_row_s + gpu_layer_s                   (grouped matmuls; launches of the layer)
    split: both at once, each on its own experts: max(CPU part, GPU part + split_s, cpu_expert_s * experts)
          (split_s: the host waits for the routing to know the rows per expert; the last term: the copies read the
          same host memory the CPU's experts are read from, so the memory-bound part of the CPU's work does not
          shrink when the GPU takes experts: a split pays where the CPU is compute-bound, i.e. many rows)

The GPU takes the experts with the most rows first: per routed row it is two orders of magnitude faster than the CPU,
while copying an expert costs about what the CPU's own read of it costs. Modes of one forward (``choose_mode``):

    cpu    every layer on the CPU (nothing to gain: few tokens)
    split  per layer, once its routing is known: the best number of experts for the GPU (``choose_split``, 0 = CPU);
           its copy waits for the routing (a host sync), so nothing hides it and the GPU's dense work is not hidden
    ahead  n experts a layer chosen before the routing (``ahead_split`` sizes n, ``ahead_experts`` picks them from
           the rows they got before): copied while layer L-1 computes, like gpu mode, the CPU takes the rest (its
           skip mask); a layer costs max(layer_s + CPU part, layer_s + GPU compute, copy of n)
    gpu    every layer wholly on the GPU, layer L+1's copy running while layer L computes: a layer costs
           max(copy, layer_s, dense_s + compute) and the copy of the first layer is not hidden

``layer_s``: what a layer spends outside its routed experts when the host waits for each layer's routing (cpu,
split, ahead): the host's launches of the attention and the router, the GPU's dense work, the routing's copy to the
host, most of it the host's (docs/performance.md has what it is on the GPU machine). The streamer measures
it in split and ahead forwards (the host time from one layer's CPU task done to the next one's submit) and corrects
the CPU's costs by what its tasks took there (``Costs.scaled``). gpu mode hides it: its host never waits, so a layer
costs max(copy, layer_s, dense_s + compute), ``dense_s`` (the GPU's share of it) a guess.

Legend: T tokens, k experts per token, E experts, m experts with rows, n experts on the GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

MODES = ("auto", "cpu", "gpu")
#: another mode than cpu (and a split with GPU experts) is taken only when it is estimated this much faster: what the
#: model leaves out (launches, host work, the first layer's copy) must not turn a small estimated gain into a loss
MARGIN = 0.1
#: a forward streams whole layers ahead (gpu mode) when the chance that an expert gets no row is below this
PREFETCH_UNUSED = 0.05
#: a mode that shares a layer with the CPU (split, ahead) replaces gpu mode only when estimated this much faster: its
#: copies contend with the CPU's reads of host memory, which the model does not price (a split estimated faster than
#: gpu mode was measured to lose to it: docs/performance.md)
SHARED_MARGIN = 0.1
#: whether auto may choose ahead mode (tests turn it off to see the others). It was off while ahead queued its GPU work
#: before the routing sync, where a host sync inside held the CPU's task back (ahead lost to split and gpu then)
AHEAD = True


def check_mode(value: Any, where: str = "") -> str:
    """``value`` if it is a prefill mode, else ValueError naming the option (and ``where`` it was written)."""
    if value in MODES:
        return value
    at = f"{where}: " if where else ""
    raise ValueError(f"{at}prefill: expected one of {', '.join(repr(m) for m in MODES)} (where the routed experts of "
                     f"a prompt run: 'auto' splits them between the CPU and the GPU by a cost model, 'cpu' keeps them "
                     f"in the native CPU kernels, 'gpu' streams them to the GPU), got {value!r}")


def mode_from_plan(plan: Any, given: str | None = None) -> str:
    """The prefill mode: ``given`` (a keyword of inject / from_pretrained) or the moe rules' ``prefill`` kwarg (the
    rules must agree: it is model-wide), else "auto". ValueError naming the rule or the keyword."""
    if given is not None:
        return check_mode(given)
    found: tuple[str, str] | None = None
    for entry in plan.operator_entries():
        value = entry.kwargs.get("prefill")
        if value is None:
            continue
        where = entry.rule.where
        check_mode(value, where)
        if found is not None and found[0] != value:
            raise ValueError(f"moe rules disagree on prefill: {found[0]!r} ({found[1]}) vs {value!r} ({where}); "
                             f"prefill is model-wide: give one value")
        found = found or (value, where)
    return "auto" if found is None else found[0]


@dataclass(frozen=True)
class Costs:
    """Seconds per unit of one MoE layer's work (see the module docstring); ``h2d``: bytes per second, page-locked
    host to device; ``expert_bytes``: one expert's packed bytes (what crosses PCIe)."""

    h2d: float
    expert_bytes: int
    cpu_expert_s: float
    cpu_row_s: float
    gpu_expert_s: float
    gpu_row_s: float
    gpu_layer_s: float = 1.5e-4
    split_s: float = 1e-4
    dense_s: float = 3e-4
    layer_s: float = 3e-4
    h2d_shared: float | None = None  # bytes/s of copies beside the CPU's work (ahead mode), when measured; else h2d

    def with_(self, **changes) -> Costs:
        return replace(self, **changes)

    def scaled(self, cpu: float = 1.0, layer_s: float | None = None) -> Costs:
        """These costs with the CPU's times times ``cpu`` and, when given, a measured ``layer_s``."""
        return replace(self, cpu_expert_s=self.cpu_expert_s * cpu, cpu_row_s=self.cpu_row_s * cpu,
                       layer_s=self.layer_s if layer_s is None else layer_s)

    def copy_s(self, experts: float) -> float:
        return experts * self.expert_bytes / self.h2d

    def cpu_s(self, experts: float, rows: float) -> float:
        return self.cpu_expert_s * experts + self.cpu_row_s * rows

    def gpu_s(self, experts: float, rows: float) -> float:
        """Copy, dequantize and compute of ``experts`` with ``rows``, one after another (no overlap)."""
        if experts <= 0:
            return 0.0
        return self.copy_s(experts) + self.gpu_expert_s * experts + self.gpu_row_s * rows + self.gpu_layer_s


def gpu_default_costs(hidden: int, intermediate: int, quant: str) -> dict[str, float]:
    """gpu_expert_s and gpu_row_s from a datacenter GPU's rates until measured: dequantizing writes 3HI bf16 weights and
    reads the packed ones (~1.5 TB/s with torch kernels), a routed row is 6HI flops (~250 TFLOPS grouped bf16)."""
    weights = 3 * hidden * intermediate
    packed = {"bf16": 2.0, "int8": 1.0, "int4": 0.5, "mxfp4": 0.53}.get(quant, 2.0)
    return {"gpu_expert_s": weights * (2.0 + packed) / 1.5e12, "gpu_row_s": 2.0 * weights / 250e12}


def fit_cpu(rows_per_expert: tuple[float, float], seconds: tuple[float, float], experts: int) -> tuple[float, float]:
    """(cpu_expert_s, cpu_row_s) from two timed forwards of ``experts`` experts with the given rows each."""
    (r1, r2), (t1, t2) = rows_per_expert, seconds
    if r2 == r1 or experts < 1:
        raise ValueError("fit_cpu: two different row counts and at least one expert are needed")
    per_row = max((t2 - t1) / (experts * (r2 - r1)), 1e-10)
    per_expert = max(t1 / experts - r1 * per_row, 0.0)
    return per_expert, per_row


def split_times(rows: Sequence[int] | np.ndarray, costs: Costs) -> tuple[np.ndarray, np.ndarray]:
    """(cpu [m+1], gpu [m+1]) seconds when the n = 0..m first experts of ``rows`` (rows per expert, sorted largest
    first, all > 0) go to the GPU and the rest stay on the CPU."""
    r = np.asarray(rows, dtype=np.float64)
    m = r.size
    n = np.arange(m + 1, dtype=np.float64)
    on_gpu = np.concatenate([[0.0], np.cumsum(r)])  # rows of the first n
    cpu = costs.cpu_expert_s * (m - n) + costs.cpu_row_s * (on_gpu[-1] - on_gpu)
    gpu = (costs.copy_s(1.0) + costs.gpu_expert_s) * n + costs.gpu_row_s * on_gpu
    # with GPU experts, the host memory is read for all m experts (by the CPU or by the copies): a floor
    gpu = np.where(n > 0, np.maximum(gpu + costs.gpu_layer_s + costs.split_s, costs.cpu_expert_s * m), 0.0)
    return cpu, gpu


def best_split(rows: Sequence[int] | np.ndarray, costs: Costs) -> tuple[int, float]:
    """(n, seconds): how many of ``rows``' experts (largest first) the GPU takes so that the layer ends soonest;
    0 unless that is at least MARGIN faster than the CPU alone."""
    cpu, gpu = split_times(rows, costs)
    total = np.maximum(cpu, gpu)
    n = int(np.argmin(total))  # the first minimum: fewer GPU experts on a tie
    if total[n] > (1.0 - MARGIN) * total[0]:
        n = 0
    return n, float(total[n])


def choose_split(counts: np.ndarray, eligible: np.ndarray, costs: Costs) -> list[int]:
    """Experts (ascending ids) for the GPU in one layer: ``counts`` [E] rows per expert, ``eligible`` [E] bool (not
    GPU-resident). Largest rows first, ties by lower id."""
    ids = np.flatnonzero(eligible & (counts > 0))
    order = ids[np.lexsort((ids, -counts[ids]))]
    n, _ = best_split(counts[order], costs)
    return sorted(int(e) for e in order[:n])


def uniform_rows(T: int, k: int, experts: int) -> np.ndarray:
    """Rows per used expert when T tokens pick k of ``experts`` uniformly: the expected number of used experts,
    each with T*k / used rows (the planning guess before any routing is known)."""
    if T <= 0 or experts <= 0:
        return np.zeros(0)
    used = experts * (1.0 - (1.0 - min(k, experts) / experts) ** T)
    m = max(1, min(experts, int(round(used))))
    return np.full(m, T * min(k, experts) / m)


def prefetch_worthy(T: int, k: int, experts: int) -> bool:
    """Whether nearly every expert gets rows (so a layer can be copied whole before its routing is known)."""
    return experts > 0 and (1.0 - min(k, experts) / experts) ** T < PREFETCH_UNUSED


def ahead_times(T: int, k: int, experts: int, costs: Costs, cap: int | None = None) -> np.ndarray:
    """Seconds of a layer [n+1] when n = 0..min(experts, cap) experts, fixed before the routing, are copied during
    the layer before and computed on the GPU, the CPU computing the rest (ahead mode; uniform routing: each expert
    T*k/experts rows, used with the chance ``uniform_rows`` gives)."""
    if T <= 0 or experts <= 0:
        return np.zeros(1)
    top = experts if cap is None else max(0, min(experts, int(cap)))
    n = np.arange(top + 1, dtype=np.float64)
    per = T * min(k, experts) / experts  # rows an expert
    used = uniform_rows(T, k, experts).size / experts  # chance an expert has rows
    cpu = costs.cpu_expert_s * used * (experts - n) + costs.cpu_row_s * per * (experts - n)
    gpu = np.where(n > 0, costs.gpu_expert_s * n + costs.gpu_row_s * per * n + costs.gpu_layer_s, 0.0)
    copy = n * costs.expert_bytes / (costs.h2d_shared or costs.h2d)  # during the layer before: hidden unless longest
    # no memory floor as in split_times (host memory reads far faster than PCIe): the copies' contention with the
    # CPU is in the CPU's costs the streamer measures during such forwards (Costs.scaled)
    return np.maximum.reduce([costs.layer_s + cpu, costs.layer_s + gpu, copy])


def ahead_split(T: int, k: int, experts: int, costs: Costs, cap: int | None = None) -> tuple[int, float]:
    """(n, seconds): experts a layer for the GPU in ahead mode (the least time, fewer on a tie; 0 unless at least
    MARGIN faster than the CPU alone)."""
    total = ahead_times(T, k, experts, costs, cap)
    n = int(np.argmin(total))
    if total[n] > (1.0 - MARGIN) * total[0]:
        n = 0
    return n, float(total[n])


def ahead_experts(seen: np.ndarray | None, eligible: np.ndarray, n: int) -> list[int]:
    """The n experts (ascending ids) of a layer for the GPU before its routing is known: of the ``eligible`` [E]
    (not resident), those with the most rows ``seen`` [E] in earlier forwards (None: none yet), ties by lower id."""
    ids = np.flatnonzero(eligible)
    if n <= 0 or ids.size == 0:
        return []
    rows = np.zeros(eligible.shape[0]) if seen is None else np.asarray(seen, dtype=np.float64)
    order = ids[np.lexsort((ids, -rows[ids]))]
    return sorted(int(e) for e in order[:n])


def estimates(T: int, k: int, experts: int, costs: Costs, cap: int | None = None,
              ahead_s: float | None = None) -> dict[str, float]:
    """Seconds per layer of each mode for T tokens over ``experts`` streamable experts (uniform routing); ``cap``:
    at most this many experts in one copy (a ring slot), for ahead mode; ``ahead_s``: ahead mode's time as measured
    (``balance.AheadBalance.estimate``), instead of the model's."""
    rows = uniform_rows(T, k, experts)
    cpu = costs.layer_s + costs.cpu_s(rows.size, rows.sum())
    _, split = best_split(rows, costs)
    if prefetch_worthy(T, k, experts):
        compute = costs.gpu_expert_s * experts + costs.gpu_row_s * T * k + costs.gpu_layer_s
        gpu = max(costs.copy_s(experts), costs.layer_s, costs.dense_s + compute)
    else:  # copied after routing, used experts only: nothing overlaps the copy
        gpu = costs.layer_s + costs.gpu_s(rows.size, rows.sum()) + costs.split_s
    # ahead only where nearly every expert gets rows: a fixed set copied for few tokens would mostly go unused
    ahead = cpu
    if prefetch_worthy(T, k, experts):
        ahead = ahead_split(T, k, experts, costs, cap)[1] if ahead_s is None else ahead_s
    return {"cpu": cpu, "split": costs.layer_s + split, "ahead": ahead, "gpu": gpu}


def choose_mode(T: int, k: int, experts: int, costs: Costs, cap: int | None = None,
                ahead_s: float | None = None) -> str:
    """"cpu", "split", "ahead" or "gpu" for a forward of T tokens: the least estimated time; cpu unless the best
    other mode is at least MARGIN faster, a mode shared with the CPU over gpu only when SHARED_MARGIN faster; ahead
    on a tie with split (its copies overlap). ``ahead_s``: as for ``estimates``."""
    est = estimates(T, k, experts, costs, cap, ahead_s)
    if not all(math.isfinite(v) for v in est.values()):
        return "cpu"
    shared = "ahead" if AHEAD and est["ahead"] <= est["split"] else "split"
    other = shared if est[shared] <= (1.0 - SHARED_MARGIN) * est["gpu"] else "gpu"
    return other if est[other] <= (1.0 - MARGIN) * est["cpu"] else "cpu"
