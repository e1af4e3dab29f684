"""The decode step's handshake with the CPU pool, variant by variant, in CUDA graphs of 48 layers (Qwen3-30B-A3B's
router: 128 experts, H 2048, k 8; batch 1 and 8; every expert skipped, so the CPU side is the pool taking the task
and raising done): each layer is the router kernel staging the CPU's inputs, the handshake, and the collect of the
output, whose result is the next layer's input (the dependency chain of a decode step).

- memops:    router; write-value go; wait-value done; collect kernel (copy + reset)   (before 79941f1)
- router-go: router raising go itself; wait-value done; collect kernel
- spin:      router; write-value go; collect kernel polling done itself
- both:      router raising go; collect polling done                                 (79941f1)
- both-sys:  both, with the per-token counters of the router at system scope (79941f1 as committed)
- no-cpu:    router; collect without any handshake (what the GPU costs alone)

Variants take turns (ROUNDS rounds), each timed over 20 replays; the median per layer is printed, then for each
variant the pool's profile of 20 more replays (a layer's CPU job from taking the go flag to raising done: the rest of
the handshake is the two flags' way across PCIe and the stream's nodes).

    PYTHONPATH=$PWD python tests/gpu/probe_handshake.py [ROUNDS]"""
from __future__ import annotations

import statistics
import sys

import torch

from ktinject import cuda_driver
from ktinject.operators import fused
from ktinject.bench.handshake import tiny_experts
from ktinject.stream_experts import StreamExperts

E, H, K, LAYERS = 128, 2048, 8, 48
VARIANTS = ("memops", "router-go", "spin", "both", "both-sys", "no-cpu")


def step(variant: str, rs, x, W):
    stream = torch.cuda.current_stream().cuda_stream
    y = x
    fused._ROUTER_SCOPE = "sys" if variant == "both-sys" else "gpu"
    for r in rs:
        go = variant in ("router-go", "both", "both-sys")
        spin = variant in ("spin", "both", "both-sys")
        fused.router_topk(y, W, K, stage=(r.h, r.ids, r.w), go=r.flags[0:1] if go else None)
        if variant == "no-cpu":
            fused.copy(r.h, r.out)
            y = r.out
            continue
        if not go:
            cuda_driver.stream_write_value32(stream, r.go_dptr, 1)
        if spin:
            fused.copy(r.o, r.out, r.flags[r.DONE:r.DONE + 1], wait=True)
        else:
            cuda_driver.stream_wait_value32(stream, r.done_dptr, 1, cuda_driver.CU_STREAM_WAIT_VALUE_EQ)
            fused.copy(r.o, r.out, r.flags[r.DONE:r.DONE + 1])
        y = r.out
    fused._ROUTER_SCOPE = "gpu"
    return y


def main(rounds: int) -> None:
    torch.manual_seed(0)
    experts = tiny_experts(E, H, 16)
    skip = torch.ones(E, dtype=torch.uint8)
    W = torch.randn(E, H, device="cuda") * 0.02
    from ktinject.bench.timing import profile_line
    from ktinject.native import default_pool

    pool = default_pool()
    for T in (1, 2, 4, 8):
        rs = [StreamExperts(experts, T, K, H, "cuda", skip=skip) for _ in range(LAYERS)]
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        graphs = {}
        for v in VARIANTS:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step(v, rs, x, W)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                step(v, rs, x, W)
            graphs[v] = g
        times = {v: [] for v in VARIANTS}
        for _ in range(rounds):
            for v, g in graphs.items():
                for _ in range(3):
                    g.replay()
                torch.cuda.synchronize()
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                for _ in range(20):
                    g.replay()
                t1.record()
                torch.cuda.synchronize()
                times[v].append(t0.elapsed_time(t1) * 1e3 / 20 / LAYERS)
        for v in VARIANTS:
            ts = sorted(times[v])
            print(f"T={T} {v:10s} {statistics.median(ts):6.2f} us a layer (min {ts[0]:.2f}, max {ts[-1]:.2f}; "
                  f"x48 = {statistics.median(ts) * 48 / 1000:.2f} ms)", flush=True)
        for v in ("memops", "both"):
            with pool.profiling() as prof:
                for _ in range(20):
                    graphs[v].replay()
                torch.cuda.synchronize()
            print(f"T={T} {v:10s} profile: {profile_line(prof)}", flush=True)
        for r in rs:
            r.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
