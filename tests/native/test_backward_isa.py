"""The routed experts' backward on each ISA (ktk_backward: the AVX-512 kernels of kernels/avx512/backward.c for the
avx512 and amx ISAs, those of kernels/avx2/backward.c for avx2) against the generic step, its reference, and against float64 torch
autograd, for every format on awkward shapes: sizes off every multiple of 16, one token, experts with no tokens, all
tokens on one expert (several 32-row chunks), gpt-oss's clamps with biases, skipped experts, bf16 dy.

The ISA kernels dequantize exactly as the generic step does and sum with FMAs in their own fixed order, so the two
agree to float rounding, not bit for bit: TOL_ISA (relative Frobenius) on dx and on the routing weights' gradient.
Legend: T tokens, H hidden, I expert intermediate, E experts, k experts per token.
"""
from __future__ import annotations

import pytest
import torch

from ktinject import native
from tests.training.test_experts_backward import F32_TOL, QUANTS, make_experts, reference_grads, rel, routing

TOL_ISA = 1e-5  # float32 sums of a few hundred terms in two orders (FMA against multiply-add)
ISAS = [i for i in native.available_isas() if i != "generic"]

# (E, H, I, T, k)
SHAPES = [(6, 40, 24, 5, 2), (8, 72, 50, 1, 8), (9, 130, 17, 7, 1), (16, 64, 96, 33, 4), (4, 200, 70, 3, 3),
          (5, 256, 128, 9, 2)]


@pytest.fixture
def on_isa():
    before = native.isa()

    def use(name):
        native.set_isa(name)
    yield use
    native.set_isa(before)


def both(on_isa, isa, ex, x, ids, weights, dy, skip=None, pool=None):
    on_isa("generic")
    ref = ex.backward(x, ids, weights, dy, skip=skip, pool=pool)
    on_isa(isa)
    return ref, ex.backward(x, ids, weights, dy, skip=skip, pool=pool)


def check(on_isa, isa, ex, biases, x, ids, weights, dy, skip=None, tol_ref=F32_TOL):
    (gx, gw), (dx, dw) = both(on_isa, isa, ex, x, ids, weights, dy, skip)
    assert dx.dtype == gx.dtype and dx.shape == gx.shape and dw.shape == gw.shape
    assert rel(dx, gx) < TOL_ISA, f"dx vs generic: {rel(dx, gx):.2e}"
    assert rel(dw, gw) < TOL_ISA, f"dweights vs generic: {rel(dw, gw):.2e}"
    rx, rw = reference_grads(ex, biases, x, ids, weights, dy.float(), skip)
    assert rel(dx, rx) < tol_ref and rel(dw, rw) < F32_TOL
    return dx, dw


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}-H{}-I{}-T{}-k{}".format(*s))
def test_isa_matches_generic(on_isa, isa, quant, shape):
    E, H, I, T, k = shape
    ex, biases = make_experts(E, H, I, quant, seed=E + H)
    ids, weights = routing(T, E, k, seed=T)
    g = torch.Generator().manual_seed(11)
    check(on_isa, isa, ex, biases, torch.randn(T, H, generator=g), ids, weights, torch.randn(T, H, generator=g))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("quant", QUANTS)
def test_isa_gptoss_clamps_biases_one_expert(on_isa, isa, quant):
    """Clamped activation with biases, and 70 rows on one expert: three row chunks of it."""
    E, H, I, T, k = 5, 48, 40, 70, 2
    ex, biases = make_experts(E, H, I, quant, gptoss=True, limit=0.6)
    ids, weights = routing(T, E, k, one_expert=2)
    g = torch.Generator().manual_seed(12)
    check(on_isa, isa, ex, biases, torch.randn(T, H, generator=g), ids, weights, torch.randn(T, H, generator=g))


@pytest.mark.parametrize("isa", ISAS)
def test_isa_skip_bf16_dy_threads(on_isa, isa):
    """Skipped experts give zero weight gradients; bf16 dy gives bf16 dx; one and two threads give the same bits."""
    E, H, I, T, k = 6, 72, 40, 21, 3
    ex, biases = make_experts(E, H, I, "int4")
    ids, weights = routing(T, E, k)
    skip = torch.zeros(E, dtype=torch.uint8)
    skip[[0, 3]] = 1
    g = torch.Generator().manual_seed(13)
    x, dy = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    _, dw = check(on_isa, isa, ex, biases, x, ids, weights, dy, skip)
    masked = skip.bool()[ids]
    assert masked.any() and (dw[masked] == 0).all() and (dw[~masked] != 0).all()
    dx16, _ = check(on_isa, isa, ex, biases, x, ids, weights, dy.bfloat16(), tol_ref=2 ** -8)
    assert dx16.dtype == torch.bfloat16
    on_isa(isa)
    one, two = native.Pool(1), native.Pool(2)
    try:
        a, b = ex.backward(x, ids, weights, dy, pool=one), ex.backward(x, ids, weights, dy, pool=two)
    finally:
        one.close()
        two.close()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("isa", ISAS)
def test_isa_fp8_nan_weight_propagates(on_isa, isa):
    """An e4m3 NaN code in a stored weight gives NaN gradients on every ISA, as the generic step does."""
    E, H, I, T, k = 2, 32, 16, 2, 1
    gate_up, down = torch.randn(E, 2 * I, H) / H ** 0.5, torch.randn(E, H, I) / I ** 0.5
    down[0, 3, 5] = float("nan")
    ex = native.Experts.from_hf(gate_up, down, quant="fp8")
    ids, weights = torch.zeros(T, k, dtype=torch.int64), torch.ones(T, k)
    x, dy = torch.randn(T, H), torch.randn(T, H)
    (gx, gw), (dx, dw) = both(on_isa, isa, ex, x, ids, weights, dy)
    assert torch.isnan(gx).any() and torch.equal(torch.isnan(dx), torch.isnan(gx))
    assert torch.equal(torch.isnan(dw), torch.isnan(gw))
