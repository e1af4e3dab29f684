"""How a quantized checkpoint tensor's stored bytes decode into the values the model holds.

A ``Codec`` belongs to a ``TensorRef`` whose bytes are one or more stored tensors read back to back (``spans``):

    FP8Block    float8 e4m3 values + one float scale per block (``weight_scale_inv``, 128 x 128 in the releases):
                DeepSeek-V3 / R1 / V3.2, Kimi-K2, GLM-4.5+, MiniMax-M2, Qwen3 FP8
    PackedInt   compressed-tensors ``pack-quantized``: symmetric intB values packed into int32 words (element c of
                a row at bits B*c of the row's words, stored as q + 2^(B-1)), a scale per group of inputs:
                Kimi-K2-Thinking / K2.5 (int4, group 32)
    MXFP4       OCP microscaling FP4: e2m1 values two to a byte (low nibble first) in ``*_blocks``, an e8m0
                power-of-two scale per 32 values in ``*_scales``: gpt-oss's experts

``decode(buf, shape)`` gives float32 values of the logical ``shape`` (the model tensor's, or one expert's slice
of it). ``quantized(buf, shape, quant, group)`` gives the stored integers and scales instead, when they are
exactly a native expert format (``quant``, ``group``): the loader then stores them without rounding again; None
when they are not, and the loader requantizes ``decode``'s values (and reports the error). ``fp8_parts(buf,
shape)`` gives what the native fp8 experts can hold exactly (e4m3 values and the scales of their groups of inputs),
or None; ``mxfp4_parts(buf, shape)`` the bytes native mxfp4 experts store as they are (e2m1 pairs and e8m0
exponents), or None. ``native`` names the native expert format that keeps the stored values (the default ``quant``
of a checkpoint in this format): FP8 -> fp8 as released (the bytes and scales as they are); MXFP4 -> mxfp4 as
released (the bytes as they are, 4.25 bits a weight; fp8 with groups of 32 holds the values exactly too, at 8 bits a
weight, once each block of 16 rows x 32 inputs takes the largest of its power-of-two scales); int4 with groups of
32, 64 or 128 -> int4 as released.
"""
from __future__ import annotations

import math

import torch

from ktinject.injection.formats.base import LoadError

