"""Triton kernels of the decode-step attention (decode/attention.py), each with its torch reference.

- ``qk_norm_rope``: q/k RMSNorm and rotary embedding, seven torch kernels (stacked norm weights, unweighted norm,
  weight multiplication, x * cos, roll, sign * sin, addcmul) as one kernel, one program per (batch, head) row of q
  and k, with the roundings of the torch ops (to the input dtype after the norm, after the weight, after x * cos,
  once at the end):
      y   = round(round(x * rsqrt(mean(x^2) + eps)) * w)      (w: q_norm's weight for q rows, k_norm's for k rows)
      out = round(round(y * cos) + roll(y, D/2) * sign * sin)  (sign = -1 for the first half of D, +1 after)
  With ``cache`` (a ktinject KVCache layer's K/V [B, Hkv, L, D] and lengths [B]) the k rows and the v rows of qkv
  go straight into the cache at each row's length instead of out (the cache's two scatter kernels); out holds q.
- ``attention``: one query token per row against the static cache, in one kernel: grid (B x Hkv, P splits of the
  keys); each program takes the G query heads of its KV head as the rows of a [G, D] x [D, keys] product (tensor
  cores, G padded to 16) and runs an online softmax (scale, mask: bool keep-where-true or float added, as the
  module's torch path) over its share of the keys, its next blocks' loads in flight (a pipelined loop). With
  ``lengths`` only keys 0..lengths[b] are read (the others are masked anyway) and the split is over those: the
  keys held are cut into splits of at least ``keys_per_split`` (at most P), so a short sequence in a long cache
  costs what it holds and runs as one program a KV head, which writes the output itself; with several splits
  each stores its partial result and the last of them (common.py's last-program pattern) combines them, unrolled
  over at most MAX_SPLITS so that every split's loads are issued at once. A split's
  cost is mostly latency (loads, the partials' store, the counter, the combine's loads), so a few long splits
  beat many short ones (a short sequence cut into many splits costs more than its keys). The program
  that counts last among a batch row's Hkv x P advances lengths[b] by one (what KVLayer.update's add_ did),
  after all of them have read it. Probabilities enter the value product in the value dtype (as flash kernels and
  the torch path do), unnormalized (flash-decoding); accumulation is float32.
Legend: B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, D head dim, L keys (the static cache length), P splits.
"""
from __future__ import annotations

import functools

import torch

from ktinject.operators.kernels import common as fused
from ktinject.operators.kernels.common import on_device, pow2


