"""Where an auto (ahead / split) prefill layer's CPU idles: per overlapped layer, from the layer before's CPU task
end to this layer's task start, split into the GPU's and the host's parts, from the native task times
(``Task.times``, CLOCK_MONOTONIC = perf_counter) and the host's clock in ``SplitLayers``, and the GPU's time from
the layer before's combine to this layer's routing copied (CUDA events):

    host launch                the host from queuing layer L-1's combine to queuing layer L's routing copy
    end(L-1) -> synced(L)      the GPU: wait word seen, combine, attention, router, routing to the host; the
                               host's wake from the routing's event (gated layers: -> start(L), the whole gap;
                               the next two are 0 there)
    synced(L) -> submitted(L)  the host: bincount, sets, skip mask, bind
    submitted(L) -> start(L)   the pool's wake
    start(L) -> end(L)         the CPU's experts

    python benchmarks/probe_ahead_gap.py [--layers 12] [--quant int8] [--tokens 512] [--reps 5]
(KTINJECT_SPIN_US, KTINJECT_PREFILL_GATED etc. from the environment: one setting a process.)
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import ktinject
from ktinject import native
from ktinject.bench.model import bench_model
from ktinject.bench.prefill import time_prefill
from ktinject.decode.generate import get_runner
from ktinject.gpu_experts.prefill import feedback as balance
from ktinject.gpu_experts.prefill import split
from ktinject.gpu_experts.prefill import streamer as stream


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--quant", default="int8")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ab", action="store_true", help="only tok/s, KTINJECT_PREFILL_GATED 1 and 0 in turns, one "
                    "forward each, --reps of each (one process, one streamer: the host's drift hits both alike)")
    ap.add_argument("--threads", type=int, default=None, help="the native pool's threads (default: the library's)")
    a = ap.parse_args()
    model, device = bench_model(False, a.layers, a.threads)
    ktinject.inject(model, gpu=str(device), quant=a.quant, prefill="cpu", gpu_experts_budget=0)
    get_runner(model, use_graphs=False, prefill_chunk="auto")
    probe = stream.attach(model, "gpu")
    probe.switch("auto")
    for _ in range(3 * balance.TRIALS + 2):
        time_prefill(model, a.tokens, device)

    if a.ab:
        walls = {"1": [], "0": []}
        for _ in range(a.reps):
            for v in walls:
                os.environ["KTINJECT_PREFILL_GATED"] = v
                walls[v].append(time_prefill(model, a.tokens, device))
        os.environ.pop("KTINJECT_PREFILL_GATED")
        for v, w in walls.items():
            print(f"# {a.quant}, {a.tokens} tokens, gated {v}: {a.tokens / statistics.median(w):,.0f} tok/s (runs "
                  + ", ".join(f"{a.tokens / t:,.0f}" for t in w) + ")", flush=True)
        return
    rec: dict = {"times": [], "settled": [], "combine": [], "routed": [], "host": []}
    orig_times, orig_observe = native.Task.times, stream.PrefillStreamer.observe
    orig_combine, orig_shared = split.hostio.combine, split.shared_output

    def times(self):
        got = orig_times(self)
        rec["times"].append(got)
        return got

    def observe(self, i, T, cpu_counts, times_, idle, ahead, m, cpu_end=None):
        if cpu_end is not None:  # an overlapped layer (gated or not): its task's (start, end) was just read
            rec["settled"].append((i, times_, rec["times"][-1]))
        return orig_observe(self, i, T, cpu_counts, times_, idle, ahead, m, cpu_end)

    def combine(*args, **kwargs):
        out = orig_combine(*args, **kwargs)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        rec["combine"].append(ev)
        rec["host"].append(("combined", time.perf_counter()))
        return out

    def shared(*args, **kwargs):  # called right after the routing's copy event is recorded
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        rec["routed"].append(ev)
        rec["host"].append(("routed", time.perf_counter()))
        return orig_shared(*args, **kwargs)

    native.Task.times, stream.PrefillStreamer.observe = times, observe
    split.hostio.combine, split.shared_output = combine, shared
    walls = []
    gaps = {"host launch": [], "gpu+wake": [], "host": [], "pool wake": [], "cpu": [], "gpu combine->routed": []}
    try:
        for _ in range(a.reps):
            for v in rec.values():
                v.clear()
            walls.append(time_prefill(model, a.tokens, device))
            torch.cuda.synchronize()
            by = {j: (t, se) for j, t, se in rec["settled"]}
            for j in sorted(by):
                if j - 1 in by:
                    (_, synced, submitted, _, _), (start, end) = by[j]
                    prev_end = by[j - 1][1][1]
                    gaps["gpu+wake"].append(synced - prev_end)
                    gaps["host"].append(submitted - synced)
                    gaps["pool wake"].append(start - submitted)
                    gaps["cpu"].append(end - start)
            # the host from layer j-1's combine queued to layer j's routing queued: the dense part's launches
            h = rec["host"]
            for (k0, t0), (k1, t1) in zip(h, h[1:]):
                if k0 == "combined" and k1 == "routed":
                    gaps["host launch"].append(t1 - t0)
            # combine of layer j-1 (index j-1 among the overlapped layers) -> routing of layer j
            for c, r in zip(rec["combine"], rec["routed"][1:]):
                gaps["gpu combine->routed"].append(c.elapsed_time(r) / 1e3)
    finally:
        native.Task.times, stream.PrefillStreamer.observe = orig_times, orig_observe
        split.hostio.combine, split.shared_output = orig_combine, orig_shared
    L = len(stream.blocks_of(model))
    wall = statistics.median(walls)
    print(f"# {a.quant}, {L} layers, {a.tokens} tokens, KTINJECT_SPIN_US={os.environ.get('KTINJECT_SPIN_US', '')}, "
          f"threads {a.threads or 'default'}, gated {os.environ.get('KTINJECT_PREFILL_GATED', '1')}: "
          f"{a.tokens / wall:,.0f} tok/s (runs " + ", ".join(f"{a.tokens / w:,.0f}" for w in walls)
          + f"), {1e3 * wall / L:.2f} ms a layer; {probe.last.get('mode')}, "
          f"{statistics.median(probe.last.get('gpu_experts') or [0]):g} experts a layer on the GPU", flush=True)
    for k, v in gaps.items():
        if v:
            q = sorted(v)
            print(f"#   {k:22s} median {1e6 * statistics.median(v):8.1f} us  p10 {1e6 * q[len(q) // 10]:8.1f}  "
                  f"p90 {1e6 * q[9 * len(q) // 10]:8.1f}  (n {len(v)})", flush=True)


if __name__ == "__main__":
    main()
