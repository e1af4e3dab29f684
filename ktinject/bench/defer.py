"""Expert deferral in decode (``python -m ktinject.bench decode --defer 0,1,2,0.3``): tok/s per setting and the bound.

Without deferral a decode step runs each layer's CPU experts and the GPU's dense work mostly one after the other;
with d deferred slots per token, a layer's deferred experts overlap the next layer's attention
(``ktinject.operators.deferral``). A perfect overlap would give the bound (CPU + GPU) / max(CPU, GPU) of the speed
without deferral, with CPU = the native experts alone (``cpu_expert_time``: whole passes over the layers, one
synchronous forward per layer, cache-cold) and GPU = the graph replay with every routed expert muted (dense work and
handshakes, ``muted_replay``), both measured in this run. Settings: an int d, slots per token, or a float m, a share
of each token's routing weight (``ktinject.operators.deferral``). Per setting one graph is captured (the runner
keeps one per setting); then rounds in which every setting is timed in turn, through ``ktinject.generate`` and as
bare replays, with a CPU pass per round, so the host's drift spreads over all of them; the rows give medians.
Speed-up: against d = 0 of the same rounds; share of the bound: speed-up / bound. The share of the slots deferred
is counted by the native tasks over the timed generate runs (``deferral.slots_run``); the limit 1 + s
(``share_bound``) takes d / k for a count and that measured share for a weight share. Without CUDA (``--tiny`` on
a CPU) the eager decode is timed and the GPU columns say n/a. ``--defer-layouts one,cut,two`` times each d > 0 in
each layout of the deferring layers' split tasks (``KTINJECT_DEFER_PHASES``, set between runs: the native code reads
it at each forward, so one captured graph serves all) in the same rounds; the targets judge the layout of the best
mean speed-up over the settings (named in the verdict).
Legend: B batch, P prompt tokens, d deferred slots per token, m deferred share of the routing weight.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

import ktinject
from ktinject import envs
from ktinject.bench.targets import defer_failed, defer_targets
from ktinject.bench.timing import profile_line, replay_iters
from ktinject.cli.options import defer_list, defer_settings
from ktinject.operators import deferral
from ktinject.operators.kernels import dense as fused_dense


@dataclass(frozen=True)
class Timers:
    """The measurements of ``bench.decode`` that these rows reuse, handed over by it (it imports this module)."""

    cpu_expert_time: Callable  # (model, batch, passes, profile=None) -> [seconds per pass]
    graph_replay: Callable  # (runner, batch, prompt_len, iters, entry) -> seconds per replay
    muted_replay: Callable  # (model, runner, batch, prompt_len, iters, entry) -> seconds per replay, experts muted


def parse(text: str, k: int) -> list[int | float]:
    """``--defer`` as distinct settings, 0 first (the baseline), then the counts d (ints, 0 <= d < k), then the
    shares m (floats, 0 < m < 1), each ascending; SystemExit naming the flag if one is bad."""
    try:
        ds = defer_settings(defer_list(text))
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"--defer {text!r}: {e}") from None
    bad = [d for d in ds if isinstance(d, int) and d >= k]
    if bad:
        raise SystemExit(f"--defer {text!r}: {bad} out of range: 0 <= d < k = {k} (experts per token)")
    return ds


def _entry(runner, batch: int, setting: tuple):
    """The runner's captured graph of ``batch`` rows for the deferral ``setting``, or None."""
    return next((g for key, g in runner.graphs.items() if key[0] == batch and key[2] == setting and g is not None),
                None)


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e3:.2f}"


class _Clock:
    """A streamer that only notes when each put arrives (HF puts the prompt, then each new token as it reaches the
    host: with the runner's deferred stop check one step late, so no extra wait)."""

    def __init__(self):
        self.t: list[float] = []

    def put(self, value) -> None:
        self.t.append(time.perf_counter())

    def end(self) -> None:
        pass


def seconds_per_token(model, prompt: torch.Tensor, tokens: int) -> float:
    """Decode seconds per step through ``ktinject.generate`` with the model's runner as it is (no new runner): the
    time between the host's receipt of the 2nd and the last of ``tokens`` + 2 new tokens, per step. Not a whole
    generate less a short one: at a long prompt the prefill's own noise is as large as the whole run of decode
    steps, and the difference of the two reads nonsense."""
    if tokens < 1:
        raise ValueError(f"tokens = {tokens}: at least 1 decode step to time")
    clock = _Clock()
    ktinject.generate(model, prompt, max_new_tokens=tokens + 2, min_new_tokens=tokens + 2, do_sample=False,
                      streamer=clock)
    if len(clock.t) < tokens + 3:
        raise RuntimeError(f"generate streamed {len(clock.t) - 1} tokens, expected {tokens + 2}")
    got = clock.t[1:]  # the tokens' receipts (t[0]: the prompt's put)
    return (got[-1] - got[1]) / (len(got) - 2)


