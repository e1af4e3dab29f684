"""What a prefill layer costs outside its routed experts (``policy.Costs.layer_s``): a 512-token prefill on the CPU
path with every routed expert muted (the native skip mask all 1: the pool returns at once) against the same with
experts, per layer; the host's time a layer split between attention, the MoE block and the rest (hooks); then one
muted forward under torch.profiler (CPU and CUDA activities): the ops by host time and by GPU time (``--trace
FILE``: its chrome trace too).

    python benchmarks/probe_layer_overhead.py [--layers 12] [--quant int8] [--tokens 512] [--reps 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import ktinject
from ktinject.bench.model import bench_model
from ktinject.bench import timing
from ktinject.bench.prefill import time_prefill
from ktinject.gpu_experts.prefill import streamer as stream


def host_split(model, run) -> str:
    """Where a forward's host time goes, a layer: the host's time inside each decoder layer's attention module and
    MLP (the MoE block: routing, its copies, the native task, the host's wait for the routing) and the rest of the
    layer (norms, residual adds), from perf_counter hooks on one run (medians over the layers; the hooks' own cost
    is a few us)."""
    from ktinject.decode.graph_runner import decoder_layers

    spans: dict[str, list[float]] = {"layer": [], "attention": [], "mlp": []}
    hooks, starts = [], {}

    def watch(module, name):
        def pre(mod, args, kwargs=None):
            starts[id(mod)] = time.perf_counter()

        def post(mod, args, *rest):
            spans[name].append(time.perf_counter() - starts.pop(id(mod)))

        hooks.append(module.register_forward_pre_hook(pre))
        hooks.append(module.register_forward_hook(post))

    for layer in decoder_layers(model):
        watch(layer, "layer")
        watch(layer.self_attn, "attention")
        watch(layer.mlp, "mlp")
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    med = {k: 1e3 * statistics.median(v) for k, v in spans.items() if v}
    if len(med) < 3:
        return "host split: no decoder layers seen"
    rest = med["layer"] - med["attention"] - med["mlp"]
    return (f"host time a layer (median of {len(spans['layer'])}): {med['layer']:.3f} ms = attention "
            f"{med['attention']:.3f} + MoE block {med['mlp']:.3f} (routing, copies, native task, waits) + rest "
            f"{rest:.3f} (norms, residual adds)")


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
    ktinject.inject(model, gpu=str(device), quant=a.quant, prefill="cpu", gpu_experts_budget=0)
    blocks = stream.blocks_of(model)
    L = len(blocks)

    def timed():
        time_prefill(model, a.tokens, device)
        return statistics.median(time_prefill(model, a.tokens, device) for _ in range(a.reps))

    full = timed()
    with timing.muted(model):  # (the masks restored on the way out, an exception too)
        muted = timed()
        print(f"# {a.quant}, {L} layers, {a.tokens} tokens, cpu path: with experts {1e3 * full:.1f} ms "
              f"({1e3 * full / L:.2f} a layer), experts muted {1e3 * muted:.1f} ms ({1e3 * muted / L:.2f} a layer)",
              flush=True)
        print("# " + host_split(model, lambda: time_prefill(model, a.tokens, device)), flush=True)
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


if __name__ == "__main__":
    main()
