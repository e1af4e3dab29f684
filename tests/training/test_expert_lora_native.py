"""The expert LoRA path's native base products (``Experts.project``, forward and transposed) with the adapters'
terms, biases, activations and dropout in torch: gradients of A, B, the input and the routing weights against
float64 autograd, for bf16 / int8 / int4 / fp8 experts, with and without biases (gpt-oss) and dropout, on awkward
routing (one token, experts with no rows, every row on the same experts, one expert with more rows than the
native step's 32-row chunks).

References: float64 autograd of the same function written row by row with the stored expert values (``Experts.get``)
and the same dropout masks; and of the un-injected HF block with those values (test_expert_lora's ``_reference``).
The path computes in float32 on the exact stored values, so both agree to float32 rounding whatever the format
(a missing term or a wrong derivative is off by order 1): these tests pin its base products to float
(KTINJECT_EXPERT_PRODUCTS, whatever the default), but the last, which checks the bf16 products against them.
Legend: T tokens, E experts, H hidden, I expert intermediate, k experts per token, r rank.
"""
from __future__ import annotations

import pytest
import torch

from ktinject.operators import expert_lora_path as path
from ktinject.operators.expert_lora import NATIVE, PROJECTIONS, Factors
from ktinject.operators.moe import HybridMoE
from tests.training.test_injected_training import models

QUANTS = ("bf16", "int8", "int4", "fp8")
TOL = dict(rtol=1e-3, atol=1e-5)


@pytest.fixture(autouse=True)
def _float_products(monkeypatch):
    monkeypatch.setenv("KTINJECT_EXPERT_PRODUCTS", "float")


def _block(family, quant):
    _, inj = models(family, quant)
    return next(m for m in inj.modules() if isinstance(m, HybridMoE))


