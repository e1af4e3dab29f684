"""Ahead mode's GPU share steered by what its layers show (streamed prefill, issue 19).

The cost model (``policy.ahead_split``) sizes n, the experts a layer the GPU takes, from rates measured alone: the
H2D bandwidth of one copy, the CPU's time per expert of a forward with nothing beside it. In ahead mode both run at
once and slow each other (on the H100, int8 at 512 tokens: the copies at ~44 GB/s instead of 55, the CPU's tasks up
to 1.7x the model's), so the model's n may leave either side waiting. Here each ahead layer's copy (CUDA events)
and CPU task (host clock) give per-expert rates under that load, and the next layers' n balances them:

    copy of n experts           = c * n                       (runs during everything else of the layer before)
    layer_s + CPU's other m - n  = layer_s + p * (m - n)      (the host's part and the CPU's experts, serial)
    n* = (layer_s + p * m) / (c + p), moved at most STEP a layer, within [1, cap]

kept per prompt length T for the next forwards. Legend: m streamable experts a layer, c and p seconds per expert.
"""
from __future__ import annotations

EMA = 0.3  # weight of a layer's rates in the running averages
STEP = 8  # at most this change of n from one layer to the next


class AheadBalance:
    def __init__(self):
        self.n: dict[int, int] = {}  # T -> n steered to
        self.copy_s: dict[int, float] = {}  # T -> seconds per expert copied, under the layer's load
        self.cpu_s: dict[int, float] = {}  # T -> seconds per expert on the CPU, beside the copies

    def start(self, T: int, model_n: int) -> int:
        """n for a forward of T tokens: where earlier forwards steered to, else the cost model's."""
        return self.n.get(T, model_n)

    @staticmethod
    def _avg(d: dict, T: int, v: float) -> None:
        d[T] = v if T not in d else (1 - EMA) * d[T] + EMA * v

    def copied(self, T: int, seconds: float, experts: int) -> None:
        if experts > 0 and seconds > 0:
            self._avg(self.copy_s, T, seconds / experts)

    def computed(self, T: int, seconds: float, experts: int) -> None:
        if experts > 0 and seconds > 0:
            self._avg(self.cpu_s, T, seconds / experts)

    def steer(self, T: int, n: int, m: int, layer_s: float, cap: int) -> int:
        """The next layers' n from n (this layer's) for m streamable experts; n unchanged until both rates are
        measured."""
        c, p = self.copy_s.get(T), self.cpu_s.get(T)
        if c is None or p is None or m <= 0:
            return n
        want = (layer_s + p * m) / (c + p)
        new = int(round(min(max(want, n - STEP), n + STEP)))
        self.n[T] = new = max(1, min(new, cap, m))
        return new
