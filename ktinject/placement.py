"""Expert activation statistics and the choice of GPU-resident ("hot") experts within a byte budget.

Statistics: every HybridMoE counts, on its device, the (token, slot) pairs its router sends to each expert
(``block.counts``, int64 [E]: one ``index_add_`` per forward, no host sync, so it is captured with the decode step;
graph warm-up steps count too). ``read_stats`` gathers them into an ``ExpertStats`` (layer names + counts [L, E] on
the CPU), ``reset_stats`` zeroes them, ``set_collection`` turns counting off or on, ``save_stats``/``load_stats``
write and read them (safetensors, or JSON for a ``.json`` path; never pickle). ``python -m ktinject.calibrate``
runs prompts and writes them.

Choosing (pure, ``choose``): given counts [L, E], a byte budget and the bytes one resident expert takes in each layer
(in the dtype used on the GPU) plus each used layer's table bytes, pick the experts that live on the GPU:
  frequency  one global ranking of (layer, expert) by count, taken greedily while it fits;
  uniform    the same number n in every layer (the largest n that fits), each layer's top n by count;
  none       nothing.
The chosen bytes never exceed the budget. ``dynamic`` (for ``place``) starts like ``frequency`` (``uniform`` without
statistics) and then re-ranks at run time (``ktinject.operators.rebalance.Rebalancer``), keeping each layer's slot
count.

Applying (``place``): builds each chosen layer's bank (``HotExperts``) on the block's device and sets the native
skip mask, drops captured decode graphs (the next step captures again, with the banks in it).

CPU copies of GPU-resident experts are kept: native experts are one packed allocation per layer and the skip mask
leaves the resident ones out, so nothing is repacked, a bank can be dropped or re-placed at any time by copying
from the host again, and host memory is what it was without placement (the bytes dropping them would save are the
bank's weight bytes; ``python -m ktinject.bench hot`` prints both).

Legend: L MoE layers, E experts per layer.
"""
from __future__ import annotations

import json
import logging
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

log = logging.getLogger(__name__)

STRATEGIES = ("frequency", "uniform", "dynamic", "none")
STATS_FORMAT = "ktinject.expert_stats"
_REBALANCER_ATTR = "_ktinject_rebalancer"
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(value: Any) -> int:
    """Bytes from an int/float or a string like '12GiB', '512 MiB', '1.5GB', '0' (GiB/MiB binary, GB/MB decimal)."""
    if isinstance(value, bool):
        raise ValueError(f"byte size {value!r}: expected a number or a string like '12GiB'")
    if isinstance(value, (int, float)):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*", str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"byte size {value!r}: expected a number with an optional unit (B, KiB, MiB, GiB, TiB, "
                             f"KB, MB, GB, TB), e.g. '12GiB'")
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(n) or n < 0:
        raise ValueError(f"byte size {value!r}: must be a non-negative number of bytes")
    return int(n)


def check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"placement strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    return strategy


# ---------------------------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class ExpertStats:
    """Routed (token, slot) pairs per expert: ``counts`` int64 [L, E] (CPU) for the MoE blocks named ``layers``."""

    layers: tuple[str, ...]
    counts: torch.Tensor = field(repr=False)

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        c = torch.as_tensor(self.counts).to(torch.int64).cpu()
        if c.dim() != 2 or c.shape[0] != len(self.layers):
            raise ValueError(f"expert stats: counts {tuple(c.shape)} do not match {len(self.layers)} layers")
        object.__setattr__(self, "counts", c)

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def share(self, chosen: Sequence[Sequence[int]]) -> float:
        """Share of all routed pairs that ``chosen`` (experts per layer) would serve."""
        return hit_share(self.counts, chosen)

    def __repr__(self) -> str:
        return f"ExpertStats({len(self.layers)} layers x {self.counts.shape[1]} experts, {self.total} routed pairs)"


def hybrid_blocks(model) -> list[tuple[str, Any]]:
    """(module name, HybridMoE) of every injected MoE block, in module order."""
    from ktinject.operators.moe import HybridMoE

    return [(n, m) for n, m in model.named_modules() if isinstance(m, HybridMoE)]


def _blocks(model) -> list[tuple[str, Any]]:
    blocks = hybrid_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no injected MoE blocks (ktinject.inject it first)")
    return blocks


