"""The decode-step q/k RMSNorm and rotary embedding of ``decode_attention`` as one Triton kernel (CUDA only).

In torch ops the step is seven small kernels per layer (stacked norm weights, unweighted RMSNorm, the weight
multiplication, x * cos, roll, sign * sin, addcmul); a decode step on the GPU is a chain of such dependent kernels,
each costing its launch gap. One program per (batch, head) row of q and k computes, with the same roundings as the
torch ops (to the input dtype after the norm, after the weight, after x * cos, once at the end):

    y  = round(round(x * rsqrt(mean(x^2) + eps)) * w)       (w: q_norm's weight for q rows, k_norm's for k rows)
    out = round(round(y * cos) + roll(y, D/2) * sign * sin)   (sign = -1 for the first half of D, +1 after)

``available(t)``: Triton importable, ``t`` on CUDA; D must be a power of two (else the torch ops run). Triton is
imported at the first call, not at import; the kernel is compiled once per (D, dtype, norm or not).
Legend: B batch, Hq query heads, Hkv KV heads, D head dim.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger(__name__)


@functools.cache
def _kernel():
    """The jitted kernel, or None when Triton is missing or broken here."""
    try:
        import triton
        import triton.language as tl
    except Exception as e:  # ImportError, or a Triton build that fails to load: the torch ops run instead
        log.info("fused_rope: Triton unavailable (%s); decode attention uses torch ops", e)
        return None

    @triton.jit
    def qk_norm_rope(qkv, out, wq, wk, cos, sin, s_qkv_b, s_qkv_h, s_out_b, s_out_h, s_cs_b, eps,
                     HQ: tl.constexpr, HQK: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr):
        pid = tl.program_id(0)
        b = pid // HQK
        h = pid % HQK
        offs = tl.arange(0, D)
        rot = (offs + D // 2) % D  # roll(y, D/2)[i] = y[(i + D/2) % D]
        dt = qkv.dtype.element_ty
        row = qkv + b * s_qkv_b + h * s_qkv_h
        x = tl.load(row + offs).to(tl.float32)
        xr = tl.load(row + rot).to(tl.float32)
        if NORM:
            r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            is_q = h < HQ
            w = tl.where(is_q, tl.load(wq + offs), tl.load(wk + offs)).to(tl.float32)
            wr = tl.where(is_q, tl.load(wq + rot), tl.load(wk + rot)).to(tl.float32)
            x = ((x * r).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
            xr = ((xr * r).to(dt).to(tl.float32) * wr).to(dt).to(tl.float32)
        c = tl.load(cos + b * s_cs_b + offs).to(tl.float32)
        s = tl.load(sin + b * s_cs_b + offs).to(tl.float32)
        s = tl.where(offs < D // 2, -s, s)
        y = (x * c).to(dt).to(tl.float32) + xr * s
        tl.store(out + b * s_out_b + h * s_out_h + offs, y.to(dt))

    return qk_norm_rope


def available(t: torch.Tensor, head_dim: int) -> bool:
    """Whether the fused kernel can run for ``t`` (CUDA, a power-of-two head dim, Triton importable, not turned off
    by KTINJECT_FUSED_ROPE=0: A/B measurements, tests)."""
    return (t.is_cuda and head_dim >= 16 and head_dim & (head_dim - 1) == 0
            and os.environ.get("KTINJECT_FUSED_ROPE", "1") != "0" and _kernel() is not None)


def qk_norm_rope(qkv: torch.Tensor, hq: int, hk: int, norms, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q and k of ``qkv`` [B, Hq + 2 Hkv, D] (last dim contiguous) normed (``norms`` = (q_norm, k_norm, eps) or
    None) and rotated by ``cos``/``sin`` [B, 1, D]: a new [B, Hq + Hkv, D] tensor of qkv's dtype."""
    B, _, D = qkv.shape
    out = torch.empty((B, hq + hk, D), dtype=qkv.dtype, device=qkv.device)
    cos = cos.to(qkv.dtype).reshape(B, D).contiguous()
    sin = sin.to(qkv.dtype).reshape(B, D).contiguous()
    if norms:
        wq, wk, eps = norms[0].weight, norms[1].weight, float(norms[2])
    else:
        wq = wk = cos  # not read
        eps = 0.0
    _kernel()[(B * (hq + hk),)](qkv, out, wq, wk, cos, sin, qkv.stride(0), qkv.stride(1), out.stride(0),
                                out.stride(1), cos.stride(0), eps, HQ=hq, HQK=hq + hk, D=D, NORM=bool(norms))
    return out
