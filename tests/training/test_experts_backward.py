"""The native backward of the routed experts (ktk_backward, ``native.Experts.backward``) against float64 torch
autograd of the same experts (their stored weights, dequantized: ``Experts.get``), for every format, on awkward
shapes; and the autograd Function around the forward (``ktinject.operators.moe_backward``).

The backward computes in float with the stored weights and the given x / dy (no activation rounding), so it must
match float64 autograd to float rounding whatever the format: the tolerances are float32's, not the formats'.

Legend: T tokens, H hidden, I expert intermediate, E experts, k experts per token.
"""
from __future__ import annotations

import pytest
import torch

from ktinject import native
from ktinject.operators import moe_backward
from tests.references import experts_reference

QUANTS = ("bf16", "int8", "int4", "fp8")
F32_TOL = 2e-5  # relative (Frobenius) error of float32 arithmetic against float64, sums of a few hundred terms


def make_experts(E: int, H: int, I: int, quant: str, gptoss: bool = False, limit: float = 7.0, seed: int = 0):
    """(native.Experts of random weights keeping outputs O(1), biases as experts_reference takes them or None)."""
    g = torch.Generator().manual_seed(seed)
    if not gptoss:
        return native.Experts.from_hf(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5,
                                      torch.randn(E, H, I, generator=g) / I ** 0.5, quant=quant), None
    gub, db = torch.randn(E, 2 * I, generator=g) * 0.3, torch.randn(E, H, generator=g) * 0.3
    ex = native.Experts.from_gpt_oss(torch.randn(E, H, 2 * I, generator=g) * (2 / H ** 0.5), gub,
                                     torch.randn(E, I, H, generator=g) / I ** 0.5, db, limit=limit, quant=quant)
    return ex, (torch.cat([gub[:, 0::2], gub[:, 1::2]], dim=1), db)


def routing(T: int, E: int, k: int, seed: int = 0, one_expert: int | None = None):
    """ids [T, k] (distinct experts per token; every token's first slot on ``one_expert`` where given), weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if one_expert is not None:
        for t in range(T):
            row = [one_expert] + [e for e in ids[t].tolist() if e != one_expert][:k - 1]
            ids[t] = torch.tensor(row)
    weights = torch.rand(T, k, generator=g) + 0.1
    return ids, weights / weights.sum(-1, keepdim=True)


def reference_grads(ex, biases, x, ids, weights, dy, skip=None):
    """(dx, dweights) float64 by autograd of experts_reference (skipped experts' slots routed nowhere)."""
    x64 = x.double().requires_grad_(True)
    w64 = weights.double().requires_grad_(True)
    w_used = w64 if skip is None else w64 * (~skip.bool()[ids]).double()
    out = experts_reference(ex, biases, x64, ids, w_used)
    out.backward(dy.double())
    return x64.grad, w64.grad


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(ex, biases, x, ids, weights, dy, skip=None, tol=F32_TOL):
    dx, dw = ex.backward(x, ids, weights, dy, skip=skip)
    rx, rw = reference_grads(ex, biases, x, ids, weights, dy, skip)
    assert dx.dtype == dy.dtype and dx.shape == x.shape and dw.dtype == torch.float32 and dw.shape == ids.shape
    assert rel(dx, rx) < tol, f"dx: {rel(dx, rx):.2e}"
    assert rel(dw, rw) < tol, f"dweights: {rel(dw, rw):.2e}"
    return dx, dw


# (E, H, I, T, k): sizes off every multiple of 16 / 64, one token, top-k 1 and 8, more experts than tokens use
SHAPES = [(6, 40, 24, 5, 2), (8, 72, 50, 1, 8), (9, 130, 17, 7, 1), (16, 64, 96, 33, 4), (4, 200, 70, 3, 3)]


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}-H{}-I{}-T{}-k{}".format(*s))
def test_backward_matches_float64_autograd(quant, shape):
    E, H, I, T, k = shape
    ex, biases = make_experts(E, H, I, quant)
    ids, weights = routing(T, E, k, seed=T)
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    check(ex, biases, x, ids, weights, dy)
    if T * k < E:  # some experts have no token: nothing of theirs may leak in
        assert len(ids.unique()) < E


@pytest.mark.parametrize("quant", QUANTS)
def test_backward_gptoss_clamps_and_biases(quant):
    """gpt-oss's clamped activation with biases, a limit small enough that many gate / up values are clamped: the
    gradient passes only inside the bounds (torch's clamp)."""
    E, H, I, T, k = 5, 48, 40, 6, 2
    ex, biases = make_experts(E, H, I, quant, gptoss=True, limit=0.6)
    ids, weights = routing(T, E, k)
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    gate = x.double() @ ex.get(ids[0, 0].item(), "gate").double().T + biases[0][ids[0, 0], :I].double()
    assert (gate > 0.6).any() and (gate <= 0.6).any()  # both sides of the clamp are exercised
    check(ex, biases, x, ids, weights, dy)


