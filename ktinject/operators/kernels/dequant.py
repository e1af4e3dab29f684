"""One-pass device dequantization of packed routed experts (streamed prefill): a Triton kernel that reads
n experts' packed rows (``ktk_experts_raw``'s block layouts, see upload.py) and writes the [n, N, K] destination
directly, instead of upload.py's torch ops (int4: shift out the nibbles into a work buffer, permute, multiply by the
scales: about four passes over the data; docs/performance.md has what that cost).

Per element (n, c) of matrix ``m`` of expert e, exactly what upload.unpack_matrix computes (and ktk_experts_get):

    int4: q = nibble (c/4)%2 of byte ((n/16)*(Kp/8) + c/8)*64 + (n%16)*4 + c%4, two's complement in [-8, 7];
          value = float32(q) * scale[((n/16)*(Kp/G) + c/G)*16 + n%16]
    int8: q = int8 at ((n/16)*(Kp/4) + c/4)*64 + (n%16)*4 + c%4; value = float32(q) * scale[n]
    bf16: value = bf16 at ((n/16)*(Kp/2) + c/2)*32 + (n%16)*2 + c%2
    fp8:  q = e4m3 at ((n/16)*Kp + c)*16 + n%16; value = float32(q) * scale[(n/16)*ceil(Kp/G) + c/G]

one float32 product (no fused add: nothing to contract), rounded once to dst's dtype (round to nearest even, as
torch's cast): bit-identical to the torch path. Only the [N, K] corner is read, so padding costs nothing and no
work buffer is needed.

A program writes a [BN, BK] tile of one matrix of one expert (rows of dst contiguous: wide stores; the source bytes
of the tile are one contiguous stretch of its 16-row blocks). Triton is imported at the first call, not at import.
Legend: n experts, N output rows, K input columns, Np/Kp padded (upload.py), G int4 group size.
"""
from __future__ import annotations

import functools

import torch

from ktinject import envs
from ktinject.operators.kernels import common as fused

QUANT_CODE = {"bf16": 0, "int8": 1, "int4": 2, "fp8": 3}
BN, BK, WARPS = 32, 128, 4  # 4096 elements a program: 32 per thread, rows of 256 bytes (bf16) per store


