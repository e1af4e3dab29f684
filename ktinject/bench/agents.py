"""Agent-like serving load: clients resending a shared context each turn, with the prefix cache against without it.

    python -m ktinject.bench agents [--clients 8] [--shared 8000] [--turns 4] [--message 50] [--reply 32]
                                    [--quant int4] [--layers 48] [--tier gpu|ram] [--tiny]

Builds the bench model (Qwen3-30B-A3B shapes, ``ktinject.bench.model``; every routed expert on the CPU), injects it
once, and drives the serving engine (``ktinject.serve.engine.Engine``, no HTTP) twice with the same load: first
without a prefix cache, then with one ``PrefixCache`` shared by every request (``--tier``, default ram: the GPU tier
and page-locked host RAM). The load: ``--clients`` closed-loop clients; each turn's prompt is the shared context
(``--shared`` tokens, the same for all: an agent's system prompt, tools and repository map), the client's own
history (its earlier messages and the replies it got back) and a new message (``--message`` tokens); ``--reply``
tokens come back (greedy, EOS ignored). Printed per run: time to first token p50 / p99 over every request, the
completion tokens per second of the whole run, the prompt tokens the cache restored (of all sent) and the run's
wall time; then the cache's ratio against without. The first turn of the run with a cache finds the shared context
cold (the first request that prefills it stores it): that is in its figures, as a server would see it.
"""
from __future__ import annotations

import argparse
import threading
import time

import torch

from ktinject.bench.model import bench_model
from ktinject.bench.serve import percentile


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ktinject.bench agents", description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (closed loop)")
    p.add_argument("--shared", type=int, default=8000, help="tokens of the context every request starts with")
    p.add_argument("--turns", type=int, default=4, help="turns per client")
    p.add_argument("--message", type=int, default=50, help="new tokens a client sends each turn")
    p.add_argument("--reply", type=int, default=32, help="tokens of each reply")
    p.add_argument("--quant", default="int4", help="routed experts' format (bf16, int8, int4, fp8, mxfp4)")
    p.add_argument("--layers", type=int, default=48, help="decoder layers (48 = the real model)")
    p.add_argument("--tier", default="ram", choices=("gpu", "ram"), help="the prefix cache's lowest tier")
    p.add_argument("--block", type=int, default=256, help="prefix cache block size in tokens")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens per engine step")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (native pool and torch); default: cores")
    p.add_argument("--tiny", action="store_true", help="the tiny qwen3_moe test model (runs on a CPU)")
    return p


def run_load(engine, args, vocab: int) -> dict:
    """Every client's turns on ``engine``; the run's figures."""
    from ktinject.serve.sampling import SamplingParams

    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, vocab, (args.shared,), generator=gen).tolist()
    messages = [[torch.randint(3, vocab, (args.message,), generator=gen).tolist() for _ in range(args.turns)]
                for _ in range(args.clients)]
    params = SamplingParams(max_tokens=args.reply, temperature=0, ignore_eos=True)
    results, errors = [], []
    lock = threading.Lock()

    def client(c: int) -> None:
        history: list[int] = []
        for turn in range(args.turns):
            prompt = shared + history + messages[c][turn]
            r = engine.generate(prompt, params)
            with lock:
                (errors if r.error else results).append(r)
            history = prompt[len(shared):] + r.token_ids

    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0].error}")
    ttft = [r.ttft for r in results]
    return {"requests": len(results), "wall": wall, "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "throughput": sum(r.completion_tokens for r in results) / wall,
            "prompt": sum(r.prompt_tokens for r in results), "cached": sum(r.cached_tokens for r in results),
            "tokens": [r.token_ids for r in results]}


def _line(name: str, r: dict) -> str:
    return (f"# {name}: TTFT p50 {1e3 * r['ttft_p50']:.0f} ms, p99 {1e3 * r['ttft_p99']:.0f} ms; "
            f"{r['throughput']:.1f} completion tok/s; {r['cached']:,} of {r['prompt']:,} prompt tokens restored; "
            f"{r['requests']} requests in {r['wall']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    import ktinject
    from ktinject import native
    from ktinject.decode.prefix_cache import PrefixCache
    from ktinject.serve.engine import Engine, EngineConfig

    args = _parser().parse_args(argv)
    if min(args.clients, args.turns, args.message, args.reply, args.shared) < 1:
        raise SystemExit("--clients, --turns, --message, --reply and --shared must be >= 1")
    t0 = time.perf_counter()
    model, device = bench_model(args.tiny, args.layers, args.threads)
    cuda = device.type == "cuda"
    quant = None if args.tiny and not cuda else args.quant
    ktinject.inject(model, gpu=str(device), quant=quant, gpu_experts_budget=0)
    cfg = model.config
    context = args.shared + args.turns * (args.message + args.reply) + 8
    if context > cfg.max_position_embeddings:
        raise SystemExit(f"the last turn's {context} tokens exceed the model's {cfg.max_position_embeddings} positions")
    print(f"# agents bench: {'tiny qwen3_moe' if args.tiny else 'Qwen3-30B-A3B shapes'}, {cfg.num_hidden_layers} "
          f"layers, experts {quant or 'bf16'} on the CPU; {args.clients} clients x {args.turns} turns, shared "
          f"context {args.shared}, +{args.message} a message, {args.reply}-token replies; built in "
          f"{time.perf_counter() - t0:.1f} s; native ISA {native.isa()}, {native.default_pool().threads} threads",
          flush=True)
    runs = {}
    for name in ("without", "with"):
        prefix = None
        if name == "with":
            budget = 2 * args.clients * context * 256 * 1024  # generous: nothing of this load is evicted
            prefix = PrefixCache(tier=args.tier, block_size=args.block, gpu_bytes=budget if args.tier == "gpu" else
                                 None, ram_bytes=budget, device=device if cuda else "cpu")
        config = EngineConfig(max_batch=args.clients, max_context=context, max_queue=args.clients,
                              prefill_chunk=args.prefill_chunk, prefix_cache=prefix)
        engine = Engine(model, None, config, name="bench").start()
        try:
            runs[name] = run_load(engine, args, cfg.vocab_size)
        finally:
            engine.stop()
            engine.runner.close()
        print(_line(f"prefix cache {'off' if prefix is None else args.tier}", runs[name]), flush=True)
    a, b = runs["without"], runs["with"]
    same = sum(x == y for x, y in zip(sorted(map(tuple, a["tokens"])), sorted(map(tuple, b["tokens"]))))
    print(f"# with / without: TTFT p50 x{b['ttft_p50'] / a['ttft_p50']:.2f}, p99 x{b['ttft_p99'] / a['ttft_p99']:.2f}"
          f", throughput x{b['throughput'] / a['throughput']:.2f}; replies equal: {same} of {a['requests']}",
          flush=True)
    return 0
