"""Does the host heap grow with each new matmul shape on CUDA? (issue 21's soak: on the GPU machine the malloc heap
rose ~70 MiB over 8 minutes after the warm-up, settling, Python objects flat; the engine's prefill forwards take
(rows, longest chunk) shapes of 1..16 x 1..256, so new shapes keep coming long after the start.) Matmuls of M =
1..--shapes rows (shuffled) against the demo-model-like weights, the malloc heap in use (mallinfo2) read every 500
shapes, then every shape again (a cache: no growth the second time). Run once as is and once with
CUBLASLT_HEURISTICS_CACHE_CAPACITY=0 (cuBLASLt's heuristics cache off) in a child process.

    python tests/gpu/probe_shape_heap.py [--shapes 3000]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import random
import subprocess
import sys

import torch


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_mib() -> float:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    m = libc.mallinfo2()
    return (m.uordblks + m.hblkhd) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", type=int, default=3000)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for n, k in ((1024, 512), (512, 1024), (3072, 512))]
    bias = torch.randn(1024, device=dev, dtype=torch.bfloat16)
    ms = list(range(1, args.shapes + 1))
    random.Random(0).shuffle(ms)

    def one(m: int) -> None:
        for w in ws:
            x = torch.randn(m, w.shape[1], device=dev, dtype=torch.bfloat16)
            torch.nn.functional.linear(x, w)
        torch.nn.functional.linear(torch.randn(m, 512, device=dev, dtype=torch.bfloat16), ws[0], bias)

    one(7)
    torch.cuda.synchronize()
    h0 = heap_mib()
    tag = os.environ.get("CUBLASLT_HEURISTICS_CACHE_CAPACITY", "default")
    line = []
    for rnd in range(2):
        for i, m in enumerate(ms):
            one(m)
            if (i + 1) % 500 == 0:
                torch.cuda.synchronize()
                line.append(f"{'first' if rnd == 0 else 'again'} {i + 1}: +{heap_mib() - h0:.1f}")
    print(f"# heuristics cache capacity {tag}: heap in use MiB over the start after n new shapes: " + ", ".join(line),
          flush=True)
    if not args.child:
        env = dict(os.environ, CUBLASLT_HEURISTICS_CACHE_CAPACITY="0")
        subprocess.run([sys.executable, __file__, "--shapes", str(args.shapes), "--child"], env=env, check=False)


if __name__ == "__main__":
    main()