#: a split task's layouts (``KTINJECT_DEFER_PHASES``, read by the native code at each forward: native/src/moe/pipeline.c)
LAYOUTS = ("one", "cut", "two")
LAYOUT_ENV = "KTINJECT_DEFER_PHASES"
DEFAULT_LAYOUT = "cut"  # the native code's when the variable is unset (forward.c says why)


def layouts(text: str | None) -> list[str]:
    """``--defer-layouts`` as a list (default: the environment's layout, else cut); SystemExit naming a bad one."""
    where = f"--defer-layouts {text!r}" if text else f"{LAYOUT_ENV}={envs.raw(LAYOUT_ENV)!r}"
    got = [t.strip() for t in (text or envs.raw(LAYOUT_ENV) or DEFAULT_LAYOUT).split(",") if t.strip()]
    bad = [t for t in got if t not in LAYOUTS]
    if bad or not got:
        raise SystemExit(f"{where}: expected a comma-separated list of {', '.join(LAYOUTS)}")
    return list(dict.fromkeys(got))


@contextlib.contextmanager
def _layout_env():
    """Yields use(layout): sets the split layout the native code reads at each forward (None: leaves it); the
    environment's value is restored at the end."""
    before = envs.raw(LAYOUT_ENV)

    def use(layout: str | None) -> None:
        if layout is not None:
            os.environ[LAYOUT_ENV] = layout

    try:
        yield use
    finally:
        if before is None:
            os.environ.pop(LAYOUT_ENV, None)
        else:
            os.environ[LAYOUT_ENV] = before


def share_bound(cpu_s: float, gpu_s: float, share: float) -> float:
    """The speed-up deferral can give when a ``share`` of the CPU's expert work is deferred: a layer takes g + c
    without it (GPU, CPU, one after the other); with it the immediate part, then the deferred part beside the next
    layer's GPU work: (1 - s) c + max(g, s c). So at most 1 + s, reached when g = s c (the overlap free); the
    bound above (CPU + GPU) / max(CPU, GPU) assumes every GPU microsecond hides."""
    return (cpu_s + gpu_s) / ((1 - share) * cpu_s + max(gpu_s, share * cpu_s))


