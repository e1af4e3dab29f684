"""Measuring the prefill cost model's numbers (``policy.Costs``) on the machine itself, once per layer shape and quant.

    cpu_costs   two native forwards of one layer, every expert given 8 and then 64 rows (tokens routed
                round-robin): the time per expert (reading its weights) and per routed row (the kernels' work)
    gpu_costs   on the streamed experts' own buffers: one layer's experts dequantized into the scratch, then one grouped
                GEMM pass over 64 random rows an expert (with the weighting), timed with CUDA events

Each timing is the best of two after a warm-up. The H2D bandwidth is the ring's (``Ring.measure_h2d``).
Legend: E experts, H hidden, I intermediate, R rows per expert, n experts in a ring slot.
"""
from __future__ import annotations

import time

import torch

from ktinject.gpu_experts.prefill import policy
from ktinject.gpu_experts.hot.bank import Activation, grouped_ffn, looped_ffn
from ktinject.gpu_experts.hot.upload import unpack_experts

CPU_ROWS = (8, 64)  # rows per expert of the two CPU forwards
GPU_ROWS = 64  # rows per expert of the GPU pass


def _best(fn, cuda: bool, reps: int = 2) -> float:
    """Seconds of the fastest of ``reps`` calls of fn after one warm-up (CUDA events on the current stream)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        if cuda:
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            fn()
            t1.record()
            t1.synchronize()
            best = min(best, t0.elapsed_time(t1) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def cpu_costs(ex) -> tuple[float, float]:
    """(cpu_expert_s, cpu_row_s) of native experts ``ex`` on the default pool."""
    E, H = ex.num_experts, ex.hidden
    k = min(8, E)
    gen = torch.Generator().manual_seed(0)
    times = []
    for r in CPU_ROWS:
        T = max(1, r * E // k)
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
        ids = (torch.arange(T * k) % E).view(T, k)  # each token k distinct experts, each expert r rows
        w = torch.full((T, k), 1.0 / k)
        times.append(_best(lambda: ex.forward(x, ids, w), cuda=False))
    return policy.fit_cpu(tuple(float(r) for r in CPU_ROWS), tuple(times), E)


def gpu_costs(experts, i: int, block) -> dict[str, float]:
    """{"gpu_expert_s", "gpu_row_s"} of layer ``i`` of a set-up ``device.StreamedExperts`` ``experts`` (on its
    device: its ring and scratch): its first experts (a slot's worth) copied, dequantized and run over GPU_ROWS rows
    each; call with nothing in flight."""
    lay, region = experts.layouts[i], experts.regions[i].tensor
    n = min(experts.cap, block.num_experts)
    H, I, dev = block.hidden_size, block.intermediate_size, experts.device
    ring = experts.ring
    item = ring.fetch(("calibration", i), region, lay.expert_bytes, list(range(n)))
    slot = ring.acquire(item).view(n, lay.expert_bytes)
    gate_up = experts.gate_up[:n * 2 * I * H].view(n, 2 * I, H)
    down = experts.down[:n * H * I].view(n, H, I)
    dequant = _best(lambda: unpack_experts(slot, lay, gate_up, down, experts.work), cuda=experts.cuda)
    ring.release(item)
    act = Activation.of(block.native_experts)
    rows = n * GPU_ROWS
    xs = torch.randn(rows, H, device=dev, dtype=torch.bfloat16)
    w = torch.rand(rows, 1, device=dev)
    ends = torch.arange(1, n + 1, device=dev, dtype=torch.int32) * GPU_ROWS
    if experts.grouped:
        compute = _best(lambda: grouped_ffn(xs, ends, gate_up, down, act).float().mul_(w), cuda=experts.cuda)
    else:
        host_ends = ends.cpu()
        compute = _best(lambda: looped_ffn(xs, host_ends, gate_up, down, act).mul_(w), cuda=experts.cuda)
    return {"gpu_expert_s": dequant / n, "gpu_row_s": compute / rows}
