"""The native K-quant decoder (ktk_gguf_dequantize) against the torch reference of gguf_kquants, bit for bit.

Random blocks of every K-quant type, with ordinary, extreme (largest, smallest normal, subnormal, zero, negative)
and non-finite (inf, NaN) fp16 scales; one block, many blocks, chunked casts to bf16; and the errors for bad sizes
and types. gguf-py's numpy dequantizers (``gguf.quants.dequantize``) are a second oracle where they are installed.
"""
from __future__ import annotations

import pytest
import torch

from ktinject.injection.formats import gguf_kquants as kq
from ktinject.native import ERR_DTYPE, ERR_NULL, ERR_SHAPE, NativeError
from ktinject.native import gguf as native_gguf
from ktinject.native.library import ffi_lib

pytestmark = pytest.mark.skipif(not native_gguf.available(), reason="native module without ktk_gguf_dequantize")

#: byte offsets of the fp16 super-block scales in a block (Q4_K / Q5_K: d, dmin; Q6_K: d)
SCALE_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
#: fp16 bit patterns of the scales: ordinary, largest, -largest, smallest normal, subnormals, zero, -zero
FINITE = [0x2E66, 0x1400, 0xB800, 0x7BFF, 0xFBFF, 0x0400, 0x0001, 0x03FF, 0x8001, 0x0000, 0x8000]
NON_FINITE = [0x7C00, 0xFC00, 0x7E00, 0xFE01]  # inf, -inf, NaN, -NaN with a payload


def _blocks(qtype: str, n: int, scales: list[int], seed: int) -> torch.Tensor:
    """uint8 [n, block bytes] of random bytes, each fp16 scale drawn from ``scales``."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n, kq.SIZES[qtype]), dtype=torch.uint8, generator=g)
    pool = torch.tensor(scales, dtype=torch.int32)
    for at in SCALE_AT[qtype]:
        bits = pool[torch.randint(0, len(scales), (n,), generator=g)]
        b[:, at] = (bits & 0xFF).to(torch.uint8)
        b[:, at + 1] = (bits >> 8).to(torch.uint8)
    return b


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The float32 bits of x, every NaN as one pattern: torch's own fp16 -> float32 conversion gives a NaN scale
    other payloads on its vector path than on its scalar one, so only where NaNs are is compared."""
    return torch.where(torch.isnan(x), torch.full_like(x, float("nan")), x).contiguous().view(torch.int32)


@pytest.mark.parametrize("qtype", sorted(kq.SIZES))
@pytest.mark.parametrize("n", [1, 3, 1000])
@pytest.mark.parametrize("scales", [FINITE, FINITE + NON_FINITE], ids=["finite", "non-finite"])
def test_native_equals_the_torch_reference_bit_for_bit(qtype, n, scales):
    b = _blocks(qtype, n, scales, seed=n)
    got = native_gguf.dequantize_into(b, qtype, torch.empty(n * 256))
    want = kq.reference(b, qtype)
    assert torch.equal(_bits(got), _bits(want)), f"{qtype}: {(_bits(got) != _bits(want)).sum()} values differ"
    assert torch.equal(_bits(kq.dequantize(b, qtype)), _bits(want))  # the loader's entry takes the native path
    if scales is FINITE and n == 1000:
        assert torch.isfinite(got).all() and got.abs().max() > 1e4  # the extreme scales were there