def _build(triton, tl):
    global norm_rope_rows  # a jit helper is found through the module's globals (not the closure), made here
    global gdc_wait, gdc_launch_dependents
    gdc_wait, gdc_launch_dependents = fused.gdc_functions()
    @triton.jit
    def rope_k(qkv, out, wq, wk, cos, sin, kc, vc, lens, s_qkv_b, s_qkv_h, s_out_b, s_out_h, s_cs_b,
               s_kc_b, s_kc_h, s_kc_l, s_vc_b, s_vc_h, s_vc_l, L, eps, HQ: tl.constexpr, HK: tl.constexpr,
               D: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr, KV: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        pid = tl.program_id(0)
        b = (pid // (HQ + HK)).to(tl.int64)
        h = pid % (HQ + HK)
        offs = tl.arange(0, BD)
        inside = offs < D
        rot = (offs + D // 2) % D  # roll(y, D/2)[i] = y[(i + D/2) % D]
        dt = qkv.dtype.element_ty
        row = qkv + b * s_qkv_b + h * s_qkv_h
        x = tl.load(row + offs, mask=inside, other=0.0).to(tl.float32)
        xr = tl.load(row + rot, mask=inside, other=0.0).to(tl.float32)
        if NORM:
            r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            is_q = h < HQ
            w = tl.where(is_q, tl.load(wq + offs, mask=inside, other=0.0), tl.load(wk + offs, mask=inside, other=0.0))
            wr = tl.where(is_q, tl.load(wq + rot, mask=inside, other=0.0), tl.load(wk + rot, mask=inside, other=0.0))
            x = ((x * r).to(dt).to(tl.float32) * w.to(tl.float32)).to(dt).to(tl.float32)
            xr = ((xr * r).to(dt).to(tl.float32) * wr.to(tl.float32)).to(dt).to(tl.float32)
        c = tl.load(cos + b * s_cs_b + offs, mask=inside, other=0.0).to(tl.float32)
        s = tl.load(sin + b * s_cs_b + offs, mask=inside, other=0.0).to(tl.float32)
        s = tl.where(offs < D // 2, -s, s)
        y = ((x * c).to(dt).to(tl.float32) + xr * s).to(dt)
        if KV:  # k rows -> the cache at the row's length, with the v row of the same head; q rows -> out
            # blocks, not scalars: Triton's interpreter mistypes a bool scalar broadcast against a block
            is_k = tl.full([BD], h, tl.int32) >= HQ
            pos = tl.load(lens + b + 0 * offs)
            ok = inside & is_k & (pos < L)
            kh = h - HQ
            tl.store(kc + b * s_kc_b + kh * s_kc_h + pos * s_kc_l + offs, y.to(kc.dtype.element_ty), mask=ok)
            v = tl.load(qkv + b * s_qkv_b + (HQ + HK + kh) * s_qkv_h + offs, mask=ok, other=0.0)
            tl.store(vc + b * s_vc_b + kh * s_vc_h + pos * s_vc_l + offs, v.to(vc.dtype.element_ty), mask=ok)
            tl.store(out + b * s_out_b + h * s_out_h + offs, y, mask=inside & ~is_k)
        else:
            tl.store(out + b * s_out_b + h * s_out_h + offs, y, mask=inside)

    @triton.jit
    def norm_rope_rows(row0, s_row, w, cs, sn, g, d, nrows, eps, D: tl.constexpr, NORM: tl.constexpr):
        """rope_k's roundings on rows g < nrows of a [GP, BD] tile (row g at row0 + g * s_row), in row0's dtype."""
        dt = row0.dtype.element_ty
        ok = (g < nrows)[:, None] & (d < D)[None, :]
        rot = (d + D // 2) % D
        x = tl.load(row0 + g[:, None] * s_row + d[None, :], mask=ok, other=0.0).to(tl.float32)
        xr = tl.load(row0 + g[:, None] * s_row + rot[None, :], mask=ok, other=0.0).to(tl.float32)
        if NORM:
            r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            wv = tl.load(w + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
            wr = tl.load(w + rot, mask=d < D, other=0.0).to(tl.float32)[None, :]
            x = ((x * r).to(dt).to(tl.float32) * wv).to(dt).to(tl.float32)
            xr = ((xr * r).to(dt).to(tl.float32) * wr).to(dt).to(tl.float32)
        c = tl.load(cs + d, mask=d < D, other=0.0).to(tl.float32)
        sv = tl.load(sn + d, mask=d < D, other=0.0).to(tl.float32)
        sv = tl.where(d < D // 2, -sv, sv)
        return ((x * c[None, :]).to(dt).to(tl.float32) + xr * sv[None, :]).to(dt)

    @triton.jit(do_not_specialize=["L", "s_m_b", "KPS"])  # one compile for every cache length
    def attn_k(q, kc, vc, lens, mask, out, part, ml, cnt, L, P, NR, KPS, scale, s_q_b, s_q_h, s_k_b, s_k_h, s_k_l,
               s_v_b, s_v_h, s_v_l, s_m_b, s_o_b, wq, wk, cos, sin, s_cs_b, eps, HK: tl.constexpr, G: tl.constexpr,
               GP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, MAXS: tl.constexpr,
               LENS: tl.constexpr, MASK: tl.constexpr, MASK_BOOL: tl.constexpr, PREC: tl.constexpr,
               ROPE: tl.constexpr = False, NORM: tl.constexpr = False, PDL: tl.constexpr = False):
        if PDL:  # (the next kernel, o_proj's GEMV, loads its weights while this one runs)
            gdc_wait()
            gdc_launch_dependents()
        r = tl.program_id(0)  # b * Hkv + KV head
        sp = tl.program_id(1)
        b = r // HK
        hk = r % HK
        n = L
        held = L.to(tl.int64) * 0  # (typed before the branch: ROPE reads it after)
        if LENS:  # keys 0 .. lengths[b] (the new token's own key at lengths[b])
            held = tl.load(lens + b)
            n = tl.minimum(held.to(tl.int32) + 1, L)
            tl.debug_barrier()  # every thread has read lengths[b] before the counter says so
            # lengths[b] advances once all Hkv x P programs of row b have read it (the last to count does it)
            if tl.atomic_add(cnt + NR + b, 1, sem="acq_rel", scope="gpu") == HK * P - 1:
                tl.store(lens + b, held + 1)
                tl.atomic_xchg(cnt + NR + b, 0)
        # splits of at least KPS keys (a split's cost is mostly latency: few long splits beat many short ones), at
        # most P; the splits that get keys (nact) are the ones that work, the others are done
        chunk = tl.cdiv(tl.cdiv(n, tl.minimum(tl.cdiv(n, KPS), P)), BN) * BN
        nact = tl.cdiv(n, chunk)
        if sp < nact:
            start = sp * chunk
            end = tl.minimum(start + chunk, n)
            g = tl.arange(0, GP)
            d = tl.arange(0, BD)
            gd = (g < G)[:, None] & (d < D)[None, :]
            kbase = kc + b.to(tl.int64) * s_k_b + hk.to(tl.int64) * s_k_h
            vbase = vc + b.to(tl.int64) * s_v_b + hk.to(tl.int64) * s_v_h
            if ROPE:  # q is qkv [B, Hq + 2 Hkv, D]: this KV head's G query rows normed and rotated here
                qrow = q + b.to(tl.int64) * s_q_b
                cs_b = b.to(tl.int64) * s_cs_b
                qv = norm_rope_rows(qrow + (hk * G) * s_q_h, s_q_h, wq, cos + cs_b, sin + cs_b, g, d, G, eps, D, NORM)
                if sp == nact - 1:  # the split ending at the new token: its k and v into the cache first
                    pos = held + 0 * g  # lengths[b] as read above (the last program may have advanced it since)
                    kv = (g < 1)[:, None] & (d < D)[None, :] & (pos < L)[:, None]
                    kr = norm_rope_rows(qrow + (HK * G + hk) * s_q_h, s_q_h, wk, cos + cs_b, sin + cs_b, g, d, 1,
                                        eps, D, NORM)
                    tl.store(kbase + pos[:, None] * s_k_l + d[None, :], kr.to(kc.dtype.element_ty), mask=kv)
                    vr = tl.load(qrow + (HK * G + HK + hk) * s_q_h + d[None, :] + 0 * g[:, None], mask=kv, other=0.0)
                    tl.store(vbase + pos[:, None] * s_v_l + d[None, :], vr.to(vc.dtype.element_ty), mask=kv)
                    tl.debug_barrier()  # stored before any thread loads its keys
            else:
                qv = tl.load(q + b.to(tl.int64) * s_q_b + (hk * G + g)[:, None] * s_q_h + d[None, :], mask=gd,
                             other=0.0)
            m_i = tl.full([GP], float("-inf"), tl.float32)
            l_i = tl.zeros([GP], tl.float32)
            acc = tl.zeros([GP, BD], tl.float32)
            for j0 in range(start, end, BN):  # pipelined by Triton (the launch's num_stages): next loads in flight
                j = j0 + tl.arange(0, BN)
                jm = j < end
                kv_mask = jm[:, None] & (d < D)[None, :]
                k = tl.load(kbase + j[:, None].to(tl.int64) * s_k_l + d[None, :], mask=kv_mask, other=0.0)  # [BN, BD]
                sc = tl.dot(qv, tl.trans(k), input_precision=PREC) * scale  # [GP, BN] float32
                if MASK:
                    mv = tl.load(mask + b.to(tl.int64) * s_m_b + j, mask=jm, other=0)
                    if MASK_BOOL:
                        sc = tl.where((mv != 0)[None, :], sc, float("-inf"))
                    else:
                        sc = sc + mv.to(tl.float32)[None, :]
                sc = tl.where(jm[None, :], sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: nothing to rescale
                alpha = tl.exp(m_i - m_safe)
                p = tl.exp(sc - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(vbase + j[:, None].to(tl.int64) * s_v_l + d[None, :], mask=kv_mask, other=0.0)  # [BN, BD]
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
                m_i = m_new
            optr = out + b.to(tl.int64) * s_o_b + (hk * G + g)[:, None] * D + d[None, :]
            if nact == 1:  # one split holds every key: its result is the output (no partials, no combine)
                o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
                tl.store(optr, o.to(out.dtype.element_ty), mask=gd)
            else:
                slot = r * P + sp
                tl.store(part + slot.to(tl.int64) * (GP * BD) + g[:, None] * BD + d[None, :], acc)
                tl.store(ml + slot * (2 * GP) + g, m_i)
                tl.store(ml + slot * (2 * GP) + GP + g, l_i)
                tl.debug_barrier()  # every thread's partials stored before the counter says so
                if tl.atomic_add(cnt + r, 1, sem="acq_rel", scope="gpu") == nact - 1:  # the last split of (b, KV head)
                    mx = tl.full([GP], float("-inf"), tl.float32)
                    tot = tl.zeros([GP], tl.float32)
                    o = tl.zeros([GP, BD], tl.float32)
                    # unrolled over MAXS splits: every split's loads independent of the others, issued back to back
                    for s in tl.static_range(MAXS):
                        ok = tl.full([GP], s, tl.int32) < nact
                        mm = tl.load(ml + (r * P + s) * (2 * GP) + g, mask=ok, other=float("-inf"),
                                     cache_modifier=".cg")
                        mx = tl.maximum(mx, mm)
                    mx = tl.where(mx == float("-inf"), 0.0, mx)
                    for s in tl.static_range(MAXS):
                        ok = tl.full([GP], s, tl.int32) < nact
                        row = (r * P + s) * (2 * GP) + g
                        wgt = tl.exp(tl.load(ml + row, mask=ok, other=float("-inf"), cache_modifier=".cg") - mx)
                        tot += wgt * tl.load(ml + row + GP, mask=ok, other=0.0, cache_modifier=".cg")
                        pa = tl.load(part + (r * P + s).to(tl.int64) * (GP * BD) + g[:, None] * BD + d[None, :],
                                     mask=ok[:, None], other=0.0, cache_modifier=".cg")
                        o += pa * wgt[:, None]
                    o = o / tl.where(tot > 0, tot, 1.0)[:, None]
                    tl.store(optr, o.to(out.dtype.element_ty), mask=gd)
                    tl.atomic_xchg(cnt + r, 0)

    return rope_k, attn_k


@functools.cache
def _kernels():
    return fused.define(_build)


def _rope_operands(qkv: torch.Tensor, norms, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """(cos, sin [B or 1, D] in qkv's dtype, q_norm's and k_norm's weights, eps) as the rotary kernels read them
    (HF: batch 1 without position ids gives one row of cos/sin; without norms the weights are not read)."""
    D = qkv.shape[-1]
    cos = cos.to(qkv.dtype).reshape(-1, D).contiguous()
    sin = sin.to(qkv.dtype).reshape(-1, D).contiguous()
    if norms:
        return cos, sin, norms[0].weight.contiguous(), norms[1].weight.contiguous(), float(norms[2])
    return cos, sin, cos, cos, 0.0


def qk_norm_rope(qkv: torch.Tensor, hq: int, hk: int, norms, cos: torch.Tensor, sin: torch.Tensor,
                 cache: tuple | None = None) -> torch.Tensor:
    """q and k of ``qkv`` [B, Hq + 2 Hkv, D] (last dim contiguous, D even) normed (``norms`` = (q_norm, k_norm,
    eps) or None) and rotated by ``cos``/``sin`` [B, 1, D] or [1, 1, D]: a new [B, Hq + Hkv, D] tensor of qkv's
    dtype; with ``cache`` = (K [B, Hkv, L, D], V [B, Hkv, L, D], lengths [B] int64), k and v are written into K
    and V at position lengths[b] (nothing where that is >= L) and the result is q alone, [B, Hq, D]."""
    B, _, D = qkv.shape
    out = torch.empty((B, hq if cache else hq + hk, D), dtype=qkv.dtype, device=qkv.device)
    cos, sin, wq, wk, eps = _rope_operands(qkv, norms, cos, sin)
    kc, vc, lens = cache if cache else (out, out, out)  # not read without a cache
    if cache and not (kc.stride(-1) == vc.stride(-1) == 1 and kc.shape[-1] == vc.shape[-1] == D):
        raise ValueError("qk_norm_rope: cache K/V need head dim D with a contiguous last dim")
    L = kc.shape[2] if cache else 0
    with on_device(qkv):
        _kernels()[0][(B * (hq + hk),)](
            qkv, out, wq, wk, cos, sin, kc, vc, lens, qkv.stride(0), qkv.stride(1), out.stride(0), out.stride(1),
            0 if cos.shape[0] == 1 else cos.stride(0), *(kc.stride()[:3] if cache else (0, 0, 0)),
            *(vc.stride()[:3] if cache else (0, 0, 0)), L, eps, HQ=hq, HK=hk, D=D, BD=pow2(D, 16),
            NORM=bool(norms), KV=bool(cache), **fused.pdl_kwargs(qkv))
    return out


def key_block(dtype) -> int:
    """Keys per step of the attention kernel: 64 (bf16, fp16), 16 for float32 (its products run without tensor
    cores, in registers: 32 already spills with 4 warps). ``dtype``: a torch dtype or Triton's name ("fp32")."""
    return 16 if dtype in (torch.float32, "fp32") else 64


def splits(rows: int, L: int, device: torch.device, block: int = 64) -> int:
    """Programs per (batch row, KV head): about two per SM over all rows, at most one per ``block`` keys, at most
    MAX_SPLITS."""
    sms = _sms(device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" \
        else 8
    return max(1, min(-(-L // block), -(-2 * sms // rows), MAX_SPLITS))


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


#: keys a split takes at least, and splits a KV head at most (attention). A split costs latency, the combine of
#: several (unrolled) some more, and one program streams keys at a steady rate: a short sequence runs as one split,
#: a thousand keys ran faster as eight splits than as four or one; a combine looping over groups of splits was
#: slower at long caches and was dropped (docs/performance.md).
KEYS_PER_SPLIT = 128
MAX_SPLITS = 8


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
              mask: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
              keys_per_split: int | None = None) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for one query per row: q [B, Hq, D], keys/values [B, Hkv, L, D] (last dims
    contiguous); mask None or [B or 1, 1, 1, >= L] bool (keep where true) or float (added), last dim contiguous;
    ``lengths`` [B] int64: keys held before this token (keys > lengths[b] are not read; lengths += 1 afterwards);
    ``keys_per_split``: at least this many keys a program (default KEYS_PER_SPLIT). Returns [B, Hq * D] in the
    values' dtype."""
    return _attention(q, q.shape[1], keys, values, scale, mask, lengths, keys_per_split, None)


def rope_attention(qkv: torch.Tensor, hq: int, norms, cos: torch.Tensor, sin: torch.Tensor, cache: tuple,
                   scale: float, mask: torch.Tensor | None = None, keys_per_split: int | None = None) -> torch.Tensor:
    """``qk_norm_rope`` with the cache followed by ``attention``, as one kernel: qkv [B, Hq + 2 Hkv, D] (last dim
    contiguous; ``norms``, ``cos``, ``sin`` as qk_norm_rope), ``cache`` = (K, V [B, Hkv, L, D], lengths [B] int64).
    Every program norms and rotates its KV head's G query rows itself, and the one whose split ends at the new
    token writes that token's k and v into the cache (nothing where lengths[b] >= L) before reading its keys: the
    same values as the two kernels, one launch fewer. Returns [B, Hq * D]; lengths advance by one."""
    keys, values, lengths = cache
    cos, sin, wq, wk, eps = _rope_operands(qkv, norms, cos, sin)
    if qkv.stride(-1) != 1 or qkv.shape[1] != hq + 2 * keys.shape[1]:
        raise ValueError(f"rope_attention: qkv {list(qkv.shape)} must be [B, Hq + 2 Hkv = {hq + 2 * keys.shape[1]}, "
                         f"D] with a contiguous last dim")
    rope = (wq, wk, cos, sin, 0 if cos.shape[0] == 1 else cos.stride(0), eps, bool(norms))
    return _attention(qkv, hq, keys, values, scale, mask, lengths, keys_per_split, rope)


def _attention(q, hq, keys, values, scale, mask, lengths, keys_per_split, rope) -> torch.Tensor:
    """attention's launch; ``rope``: None (q [B, Hq, D] as it is) or rope_attention's (wq, wk, cos, sin, s_cs_b,
    eps, norm) with q = qkv."""
    B, _, D = q.shape
    hk, L = keys.shape[1], keys.shape[2]
    G = hq // hk
    if L < 1:
        raise ValueError(f"attention: the cache holds no key slots (keys {list(keys.shape)})")
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1 or values.shape[-1] != D:
        raise ValueError("attention: q, keys and values need one head dim with contiguous last dims")
    if rope is not None and lengths is None:
        raise ValueError("rope_attention: the cache's lengths are needed (where the new token's k and v go)")
    out = torch.empty((B, hq * D), dtype=values.dtype, device=q.device)
    GP, BD, BN = pow2(G, 16), pow2(D, 16), key_block(q.dtype)
    kps = max(BN, int(keys_per_split or KEYS_PER_SPLIT))
    P = splits(B * hk, L, q.device, kps)  # <= MAX_SPLITS: the combine is unrolled over that many
    part = fused.workspace("attn_part", B * hk * P * GP * BD, torch.float32, q.device)
    ml = fused.workspace("attn_ml", B * hk * P * 2 * GP, torch.float32, q.device)
    cnt = fused.workspace("attn_counters", B * hk + B, torch.int32, q.device, zero=True)
    if mask is None:
        m, s_m_b, is_bool = q, 0, True  # not read
    else:
        m = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        s_m_b, is_bool = (m.stride(0) if m.shape[0] > 1 else 0), mask.dtype == torch.bool
    with on_device(q):
        _kernels()[1][(B * hk, P)](
            q, keys, values, q if lengths is None else lengths, m, out, part, ml, cnt, L, P, B * hk, kps, float(scale),
            q.stride(0), q.stride(1), *keys.stride()[:3], *values.stride()[:3], s_m_b, out.stride(0),
            *(rope[:6] if rope else (q, q, q, q, 0, 0.0)), HK=hk, G=G, GP=GP, D=D, BD=BD, BN=BN, MAXS=MAX_SPLITS,
            LENS=lengths is not None, MASK=mask is not None, MASK_BOOL=is_bool, PREC=fused.dot_precision(q.dtype),
            ROPE=rope is not None, NORM=bool(rope and rope[6]), **fused.pdl_kwargs(q))
    return out


def attention_reference(q, keys, values, scale, mask=None, lengths=None) -> torch.Tensor:
    """``attention`` in float64 torch ops (the test oracle; advances ``lengths`` as the kernel does)."""
    B, hq, D = q.shape
    hk, L = keys.shape[1], keys.shape[2]
    k = keys.double().repeat_interleave(hq // hk, 1)  # [B, Hq, L, D]
    v = values.double().repeat_interleave(hq // hk, 1)
    s = torch.einsum("bhd,bhld->bhl", q.double(), k) * scale
    if mask is not None:
        mk = mask[:, 0, 0, :L]  # [B or 1, L]
        s = s.masked_fill(~mk[:, None], float("-inf")) if mk.dtype == torch.bool else s + mk.double()[:, None]
    if lengths is not None:
        past = torch.arange(L, device=q.device)[None, :] > lengths[:, None]  # [B, L]
        s = s.masked_fill(past[:, None], float("-inf"))
        lengths.add_(1)
    return torch.einsum("bhl,bhld->bhd", torch.softmax(s, -1), v).reshape(B, hq * D)
