"""Training through an injected model (CPU): gradients of the parameters that stay trainable (attention, router,
shared experts, norms, embeddings) after one backward match HF's autograd on the un-injected float32 model with the
same weights; PEFT's LoRA on attention trains it while everything else, the packed experts included, stays fixed.

The reference model gets the experts' stored values (bf16-rounded, or dequantized: ``Experts.get``), so what is
left between the two is the injected forward's own rounding of its activations (bf16 x and h; int8 for int8 and
int4 weights): bf16 and fp8 experts agree to a few 1e-3, int8 to about 1e-2 (gpt-oss, whose clamped activation
amplifies it: a few 1e-2), int4 (W4A8) looser still. A wrong backward (a missing product, a wrong derivative,
the router's gradient lost) is off by order 1.

Legend: B batch, S sequence, E experts, H hidden, I expert intermediate.
"""
from __future__ import annotations

import copy

import pytest
import torch

from ktinject import inject
from ktinject.operators import moe_backward
from ktinject.operators.moe import HybridMoE
from ktinject.tiny_models import build_tiny_model, tiny_prompts

BATCH = tiny_prompts(2, 16, seed=3)  # [B, S]
# worst relative (Frobenius) gradient error over the model's trainable parameters, by format
TOL = {"bf16": 1.5e-2, "fp8": 2e-2, "int8": 8e-2, "int4": 1e-1}


def models(family: str, quant: str):
    """(HF float32 reference with the stored expert values, injected copy), every parameter trainable."""
    ref = build_tiny_model(family, seed=0).requires_grad_(True)
    inj = copy.deepcopy(ref)
    inject(inj, gpu="cpu", quant=quant)
    hf = dict(ref.named_modules())
    with torch.no_grad():
        for name, block in inj.named_modules():
            if not isinstance(block, HybridMoE):
                continue
            experts, ex, I = hf[name].experts, block.native_experts, block.native_experts.intermediate
            for e in range(ex.num_experts):
                gate, up, down = ex.get(e, "gate"), ex.get(e, "up"), ex.get(e, "down")
                if block.spec.layout == "gpt_oss":  # [E, H, 2I] interleaved, [E, I, H]
                    experts.gate_up_proj[e, :, 0::2], experts.gate_up_proj[e, :, 1::2] = gate.T, up.T
                    experts.down_proj[e] = down.T
                else:  # [E, 2I, H] gate then up, [E, H, I]
                    experts.gate_up_proj[e, :I], experts.gate_up_proj[e, I:] = gate, up
                    experts.down_proj[e] = down
    return ref, inj


def grads(model) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(BATCH, labels=BATCH).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = [(f, "bf16") for f in ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss")] + [
    ("qwen3_moe", q) for q in ("int8", "int4", "fp8")] + [("gpt_oss", q) for q in ("int8", "fp8")]


@pytest.mark.parametrize("family,quant", CASES, ids=lambda v: v)
def test_gradients_match_hf(family, quant):
    ref, inj = models(family, quant)
    loss_ref, g_ref = grads(ref)
    loss_inj, g_inj = grads(inj)
    assert abs(loss_inj - loss_ref) < 1e-2 * abs(loss_ref)
    experts = {n for n in g_ref if ".experts." in n and not n.split(".experts.")[1].startswith("shared")}
    assert set(g_inj) == set(g_ref) - experts  # the routed experts are packed: no parameters, no gradients
    routers = [n for n in g_inj if n.endswith(("mlp.gate.weight", "mlp.router.weight"))]
    assert routers and any("q_proj" in n or "q_a_proj" in n for n in g_inj)
    errors = {n: ((g_inj[n] - g_ref[n]).norm() / g_ref[n].norm().clamp_min(1e-30)).item() for n in g_inj}
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOL[quant], f"{worst}: {errors[worst]:.2e}"
    assert max(errors[n] for n in routers) < TOL[quant]


def test_inference_never_records():
    """With grad disabled, or enabled with nothing requiring it, the blocks take their inference path (no Function)."""
    model = build_tiny_model("qwen3_moe", seed=0)
    inject(model, gpu="cpu")
    calls = []
    original = moe_backward.RoutedExperts.apply
    moe_backward.RoutedExperts.apply = lambda *a: calls.append(1) or original(*a)
    try:
        with torch.no_grad():
            quiet = model(BATCH).logits
        plain = model(BATCH).logits  # grad mode, no parameter requires grad
        assert not calls and not plain.requires_grad and torch.equal(quiet, plain)
        model.requires_grad_(True)
        trained = model(BATCH).logits
        assert calls and trained.requires_grad
        # the same forward (HF's router instead of its fast path: the same weights to rounding)
        assert torch.allclose(trained, plain, rtol=1e-4, atol=1e-4)
    finally:
        moe_backward.RoutedExperts.apply = original