def _build(triton, tl):
    @triton.jit
    def dequant_k(src, scale, dst, N, K, Kp, s_src, s_scale, s_de, s_dn,
                  QUANT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # src: this matrix's packed data of expert 0 (elements of its dtype), experts s_src apart; scale likewise
        tile = tl.program_id(0)
        e = tl.program_id(1).to(tl.int64)
        tiles_k = tl.cdiv(K, BK)
        n = (tile // tiles_k) * BN + tl.arange(0, BN)[:, None]  # [BN, 1]
        c = (tile % tiles_k) * BK + tl.arange(0, BK)[None, :]  # [1, BK]
        inside = (n < N) & (c < K)
        nb = n // 16
        r = n % 16
        base = src + e * s_src
        if QUANT == 3:
            byte = tl.load(base + (nb * Kp + c) * 16 + r, mask=inside, other=0)
            q = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            s = tl.load(scale + e * s_scale + nb * tl.cdiv(Kp, G) + c // G, mask=inside, other=0.0)
            v = q * s
        elif QUANT == 2:
            byte = tl.load(base + (nb * (Kp // 8) + c // 8) * 64 + r * 4 + c % 4, mask=inside, other=0)
            # the byte's nibble moved to the top of an int32 and shifted back arithmetically: q sign-extended
            q = (byte.to(tl.int32) << (28 - 4 * ((c // 4) % 2))) >> 28
            s = tl.load(scale + e * s_scale + (nb * (Kp // G) + c // G) * 16 + r, mask=inside, other=0.0)
            v = q.to(tl.float32) * s
        elif QUANT == 1:
            q = tl.load(base + (nb * (Kp // 4) + c // 4) * 64 + r * 4 + c % 4, mask=inside, other=0)
            v = q.to(tl.float32) * tl.load(scale + e * s_scale + n, mask=n < N, other=0.0)
        else:
            v = tl.load(base + (nb * (Kp // 2) + c // 2) * 32 + r * 2 + c % 2, mask=inside, other=0.0)
        tl.store(dst + e * s_de + n * s_dn + c, v.to(dst.dtype.element_ty), mask=inside)

    return dequant_k


@functools.cache
def _kernel():
    return fused.define(_build)


def usable(buf: torch.Tensor, *dsts: torch.Tensor) -> bool:
    """Whether the kernel can unpack ``buf`` into ``dsts``: CUDA tensors, Triton importable, KTINJECT_FUSED not 0
    (read per call), byte rows with a contiguous last dim and 4-byte aligned rows (scales are read as float32),
    destinations of a float dtype with contiguous rows."""
    if not buf.is_cuda or not envs.get("KTINJECT_FUSED"):
        return False
    return _layout_ok(buf, dsts) and _kernel() is not None


def _layout_ok(buf: torch.Tensor, dsts) -> bool:
    ok_buf = (buf.dim() == 2 and buf.dtype == torch.uint8 and buf.stride(-1) == 1 and buf.stride(0) % 4 == 0
              and buf.data_ptr() % 4 == 0)
    return ok_buf and all(d.dim() == 3 and d.stride(-1) == 1 and d.dtype in (torch.bfloat16, torch.float16,
                                                                            torch.float32) for d in dsts)


def unpack_matrix(buf: torch.Tensor, m, quant: str, dst: torch.Tensor, group: int = 0) -> None:
    """dst [n, N, K] = matrix ``m`` (upload.MatLayout) of the n packed regions ``buf`` (uint8 [n, expert_bytes],
    rows any distance apart), as upload.unpack_matrix: one launch on the current stream (CUDA, or CPU tensors
    under TRITON_INTERPRET=1). The caller checks ``usable``."""
    if quant not in QUANT_CODE:
        raise ValueError(f"dequant: quant {quant!r} has no kernel (expected one of {tuple(QUANT_CODE)})")
    n = buf.shape[0]
    if dst.shape != (n, m.N, m.K):
        raise ValueError(f"dequant: dst {list(dst.shape)} for {n} matrices [{m.N}, {m.K}]")
    if quant == "int4" and (group <= 0 or m.Kp % group):
        raise ValueError(f"dequant: int4 group size {group} does not divide Kp = {m.Kp}")
    if n == 0 or m.N == 0 or m.K == 0:
        return
    if not _layout_ok(buf, (dst,)):
        raise ValueError("dequant: buf must be uint8 [n, expert_bytes] rows (4-byte aligned, contiguous last dim) "
                         "and dst a float [n, N, K] with contiguous rows")
    if quant == "fp8" and group <= 0:
        raise ValueError(f"dequant: fp8 group size {group}")
    elem = {"bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.int8, "fp8": torch.uint8}[quant]
    src = buf[:, m.data_off:m.data_off + m.data_bytes].view(elem)  # [n, data elements]
    if quant == "bf16":
        scale = dst  # unused
        s_scale = 0
    else:
        ns = (m.Np // 16 * -(-m.Kp // group) if quant == "fp8"
              else m.Np * (m.Kp // group if quant == "int4" else 1))
        scale = buf[:, m.scale_off:m.scale_off + 4 * ns].view(torch.float32)
        s_scale = scale.stride(0)
    grid = (-(-m.N // BN) * -(-m.K // BK), n)
    with fused.on_device(buf):
        _kernel()[grid](src, scale, dst, m.N, m.K, m.Kp, src.stride(0), s_scale, dst.stride(0),
                        dst.stride(1), QUANT=QUANT_CODE[quant], G=max(group, 1), BN=BN, BK=BK, num_warps=WARPS)


def unpack_experts(buf: torch.Tensor, layout, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """upload.unpack_experts by the kernel: gate_up [n, 2I, H] (gate rows, then up rows), down [n, H, I]; three
    launches, no work buffer."""
    I = layout.mats[0].N
    for m, dst in zip(layout.mats, (gate_up[:, :I], gate_up[:, I:], down)):
        unpack_matrix(buf, m, layout.quant, dst, layout.group)
