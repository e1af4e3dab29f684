"""llama.cpp's K-quant super-blocks (256 values) decoded by the native core, or with torch ops in chunks of blocks.

The same float32 operations, in the same order, as ``gguf.quants``' numpy dequantizers (the values the tests and
the loader's error reports compare with): per 32 (Q4_K, Q5_K) or 16 (Q6_K) values a float32 product of the fp16
super-block scale and the sub-block's integer scale, then (Q4_K, Q5_K) ``d * q - dmin * m`` or (Q6_K) ``d * q``,
each operation rounded on its own. ``dequantize`` runs them in the native core (``ktk_gguf_dequantize``, bit for
bit the same) when the loaded module has it, else with torch (``reference``: on every core, in chunks of CHUNK
blocks into the output, so decoding a large tensor holds the output plus a few chunk-sized temporaries, not
several float32 copies of it).

Layouts (bytes of one block): Q4_K 144 = d f16, dmin f16, 12 bytes of 6-bit scales and mins for 8 sub-blocks of
32, 128 bytes of nibbles (each 32 bytes: 32 values in the low nibbles, the next 32 in the high ones); Q5_K 176 =
the same head, 32 bytes of fifth bits (bit j of byte l: value l of sub-block j), 128 bytes of nibbles; Q6_K 210 =
128 bytes of low nibbles, 64 bytes of two high bits, 16 int8 scales (one per 16 values), d f16.
"""
from __future__ import annotations

import torch

from ktinject.native import gguf as native_gguf

CHUNK = 1 << 14  # blocks a step: 4 M values, 16 MiB of float32
SIZES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of Q4_K / Q5_K blocks ([n, 12] bytes) as float32 [n, 8] each."""
    s = scales.view(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _scale_min(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * sc).view(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn).view(n, 8, 1)
    qs = b[:, 16:].reshape(n, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).view(n, 8, 32).float()
    return (d * q - dm).view(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _scale_min(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * sc).view(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn).view(n, 8, 1)
    qh = b[:, 16:48].reshape(n, 1, 32)
    qs = b[:, 48:].reshape(n, 4, 1, 32)
    ql = torch.cat([qs & 0x0F, qs >> 4], dim=2).view(n, 8, 32)
    hi = (qh >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    return (d * (ql | (hi << 4)).float() - dm).view(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).view(n, 16, 1)
    ql = b[:, :128].reshape(n, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).view(n, 8, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    qh = ((qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3).view(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).view(n, 16, 16).float()
    return (d * q).view(n, 256)


_DECODE = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def reference(blocks: torch.Tensor, qtype: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[n * 256] values of ``blocks`` (uint8 [n, SIZES[qtype]]) with torch ops: float32, each chunk cast to
    ``dtype`` as it is stored (the fallback of ``dequantize`` and what its native path is tested against)."""
    fn, n = _DECODE[qtype], blocks.shape[0]
    out = torch.empty(n, 256, dtype=dtype)
    for i in range(0, n, CHUNK):
        out[i:i + CHUNK] = fn(blocks[i:i + CHUNK])
    return out.view(-1)


def _native(blocks: torch.Tensor, qtype: str, dtype: torch.dtype) -> torch.Tensor:
    n = blocks.shape[0]
    blocks = blocks.contiguous()
    if dtype == torch.float32:
        return native_gguf.dequantize_into(blocks, qtype, torch.empty(n * 256, dtype=dtype))
    out = torch.empty(n, 256, dtype=dtype)
    scratch = torch.empty(min(n, CHUNK), 256, dtype=torch.float32)
    for i in range(0, n, CHUNK):
        part = blocks[i:i + CHUNK]
        out[i:i + CHUNK] = native_gguf.dequantize_into(part, qtype, scratch[:part.shape[0]])
    return out.view(-1)


def dequantize(blocks: torch.Tensor, qtype: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[n * 256] values of ``blocks`` (uint8 [n, SIZES[qtype]]): float32, each chunk cast to ``dtype`` as it is
    stored. The native core decodes when the loaded module has ``ktk_gguf_dequantize`` (the same bits), else
    torch (``reference``)."""
    if qtype not in SIZES:
        raise ValueError(f"{qtype} is not a K-quant (expected one of {', '.join(SIZES)})")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != SIZES[qtype]:
        raise ValueError(f"{qtype} blocks must be uint8 [n, {SIZES[qtype]}], got {blocks.dtype} "
                         f"{list(blocks.shape)}")
    if native_gguf.available():
        return _native(blocks, qtype, dtype)
    return reference(blocks, qtype, dtype)
