"""The routed experts with LoRA adapters, in torch on the CPU (``expert_lora`` says why and what for).

    forward:  for each expert e with rows (tokens routed to it): W_g, W_u, W_d = dequantized (Experts.get, a
              thread ahead), x_e [n, H] ->
                  g = x_e W_g^T + (drop(x_e) A_g^T) B_g^T      (B scaled)     [n, I]
                  u = x_e W_u^T + (drop(x_e) A_u^T) B_u^T                     [n, I]
                  h = act(g, u)                                               [n, I]
                  y = h W_d^T + (drop(h) A_d^T) B_d^T                         [n, H]
              routed[t] += weight[t, j] * y                                   [T, H]
    backward: the same per expert under autograd (recomputed: only x, ids, weights and the dropout seed are kept),
              giving dx [T, H], d weights [T, k] and dA, dB [E, r, *] of every adapted projection.

Gate and up add their biases (gpt-oss: ``HybridMoE.expert_biases``) before the activation, down after; the
activation is the native experts' (silu, gptoss, swiglu_limit). The dropout masks come from a generator seeded
in the forward, drawn in the same order in the backward.

Legend: T tokens, E experts, H hidden, I expert intermediate, k experts per token, n rows of one expert.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from ktinject.operators import handshake as stream_experts
from ktinject.operators.base import OperatorError
from ktinject.operators.expert_lora import NATIVE, PROJECTIONS, Factors

_pool: ThreadPoolExecutor | None = None  # dequantizes the next experts while torch computes one (made on first use)
_AHEAD = max(2, min(8, (os.cpu_count() or 2) // 4))  # experts dequantized ahead, one thread each (native calls
# release the GIL)


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=_AHEAD, thread_name_prefix="ktinject-expert-lora")
    return _pool


def _weights(experts, order: list[int]):
    """Yield (e, {gate, up, down: float32 [out, in]}) for the experts of ``order``, dequantized ahead."""
    get = lambda e: {w: experts.get(e, w) for w in ("gate", "up", "down")}  # noqa: E731
    pool = _executor()
    futures = [pool.submit(get, e) for e in order[:_AHEAD]]
    for i, e in enumerate(order):
        if i + _AHEAD < len(order):
            futures.append(pool.submit(get, order[i + _AHEAD]))
        yield e, futures[i].result()
        futures[i] = None


def _act(experts, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if experts.activation == "silu":
        return F.silu(g) * u
    lim = experts.limit
    if experts.activation == "swiglu_limit":
        return F.silu(g.clamp(max=lim)) * u.clamp(-lim, lim)
    g = g.clamp(max=lim)  # gptoss
    return g * torch.sigmoid(experts.alpha * g) * (u.clamp(-lim, lim) + 1.0)


def _expert(experts, W: dict, x: torch.Tensor, ab: dict, masks: dict, bias) -> torch.Tensor:
    """y [n, H] of one expert for x [n, H] (float32); ``ab``: projection -> (A [r, in], B [out, r]); ``masks``:
    projection -> dropout mask of its input (or absent); ``bias``: (gate [I], up [I], down [H]) or None."""
    def proj(p: str, inp: torch.Tensor) -> torch.Tensor:
        out = inp @ W[NATIVE[p]].T
        if p in ab:
            a, b = ab[p]
            m = masks.get(p)
            out = out + ((inp if m is None else inp * m) @ a.T) @ b.T
        return out
    g, u = proj("expert_gate_proj", x), proj("expert_up_proj", x)
    if bias is not None:
        g, u = g + bias[0], u + bias[1]
    y = proj("expert_down_proj", _act(experts, g, u))
    return y if bias is None else y + bias[2]


def _masks(gen, fac: Factors, n: int, H: int, I: int) -> dict:
    """Dropout masks (scaled by 1 / (1 - p)) of one expert's n rows, drawn from ``gen`` in a fixed order."""
    out = {}
    for p in PROJECTIONS:
        q = fac.dropout.get(p, 0.0)
        if p in fac.a and q > 0:
            width = I if p == "expert_down_proj" else H
            out[p] = (torch.rand(n, width, generator=gen) >= q).float() / (1.0 - q)
    return out


def _plan(ids: torch.Tensor, E: int):
    """(order of the flat (token, slot) pairs by expert, per-expert counts [E]) of ids [T, k]."""
    flat = ids.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=E).tolist()


