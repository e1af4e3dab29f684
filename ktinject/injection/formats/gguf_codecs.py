"""How GGUF (llama.cpp) tensor types decode: one ``codecs.Codec`` per ggml quant type ktinject reads.

    Plain    F32 / F16 / BF16 (only where a tensor needs a transform on the way, e.g. llama's Q/K order; other
             plain tensors are read as their dtype without a codec)
    Q8_0     blocks of 32: fp16 scale d + 32 int8 q; value = d * q. Native int8 has one scale per output row, so
             Q8_0 experts are quantized again (int8), the error measured at load
    Q4_0     blocks of 32: fp16 d + 16 bytes; the low nibbles are elements 0..15, the high nibbles 16..31;
             value = d * (nibble - 8): exactly native int4 with groups of 32 (q = nibble - 8, scale = d)
    Q4_K     super-blocks of 256 (8 x 32, 6-bit scales and mins): requantized, into int4 group 32 by default
    Q5_K     super-blocks of 256: requantized, into int8 by default
    Q6_K     super-blocks of 256 (16 x 16, int8 scales): requantized, into int8 by default
    MXFP4    blocks of 32: one e8m0 exponent e + 16 bytes of e2m1 codes, the low nibbles elements 0..15, the high
             nibbles 16..31; value = e2m1 * 2^(e - 127) (gpt-oss's experts; llama.cpp repacks the release's
             ``*_blocks`` / ``*_scales`` into these blocks bit for bit, so the values are the release's). Into
             native mxfp4 by default, exactly: the nibbles are put back in the release's order (element 2i in the
             low nibble of byte i, 2i + 1 in the high one), codes and exponents unchanged

Tensors one Hugging Face tensor is made of, read back to back (``TensorRef.spans``): ``MLAKVB`` (DeepSeek MLA's
``kv_b_proj`` from ``attn_k_b`` + ``attn_v_b``), ``Interleaved`` (gpt-oss ``gate_up_proj`` from the gate and up
experts), ``Transposed`` (gpt-oss ``down_proj``).

A quantized tensor's blocks run along its last (input) dimension, row after row, so one expert's slice of a fused
``[E, N, K]`` tensor is a contiguous run of whole blocks. ``Permuted`` undoes llama.cpp's Q/K row permutation of
llama-architecture models after decoding (as transformers' GGUF loader does). K-quants decode with
``gguf_kquants`` (the native core's ``ktk_gguf_dequantize``, or torch ops without it: the numpy dequantizers'
operations in their order either way); Q8_0 / Q4_0 / MXFP4 with torch,
in chunks (the tests compare all with ``gguf.quants.dequantize``).
"""
from __future__ import annotations

import math

import torch

from ktinject.injection.formats import gguf_kquants as kquants
from ktinject.injection.formats.base import LoadError
from ktinject.injection.formats.codecs import E2M1, Codec

#: ggml type name -> (elements per block, bytes per block) for the types ktinject reads
BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "MXFP4": (32, 17),
}
#: the plain types and the torch dtype their bytes hold
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
#: ggml type -> the native expert format (quant, group) that keeps its values best
NATIVE: dict[str, tuple[str, int | None]] = {
    "F32": ("bf16", None), "F16": ("bf16", None), "BF16": ("bf16", None),
    "Q8_0": ("int8", None), "Q4_0": ("int4", 32), "Q4_K": ("int4", 32), "Q5_K": ("int8", None),
    "Q6_K": ("int8", None), "MXFP4": ("mxfp4", 32),
}


def row_bytes(qtype: str, K: int) -> int:
    """Bytes of one row of ``K`` elements of ``qtype``; LoadError when K is not a whole number of blocks."""
    block, size = BLOCKS[qtype]
    if K % block:
        raise LoadError(f"{qtype} stores rows in blocks of {block} elements; a row of {K} is not whole blocks")
    return K // block * size


