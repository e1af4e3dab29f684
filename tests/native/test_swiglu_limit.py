"""Native experts with DeepSeek-V4's clamped SwiGLU (activation "swiglu_limit": silu(min(g, L)) * clamp(u, -L, L))
against torch, on sizes that are not multiples of 16, one token and many, limits that clamp most values or none;
its backward against float64 autograd; bad limits refused by name.

Legend: T tokens, k experts per token, E experts, H hidden, I expert intermediate, L the limit.
"""
from __future__ import annotations

import pytest
import torch

from ktinject import native
from ktinject.native import NativeError


def _weights(E: int, H: int, I: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [E, 2I, H], down [E, H, I] float32, scaled so gate/up pre-activations are O(1)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * I, H, generator=g) * (1.5 / H ** 0.5),
            torch.randn(E, H, I, generator=g) * (1.0 / I ** 0.5))


def _routing(T: int, E: int, k: int, H: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g) * 1.5
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return x, ids, torch.rand(T, k, generator=g)


def _reference(x, ids, w, gate_up, down, limit: float, bf16: bool) -> torch.Tensor:
    """HF's DeepseekV4Experts arithmetic in float64; ``bf16``: with the roundings of native bf16 experts (weights,
    x and the activation h rounded to bf16, float accumulation)."""
    r = (lambda t: t.bfloat16().double()) if bf16 else (lambda t: t.double())
    I = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = r(gate_up[e]) @ r(x[t])
            h = torch.nn.functional.silu(gu[:I].clamp(max=limit)) * gu[I:].clamp(-limit, limit)
            out[t] += float(w[t, j]) * (r(down[e]) @ (r(h.float()) if bf16 else h))
    return out


@pytest.mark.parametrize("E, H, I, k", [(5, 37, 23, 3), (6, 72, 40, 2), (3, 130, 88, 3)])
@pytest.mark.parametrize("T", [1, 7, 200])
@pytest.mark.parametrize("limit", [0.4, 1.5, 1e4])
def test_forward_equals_torch(E, H, I, k, T, limit):
    """bf16 experts: equal to the float64 reference with their roundings up to float accumulation (a bf16 rounding
    of h may flip where h lands near a tie: 1e-4 relative); far from the unclamped SwiGLU where the limit bites."""
    gate_up, down = _weights(E, H, I, seed=E * H)
    x, ids, w = _routing(T, E, k, H, seed=T)
    ex = native.Experts.from_hf(gate_up, down, activation="swiglu_limit", limit=limit)
    assert ex.activation == "swiglu_limit" and ex.limit == pytest.approx(limit)
    got = ex(x, ids, w).double()
    want = _reference(x, ids, w, gate_up, down, limit, bf16=True)
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-4, err
    unclamped = _reference(x, ids, w, gate_up, down, float("inf"), bf16=True)
    moved = ((unclamped - want).norm() / want.norm()).item()
    if limit < 2:  # the clamp changes the result by far more than the tolerance
        assert moved > 100 * max(err, 1e-6), (moved, err)
    else:
        assert moved == 0.0


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512", "amx"])
def test_forward_on_every_isa(isa):
    """The same check through each ISA's kernels (one token: the decode path; 96 tokens on few experts: many rows
    an expert)."""
    if isa not in native.available_isas():
        pytest.skip(f"ISA {isa} not available here (have {native.available_isas()})")
    before = native.isa()
    native.set_isa(isa)
    try:
        gate_up, down = _weights(4, 72, 40, seed=31)
        ex = native.Experts.from_hf(gate_up, down, activation="swiglu_limit", limit=0.6)
        for T in (1, 96):
            x, ids, w = _routing(T, 4, 2, 72, seed=32 + T)
            want = _reference(x, ids, w, gate_up, down, 0.6, bf16=True)
            err = ((ex(x, ids, w).double() - want).norm() / want.norm()).item()
            assert err < 1e-4, (isa, T, err)
    finally:
        native.set_isa(before)


def test_no_clamp_equals_silu_bitwise():
    """A limit no value reaches: the same bits as the plain SiLU experts (the same exp and product)."""
    gate_up, down = _weights(4, 40, 24, seed=3)
    x, ids, w = _routing(33, 4, 2, 40, seed=4)
    silu = native.Experts.from_hf(gate_up, down)
    clamped = native.Experts.from_hf(gate_up, down, activation="swiglu_limit", limit=1e30)
    assert torch.equal(silu(x, ids, w), clamped(x, ids, w))


@pytest.mark.parametrize("quant, bound", [("int8", 2e-2), ("int4", 2e-2), ("fp8", 1e-2)])
def test_quantized_experts_take_the_clamp(quant, bound):
    """int8 / int4 / fp8 weights with the clamp: against the float64 reference on the weights as stored (``get``:
    dequantized), within the rounding of their activations (int8 per token for int8 / int4, bf16 for fp8); the
    clamp moves the result by far more (the activation runs on the float gate/up whatever the weights' format)."""
    E, H, I, limit = 5, 72, 40, 0.8
    gate_up, down = _weights(E, H, I, seed=11)
    x, ids, w = _routing(40, E, 3, H, seed=12)
    ex = native.Experts.from_hf(gate_up, down, quant=quant, activation="swiglu_limit", limit=limit)
    stored_gu = torch.stack([torch.cat([ex.get(e, "gate"), ex.get(e, "up")]) for e in range(E)])
    stored_down = torch.stack([ex.get(e, "down") for e in range(E)])
    got = ex(x, ids, w).double()
    want = _reference(x, ids, w, stored_gu, stored_down, limit, bf16=False)
    unclamped = _reference(x, ids, w, stored_gu, stored_down, float("inf"), bf16=False)
    err = ((got - want).norm() / want.norm()).item()
    assert err < bound, err
    assert ((unclamped - want).norm() / want.norm()).item() > 5 * bound


def test_backward_equals_autograd():
    """ktk_backward with the clamped SwiGLU: dx and the routing weights' gradient against float64 autograd through
    the same function on the stored (bf16) weights; clamp passes no gradient outside its bounds, as torch's."""
    E, H, I, T, k, limit = 5, 37, 23, 9, 3, 0.7
    gate_up, down = _weights(E, H, I, seed=21)
    x, ids, w = _routing(T, E, k, H, seed=22)
    ex = native.Experts.from_hf(gate_up, down, activation="swiglu_limit", limit=limit)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(23))
    gx, gw = ex.backward(x, ids, w, dy)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    gu64, dn64 = gate_up.bfloat16().double(), down.bfloat16().double()
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            gu = gu64[e] @ x64[t]
            h = torch.nn.functional.silu(gu[:I].clamp(max=limit)) * gu[I:].clamp(-limit, limit)
            out = out.index_add(0, torch.tensor([t]), (w64[t, j] * (dn64[e] @ h))[None])
    out.backward(dy.double())
    for got, want in ((gx, x64.grad), (gw, w64.grad)):
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.parametrize("limit", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_limit_refused(limit):
    with pytest.raises(NativeError, match=r"swiglu_limit activation needs a finite limit > 0"):
        native.Experts(2, 16, 16, activation="swiglu_limit", limit=limit)


def test_unknown_activation_names_the_known_ones():
    with pytest.raises(NativeError, match=r"activation = 'swiglu'.*silu, gptoss, swiglu_limit"):
        native.Experts(2, 16, 16, activation="swiglu")
