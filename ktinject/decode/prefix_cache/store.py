"""``PrefixCache``: the store a generate or a server consults before a prefill and fills after it.

    cache = PrefixCache(tier="ram", block_size=256)       # tiers gpu | ram | disk: the lowest tier used
    hit = cache.lookup(model, token_ids)                  # longest cached prefix, in whole blocks
    cache.restore(hit, kv, row)                           # K/V of hit.tokens positions into a KVCache row
    ... prefill token_ids[hit.tokens:] into that row ...
    cache.insert(model, token_ids, kv, row)               # store the row's whole blocks not stored yet

A block holds, per layer, the K and V (MLA: the latents as the KVCache holds them) of ``block_size`` positions of
one row (``KVCache.export_row``), and DeepSeek Sparse Attention's indexer keys beside them (``x.<layer>``:
``KVCache.export_index_keys``). State that cannot be cut at a token (the linear-attention layers' conv windows
and recurrent matrices) is stored as a checkpoint beside the block at whose end it was taken (``state_key``): a hit
of such a model ends at a block with one, and its restore puts that state back; a checkpoint is taken when an
insert finds the row's length at a block boundary (``ktinject.generate`` prefills up to the prompt's last whole
block first, so it does). Layouts the KVCache does not hold (DeepSeek-V4's compressed caches: ``stateful_layers``)
are not cached: ``uncacheable_reason`` says why, and lookups of such a model miss.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from ktinject.decode import kv_cache, stateful_layers
from ktinject.decode.prefix_cache import keys as block_keys
from ktinject.decode.prefix_cache.tiers import TIER_NAMES, DiskTier, MemoryTier, Tiers

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 256
DEFAULT_BUDGETS = {"gpu": 4 * 2**30, "ram": 8 * 2**30, "disk": 64 * 2**30}
_ROOT_ATTR = "_ktinject_prefix_root"
_FINGERPRINT_SAMPLES = 64


def default_disk_path() -> Path:
    """``$XDG_CACHE_HOME/ktinject/prefix``, else ``~/.cache/ktinject/prefix``."""
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "ktinject" / "prefix"


def uncacheable_reason(model) -> str | None:
    """Why ``model``'s cache state cannot be stored by prefix, or None."""
    reason = stateful_layers.prefix_uncached_reason(model)
    if reason is None:
        return None
    return f"prefix cache off for {type(model).__name__}: {reason.split(':')[0]}; every prompt is prefilled whole"


def _weights_fingerprint(model) -> list:
    """(name, dtype, shape, sampled values) of every parameter and buffer off the meta device: tells two models'
    weights apart without reading them all."""
    out = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type == "meta" or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)
        n = min(_FINGERPRINT_SAMPLES, flat.numel())  # evenly spaced, in integers (a float linspace rounds past
        idx = torch.arange(n, device=flat.device) * (flat.numel() - 1) // max(n - 1, 1)  # the end above 2^24)
        sample = flat[idx].to("cpu", torch.float64).tolist()
        out.append((name, str(t.dtype), tuple(t.shape), sample))
    return out


