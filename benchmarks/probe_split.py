"""Where a short prefill's split between the CPU and the GPU pays: tok/s of cpu, gpu, and split / ahead with a forced
number n of GPU experts a layer, interleaved in one process, with per-layer CPU and GPU times of the split layers.

    python benchmarks/probe_split.py [--layers 12] [--quant bf16,int8,int4] [--tokens 512] [--n 16,32,...] [--reps 3]

For each quant one model build; per rep every config once in turn (cpu, gpu, split n..., ahead n...), so host
speed drifts hit all configs alike. Per config: median tok/s (x layers/48 = whole model), its runs, and for split /
ahead the medians over layers of: cpu = the native task's submit -> wait return (host clock), gpu = the streamed
experts' CUDA time (events around _stream), and the policy's estimate for that n. Prints the cost model's numbers.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import ktinject
from ktinject import native
from ktinject.bench.model import bench_model
from ktinject.bench.prefill import time_prefill
from ktinject.gpu_experts.prefill import policy
from ktinject.gpu_experts.prefill import streamer as stream
from ktinject.gpu_experts.prefill.feedback import AheadBalance


class _Fixed(AheadBalance):
    def start(self, T, model_n):
        return model_n

    def steer(self, T, n, m, layer_s, cap):
        return n


class _TimedTask:
    def __init__(self, task, log):
        self.task, self.log, self.t0 = task, log, 0.0

    def bind(self, *a, **kw):
        return self.task.bind(*a, **kw)

    def submit(self):
        self.t0 = time.perf_counter()
        self.task.submit()

    def wait(self):
        self.task.wait()
        self.log["cpu"].append(time.perf_counter() - self.t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--quant", default="bf16,int8,int4")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--n", default="16,32,48,64,80,96,112")
    ap.add_argument("--modes", default="split,ahead")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeline", default="", help="mode:n,... timelines of one forward each (e.g. ahead:72,split:56)")
    ap.add_argument("--sync-debug", action="store_true", help="with --timeline: one more forward each under "
                    "torch.cuda.set_sync_debug_mode('warn'), the host syncs' places printed")
    ap.add_argument("--tiny", action="store_true", help="the tiny test model (a smoke test of this script on a CPU)")
    a = ap.parse_args()
    ns = [int(v) for v in a.n.split(",")]
    for quant in a.quant.split(","):
        model, device = bench_model(a.tiny, a.layers, None)
        cuda = device.type == "cuda"
        ktinject.inject(model, gpu=str(device), quant=quant, prefill="cpu", gpu_experts_budget=0)
        s = stream.attach(model, "gpu")  # (auto would attach nothing off CUDA)
        s.setup()
        block = s.blocks[0]
        costs = s.costs_for(block)
        cap = s.experts.cap
        print(f"\n## {quant}: {a.layers} layers, T={a.tokens}, H2D {s.experts.h2d / 1e9:.1f} GB/s, slot {cap} experts; "
              f"costs {costs}", flush=True)
        E = block.num_experts
        est = policy.estimates(a.tokens, 8, block.num_experts, costs, cap)
        print(f"# estimates per layer (ms): " + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in est.items())
              + f"; auto chooses {policy.choose_mode(a.tokens, 8, block.num_experts, costs, cap)}", flush=True)
        log = {"cpu": [], "gpu": []}
        orig_stream, orig_split = s.experts.stream, policy.choose_split
        forced = {"n": 0}

        def timed_stream(*args, **kw):
            if not cuda:
                return orig_stream(*args, **kw)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            out = orig_stream(*args, **kw)
            e1.record()
            log["gpu"].append((e0, e1))
            return out

        def top_n(counts, eligible, costs):
            ids = np.flatnonzero(eligible & (counts > 0))
            order = ids[np.lexsort((ids, -counts[ids]))]
            return sorted(int(e) for e in order[:forced["n"]])

        raw_task = native.Task()
        steered = s.feedback.balance
        configs = [("cpu", None), ("gpu", None), ("auto", None)]
        configs += [(m, n) for m in a.modes.split(",") for n in ns]
        results = {c: [] for c in configs}
        layer_t = {c: {"cpu": [], "gpu": []} for c in configs}
        time_prefill(model, a.tokens, device)
        for rep in range(a.reps):
            for c in configs:
                mode, n = c
                s.switch("auto" if mode in ("split", "ahead") else mode)
                for attr in ("_decide", "_ahead_n"):
                    s.__dict__.pop(attr, None)
                s.experts.__dict__.pop("stream", None)
                s.split._native_task = None  # a fresh task at the next split layer
                s.feedback.balance = steered if mode == "auto" else _Fixed()  # forced n: not steered away
                policy.choose_split = orig_split
                if mode in ("split", "ahead"):
                    forced["n"] = n
                    s._decide = lambda block, T, k, m=mode: m
                    s._ahead_n = lambda block, T, k, n=n: n
                    policy.choose_split = top_n
                    s.experts.stream = timed_stream
                    s.split._native_task = _TimedTask(raw_task, log)
                if rep == 0:
                    time_prefill(model, a.tokens, device)  # warm this config (ring sets, caches)
                log["cpu"].clear()
                log["gpu"].clear()
                sec = time_prefill(model, a.tokens, device)
                results[c].append(a.tokens / sec)
                if cuda:
                    torch.cuda.synchronize()
                layer_t[c]["cpu"] += log["cpu"]
                layer_t[c]["gpu"] += [e0.elapsed_time(e1) / 1e3 for e0, e1 in log["gpu"]]
        policy.choose_split = orig_split
        for spec in filter(None, a.timeline.split(",")):
            mode, n = spec.split(":")
            s.switch("auto")
            s.feedback.balance = _Fixed()
            s.experts.__dict__.pop("stream", None)
            s.split._native_task = None
            forced["n"] = int(n)
            s._decide = lambda block, T, k, m=mode: m
            s._ahead_n = lambda block, T, k, n=int(n): n
            policy.choose_split = top_n
            time_prefill(model, a.tokens, device)
            if cuda:
                timeline(model, s, device, a.tokens, mode, int(n))
                if a.sync_debug:
                    sync_places(model, device, a.tokens, mode, int(n))
            policy.choose_split = orig_split
            for attr in ("_decide", "_ahead_n"):
                s.__dict__.pop(attr, None)
        scale = a.layers / 48
        for c in configs:
            mode, n = c
            r = results[c]
            med = statistics.median(r)
            line = (f"{quant} {mode}{'' if n is None else f' n={n}'}: {med * scale:,.0f} tok/s whole-model "
                    f"({med:,.0f} on {a.layers} layers; runs " + ", ".join(f"{v * scale:,.0f}" for v in r) + ")")
            if n is not None:
                cpu_t, gpu_t = layer_t[c]["cpu"], layer_t[c]["gpu"]
                if mode == "split":
                    cpu_m, gpu_m = policy.split_times(policy.uniform_rows(a.tokens, 8, E), costs)
                    e = f"est cpu {1e3 * cpu_m[n]:.2f} gpu {1e3 * gpu_m[n]:.2f}"
                else:
                    e = f"est {1e3 * policy.ahead_times(a.tokens, 8, E, costs, cap)[min(n, cap)]:.2f}"
                line += (f"; layer cpu {1e3 * statistics.median(cpu_t) if cpu_t else float('nan'):.2f} ms, "
                         f"gpu {1e3 * statistics.median(gpu_t) if gpu_t else float('nan'):.2f} ms; {e}")
            print("# " + line, flush=True)
        stream.attach(model, "cpu")
        del model, s
        if cuda:
            torch.cuda.empty_cache()



def timeline(model, s, device, tokens: int, mode: str, n: int, layers=(3, 4, 5, 6)) -> None:
    """One forward of ``mode`` with n GPU experts a layer, its timeline printed: per layer, host times (entry of
    ``SplitLayers.layer``, routing sync returned, CPU task submitted / waited) and device times (each copy's span, the
    streamed compute's span) in ms from the forward's start (device times mapped to the host clock by a synchronized
    event)."""
    from ktinject.gpu_experts.prefill import ring as ring_mod

    marks: list[tuple[str, int, object]] = []  # (what, layer, host seconds or (start, end) events)
    cur = {"L": -1}
    orig_split, orig_stream, orig_issue, orig_event = s.split.layer, s.experts.stream, s.experts.ring._issue, \
        s.split._event

    def split(i, *a, **kw):
        cur["L"] = i
        marks.append(("enter", i, time.perf_counter()))
        return orig_split(i, *a, **kw)

    def stream_(*a, **kw):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = orig_stream(*a, **kw)
        e1.record()
        marks.append(("gpu", cur["L"], (e0, e1)))
        return out

    def issue(key, *a, **kw):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(s.experts.ring.stream)
        item = orig_issue(key, *a, **kw)
        e1.record(s.experts.ring.stream)
        marks.append(("copy", key[0] if isinstance(key[0], int) else -1, (e0, e1)))
        return item

    class Ev:
        def __init__(self, ev):
            self.ev = ev

        def record(self, *a):
            self.ev.record(*a)

        def synchronize(self):
            self.ev.synchronize()
            marks.append(("synced", cur["L"], time.perf_counter()))

    class Tk:
        def __init__(self, t):
            self.t = t

        def bind(self, *a, **kw):
            return self.t.bind(*a, **kw)

        def submit(self):
            marks.append(("submit", cur["L"], time.perf_counter()))
            self.t.submit()

        def wait(self):
            self.t.wait()
            marks.append(("waited", cur["L"], time.perf_counter()))

    raw = s.split._task()
    s.split.layer, s.experts.stream, s.experts.ring._issue = split, stream_, issue
    copied = Ev(orig_event())
    s.split._event = lambda name="_copied": copied if name == "_copied" else orig_event(name)
    s.split._native_task = Tk(raw)
    try:
        torch.cuda.synchronize()
        ref = torch.cuda.Event(enable_timing=True)
        ref.record()
        ref.synchronize()
        t_ref = time.perf_counter()
        time_prefill(model, tokens, device)
        torch.cuda.synchronize()
    finally:
        for attr in ("layer", "_event"):
            s.split.__dict__.pop(attr, None)
        s.experts.__dict__.pop("stream", None)
        s.experts.ring.__dict__.pop("_issue", None)
        s.split._native_task = raw
    rows = {}
    for what, L, v in marks:
        if isinstance(v, tuple):
            a, b = (t_ref * 1e3 + ref.elapsed_time(e) for e in v)
            rows.setdefault(L, []).append(f"{what} {a - t_ref * 1e3:.2f}-{b - t_ref * 1e3:.2f}")
        else:
            rows.setdefault(L, []).append(f"{what} {1e3 * (v - t_ref):.2f}")
    print(f"# timeline {mode} n={n} (ms from the forward's start; copy L = the copy of layer L's experts):")
    for L in layers:
        print(f"#   layer {L}: " + "; ".join(rows.get(L, [])), flush=True)



def sync_places(model, device, tokens: int, mode: str, n: int) -> None:
    """One forward under torch.cuda.set_sync_debug_mode("warn"): each distinct place (our files' frames) that
    synchronized the host with the device, with its count."""
    import traceback
    import warnings

    places: dict[str, int] = {}

    def show(message, category, filename, lineno, file=None, line=None):
        stack = [f"{f.filename.split('/ktinject/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                 if "/ktinject/" in f.filename and "probe_split" not in f.filename][-4:]
        key = str(message)[:60] + " @ " + " <- ".join(reversed(stack))
        places[key] = places.get(key, 0) + 1

    old = warnings.showwarning
    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            time_prefill(model, tokens, device)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    print(f"# host syncs in one {mode} n={n} forward ({sum(places.values())}):")
    for k, v in sorted(places.items(), key=lambda kv: -kv[1]):
        print(f"#   {v} x {k}", flush=True)


if __name__ == "__main__":
    main()