class GGMLCodec(Codec):
    """One ggml type: its blocks along the last dimension of a [..., N, K] tensor (1-D tensors: [K])."""

    def __init__(self, qtype: str):
        if qtype not in BLOCKS:
            raise LoadError(f"ggml type {qtype} is not supported; ktinject reads {', '.join(BLOCKS)}")
        self.qtype = qtype
        self.name = f"gguf {qtype}"
        self.native = NATIVE[qtype]

    def nbytes(self, shape):
        return [math.prod(shape[:-1]) * row_bytes(self.qtype, shape[-1])]

    def _blocks(self, buf: torch.Tensor, shape) -> torch.Tensor:
        (n,) = self.nbytes(shape)
        if buf.numel() != n:
            raise LoadError(f"{buf.numel()} bytes read where {self.qtype} {list(shape)} needs {n}")
        return buf.view(-1, BLOCKS[self.qtype][1])

    def decode(self, buf, shape):
        return self.decode_as(buf, shape, torch.float32)

    def decode_as(self, buf, shape, dtype):
        if self.qtype in PLAIN:
            return buf.view(PLAIN[self.qtype]).view(shape).to(dtype, copy=True)  # (buf goes back to the pool)
        b = self._blocks(buf, shape)
        if self.qtype in kquants.SIZES:
            return kquants.dequantize(b, self.qtype, dtype).view(shape)
        out = torch.empty(b.shape[0], 32, dtype=dtype)
        for i in range(0, b.shape[0], kquants.CHUNK * 8):  # in chunks: a few chunk-sized temporaries at a time
            out[i:i + kquants.CHUNK * 8] = self._decode32(b[i:i + kquants.CHUNK * 8])
        return out.view(shape)

    def _decode32(self, b: torch.Tensor) -> torch.Tensor:
        """Blocks of 32 values (Q8_0, Q4_0, MXFP4) -> float32 [n, 32]."""
        if self.qtype == "Q8_0":
            d = b[:, :2].contiguous().view(torch.float16).float()
            return b[:, 2:].contiguous().view(torch.int8).float() * d
        if self.qtype == "Q4_0":
            d = b[:, :2].contiguous().view(torch.float16).float()
            q = torch.cat([b[:, 2:] & 0x0F, b[:, 2:] >> 4], dim=1).to(torch.int8) - 8
            return q.float() * d
        codes = torch.cat([b[:, 1:] & 0x0F, b[:, 1:] >> 4], dim=1).long()  # MXFP4: low nibbles 0..15, high 16..31
        exp = b[:, :1].to(torch.int32) - 127
        return torch.ldexp(torch.tensor(E2M1, dtype=torch.float32)[codes], exp.float())

    def mxfp4_parts(self, buf, shape):
        """MXFP4: (e2m1 pairs uint8 [..., N, K / 2] in the release's nibble order, e8m0 exponents [..., N, K / 32])."""
        if self.qtype != "MXFP4" or len(shape) < 2:
            return None
        b = self._blocks(buf, shape)
        codes = torch.cat([b[:, 1:] & 0x0F, b[:, 1:] >> 4], dim=1)  # elements 0..31 of each block, in order
        pairs = codes[:, 0::2] | (codes[:, 1::2] << 4)
        return pairs.reshape(*shape[:-1], shape[-1] // 2), b[:, 0].contiguous().view(*shape[:-1], shape[-1] // 32)

    def _q4_0(self, buf, shape) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [..., K] in [-8, 7], d float32 [..., K / 32])."""
        b = self._blocks(buf, shape)
        d = b[:, :2].contiguous().view(torch.float16).float()
        qs = b[:, 2:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1).to(torch.int8) - 8  # low nibbles 0..15, high 16..31
        return q.view(shape), d.view(*shape[:-1], shape[-1] // 32)

    def quantized(self, buf, shape, quant, group):
        if self.qtype != "Q4_0" or (quant, group) != ("int4", 32) or len(shape) < 2:
            return None
        return self._q4_0(buf, shape)


class Permuted(Codec):
    """``inner``'s values with llama.cpp's row permutation of llama Q / K projections undone: rows are stored per
    head as (dim, 2) pairs interleaved; transformers' ``LlamaTensorProcessor._reverse_permute_weights``, exactly."""

    def __init__(self, inner: GGMLCodec, n_head: int):
        self.inner, self.n_head = inner, n_head
        self.name, self.native = inner.name, inner.native

    def nbytes(self, shape):
        return self.inner.nbytes(shape)

    def decode(self, buf, shape):
        w = self.inner.decode(buf, shape)
        dim = shape[0] // self.n_head // 2
        return w.reshape(self.n_head, dim, 2, *shape[1:]).transpose(1, 2).reshape(shape)


