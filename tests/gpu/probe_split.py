"""Where a short prefill's split between the CPU and the GPU pays: tok/s of cpu, gpu, and split / ahead with a forced
number n of GPU experts a layer, interleaved in one process, with per-layer CPU and GPU times of the split layers.

    python tests/gpu/probe_split.py [--layers 12] [--quant bf16,int8,int4] [--tokens 512] [--n 16,32,...] [--reps 3]

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
from ktinject.gpu_experts import policy, stream


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
    ap.add_argument("--tiny", action="store_true", help="the tiny test model (a smoke test of this script on a CPU)")
    a = ap.parse_args()
    ns = [int(v) for v in a.n.split(",")]
    for quant in a.quant.split(","):
        model, device = bench_model(a.tiny, a.layers, None)
        cuda = device.type == "cuda"
        ktinject.inject(model, gpu=str(device), quant=quant, prefill="cpu")
        s = stream.attach(model, "gpu")  # (auto would attach nothing off CUDA)
        s.setup()
        block = s.blocks[0]
        costs = s.costs_for(block)
        print(f"\n## {quant}: {a.layers} layers, T={a.tokens}, H2D {s.h2d / 1e9:.1f} GB/s, slot {s.cap} experts; "
              f"costs {costs}", flush=True)
        E = block.num_experts
        est = policy.estimates(a.tokens, 8, block.num_experts, costs, s.cap)
        print(f"# estimates per layer (ms): " + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in est.items())
              + f"; auto chooses {policy.choose_mode(a.tokens, 8, block.num_experts, costs, s.cap)}", flush=True)
        log = {"cpu": [], "gpu": []}
        orig_stream, orig_split = s._stream, policy.choose_split
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
        configs = [("cpu", None), ("gpu", None), ("auto", None)]
        configs += [(m, n) for m in a.modes.split(",") for n in ns]
        results = {c: [] for c in configs}
        layer_t = {c: {"cpu": [], "gpu": []} for c in configs}
        time_prefill(model, a.tokens, device)
        for rep in range(a.reps):
            for c in configs:
                mode, n = c
                s.switch("auto" if mode in ("split", "ahead") else mode)
                for attr in ("_decide", "_ahead_n", "_stream", "_native_task"):
                    s.__dict__.pop(attr, None)
                policy.choose_split = orig_split
                if mode in ("split", "ahead"):
                    forced["n"] = n
                    s._decide = lambda block, T, k, m=mode: m
                    s._ahead_n = lambda block, T, k, n=n: n
                    policy.choose_split = top_n
                    s._stream = timed_stream
                    s._native_task = _TimedTask(raw_task, log)
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
                    e = f"est {1e3 * policy.ahead_times(a.tokens, 8, E, costs, s.cap)[min(n, s.cap)]:.2f}"
                line += (f"; layer cpu {1e3 * statistics.median(cpu_t) if cpu_t else float('nan'):.2f} ms, "
                         f"gpu {1e3 * statistics.median(gpu_t) if gpu_t else float('nan'):.2f} ms; {e}")
            print("# " + line, flush=True)
        stream.attach(model, "cpu")
        del model, s
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
