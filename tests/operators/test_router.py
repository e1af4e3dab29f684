"""The MoE operator's fast routing (operators/routing.py: softmax over the top-k logits) against HF's routers.

Softmax -> top-k -> renormalize routers (Qwen3-MoE, Mixtral; Qwen2-MoE and OLMoE with norm_topk_prob) give the same
experts (as sets: the fast path's ids are unsorted) and the same weights to float32 rounding; hooked routers, grad
mode and the other router kinds take HF's own forward, bitwise.
"""
from __future__ import annotations

import pytest
import torch

import ktinject
from ktinject import tiny_models as testing
from ktinject.operators.moe import HybridMoE
from ktinject.operators.routing import fast_routing, softmax_topk_router

FAST = [("qwen3_moe", {}), ("mixtral", {}), ("qwen2_moe", {"norm_topk_prob": True}), ("olmoe", {"norm_topk_prob": True})]
SLOW = [("qwen2_moe", {}), ("olmoe", {}), ("deepseek_v2", {}), ("deepseek_v3", {}), ("glm4_moe", {}), ("gpt_oss", {})]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _block(family, overrides, device="cpu") -> HybridMoE:
    model = testing.build_tiny_model(family, **overrides)
    ktinject.inject(model, gpu=device)
    return next(m for m in model.modules() if isinstance(m, HybridMoE))


def _by_expert(weights: torch.Tensor, ids: torch.Tensor):
    order = ids.argsort(dim=-1)
    return ids.gather(-1, order), weights.gather(-1, order)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family,overrides", FAST)
def test_fast_routing_matches_hf(family, overrides, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    block = _block(family, overrides, device)
    router = block._modules[block.spec.router]
    assert softmax_topk_router(router)
    g = torch.Generator().manual_seed(0)
    for T in (1, 5, 64):
        x = (torch.randn(T, block.hidden_size, generator=g) * 3).to(device, torch.bfloat16)
        _, w_hf, ids_hf = router(x.float())
        w, ids = fast_routing(router, x)
        assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == ids_hf.shape
        i0, w0 = _by_expert(w_hf, ids_hf)
        i1, w1 = _by_expert(w, ids)
        assert torch.equal(i0, i1)
        # HF's logits come from one linear (MKL's GEMM on the CPU), ours from one-row products (row_logits): their
        # float32 sums round differently by a few ulps of the largest logit, and a weight's relative error follows
        # its logit's absolute error (softmax), so the bound scales with that ulp (Intel hosts: 3.4e-6 relative at
        # logits ~10, where AMD ones had stayed under 2e-6)
        ulp = 2.0 ** -23 * float((x.float() @ router.weight.float().t()).abs().max())
        torch.testing.assert_close(w1, w0.float(), rtol=2e-6 + 16 * ulp, atol=1e-7)
        assert torch.allclose(w.sum(-1), torch.ones(T, device=device))
        with torch.no_grad():  # the operator takes it under no_grad (generate, graph capture)
            wr, ir = block.routing(x)
        assert torch.equal(_by_expert(wr, ir)[0], i0)


@pytest.mark.parametrize("family,overrides", FAST[:2])
def test_hf_path_when_hooked_or_recording_grad(family, overrides):
    block = _block(family, overrides)
    router = block._modules[block.spec.router]
    x = torch.randn(7, block.hidden_size).bfloat16()
    router.weight.requires_grad_(True)
    _, w_hf, ids_hf = router(x.float())
    w, ids = block.routing(x)  # grad mode, the router's weight requires grad: HF's forward
    assert w.requires_grad and torch.equal(ids, ids_hf) and torch.equal(w, w_hf)
    router.weight.requires_grad_(False)
    w_hf, ids_hf = w_hf.detach(), ids_hf
    seen = []
    handle = router.register_forward_hook(lambda m, a, out: seen.append(out[0]))
    try:
        with torch.no_grad():
            w, ids = block.routing(x)
    finally:
        handle.remove()
    assert len(seen) == 1 and torch.equal(ids, ids_hf) and torch.equal(w, w_hf)


@pytest.mark.parametrize("family,overrides", SLOW)
def test_other_routers_keep_hf_forward(family, overrides):
    block = _block(family, overrides)
    router = block._modules[block.spec.router]
    assert not softmax_topk_router(router)
    x = torch.randn(5, block.hidden_size).bfloat16()
    with torch.no_grad():
        out = router(x.float())
        w, ids = block.routing(x)
    assert torch.equal(ids, out[2]) and torch.equal(w, out[1])


def test_replaced_router_is_not_fast_routed():
    block = _block("qwen3_moe", {})

    class Wrapped(torch.nn.Module):  # e.g. bench.hot's SkewedRouter
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            logits, w, ids = self.inner(x)
            return logits, w, ids

    block.gate = Wrapped(block.gate)
    x = torch.randn(3, block.hidden_size).bfloat16()
    with torch.no_grad():
        w, ids = block.routing(x)
        _, w_hf, ids_hf = block.gate(x.float())
    assert torch.equal(ids, ids_hf) and torch.equal(w, w_hf)


def test_idle_output_capture_hooks_keep_fast_routing():
    """transformers installs its output-capturing hooks on the routers the first time any output_* flag is used and
    keeps them: idle, they must not turn fast routing off; collecting router logits goes through HF's forward."""
    model = testing.build_tiny_model("qwen3_moe")
    ktinject.inject(model, gpu="cpu")
    block = next(m for m in model.modules() if isinstance(m, HybridMoE))
    ids = testing.tiny_prompts(1, 6)
    calls = []
    router = block.gate
    orig = type(router).forward

    def counting(self, *a, **k):
        calls.append(1)
        return orig(self, *a, **k)

    with torch.no_grad():
        model(ids, output_hidden_states=True)
        type(router).forward = counting
        try:
            calls.clear()
            model(ids)
            assert calls == []  # fast routing: HF's router forward not called
            out = model(ids, output_router_logits=True)
            assert len(calls) > 0 and out.router_logits is not None and len(out.router_logits) > 0
        finally:
            type(router).forward = orig


def test_norm_flag_is_read_per_call():
    block = _block("qwen3_moe", {})
    block.gate.norm_topk_prob = False
    x = torch.randn(4, block.hidden_size).bfloat16()
    with torch.no_grad():
        _, w_hf, ids_hf = block.gate(x.float())
        w, ids = block.routing(x)
    assert torch.equal(ids, ids_hf) and torch.equal(w, w_hf) and not torch.allclose(w.sum(-1), torch.ones(4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_router_topk_matches_torch():
    """fused.router_topk (logits kernel + top-k/softmax kernel) against linear, topk and softmax in torch."""
    from ktinject.operators.kernels import common as fused

    if not fused.available(torch.empty(1, device="cuda")):
        pytest.skip("Triton unavailable")
    g = torch.Generator(device="cuda").manual_seed(0)
    for T, E, H, k in ((1, 128, 2048, 8), (5, 60, 100, 4), (3, 256, 7168, 8), (2, 8, 64, 1), (4, 1024, 512, 16),
                       (0, 128, 2048, 8)):
        x = torch.randn(T, H + 3, device="cuda", generator=g).bfloat16()[:, :H]  # rows H + 3 apart
        W = torch.randn(E, H, device="cuda", generator=g) * 0.02
        w, ids = fused.router_topk(x, W, k)
        top, want_ids = torch.topk(torch.nn.functional.linear(x.float(), W), k, dim=-1)
        assert torch.equal(ids, want_ids)  # both in descending logit order
        torch.testing.assert_close(w, torch.softmax(top, dim=-1), rtol=1e-5, atol=1e-6)
