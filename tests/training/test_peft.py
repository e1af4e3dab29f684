"""PEFT on an injected model (CPU): ``get_peft_model(injected, LoraConfig(target_modules=["q_proj", "v_proj"]))``
trains: a few optimizer steps on a fixed batch lower the loss, only the adapters change, and the packed experts'
bytes are the same before and after; the adapters' gradients match PEFT's on the un-injected model (they reach the
earlier layers through the CPU experts' backward), with gradient checkpointing too. Skipped only where peft is not
installed (it is in the test extra).

Legend: B batch, S sequence.
"""
from __future__ import annotations

import pytest
import torch

from ktinject import inject
from ktinject.operators import moe_backward
from ktinject.operators.moe import HybridMoE
from ktinject.tiny_models import build_tiny_model, tiny_prompts
from tests.training.test_injected_training import models

peft = pytest.importorskip("peft")

BATCH = tiny_prompts(4, 16, seed=5)  # [B, S]


@pytest.mark.parametrize("family,quant", [("qwen3_moe", "bf16"), ("qwen2_moe", "int4"), ("gpt_oss", "int8")])
def test_lora_on_attention_trains_only_the_adapters(family, quant):
    model = build_tiny_model(family, seed=0)
    inject(model, gpu="cpu", quant=quant)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                       target_modules=["q_proj", "v_proj"]))
    blocks = [m for m in model.modules() if isinstance(m, HybridMoE)]
    packed = [b.native_experts.export() for b in blocks]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    model.train()
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = model(input_ids=BATCH, labels=BATCH).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert {n for n in changed if "lora_A" in n} == {n for n in before if "lora_A" in n}  # every adapter moved
    assert all(torch.equal(b.native_experts.export(), p) for b, p in zip(blocks, packed))


def _lora(model, seed: int = 0):
    torch.manual_seed(seed)  # the same adapter initialization on both models
    model = peft.get_peft_model(model.requires_grad_(False), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # lora_B nonzero too, so that every adapter matrix has a gradient at the first step
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05, generator=gen)
    return model


def _adapter_grads(model) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(input_ids=BATCH, labels=BATCH).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("quant", ["bf16", "fp8"])
def test_adapter_gradients_match_peft_on_hf(quant):
    ref, inj = models("qwen3_moe", quant)
    g_ref, g_inj = _adapter_grads(_lora(ref)), _adapter_grads(_lora(inj))
    assert set(g_ref) == set(g_inj) and len(g_ref) == 4 * 3  # A and B of q_proj and v_proj in 3 layers
    for n in g_ref:
        err = ((g_inj[n] - g_ref[n]).norm() / g_ref[n].norm()).item()
        assert err < 1.5e-2, f"{n}: {err:.2e}"


def test_gradient_checkpointing(monkeypatch):
    """HF's gradient checkpointing re-runs each layer's forward (the CPU experts' too) in the backward: the same
    gradients as without it."""
    model = build_tiny_model("qwen3_moe", seed=0)
    inject(model, gpu="cpu")
    model = _lora(model)
    model.train()
    calls = []
    routed = moe_backward.routed
    monkeypatch.setattr(moe_backward, "routed", lambda *a: calls.append(1) or routed(*a))
    plain = _adapter_grads(model)
    once = len(calls)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    again = _adapter_grads(model)
    assert once == 2 and len(calls) == once + 2 * once  # two MoE blocks; checkpointed: forward, then recomputed
    assert set(plain) == set(again) and plain
    assert all(torch.allclose(plain[n], again[n], rtol=1e-5, atol=1e-7) for n in plain)
