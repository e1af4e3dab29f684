"""What split and ahead layers show, fed back into the prefill policy (streamed prefill).

The cost model (``policy``) starts from rates measured alone: one copy's H2D bandwidth, the CPU's time per expert
of a forward with nothing beside it, a guess of a layer's time outside its experts (``layer_s``). When the CPU
and the copies run at once they slow each other (copies slower than alone, the CPU's tasks slower than the model
says), and ``layer_s`` is several times the guess (docs/performance.md has the figures). ``Measured`` keeps the samples
the streamer takes in split and ahead layers (medians of the last WINDOW: one slow layer, e.g. a kernel compiled in
it, does not steer the next decisions):

    layer_s(T)        host time from one layer's CPU task done to the next one's submit (T tokens; the nearest
                      measured T stands in for one not measured yet)
    cpu_scale(key)    the CPU's task time / the model's, beside the copies
    h2d_shared()      bytes per second of ahead mode's copies, beside the CPU's work

``AheadBalance`` steers ahead mode's n from one layer to the next with the per-expert rates of the same samples:

    copy of n experts           = c * n                       (runs during everything else of the layer before)
    layer_s + CPU's other m - n  = layer_s + p * (m - n)      (the host's part and the CPU's experts, serial)
    n* = (layer_s + p * m) / (c + p), moved at most STEP a layer, within [1, cap]

kept per prompt length T for the next forwards. Legend: m streamable experts a layer, c and p seconds per expert.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque

import numpy as np
import torch

from ktinject.gpu_experts.prefill.policy import Costs

WINDOW = 15  # samples kept per quantity: their median is the estimate
WAITED_S = 1e-4  # a CPU task's time is measured only where the host waited at least this long for it
STEP = 8  # at most this change of n from one layer to the next
OUTLIER = 10.0  # a sample this many times the median of the kept ones is dropped
DROPS = 3  # ... at most this many in a row: then the level has moved
TRIALS = 2  # forwards of each mode auto's trials time before they compare
ENDED = 16  # at most this many forwards' spans wait for the device to pass them


class _Samples(dict):
    """key -> the last WINDOW samples; ``median(key)`` or None. A sample over OUTLIER x the median of three or more
    is dropped: a layer's first forwards (kernels compiled, caches cold) can take a hundred times what a layer shows
    later, and a median kept from them once stuck auto at cpu. Past DROPS dropped in a
    row the level itself has moved (longer prompts, a busier host): the samples restart from that one."""

    def __init__(self):
        super().__init__()
        self._dropped: dict = {}  # key -> samples dropped in a row

    def add(self, key, value: float) -> None:
        got = self.setdefault(key, deque(maxlen=WINDOW))
        if len(got) >= 3 and value > OUTLIER * statistics.median(got):
            self._dropped[key] = self._dropped.get(key, 0) + 1
            if self._dropped[key] <= DROPS:
                return
            got.clear()
        self._dropped[key] = 0
        got.append(float(value))

    def median(self, key) -> float | None:
        got = self.get(key)
        return statistics.median(got) if got else None


def _nearest(lengths, T: int | None) -> int | None:
    """T when it is among ``lengths`` (prompt lengths measured), else the one nearest to it by ratio; None when
    there are none or T is None."""
    if T is None or not lengths:
        return None
    if T in lengths:
        return T
    return min(lengths, key=lambda t: abs(math.log(max(t, 1) / max(T, 1))))


class Measured:
    def __init__(self):
        self.layer = _Samples()  # T -> seconds
        self.cpu = _Samples()  # costs key -> measured / modelled
        self.copy = _Samples()  # 0 -> bytes per second (ahead mode's copies)

    def layer_s(self, T: int | None) -> float | None:
        """The median at T, else at the measured T nearest (by ratio), else None (also for T None: no length)."""
        near = _nearest(self.layer, T)
        return None if near is None else self.layer.median(near)

    def cpu_scale(self, key) -> float:
        return self.cpu.median(key) or 1.0

    def h2d_shared(self) -> float | None:
        return self.copy.median(0)


class AheadBalance:
    def __init__(self):
        self.n: dict[int, int] = {}  # T -> n steered to
        self.copy_s = _Samples()  # T -> seconds per expert copied, under the layer's load
        self.cpu_s = _Samples()  # T -> seconds per expert on the CPU, beside the copies

    def start(self, T: int, model_n: int) -> int:
        """n for a forward of T tokens: where earlier forwards steered to (at T, else at the nearest length steered),
        else the cost model's; at least 1 (with no expert on the GPU nothing is copied, so no rate is ever measured
        at T and the steering could not move it: auto may choose ahead from rates measured at another length where
        the model's own n is 0)."""
        near = _nearest(self.n, T)
        return max(1, self.n[near] if near is not None else model_n)

    def copied(self, T: int, seconds: float, experts: int) -> None:
        if experts > 0 and seconds > 0:
            self.copy_s.add(T, seconds / experts)

    def computed(self, T: int, seconds: float, experts: int) -> None:
        if experts > 0 and seconds > 0:
            self.cpu_s.add(T, seconds / experts)

    def _rates(self, T: int) -> tuple[float, float] | None:
        """(c, p) measured at T, else at the nearest T measured (by ratio), else None."""
        T = _nearest([t for t in self.copy_s if t in self.cpu_s], T)
        return None if T is None else (self.copy_s.median(T), self.cpu_s.median(T))

    def estimate(self, T: int, m: int, layer_s: float, cap: int) -> float | None:
        """Seconds of an ahead layer of T tokens at the balanced n, from the rates measured (None before any):
        max(c n, layer_s + p (m - n)) with n as ``steer`` aims."""
        rates = self._rates(T)
        if rates is None or m <= 0:
            return None
        c, p = rates
        n = max(1.0, min((layer_s + p * m) / (c + p), float(cap), float(m)))
        return max(c * n, layer_s + p * (m - n))

    def steer(self, T: int, n: int, m: int, layer_s: float, cap: int) -> int:
        """The next layers' n from n (this layer's) for m streamable experts; n unchanged until both rates are
        measured."""
        c, p = self.copy_s.median(T), self.cpu_s.median(T)
        if c is None or p is None or m <= 0:
            return n
        want = (layer_s + p * m) / (c + p)
        new = int(round(min(max(want, n - STEP), n + STEP)))
        self.n[T] = new = max(1, min(new, cap, m))
        return new


