"""Shared by the probes in benchmarks/ (run as ``python benchmarks/probe_NAME.py``, which puts this folder on
sys.path): the host's steal time, the decode set-up (bench model, prompt, runner, captured graph), one variant of a
decode-graph A/B and its medians, and a CUDA-graph timer for single GPU ops."""
from __future__ import annotations

import torch

import ktinject


def steal_jiffies() -> int:
    """The host's steal time so far (/proc/stat, jiffies): probes print its growth beside CPU timings."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def decode_setup(quant: str, layers: int, threads: int | None = None, prompt_len: int = 32):
    """The probes' decode set-up: the bench model (Qwen3-30B-A3B shapes, ``layers`` layers) injected with
    ``quant``, a random prompt, its graph runner, and one generate run (captures the decode graph).
    Returns (model, prompt, runner)."""
    from ktinject.bench.model import bench_model
    from ktinject.bench.timing import gen_time
    from ktinject.decode.generate import get_runner

    model, device = bench_model(False, layers, threads)
    ktinject.inject(model, gpu=str(device), quant=quant, gpu_experts_budget=0)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=device)
    runner = get_runner(model, prefill_chunk=2048)
    gen_time(model, prompt, 3)
    return model, prompt, runner


def capture_and_time(model, runner, prompt, tokens: int, muted_runs: int = 1) -> tuple[float, float, float, int]:
    """One variant of a decode-graph A/B (probe_qkv_choice.py, probe_variants.py): the graphs captured anew with the
    variant's setting, then (bare replay, muted replay (median of ``muted_runs``), generate) seconds a token and the
    host's steal jiffies over them."""
    import statistics

    from ktinject.bench.timing import gen_time, graph_replay, muted_replay
    from ktinject.decode.generate import invalidate_graphs

    P = prompt.shape[1]
    invalidate_graphs(model)
    gen_time(model, prompt, 3)  # captures with this setting
    s0 = steal_jiffies()
    bare = graph_replay(runner, 1, P, tokens)
    mutes = [muted_replay(model, runner, 1, P, tokens) for _ in range(muted_runs)]
    if bare is None or None in mutes:
        raise RuntimeError("no decode graph to replay (its capture failed?)")
    t1 = gen_time(model, prompt, 1)
    gen = (gen_time(model, prompt, tokens + 1) - t1) / tokens
    return bare, statistics.median(mutes), gen, steal_jiffies() - s0


def print_medians(res: dict, label: str = "") -> None:
    """Per variant of ``res`` (name -> [(bare, muted, generate) seconds]), the medians over its rounds."""
    import statistics

    for name, rows in res.items():
        med = [statistics.median(x[i] for x in rows) * 1e3 for i in range(3)]
        print(f"{label}{name:12s} median: muted {med[1]:.3f} ms (all {' '.join(f'{x[1] * 1e3:.3f}' for x in rows)}), "
              f"bare {med[0]:.3f} ms, generate {med[2]:.3f} ms ({1e3 / med[2]:.1f} tok/s)")


def timed(fn, n=48, iters=20) -> float:
    """Microseconds per call of fn, captured n times in one graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (iters * n)