def _bias(block, e: int):
    if block.expert_biases is None:
        return None
    I = block.intermediate_size
    gate_up, down = block.expert_biases
    return gate_up[e, :I], gate_up[e, I:], down[e]


class ExpertsWithLora(torch.autograd.Function):
    """routed [T, H] of a block's experts with adapters. ``apply(x, weights, block, fac, ids, seed, *ab)``: x [T, H]
    and weights [T, k] host float32, ``ab`` the A, B stacks of fac's projections in PROJECTIONS order (the
    differentiable copies of ``fac``'s)."""

    @staticmethod
    def forward(ctx, x, weights, block, fac, ids, seed, *ab):
        ctx.block, ctx.fac, ctx.seed, ctx.names = block, fac, seed, [p for p in PROJECTIONS if p in fac.a]
        ctx.save_for_backward(x, weights, ids, *ab)
        stacks = dict(zip(ctx.names, zip(ab[0::2], ab[1::2])))
        T, H = x.shape
        k = ids.shape[1]
        out = torch.zeros(T, H)
        order, counts = _plan(ids, block.num_experts)
        starts = torch.tensor([0] + counts).cumsum(0).tolist()
        gen = torch.Generator().manual_seed(seed)
        ex = block.native_experts
        for e, W in _weights(ex, [e for e in range(block.num_experts) if counts[e]]):
            rows = order[starts[e]:starts[e + 1]]
            tok = rows // k
            masks = _masks(gen, fac, len(rows), H, block.intermediate_size)
            y = _expert(ex, W, x[tok], {p: (a[e], b[e]) for p, (a, b) in stacks.items()}, masks, _bias(block, e))
            out.index_add_(0, tok, y * weights.reshape(-1)[rows, None])
        return out

    @staticmethod
    def backward(ctx, d_out):
        x, weights, ids, *ab = ctx.saved_tensors
        block, fac = ctx.block, ctx.fac
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy = d_out.to(device="cpu", dtype=torch.float32)
        T, H = x.shape
        k = ids.shape[1]
        dx = torch.zeros_like(x) if need_x else None
        dw = torch.zeros(T * k) if need_w else None
        dab = [torch.zeros_like(t) for t in ab]
        stacks = dict(zip(ctx.names, zip(ab[0::2], ab[1::2])))
        order, counts = _plan(ids, block.num_experts)
        starts = torch.tensor([0] + counts).cumsum(0).tolist()
        gen = torch.Generator().manual_seed(ctx.seed)
        ex = block.native_experts
        for e, W in _weights(ex, [e for e in range(block.num_experts) if counts[e]]):
            rows = order[starts[e]:starts[e + 1]]
            tok = rows // k
            masks = _masks(gen, fac, len(rows), H, block.intermediate_size)
            with torch.enable_grad():
                xe = x[tok].requires_grad_(need_x)
                leaves = {p: (a[e].detach().requires_grad_(), b[e].detach().requires_grad_())
                          for p, (a, b) in stacks.items()}
                y = _expert(ex, W, xe, leaves, masks, _bias(block, e))
                inputs = [t for pair in leaves.values() for t in pair] + ([xe] if need_x else [])
                grads = torch.autograd.grad(y, inputs, dy[tok] * weights.reshape(-1)[rows, None])
            for i, g in enumerate(grads[:len(dab)]):
                dab[i][e] = g
            if need_x:
                dx.index_add_(0, tok, grads[-1])
            if need_w:
                dw[rows] = (y.detach() * dy[tok]).sum(-1)
        return (dx, None if dw is None else dw.view(T, k), None, None, None, None, *dab)


def routed(block, fac: Factors, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The block's routed output [T, H] (x's device and dtype) with the expert adapters ``fac``, recorded for
    autograd where a gradient is wanted."""
    if stream_experts.active():  # (a graph capture: the decode step then runs eagerly)
        raise OperatorError("expert LoRA runs the routed experts in torch on the host: not inside a captured graph")
    hx = x.to(device="cpu", dtype=torch.float32)
    hw = weights.to(device="cpu", dtype=torch.float32)
    hi = ids.detach().to(device="cpu", dtype=torch.int64)
    ab = [t for p in PROJECTIONS if p in fac.a for t in (fac.a[p], fac.b[p])]
    seed = int(torch.randint(0, 2**62, (1,)).item()) if any(fac.dropout.values()) else 0
    out = ExpertsWithLora.apply(hx, hw, block, fac, hi, seed, *ab)
    return out.to(device=x.device, dtype=x.dtype)
