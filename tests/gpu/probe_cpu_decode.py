"""Where a decode step's CPU expert time goes (issues 18 and 21): native forwards of L layers of Qwen3-30B-A3B-shaped
experts, cache-cold (each pass routes every layer to experts its previous pass did not use), timed per pass, at
batch 1, 2, 4, 8, for each quant and thread count; a fit of the time per layer against the bytes read per layer
(time = fixed + bytes / bandwidth) says whether a step is bound by memory bandwidth or by a per-layer fixed cost.
Beside it: the per-forward cost with every expert masked (Python + the pool's hand-off, no weights read) and the
read bandwidth of the run's best read loop (bench.memory).

    python tests/gpu/probe_cpu_decode.py [--layers 16] [--quant int4,int8] [--threads 15,8] [--batch 1,2,4,8]

No GPU needed; on the GPU machine it shows that host. Legend: L layers, B batch (tokens of a step), k experts per
token, E experts.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

H, I, E, K = 2048, 768, 128, 8


def build(layers: int, quant: str, e: int):
    """L layers of E experts: one layer quantized from random weights, its packed bytes copied into the others
    (distinct memory, same values: the kernels' speed does not depend on them)."""
    from ktinject.native import Experts

    gen = torch.Generator().manual_seed(0)
    gu = (torch.randn(e, 2 * I, H, generator=gen) * 0.02).to(torch.bfloat16)
    dn = (torch.randn(e, H, I, generator=gen) * 0.02).to(torch.bfloat16)
    first = Experts.from_hf(gu, dn, quant=quant)
    packed = first.export()
    out = [first]
    for _ in range(layers - 1):
        ex = Experts(e, H, I, quant=quant)
        ex.load_packed(packed)
        out.append(ex)
    return out


def passes(layers, pool, batch: int, n: int, e: int, skip=None) -> list[float]:
    from ktinject.bench.timing import fresh_ids

    gen = torch.Generator().manual_seed(batch)
    xs = [torch.randn(batch, H, generator=gen).to(torch.bfloat16) for _ in layers]
    w = torch.full((batch, K), 1.0 / K)
    outs = [torch.empty(batch, H, dtype=torch.bfloat16) for _ in layers]
    prev = [set() for _ in layers]
    times = []
    for p in range(n + 1):
        ids = [fresh_ids(gen, e, K, batch, prev[i]) for i in range(len(layers))]
        prev = [set(i.flatten().tolist()) for i in ids]
        t0 = time.perf_counter()
        for ex, x, i, o in zip(layers, xs, ids, outs):
            ex.forward(x, i, w, skip=skip, out=o, pool=pool)
        if p:
            times.append(time.perf_counter() - t0)
    return times


def distinct(batch: int, e: int) -> float:
    return e * (1 - (1 - K / e) ** batch)


def _huge() -> str:
    """This process's transparent huge pages (the experts' memory asks for them: experts.c, MADV_HUGEPAGE)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().strip()
        with open("/proc/self/smaps_rollup") as f:
            roll = {k: v.strip() for k, v in (ln.split(":", 1) for ln in f if ":" in ln)}
        return f"THP {mode}; AnonHugePages {roll.get('AnonHugePages')} of Rss {roll.get('Rss')}"
    except OSError as e:
        return f"THP unknown ({e})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=E)
    ap.add_argument("--quant", default="int4,int8")
    ap.add_argument("--threads", default="15")
    ap.add_argument("--batch", default="1,2,4,8")
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--gemv", default="default", help="comma-separated: default, 0, 1 (KTINJECT_GEMV)")
    args = ap.parse_args()
    from ktinject.bench.memory import measure_read_bandwidth
    from ktinject.native import Pool

    for quant in args.quant.split(","):
        t0 = time.perf_counter()
        layers = build(args.layers, quant, args.experts)
        per_expert = layers[0].nbytes / args.experts
        print(f"# {quant}: {args.layers} layers x {args.experts} experts, {per_expert / 1e6:.3f} MB an expert, "
              f"built in {time.perf_counter() - t0:.0f} s; {_huge()}", flush=True)
        for nt in [int(t) for t in args.threads.split(",")]:
            pool = Pool(nt)
            mem = measure_read_bandwidth(2.0, nt)
            print(f"# threads {nt}: read bandwidth best {mem.best_gbs:.1f} GB/s", flush=True)
            skip = torch.ones(args.experts, dtype=torch.uint8)
            fixed = statistics.median(passes(layers, pool, 1, args.passes, args.experts, skip)) / args.layers
            print(f"#   every expert masked: {1e6 * fixed:.1f} us a forward (Python + hand-off)", flush=True)
            for gemv in args.gemv.split(","):
                if gemv == "default":
                    os.environ.pop("KTINJECT_GEMV", None)
                else:
                    os.environ["KTINJECT_GEMV"] = gemv
                pts = []
                for b in [int(x) for x in args.batch.split(",")]:
                    ts = passes(layers, pool, b, args.passes, args.experts)
                    med = statistics.median(ts) / args.layers
                    nbytes = distinct(b, args.experts) * per_expert
                    pts.append((nbytes, med))
                    print(f"#   gemv={gemv} B={b}: {1e6 * med:.1f} us a layer (runs {min(ts) / args.layers * 1e6:.0f}-"
                          f"{max(ts) / args.layers * 1e6:.0f}), {nbytes / 1e6:.1f} MB -> "
                          f"{nbytes / med / 1e9:.1f} GB/s", flush=True)
                if len(pts) >= 2:  # least squares time = a + bytes / bw
                    n = len(pts)
                    mx = sum(p[0] for p in pts) / n
                    my = sum(p[1] for p in pts) / n
                    sxx = sum((p[0] - mx) ** 2 for p in pts)
                    slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
                    a = my - slope * mx
                    print(f"#   gemv={gemv} fit: fixed {1e6 * a:.1f} us a layer + bytes at {1e-9 / slope:.1f} GB/s",
                          flush=True)
            os.environ.pop("KTINJECT_GEMV", None)
            pool.close()
        del layers


if __name__ == "__main__":
    main()