@pytest.mark.parametrize("quant", QUANTS)
def test_backward_all_tokens_on_one_expert(quant):
    E, H, I, T, k = 8, 56, 36, 70, 2  # 70 rows of expert 3: several row chunks of one expert
    ex, biases = make_experts(E, H, I, quant)
    ids, weights = routing(T, E, k, one_expert=3)
    g = torch.Generator().manual_seed(3)
    check(ex, biases, torch.randn(T, H, generator=g), ids, weights, torch.randn(T, H, generator=g))


def test_backward_skip_mask():
    """Slots of skipped experts contribute nothing and get a zero weight gradient."""
    E, H, I, T, k = 6, 40, 24, 9, 3
    ex, biases = make_experts(E, H, I, "bf16")
    ids, weights = routing(T, E, k)
    skip = torch.zeros(E, dtype=torch.uint8)
    skip[[1, 4]] = 1
    g = torch.Generator().manual_seed(4)
    _, dw = check(ex, biases, torch.randn(T, H, generator=g), ids, weights, torch.randn(T, H, generator=g), skip)
    masked = skip.bool()[ids]
    assert masked.any() and (dw[masked] == 0).all() and (dw[~masked] != 0).all()


def test_backward_bf16_gradients_and_one_of_two():
    """dy in bf16 gives dx in bf16 (rounded once, at the end); asking for one gradient gives the same values."""
    E, H, I, T, k = 6, 40, 24, 5, 2
    ex, biases = make_experts(E, H, I, "int4")
    ids, weights = routing(T, E, k)
    g = torch.Generator().manual_seed(5)
    x, dy = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g).bfloat16()
    dx, dw = ex.backward(x, ids, weights, dy)
    rx, rw = reference_grads(ex, biases, x, ids, weights, dy.float())
    assert dx.dtype == torch.bfloat16 and rel(dx, rx) < 2 ** -8 and rel(dw, rw) < F32_TOL
    only_x, none_w = ex.backward(x, ids, weights, dy, dweights=False)
    none_x, only_w = ex.backward(x, ids, weights, dy, dx=False)
    assert none_w is None and none_x is None
    assert torch.equal(only_x, dx) and torch.equal(only_w, dw)


def test_backward_does_not_depend_on_threads():
    E, H, I, T, k = 8, 72, 40, 40, 2
    ex, _ = make_experts(E, H, I, "int8")
    ids, weights = routing(T, E, k)
    g = torch.Generator().manual_seed(6)
    x, dy = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    one, two = native.Pool(1), native.Pool(2)
    a, b = ex.backward(x, ids, weights, dy, pool=one), ex.backward(x, ids, weights, dy, pool=two)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_backward_bad_input_says_what_to_fix():
    ex, _ = make_experts(4, 32, 16, "bf16")
    ids, weights = routing(3, 4, 2)
    x, dy = torch.randn(3, 32), torch.randn(3, 32)
    with pytest.raises(native.NativeError, match="dy: expected shape"):
        ex.backward(x, ids, weights, torch.randn(3, 31))
    with pytest.raises(native.NativeError, match="dy has 2 rows, hidden 3"):
        ex.backward(x, ids, weights, torch.randn(2, 32))
    with pytest.raises(native.NativeError, match="nothing to compute"):
        ex.backward(x, ids, weights, dy, dx=False, dweights=False)
    bad = ids.clone()
    bad[1, 1] = 4
    with pytest.raises(native.NativeError, match=r"ids\[1\]\[1\] = 4"):
        ex.backward(x, bad, weights, dy)


@pytest.mark.parametrize("quant", ("bf16", "int4"))
def test_function_gradients(quant):
    """RoutedExperts.apply: the forward is the native forward's, the backward the native backward's, both reached
    by loss.backward(); the experts' weights get no gradient (they are no tensors of the graph)."""
    E, H, I, T, k = 6, 40, 24, 7, 2
    ex, biases = make_experts(E, H, I, quant)
    ids, weights = routing(T, E, k)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=g).requires_grad_(True)
    w = weights.clone().requires_grad_(True)
    probe = torch.randn(T, H, generator=g)
    assert moe_backward.wanted(x, w)
    out = moe_backward.routed(ex, x, ids, w)
    with torch.no_grad():
        assert not moe_backward.wanted(x, w)
        assert torch.equal(out, ex(x.detach(), ids, weights))
    (out * probe).sum().backward()
    rx, rw = reference_grads(ex, biases, x.detach(), ids, weights, probe)
    assert rel(x.grad, rx) < F32_TOL and rel(w.grad, rw) < F32_TOL
