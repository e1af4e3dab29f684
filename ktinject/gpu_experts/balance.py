"""What split and ahead layers show, fed back into the prefill policy (streamed prefill, issue 19).

The cost model (``policy``) starts from rates measured alone: one copy's H2D bandwidth, the CPU's time per expert
of a forward with nothing beside it, a guess of a layer's time outside its experts (``layer_s``). When the CPU
and the copies run at once they slow each other (on the H100, int8 at 512 tokens: copies at ~44 GB/s instead of
55, the CPU's tasks up to 1.7x the model's), and ``layer_s`` is ~2-3 ms, not 0.3. ``Measured`` keeps the samples
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
from collections import deque

WINDOW = 15  # samples kept per quantity: their median is the estimate
STEP = 8  # at most this change of n from one layer to the next
OUTLIER = 10.0  # a sample this many times the median of the kept ones is dropped


class _Samples(dict):
    """key -> the last WINDOW samples; ``median(key)`` or None. A sample over OUTLIER x the median of three or more
    is dropped: the H100 run of 5c3ae5e (bench prefill, bf16) kept a median of 415 ms "a layer outside the experts"
    from its first forwards, where 2.6-8 ms is what a layer shows (that stuck auto at cpu)."""

    def add(self, key, value: float) -> None:
        got = self.setdefault(key, deque(maxlen=WINDOW))
        if len(got) >= 3 and value > OUTLIER * statistics.median(got):
            return
        got.append(float(value))

    def median(self, key) -> float | None:
        got = self.get(key)
        return statistics.median(got) if got else None


class Measured:
    def __init__(self):
        self.layer = _Samples()  # T -> seconds
        self.cpu = _Samples()  # costs key -> measured / modelled
        self.copy = _Samples()  # 0 -> bytes per second (ahead mode's copies)

    def layer_s(self, T: int) -> float | None:
        """The median at T, else at the measured T nearest (by ratio), else None."""
        if T in self.layer:
            return self.layer.median(T)
        if not self.layer:
            return None
        near = min(self.layer, key=lambda t: abs(math.log(max(t, 1) / max(T, 1))))
        return self.layer.median(near)

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
        """n for a forward of T tokens: where earlier forwards steered to, else the cost model's."""
        return self.n.get(T, model_n)

    def copied(self, T: int, seconds: float, experts: int) -> None:
        if experts > 0 and seconds > 0:
            self.copy_s.add(T, seconds / experts)

    def computed(self, T: int, seconds: float, experts: int) -> None:
        if experts > 0 and seconds > 0:
            self.cpu_s.add(T, seconds / experts)

    def _rates(self, T: int) -> tuple[float, float] | None:
        """(c, p) measured at T, else at the nearest T measured (by ratio), else None."""
        if T not in self.copy_s or T not in self.cpu_s:
            both = [t for t in self.copy_s if t in self.cpu_s]
            if not both:
                return None
            T = min(both, key=lambda t: abs(math.log(max(t, 1) / max(T, 1))))
        return self.copy_s.median(T), self.cpu_s.median(T)

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
    """Where the model chose a mode that shares a layer with the CPU (split, ahead), auto checks it against streaming
    whole layers: the next forward of a like length (the same power-of-two bucket) runs the alternative (gpu mode),
    and from then on the faster of the two by their measured time a layer (medians) is taken. On the H100
    (2026-11-25, 12 Qwen3-30B-A3B layers) the model's ahead lost 8-18% to gpu mode at int4 512 and bf16 / int8 2048
    tokens, where its estimate said 10%+ faster: auto's promise, never below the faster pure path, needs the
    measurement."""

    def __init__(self):
        self.seconds = _Samples()  # (bucket, mode) -> seconds a layer

    @staticmethod
    def bucket(T: int) -> int:
        return 1 << max(0, int(T).bit_length() - 1)

    def add(self, T: int, mode: str, seconds_per_layer: float) -> None:
        if seconds_per_layer > 0:
            self.seconds.add((self.bucket(T), mode), seconds_per_layer)

    def pick(self, T: int, proposed: str, alternative: str) -> str:
        """The mode for a forward of T tokens: ``proposed`` (the model's) unless it is split or ahead and
        ``alternative`` (the pure GPU mode) is untried for T's bucket after the proposed one ran, or measured
        faster."""
        if proposed not in ("split", "ahead"):
            return proposed
        b = self.bucket(T)
        mine, other = self.seconds.median((b, proposed)), self.seconds.median((b, alternative))
        if mine is None:
            return proposed
        if other is None:
            return alternative  # explore once
        return proposed if mine <= other else alternative
