"""A/B of one-token forwards: the gemv decode path (KTINJECT_GEMV=1) against the item path (=0), interleaved in one
process, for the Qwen3-30B-A3B and DeepSeek-V3 layer shapes; cache-cold (rotating disjoint expert sets).

    python tests/gpu/probe_gemv.py [--threads N] [--configs "ENV=V ENV2=V;..."] [--quants bf16,int8,int4]

Each config (a ';'-separated list of space-separated VAR=VALUE settings, '' = none) is applied to os.environ before
its timings; the kernels may read such variables at each call (experiments). Prints ms per forward and GB/s of
expert weights (stored format) per path, and the ratio."""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ktinject import native as kn

SHAPES = {"qwen3": (128, 2048, 768), "deepseek": (32, 7168, 2048)}
BYTES = {"bf16": 2.0, "int8": 1.0, "int4": 0.5 + 4 / 64}


def build(E, H, I, quant):
    g = torch.Generator().manual_seed(0)
    ex = kn.Experts(E, H, I, quant=quant, **({"group_size": 64} if quant == "int4" else {}))
    for e in range(E):  # one random expert reused: packing cost stays small; bytes are distinct per expert
        if e == 0:
            gate, up, down = ((torch.randn(*s, generator=g) / s[1] ** 0.5).bfloat16() for s in ((I, H), (I, H), (H, I)))
        ex.set(e, "gate", gate)
        ex.set(e, "up", up)
        ex.set(e, "down", down)
    return ex


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--configs", default="")
    ap.add_argument("--quants", default="bf16,int8,int4")
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    pool = kn.Pool(a.threads or kn.default_threads())
    print(f"threads {pool.threads}")
    k = 8
    for name, (E, H, I) in SHAPES.items():
        for quant in a.quants.split(","):
            ex = build(E, H, I, quant)
            x = torch.randn(1, H).bfloat16()
            w = torch.softmax(torch.randn(1, k), -1)
            sets = [torch.arange(s * k, (s + 1) * k).view(1, k) for s in range(E // k)]
            out = torch.empty(1, H, dtype=torch.bfloat16)
            nbytes = BYTES[quant] * 3 * H * I * k
            for cfg in a.configs.split(";"):
                env = dict(kv.split("=", 1) for kv in cfg.split())
                saved = {kk: os.environ.get(kk) for kk in env}
                os.environ.update(env)
                res = {"0": [], "1": []}
                for rep in range(a.reps):
                    for v in ("0", "1"):
                        os.environ["KTINJECT_GEMV"] = v
                        for _ in range(2 if rep == 0 else 1):  # first rep: a warm-up pass per path
                            t = time.perf_counter()
                            for ids in sets:
                                ex.forward(x, ids, w, out=out, pool=pool)
                            dt = (time.perf_counter() - t) / len(sets)
                        res[v].append(dt)
                m0, m1 = (statistics.median(res[v]) for v in ("0", "1"))
                print(f"{name:8s} {quant:4s} [{cfg or 'default':18s}] items {m0 * 1e3:.3f} ms {nbytes / m0 / 1e9:6.1f} GB/s"
                      f" | gemv {m1 * 1e3:.3f} ms {nbytes / m1 / 1e9:6.1f} GB/s | gemv/items {m1 / m0:.3f}", flush=True)
                for kk, vv in saved.items():
                    if vv is None:
                        os.environ.pop(kk, None)
                    else:
                        os.environ[kk] = vv
            del ex


if __name__ == "__main__":
    main()
