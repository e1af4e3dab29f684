"""CUDA graph capture and replay of the decode step (embedding -> logits), one graph per batch bucket.

``GraphRunner`` takes the place of the ``torch.compile``'d forward that Hugging Face ``generate()`` asks for through
``model.get_compiled_call`` (see ``ktinject.generate``): HF keeps its loop (logits processors, sampling, stopping
criteria, streamers) and calls the runner once per step with the step's inputs. A decode step (input_ids [B,1]) of
a bucket batch size B replays the graph captured for it; anything else (prefill chunks, batch sizes without a
bucket, output_attentions, no CUDA) runs the model eagerly.

Static state (addresses fixed for the life of the graphs):
- one ``ktinject.decode.kv_cache.KVCache`` of ``max_cache_len`` tokens x ``slots`` rows; a batch of B rows uses rows
  0..B-1 (a view). Each row's length is a device tensor that a forward advances in place, so a replay writes K/V
  at every row's own position with no host involvement, and the step's masks are built from those lengths inside
  the graph (rows may sit at different positions; sliding-window layers are masks too, so gpt-oss replays); the
  gated-DeltaNet layers of hybrid models (Qwen3-Next, Qwen3.5) keep their conv and recurrent states in the same
  cache, per row, written in place by the step; a new ``generate`` resets the rows in place (lengths to zero,
  linear-attention states zeroed);
- per graph, input buffers filled before each replay: input_ids [B,1], position_ids [B,1] and the attention mask:
  either the 4D mask [B,1,1,L] that HF builds for static caches, or (through ``ktinject.generate``, which stops HF
  from building that mask on the host every step) the 2D padding mask [B,n] of the n tokens so far, copied into a
  static [B,L] buffer (the rest is masked as future positions anyway): the runner builds the 4D masks from it and
  the rows' lengths inside the graph (L = max_cache_len);
- MoE blocks: while warming up and capturing, HybridMoE goes through ``ktinject.operators.handshake`` (the stream raises
  a pinned go flag that a native pool thread watches, then waits for its done flag), one runner per (layer, B); with
  expert deferral (``ktinject.operators.deferral``) a layer's deferred task follows its immediate one on the CPU and
  the next layer waits for it; the deferral setting is part of a graph's key.
  Just before each replay the runner wakes those pools (``Pool.wake``): their threads spin through the step, so
  no layer's go pays a futex wake-up, and sleep again ~1 ms after its last layer (KTINJECT_WATCH_SPIN_US).

Capture (``ktinject.decode.graph_capture``): two warm-up steps on a side stream, with the cache counters (and
linear-attention states) put back after each, then the capture itself, which executes nothing, in ``graph_pieces`` graphs cut at decoder layers.
Legend: B batch, L max cache length, V vocabulary.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ktinject import compat
from ktinject.decode.graph_capture import (CapturedGraph, capture_pieces, decoder_layers, fill_static, static_input,
                                           warm_up)
from ktinject.operators import fast_path_report as fastpaths
from ktinject.operators import handshake as stream_experts
from ktinject.operators import deferral

log = logging.getLogger(__name__)

#: tensor arguments a decode step may carry into a graph (copied into static buffers before each replay)
GRAPH_TENSOR_ARGS = ("input_ids", "position_ids", "attention_mask")
#: keyword arguments that, when truthy, force the eager path
EAGER_FLAGS = ("output_attentions", "output_hidden_states", "output_router_logits", "inputs_embeds", "labels")


def choose_bucket(batch: int, buckets) -> int | None:
    """Smallest bucket >= batch (the graph a padded batch would use); None if the batch is larger than all."""
    fitting = [b for b in buckets if b >= batch]
    return min(fitting) if fitting else None


def round_cache_len(needed: int, minimum: int = 256, limit: int | None = None) -> int:
    """Cache length for ``needed`` tokens: the next power of two >= needed (>= minimum), capped at ``limit``."""
    n = max(int(minimum), 1)
    while n < needed:
        n *= 2
    if limit is not None and needed <= limit < n:
        n = limit
    return n


@dataclass
class RunnerStats:
    captures: int = 0
    replays: int = 0
    eager_decode: int = 0
    eager_other: int = 0
    capture_failures: list = field(default_factory=list)


def no_cuda_reason(device: torch.device) -> str:
    """Why decode steps of a model on ``device`` (not CUDA) run eagerly (``ktinject.info`` says it before a run)."""
    return f"the model is on {device.type}, graphs need CUDA"


class GraphRunner:
    """Decode-step graphs of one model, per batch bucket, with static caches and an eager fallback.

    ``buckets``: batch sizes that get a graph; ``max_cache_len``: tokens per cache (None: sized by the first
    generate, a power of two >= 1024 on CUDA, >= 256 on the CPU; it grows, dropping caches and graphs, when a
    generate needs more); ``prefill_chunk``: prompt tokens per eager prefill forward (bounds activation memory;
    "auto": from the free GPU memory where prompts' experts are streamed to it, ``ktinject.decode.generate.prefill_chunk``);
    ``use_graphs``: None = on CUDA, False = eager only (same static caches, for comparison); ``pad_batches``:
    pad a batch size without a bucket up to the next bucket (None: when graphs are on); ``host_wait``: how the
    host thread waits for the GPU once graphs are used ("block" sleeps, leaving every core to the native expert
    threads; "spin" busy-waits; None leaves CUDA's choice, which spins on one core) - process-wide; ``own_masks``:
    decode steps through ``ktinject.generate`` take the 2D padding mask and build the 4D mask inside the graph
    (False: HF builds it on the host every step, as before); ``graph_pieces``: the step is captured as this many
    graphs cut at decoder-layer boundaries and replayed in order, so the GPU starts while the host still launches
    the later pieces (default 1: one graph; more pieces showed no gain beyond run-to-run noise); ``defer_stop``:
    ``ktinject.generate`` reads the stop decision one step late so the host queues the next step while the device
    runs this one (False: HF's per-step synchronisation)."""

    def __init__(self, model, buckets=(1, 2, 4, 8), max_cache_len: int | None = None,
                 prefill_chunk: int | str | None = "auto", use_graphs: bool | None = None,
                 pad_batches: bool | None = None, host_wait: str | None = "block", warmup: int = 2,
                 own_masks: bool = True, graph_pieces: int = 1, defer_stop: bool = True):
        self.model = model
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets!r}")
        self.max_cache_len = int(max_cache_len) if max_cache_len else 0
        self.prefill_chunk = "auto" if prefill_chunk == "auto" else int(prefill_chunk) if prefill_chunk else None
        self.use_graphs = use_graphs
        self.pad_batches = pad_batches
        self.host_wait = host_wait
        self.warmup = int(warmup)
        self.own_masks = bool(own_masks)
        if int(graph_pieces) < 1:
            raise ValueError(f"graph_pieces must be >= 1, got {graph_pieces!r}")
        self.graph_pieces = int(graph_pieces)
        self.defer_stop = bool(defer_stop)
        self.kv = None  # the KVCache (ktinject.decode.kv_cache), made by cache_for
        self.caches: dict[int, Any] = {}  # batch -> rows 0..batch-1 of self.kv
        self.graphs: dict[tuple, CapturedGraph | None] = {}  # key -> graph (None: capture failed, eager)
        self.stats = RunnerStats()
        self._pool = None

    # ---- configuration -------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(p.device for p in self.model.parameters() if p.device.type != "meta")

    def graphs_enabled(self) -> bool:
        if self.use_graphs is False:
            return False
        return self.device.type == "cuda" and torch.cuda.is_available()

    def bucket_for(self, batch: int) -> int | None:
        return choose_bucket(batch, self.buckets)

    def padded_batch(self, batch: int) -> int:
        """Rows a generate of ``batch`` rows runs with (its bucket when padding is on and one fits)."""
        pad = self.graphs_enabled() if self.pad_batches is None else self.pad_batches
        if not pad or batch in self.buckets:
            return batch
        bucket = self.bucket_for(batch)
        return batch if bucket is None else bucket

    def max_len_limit(self) -> int | None:
        cfg = self.model.config.get_text_config(decoder=True) if hasattr(self.model.config, "get_text_config") \
            else self.model.config
        return getattr(cfg, "max_position_embeddings", None)

    # ---- caches --------------------------------------------------------------------------------------------
    def cache_for(self, batch: int, needed_len: int):
        """Rows 0..batch-1 of the runner's KVCache (``ktinject.decode.kv_cache``), reset, with room for ``needed_len``
        tokens. One cache per runner, of ``slots`` rows (the largest bucket, or the batch if larger); growing its
        length or rows drops it and every graph (their shapes change); otherwise nothing is re-captured."""
        from ktinject.decode import kv_cache, stateful_layers

        stateful = stateful_layers.remember(self.model)
        if stateful is not None:
            raise ValueError(f"{type(self.model).__name__}: {stateful}; ktinject's KVCache cannot serve this "
                             f"model (use its generate(), which runs Hugging Face's)")
        slots = max(batch, max(self.buckets))
        if needed_len > self.max_cache_len or (self.kv is not None and batch > self.kv.slots):
            if needed_len > self.max_cache_len:
                floor = self.max_cache_len or (1024 if self.device.type == "cuda" else 256)
                new_len = round_cache_len(needed_len, floor, self.max_len_limit())
                if self.max_cache_len:
                    log.info("ktinject graph: cache length %d -> %d tokens (graphs are captured again)",
                             self.max_cache_len, new_len)
                self.max_cache_len = new_len
            self.reset()
        if self.kv is None:
            self.kv = kv_cache.new(self.model.config, slots, self.max_cache_len, self.device)
        cache = self.caches.get(batch)
        if cache is None:
            cache = self.caches[batch] = self.kv.rows(0, batch)
        cache.reset()  # lengths (and linear-attention states) in place: the graphs keep their addresses
        return cache

    def rows(self, batch: int):
        """Rows 0..batch-1 of the runner's KVCache as made by ``cache_for`` (not reset): the cache object whose
        decode steps replay the graph of bucket ``batch``. KeyError before ``cache_for(batch, ...)``."""
        return self.caches[batch]

    def graphable_cache(self, cache) -> bool:
        """Caches whose whole state lives in device tensors a graph can replay: ktinject's KVCache."""
        from ktinject.decode import kv_cache

        return kv_cache.is_kv_cache(cache)

    def _forward(self, kwargs):
        """The model on ``kwargs``; on a KVCache, a 2D padding mask (or none) becomes the step's masks, built on the
        device from the rows' lengths (inside the graph when captured)."""
        from ktinject.decode import kv_cache

        cache = compat.cache_from(kwargs)
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids")
        if kv_cache.is_kv_cache(cache) and ids is not None and (mask is None or (torch.is_tensor(mask) and mask.dim() == 2)):
            B, S = ids.shape
            kwargs = dict(kwargs)
            kwargs["attention_mask"] = kv_cache.attention_masks(
                self.model.config, cache.row_lengths[:B], S, cache.max_len, mask, kv_cache.mask_float_dtype(self.model))
        return self.model(**kwargs)

    # ---- the step ------------------------------------------------------------------------------------------
    def __call__(self, **kwargs):
        """One forward with HF's keyword arguments: a graph replay for a bucketed decode step, else eager."""
        key, why = self._classify(kwargs)
        if key is None:
            return self._eager(kwargs, why)
        entry = self.graphs.get(key, False)
        if entry is False:
            entry = self.graphs[key] = self._capture(key, kwargs)
        if entry is None:
            self.stats.eager_decode += 1
            fastpaths.report_for(self.model).fell_back("graph_decode", f"the capture of batch {key[0]} failed")
            return self._forward(kwargs)
        for pool in entry.pools:
            pool.wake()  # expert threads spin from now on: the first layer's go pays no futex wake-up
        for name, buf in entry.inputs.items():
            fill_static(buf, kwargs[name])
        entry.graph.replay()
        entry.replays += 1
        self.stats.replays += 1
        fastpaths.report_for(self.model).ran("graph_decode")
        return entry.output

    def _eager(self, kwargs, why: tuple[str, bool] | None = None):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.dim() == 2 and ids.shape[1] == 1:
            self.stats.eager_decode += 1
            if why is not None:
                fastpaths.report_for(self.model).fell_back("graph_decode", *why)
        else:
            self.stats.eager_other += 1
        return self._forward(kwargs)

    def _key(self, kwargs) -> tuple | None:
        """Hashable description of a graphable decode step, or None for the eager path."""
        return self._classify(kwargs)[0]

    def _classify(self, kwargs) -> tuple[tuple | None, tuple[str, bool] | None]:
        """(key, None) for a graphable decode step, else (None, (why eager, whether that is expected)); see
        ``ktinject.operators.fast_path_report`` for what counts as expected."""
        if not self.graphs_enabled():
            return None, ("graphs are off (use_graphs=False)" if self.use_graphs is False else
                          no_cuda_reason(self.device), True)
        ids = kwargs.get("input_ids")
        cache = compat.cache_from(kwargs)
        if ids is None or ids.dim() != 2 or ids.shape[1] != 1 or not ids.is_cuda:
            return None, ("not a one-token step of input_ids on the GPU", True)
        batch = ids.shape[0]
        stray = compat.stray_cache(kwargs) if cache is None else None
        if stray:
            return None, (stray, False)
        if batch not in self.buckets:
            return None, (f"batch {batch} has no bucket (buckets {self.buckets})", True)
        if self.caches.get(batch) is not cache:
            return None, ("the step's cache is not the runner's static cache", True)
        if not self.graphable_cache(cache):
            return None, ("a cache layer keeps its position in Python (sliding window)", True)
        for name in EAGER_FLAGS:
            flag = kwargs.get(name)
            if isinstance(flag, torch.Tensor) or flag:
                return None, (f"{name} asked for", True)
        parts = []
        for name, value in sorted(kwargs.items()):
            if name in compat.CACHE_NAMES:
                continue
            if isinstance(value, torch.Tensor):
                if name not in GRAPH_TENSOR_ARGS or value.device != ids.device:
                    held = ", ".join(GRAPH_TENSOR_ARGS)
                    return None, (f"tensor argument {name!r} is not one the graph holds ({held})", False)
                if name == "attention_mask" and value.dim() == 2:  # padding mask of the tokens so far: grows
                    if value.shape[0] != batch or value.shape[1] > self.max_cache_len:
                        return None, ("a 2D mask longer than the static cache", False)
                    parts.append((name, "2d", value.dtype))
                else:
                    parts.append((name, tuple(value.shape), value.dtype))
            elif value is None or isinstance(value, (bool, int, float, str)):
                parts.append((name, value))
            else:
                return None, (f"argument {name!r} of type {type(value).__name__} cannot be held static", False)
        chain = deferral.chain_of(self.model)  # a graph holds one expert-deferral setting: a new one captures anew
        return (batch, tuple(parts), chain.setting if chain is not None else ()), None

    def _capture(self, key, kwargs) -> CapturedGraph | None:
        cache = compat.cache_from(kwargs)
        if self.host_wait:
            from ktinject.native import cuda_driver

            if not cuda_driver.set_host_wait_mode(self.host_wait):
                log.info("ktinject graph: cannot set the host wait mode (driver older than CUDA 12.1)")
        inputs = {n: static_input(n, v, self.max_cache_len) for n, v in kwargs.items() if isinstance(v, torch.Tensor)}
        rest = {n: v for n, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        saved = cache.save_step_state()
        try:
            warm_up(self._forward, inputs, rest, cache, saved, self.warmup, self.device)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph, output = capture_pieces(self._forward, inputs, rest, decoder_layers(self.model), self.graph_pieces,
                                           self._pool, self.device)
        except Exception as e:  # noqa: BLE001 - any capture problem means: run this shape eagerly
            torch.cuda.synchronize(self.device)
            cache.restore_step_state(saved)
            self._after_failed_step(key[0])
            fastpaths.report_for(self.model).fell_back(
                "graph_decode", f"capture of batch {key[0]} failed: {type(e).__name__}: {e}")
            self.stats.capture_failures.append(f"batch {key[0]}: {type(e).__name__}: {e}")
            return None
        self.stats.captures += 1
        log.info("ktinject graph: captured the decode step for batch %d", key[0])
        return CapturedGraph(graph, inputs, output, pools=self._pools())

    def _after_failed_step(self, tokens: int) -> None:
        """A warm-up cut short may have left a go without its collect, a pending lazy collect and deferred work in
        flight: reset the runners of ``tokens`` tokens a step, the MoE blocks' lazy hand-over and the deferral
        chain (the device synchronized), so that the eager steps and a later capture start clean."""
        for r in self._stream_runners(tokens):
            try:
                r.reset()
            except Exception as e:  # noqa: BLE001 - one runner's failure must not keep the others stale
                log.warning("ktinject graph: resetting a stream-experts runner after a failed capture: %s", e)
        for module in self.model.modules():
            if hasattr(module, "take_lazy_collect"):
                module.take_lazy_collect()  # (clears the hand-over; its runner was reset above)
        chain = deferral.chain_of(self.model)
        if chain is not None:
            chain.forget()

    def _stream_runners(self, tokens: int | None = None) -> list:
        """This model's stream-experts runners (of ``tokens`` tokens a step where given)."""
        found = []
        for module in self.model.modules():
            experts = getattr(module, "native_experts", None)
            if experts is not None:
                found += [r for r in stream_experts.runners(experts) if tokens is None or r.T == tokens]
        return found

    def _pools(self) -> tuple:
        """The native pools of this model's stream-experts runners (one per pool)."""
        return tuple({id(r.task.pool): r.task.pool for r in self._stream_runners()}.values())

    # ---- lifetime ------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every graph and cache (stream-experts runners stay cached for the next capture)."""
        if self.graphs and torch.cuda.is_available():
            torch.cuda.synchronize()
        self.graphs.clear()
        self.caches.clear()
        self.kv = None
        # a fresh memory pool for the next captures: capturing into the pool of graphs that no longer exist trips
        # the caching allocator's use_count assert (seen on torch 2.11 when placement re-captured)
        self._pool = None

    def close(self) -> None:
        """reset() and stop the stream-experts runners of this model's MoE blocks."""
        self.reset()
        for module in self.model.modules():
            experts = getattr(module, "native_experts", None)
            if experts is not None:
                stream_experts.release(experts)

    def describe(self) -> str:
        s = self.stats
        return (f"GraphRunner(buckets={self.buckets}, max_cache_len={self.max_cache_len}, "
                f"prefill_chunk={self.prefill_chunk}, graphs={'on' if self.graphs_enabled() else 'off'}, "
                f"captured={sorted(k[0] for k, g in self.graphs.items() if g is not None)}, replays={s.replays}, "
                f"eager decode={s.eager_decode}, eager other={s.eager_other})")

    __repr__ = describe
