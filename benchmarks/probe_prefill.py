"""A/B of prefill forwards under environment settings, interleaved in one process: the DeepSeek-V3 layer shapes
(H 7168, I 2048) with 32 experts and 4096 * 32 / 256 = 512 tokens, top-8 random routing (128 rows per expert, as
4096 tokens over the real 256 experts; the same work as `python -m ktinject.bench kernels`).

    python benchmarks/probe_prefill.py [--threads N] [--quants bf16,int8,int4] [--reps 7] [--configs "A=1;A=0 B=2"]

Each config (';'-separated, each a space-separated list of VAR=VALUE, '' = none) is applied to os.environ before its
forward; the native module reads such variables at each forward (KTINJECT_TILES, KTINJECT_INT4_PATH). Prints the
median and the range of TFLOPS (2 T k 3 H I / time) per config."""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ktinject import native as kn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quants", default="bf16,int8,int4")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--configs", default="KTINJECT_TILES=0;")
    a = ap.parse_args()
    E, H, I, k, T = 32, 7168, 2048, 8, 512
    pool = kn.Pool(a.threads or kn.default_threads())
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.02).bfloat16()
    down = (torch.randn(E, H, I, generator=g) * 0.02).bfloat16()
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.rand(T, E, generator=g).topk(k, dim=-1).indices
    w = torch.softmax(torch.randn(T, k, generator=g), -1)
    out = torch.empty(T, H, dtype=torch.bfloat16)
    flops = 2.0 * T * k * 3 * H * I
    configs = a.configs.split(";")
    print(f"threads {pool.threads}, DeepSeek-V3 shapes, {E} experts, {T} tokens, top-{k}")
    for quant in a.quants.split(","):
        ex = kn.Experts.from_hf(gate_up, down, quant=quant)
        res = {c: [] for c in configs}
        for rep in range(a.reps + 1):
            for i in range(len(configs)):
                cfg = configs[(i + rep) % len(configs)]
                env = dict(kv.split("=", 1) for kv in cfg.split())
                saved = {kk: os.environ.get(kk) for kk in env}
                os.environ.update(env)
                t0 = time.perf_counter()
                ex.forward(x, ids, w, out=out, pool=pool)
                dt = time.perf_counter() - t0
                for kk, v in saved.items():
                    if v is None:
                        os.environ.pop(kk, None)
                    else:
                        os.environ[kk] = v
                if rep:  # rep 0: warm-up
                    res[cfg].append(flops / dt / 1e12)
        for cfg, r in res.items():
            print(f"  {quant:5s} {cfg or '(default)':28s} {statistics.median(r):6.2f} TFLOPS [{min(r):.2f}-{max(r):.2f}]")
        del ex


if __name__ == "__main__":
    main()
