"""The GPU budget of the hot experts as arithmetic: what the card has, less what the run needs, is what experts get.

    usable   = min(free, cap)              free: GPU bytes the run may take (measured before the load, as if its
                                           dense part were not there yet); cap: ``gpu_memory``, None: no cap
    needs    = dense + kv + reserve + workspace + margin (+ ring, when not every expert fits)
    budget   = fraction * (usable - needs)  ``auto``: fraction 1; a share like 0.5: that part of what is left

``dense``: the non-routed-expert weights on the GPU; ``kv``: the KV cache of ``rows`` x ``context`` tokens (plus
each row's fixed state: linear-attention layers); ``reserve``: GPU bytes kept for other uses (a prefix cache's GPU
tier); ``workspace``: a fixed part (cuBLAS workspaces, the decode graphs'
pools, the caching allocator's rounding) plus one prefill chunk's activations; ``ring``: the streamed prefill's ring
and scratch for one whole layer (``prefill.device.StreamedExperts``), not reserved when every expert fits (nothing
is streamed then) nor when prefill stays on the CPU; ``margin``: ``MARGIN_SHARE`` of the usable bytes, at least
``MARGIN_MIN`` (what the estimates above may miss: fragmentation, attention's temporaries, a longer prompt).

When the whole model fits (every expert, at ``fraction`` of what is left before the ring), the budget is exactly
the bytes of every expert. When the needs alone exceed what is usable, the budget is 0 and ``reason`` says by how
much; ``check_cap`` turns a ``gpu_memory`` that cannot hold the dense part and the cache into an error.

Pure: numbers in, numbers and text out (no torch); ``ktinject.injection.gpu_budget`` measures the inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ktinject.gpu_experts.hot.settings import human_bytes, parse_bytes

#: the margin: this share of the usable bytes, at least MARGIN_MIN
MARGIN_SHARE = 0.03
MARGIN_MIN = 512 << 20
#: the fixed part of the workspace: cuBLAS workspaces, decode graph pools, allocator rounding
WORKSPACE_FIXED = 512 << 20
#: prompt tokens of the prefill chunk whose activations the workspace holds (generate's default chunk; the
#: streamed prefill sizes its chunks from what is left, at least 512 tokens)
PREFILL_TOKENS = 2048
#: a KV row of the generate runner: its cache has this many rows (its largest batch bucket)
GENERATE_ROWS = 8


class ModelShape(NamedTuple):
    """What the budget needs to know of an injected model, in bytes (``gpu_budget.model_shape`` measures it)."""

    dense: int  # non-routed-expert weights on the GPU
    kv_per_token: int  # KV cache of one token of one row, every layer
    expert: int  # one GPU-resident expert (its bank rows)
    experts: int  # routed experts, every MoE layer
    layers: int  # MoE layers
    table: int = 0  # a layer's bank tables (for a layer with any resident expert)
    ring: int = 0  # streamed prefill: ring + scratch holding one whole layer; 0: prefill on the CPU
    activation_per_token: int = 0  # prefill activations of one prompt token on the GPU
    kv_per_row: int = 0  # fixed state of one row (linear-attention conv and recurrent states)

    def all_experts(self) -> int:
        """Bytes of every expert resident (banks and tables)."""
        return self.experts * self.expert + self.layers * self.table if self.experts else 0


def default_margin(usable: int) -> int:
    return max(MARGIN_MIN, int(MARGIN_SHARE * max(usable, 0)))


def kv_bytes(shape: ModelShape, rows: int, context: int) -> int:
    return rows * (context * shape.kv_per_token + shape.kv_per_row)


def workspace_bytes(shape: ModelShape, tokens: int = PREFILL_TOKENS) -> int:
    return WORKSPACE_FIXED + tokens * shape.activation_per_token


def room_for(shape: ModelShape, budget: int) -> int:
    """Experts ``budget`` bytes hold at the same count in every layer (what placement without statistics does)."""
    if shape.experts == 0 or shape.layers == 0 or shape.expert <= 0:
        return 0
    per_layer = shape.experts // shape.layers
    n = (budget // shape.layers - shape.table) // shape.expert
    return max(0, min(per_layer, n)) * shape.layers


@dataclass(frozen=True)
class Budget:
    """What ``fit`` decided and from what (bytes). ``budget``: for the hot experts; ``placed``: experts it holds
    (``room_for``); ``reason``: why nothing is placed, else None."""

    request: str  # how the budget was asked for: "auto", "0.5 of what is left", "12.0 GiB"
    budget: int
    placed: int
    experts: int
    expert: int
    free: int = 0
    cap: int | None = None
    usable: int = 0
    dense: int = 0
    kv: int = 0
    reserve: int = 0
    rows: int = 0
    context: int = 0
    ring: int = 0
    workspace: int = 0
    margin: int = 0
    reason: str | None = None

    @property
    def everything(self) -> bool:
        return self.experts > 0 and self.placed == self.experts

    def __str__(self) -> str:
        if self.reason is not None:
            return f"GPU budget ({self.request}): no hot experts: {self.reason}"
        whole = " (the whole model)" if self.everything else ""
        return (f"GPU budget ({self.request}): {human_bytes(self.budget)} for hot experts, room for {self.placed} "
                f"of {self.experts} experts{whole}")

    def lines(self) -> list[str]:
        """The report: the budget, then what fills the usable memory, one part a line."""
        out = [str(self)]
        if self.usable == 0 and self.free == 0:  # nothing measured (no GPU)
            return out
        cap = "no cap" if self.cap is None else f"gpu_memory {human_bytes(self.cap)}"
        out.append(f"  usable      {human_bytes(self.usable)} (free {human_bytes(self.free)}, {cap})")
        out.append(f"  dense       {human_bytes(self.dense)} (non-expert weights)")
        out.append(f"  KV cache    {human_bytes(self.kv)} ({self.rows} rows x {self.context} tokens)")
        if self.reserve:
            out.append(f"  reserved    {human_bytes(self.reserve)} (gpu_reserve: a prefix cache's GPU tier, ...)")
        out.append(f"  ring        {human_bytes(self.ring)}" + ("" if self.ring else
                                                                 " (nothing streamed: no prefill ring)"))
        out.append(f"  workspace   {human_bytes(self.workspace)} (graphs, cuBLAS, a {PREFILL_TOKENS}-token "
                   f"prefill chunk)")
        out.append(f"  margin      {human_bytes(self.margin)} ({100 * MARGIN_SHARE:g}% of usable, at least "
                   f"{human_bytes(MARGIN_MIN)})")
        out.append(f"  experts     {self.placed} of {self.experts}, {human_bytes(self.placed * self.expert)} "
                   f"({human_bytes(self.expert)} each)")
        return out


def fit(shape: ModelShape, free: int, *, cap: int | None = None, rows: int = GENERATE_ROWS, context: int = 4096,
        fraction: float = 1.0, reserve: int = 0, margin: int | None = None) -> Budget:
    """The hot-expert budget of a model of ``shape`` on a GPU with ``free`` bytes for the run, at most ``cap`` in
    all, its KV cache ``rows`` x ``context`` tokens, ``reserve`` bytes kept for other uses; ``fraction`` (0, 1] of
    what is left (1: ``auto``); ``margin`` (None: ``default_margin``)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction {fraction!r}: expected a share of what is left, 0 < fraction <= 1")
    usable = max(0, int(free if cap is None else min(free, cap)))
    margin = default_margin(usable) if margin is None else int(margin)
    kv, work = kv_bytes(shape, rows, context), workspace_bytes(shape)
    request = "auto" if fraction == 1 else f"{fraction:g} of what is left"
    parts = dict(request=request, experts=shape.experts, expert=shape.expert, free=int(free), cap=cap,
                 usable=usable, dense=shape.dense, kv=kv, reserve=reserve, rows=rows, context=context, workspace=work,
                 margin=margin)
    needs = shape.dense + kv + reserve + work + margin
    left = usable - needs
    if left < 0:
        named = [("dense", shape.dense), ("KV cache", kv), ("reserved", reserve), ("workspace", work),
                 ("margin", margin)]
        terms = " + ".join(f"{what} {human_bytes(n)}" for what, n in named if n or what != "reserved")
        return Budget(budget=0, placed=0, reason=f"the run needs {human_bytes(needs)} ({terms}) and "
                      f"{human_bytes(usable)} is usable", **parts)
    if shape.experts and fraction * left >= shape.all_experts():  # the whole model: nothing to stream
        return Budget(budget=shape.all_experts(), placed=shape.experts, **parts)
    left -= shape.ring
    budget = int(fraction * max(left, 0))
    placed = room_for(shape, budget)
    if placed == 0:
        why = ("the model has no routed experts" if not shape.experts else
               f"{human_bytes(max(left, 0))} is left after the needs and the prefill ring ({human_bytes(shape.ring)}),"
               f" less than a layer's share of one expert ({human_bytes(shape.expert + shape.table)} a layer)")
        return Budget(budget=0, placed=0, ring=shape.ring, reason=why, **parts)
    return Budget(budget=budget, placed=placed, ring=shape.ring, **parts)