def _factors(block, r=3, dropout=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, H, I = block.num_experts, block.hidden_size, block.intermediate_size
    a, b = {}, {}
    for p in PROJECTIONS:
        fi, fo = (I, H) if p == "expert_down_proj" else (H, I)
        a[p] = (torch.randn(E, r, fi, generator=g) / fi ** 0.5).requires_grad_()
        b[p] = (torch.randn(E, fo, r, generator=g) * 0.3).requires_grad_()
    return Factors(a, b, {p: dropout for p in PROJECTIONS})


def _routing(kind, T, E, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "one_expert":  # every token on the same k experts
        ids = torch.arange(k).repeat(T, 1)
    elif kind == "skewed":  # every token's first slot on expert 0 (more rows than a native chunk), the rest random
        ids = torch.stack([torch.cat([torch.tensor([0]), 1 + torch.randperm(E - 1, generator=g)[:k - 1]])
                           for _ in range(T)])
    else:  # distinct experts per token; the last two experts get no rows
        ids = torch.stack([torch.randperm(E - 2, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g) + 0.1
    return ids, w / w.sum(-1, keepdim=True)


def _reference(block, fac, x, ids, w, seed):
    """float64, row by row in the path's row order (for its dropout masks), with the stored expert values."""
    ex = block.native_experts
    rows = path._Rows(ids, block.num_experts)
    masks = path._masks(seed, fac, rows, block.hidden_size, block.intermediate_size)
    leaves = {p: (fac.a[p].detach().double().requires_grad_(), fac.b[p].detach().double().requires_grad_())
              for p in PROJECTIONS}
    bias = block.expert_biases
    W = {}
    out = torch.zeros(x.shape, dtype=torch.float64)
    for i, (e, t) in enumerate(zip(rows.eid.tolist(), rows.tok.tolist())):
        def proj(p, v):
            if (e, p) not in W:
                W[(e, p)] = ex.get(e, NATIVE[p]).double()
            a, b = leaves[p]
            m = masks[p][i].double() if p in masks else 1.0
            return W[(e, p)] @ v + b[e] @ (a[e] @ (v * m))
        g, u = proj("expert_gate_proj", x[t]), proj("expert_up_proj", x[t])
        if bias is not None:
            I = block.intermediate_size
            g, u = g + bias[0][e, :I].double(), u + bias[0][e, I:].double()
        y = proj("expert_down_proj", path._act(ex, g, u))
        if bias is not None:
            y = y + bias[1][e].double()
        out = out.index_add(0, torch.tensor([t]), (w.reshape(-1)[rows.order[i]] * y)[None])
    return out, leaves


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("case", [(1, "mixed", 0.0), (9, "one_expert", 0.0), (13, "mixed", 0.3),
                                  (40, "skewed", 0.2)])
def test_gradients_match_float64_autograd(quant, family, case):
    T, kind, dropout = case
    block = _block(family, quant)
    fac = _factors(block, dropout=dropout)
    H = block.hidden_size
    ids, w = _routing(kind, T, block.num_experts, block.top_k)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g)
    seed = 1234
    ab = [t for p in PROJECTIONS for t in (fac.a[p], fac.b[p])]
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = path.ExpertsWithLora.apply(xi, wi, block, fac, ids, seed, *ab)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    ref, leaves = _reference(block, fac, x64, ids, w64, seed)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-4, atol=1e-5)
    dy = torch.randn(out.shape, generator=g)
    (out * dy).sum().backward()
    (ref * dy.double()).sum().backward()
    torch.testing.assert_close(xi.grad.double(), x64.grad, **TOL)
    torch.testing.assert_close(wi.grad.double(), w64.grad, **TOL)
    routed = set(ids.reshape(-1).tolist())
    for p in PROJECTIONS:
        for got, (want, name) in zip((fac.a[p].grad, fac.b[p].grad), ((leaves[p][0].grad, "A"), (leaves[p][1].grad,
                                                                                                "B"))):
            torch.testing.assert_close(got.double(), want, **TOL, msg=f"{name} of {p}")
            assert not got[[e for e in range(block.num_experts) if e not in routed]].any()


@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_hf_block_reference_int8_fp8(quant):
    """As test_expert_lora's gradient test (bf16, int4 there) for int8 and fp8 experts: the un-injected HF block
    with W + scaling * B A."""
    import peft

    from tests.training.test_expert_lora import EXPERTS, _blocks, _lora, _reference as hf_reference

    ref_model, inj = models("qwen3_moe", quant)
    inj = _lora(inj.requires_grad_(False), EXPERTS)
    name, block = _blocks(inj)[1]
    hf_block = dict(ref_model.named_modules())[name.removeprefix("base_model.model.")]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 5, block.hidden_size, generator=g)
    block.gate.weight.requires_grad_(True)
    x64 = x.double().requires_grad_()
    out_ref, leaves, ref = hf_reference(hf_block, block, x64, scale=8 / 4)
    xi = x.clone().requires_grad_()
    out = block(xi)
    out = out[0] if isinstance(out, tuple) else out
    R = torch.randn(out.shape, generator=g)
    (out_ref * R.double()).sum().backward()
    (out * R).sum().backward()
    torch.testing.assert_close(out.double(), out_ref.detach(), rtol=1e-4, atol=1e-5)
    for (e, p), (a64, b64) in leaves.items():
        m = block.experts[e]._modules[p]
        assert isinstance(m, peft.tuners.lora.Linear)
        ga = m.lora_A["default"].weight.grad
        if a64.grad is None or not a64.grad.any():
            assert ga is None or not ga.any()
            continue
        torch.testing.assert_close(ga.double(), a64.grad, **TOL)
        torch.testing.assert_close(m.lora_B["default"].weight.grad.double(), b64.grad, **TOL)
    torch.testing.assert_close(xi.grad.double(), x64.grad, **TOL)
    torch.testing.assert_close(block.gate.weight.grad.double(), ref.gate.weight.grad, **TOL)


def test_inference_saves_nothing_and_matches_training_forward():
    """Under no_grad nothing is kept for a backward; the output is the same bits as with gradients."""
    block = _block("qwen3_moe", "int4")
    fac = _factors(block)
    ids, w = _routing("mixed", 6, block.num_experts, block.top_k)
    x = torch.randn(6, block.hidden_size)
    ab = [t for p in PROJECTIONS for t in (fac.a[p], fac.b[p])]
    with torch.no_grad():
        a = path.ExpertsWithLora.apply(x, w, block, fac, ids, 0, *ab)
    b = path.ExpertsWithLora.apply(x, w, block, fac, ids, 0, *ab)
    assert a.grad_fn is None and b.grad_fn is not None and torch.equal(a, b)


def _run(block, fac, x, ids, w, dy):
    """(out, dx, dweights, every A and B gradient) of the path, the factors' gradients reset first."""
    ab = [t for p in PROJECTIONS for t in (fac.a[p], fac.b[p])]
    for t in ab:
        t.grad = None
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = path.ExpertsWithLora.apply(xi, wi, block, fac, ids, 0, *ab)
    (out * dy).sum().backward()
    return [out.detach(), xi.grad, wi.grad] + [t.grad.clone() for t in ab]


@pytest.mark.parametrize("quant", ["bf16", "int4"])
@pytest.mark.parametrize("kind", ["one_expert", "skewed"])
def test_bf16_products_close_to_float(monkeypatch, quant, kind):
    """KTINJECT_EXPERT_PRODUCTS=bf16 (experts with at least 16 rows: every one of one_expert's, expert 0 of skewed's):
    output and gradients within a few 2^-8 of the float path's (inputs and weights rounded to bf16 in the base
    products, forward and backward), and not its bits (the bf16 step ran)."""
    block = _block("qwen3_moe", quant)
    fac = _factors(block)
    ids, w = _routing(kind, 40, block.num_experts, block.top_k)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, block.hidden_size, generator=g)
    dy = torch.randn(40, block.hidden_size, generator=g)
    want = _run(block, fac, x, ids, w, dy)
    monkeypatch.setenv("KTINJECT_EXPERT_PRODUCTS", "bf16")
    got = _run(block, fac, x, ids, w, dy)
    assert not torch.equal(got[0], want[0])
    for i, (a, b) in enumerate(zip(got, want)):
        if b.any():
            assert (a - b).norm() <= 1e-2 * b.norm(), i
