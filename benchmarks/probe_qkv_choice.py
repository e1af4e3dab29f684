"""Which kernel runs a decode-chain projection (not a test), in turns in one process: q/k/v (one row x [5120, 2048] at
Qwen3-30B-A3B shapes), o_proj (with its residual and norm) or the LM head (``--which``). Variants: the choice as
``fused_dense.choose`` measured it (``auto``), cuBLAS, or a Triton config (BNxBKxWARPS[x1 for RED]); the kernels
launch with PDL and load their first weight tiles while the kernel before them runs (for q/k/v: the collect,
waiting for the CPU), which timings alone do not see. Each variant captures its own decode graph (the choice
overridden in ``fused_dense._CHOICE``), then bare replays, muted replays (GPU part + handshakes) and
``ktinject.generate``, ms a token.

    python benchmarks/probe_qkv_choice.py [--quant int4] [--layers 48] [--rounds 3] [--tokens 64] [--prompt 32]
        [--configs auto,cublas,4x2048x4,8x512x4] [--which qkv|o|head]
"""
from __future__ import annotations

import argparse

import torch

from helpers import capture_and_time, decode_setup, print_medians
from ktinject.operators.kernels import dense as fused_dense


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--configs", default="cublas,4x2048x4,8x512x4")
    ap.add_argument("--which", default="qkv", choices=("qkv", "o", "head"),
                    help="the projection overridden: q/k/v (one row, no residual), o_proj (residual + norm) or the "
                         "LM head (the vocabulary's rows)")
    a = ap.parse_args()
    model, prompt, runner = decode_setup(a.quant, a.layers, prompt_len=a.prompt)  # (fused_dense measures its shapes)
    P = a.prompt
    print(f"# {a.quant}, {a.layers} layers, prompt {P}, {torch.cuda.get_device_name()}", flush=True)
    vocab = model.config.vocab_size
    keys = [k for k in fused_dense._CHOICE if k[0] == 1 and bool(k[5]) == (a.which == "o")  # key[5]: residual
            and (k[1] == vocab) == (a.which == "head")]  # key[1]: rows of the weight
    print(f"# measured choices: {fused_dense._CHOICE}; overriding {keys}", flush=True)
    assert keys, f"no measured {a.which} shape to override (its weights under MEASURE_FROM, or not on the kernel path)"
    measured = {k: fused_dense._CHOICE[k] for k in keys}
    variants = a.configs.split(",")
    res: dict[str, list] = {v: [] for v in variants}
    for r in range(a.rounds):
        for v in variants:
            for k in keys:  # "auto": as measured (fused_dense.choose's pick); "cublas"; "BNxBKxWARPS[x1]"
                fused_dense._CHOICE[k] = (measured[k] if v == "auto" else None if v == "cublas"
                                          else tuple(int(x) for x in v.split("x")))
            bare, mute, gen, steal = capture_and_time(model, runner, prompt, a.tokens)
            res[v].append((bare, mute, gen))
            print(f"round {r} {a.which} {v}: bare {bare * 1e3:.3f} ms, muted {mute * 1e3:.3f} ms, generate "
                  f"{gen * 1e3:.3f} ms ({1 / gen:.1f} tok/s); steal +{steal}", flush=True)
    print_medians(res, f"{a.which} ")


if __name__ == "__main__":
    main()