def _experts_fingerprint(model) -> list:
    """(module name, sampled bytes) of every routed-experts module's packed storage (``native_experts``, in the
    native core's memory: not a parameter), so two models that differ only in their experts' values differ."""
    from ktinject.native.packed_views import experts_region_view

    out = []
    for name, m in model.named_modules():
        experts = getattr(m, "native_experts", None)
        if experts is None:
            continue
        _, view = experts_region_view(experts)
        words = view[:view.numel() // 8 * 8].view(torch.int64)  # whole 8-byte words: every byte of a value
        n = min(_FINGERPRINT_SAMPLES * 8, words.numel())
        idx = torch.arange(n) * (words.numel() - 1) // max(n - 1, 1)
        out.append((name, words[idx].tolist()))
    return out


def identity_parts(model, block_size: int) -> dict:
    """What a model's cached values depend on (the parts of its root key)."""
    from importlib import metadata

    import transformers

    try:
        version = metadata.version("ktinject")
    except metadata.PackageNotFoundError:
        version = "unknown"

    config = model.config.to_dict() if hasattr(model.config, "to_dict") else repr(model.config)
    fields = ("quant", "group_size", "num_experts", "hidden", "intermediate", "activation", "bias")
    experts = sorted({(*(repr(getattr(m.native_experts, f, None)) for f in fields), repr(getattr(m, "defer", None)))
                      for m in model.modules() if getattr(m, "native_experts", None) is not None})
    return {"layout": "kv_cache rows", "block_size": block_size, "model": type(model).__name__, "config": config,
            "plan": repr(getattr(model, "_ktinject_plan", None)), "experts": experts,
            "weights": _weights_fingerprint(model), "expert_values": _experts_fingerprint(model),
            "ktinject": version, "torch": torch.__version__,
            "transformers": transformers.__version__}


@dataclass
class Hit:
    """A lookup's answer: ``tokens`` cached positions (whole blocks, at most the prompt less its last token) and
    the keys of those blocks."""

    tokens: int
    keys: list[str]
    block_size: int
    reason: str | None = None  # why nothing could be reused (an uncacheable model), or None


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hit_tokens: int = 0  # prompt tokens restored instead of computed
    lookup_tokens: int = 0
    inserted_blocks: int = 0
    state_checkpoints: int = 0  # linear-attention states stored at block boundaries (hybrid models)
    hits: dict = field(default_factory=lambda: dict.fromkeys(TIER_NAMES, 0))  # blocks restored, per tier found in


class PrefixCache:
    """The store (see the module docstring). ``tier``: the lowest tier used (gpu: GPU memory only; ram: GPU and
    host RAM, page-locked where CUDA is; disk: both and the directory ``disk_path``); ``*_bytes``: each tier's
    budget (0 leaves a memory tier out: ``tier="disk", gpu_bytes=0, ram_bytes=0`` reads every hit from disk);
    ``device``: the GPU tier's device (None: ``cuda`` where available, else no GPU tier);
    ``keep_generated``: a generate also stores the positions its decode steps computed (the reply), so a follow-up
    that resends the reply prefills only what is new (a chat); their values are a decode step's, which may round
    differently from a prefill of the same tokens. Off, only prompt positions (computed by prefills) are stored,
    and a hit gives what a whole prefill gives."""

    def __init__(self, tier: str = "ram", block_size: int = DEFAULT_BLOCK_SIZE, gpu_bytes: int | None = None,
                 ram_bytes: int | None = None, disk_bytes: int | None = None, disk_path=None, device=None,
                 keep_generated: bool = False):
        if tier not in TIER_NAMES:
            raise ValueError(f"prefix cache tier must be one of {', '.join(TIER_NAMES)}, got {tier!r}")
        if int(block_size) < 1:
            raise ValueError(f"prefix cache block_size must be >= 1 token, got {block_size}")
        self.block_size, self.tier, self.keep_generated = int(block_size), tier, bool(keep_generated)
        cuda = device is not None and torch.device(device).type == "cuda" or (
            device is None and torch.cuda.is_available())
        budgets = {"gpu": gpu_bytes, "ram": ram_bytes, "disk": disk_bytes}
        budgets = {k: DEFAULT_BUDGETS[k] if v is None else int(v) for k, v in budgets.items()}
        memory = []
        if cuda and budgets["gpu"] > 0:
            memory.append(MemoryTier("gpu", device or "cuda", budgets["gpu"]))
        if (tier in ("ram", "disk") or not cuda) and budgets["ram"] > 0:
            memory.append(MemoryTier("ram", "cpu", budgets["ram"], pinned=cuda))
        disk = DiskTier(disk_path or default_disk_path(), budgets["disk"]) if tier == "disk" else None
        self.tiers = Tiers(memory, disk)
        self.stats = PrefixCacheStats()

    # ---- keys ----------------------------------------------------------------------------------------------
    def root(self, model) -> str:
        """The model's root key (computed once per model and block size)."""
        cached = model.__dict__.get(_ROOT_ATTR)
        if cached is None or cached[0] != self.block_size:
            cached = model.__dict__[_ROOT_ATTR] = (self.block_size,
                                                   block_keys.root_key(identity_parts(model, self.block_size)))
        return cached[1]

    def keys(self, model, tokens: Sequence[int]) -> list[str]:
        return block_keys.block_keys(tokens, self.block_size, self.root(model))

    # ---- the three calls -----------------------------------------------------------------------------------
    def lookup(self, model, tokens: Sequence[int]) -> Hit:
        """The longest cached prefix of ``tokens`` (whole blocks, leaving the last token to compute)."""
        tokens = _as_list(tokens)
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(tokens)
        reason = uncacheable_reason(model)
        if reason is not None:
            return Hit(0, [], self.block_size, reason)
        limit = block_keys.usable_hit_tokens(len(tokens), len(tokens)) // self.block_size
        keys = self.keys(model, tokens[:limit * self.block_size])
        n = block_keys.hit_blocks(keys, self.tiers.holds)
        if stateful_layers.needs_state_checkpoints(model):  # a hit ends where a state checkpoint was taken
            while n and not self.tiers.holds(state_key(keys[n - 1])):
                n -= 1
        return Hit(n * self.block_size, keys[:n], self.block_size)

    def restore(self, hit: Hit, cache, row: int) -> int:
        """Write ``hit``'s blocks into ``row`` of ``cache`` (a KVCache) from position 0; the row's length becomes
        the restored tokens, returned (fewer than ``hit.tokens`` where a block went missing or failed its check
        meanwhile: the rest is then computed)."""
        if not kv_cache.is_kv_cache(cache):
            raise TypeError(f"PrefixCache.restore needs a ktinject KVCache, got {type(cache).__name__}")
        done = 0
        cache.lengths[:, row] = 0
        for key in hit.keys:
            found = self.tiers.get(key)
            if found is None:
                break
            block, tier = found
            n_layers = len(cache.kv_layers())
            kv = [(block[f"k.{i}"], block[f"v.{i}"]) for i in range(n_layers)]
            cache.import_row(row, [(k.to(_device(cache, k)), v.to(_device(cache, v))) for k, v in kv], start=done)
            index = [block.get(f"x.{i}") for i in range(n_layers)]  # DSA's indexer keys, where the model has them
            if any(x is not None for x in index):
                cache.import_index_keys(row, [None if x is None else x.to(_device(cache, x)) for x in index],
                                        start=done)
            done += self.block_size
            self.stats.hits[tier] += 1
            self.tiers.all[[t.name for t in self.tiers.all].index(tier)].stats.hits += 1
        if done and cache.linear is not None:  # the state at the last restored block's end
            found = self.tiers.get(state_key(hit.keys[done // self.block_size - 1]))
            if found is None:  # (evicted or damaged meanwhile): nothing restored, the prompt is computed whole
                cache.reset_rows(row)
                return 0
            cache.import_state(row, found[0])
        self.stats.hit_tokens += done
        return done

    def insert(self, model, tokens: Sequence[int], cache, row: int, length: int | None = None) -> int:
        """Store the whole blocks of ``row`` of ``cache`` (its first ``length`` positions, default the row's
        length, whose tokens are ``tokens``) that are not stored yet; the blocks added."""
        if uncacheable_reason(model) is not None or not kv_cache.is_kv_cache(cache):
            return 0
        tokens = _as_list(tokens)
        held = int(cache.lengths[0, row])
        n = min(len(tokens), held if length is None else int(length))
        added = 0
        keys = self.keys(model, tokens[:n])
        for i, key in enumerate(keys):
            if self.tiers.holds(key):
                continue
            start = i * self.block_size
            kv = cache.export_row(row, start, start + self.block_size)
            block = {f"{kind}.{j}": t for j, pair in enumerate(kv) for kind, t in zip("kv", pair)}
            block.update({f"x.{j}": t for j, t in enumerate(cache.export_index_keys(row, start, start + self.block_size))
                          if t is not None})
            self.tiers.put(key, block)
            added += 1
        if cache.linear is not None and keys and held == len(keys) * self.block_size and \
                not self.tiers.holds(state_key(keys[-1])):  # the row's state is at a block boundary: checkpoint it
            self.tiers.put(state_key(keys[-1]), cache.export_state(row))
            self.stats.state_checkpoints += 1
        self.stats.inserted_blocks += added
        return added

    def why_uncached(self, model) -> str | None:
        """``uncacheable_reason(model)``: why lookups of ``model`` miss, or None."""
        return uncacheable_reason(model)

    # ---- reporting -----------------------------------------------------------------------------------------
    def describe(self) -> list[str]:
        """Lines for a /stats or a log: reused tokens, then per tier its hits, blocks and bytes."""
        s = self.stats
        lines = [f"prefix cache: {s.hit_tokens} of {s.lookup_tokens} prompt tokens reused in {s.lookups} lookups, "
                 f"blocks of {self.block_size} tokens"]
        for t in self.tiers.all:
            lines.append(f"prefix cache {t.name}: {s.hits[t.name]} block hits, {t.stats.blocks} blocks, "
                         f"{t.stats.bytes / 2**20:.1f} MiB of {t.budget / 2**20:.0f} MiB"
                         + (f", {t.stats.rejected} damaged blocks dropped" if t.stats.rejected else ""))
        return lines

    def clear(self) -> None:
        """Forget every block (the disk tier's files too)."""
        self.tiers.clear()


def state_key(block_key: str) -> str:
    """The key of the state checkpoint taken at the end of the block ``block_key`` (hybrid models)."""
    return f"{block_key}-state"


def _device(cache, t: torch.Tensor) -> torch.device:
    layer = cache.kv_layers()[0]
    return layer.keys.device if layer.is_initialized else cache.lengths.device


def _as_list(tokens) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ValueError(f"prefix cache: token ids of one row expected, got shape {tuple(tokens.shape)}")
        return tokens.tolist()
    return [int(t) for t in tokens]