def rows(model, prompt: torch.Tensor, args, add, timers: Timers, quant: str = "bf16") -> None:
    """The deferral rows of one injected model (``args.defer``, ``args.tokens``, ``args.defer_rounds``), each given
    to ``add((what, tok/s, ms/token, note))``, then the deferral target judged (``targets.defer_targets``; ``quant``:
    the experts' format)."""
    from ktinject.decode.generate import get_runner

    B, P = prompt.shape
    ds = parse(args.defer, model.config.num_experts_per_tok)
    chain = deferral.chain_of(model)
    graphs = prompt.is_cuda
    runner = get_runner(model, use_graphs=graphs, prefill_chunk=2048)  # one runner: a graph per setting
    entries = {}
    for d in ds:
        deferral.set_defer(model, d)
        seconds_per_token(model, prompt, 2)  # warm-up and capture
        entries[d] = _entry(runner, B, chain.setting) if graphs else None
        if graphs and entries[d] is None:
            add((f"defer {d}", "failed", "", f"no graph captured: {runner.stats.capture_failures[-1:]}"))
            for row in defer_failed(quant, f"no decode graph captured at defer {d}", args):
                add(row)
            return
    given = getattr(args, "defer_layouts", None)
    lays = layouts(given) if graphs or given else [None]  # a split task's layout: graph decode's
    if not graphs and len(lays) > 1:
        add(("defer layouts", "", "", "eager decode runs two tasks a layer, not a split one: the layouts time the "
             "same path here (they apply to graph decode)"))
    variants = [(0, lays[0])] + [(d, lay) for d in ds if d for lay in lays]
    gen: dict[tuple, list[float]] = {v: [] for v in variants}
    bare: dict[tuple, list[float]] = {v: [] for v in variants}
    slots = {v: [0, 0] for v in variants}  # (immediate, deferred) rows of the deferring blocks in the timed runs
    cpu: list[float] = []
    profiles: list[dict] = []
    inside = {}  # variant -> the pools' profile inside bare replays: where the CPU's part of a step goes
    with _layout_env() as use:
        for _ in range(max(1, args.defer_rounds)):
            cpu += timers.cpu_expert_time(model, B, passes=2, profile=profiles)
            for v in variants:
                use(v[1])
                deferral.set_defer(model, v[0])
                deferral.slots_run(model, reset=True)
                gen[v].append(seconds_per_token(model, prompt, args.tokens))
                slots[v] = [a + b for a, b in zip(slots[v], deferral.slots_run(model))]
                if graphs:
                    bare[v].append(timers.graph_replay(runner, B, P, args.tokens, entry=entries[v[0]]))
        for v in variants if graphs else ():
            use(v[1])
            with contextlib.ExitStack() as stack:
                profs = [stack.enter_context(p.profiling()) for p in entries[v[0]].pools]
                timers.graph_replay(runner, B, P, args.tokens, entry=entries[v[0]])
            inside[v] = profs
    deferral.set_defer(model, 0)
    cpu_s = statistics.median(cpu)
    muted = {d: timers.muted_replay(model, runner, B, P, args.tokens, entry=entries[d]) for d in ds} if graphs else {}
    gpu_s = muted.get(0)
    bound = None if gpu_s is None else (cpu_s + gpu_s) / max(cpu_s, gpu_s)
    add(("defer: CPU experts alone", "", _ms(cpu_s), f"median of {len(cpu)} passes, "
         f"{len(cpu) // max(1, args.defer_rounds)} per round (no deferral: the whole work)"))
    if profiles:
        add(("defer: CPU experts alone, a layer", "", "", "native pool profile of the last round's passes: "
             + profile_line(profiles[-1])))
    add(("defer: GPU + handshakes (experts muted, d=0)", "", _ms(gpu_s), "graph replay, every routed expert skipped; "
         f"projections of {B} row(s): {fused_dense.choices_line(B)}"))
    add(("defer: bound (CPU + GPU) / max(CPU, GPU)", "", "", "n/a" if bound is None else f"{bound:.3f}x"))
    med = {v: statistics.median(gen[v]) for v in variants}
    k = model.config.num_experts_per_tok
    ups = {v: med[variants[0]] / s for v, s in med.items()}
    for v in variants:
        d, lay = v
        s, up = med[v], ups[v]
        note = [f"{up:.3f}x of d=0"]
        imm, dfr = slots[v]
        share = dfr / max(1, imm + dfr)  # measured: what a weight share defers depends on the tokens
        if d:
            note.append(f"{100 * share:.1f}% of slots deferred")
        if bound is not None:
            note.append(f"{100 * up / bound:.0f}% of the bound")
            if d:
                s_bound = d / k if isinstance(d, int) else share
                note.append(f"at most {share_bound(cpu_s, gpu_s, s_bound):.3f}x "
                            + (f"with {d} of {k} deferred" if isinstance(d, int) else "at that share"))
        if graphs:
            note.append(f"bare replay {_ms(statistics.median(bare[v]))} ms, muted {_ms(muted[d])} ms")
        note.append("runs " + ", ".join(f"{B / t:.1f}" for t in gen[v]) + " tok/s")
        name = f"defer {d}" + (f" ({lay})" if d and len(lays) > 1 else "")
        add((f"{name}: {'graph' if graphs else 'eager'} decode", f"{B / s:,.1f}", _ms(s), "; ".join(note)))
        for prof in inside.get(v, ()):  # the CPU jobs' sum a step: beside the bare replay, what overlaps and what not
            steps = replay_iters(runner, P, args.tokens) + 1  # graph_replay's warm-up too
            add((f"{name}: the pool inside bare replays", "", _ms(prof["jobs"] * prof["job_us"] / 1e6 / steps),
                 "CPU jobs a step, summed (go seen -> done raised); " + profile_line(prof)))
    # the targets judge one layout for every setting: the one of the best mean speed-up over them (not each
    # setting's best of several noisy medians against one baseline), named in the verdict
    judged = lays[0]
    if len(lays) > 1 and len(ds) > 1:
        mean = {lay: statistics.fmean(ups[(d, lay)] for d in ds if d) for lay in lays}
        judged = max(mean, key=mean.get)
        add(("defer layouts: judged", "", "", f"{judged}, the best mean speed-up over the settings ("
             + ", ".join(f"{lay} {m:.3f}x" for lay, m in mean.items()) + ")"))
    speedups = {(f"{d} ({judged})" if d and len(lays) > 1 else d): ups[(d, judged if d else lays[0])] for d in ds}
    for row in defer_targets(quant, speedups, bound, args, cpu_s, gpu_s) if graphs else ():
        add(row)
