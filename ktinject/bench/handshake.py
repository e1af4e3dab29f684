"""The decode handshake's cost alone (``python -m ktinject.bench decode`` prints it; tests/decode/test_graph_gpu.py uses
it): a CUDA graph of n ``StreamExperts`` start / finish pairs whose tasks compute nothing, against the same graph's
copies without the handshakes. Legend: n layers, E experts, H hidden, k experts per token.
"""
from __future__ import annotations

import torch

from ktinject.operators.handshake import StreamExperts


def handshake_cost(n: int = 48, iters: int = 50, mode: str | None = None, device="cuda", pool=None) -> dict:
    """Microbenchmark of the coordination alone: a graph of ``n`` start/finish pairs whose tasks compute nothing
    (every expert skipped), on ``pool`` (default: the default pool). Returns {"mode", "per_handshake_us",
    "replay_us", "empty_replay_us"}."""
    H, E, k = 64, 4, 2
    experts = tiny_experts(E, H, 32)
    skip = torch.ones(E, dtype=torch.uint8)
    rs = [StreamExperts(experts, 1, k, H, device, dtype=torch.bfloat16, skip=skip, mode=mode, pool=pool)
          for _ in range(n)]
    x = torch.zeros((1, H), dtype=torch.bfloat16, device=device)
    ids = torch.zeros((1, k), dtype=torch.int64, device=device)
    w = torch.zeros((1, k), dtype=torch.float32, device=device)

    def step():
        y = x
        for r in rs:
            r.start(y, ids, w)
            y = r.finish()
        return y

    def timed(g):
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(iters):
            g.replay()
        t1.record()
        torch.cuda.synchronize()
        return t0.elapsed_time(t1) * 1e3 / iters

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        step()
    g0 = torch.cuda.CUDAGraph()  # same copies, no handshakes
    with torch.cuda.graph(g0, capture_error_mode="thread_local"):
        y = x
        for r in rs:
            r.h.copy_(y, non_blocking=True)
            r.ids.copy_(ids, non_blocking=True)
            r.w.copy_(w, non_blocking=True)
            r.out.copy_(r.o, non_blocking=True)
            y = r.out
    full, empty = timed(g), timed(g0)
    for r in rs:
        r.close()
    return {"mode": rs[0].mode, "n": n, "replay_us": full, "empty_replay_us": empty,
            "per_handshake_us": (full - empty) / n}


def tiny_experts(E: int, H: int, I: int):
    """A native.Experts of small random bf16 experts (for microbenchmarks)."""
    from ktinject import native

    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5  # [E, 2I, H]
    down = torch.randn(E, H, I, generator=gen) / I ** 0.5  # [E, H, I]
    return native.Experts.from_hf(gate_up, down)
