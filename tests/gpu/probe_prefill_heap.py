"""Does rounding the serve engine's prefill widths (EngineConfig.prefill_pad) stop the host heap's growth on CUDA?
(issue 21's soak: +71 MiB after the warm-up over 8 minutes, settling, H200 2026-11-29; tests/gpu/probe_shape_heap.py:
each new matmul shape costs host memory once.) The demo model on CUDA, an engine of 16 rows and prefill chunks of
256, 16 client threads sending prompts of 1..300 random tokens for 1 new token each (prefill forwards of many
(rows, width) shapes); the malloc heap in use every --every requests. Once per --pad value, each in a child process.

    python tests/gpu/probe_prefill_heap.py [--pads 1,16] [--requests 3000]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import subprocess
import sys

import torch

from probe_shape_heap import heap_mib


def child(pad: int, requests: int, every: int) -> None:
    from ktinject.chat import load_model
    from ktinject.demo import demo_model_dir
    from ktinject.serve.engine import Engine, EngineConfig
    from ktinject.serve.sampling import SamplingParams

    model, tokenizer, _ = load_model(demo_model_dir(), progress=False, gpu="cuda")
    eng = Engine(model, tokenizer, EngineConfig(max_batch=16, max_context=512, prefill_chunk=256, prefill_pad=pad),
                 name="demo").start()
    rng = random.Random(0)
    V = model.config.vocab_size
    prompts = [[rng.randrange(3, V) for _ in range(rng.randint(1, 300))] for _ in range(requests)]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    marks = []
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            h0 = None
            for i in range(0, requests, every):
                list(pool.map(lambda p: eng.generate(p, params), prompts[i:i + every]))
                torch.cuda.synchronize()
                h = heap_mib()
                h0 = h if h0 is None else h0
                marks.append(f"{i + every}: +{h - h0:.1f}")
    finally:
        eng.stop()
    print(f"# prefill_pad {pad}: heap in use MiB over the first {every} requests' after n requests: "
          + ", ".join(marks), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pads", default="1,16")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--every", type=int, default=300)
    ap.add_argument("--child", type=int)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, args.requests, args.every)
        return
    for pad in (int(p) for p in args.pads.split(",")):
        subprocess.run([sys.executable, __file__, "--child", str(pad), "--requests", str(args.requests),
                        "--every", str(args.every)], check=False, env=dict(os.environ))


if __name__ == "__main__":
    main()
