"""Fixed cost of a one-token forward by thread count (not a test): the tiny layer of `bench kernels` (E 8, H = I =
64, k 8), where the weights take no time, so what is left is Python's argument checks, routing, and the pool's
phases (wake-up, claims, barrier). Also the Python side alone (Experts._forward_args).

    python benchmarks/probe_overhead.py [--threads 1,2,4,8,15] [--quants bf16,int8,int4]

Prints the median of 7 timed calls of 2000 forwards each, in microseconds per forward."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ktinject import native as kn


def per_call_us(fn, n: int = 2000, rounds: int = 7) -> float:
    for _ in range(200):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2,4,8,15")
    ap.add_argument("--quants", default="bf16,int8,int4")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(8, 128, 64, generator=g).bfloat16()
    down = torch.randn(8, 64, 64, generator=g).bfloat16()
    x = torch.randn(1, 64, generator=g).bfloat16()
    ids, w = torch.arange(8).view(1, 8), torch.full((1, 8), 0.125)
    out = torch.empty(1, 64, dtype=torch.bfloat16)
    threads = [int(t) for t in args.threads.split(",")]
    print(f"isa {kn.isa()}; us per one-token forward of the tiny layer; columns: threads")
    print("quant  args  " + "  ".join(f"{t:>5}" for t in threads))
    for q in args.quants.split(","):
        ex = kn.Experts.from_hf(gate_up, down, quant=q)
        cells = []
        for t in threads:
            pool = kn.Pool(t)
            try:
                cells.append(per_call_us(lambda: ex.forward(x, ids, w, out=out, pool=pool)))
            finally:
                pool.close()
        a = per_call_us(lambda: ex._forward_args(x, ids, w, None, out))
        print(f"{q:5}  {a:4.1f}  " + "  ".join(f"{c:5.1f}" for c in cells))


if __name__ == "__main__":
    main()