class Trials:
    """Where the model chose a mode that shares a layer with the CPU (split, ahead), auto checks it against the pure
    modes: once the proposed mode has run TRIALS forwards of a like length (the same power-of-two bucket), the next
    TRIALS run gpu mode (streaming whole layers), the next TRIALS cpu mode, and from then on the fastest by their
    best time a layer is taken (the best: a forward's one-time costs, the first layer's copy not fetched ahead or a kernel compiled, and
    the host's noise only ever slow one down). The model's ahead mode was measured to lose to gpu mode where its
    estimate said it was faster, and to cpu mode at short prompts once the CPU path left its tasks running
    (operators/cpu_overlap.py; docs/performance.md): auto's promise, never below the faster pure path, needs the
    measurement."""

    def __init__(self):
        self.seconds = _Samples()  # (bucket, mode) -> seconds a layer

    @staticmethod
    def bucket(T: int) -> int:
        return 1 << max(0, int(T).bit_length() - 1)

    def add(self, T: int, mode: str, seconds_per_layer: float) -> None:
        if seconds_per_layer > 0:
            self.seconds.add((self.bucket(T), mode), seconds_per_layer)

    def pick(self, T: int, proposed: str, *alternatives: str) -> str:
        """The mode for a forward of T tokens: ``proposed`` (the model's) unless it is split or ahead and, after
        TRIALS forwards of it in T's bucket, an ``alternatives`` (the pure modes: gpu, then cpu) has run fewer than
        TRIALS (its turn) or was measured faster (the fastest by best time a layer; ties: the earlier named)."""
        if proposed not in ("split", "ahead"):
            return proposed
        b = self.bucket(T)
        best = {}
        for mode in (proposed, *alternatives):
            runs = self.seconds.get((b, mode), ())
            if len(runs) < TRIALS:
                return mode  # proposed first, then each alternative in turn (explore)
            best.setdefault(mode, min(runs))
        return min(best, key=best.get)


