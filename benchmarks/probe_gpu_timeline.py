"""The decode step's GPU part on a timeline (not a test): muted replays (every routed expert skipped: GPU work and
handshakes only) of the captured decode graph under torch.profiler, the kernels' start and end read back from the
trace, and per layer kernel: the median duration, the median gap before it (the previous kernel's end to its
start; negative where PDL overlaps them) and where the step's time goes outside the layers.

    python benchmarks/probe_gpu_timeline.py [--quant int4] [--layers 48] [--trace FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict

import torch

from helpers import decode_setup
from ktinject.bench.timing import _decode_graph, muted, muted_replay, reset_lengths


def kernels(trace_path: str) -> list[tuple[str, float, float]]:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    ks = [(e["name"], float(e["ts"]), float(e["dur"])) for e in events
          if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    return sorted(ks, key=lambda k: k[1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--trace", default=None)
    a = ap.parse_args()
    model, prompt, runner = decode_setup(a.quant, a.layers)
    P = prompt.shape[1]
    entry = _decode_graph(runner, 1)
    print(f"# muted replay {muted_replay(model, runner, 1, P, 20) * 1e3:.3f} ms ({torch.cuda.get_device_name()})")
    from ktinject.operators.kernels import dense as fused_dense
    for key, config in fused_dense._CHOICE.items():  # (B, N, K, dtype, bias, residual, norm, device) -> config
        print(f"# linear {key[:3]} residual {key[5]} norm {key[6]}: {'cuBLAS' if config is None else config}")
    from torch.profiler import ProfilerActivity, profile

    with muted(model):
        reset_lengths(runner, 1, P)
        entry.graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                entry.graph.replay()
            torch.cuda.synchronize()
    path = a.trace or tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    ks = kernels(path)
    n = len(ks) // 3  # the three replays' kernels, in time order: a third each
    print(f"# {len(ks)} kernels in 3 replays ({n} a step)")
    for s in range(3):
        step = ks[s * n:(s + 1) * n]
        span = step[-1][1] + step[-1][2] - step[0][1]
        busy = sum(k[2] for k in step)
        print(f"step {s}: span {span:.1f} us, kernel time {busy:.1f} us")
    step = ks[n:2 * n]
    per = defaultdict(lambda: ([], []))
    prev_end = None
    order = []
    for name, ts, dur in step:
        short = name[:60]
        if short not in per:
            order.append(short)
        per[short][0].append(dur)
        if prev_end is not None:
            per[short][1].append(ts - prev_end)
        prev_end = ts + dur
    print(f"{'kernel':60s} {'calls':>5s} {'med us':>8s} {'sum us':>9s} {'gap med':>8s} {'gap sum':>9s}")
    for k in order:
        d, g = per[k]
        print(f"{k:60s} {len(d):5d} {statistics.median(d):8.2f} {sum(d):9.1f} "
              f"{statistics.median(g) if g else 0:8.2f} {sum(g):9.1f}")
    # a stretch of the middle replay in order: from a layer ~20 layers after the first router (5 kernels a layer)
    names = [k[0][:40] for k in step]
    first = next((i for i, nm in enumerate(names) if nm.startswith("router_k")), None)
    if first is not None:
        i0 = max(0, first + 5 * 20 - 6)
        print("# a middle stretch (name, start rel us, dur, gap):")
        t0 = step[i0][1]
        pe = step[i0 - 1][1] + step[i0 - 1][2]
        for name, ts, dur in step[i0:i0 + 14]:
            print(f"  {name[:50]:50s} {ts - t0:8.2f} {dur:7.2f} {ts - pe:7.2f}")
            pe = ts + dur


if __name__ == "__main__":
    main()
