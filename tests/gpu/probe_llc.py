"""Is the read roofline a DRAM figure? (issues 18 and 21). The benches' limit reads a buffer of 4x the LLC; on the
H200 host (300 MiB LLC) its passes moved 94-373 GB/s between windows seconds apart while cache-cold decode held
101-126 (tests/gpu/probe_cap.py, 2026-11-29): passes above the DRAM's speed mean part of the buffer came from the
LLC. Here buffers of 4, 8, 16 and 32x the LLC are read in turns, the same variants on each, many rounds: if the
spread and the peaks shrink as the buffer grows, the 4x buffer's figure holds cache hits, not DRAM bandwidth.
Cache-cold and cache-hot bf16 decode passes (16 layers, batch 1) run in the same rounds for reference.

    python tests/gpu/probe_llc.py [--multiples 4,8,16,32] [--rounds 12] [--threads 16]

No GPU needed. Legend: LLC last-level cache.
"""
from __future__ import annotations

import argparse
import statistics

from probe_cpu_decode import Passes, build, distinct

VARIANTS = ((1, 0, 0), (4, 1024, 0), (16, 0, 0), (4, 1024, 256 << 10), (16, 0, 256 << 10), (1, 1024, 1 << 20))


def meminfo(key: str) -> str:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    return "?"


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1] if len(xs) > 1 else xs[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--multiples", default="4,8,16,32")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=16, help="read-loop threads (one per core)")
    ap.add_argument("--layers", type=int, default=16, help="decode layers (0: no decode passes)")
    ap.add_argument("--pool-threads", type=int, default=15, help="the native pool's threads for the decode passes")
    args = ap.parse_args()

    from ktinject.bench.memory import ReadLoop, Variant, llc_bytes
    from ktinject.native import Pool

    llc = llc_bytes()
    print(f"# LLC {llc / 2**20:.0f} MiB; AnonHugePages before {meminfo('AnonHugePages')}", flush=True)
    loops = {}
    for m in (int(x) for x in args.multiples.split(",")):
        loops[m] = ReadLoop(int(m * llc) // (2 << 20) * (2 << 20), args.threads)
    variants = [Variant(*v) for v in VARIANTS]
    layers = build(args.layers, "bf16", 128) if args.layers else []
    print(f"# AnonHugePages after allocating {meminfo('AnonHugePages')}", flush=True)
    pool = Pool(args.pool_threads) if layers else None
    cold = Passes(layers, pool, 1, 128, seed=0) if layers else None
    nbytes = distinct(1, 128) * layers[0].nbytes / 128 * len(layers) if layers else 0
    got = {(m, v.name): [] for m in loops for v in variants}
    dec, hot = [], []
    try:
        for loop in loops.values():
            for v in variants:
                loop.seconds(v)
        if cold:
            cold.seconds(), cold.seconds(hot=True)
        for r in range(args.rounds):
            for m, loop in loops.items():
                for v in variants:
                    got[m, v.name].append(loop.gbs(v))
                if cold:
                    dec.append(nbytes / cold.seconds() / 1e9)
            if cold:
                hot.append(nbytes / cold.seconds(hot=True) / 1e9)
    finally:
        for loop in loops.values():
            loop.close()
        if pool:
            pool.close()
    print(f"# {args.rounds} rounds, {args.threads} threads; GB/s median / p90 / max [min] per buffer and variant:")
    for m, loop in loops.items():
        allv = [g for v in variants for g in got[m, v.name]]
        cells = ", ".join(f"{v.name} {statistics.median(got[m, v.name]):.0f}/"
                          f"{p90(got[m, v.name]):.0f}/"
                          f"{max(got[m, v.name]):.0f} [{min(got[m, v.name]):.0f}]" for v in variants)
        best = max(statistics.median(got[m, v.name]) for v in variants)
        print(f"#   {m}x LLC ({loop.nbytes / 1e9:.2f} GB): all variants median {statistics.median(allv):.0f}, "
              f"max {max(allv):.0f}; best variant's median {best:.0f}; {cells}", flush=True)
    if dec:
        print(f"#   bf16 decode batch 1 ({nbytes / 1e6:.0f} MB a pass, {args.pool_threads} threads): cache-cold median "
              f"{statistics.median(dec):.0f} GB/s ({min(dec):.0f}-{max(dec):.0f}); each layer's forward again at once "
              f"(cache-hot) {statistics.median(hot):.0f} ({min(hot):.0f}-{max(hot):.0f})", flush=True)


if __name__ == "__main__":
    main()
