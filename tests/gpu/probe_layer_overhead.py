"""What a prefill layer costs outside its routed experts (``policy.Costs.layer_s``): a 512-token prefill on the CPU
path with every routed expert muted (the native skip mask all 1: the pool returns at once) against the same with
experts, per layer; then one muted forward under torch.profiler (CPU activities): the ops by host time.

    python tests/gpu/probe_layer_overhead.py [--layers 12] [--quant int8] [--tokens 512] [--reps 5]
"""
from __future__ import annotations

import argparse
import statistics

import torch

import ktinject
from ktinject.bench.model import bench_model
from ktinject.bench.prefill import time_prefill
from ktinject.gpu_experts import stream


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--quant", default="int8")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--trace", default=None, help="write the profiled forward's chrome trace here")
    a = ap.parse_args()
    model, device = bench_model(a.tiny, a.layers, None)
    ktinject.inject(model, gpu=str(device), quant=a.quant, prefill="cpu")
    blocks = stream.blocks_of(model)
    L = len(blocks)

    def timed():
        time_prefill(model, a.tokens, device)
        return statistics.median(time_prefill(model, a.tokens, device) for _ in range(a.reps))

    full = timed()
    saved = [b.skip.clone() for b in blocks]
    for b in blocks:
        b.skip.fill_(1)
    muted = timed()
    print(f"# {a.quant}, {L} layers, {a.tokens} tokens, cpu path: with experts {1e3 * full:.1f} ms "
          f"({1e3 * full / L:.2f} a layer), experts muted {1e3 * muted:.1f} ms ({1e3 * muted / L:.2f} a layer)",
          flush=True)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts, record_shapes=False) as prof:
        time_prefill(model, a.tokens, device)
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=40), flush=True)
    if device.type == "cuda":
        print(ka.table(sort_by="self_device_time_total", row_limit=25), flush=True)
    if a.trace:
        prof.export_chrome_trace(a.trace)
    for b, s in zip(blocks, saved):
        b.skip.copy_(s)


if __name__ == "__main__":
    main()