def read_stats(model) -> ExpertStats:
    """The model's counts so far (one device-to-host copy per layer: call between steps, not in a graph)."""
    blocks = _blocks(model)
    return ExpertStats(tuple(n for n, _ in blocks), torch.stack([b.counts.detach().cpu() for _, b in blocks]))


def reset_stats(model) -> None:
    """Zero the counts (in place: captured graphs keep counting into the same tensors)."""
    for _, b in _blocks(model):
        b.counts.zero_()


def set_collection(model, enabled: bool = True) -> None:
    """Turn counting on or off (captured graphs keep what they were captured with: call before capture)."""
    for _, b in _blocks(model):
        b.collect_stats = bool(enabled)


def save_stats(stats: ExpertStats, path) -> Path:
    """Write ``stats``: JSON if ``path`` ends in .json, else safetensors (tensor 'counts' + metadata)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".json":
        doc = {"format": STATS_FORMAT, "version": 1, "layers": list(stats.layers), "counts": stats.counts.tolist()}
        path.write_text(json.dumps(doc) + "\n", encoding="utf-8")
    else:
        from safetensors.torch import save_file

        meta = {"format": STATS_FORMAT, "version": "1", "layers": json.dumps(list(stats.layers))}
        save_file({"counts": stats.counts.contiguous()}, str(path), metadata=meta)
    return path


def load_stats(path) -> ExpertStats:
    """Read a file written by ``save_stats`` (either format, detected from its content)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"expert stats file not found: {path}")
    with open(path, "rb") as f:
        head = f.read(1)
    if head == b"{":
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("format") != STATS_FORMAT:
            raise ValueError(f"{path}: not a ktinject expert stats file (format {doc.get('format')!r})")
        return ExpertStats(tuple(doc["layers"]), torch.tensor(doc["counts"], dtype=torch.int64))
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != STATS_FORMAT:
            raise ValueError(f"{path}: not a ktinject expert stats file (format {meta.get('format')!r})")
        return ExpertStats(tuple(json.loads(meta["layers"])), f.get_tensor("counts"))


def _aligned_counts(stats: ExpertStats, names: Sequence[str], num_experts: int) -> torch.Tensor:
    """stats.counts rows in the order of ``names`` (the model's MoE blocks)."""
    where = {n: i for i, n in enumerate(stats.layers)}
    missing = [n for n in names if n not in where]
    if missing or stats.counts.shape[1] != num_experts:
        raise ValueError(f"expert stats do not fit this model: {len(missing)} of its MoE layers are not in the stats "
                         f"(e.g. {missing[:2]}), stats have {stats.counts.shape[1]} experts per layer, the model "
                         f"{num_experts}; collect them on this model (python -m ktinject.calibrate)")
    return stats.counts[[where[n] for n in names]]


# ---------------------------------------------------------------------------------------------- choosing


def _per_layer(value, L: int, what: str) -> list:
    if isinstance(value, (int, float)) or value is None:
        return [value] * L
    value = list(value)
    if len(value) != L:
        raise ValueError(f"{what}: {len(value)} values for {L} layers")
    return value


def choose(counts, budget: int, expert_bytes, strategy: str, layer_bytes=0) -> list[list[int]]:
    """Experts per layer (sorted lists) to keep on the GPU. ``counts`` [L, E]; ``expert_bytes``: bytes of one
    resident expert, per layer or one for all (None: the layer cannot have resident experts); ``layer_bytes``:
    fixed bytes of a layer that has any (its tables). Ties go to the lower layer, then the lower expert id."""
    check_strategy(strategy)
    c = torch.as_tensor(counts)
    if c.dim() != 2:
        raise ValueError(f"counts must be [L, E], got shape {tuple(c.shape)}")
    L, E = c.shape
    eb, lb = _per_layer(expert_bytes, L, "expert_bytes"), _per_layer(layer_bytes, L, "layer_bytes")
    budget = int(budget)
    chosen: list[list[int]] = [[] for _ in range(L)]
    if strategy == "none" or budget <= 0:
        return chosen
    rows = c.tolist()
    if strategy == "uniform":
        ok = [i for i in range(L) if eb[i] is not None]

        def cost(n: int) -> int:
            return sum(n * eb[i] + lb[i] for i in ok) if n else 0

        n = E
        while n > 0 and cost(n) > budget:
            n -= 1
        for i in ok:
            chosen[i] = sorted(sorted(range(E), key=lambda e: (-rows[i][e], e))[:n])
        return chosen
    # frequency (and dynamic's start): one ranking across layers
    order = sorted(((i, e) for i in range(L) if eb[i] is not None for e in range(E)),
                   key=lambda p: (-rows[p[0]][p[1]], p[0], p[1]))
    used = 0
    for i, e in order:
        extra = eb[i] + (0 if chosen[i] else lb[i])
        if used + extra <= budget:
            chosen[i].append(e)
            used += extra
    return [sorted(x) for x in chosen]


