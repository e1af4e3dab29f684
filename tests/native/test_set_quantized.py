"""Experts.set_quantized: values already quantized are stored as given (int8 per row, int4 per group), read back
exactly, computed as set() would compute the same values, and refused by name when out of range."""
from __future__ import annotations

import pytest
import torch

from ktinject import native


def _experts(quant, H=72, I=40, group=None, E=3):
    return native.Experts(E, H, I, quant=quant, group_size=group)


@pytest.mark.parametrize("group", [32, 64])
def test_int4_values_and_scales_are_kept(group):
    ex = _experts("int4", group=group)
    g = torch.Generator().manual_seed(0)
    for which in ("gate", "up", "down"):
        N, K = ex.shape(which)
        q = torch.randint(-8, 8, (N, K), generator=g, dtype=torch.int8)
        scale = torch.rand(N, -(-K // group), generator=g) + 0.01
        ex.set_quantized(1, which, q, scale)
        want = q.float() * scale.repeat_interleave(group, 1)[:, :K]
        assert torch.equal(ex.get(1, which), want)


def test_int8_per_row_and_strided_sources():
    ex = _experts("int8")
    N, K = ex.shape("down")
    q = torch.randint(-127, 128, (K, N), dtype=torch.int8).t()  # strided view
    scale = torch.rand(N, 1) + 0.1
    ex.set_quantized(0, "down", q, scale)
    assert torch.equal(ex.get(0, "down"), q.float() * scale)


def test_forward_matches_set_of_the_same_values():
    """A group whose largest magnitude is -8 * s: set() recovers q and s exactly, so both packs are the same."""
    H, I, group = 64, 32, 32
    a, b = _experts("int4", H, I, group, E=2), _experts("int4", H, I, group, E=2)
    g = torch.Generator().manual_seed(1)
    for e in range(2):
        for which in ("gate", "up", "down"):
            N, K = a.shape(which)
            q = torch.randint(-7, 8, (N, K), generator=g, dtype=torch.int8)
            q[:, ::group] = -8
            scale = torch.rand(N, K // group, generator=g) + 0.05
            a.set_quantized(e, which, q, scale)
            b.set(e, which, q.float() * scale.repeat_interleave(group, 1))
    x = torch.randn(5, H, generator=g)
    ids = torch.tensor([[0, 1]] * 5)
    w = torch.full((5, 2), 0.5)
    assert torch.equal(a.forward(x, ids, w), b.forward(x, ids, w))


def test_out_of_range_and_bad_kinds_are_refused():
    ex = _experts("int4", group=32)
    N, K = ex.shape("gate")
    q = torch.zeros(N, K, dtype=torch.int8)
    q[3, 5] = 8
    with pytest.raises(native.NativeError, match=r"q\[3\]\[5\] = 8 is outside -8..7"):
        ex.set_quantized(0, "gate", q, torch.ones(N, 3))
    q[3, 5] = 0
    bad = torch.ones(N, 3)
    bad[2, 1] = float("nan")
    with pytest.raises(native.NativeError, match=r"scale of row 2, group 1"):
        ex.set_quantized(0, "gate", q, bad)
    with pytest.raises(native.NativeError, match=r"gate scales of expert 0: expected shape \[40, 3\]"):
        ex.set_quantized(0, "gate", q, torch.ones(N, 2))
    with pytest.raises(native.NativeError, match=r"quantized values are stored only in int8"):
        _experts("bf16").set_quantized(0, "gate", q, torch.ones(N, 2))
