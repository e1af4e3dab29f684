"""Triton kernels for the decode step on CUDA: chains of small kernels as one or two each.

A decode step on the GPU is a chain of small dependent kernels, each costing its launch gap; with the routed
experts on the CPU that chain is on the step's critical path (the GPU time of each chain before and after is in the
README's Performance section, timed inside CUDA graphs by tests/gpu/probe_fused.py):

- ``qk_norm_rope``: q/k RMSNorm and rotary embedding, seven torch kernels (stacked norm weights, unweighted norm,
  weight multiplication, x * cos, roll, sign * sin, addcmul) as one kernel. One program per (batch, head) row
  of q and k, with the roundings of the torch ops (to the input dtype after the norm, after the weight, after
  x * cos, once at the end):
      y   = round(round(x * rsqrt(mean(x^2) + eps)) * w)      (w: q_norm's weight for q rows, k_norm's for k rows)
      out = round(round(y * cos) + roll(y, D/2) * sign * sin)  (sign = -1 for the first half of D, +1 after)
- ``masked_softmax``: float32 scores -> scale, mask (bool: keep where true; float: added) -> softmax over the keys
  -> probabilities in the value dtype, four torch kernels (mul_, where / add, softmax, cast) as one.
  One program per score row, the keys in blocks of 1024: a pass for the running max and sum (online softmax), a
  pass that writes.
- ``router_topk`` (the MoE operator's fast routing): logits (blocks of 2 experts, 64 programs for 128) and top-k
  + the softmax of the k, two kernels instead of five.

``available(t, head_dim)`` says where they run (see there); elsewhere the torch ops run. Triton is imported at the
first call (the first routing, prefill included), not at import. exp and rsqrt are Triton's fast versions (relative
error ~1e-6: below bf16's rounding, at float32's last bits).
Legend: B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, D head dim, L keys (the static cache length).
"""
from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger(__name__)


@functools.cache
def _kernels():
    """(qk_norm_rope, masked_softmax, router_logits, topk_softmax) jitted, or None when Triton is missing or
    broken here (the torch ops run instead)."""
    try:
        return _define()
    except Exception as e:  # ImportError, a Triton build that fails to load, sources missing for the JIT
        log.info("fused: Triton unavailable (%s); the decode step uses torch ops", e)
        return None


