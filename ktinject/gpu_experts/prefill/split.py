"""Prefill layers shared by the CPU and the GPU: split and ahead modes of ``streamer.PrefillStreamer``, whose
``split`` part a ``SplitLayers`` is (the streamer decides which experts go where, its ``experts`` part streams the
GPU's, this runs the CPU's beside them and sums the two).

    layer     the routing synced to the host, the experts parted (the GPU's set: ``policy.choose_split`` or ahead
              mode's fixed one), the CPU's part submitted to the native pool, the GPU's part queued, the two outputs
              summed on the device
    settle    the layer before's CPU task, left running (below), waited for and its times fed back

Overlap (KTINJECT_PREFILL_OVERLAP=0 turns it off, with the CPU path's: ``operators/cpu_overlap.py``): the host does not
wait for a layer's CPU task. The task raises a pinned done word when its output is written (``native.Task.signal``), a
one-warp kernel waits for that word before the kernel that adds the CPU's output to the GPU's (``hostio.combine``), and
the host goes on to queue the next layer's dense part (attention's launches, which take about as long as the CPU's work
at int8) while the CPU computes, where it used to wait first and launch after. The next layer's routing sync then waits
for the GPU, which waits for the task: from then on the task's buffers (inputs, output, skip mask) are free, so nothing
is rewritten under it. The task's times come from the native side (``Task.times``) at that next layer (``settle``),
which also raises the task's error. Where it does not apply the host waits as before: the last MoE layer of a forward
(its output ends the forward), without the pinned-buffer kernels (``hostio.usable``), off CUDA.

Gated ahead layers (``_gated``; KTINJECT_PREFILL_GATED=0 turns them off): in ahead mode the CPU's experts are known
before the routing (all but the fixed set and the resident ones), so the host need not wait for the routing either. Each
layer's task is bound and watched (``native.Task.watch``) before its routing is computed; a one-thread kernel raises its
go word once the routing and hidden states have reached the host (``fused.raise_word``), a pool thread (spinning: a
watched run ended within the watch window) starts it at once, and the layer's sum waits for its done word and consumes
it (``hostio.combine``, ``reset``). The host never waits for a layer: it queues the next layer's attention, routing and
copies while the CPU works, and the chain from one layer's CPU end to the next one's start is the GPU's work alone (the
sum, attention, router, the inputs to the host), not also the host's wake, its bookkeeping and the pool's wake-up. Two
tasks alternate (``_Gate``): the one of layer i-2 is waited for at layer i (a CUDA event after its sum: it has ended and
the stream has consumed its done word), unwatched (its run's error raised) and fed back (its native start and end times,
the GPU part's CUDA events, its rows per expert counted on the device), so the host runs at most two layers ahead of the
GPU. The last MoE layer settles both first; a forward that stopped mid-way leaves its gates to the next forward's first
layer (``settle_gates``), which waits for the device where a gate's sum was never queued.
Legend: T tokens, k experts per token, E experts, H hidden.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ktinject import native
from ktinject.native import cuda_driver
from ktinject.operators import handshake as stream_experts
from ktinject import envs
from ktinject.gpu_experts.prefill import host_io as hostio
from ktinject.gpu_experts.prefill import policy
from ktinject.gpu_experts.prefill.device import resident
from ktinject.operators import cpu_overlap
from ktinject.operators.kernels import common as fused
from ktinject.operators.families import shared_output
from ktinject.operators.routing import staging

log = logging.getLogger(__name__)
COUNTS = {"gated": 0}  # gated layers run since import (tests, probes)


#: the pool's watch spin window while gated layers run (``SplitLayers._quiet`` says why it is 0)
GATED_WATCH_SPIN_US = 0


def gated_enabled() -> bool:
    """KTINJECT_PREFILL_GATED (default 1; KTINJECT_PREFILL_OVERLAP=0 turns it off too), read per layer."""
    return envs.get("KTINJECT_PREFILL_GATED") and cpu_overlap.enabled()


class _Gate:
    """One of the two watched tasks that gated layers alternate: the task, its pinned words (go at 0, done at 16:
    separate 64-byte lines, as graph decode's), skip mask and routing counts [E] (copied from the device before the
    go), and the layer it was armed for (``pending``: [layer, T, routing event (the go queued), GPU part's end
    event, the sum's event (queued), streamable experts])."""

    def __init__(self, E: int):
        self.task = native.Task()
        self.words = torch.zeros(32, dtype=torch.int32, pin_memory=True)
        self.go, self.done = self.words[0:1], self.words[16:17]
        self.skip = torch.zeros(E, dtype=torch.uint8, pin_memory=True)
        self.counts = torch.zeros(E, dtype=torch.int64, pin_memory=True)
        self.pending: list | None = None
        self.go_dptr = None  # the go word's device address where stream memory operations are supported

    def raise_go(self, device: torch.device) -> None:
        """Queue go = 1 on the current stream: cuStreamWriteValue32 (its default flags fence the earlier copies and
        kernels' writes to host memory before it, as graph decode's go), else a one-thread kernel (``fused.raise_word``:
        a release at system scope after the earlier kernels, relying on the link keeping the GPU's writes in order)."""
        if self.go_dptr is None:  # (memops where supported, unless KTINJECT_STREAM_SYNC says hostfn)
            self.go_dptr = (cuda_driver.host_device_pointer(self.go.data_ptr())
                            if cuda_driver.default_sync_mode() == "memops" else 0)
        if self.go_dptr:
            cuda_driver.stream_write_value32(torch.cuda.current_stream(device).cuda_stream, self.go_dptr, 1)
        else:
            fused.raise_word(self.go, device)

    def close(self) -> None:
        self.task.close()


class SplitLayers:
    """The split / ahead layers of ``streamer`` (see the module docstring), its GPU part streamed by ``experts``
    (the streamer's ``StreamedExperts``: ``stream``, and ``grouped``, which gated layers need). Of the streamer it
    reads ``blocks``, ``device``, ``cuda`` and ``last``, asks ``costs_for`` and ``take_set`` (ahead mode's set and
    its copy), and reports each layer's rows per expert (``see``) and times (``observe``)."""

    def __init__(self, streamer, experts):
        self.streamer, self.experts = streamer, experts
        self._pending: tuple | None = None  # the layer whose CPU task the host left running (``settle``)
        self._gates: dict[int, tuple[_Gate, _Gate]] = {}  # E -> the two tasks gated layers of E experts alternate
        self._spin_saved: tuple | None = None  # (pool, its watch window, ours) while gated layers run (``_quiet``)
        self._skips: dict[int, torch.Tensor] = {}  # E -> the split's native skip mask (``_skip``)
        self._events: dict[str, torch.cuda.Event] = {}  # ``_event``'s, by name
        self._native_task: native.Task | None = None  # the ungated layers' task (``_task``)

    def layer(self, i, block, x, ids, weights, ahead: bool = False):
        """The experts with the most rows on the GPU, the rest in the native kernels, at the same time. ``ahead``:
        the GPU's experts are the layer's fixed set (the streamer's ``take_set``), fetched during the layer before.
        The GPU's work (and the next layer's copy) is queued after the CPU's task is submitted, so that its launches
        (and any host sync in them) overlap the CPU's work, not precede it."""
        streamer, cuda = self.streamer, self.streamer.cuda
        if ahead and cuda and self.experts.grouped and i < len(streamer.blocks) - 1 and gated_enabled():
            with torch.cuda.device(x.device):  # its events, go and stream: x's device whatever is current
                out = self._gated(i, block, x, ids, weights)
            if out is not None:
                return out
        entered = time.perf_counter()
        T, H = x.shape
        E = block.num_experts
        st = staging(pin=cuda)
        o = st.get("out", T, H, stream_experts.host_dtype(x.dtype))
        io = cuda and hostio.usable(x.device, o)  # kernels, not copies (hostio says why); the staging's buffers
        h, i_, w = st.inputs("", x, ids, weights, non_blocking=cuda,  # are pinned alike
                             to_host=hostio.to_host if io else None)
        shared = extra = streamed = None
        hot = resident(block)
        gpu = first = None
        if ahead:
            gpu, first = streamer.take_set(i)
        if cuda:
            copied = self._event()
            copied.record()
            shared = shared_output(block, block.spec.shared, x)  # queued: overlaps what follows
            extra = None if block.hot is None else block.hot(x, ids, weights)
            copied.synchronize()
            self.settle_gates(i, T)  # the gated layers before (passed too: the routing follows their sums)
        synced = time.perf_counter()
        settled = self.settle(i, T)  # the GPU has passed the layer before's combine: its CPU task is done
        counts = torch.bincount(i_.reshape(-1), minlength=E).numpy()
        streamer.see(i, counts)
        if not ahead:
            gpu = policy.choose_split(counts, ~hot, streamer.costs_for(block, T))
        streamer.last["gpu_experts"].append(len(gpu))
        skip = _mask(self._skip(E), hot, gpu)
        cpu_counts = np.where(skip.numpy() == 0, counts, 0)
        task = self._task()
        task.bind(block.native_experts, h, i_, w, skip=skip, out=o)
        overlap = io and i < len(streamer.blocks) - 1 and cpu_overlap.enabled()
        if overlap:
            # the task's signal word, reset: the layer before's wait kernel has seen it (this layer's routing sync
            # passed it; one stream: a forward abandoned mid-way on another stream could still be waiting, and would
            # then add this task's output to its own, already discarded, result)
            done = cpu_overlap.word(task)
        submitted = launched = time.perf_counter()
        task.submit()
        if settled is not None:  # the layer before's times, fed back while this task runs
            try:
                streamer.observe(*settled)
            except BaseException:
                task.wait()
                raise
        if overlap:
            try:
                streamed = self.experts.stream(i, block, x, ids, weights, gpu, counts, ahead, first) if gpu else None
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
            if cuda:  # queued while the CPU works
                streamed = self.experts.stream(i, block, x, ids, weights, gpu, counts, ahead, first) if gpu else None
            else:
                shared = shared_output(block, block.spec.shared, x)
            launched = time.perf_counter()
        finally:
            task.wait()  # always: the pool must be done with the buffers before anyone reuses them
        waited = time.perf_counter()
        idle = True  # the GPU done with this layer's streamed work when the CPU was
        if cuda:
            done_ev = self._event("_streamed")
            done_ev.record()
            idle = done_ev.query()
        streamer.observe(i, T, cpu_counts, (entered, synced, submitted, launched, waited), idle, ahead,
                         int(E - hot.sum()))
        if not cuda:  # a "GPU" on the CPU: after the pool, not against it
            extra = None if block.hot is None else block.hot(x, ids, weights)
            if gpu:
                streamed = self.experts.stream(i, block, x, ids, weights, gpu, counts, ahead, first)
        if io:  # `o` read in place; stream order protects it until the next layer's host sync
            return hostio.combine(o, streamed, extra, x.dtype, x.device), shared
        routed = torch.empty((T, H), dtype=x.dtype, device=x.device)
        routed.copy_(o, non_blocking=cuda)  # stream order protects `o` until the next layer's host sync
        return total(x, routed, extra, streamed), shared

    def _gated(self, i, block, x, ids, weights):
        """An ahead layer whose CPU task starts from the GPU (the module docstring's gated layers): (out, shared),
        or None where the pinned-buffer kernels are not usable (the caller's path then)."""
        T, H = x.shape
        E = block.num_experts
        st = staging(pin=True)
        o = st.get("out", T, H, stream_experts.host_dtype(x.dtype))
        if not hostio.usable(x.device, o):
            return None
        if self._pending is not None:  # an ungated layer's task: this forward's layer before (fed back) or another's
            settled = self.settle(i, T)
            if settled is not None:
                self.streamer.observe(*settled)
        gates = self._gates
        if E not in gates:
            gates[E] = (_Gate(E), _Gate(E))
        g = gates[E][i % 2]
        self._settle_gate(g, i, T)  # layer i - 2's run: ended, fed back
        if g.task.watched:  # left watched by an interrupt between a settle's wait and its unwatch (its run is over)
            try:
                g.task.unwatch()
            except native.NativeError as e:
                log.warning("prefill: a gated CPU task left watched had failed: %s", e)
        h, i_, w = st.inputs("", x, ids, weights, non_blocking=True, to_host=hostio.to_host)
        hot = resident(block)
        gpu, first = self.streamer.take_set(i)
        self.streamer.last["gpu_experts"].append(len(gpu))
        _mask(g.skip, hot, gpu)
        flat = ids.reshape(-1)  # rows per expert on the device (torch.bincount would sync for its size)
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        hostio.to_host(counts, g.counts)  # a kernel: a copy would queue behind the ring's expert copies
        g.task.bind(block.native_experts, h, i_, w, skip=g.skip, out=o)
        self._quiet(g.task.pool)
        g.words.zero_()  # (both 0 already: the pool took the last go, the last sum consumed the done word)
        g.pending = [i, T, None, None, None, int(E - hot.sum())]  # (before watch: a settle then unwatches)
        g.task.watch(g.go.data_ptr(), g.done.data_ptr())
        COUNTS["gated"] += 1
        try:
            routed = torch.cuda.Event(enable_timing=True)
            routed.record()
            g.raise_go(x.device)  # after the inputs' and the counts' copies on the stream
            g.pending[2] = routed
            shared = shared_output(block, block.spec.shared, x)
            extra = None if block.hot is None else block.hot(x, ids, weights)
            streamed = self.experts.stream(i, block, x, ids, weights, gpu, None, True, first) if gpu else None
            gpu_end = torch.cuda.Event(enable_timing=True)
            gpu_end.record()
            out = hostio.combine(o, streamed, extra, x.dtype, x.device, done=g.done, reset=True)
            passed = torch.cuda.Event()
            passed.record()
            g.pending[3:5] = gpu_end, passed
        except BaseException:
            # the pool must be done with the staging buffers (this thread's, any forward's) before anyone reuses
            # them, and graph decode gets its spin window back; the original exception is the one raised
            try:
                self.settle_gates(closing=True)
            except Exception:  # noqa: BLE001 - e.g. a CUDA error that is also the original's cause
                log.exception("prefill: settling the gated layers after an error failed")
            raise
        return out, shared

    def settle_gates(self, i: int = -1, T: int | None = None, closing: bool = False) -> None:
        """Every gated layer's task still watched, in layer order (``_settle_gate``); its times fed back where it
        is a layer before ``i`` of this T-token forward. ``closing``: errors logged, not raised."""
        gates = [g for pair in self._gates.values() for g in pair if g.pending is not None]
        try:
            for g in sorted(gates, key=lambda g: g.pending[0]):
                self._settle_gate(g, i, T, closing)
        finally:
            if not any(g.pending for g in gates):
                self._quiet(None)

    def close_gates(self) -> None:
        """Settle every gate (errors logged) and free their tasks (the streamer closing)."""
        self.settle_gates(closing=True)
        gates, self._gates = self._gates, {}
        for pair in gates.values():
            for g in pair:
                g.close()

    def _quiet(self, pool) -> None:
        """While gated layers run, the pool's watch spin window is GATED_WATCH_SPIN_US (0: after a run
        only thread 0 polls for the next go; the others sleep until it starts the run): with its default window
        (graph decode's: every idle thread spins a while after a watched run) the spinning threads starve the host's
        launches of the next layers, and the GPU waits for the host's attention launches. ``pool`` None: the saved
        window back (every gate settled), unless the window was changed meanwhile (by the user: theirs stays)."""
        saved = self._spin_saved
        if pool is None:
            if saved is not None:
                self._spin_saved = None
                if saved[0].watch_spin_us == saved[2]:
                    saved[0].watch_spin_us = saved[1]
        elif saved is None:
            ours = GATED_WATCH_SPIN_US
            self._spin_saved = (pool, pool.watch_spin_us, ours)
            pool.watch_spin_us = ours

    def _settle_gate(self, g: _Gate, i: int = -1, T: int | None = None, closing: bool = False) -> None:
        """Wait for gate g's run (its sum's event: the stream has consumed its done word), unwatch it (raising its
        error, logged when ``closing``), and feed back its times where its layer precedes ``i`` in this T-token
        forward. A gate whose sum was never queued (its forward stopped in between) waits for the whole device
        (a go already queued is raised and run) and has its words zeroed; its times are not fed back. A failed run
        settles the other gate too (its error logged) before its own error is raised. The gate stays pending until
        its wait has returned (an interrupt there leaves it to the next settle)."""
        pending = g.pending
        if pending is None:
            return
        j, Tj, routed, gpu_end, passed, m = pending
        # (interrupted here, the gate stays pending and watched: its go may still come, and its sum waits for it)
        if passed is not None:
            passed.synchronize()
        else:
            torch.cuda.synchronize(self.streamer.device)
        g.pending = None  # its run is over, or never comes (its go was not queued)
        try:
            if g.task.watched:  # (not where watch itself failed)
                g.task.unwatch()
        except native.NativeError as e:
            if passed is None:
                g.words.zero_()
            if not closing:
                self.settle_gates(closing=True)  # the other gate too: nothing of this forward left behind
                raise
            log.warning("prefill: the CPU task of layer %d of a %d-token forward failed: %s", j, Tj, e)
            return
        if passed is None:
            g.words.zero_()
            return
        counts = g.counts.numpy()
        self.streamer.see(j, counts)
        if closing or Tj != T or not j < i:
            return
        start, end = g.task.times()
        # the layer ended when both parts did; the GPU's part started about when the CPU's did (its go)
        ended = max(end, start + routed.elapsed_time(gpu_end) / 1e3)
        cpu_counts = np.where(g.skip.numpy() == 0, counts, 0)
        self.streamer.observe(j, Tj, cpu_counts, (start, start, start, start, ended), True, True, m, end)

    def settle(self, i: int = -1, T: int | None = None, closing: bool = False) -> tuple | None:
        """Wait for the CPU task the host left running (overlap). Where it was the layer before ``i`` of a T-token
        forward: its run's error raised, and the streamer's ``observe``'s arguments returned for that layer (the caller
        feeds them back once its own task is submitted): the layer ended when both parts did, the CPU's at the task's
        native end time, the GPU's at the host time of its routing sync plus the GPU's time from the routing to the end
        of its streamed work (CUDA events). A task of another forward (one that stopped before its next layer: an
        exception, an early exit) is waited for too and its error raised here, never dropped (that forward's output may
        hold it); its times are not fed back. ``closing``: the streamer is closing, an error is logged."""
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
        # (a gated layer settles here without a sync before it: the GPU part may still run; ``layer`` has synced)
        gpu_end.synchronize()
        ended = max(end, synced + routed.elapsed_time(gpu_end) / 1e3)
        # waited: the layer's end (both parts), launched: the submit, so that the CPU's time is end - submitted
        return j, T, cpu_counts, (entered, synced, submitted, submitted, ended), True, ahead, m, end

    # ---- small pieces kept across forwards ----------------------------------------------------------------------
    def _event(self, name: str = "_copied") -> torch.cuda.Event:
        """A CUDA event kept for the streamer (timed: an overlapped layer's routing is where its GPU time starts);
        the routing's event is a new one each layer while a layer's is pending (``settle`` still reads it)."""
        ev = self._events.get(name)
        if ev is None or (self._pending is not None and ev is self._pending[4]):
            ev = self._events[name] = torch.cuda.Event(enable_timing=True)
        return ev

    def _skip(self, E: int) -> torch.Tensor:
        """Pinned uint8 [E]: the split's native skip mask (hot + GPU experts), rewritten each layer."""
        masks = self._skips
        if E not in masks:
            masks[E] = torch.zeros(E, dtype=torch.uint8, pin_memory=self.streamer.cuda)
        return masks[E]

    def _task(self) -> native.Task:
        task = self._native_task
        if task is None:
            task = self._native_task = native.Task()
        return task


def _mask(skip: torch.Tensor, hot: np.ndarray, gpu: list[int]) -> torch.Tensor:
    """skip (uint8 [E], host) rewritten as the native skip mask of a shared layer: 1 for the resident experts
    (``hot``, bool [E]) and the GPU's (``gpu``), 0 for the CPU's. Returns skip."""
    m = skip.numpy()
    m[:] = 0
    m[hot] = 1
    m[gpu] = 1
    return skip


def total(x, routed, extra, streamed) -> torch.Tensor:
    """routed (x's dtype) + extra + streamed (f32 [T, H] each, or None), in x's dtype."""
    parts = [t for t in (extra, streamed) if t is not None]
    if not parts:
        return routed if routed is not None else torch.zeros_like(x)
    acc = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    return (acc if routed is None else acc + routed).to(x.dtype)
