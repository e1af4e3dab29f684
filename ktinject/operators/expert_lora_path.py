"""The routed experts with LoRA adapters on the CPU: the base products and the adapters' low-rank terms in the
native library, biases, activation and dropout in torch (``expert_lora`` says why and what for).

Rows: the (token, slot) pairs sorted by expert (stable), R of them; e_r the row's expert, x_r its token's input.
    forward:  the stored weights' products by ``Experts.project`` (native, every format; float, or bf16 products by
              KTINJECT_EXPERT_PRODUCTS, the backward's as its forward's), the adapters' by
              ``Experts.lora`` (native, float32: t = A_e z, added in place), the rest in torch:
                  g = W_g x_r + B_g A_g drop(x_r) + bg        (B scaled; A, B of expert e_r)   [R, I]
                  u = W_u x_r + B_u A_u drop(x_r) + bu                                        [R, I]
                  h = act(g, u)                                                                [R, I]
                  y = W_d h + B_d A_d drop(h) + bd                                             [R, H]
              routed[t] += weight_r * y_r over the token's rows                                [T, H]
              Each adapter's terms are one pool job over all rows (``ktk_experts_lora``), not small products per
              expert.
    backward: with dY_r = weight_r * dy_t:
                  v = W_d^T dy_t (native, transposed)      dweight_r = <v, h> + <dy_t, B_d A_d drop(h) + bd>
                  dh = weight_r v + drop'(A_d^T B_d^T dY)  dg, du = act'(g, u) dh
                  dx_r = W_g^T dg + W_u^T du (native, transposed) + the adapters' terms; dx[t] = sum of its rows
              and dA, dB of every adapted projection (``Experts.lora_backward``: sums over each expert's rows).
Saved for the backward: x, ids, weights, their sort by expert, the dropout seed, g and u [R, I] (O(R x I): the
transposed products need no saved input; h is recomputed from g and u, the adapters' inputs from x and h) and each
adapter's A_e z_r [R, r], so the backward recomputes no product nor the sort; never a dequantized weight.

Gate and up add their biases (gpt-oss: ``HybridMoE.expert_biases``) before the activation, down after; the
activation is the native experts' (silu, gptoss, swiglu_limit). The dropout masks come from a generator seeded in
the forward, drawn per expert in ascending order (gate, up, down for each) and drawn again in that order in the
backward.

Legend: T tokens, E experts, H hidden, I expert intermediate, k experts per token, R routed rows, r rank.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ktinject import envs
from ktinject.operators import handshake as stream_experts
from ktinject.operators.base import OperatorError
from ktinject.operators.expert_lora import NATIVE, PROJECTIONS, Factors

_GATE, _UP, _DOWN = PROJECTIONS


def _act(experts, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if experts.activation == "silu":
        return F.silu(g) * u
    lim = experts.limit
    if experts.activation == "swiglu_limit":
        return F.silu(g.clamp(max=lim)) * u.clamp(-lim, lim)
    g = g.clamp(max=lim)  # gptoss
    return g * torch.sigmoid(experts.alpha * g) * (u.clamp(-lim, lim) + 1.0)


class _Rows:
    """The routed rows of ids [T, k] sorted by expert: ``order`` (flat (token, slot) index of each row), ``tok``,
    ``eid`` [R] (int64) and ``segs`` [(expert, first row, end row)] of the experts with rows, ascending."""

    def __init__(self, ids: torch.Tensor, E: int):
        flat = ids.reshape(-1)
        self.order = torch.argsort(flat, stable=True)
        self.tok = self.order // ids.shape[1]
        self.eid = flat[self.order].contiguous()
        counts = torch.bincount(flat, minlength=E).tolist()
        self.segs, s = [], 0
        for e, n in enumerate(counts):
            if n:
                self.segs.append((e, s, s + n))
                s += n


def _masks(seed: int, fac: Factors, rows: _Rows, H: int, I: int) -> dict:
    """Dropout masks (scaled by 1 / (1 - p)) of every row per adapted projection with dropout, [R, its input]: drawn
    per expert segment from a generator seeded with ``seed``, in a fixed order."""
    drop = [p for p in PROJECTIONS if p in fac.a and fac.dropout.get(p, 0.0) > 0]
    if not drop:
        return {}
    gen = torch.Generator().manual_seed(seed)
    parts = {p: [] for p in drop}
    for _, s0, s1 in rows.segs:
        for p in drop:
            q = fac.dropout[p]
            width = I if p == _DOWN else H
            parts[p].append((torch.rand(s1 - s0, width, generator=gen) >= q).float() / (1.0 - q))
    return {p: torch.cat(v) for p, v in parts.items()}


def _biases(block, eid: torch.Tensor):
    """(gate [R, I], up [R, I], down [R, H]) of each row's expert, or None."""
    if block.expert_biases is None:
        return None
    I = block.intermediate_size
    gate_up, down = block.expert_biases
    gu = gate_up.detach().float()[eid]
    return gu[:, :I], gu[:, I:], down.detach().float()[eid]