def chosen_nbytes(chosen: Sequence[Sequence[int]], expert_bytes, layer_bytes=0) -> int:
    """Bytes a choice takes: resident experts plus the tables of layers with any."""
    L = len(chosen)
    eb, lb = _per_layer(expert_bytes, L, "expert_bytes"), _per_layer(layer_bytes, L, "layer_bytes")
    return sum(len(x) * eb[i] + lb[i] for i, x in enumerate(chosen) if x)


def hit_share(counts, chosen: Sequence[Sequence[int]]) -> float:
    """Share of the routed pairs in ``counts`` [L, E] that go to the ``chosen`` experts (0 if counts are empty)."""
    c = torch.as_tensor(counts).double()
    total = float(c.sum())
    if total <= 0:
        return 0.0
    return sum(float(c[i, list(x)].sum()) for i, x in enumerate(chosen) if x) / total


# ---------------------------------------------------------------------------------------------- applying


@dataclass
class Placement:
    """What ``place`` did: experts per layer on the GPU, bank bytes, and h expected from the statistics used."""

    strategy: str
    budget: int
    layers: tuple[str, ...]
    experts: list[list[int]]
    nbytes: int
    expected_share: float | None
    rebalancer: Any = None

    @property
    def resident(self) -> int:
        return sum(len(x) for x in self.experts)

    def __str__(self) -> str:
        from ktinject.plan import human_bytes

        per = sorted({len(x) for x in self.experts})
        share = "n/a" if self.expected_share is None else f"{100 * self.expected_share:.1f}%"
        dyn = f", re-placed every {self.rebalancer.every} tokens" if self.rebalancer is not None else ""
        return (f"hot experts ({self.strategy}{dyn}): {self.resident} on the GPU in {len(self.layers)} layers "
                f"({per[0] if per else 0}..{per[-1] if per else 0} per layer), {human_bytes(self.nbytes)} of "
                f"{human_bytes(self.budget)}; expected share of routed pairs {share}")


def _model_dtype(model) -> torch.dtype:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    w = getattr(emb, "weight", None)
    return w.dtype if isinstance(w, torch.Tensor) and w.is_floating_point() else torch.bfloat16


def _invalidate_graphs(model) -> None:
    """Drop captured decode graphs: they hold the old banks' addresses (or none); the next step captures again."""
    from ktinject.generate import invalidate_graphs

    invalidate_graphs(model)


def rebalancer(model):
    """The model's Rebalancer (``place(..., strategy="dynamic")``), or None. ``model.generate`` calls it once per
    token (place() hooks it into HF's stopping criteria); call its ``step()`` yourself in a hand-written loop."""
    return model.__dict__.get(_REBALANCER_ATTR)


def _hook_generate(model) -> None:
    """Make generate() call the model's Rebalancer once per token: HF's stopping-criteria list gets it appended
    (an instance attribute over ``_get_stopping_criteria``, as ktinject.generate hooks HF; removed by place())."""
    original = getattr(type(model), "_get_stopping_criteria", None)
    if original is None:
        log.warning("placement: %s has no _get_stopping_criteria; pass ktinject.placement.rebalancer(model) to "
                    "generate(stopping_criteria=[...]) yourself", type(model).__name__)
        return

    def hooked(*args, **kwargs):
        criteria = original(model, *args, **kwargs)
        reb = model.__dict__.get(_REBALANCER_ATTR)
        if reb is not None and not any(c is reb for c in criteria):
            criteria.append(reb)
        return criteria

    model.__dict__["_get_stopping_criteria"] = hooked


def _fill(jobs: list[tuple[Any, int, int]], threads: int = 8, window: int = 32) -> None:
    """Load (bank, slot, expert) jobs: experts unpacked from the native copy in threads, copied in order."""
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for lo in range(0, len(jobs), window):
            part = jobs[lo:lo + window]
            loaded = pool.map(lambda j: j[0].host_weights(j[2], pin=j[0].device.type == "cuda"), part)
            for (hot, slot, e), w in zip(part, loaded):
                hot.write_slot(slot, w, non_blocking=True)  # pinned on CUDA; place() synchronizes at the end
                hot.admit(slot, e)


