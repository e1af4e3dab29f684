"""A prefill layer shared by the CPU and the GPU (split and ahead modes of ``stream.PrefillStreamer``; a mixin: the
streamer decides, ``streamed`` streams, this shares a layer).

    _split    the routing synced to the host, the experts parted (the GPU's set: ``policy.choose_split`` or ahead
              mode's fixed one), the CPU's part submitted to the native pool, the GPU's part queued, the two outputs
              summed on the device
    _settle   the layer before's CPU task, left running (below), waited for and its times fed back

Overlap (KTINJECT_PREFILL_OVERLAP=0 turns it off, with the CPU path's: ``operators/cpu_overlap.py``): the host does
not wait for a layer's CPU task. The task raises a pinned done word when its output is written
(``native.Task.signal``), a one-warp kernel waits for that word before the kernel that adds the CPU's output to the
GPU's (``hostio.combine``), and the host goes on to queue the next layer's dense part (attention: ~2 ms of launches
a layer at 512 tokens on the H100, as long as the CPU's work at int8) while the CPU computes, where it used to wait
first and launch after. The next layer's routing sync then waits for the GPU, which waits for the task: from then on
the task's buffers (inputs, output, skip mask) are free, so nothing is rewritten under it. The task's times come from
the native side (``Task.times``) at that next layer (``_settle``), which also raises the task's error. Where it does
not apply the host waits as before: the last MoE layer of a forward (its output ends the forward), without the
pinned-buffer kernels (``hostio.usable``), off CUDA.
Legend: T tokens, k experts per token, E experts, H hidden.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ktinject import native, stream_experts
from ktinject.gpu_experts import hostio, policy
from ktinject.gpu_experts.streamed import resident
from ktinject.operators import cpu_overlap
from ktinject.operators.families import shared_output
from ktinject.operators.routing import staging

log = logging.getLogger(__name__)


class SplitLayers:
    """Mixin of ``PrefillStreamer``: its split / ahead layers (see the module docstring). Uses the streamer's
    ``blocks``, ``cuda``, ``feedback``, ``ring``, ``layouts``, ``cap``, ``last``, ``_seen``, ``_sets``,
    ``_n_ahead``, ``_costs``, ``costs_for``, ``_costs_key``, ``_set``, ``_take`` and ``_stream``."""

    _pending: tuple | None = None  # the layer whose CPU task the host left running (``_settle``)

    def _split(self, i, block, x, ids, weights, ahead: bool = False):
        """The experts with the most rows on the GPU, the rest in the native kernels, at the same time. ``ahead``:
        the GPU's experts are the layer's fixed set (``_set``), fetched during the layer before. The GPU's work (and
        the next layer's copy) is queued after the CPU's task is submitted, so that its launches (and any host sync
        in them) overlap the CPU's work, not precede it."""
        entered = time.perf_counter()
        T, H = x.shape
        E = block.num_experts
        st = staging(pin=self.cuda)
        o = st.get("out", T, H, stream_experts.host_dtype(x.dtype))
        io = self.cuda and hostio.usable(x.device, o)  # kernels, not copies (hostio says why); the staging's buffers
        h, i_, w = st.inputs("", x, ids, weights, non_blocking=self.cuda,  # are pinned alike
                             to_host=hostio.to_host if io else None)
        shared = extra = streamed = None
        hot = resident(block)
        gpu = first = None
        if ahead:
            gpu = self._set(i)
            del self._sets[i]  # the next ask (the next forward's prefetch) picks from the rows seen by then
            first = self._take(i, gpu) if gpu else None
        if self.cuda:
            copied = self._event()
            copied.record()
            shared = shared_output(block, block.spec.shared, x)  # queued: overlaps what follows
            extra = None if block.hot is None else block.hot(x, ids, weights)
            copied.synchronize()
        synced = time.perf_counter()
        settled = self._settle(i, T)  # the GPU has passed the layer before's combine: its CPU task is done
        counts = torch.bincount(i_.reshape(-1), minlength=E).numpy()
        old = self._seen.get(i)
        self._seen[i] = counts.astype(np.float64) + (0.0 if old is None else 0.5 * old)
        if not ahead:
            gpu = policy.choose_split(counts, ~hot, self.costs_for(block, T))
        self.last["gpu_experts"].append(len(gpu))
        skip = self._skip(E)
        skip.zero_()
        skip.numpy()[hot] = 1
        skip.numpy()[gpu] = 1
        cpu_counts = np.where(skip.numpy() == 0, counts, 0)
        task = self._task()
        task.bind(block.native_experts, h, i_, w, skip=skip, out=o)
        overlap = io and i < len(self.blocks) - 1 and cpu_overlap.enabled()
        if overlap:
            # the task's signal word, reset: the layer before's wait kernel has seen it (this layer's routing sync
            # passed it; one stream: a forward abandoned mid-way on another stream could still be waiting, and would
            # then add this task's output to its own, already discarded, result)
            done = cpu_overlap.word(task)
        submitted = launched = time.perf_counter()
        task.submit()
        if settled is not None:  # the layer before's times, fed back while this task runs
            try:
                self._observe(*settled)
            except BaseException:
                task.wait()
                raise
        if overlap:
            try:
                streamed = self._stream(i, block, x, ids, weights, gpu, counts, ahead, first) if gpu else None
                gpu_end = torch.cuda.Event(enable_timing=True)  # the GPU's part of the layer ends
                gpu_end.record()
                out = hostio.combine(o, streamed, extra, x.dtype, x.device, done=done)
            except BaseException:
                task.wait()  # the pool must be done with the buffers before anyone reuses them
                raise
            self._pending = (i, T, cpu_counts, (entered, synced, submitted), copied, gpu_end, ahead,
                             int(E - hot.sum()))
            return out, shared
        try:
            if self.cuda:  # queued while the CPU works
                streamed = self._stream(i, block, x, ids, weights, gpu, counts, ahead, first) if gpu else None
            else:
                shared = shared_output(block, block.spec.shared, x)
            launched = time.perf_counter()
        finally:
            task.wait()  # always: the pool must be done with the buffers before anyone reuses them
        waited = time.perf_counter()
        idle = True  # the GPU done with this layer's streamed work when the CPU was
        if self.cuda:
            done_ev = self._event("_streamed")
            done_ev.record()
            idle = done_ev.query()
        self._observe(i, T, cpu_counts, (entered, synced, submitted, launched, waited), idle, ahead,
                      int(E - hot.sum()))
        if not self.cuda:  # a "GPU" on the CPU: after the pool, not against it
            extra = None if block.hot is None else block.hot(x, ids, weights)
            if gpu:
                streamed = self._stream(i, block, x, ids, weights, gpu, counts, ahead, first)
        if io:  # `o` read in place; stream order protects it until the next layer's host sync
            return hostio.combine(o, streamed, extra, x.dtype, x.device), shared
        routed = torch.empty((T, H), dtype=x.dtype, device=x.device)
        routed.copy_(o, non_blocking=self.cuda)  # stream order protects `o` until the next layer's host sync
        return total(x, routed, extra, streamed), shared

    def _settle(self, i: int = -1, T: int | None = None, closing: bool = False) -> tuple | None:
        """Wait for the CPU task the host left running (overlap). Where it was the layer before ``i`` of a T-token
        forward: its run's error raised, and ``_observe``'s arguments returned for that layer (the caller feeds
        them back once its own task is submitted): the layer ended when both parts did, the CPU's at the task's
        native end time, the GPU's at the host time of its routing sync plus the GPU's time from the routing to
        the end of its streamed work (CUDA events). A task of another forward (one that stopped before its next
        layer: an exception, an early exit) is waited for too and its error raised here, never dropped (that
        forward's output may hold it); its times are not fed back. ``closing``: the streamer is closing, an error
        is logged."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        task = self._task()
        j, Tj, cpu_counts, (entered, synced, submitted), routed, gpu_end, ahead, m = pending
        try:
            task.wait()
        except native.NativeError as e:
            if not closing:
                raise
            log.warning("prefill: the CPU task of layer %d of a %d-token forward failed: %s", j, Tj, e)
        if j != i - 1 or Tj != T:
            return None
        _, end = task.times()
        ended = max(end, synced + routed.elapsed_time(gpu_end) / 1e3)
        # waited: the layer's end (both parts), launched: the submit, so that the CPU's time is end - submitted
        return j, T, cpu_counts, (entered, synced, submitted, submitted, ended), True, ahead, m, end

    def _observe(self, i, T, cpu_counts, times, idle, ahead, m, cpu_end=None) -> None:
        """Layer i's host times into the feedback (``Feedback.observe``; ``cpu_end``: the CPU task's end where it
        is not the layer's) and, in ahead mode, the next layers' n steered from them (m streamable experts)."""
        block = self.blocks[i]
        key = self._costs_key(block)
        self.feedback.observe(i, T, key, self._costs.get(key), cpu_counts, times, idle, cpu_end)
        if ahead and self.ring.spans is not None:
            self._n_ahead = self.feedback.steer(T, self.ring.spans, self.layouts[i].expert_bytes, self._n_ahead,
                                                m, self.cap)

    # ---- small pieces kept across forwards ----------------------------------------------------------------------
    def _event(self, name: str = "_copied") -> torch.cuda.Event:
        """A CUDA event kept for the streamer (timed: an overlapped layer's routing is where its GPU time starts);
        the routing's event is a new one each layer while a layer's is pending (``_settle`` still reads it)."""
        ev = self.__dict__.get(name)
        if ev is None or (self._pending is not None and ev is self._pending[4]):
            ev = self.__dict__[name] = torch.cuda.Event(enable_timing=True)
        return ev

    def _skip(self, E: int) -> torch.Tensor:
        """Pinned uint8 [E]: the split's native skip mask (hot + GPU experts), rewritten each layer."""
        masks = self.__dict__.setdefault("_skips", {})
        if E not in masks:
            masks[E] = torch.zeros(E, dtype=torch.uint8, pin_memory=self.cuda)
        return masks[E]

    def _task(self) -> native.Task:
        task = self.__dict__.get("_native_task")
        if task is None:
            task = self._native_task = native.Task()
        return task


def total(x, routed, extra, streamed) -> torch.Tensor:
    """routed (x's dtype) + extra + streamed (f32 [T, H] each, or None), in x's dtype."""
    parts = [t for t in (extra, streamed) if t is not None]
    if not parts:
        return routed if routed is not None else torch.zeros_like(x)
    acc = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    return (acc if routed is None else acc + routed).to(x.dtype)