class Feedback:
    """A streamer's measurements and what they steer: ``measured``, ``balance`` and ``trials`` above, fed by
    ``observe`` (each split / ahead layer's host clock), ``steer`` (ahead layers: copy and CPU times) and the
    forward spans (``start_forward`` / ``last_block``: a forward's time on the device, for the trials). ``cuda``:
    spans are CUDA events, else the host clock."""

    def __init__(self, cuda: bool, layers: int):
        self.cuda, self.layers = cuda, max(1, layers)
        self.measured, self.balance, self.trials = Measured(), AheadBalance(), Trials()
        self.observed = False  # samples since the decisions were made
        self._prev_done: tuple | None = None  # (layer, host time its CPU task was done, GPU idle then)
        self._cpu_seen: tuple | None = None  # the last observed layer's (CPU task seconds, CPU experts), if seen
        self._span: list | None = None  # [start, end, T, mode] of the forward in progress
        self._ended: list[list] = []  # spans of forwards that ended, the device not yet past their end (CUDA)

    # ---- forwards ------------------------------------------------------------------------------------------------
    def _clock(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start_forward(self) -> bool:
        """A forward begins: the time a layer of those before that ran to their last block into the trials, once
        the device has passed their end (a forward queued without a host sync, e.g. gpu mode's, is usually still
        running when the next one starts: the next chunk of a long prompt; it is taken at a later start, not
        lost); True when the decisions should be made again (new samples)."""
        self._prev_done = None
        span, self._span = self._span, None
        if span is not None and span[1] is not None:
            self._ended.append(span)
        waiting = []
        for start, end, T, mode in self._ended:
            if not self.cuda:
                self.trials.add(T, mode, (end - start) / self.layers)
            elif end.query():
                self.trials.add(T, mode, start.elapsed_time(end) / 1e3 / self.layers)
            else:
                waiting.append([start, end, T, mode])
        self._ended = waiting[-ENDED:]
        again, self.observed = self.observed, False
        return again

    def forward_mode(self, T: int, mode: str) -> None:
        """The forward that began runs ``mode``: its time is taken (for cpu, which the streamer leaves to the native
        path, up to the end of its last block's native experts: ``PrefillStreamer.native_done``)."""
        self._span = [self._clock(), None, T, mode]

    def last_block(self) -> None:
        if self._span is not None:
            self._span[1] = self._clock()

    # ---- layers --------------------------------------------------------------------------------------------------
    def observe(self, i: int, T: int, key, base, cpu_counts: np.ndarray, times: tuple, idle: bool,
                cpu_end: float | None = None) -> None:
        """What a split / ahead layer's host clock showed, ``times``: (the layer entered, its routing synced, its
        CPU task submitted, the GPU's work launched, the task waited for); ``idle``: the GPU had finished this
        layer's streamed work by then. ``layer_s`` of T-token forwards: the host's time from the previous layer's
        task done to this layer's entry (the dense part's launches: no sync between), plus the routing sync's wait
        and this layer's own set-up where the previous layer left the GPU idle (else the sync waited for the
        previous layer's expert copies, which the balance counts as the copies' time); from the third layer on (the
        first ones allocate, compile). The CPU's task time against ``base`` (the costs measured alone, key ``key``)
        for its ``cpu_counts`` (rows per expert it computed), only where the host did wait for the task (else it
        ended unseen). Where the host left the task running (``split``'s overlap) the call comes once the task is
        done: ``waited`` is the layer's end (the later of the task's native end and the GPU part's), ``launched``
        the submit, ``cpu_end`` the task's end (the CPU's time: cpu_end - submitted)."""
        entered, synced, submitted, launched, waited = times
        prev, self._prev_done = self._prev_done, (i, waited, idle)
        if prev is not None and prev[0] == i - 1 and i >= 2:
            tail = submitted - entered if prev[2] else submitted - synced
            # at least this layer's own set-up (a guard: an overlapped layer's end is an estimate)
            self.measured.layer.add(T, max(submitted - synced, entered - prev[1] + tail))
            self.observed = True
        used = cpu_counts[cpu_counts > 0]
        cpu_end = waited if cpu_end is None else cpu_end
        seen = cpu_end - launched > WAITED_S
        self._cpu_seen = (cpu_end - submitted, int(used.size)) if seen else None  # for ``steer``
        if base is not None and used.size and seen:
            self.measured.cpu.add(key, (cpu_end - submitted) / base.cpu_s(used.size, float(used.sum())))
            self.observed = True

    def steer(self, T: int, spans: dict, expert_bytes: int, n: int, m: int, cap: int) -> int:
        """Ahead mode, after a layer's ``observe``: the copies of ``spans`` (ring.spans: key -> (start, end,
        experts)) that have ended and the layer's CPU task (where the host saw it end) into the balance; returns the
        n the next layers take (from n, for m streamable experts, at most cap)."""
        for key, (start, end, count) in list(spans.items()):
            if end.query():
                seconds = start.elapsed_time(end) / 1e3
                self.balance.copied(T, seconds, count)
                if seconds > 0:
                    self.measured.copy.add(0, count * expert_bytes / seconds)
                del spans[key]
        if self._cpu_seen is not None:
            self.balance.computed(T, *self._cpu_seen)
        return self.balance.steer(T, n, m, self.measured.layer_s(T) or Costs.layer_s, cap)