def place(model, budget, strategy: str = "frequency", stats: ExpertStats | str | Path | None = None, *,
          dtype: torch.dtype | None = None, rebalance_every: int | None = None, **rebalance) -> Placement:
    """Choose and load the model's GPU-resident experts (replacing any earlier choice); returns the Placement.

    ``budget``: bytes of banks (int or '12GiB'); ``stats``: ExpertStats or a file from save_stats (default: the
    counts the model has collected so far); ``dtype``: bank dtype (default: the embeddings' dtype); for
    ``dynamic``: ``rebalance_every`` tokens (default 64) and Rebalancer keywords."""
    from ktinject.operators.hot import HotExperts
    from ktinject.operators.rebalance import Rebalancer

    budget, strategy = parse_bytes(budget), check_strategy(strategy)
    blocks = _blocks(model)
    names = tuple(n for n, _ in blocks)
    dtype = dtype or _model_dtype(model)
    _invalidate_graphs(model)  # first: waits for replays that may still read the old banks
    old = model.__dict__.pop(_REBALANCER_ATTR, None)
    if old is not None:
        old.close()
        model.__dict__.pop("_get_stopping_criteria", None)
    for _, b in blocks:  # free old banks before allocating new ones
        if b.hot is not None:
            b.hot.close()
        b.hot = None
        b.skip.zero_()
    E = blocks[0][1].num_experts
    if isinstance(stats, (str, Path)):
        stats = load_stats(stats)
    counts = _aligned_counts(stats, names, E) if stats is not None else read_stats(model).counts
    informed = int(counts.sum()) > 0
    base = strategy
    if strategy == "dynamic":
        base = "frequency" if informed else "uniform"
    elif strategy == "frequency" and not informed and budget > 0:
        log.warning("placement: no expert statistics (collect some or pass stats=...): 'frequency' has nothing to "
                    "rank; using 'uniform' with arbitrary experts")
        base = "uniform"
    eb = [HotExperts.expert_nbytes(b.spec, dtype) if (not b.native_experts.bias or
                                                      getattr(b, "expert_biases", None) is not None) else None
          for _, b in blocks]
    if budget > 0 and strategy != "none" and None in eb:
        log.warning("placement: %d MoE layers keep all experts on the CPU: their gpt-oss biases were not kept (built "
                    "from a packed cache)", eb.count(None))
    lb = [HotExperts.table_nbytes(b.num_experts) for _, b in blocks]
    chosen = choose(counts, budget, eb, base, lb)
    jobs = []
    for (_, b), experts in zip(blocks, chosen):
        if experts:
            b.hot = HotExperts(b, len(experts), dtype=dtype, dynamic=strategy == "dynamic")
            jobs += [(b.hot, s, e) for s, e in enumerate(experts)]
    _fill(jobs)
    nbytes = 0
    for _, b in blocks:
        if b.hot is not None:
            if b.hot.device.type == "cuda":
                torch.cuda.synchronize(b.hot.device)
            b.skip.copy_(b.hot.resident.cpu())
            nbytes += b.hot.nbytes
    assert nbytes <= max(budget, 0) or not jobs, f"placement: {nbytes} bytes exceed the budget {budget}"
    result = Placement(strategy, budget, names, chosen, nbytes, hit_share(counts, chosen) if informed else None)
    if strategy == "dynamic" and jobs:
        result.rebalancer = Rebalancer([b for _, b in blocks], every=rebalance_every or 64, **rebalance)
        model.__dict__[_REBALANCER_ATTR] = result.rebalancer
        _hook_generate(model)
    model.__dict__["_ktinject_placement"] = result
    log.info("%s", result)
    return result


def served_share(model) -> tuple[int, int]:
    """(pairs served by the GPU banks, routed pairs) counted on the device since the last reset_served()."""
    blocks = _blocks(model)
    hits = sum(int(b.hot.hits) for _, b in blocks if b.hot is not None)
    return hits, sum(int(b.counts.sum()) for _, b in blocks)


def reset_served(model) -> None:
    """Zero the banks' hit counters and the routing counts (the two numbers of served_share)."""
    for _, b in _blocks(model):
        b.counts.zero_()
        if b.hot is not None:
            b.hot.hits.zero_()