#: e2m1 code -> value (bit 3 the sign)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class Codec:
    """The decoding of one kind of quantized tensor (stateless but for its parameters)."""

    name = ""
    dtype = torch.float32  # what decode returns
    native: tuple[str, int | None] = ("bf16", None)  # (quant, group size) that keeps the values best

    def nbytes(self, shape: tuple[int, ...]) -> list[int]:
        """Bytes of each stored part for a tensor of logical ``shape`` (checked against the file's)."""
        raise NotImplementedError

    def decode(self, buf: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        raise NotImplementedError

    def exact_group(self, quant: str) -> int | None:
        """The group size a load asked for ``quant`` (and no group) takes because native ``quant`` experts hold the
        stored values exactly in it (MXFP4: fp8 with groups of 32), or None: the quant's default group."""
        return None

    def decode_as(self, buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """``decode``'s values cast to ``dtype`` (the same values: the cast is elementwise). A codec that decodes in
        chunks overrides it to write each chunk cast, so a large tensor (an embedding) never exists whole in float32
        beside its model-dtype copy."""
        return self.decode(buf, shape).to(dtype)

    def quantized(self, buf: torch.Tensor, shape: tuple[int, ...], quant: str,
                  group: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q int8 [..., N, K], scale float32 [..., N, groups]) when the stored values are exactly ``quant`` with
        ``group`` inputs per scale; else None."""
        return None

    def mxfp4_parts(self, buf: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(e2m1 pairs, e8m0 exponents) for native mxfp4 experts (``Experts.set_mxfp4``), or None: uint8 views of
        the stored bytes, the logical ``shape`` with its input dimension (the last; the one before for a transposed
        tensor) counted in bytes (2 inputs a byte) and in groups of 32. Sliced like the values
        (``hf_keys.expert_matrices``: along the output dimension only)."""
        return None

    def fp8_parts(self, buf: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(q, scale, group) for native fp8 experts, or None: q of the logical ``shape`` (uint8 e4m3 bytes, or
        float32 values that are e4m3 values once each block's scale is chosen), scale float32 of ``shape`` with its
        input dimension (the last; the one before for a transposed tensor) counted in groups of ``group``: the
        value of an element is q * the scale of its group. Sliced like the values (``hf_keys.expert_matrices``)."""
        return None

    def __repr__(self) -> str:
        return self.name


def _split(buf: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    if buf.numel() != sum(sizes):
        raise LoadError(f"{buf.numel()} bytes read where {sum(sizes)} were expected")
    out, at = [], 0
    for n in sizes:
        out.append(buf[at:at + n])
        at += n
    return out


def _rows(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, int]:
    """(leading dims, N, K) of a [..., N, K] shape."""
    if len(shape) < 2:
        raise LoadError(f"a quantized tensor must be at least 2-D, not {list(shape)}")
    return tuple(shape[:-2]), shape[-2], shape[-1]


class FP8Block(Codec):
    """e4m3 values [..., N, K] and float scales [..., ceil(N/bn), ceil(K/bk)]: value = fp8 * scale of its block."""

    def __init__(self, block: tuple[int, int] = (128, 128), scale_dtype: torch.dtype = torch.float32):
        self.block, self.scale_dtype = tuple(block), scale_dtype
        self.name = f"fp8 e4m3, {block[0]}x{block[1]} block scales"
        # the native fp8 format's groups are 32, 64 or 128 inputs; blocks of rows are held per 16 rows
        self.native = ("fp8", block[1]) if block[1] in (32, 64, 128) else ("int8", None)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        lead, N, K = _rows(shape)
        return (*lead, math.ceil(N / self.block[0]), math.ceil(K / self.block[1]))

    def nbytes(self, shape):
        return [math.prod(shape), math.prod(self.scale_shape(shape)) * self.scale_dtype.itemsize]

    def decode(self, buf, shape):
        w, s = _split(buf, self.nbytes(shape))
        lead, N, K = _rows(shape)
        values = w.view(torch.float8_e4m3fn).view(shape).float()
        scale = s.view(self.scale_dtype).view(self.scale_shape(shape)).float()
        scale = scale.repeat_interleave(self.block[0], -2)[..., :N, :].repeat_interleave(self.block[1], -1)[..., :K]
        return values.mul_(scale)

    def parts(self, buf, shape) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 bytes uint8 of ``shape``, float32 scales [..., ceil(N/bn), ceil(K/bk)]): views of ``buf``."""
        w, s = _split(buf, self.nbytes(shape))
        return w.view(shape), s.view(self.scale_dtype).view(self.scale_shape(shape)).float()

    def fp8_parts(self, buf, shape):
        if self.native[0] != "fp8":
            return None
        w, s = _split(buf, self.nbytes(shape))
        N = shape[-2]
        scale = s.view(self.scale_dtype).view(self.scale_shape(shape)).float()
        return w.view(shape), scale.repeat_interleave(self.block[0], -2)[..., :N, :], self.block[1]


class PackedInt(Codec):
    """compressed-tensors pack-quantized, symmetric: int32 words [..., N, ceil(K*B/32)], scales [..., N, K/G]."""

    def __init__(self, bits: int, group: int, scale_dtype: torch.dtype):
        if bits not in (4, 8) or group <= 0:
            raise LoadError(f"compressed-tensors int{bits} with group {group} is not supported (int4 or int8, "
                            f"symmetric, group-wise)")
        self.bits, self.group, self.scale_dtype = bits, group, scale_dtype
        self.name = f"compressed-tensors int{bits}, group {group}"
        self.native = ("int4", group) if bits == 4 and group in (32, 64, 128) else ("int8", None)

    def scale_shape(self, shape):
        lead, N, K = _rows(shape)
        return (*lead, N, math.ceil(K / self.group))

    def words(self, shape) -> tuple[int, ...]:
        lead, N, K = _rows(shape)
        return (*lead, N, math.ceil(K * self.bits / 32))

    def nbytes(self, shape):
        return [math.prod(self.words(shape)) * 4, math.prod(self.scale_shape(shape)) * self.scale_dtype.itemsize]

    def _unpack(self, buf, shape) -> tuple[torch.Tensor, torch.Tensor]:
        w, s = _split(buf, self.nbytes(shape))
        K = shape[-1]
        per = 32 // self.bits
        words = w.view(torch.int32).view(self.words(shape))
        shifts = torch.arange(per, dtype=torch.int32) * self.bits
        q = (words.unsqueeze(-1) >> shifts) & ((1 << self.bits) - 1)
        q = q.flatten(-2)[..., :K].to(torch.int8) - (1 << (self.bits - 1))
        return q, s.view(self.scale_dtype).view(self.scale_shape(shape)).float()

    def decode(self, buf, shape):
        q, scale = self._unpack(buf, shape)
        return q.float().mul_(scale.repeat_interleave(self.group, -1)[..., :shape[-1]])

    def quantized(self, buf, shape, quant, group):
        if (quant, group) != self.native or quant != "int4":
            return None
        return self._unpack(buf, shape)


class MXFP4(Codec):
    """e2m1 codes two to a byte [..., N, K/32, 16] and e8m0 exponents [..., N, K/32]: value = e2m1 * 2^(e - 127).
    ``transpose``: the model holds the tensor as [..., K, N] (gpt-oss's experts), so the logical shape is that."""

    native = ("mxfp4", 32)

    def __init__(self, transpose: bool = False):
        self.transpose = transpose
        self.name = "mxfp4 (e2m1, e8m0 scales per 32)"

    def stored(self, shape) -> tuple[tuple[int, ...], int, int]:
        lead, a, b = _rows(shape)
        N, K = (b, a) if self.transpose else (a, b)
        if K % 32:
            raise LoadError(f"mxfp4 needs inputs in whole blocks of 32, not {K}")
        return lead, N, K

    def nbytes(self, shape):
        lead, N, K = self.stored(shape)
        return [math.prod(lead) * N * K // 2, math.prod(lead) * N * K // 32]

    def _values(self, buf, shape) -> tuple[torch.Tensor, torch.Tensor]:
        """(e2m1 values float32 [..., N, K], their exponents e - 127 as int32 [..., N, K/32]), as stored."""
        lead, N, K = self.stored(shape)
        blocks, scales = _split(buf, self.nbytes(shape))
        lut = torch.tensor(E2M1, dtype=torch.float32)
        blocks = blocks.view(*lead, N, K // 2).long()
        q = torch.empty(*lead, N, K, dtype=torch.float32)
        q[..., 0::2] = lut[blocks & 0x0F]
        q[..., 1::2] = lut[blocks >> 4]
        return q, scales.view(*lead, N, K // 32).to(torch.int32) - 127

    def decode(self, buf, shape):
        q, exp = self._values(buf, shape)
        out = torch.ldexp(q.unflatten(-1, (-1, 32)), exp.unsqueeze(-1).float()).flatten(-2)
        return out.transpose(-1, -2) if self.transpose else out

    def exact_group(self, quant):
        return 32 if quant in ("mxfp4", "fp8") else None

    def mxfp4_parts(self, buf, shape):
        lead, N, K = self.stored(shape)
        blocks, scales = _split(buf, self.nbytes(shape))
        blocks, scales = blocks.view(*lead, N, K // 2), scales.view(*lead, N, K // 32)
        return (blocks.transpose(-1, -2), scales.transpose(-1, -2)) if self.transpose else (blocks, scales)

    def fp8_parts(self, buf, shape):
        q, exp = self._values(buf, shape)
        scale = torch.ldexp(torch.ones(()), exp.float())
        if self.transpose:
            return q.transpose(-1, -2), scale.transpose(-1, -2), 32
        return q, scale, 32
