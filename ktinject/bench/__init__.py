"""Benchmarks: ``python -m ktinject.bench NAME [options]`` (``--help`` lists them).

Each benchmark is one module of this package with ``main(argv: list[str] | None) -> int`` (its own argparse) and a
module docstring whose first line is its one-line help. Register it in BENCHES (name -> module, imported only when
that benchmark runs, so ``--help`` stays cheap). Benchmarks print plain text (no logging) and always show the
baseline and the limit measured in the same run next to our figure.
"""
from __future__ import annotations

BENCHES: dict[str, str] = {
    "kernels": "ktinject.bench.kernels",   # expert kernels: decode GB/s, prefill TFLOPS vs torch and the machine
    "load": "ktinject.bench.load",         # loading checkpoints (bf16, fp8, GGUF): stream / cache / HF + inject
    "decode": "ktinject.bench.decode",     # decode tok/s: graph vs eager vs HF vs roofline, time split per token
    "prefill": "ktinject.bench.prefill",   # prefill tok/s at 512/2048/8192 tokens (same model as decode)
    "hot": "ktinject.bench.hot",           # hot experts on the GPU: tok/s by budget and strategy vs 1/(1-h)
    "prefix": "ktinject.bench.prefix",     # prefix cache: a follow-up's first token from GPU / RAM / disk vs cold
    "agents": "ktinject.bench.agents",     # agent-like serving load: shared context each turn, cache on vs off
    "serve": "ktinject.bench.serve",       # serving engine: aggregate tok/s and TTFT at 1/4/8/16 streams vs roofline
    "finetune": "ktinject.bench.finetune", # LoRA training tokens/s vs HF + PEFT offloaded by accelerate, and on GPU
}
