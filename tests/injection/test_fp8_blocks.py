"""expert_packing.fp8_blocks: e4m3 values and group scales into the native fp8 layout (a scale per 16 rows and
group of inputs), exactly or not at all; pure torch."""
from __future__ import annotations

import pytest
import torch

from ktinject.injection.expert_packing import fp8_blocks
from ktinject.injection.formats.base import LoadError
from ktinject.injection.formats.codecs import E2M1


def _value(q: torch.Tensor, scale: torch.Tensor, group: int, rows: int = 1) -> torch.Tensor:
    """q * the scale of its (rows x group) block, in float64 (exact for these products)."""
    q = q.view(torch.float8_e4m3fn).double() if q.dtype == torch.uint8 else q.double()
    s = scale.double().repeat_interleave(rows, 0)[:q.shape[0]].repeat_interleave(group, 1)[:, :q.shape[1]]
    return q * s


def _random_fp8_bytes(n: int, k: int, gen) -> torch.Tensor:
    b = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    return torch.where((b & 0x7F) == 0x7F, b & 0xF0, b)  # no NaN codes


def test_release_blocks_keep_their_bytes():
    gen = torch.Generator().manual_seed(0)
    q = _random_fp8_bytes(40, 100, gen)  # 40 rows: blocks of 16 rows end inside the release's 32-row blocks
    block = torch.rand(2, 4, generator=gen) + 0.01  # 32 x 32 release blocks
    rows = block.repeat_interleave(32, 0)[:40]
    out = fp8_blocks(q, rows, 32)
    assert out is not None
    q8, s = out
    assert q8.data_ptr() == q.data_ptr() and s.shape == (3, 4)  # the bytes as released, no copy
    assert torch.equal(_value(q8, s, 32, 16), _value(q, rows, 32))


def test_unequal_power_of_two_scales_are_rescaled_exactly():
    """A 16-row block whose rows' scales differ by powers of two takes the largest and shifts the others' values."""
    gen = torch.Generator().manual_seed(1)
    q = _random_fp8_bytes(16, 64, gen)
    q = q | 0x40  # exponents 8..15: two binades down they stay normal (a subnormal result could round)
    q = torch.where((q & 0x7F) == 0x7F, q - 1, q)  # (no NaN codes)
    rows = torch.full((16, 2), 0.5)
    rows[3] = 0.125  # two binades below: values / 4, still e4m3 (exponents 8..15 of 16 -> 6..13)
    out = fp8_blocks(q, rows, 32)
    assert out is not None
    assert torch.equal(_value(*out, 32, 16), _value(q, rows, 32))


def test_mxfp4_values_fit_when_the_exponents_are_close():
    gen = torch.Generator().manual_seed(2)
    lut = torch.tensor(E2M1)
    codes = torch.randint(0, 16, (33, 64), generator=gen)
    v = lut[codes]
    exps = torch.randint(-20, -6, (33, 2), generator=gen).float()  # a spread of 13 binades
    scale = torch.exp2(exps)
    out = fp8_blocks(v, scale, 32)
    assert out is not None
    q8, s = out
    assert q8.dtype == torch.uint8 and s.shape == (3, 2)
    assert torch.equal(_value(q8, s, 32, 16), _value(v, scale, 32))
    # the block's largest value is brought close to 448 (6 * 64 = 384), so small values keep their bits
    assert q8.view(torch.float8_e4m3fn).float().abs().max() == 384


def test_values_that_do_not_fit_give_none():
    v = torch.tensor(E2M1)[torch.arange(32) % 16].repeat(16, 1)
    scale = torch.ones(16, 1)
    scale[5] = 2.0 ** -20  # 20 binades below the block's largest: 0.5 * 2^-20 * 64 is no e4m3 value
    assert fp8_blocks(v, scale, 32) is None


def test_zero_block_and_shapes():
    out = fp8_blocks(torch.zeros(5, 7), torch.zeros(5, 1), 32)
    assert out is not None and torch.equal(out[0], torch.zeros(5, 7, dtype=torch.uint8))
    with pytest.raises(LoadError, match=r"scales of shape \[5, 2\] for a \[5, 7\] matrix in groups of 32"):
        fp8_blocks(torch.zeros(5, 7), torch.zeros(5, 2), 32)