class _Parts(Codec):
    """One model tensor (``ndim`` dimensions) decoded from several stored GGUF tensors read back to back: ``parts``
    = [(codec, stored shape of the whole tensor)]; with ``lead`` 1 the first dimension indexes experts and is
    read one expert at a time (``decode`` then gets one expert's slice)."""

    def __init__(self, parts: list[tuple[GGMLCodec, tuple[int, ...]]], ndim: int, lead: int = 0):
        self.parts, self.ndim, self.lead = parts, ndim, lead
        self.name, self.native = parts[0][0].name, parts[0][0].native

    def nbytes(self, shape):
        return [n for codec, s in self._shapes(shape) for n in codec.nbytes(s)]

    def _shapes(self, shape) -> list[tuple[GGMLCodec, tuple[int, ...]]]:
        drop = self.lead if len(shape) < self.ndim else 0
        return [(codec, tuple(s[drop:])) for codec, s in self.parts]

    def _values(self, buf, shape) -> list[torch.Tensor]:
        shapes = self._shapes(shape)
        sizes = [codec.nbytes(s)[0] for codec, s in shapes]
        if buf.numel() != sum(sizes):
            raise LoadError(f"{buf.numel()} bytes read where {sum(sizes)} were expected")
        ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
        return [codec.decode(buf[end - n:end], s) for n, end, (codec, s) in zip(sizes, ends, shapes)]

    def _mxfp4_parts(self, buf, shape) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Each part's ``GGMLCodec.mxfp4_parts`` (its stored [..., N, K] orientation), or None unless all are MXFP4."""
        shapes = self._shapes(shape)
        sizes = [codec.nbytes(s)[0] for codec, s in shapes]
        if buf.numel() != sum(sizes) or any(getattr(codec, "qtype", None) != "MXFP4" for codec, _ in shapes):
            return None
        ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
        return [codec.mxfp4_parts(buf[end - n:end], s) for n, end, (codec, s) in zip(sizes, ends, shapes)]


class MLAKVB(_Parts):
    """DeepSeek MLA ``kv_b_proj`` [heads * (nope + v), rank] from the converter's split: ``attn_k_b`` [heads, rank,
    nope] (transposed) and ``attn_v_b`` [heads, v, rank]; per head the nope rows, then the v rows."""

    def decode(self, buf, shape):
        k_b, v_b = self._values(buf, shape)
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(shape)


class Interleaved(_Parts):
    """gpt-oss ``gate_up_proj`` [E, H, 2I] (gate in the even columns, up in the odd) from ``ffn_gate_exps`` and
    ``ffn_up_exps`` [E, I, H]; with ``transpose`` False its bias [E, 2I] from the two [E, I] biases."""

    def __init__(self, parts, transpose: bool):
        super().__init__(parts, ndim=3 if transpose else 2, lead=1)
        self.transpose = transpose

    def decode(self, buf, shape):
        gate, up = (v.transpose(-1, -2) if self.transpose else v for v in self._values(buf, shape))
        return torch.stack([gate, up], dim=-1).reshape(shape)

    def mxfp4_parts(self, buf, shape):
        """[..., K / 2, 2I] and [..., K / 32, 2I]: gate rows at the even outputs, up rows at the odd ones (as the
        values), the stored bytes of each row as they are."""
        parts = self._mxfp4_parts(buf, shape) if self.transpose else None
        if parts is None or parts[0] is None or parts[1] is None:
            return None
        (gb, gs), (ub, us) = parts
        return tuple(torch.stack([g, u], dim=-2).flatten(-3, -2).transpose(-1, -2) for g, u in ((gb, ub), (gs, us)))


class Transposed(_Parts):
    """gpt-oss ``down_proj`` [E, I, H] from ``ffn_down_exps`` [E, H, I]."""

    def __init__(self, parts):
        super().__init__(parts, ndim=3, lead=1)

    def decode(self, buf, shape):
        (w,) = self._values(buf, shape)
        return w.transpose(-1, -2).contiguous()

    def mxfp4_parts(self, buf, shape):
        parts = self._mxfp4_parts(buf, shape)
        if parts is None or parts[0] is None:
            return None
        return tuple(t.transpose(-1, -2) for t in parts[0])
