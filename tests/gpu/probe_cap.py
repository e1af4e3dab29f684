"""What bounds the CPU side of decode: the host's memory bandwidth of the moment, or the kernels' own ceiling?
(issues 18 and 21). On the GPU machine every decode path read 110-135 GB/s (bf16 and int4, batch 1 and 8) and
flattened past 8-12 threads, while the read probe's best passes reached 143-198 GB/s and its passes moved 66-198
GB/s within seconds (2026-11-29, H200 host): measured in separate stretches of time, the two cannot be compared.

Here they take turns in short windows, many times: one pass of the read loop (the start-of-run probe's best
variant) over a buffer of ~4x the LLC, then one cache-cold pass of native decode forwards over L layers (fresh
experts each pass), each ~10-40 ms. If the decode's GB/s follows the loop's from window to window (correlation
near 1; the decode faster in the loop's fast windows), the host's bandwidth bounds it; if it stays flat while the
loop swings, the kernels' access pattern does, and the loop's fast windows are bandwidth left unused.

Result (H200 host, 2026-11-29, the loop over 4x the LLC as bench.memory had it then): decode flat at 101-126 GB/s
(bf16, batch 1) and 111-140 (int4, batch 8) while the loop moved 94-373 and 83-358, correlation +0.23 both: the
loop's fast passes were LLC hits (tests/gpu/probe_llc.py), and bench.memory's buffer is now >= 32x the LLC.

    python tests/gpu/probe_cap.py [--quant bf16] [--layers 16] [--batch 1] [--windows 60] [--threads 15]

No GPU needed (the GPU machine's CPU is the one that matters). Legend: L layers, B batch, E experts.
"""
from __future__ import annotations

import argparse
import statistics
import time

from probe_cpu_decode import Passes, build, distinct  # the sibling probe's layers (Qwen3-30B-A3B shapes), passes


def pearson(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else float("nan")


def thirds(pairs: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(median read, median decode) GB/s of the windows in the slowest, middle and fastest third of the read passes."""
    s = sorted(pairs)
    n = len(s)
    cut = [s[: n // 3], s[n // 3: n - n // 3], s[n - n // 3:]]
    return [(statistics.median(r for r, _ in c), statistics.median(d for _, d in c)) for c in cut if c]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quant", default="bf16")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--windows", type=int, default=60)
    ap.add_argument("--threads", type=int, default=15, help="native pool threads (the read loop: one per core)")
    ap.add_argument("--read-gb", type=float, default=1.0, help="read buffer, at least (bench.memory: >= 32x the LLC)")
    args = ap.parse_args()
    if args.windows < 3:
        ap.error("--windows: at least 3 (the windows are compared in thirds)")

    from ktinject.bench.memory import ReadLoop, measure_read_bandwidth
    from ktinject.native import Pool

    t0 = time.perf_counter()
    layers = build(args.layers, args.quant, args.experts)
    nbytes = distinct(args.batch, args.experts) * layers[0].nbytes / args.experts * args.layers  # a pass
    mem = measure_read_bandwidth(args.read_gb, repeats=3)
    print(f"# {args.quant}, {args.layers} layers x {args.experts} experts, batch {args.batch}: {nbytes / 1e6:.0f} MB a "
          f"decode pass; built in {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"# {mem.summary()}", flush=True)
    variant = mem.best_variant
    if variant is None:
        raise SystemExit("the native read loop could not be built (no C compiler): nothing to compare")
    pool = Pool(args.threads)
    pairs = []
    try:
        with ReadLoop(mem.nbytes, mem.threads, variant) as loop:
            decode = Passes(layers, pool, args.batch, args.experts, seed=0)
            loop.seconds()
            decode.seconds()  # warm-up (threads, scratch)
            for _ in range(args.windows):  # a read pass, then at once the decode pass it is paired with
                read = loop.gbs()
                pairs.append((read, nbytes / decode.seconds() / 1e9))
    finally:
        pool.close()
    reads, decs = [p[0] for p in pairs], [p[1] for p in pairs]
    print(f"# {args.windows} windows: read loop ({variant.name}, {mem.nbytes / 1e9:.2f} GB) "
          f"{min(reads):.0f}-{max(reads):.0f} GB/s (median {statistics.median(reads):.0f}); decode "
          f"{min(decs):.0f}-{max(decs):.0f} (median {statistics.median(decs):.0f}); correlation "
          f"{pearson(reads, decs):+.2f}", flush=True)
    for name, (r, d) in zip(("slowest", "middle", "fastest"), thirds(pairs)):
        print(f"#   the read loop's {name} third of windows: read {r:.0f} GB/s, decode {d:.0f} GB/s "
              f"({100 * d / r:.0f}% of it)", flush=True)
    print("# windows (read, decode GB/s): " + ", ".join(f"{r:.0f}/{d:.0f}" for r, d in pairs), flush=True)


if __name__ == "__main__":
    main()
