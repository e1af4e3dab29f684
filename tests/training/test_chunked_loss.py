"""``ktinject.train.loss.causal_lm_loss``: the LM head and cross entropy over chunks of positions give
transformers' own ``model(..., labels=...).loss`` and its gradients (plain HF models of each family, an injected
model under PEFT, ignored labels and padding), never build a chunk of more than ``CHUNK_LOGITS`` logits, and fall
back to transformers' loss where the head does more than a linear layer or a router loss is added."""
from __future__ import annotations

import copy

import pytest
import torch

from ktinject import inject
from ktinject.tiny_models import FAMILIES, build_tiny_model, tiny_prompts
from ktinject.train import loss as chunked
from ktinject.train.data import IGNORE

IDS = tiny_prompts(2, 24, seed=5)  # [B, S]


def _labels():
    labels = IDS.clone()
    labels[0, :7] = IGNORE  # a prompt without loss
    labels[1, -3:] = IGNORE  # padding
    return labels


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_equals_transformers_loss_and_gradients(family, monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK_LOGITS", 7 * 100)  # chunks of 16 rows at most: several per batch
    ref = build_tiny_model(family, seed=0).requires_grad_(True)
    ours = copy.deepcopy(ref)
    labels, mask = _labels(), torch.ones_like(IDS)
    want = ref(input_ids=IDS, attention_mask=mask, labels=labels, use_cache=False).loss
    want.backward()
    got = chunked.causal_lm_loss(ours, IDS, labels, mask)
    got.backward()
    assert chunked._parts(ours) is not None  # the chunked path ran, not the fallback
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g_ref, g_ours = _grads(ref), _grads(ours)
    assert g_ref.keys() == g_ours.keys()
    for n in g_ref:
        torch.testing.assert_close(g_ours[n], g_ref[n], rtol=1e-4, atol=1e-6, msg=n)


def test_an_injected_model_under_peft_holds_one_chunk_of_logits_at_a_time(monkeypatch):
    peft = pytest.importorskip("peft")
    monkeypatch.setattr(chunked, "CHUNK_LOGITS", 4 * 128)  # 4 rows of the tiny vocabulary: chunks of 16 (the least)
    model = build_tiny_model("qwen3_moe", seed=0)
    inject(model, gpu="cpu", quant="bf16")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    want = model(input_ids=IDS, labels=IDS, use_cache=False).loss
    head = model.get_base_model().get_output_embeddings()
    rows = []
    hook = head.register_forward_hook(lambda m, i, o: rows.append(o.shape[0]))
    got = chunked.causal_lm_loss(model, IDS, IDS)
    got.backward()
    hook.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert head.weight.shape[0] == 128 and max(rows) == 16  # 46 positions with a next label: chunks 16, 16, 14
    assert len(rows) == 6  # three in the forward, each recomputed once in the backward
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_a_router_loss_or_capped_logits_take_transformers_own_loss():
    model = build_tiny_model("qwen3_moe", seed=0)
    assert chunked._parts(model) is not None
    model.config.output_router_logits = True
    assert chunked._parts(model) is None
    want = model(input_ids=IDS, labels=IDS, use_cache=False).loss
    torch.testing.assert_close(chunked.causal_lm_loss(model, IDS, IDS), want)
    model.config.output_router_logits = False
    model.config.final_logit_softcapping = 30.0
    assert chunked._parts(model) is None