def nothing(request: str, reason: str, experts: int = 0, expert: int = 0) -> Budget:
    """The budget of a run that places no expert, and why (a CPU-only run: no GPU to measure)."""
    return Budget(request=request, budget=0, placed=0, experts=experts, expert=expert, reason=reason)


def check_cap(cap: int, total: int, dense: int, kv: int, device: str = "the GPU", rows: int = 0,
              context: int = 0) -> None:
    """ValueError where ``gpu_memory`` = ``cap`` cannot be kept: more than the card's ``total``, or less than the
    dense part and the KV cache together, naming the sizes and what to change."""
    if cap > total:
        raise ValueError(f"gpu_memory {human_bytes(cap)} is more than {device} has ({human_bytes(total)}): give at "
                         f"most {human_bytes(total)}, or leave it out to use the whole card")
    if cap < dense + kv:
        cache = f"the KV cache ({human_bytes(kv)}" + (f" for {rows} rows x {context} tokens" if rows else "") + ")"
        raise ValueError(f"gpu_memory {human_bytes(cap)} cannot hold the dense weights ({human_bytes(dense)}) and "
                         f"{cache}: {human_bytes(dense + kv)} at least; raise gpu_memory, or lower max_context / "
                         f"max_batch")


@dataclass(frozen=True)
class Workload:
    """The run the budget reserves for: ``cap`` (``gpu_memory``, bytes; None: the whole card), the KV cache of
    ``rows`` x ``context`` tokens (``max_batch`` x ``max_context``; context None: the model's default,
    ``gpu_budget.default_context``), ``reserve`` bytes (``gpu_reserve``) kept for other uses of the GPU."""

    cap: int | None = None
    rows: int = GENERATE_ROWS
    context: int | None = None
    reserve: int = 0

    @classmethod
    def make(cls, gpu_memory=None, max_batch=None, max_context=None, gpu_reserve=None) -> Workload:
        """From the options of inject / from_pretrained; ValueError naming the option and what to write."""
        cap = None
        if gpu_memory is not None:
            try:
                cap = parse_bytes(gpu_memory)
            except ValueError as e:
                raise ValueError(f"gpu_memory: expected the GPU bytes ktinject may take, e.g. '24GiB', got "
                                 f"{gpu_memory!r} ({e})") from None
            if cap == 0:
                raise ValueError("gpu_memory: 0 bytes leaves nothing for the dense part; give a size like '24GiB', "
                                 "or gpu='cpu' for a CPU-only run")
        for name, value in (("max_batch", max_batch), ("max_context", max_context)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        try:
            reserve = 0 if gpu_reserve is None else parse_bytes(gpu_reserve)
        except ValueError as e:
            raise ValueError(f"gpu_reserve: expected GPU bytes to keep free, e.g. '4GiB', got {gpu_reserve!r} "
                             f"({e})") from None
        return cls(cap, GENERATE_ROWS if max_batch is None else max_batch, max_context, reserve)