def _define():
    import triton
    import triton.language as tl

    @triton.jit
    def qk_norm_rope_k(qkv, out, wq, wk, cos, sin, s_qkv_b, s_qkv_h, s_out_b, s_out_h, s_cs_b, eps,
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

    @triton.jit
    def masked_scores(src, mrow, offs, inside, scale, MASK: tl.constexpr, MASK_BOOL: tl.constexpr):
        """scores * scale at offs, masked (-inf, or the float mask added); -inf outside the row."""
        x = tl.load(src + offs, mask=inside, other=float("-inf")) * scale
        if MASK:
            if MASK_BOOL:
                x = tl.where(tl.load(mrow + offs, mask=inside, other=0) != 0, x, float("-inf"))
            else:
                x = x + tl.load(mrow + offs, mask=inside, other=0.0).to(tl.float32)
        return x

    @triton.jit(do_not_specialize=["L", "ROWS_PER_B", "s_mask_b"])  # one compile for every cache length
    def masked_softmax_k(scores, mask, out, L, ROWS_PER_B, s_mask_b, scale,
                         MASK: tl.constexpr, MASK_BOOL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        b = row // ROWS_PER_B
        src = scores + row.to(tl.int64) * L
        dst = out + row.to(tl.int64) * L
        mrow = mask + b.to(tl.int64) * s_mask_b
        m_run = tl.full([BLOCK], float("-inf"), tl.float32)
        s_run = tl.zeros([BLOCK], tl.float32)
        for start in range(0, L, BLOCK):  # per lane: running max and sum of exp over its keys
            offs = start + tl.arange(0, BLOCK)
            inside = offs < L
            x = masked_scores(src, mrow, offs, inside, scale, MASK, MASK_BOOL)
            m_new = tl.maximum(m_run, x)
            alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp(m_run - m_new))
            s_run = s_run * alpha + tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
            m_run = m_new
        m = tl.max(m_run, axis=0)
        total = tl.sum(tl.where(m_run == float("-inf"), 0.0, s_run * tl.exp(m_run - m)), axis=0)
        for start in range(0, L, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < L
            x = masked_scores(src, mrow, offs, inside, scale, MASK, MASK_BOOL)
            p = tl.exp(x - m) / total
            tl.store(dst + offs, p.to(out.dtype.element_ty), mask=inside)

    @triton.jit
    def router_logits_k(x, w, out, H, E, s_x, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        acc = tl.zeros([BLOCK_E, BLOCK_H], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            xv = tl.load(x + t * s_x + h, mask=h < H, other=0.0).to(tl.float32)
            wv = tl.load(w + e[:, None] * H + h[None, :], mask=(e[:, None] < E) & (h[None, :] < H), other=0.0)
            acc += wv.to(tl.float32) * xv[None, :]
        tl.store(out + t * E + e, tl.sum(acc, axis=1), mask=e < E)

    @triton.jit
    def topk_softmax_k(logits, w_out, i_out, E, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        slot = tl.arange(0, KP)
        l = tl.load(logits + t * E + offs, mask=offs < E, other=float("-inf"))
        top = tl.max(l, axis=0)
        p = tl.zeros([KP], tl.float32)
        ids = tl.zeros([KP], tl.int64)
        for i in tl.static_range(K):  # the k largest, one at a time (ties: the lowest index first)
            m = tl.max(l, axis=0)
            j = tl.argmax(l, axis=0)
            p = tl.where(slot == i, tl.exp(m - top), p)
            ids = tl.where(slot == i, j.to(tl.int64), ids)
            l = tl.where(offs == j, float("-inf"), l)
        p = p / tl.sum(p, axis=0)
        tl.store(w_out + t * K + slot, p, mask=slot < K)
        tl.store(i_out + t * K + slot, ids, mask=slot < K)

    return qk_norm_rope_k, masked_softmax_k, router_logits_k, topk_softmax_k


def router_topk(x: torch.Tensor, weight: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the k largest of x [T, H] @ weight [E, H] (float32, contiguous): (weights [T, k] float32, ids
    [T, k] int64), the ids in descending logit order. Two kernels (logits in blocks of 2 experts; then top-k by k
    rounds of argmax, softmax of the k) instead of float32 cast, GEMV (two kernels), top-k and softmax."""
    T, H = x.shape
    E = weight.shape[0]
    logits = torch.empty((T, E), dtype=torch.float32, device=x.device)
    w = torch.empty((T, k), dtype=torch.float32, device=x.device)
    ids = torch.empty((T, k), dtype=torch.int64, device=x.device)
    if T == 0:
        return w, ids
    kern = _kernels()
    with torch.cuda.device(x.device):  # Triton launches on the current device's current stream
        kern[2][(T, -(-E // 2))](x, weight, logits, H, E, x.stride(0), BLOCK_E=2, BLOCK_H=512)
        kern[3][(T,)](logits, w, ids, E, K=k, KP=max(2, 1 << (k - 1).bit_length()),
                      BLOCK=max(16, 1 << (E - 1).bit_length()))
    return w, ids


def available(t: torch.Tensor, head_dim: int | None = None) -> bool:
    """Whether the kernels can run for ``t``: on a CUDA device of compute capability >= 8.0 (bf16), Triton
    importable, no autograd to record (the kernels have no backward), KTINJECT_FUSED not 0 (read per call; a
    captured graph keeps what was chosen at capture); qk_norm_rope also needs a power-of-two ``head_dim`` >= 16."""
    if not t.is_cuda or os.environ.get("KTINJECT_FUSED", "1") == "0" or (torch.is_grad_enabled() and t.requires_grad):
        return False
    if head_dim is not None and (head_dim < 16 or head_dim & (head_dim - 1)):
        return False
    return _capable(t.device.index if t.device.index is not None else torch.cuda.current_device()) and (
        _kernels() is not None)


@functools.cache
def _capable(device: int) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


def qk_norm_rope(qkv: torch.Tensor, hq: int, hk: int, norms, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q and k of ``qkv`` [B, Hq + 2 Hkv, D] (last dim contiguous) normed (``norms`` = (q_norm, k_norm, eps) or
    None) and rotated by ``cos``/``sin`` [B, 1, D] or [1, 1, D]: a new [B, Hq + Hkv, D] tensor of qkv's dtype."""
    B, _, D = qkv.shape
    out = torch.empty((B, hq + hk, D), dtype=qkv.dtype, device=qkv.device)
    cos = cos.to(qkv.dtype).reshape(-1, D).contiguous()  # [B or 1, D] (HF: batch 1 without position ids)
    sin = sin.to(qkv.dtype).reshape(-1, D).contiguous()
    if norms:
        wq, wk, eps = norms[0].weight.contiguous(), norms[1].weight.contiguous(), float(norms[2])
    else:
        wq = wk = cos  # not read
        eps = 0.0
    with torch.cuda.device(qkv.device):
        _kernels()[0][(B * (hq + hk),)](qkv, out, wq, wk, cos, sin, qkv.stride(0), qkv.stride(1), out.stride(0),
                                        out.stride(1), 0 if cos.shape[0] == 1 else cos.stride(0), eps, HQ=hq,
                                        HQK=hq + hk, D=D, NORM=bool(norms))
    return out


def masked_softmax(scores: torch.Tensor, scale: float, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """softmax(scores * scale, masked) over the last dim, as ``dtype``. scores: float32 [B, ..., L] contiguous;
    mask: None, or [B, 1, 1, L] (last dim contiguous) bool (keep where true) or float (added)."""
    B, L = scores.shape[0], scores.shape[-1]
    rows = scores.numel() // L
    out = torch.empty(scores.shape, dtype=dtype, device=scores.device)
    if mask is None:
        m, s_mask_b, is_bool = scores, 0, True  # not read
    else:
        m = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        s_mask_b, is_bool = (m.stride(0) if m.shape[0] > 1 else 0), mask.dtype == torch.bool
    with torch.cuda.device(scores.device):  # BLOCK fixed: one compile whatever the cache length
        _kernels()[1][(rows,)](scores, m, out, L, rows // B, s_mask_b, float(scale), MASK=mask is not None,
                               MASK_BOOL=is_bool, BLOCK=1024)
    return out