@pytest.mark.parametrize("qtype", sorted(kq.SIZES))
def test_native_equals_gguf_py(qtype):
    quants = pytest.importorskip("gguf.quants")
    gguf = pytest.importorskip("gguf")
    b = _blocks(qtype, 64, FINITE, seed=7)
    want = quants.dequantize(b.numpy(), getattr(gguf.GGMLQuantizationType, qtype)).reshape(-1)
    got = native_gguf.dequantize_into(b, qtype, torch.empty(64 * 256))
    assert torch.equal(_bits(got), _bits(torch.from_numpy(want.astype("float32"))))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_casts_equal_the_reference(monkeypatch, dtype):
    monkeypatch.setattr(kq, "CHUNK", 7)  # 20 blocks: chunks of 7, 7 and 6
    for qtype in kq.SIZES:
        b = _blocks(qtype, 20, FINITE[:3], seed=3)
        got, want = kq.dequantize(b, qtype, dtype), kq.reference(b, qtype, dtype)
        assert got.dtype == dtype and got.shape == (20 * 256,)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_large_calls_decode_in_parts_on_threads(monkeypatch):
    monkeypatch.setattr(native_gguf, "PARALLEL_BLOCKS", 8)
    monkeypatch.setattr(native_gguf, "_PART_BLOCKS", 2)
    monkeypatch.setattr(native_gguf, "physical_cores", lambda: 3)  # 11 blocks: parts of 3, 4 and 4
    for qtype in kq.SIZES:
        b = _blocks(qtype, 11, FINITE, seed=11)
        got = native_gguf.dequantize_into(b, qtype, torch.full((11 * 256,), float("nan")))
        assert torch.equal(_bits(got), _bits(kq.reference(b, qtype)))


def test_strided_blocks_decode_as_contiguous_ones():
    b = _blocks("Q6_K", 10, FINITE[:3], seed=5)
    strided = torch.cat([b, b], dim=1)[:, :210]  # rows 420 bytes apart
    assert not strided.is_contiguous()
    assert torch.equal(kq.dequantize(strided, "Q6_K"), kq.reference(b, "Q6_K"))


def test_no_blocks():
    assert kq.dequantize(torch.empty(0, 144, dtype=torch.uint8), "Q4_K").shape == (0,)


def test_bad_sizes_and_types_are_clear_errors():
    b = _blocks("Q4_K", 2, FINITE[:1], seed=1)
    with pytest.raises(ValueError, match=r"Q5_K blocks must be uint8 \[n, 176\], got torch.uint8 \[2, 144\]"):
        kq.dequantize(b, "Q5_K")
    with pytest.raises(ValueError, match="Q3_K is not a K-quant"):
        kq.dequantize(b, "Q3_K")
    with pytest.raises(NativeError, match="out: 256 elements where 2 Q4_K blocks decode to 512") as e:
        native_gguf.dequantize_into(b, "Q4_K", torch.empty(256))
    assert e.value.code == ERR_SHAPE
    with pytest.raises(NativeError, match=r"blocks: expected shape \[\*, 210\], got \[2, 144\]"):
        native_gguf.dequantize_into(b, "Q6_K", torch.empty(512))
    with pytest.raises(NativeError, match="not a K-quant") as e:
        native_gguf.dequantize_into(b, "Q2_K", torch.empty(512))
    assert e.value.code == ERR_DTYPE


def test_the_entry_point_checks_its_arguments():
    ffi, lib = ffi_lib()
    out = torch.empty(256)
    src = _blocks("Q4_K", 1, FINITE[:1], seed=2)
    args = (ffi.cast("uint8_t *", src.data_ptr()), ffi.cast("float *", out.data_ptr()))
    assert lib.ktk_gguf_dequantize(99, args[0], 1, args[1]) == ERR_DTYPE
    assert "qtype = 99 is not a K-quant" in ffi.string(lib.ktk_last_error()).decode()
    assert lib.ktk_gguf_dequantize(lib.KTK_GGUF_Q4_K, args[0], -1, args[1]) == ERR_SHAPE
    assert "nblocks = -1" in ffi.string(lib.ktk_last_error()).decode()
    assert lib.ktk_gguf_dequantize(lib.KTK_GGUF_Q4_K, ffi.NULL, 1, args[1]) == ERR_NULL
    assert lib.ktk_gguf_dequantize(lib.KTK_GGUF_Q4_K, args[0], 1, ffi.NULL) == ERR_NULL
    assert lib.ktk_gguf_dequantize(lib.KTK_GGUF_Q4_K, ffi.NULL, 0, ffi.NULL) == 0
    assert lib.ktk_gguf_dequantize(lib.KTK_GGUF_Q4_K, args[0], 1, args[1]) == 0
    assert torch.equal(out, kq.reference(src, "Q4_K"))
