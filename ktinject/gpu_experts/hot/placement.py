"""Choosing and applying the GPU-resident ("hot") experts within a byte budget.

Choosing (pure, ``choose``): given counts [L, E] (``stats``), a byte budget and the bytes one resident expert takes
in each layer (in the dtype used on the GPU) plus each used layer's table bytes, pick the experts that live on the
GPU:
  frequency  one global ranking of (layer, expert) by count, taken greedily while it fits;
  uniform    the same number n in every layer (the largest n that fits), each layer's top n by count;
  none       nothing.
The chosen bytes never exceed the budget. ``dynamic`` starts like ``frequency`` (``uniform`` without statistics) and
then re-ranks at run time (``rebalance.Rebalancer``), keeping each layer's slot count.

Applying (``place``; the entry points call it with their ``settings.HotExpertSettings``): builds each chosen
layer's bank (``bank.HotExperts``) on the block's device, sets the native skip mask, drops captured decode graphs
(the next step captures again, with the banks in it).

CPU copies of GPU-resident experts are kept: native experts are one packed allocation per layer and the skip mask
leaves the resident ones out, so nothing is repacked, a bank can be dropped or re-placed at any time by copying
from the host again, and host memory is what it was without placement (the bytes dropping them would save are the
bank's weight bytes; ``python -m ktinject.bench hot`` prints both).

Legend: L MoE layers, E experts per layer.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ktinject.gpu_experts.hot.bank import HotExperts
from ktinject.gpu_experts.hot.rebalance import Rebalancer
from ktinject.gpu_experts.hot.settings import HotExpertSettings, check_strategy, human_bytes
from ktinject.gpu_experts.hot.stats import ExpertStats, aligned_counts, hit_share, injected_blocks, load_stats, read_stats
from ktinject.operators.base import layout_changed

log = logging.getLogger(__name__)

_REBALANCER_ATTR = "_ktinject_rebalancer"


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
    device: str = "the GPU"  # where the banks live (the device's name when it is not CUDA: a CPU-only run)

    @property
    def resident(self) -> int:
        return sum(len(x) for x in self.experts)

    def __str__(self) -> str:
        per = sorted({len(x) for x in self.experts})
        share = "n/a" if self.expected_share is None else f"{100 * self.expected_share:.1f}%"
        dyn = f", re-placed every {self.rebalancer.every} tokens" if self.rebalancer is not None else ""
        return (f"hot experts ({self.strategy}{dyn}): {self.resident} on {self.device} in {len(self.layers)} layers "
                f"({per[0] if per else 0}..{per[-1] if per else 0} per layer), {human_bytes(self.nbytes)} of "
                f"{human_bytes(self.budget)}; expected share of routed pairs {share}")


def _model_dtype(model) -> torch.dtype:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    w = getattr(emb, "weight", None)
    return w.dtype if isinstance(w, torch.Tensor) and w.is_floating_point() else torch.bfloat16


def rebalancer(model):
    """The model's Rebalancer (``place(..., strategy="dynamic")``), or None. ``model.generate`` calls it once per
    token (place() hooks it into HF's stopping criteria); call its ``step()`` yourself in a hand-written loop."""
    return model.__dict__.get(_REBALANCER_ATTR)


def _hook_generate(model) -> None:
    """Make generate() call the model's Rebalancer once per token: HF's stopping-criteria list gets it appended
    (an instance attribute over ``_get_stopping_criteria``, as ktinject.generate hooks HF; removed by place())."""
    original = getattr(type(model), "_get_stopping_criteria", None)
    if original is None:
        log.warning("placement: %s has no _get_stopping_criteria; pass "
                    "ktinject.gpu_experts.hot.placement.rebalancer(model) to generate(stopping_criteria=[...]) yourself",
                    type(model).__name__)
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


def place(model, budget, strategy: str | None = None, stats: ExpertStats | str | Path | None = None, *,
          dtype: torch.dtype | None = None, rebalance_every: int | None = None, **rebalance) -> Placement:
    """Choose and load the model's GPU-resident experts (replacing any earlier choice); returns the Placement.

    ``budget``, ``strategy``, ``stats``, ``rebalance_every``: as ``settings.HotExpertSettings`` (the same options
    and defaults as ``inject`` and ``from_pretrained``); without ``stats``, the counts the model has collected so
    far rank the experts. ``dtype``: bank dtype (default: the embeddings' dtype); ``rebalance``: Rebalancer
    keywords (dynamic)."""
    return apply_settings(model, HotExpertSettings.make(budget, strategy, stats, rebalance_every), dtype=dtype,
                          **rebalance)


def apply_settings(model, settings: HotExpertSettings, *, dtype: torch.dtype | None = None,
                   **rebalance) -> Placement:
    """``place`` with validated settings (what inject, from_pretrained and the chat call)."""
    if settings.fraction is not None:
        raise ValueError(f"placement: a budget of {settings.request} is measured where the model is injected "
                         f"(inject / from_pretrained); give place() a budget in bytes")
    budget, strategy = settings.budget, settings.strategy
    blocks = injected_blocks(model)
    names = tuple(n for n, _ in blocks)
    dtype = dtype or _model_dtype(model)
    _drop_banks(model, blocks)
    stats = settings.stats
    if isinstance(stats, (str, Path)):
        stats = load_stats(stats)
    counts = aligned_counts(stats, names, blocks[0][1].num_experts) if stats is not None else read_stats(model).counts
    informed = int(counts.sum()) > 0
    base = strategy
    if strategy == "dynamic":
        base = "frequency" if informed else "uniform"
    elif strategy == "frequency" and not informed and budget > 0:
        log.warning("placement: no expert statistics (collect some or pass stats=...): 'frequency' has nothing to "
                    "rank; using 'uniform' with arbitrary experts")
        base = "uniform"
    eb = [HotExperts.expert_nbytes(b.spec, dtype) if (not b.native_experts.bias or b.expert_biases is not None)
          else None for _, b in blocks]
    if budget > 0 and strategy != "none" and None in eb:
        log.warning("placement: %d MoE layers keep all experts on the CPU: their experts have biases (gpt-oss) but "
                    "the HybridMoE holds no expert_biases; build the blocks with the moe operator (inject or "
                    "from_pretrained), which keeps them", eb.count(None))
    chosen = choose(counts, budget, eb, base, [HotExperts.table_nbytes(b.num_experts) for _, b in blocks])
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
    where = {b.hot.device for _, b in blocks if b.hot is not None}
    if where and all(d.type != "cuda" for d in where):
        result.device = ", ".join(sorted(map(str, where))) + " (no GPU: the banks are only exercised there)"
    if strategy == "dynamic" and jobs:
        result.rebalancer = Rebalancer([b for _, b in blocks], every=settings.rebalance_every, **rebalance)
        model.__dict__[_REBALANCER_ATTR] = result.rebalancer
        _hook_generate(model)
    model.__dict__["_ktinject_placement"] = result
    log.info("%s", result)
    return result


def _drop_banks(model, blocks) -> None:
    """Undo an earlier placement: graphs, re-placement, banks (freed before new ones are allocated)."""
    layout_changed(model)  # first: captured graphs hold the old banks' addresses; waits for their replays
    old = model.__dict__.pop(_REBALANCER_ATTR, None)
    if old is not None:
        old.close()
        model.__dict__.pop("_get_stopping_criteria", None)
    for _, b in blocks:
        if b.hot is not None:
            b.hot.close()
        b.hot = None
        b.skip.zero_()


def served_share(model) -> tuple[int, int]:
    """(pairs served by the GPU banks, routed pairs) counted on the device since the last reset_served()."""
    blocks = injected_blocks(model)
    hits = sum(int(b.hot.hits) for _, b in blocks if b.hot is not None)
    return hits, sum(int(b.counts.sum()) for _, b in blocks)


def reset_served(model) -> None:
    """Zero the banks' hit counters and the routing counts (the two numbers of served_share)."""
    for _, b in injected_blocks(model):
        b.counts.zero_()
        if b.hot is not None:
            b.hot.hits.zero_()
