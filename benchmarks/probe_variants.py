"""Kernel settings of the decode chain A/B'd inside decode graphs (not a test), in turns in one process: each
variant sets module constants of ktinject.operators (``fused_attn.KEYS_PER_SPLIT=64``, ``fused.ROUTER_BLOCK_H=512``,
...), captures its own decode graph, then muted replays (GPU part + handshakes), bare replays and
``ktinject.generate``, ms a token; medians over the rounds.

    python benchmarks/probe_variants.py [--quant int4] [--layers 48] [--rounds 3] [--tokens 32]
        --variant "base:" --variant "x:fused.SOME_FLAG=0" ...
"""
from __future__ import annotations

import argparse
import importlib

import torch

from helpers import capture_and_time, decode_setup, print_medians


def settings(spec: str) -> tuple[str, list]:
    """"name:mod.ATTR=int,mod.ATTR=int" -> (name, [(module, attr, value)])."""
    name, _, body = spec.partition(":")
    out = []
    for item in filter(None, body.split(",")):
        path, _, value = item.partition("=")
        mod, _, attr = path.rpartition(".")
        m = importlib.import_module(f"ktinject.operators.{mod}")
        assert hasattr(m, attr), f"{mod} has no {attr}"
        out.append((m, attr, type(getattr(m, attr))(int(value))))
    return name, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--variant", action="append", required=True)
    a = ap.parse_args()
    model, prompt, runner = decode_setup(a.quant, a.layers, prompt_len=a.prompt)
    P = a.prompt
    print(f"# {a.quant}, {a.layers} layers, prompt {P}, {torch.cuda.get_device_name()}", flush=True)
    variants = [settings(v) for v in a.variant]
    defaults = {(m, attr): getattr(m, attr) for _, sets in variants for m, attr, _ in sets}
    res: dict[str, list] = {name: [] for name, _ in variants}
    for r in range(a.rounds):
        for name, sets in variants:
            for (m, attr), v in defaults.items():
                setattr(m, attr, v)
            for m, attr, v in sets:
                setattr(m, attr, v)
            bare, mute, gen, steal = capture_and_time(model, runner, prompt, a.tokens, muted_runs=3)
            res[name].append((bare, mute, gen))
            print(f"round {r} {name}: muted {mute * 1e3:.3f} ms, bare {bare * 1e3:.3f} ms, generate "
                  f"{gen * 1e3:.3f} ms ({1 / gen:.1f} tok/s); steal +{steal}", flush=True)
    print_medians(res)


if __name__ == "__main__":
    main()
