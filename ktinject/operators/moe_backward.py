"""Autograd through the CPU experts: the routed experts' forward as a ``torch.autograd.Function`` (training).

``HybridMoE`` takes this path only where a gradient is wanted (``wanted``: grad mode on and the block's input or its
routing weights require grad); inference never comes here, so its path and cost are what they were. Then

    forward:  x [T, H], ids [T, k], weights [T, k] -> host copies -> native forward -> routed [T, H] on x's device
    backward: d routed [T, H] -> host -> native backward (``Experts.backward``: ktk_backward) -> dx [T, H] and
              d weights [T, k] on their devices (a trainable router gets its gradient through the weights)

What the backward needs is kept from the forward: the host copies of x, ids and weights (CPU RAM, not device memory;
the gate and up products are recomputed from x, nothing of the experts' intermediates is kept), so the saved state
of a block is O(T x H), as for any linear layer, and ``torch.utils.checkpoint`` works around it as around any
module. The expert weights are frozen: they live packed in their stored format (bf16, int8, int4, fp8) and get no
gradient. Every expert runs on the CPU here, GPU-resident (hot) ones included (the native copy holds them all):
the GPU bank's kernels have no backward.

Legend: T tokens, H hidden, k experts per token, E experts.
"""
from __future__ import annotations

import torch

_HOST_DTYPES = (torch.float32, torch.bfloat16)  # what the native forward and backward take as activations


def wanted(x: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether this forward must record autograd through the CPU experts."""
    return torch.is_grad_enabled() and (x.requires_grad or weights.requires_grad)


def _host(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor (in ``dtype`` where given), detached: a copy unless it already is one."""
    return t.detach().to(device="cpu", dtype=dtype or t.dtype).contiguous()


class RoutedExperts(torch.autograd.Function):
    """routed [T, H] = sum over each token's k slots of weight * expert(x), the experts on the CPU (native).

    ``apply(x, weights, experts, ids)``: x [T, H] and weights [T, k] get gradients, ``experts`` (a
    ``native.Experts``) and ``ids`` [T, k] int64 are constants."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weights: torch.Tensor, experts, ids: torch.Tensor) -> torch.Tensor:
        hx = _host(x, None if x.dtype in _HOST_DTYPES else torch.float32)  # [T, H]
        hi, hw = _host(ids, torch.int64), _host(weights, torch.float32)  # [T, k], [T, k]
        routed = experts(hx, hi, hw)  # [T, H] in hx's dtype
        ctx.save_for_backward(hx, hi, hw)
        ctx.experts = experts
        ctx.weights_dtype = weights.dtype
        return routed.to(device=x.device, dtype=x.dtype)

    @staticmethod
    def backward(ctx, d_routed: torch.Tensor):
        hx, hi, hw = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_x or need_w):
            return None, None, None, None
        dy = _host(d_routed, d_routed.dtype if d_routed.dtype in _HOST_DTYPES else torch.float32)  # [T, H]
        dx, dw = ctx.experts.backward(hx, hi, hw, dy, dx=need_x, dweights=need_w)
        device = d_routed.device
        dx = None if dx is None else dx.to(device=device, dtype=d_routed.dtype)
        dw = None if dw is None else dw.to(device=device, dtype=ctx.weights_dtype)
        return dx, dw, None, None


def routed(experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The CPU experts' output [T, H] for x [T, H] routed by ids / weights [T, k], recorded for autograd."""
    return RoutedExperts.apply(x, weights, experts, ids)