class ExpertsWithLora(torch.autograd.Function):
    """routed [T, H] of a block's experts with adapters. ``apply(x, weights, block, fac, ids, seed, *ab)``: x [T, H]
    and weights [T, k] host float32, ``ab`` the A, B stacks of fac's projections in PROJECTIONS order (the
    differentiable copies of ``fac``'s)."""

    @staticmethod
    def forward(ctx, x, weights, block, fac, ids, seed, *ab):
        names = [p for p in PROJECTIONS if p in fac.a]
        stacks = dict(zip(names, zip(ab[0::2], ab[1::2])))
        ex, T, H, I = block.native_experts, x.shape[0], x.shape[1], block.intermediate_size
        prec = envs.get("KTINJECT_EXPERT_PRODUCTS")  # the base products' arithmetic (the backward's too)
        rows = _Rows(ids, block.num_experts)
        masks = _masks(seed, fac, rows, H, I)
        bias = _biases(block, rows.eid)
        xr = x[rows.tok]
        t = {}  # A_e z_r [R, r] of each adapted projection: saved, so the backward recomputes no adapter product
        gu = []
        for i, p in enumerate((_GATE, _UP)):
            v = ex.project(NATIVE[p], xr, rows.eid, precision=prec)
            if p in stacks:  # v += B_e A_e z_r
                t[p] = ex.lora(NATIVE[p], xr * masks[p] if p in masks else xr, rows.eid, *stacks[p], v)
            gu.append(v if bias is None else v + bias[i])
        h = _act(ex, *gu)
        y = ex.project("down", h, rows.eid, precision=prec)
        if _DOWN in stacks:
            t[_DOWN] = ex.lora("down", h * masks[_DOWN] if _DOWN in masks else h, rows.eid, *stacks[_DOWN], y)
        if bias is not None:
            y += bias[2]
        y *= weights.reshape(-1)[rows.order, None]
        out = torch.zeros(T, H).index_add_(0, rows.tok, y)
        ctx.block, ctx.fac, ctx.seed, ctx.names, ctx.rows = block, fac, seed, names, rows  # (rows: the sort, once)
        ctx.prec = prec
        if any(ctx.needs_input_grad):
            ctx.save_for_backward(x, weights, ids, gu[0], gu[1], *(t[p] for p in names), *ab)
        return out

    @staticmethod
    def backward(ctx, d_out):
        x, weights, ids, g, u, *rest = ctx.saved_tensors
        block, fac, names = ctx.block, ctx.fac, ctx.names
        t, ab = dict(zip(names, rest[:len(names)])), rest[len(names):]
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ex, T, H, I = block.native_experts, x.shape[0], x.shape[1], block.intermediate_size
        k = ids.shape[1]
        stacks = dict(zip(names, zip(ab[0::2], ab[1::2])))
        grads = {}  # p -> (dA, dB)
        rows = ctx.rows
        masks = _masks(ctx.seed, fac, rows, H, I)
        bias = _biases(block, rows.eid)
        dy = d_out.to(device="cpu", dtype=torch.float32)[rows.tok].contiguous()   # [R, H]
        wr = weights.reshape(-1)[rows.order, None]
        gu = [g.detach().requires_grad_(), u.detach().requires_grad_()]
        with torch.enable_grad():
            h = _act(ex, *gu)
        hd = h.detach()
        v = ex.project("down", dy, rows.eid, transpose=True, precision=ctx.prec)   # W_d^T dy [R, I]
        dw = (v * hd).sum(-1)
        dh = v * wr
        if _DOWN in stacks:
            # d loss / d y_r = wr dy_r: the adapter's gradients from dy with wr folded into its saved inputs, so
            # that dy_r B_e (returned) also gives the routing weight's term <dy_r, B_e t_r> without a division
            zd = hd * masks[_DOWN] if _DOWN in masks else hd
            dz, dyb, *grads[_DOWN] = ex.lora_backward("down", zd * wr, t[_DOWN] * wr, dy, rows.eid, *stacks[_DOWN])
            dw += (dyb * t[_DOWN]).sum(-1)
            dz *= wr
            dh += dz * masks[_DOWN] if _DOWN in masks else dz
        if bias is not None:
            dw += (dy * bias[2]).sum(-1)
        dg, du = torch.autograd.grad(h, gu, dh)
        dx = None
        if need_x:
            dxr = ex.project("gate", dg.contiguous(), rows.eid, transpose=True, precision=ctx.prec)
            dxr += ex.project("up", du.contiguous(), rows.eid, transpose=True, precision=ctx.prec)
        if _GATE in stacks or _UP in stacks:
            xr = x[rows.tok]
        for p, d in ((_GATE, dg), (_UP, du)):
            if p in stacks:
                z = xr * masks[p] if p in masks else xr
                dz, _, *grads[p] = ex.lora_backward(NATIVE[p], z, t[p], d.contiguous(), rows.eid, *stacks[p])
                if need_x:
                    dxr += dz * masks[p] if p in masks else dz
        if need_x:
            dx = torch.zeros_like(x).index_add_(0, rows.tok, dxr)
        dweights = None
        if need_w:
            dweights = torch.zeros(T * k)
            dweights[rows.order] = dw
            dweights = dweights.view(T, k)
        dab = [g for p in names for g in grads[p]]
        return (dx, dweights, None, None, None, None, *dab)


def routed(block, fac: Factors, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The block's routed output [T, H] (x's device and dtype) with the expert adapters ``fac``, recorded for
    autograd where a gradient is wanted."""
    if stream_experts.active():  # (a graph capture: the decode step then runs eagerly)
        raise OperatorError("expert LoRA runs the routed experts on the host: not inside a captured graph")
    hx = x.to(device="cpu", dtype=torch.float32)
    hw = weights.to(device="cpu", dtype=torch.float32)
    hi = ids.detach().to(device="cpu", dtype=torch.int64)
    ab = [t for p in PROJECTIONS if p in fac.a for t in (fac.a[p], fac.b[p])]
    seed = int(torch.randint(0, 2**62, (1,)).item()) if any(fac.dropout.values()) else 0
    out = ExpertsWithLora.apply(hx, hw, block, fac, hi, seed, *ab)
    return out.to(device=x.device, dtype=x.dtype)
