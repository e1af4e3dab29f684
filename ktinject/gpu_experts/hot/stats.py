"""Expert activation statistics: how many (token, slot) pairs each layer's router sent to each expert.

Every HybridMoE counts them on its device (``block.counts``, int64 [E]: one ``index_add_`` per forward, no host
sync, so the count is captured with the decode step; graph warm-up steps count too). ``read_stats`` gathers them
into an ``ExpertStats`` (layer names + counts [L, E] on the CPU), ``reset_stats`` zeroes them, ``set_collection``
turns counting off or on, ``save_stats``/``load_stats`` write and read them (safetensors, or JSON for a ``.json``
path; never pickle). ``python -m ktinject.calibrate`` runs prompts and writes them; ``placement`` ranks by them.

Legend: L MoE layers, E experts per layer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ktinject.operators.moe import HybridMoE

STATS_FORMAT = "ktinject.expert_stats"


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
    return [(n, m) for n, m in model.named_modules() if isinstance(m, HybridMoE)]


def injected_blocks(model) -> list[tuple[str, Any]]:
    """hybrid_blocks, or a ValueError when the model has none (not injected)."""
    blocks = hybrid_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no injected MoE blocks (ktinject.inject it first)")
    return blocks


def read_stats(model) -> ExpertStats:
    """The model's counts so far (one device-to-host copy per layer: call between steps, not in a graph)."""
    blocks = injected_blocks(model)
    return ExpertStats(tuple(n for n, _ in blocks), torch.stack([b.counts.detach().cpu() for _, b in blocks]))


def reset_stats(model) -> None:
    """Zero the counts (in place: captured graphs keep counting into the same tensors)."""
    for _, b in injected_blocks(model):
        b.counts.zero_()


def set_collection(model, enabled: bool = True) -> None:
    """Turn counting on or off (captured graphs keep what they were captured with: call before capture)."""
    for _, b in injected_blocks(model):
        b.collect_stats = bool(enabled)


def save_stats(stats: ExpertStats, path) -> Path:
    """Write ``stats``: JSON if ``path`` ends in .json, else safetensors (tensor 'counts' + metadata)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".json":
        doc = {"format": STATS_FORMAT, "version": 1, "layers": list(stats.layers), "counts": stats.counts.tolist()}
        path.write_text(json.dumps(doc) + "\n", encoding="utf-8")
    else:
        meta = {"format": STATS_FORMAT, "version": "1", "layers": json.dumps(list(stats.layers))}
        save_file({"counts": stats.counts.contiguous()}, str(path), metadata=meta)
    return path


def load_stats(path) -> ExpertStats:
    """Read a file written by ``save_stats`` (either format, detected from its content), checked: a list of layer
    names and a [layers, experts] table of non-negative integer counts; a ValueError naming the file and what is
    wrong otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"expert stats file not found: {path}")
    with open(path, "rb") as f:
        head = f.read(1)
    if head.isspace() or head in (b"{", b"["):  # JSON (safetensors starts with its header's length)
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != STATS_FORMAT:
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"{path}: not a ktinject expert stats file (format {got!r}, expected {STATS_FORMAT!r})")
        layers, counts = doc.get("layers"), doc.get("counts")
        try:
            if not all(type(c) is int for row in counts for c in row):  # (torch would truncate 1.5, take True)
                raise TypeError("a count that is not an integer")
            counts = torch.tensor(counts, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise ValueError(f"{path}: \"counts\" is not a table of integers [layers, experts] ({e})") from None
        return _checked(path, layers, counts)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != STATS_FORMAT:
                raise ValueError(f"{path}: not a ktinject expert stats file (format {meta.get('format')!r}, "
                                 f"expected {STATS_FORMAT!r})")
            layers, counts = json.loads(meta.get("layers", "null")), f.get_tensor("counts")
    except (OSError, json.JSONDecodeError, SafetensorError) as e:
        raise ValueError(f"{path}: not a readable expert stats file (JSON or safetensors: {e})") from None
    return _checked(path, layers, counts)


def _checked(path: Path, layers, counts: torch.Tensor) -> ExpertStats:
    if not isinstance(layers, list) or not all(isinstance(n, str) for n in layers):
        raise ValueError(f"{path}: \"layers\" must be a list of MoE layer names, got {type(layers).__name__}")
    if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dim() != 2 or \
            counts.shape[0] != len(layers):
        raise ValueError(f"{path}: \"counts\" must be integers [layers, experts] with a row per layer "
                         f"({len(layers)}), got {counts.dtype} {list(counts.shape)}")
    if counts.numel() and int(counts.min()) < 0:
        raise ValueError(f"{path}: \"counts\" holds a negative count ({int(counts.min())})")
    return ExpertStats(tuple(layers), counts.to(torch.int64))


def aligned_counts(stats: ExpertStats, names: Sequence[str], num_experts: int) -> torch.Tensor:
    """stats.counts rows in the order of ``names`` (the model's MoE blocks)."""
    where = {n: i for i, n in enumerate(stats.layers)}
    missing = [n for n in names if n not in where]
    if missing or stats.counts.shape[1] != num_experts:
        raise ValueError(f"expert stats do not fit this model: {len(missing)} of its MoE layers are not in the stats "
                         f"(e.g. {missing[:2]}), stats have {stats.counts.shape[1]} experts per layer, the model "
                         f"{num_experts}; collect them on this model (python -m ktinject.calibrate)")
    return stats.counts[[where[n] for n in names]]


def hit_share(counts, chosen: Sequence[Sequence[int]]) -> float:
    """Share of the routed pairs in ``counts`` [L, E] that go to the ``chosen`` experts (0 if counts are empty)."""
    c = torch.as_tensor(counts).double()
    total = float(c.sum())
    if total <= 0:
        return 0.0
    return sum(float(c[i, list(x)].sum()) for i, x in enumerate(chosen) if x) / total
