"""ktinject_sdpa (operators/attention.py): the same numbers as HF's sdpa / repeat_kv attention, on the CPU.

The function itself against a repeat_kv reference (HF <= 5.22's decode path), then whole tiny models of all eight
families: injected (gpu="cpu"), logits of a left-padded batch through a static cache (prefill + decode steps) under
``ktinject_sdpa`` against HF's ``sdpa``, and greedy tokens through ktinject.generate."""
from __future__ import annotations

import pytest
import torch

import ktinject
from ktinject import compat
from ktinject.decode.generate import disable
from ktinject.operators import attention as A
from ktinject.decode import attention as decode_attention
from ktinject.tiny_models import FAMILIES, build_tiny_model, tiny_prompts


class _Module(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True
        self.layer_idx = 0


def _reference(query, key, value, mask, groups, scaling):
    """HF 5.17's decode path: repeat K/V to every query head, SDPA with the mask, [B, S, Hq, D]."""
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous()


def _decode_inputs(B=3, Hkv=2, groups=4, L=24, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # the query as HF makes it: [B, S, Hq, D] projected, then transposed (a non-contiguous view)
    query = torch.randn(B, 1, Hkv * groups, D, generator=g).to(dtype).transpose(1, 2)
    key = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
    value = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
    mask = torch.zeros(B, 1, 1, L, dtype=torch.bool)
    mask[0, ..., :10] = True  # row 0: 10 tokens seen
    mask[1, ..., 3:15] = True  # row 1: left-padded by 3
    mask[2, ..., :L] = True  # row 2: the whole cache
    return query, key, value, mask


@pytest.fixture(autouse=True, scope="module")
def _registered():
    assert A.register_sdpa()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("groups", [2, 4, 8])
def test_decode_matches_repeat_kv(dtype, tol, groups):
    q, k, v, mask = _decode_inputs(groups=groups, dtype=dtype)
    m = _Module(groups)
    assert not A._hf_handles(m, q, k, mask, {})  # the packed path, not HF's
    out, weights = A.sdpa_attention_forward(m, q, k, v, mask, scaling=0.3)
    ref = _reference(q, k, v, mask, groups, 0.3)
    assert weights is None and out.shape == ref.shape == (3, 1, 2 * groups, 16) and out.is_contiguous()
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    out_nomask, _ = A.sdpa_attention_forward(m, q, k, v, None)
    torch.testing.assert_close(out_nomask, _reference(q, k, v, None, groups, None), atol=tol, rtol=tol)


def test_other_calls_go_to_hf():
    q, k, v, mask = _decode_inputs()
    m = _Module(4)
    assert A._hf_handles(_Module(1), q[:, :2], k[:, :2], mask, {})  # no grouped query heads
    assert A._hf_handles(m, q.expand(-1, -1, 2, -1), k, mask.expand(-1, -1, 2, -1), {})  # prefill (S > 1)
    assert A._hf_handles(m, q, k, mask.expand(-1, 8, -1, -1), {})  # per-head mask
    for name in ("position_bias", "softcap", "s_aux"):
        assert A._hf_handles(m, q, k, mask, {name: 1.0})
    assert A._hf_handles(m, q, k, mask, {"output_attentions": True})
    # prefill through HF's function: same result as the repeat_kv reference
    g = torch.Generator().manual_seed(1)
    qp = torch.randn(2, 8, 5, 16, generator=g)
    kp, vp = torch.randn(2, 2, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    causal = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5)
    out, _ = A.sdpa_attention_forward(m, qp, kp, vp, causal)
    torch.testing.assert_close(out, _reference(qp, kp, vp, causal, 4, None))


def test_apply_implementation_choices():
    m = build_tiny_model("qwen3_moe")
    assert m.config._attn_implementation == "sdpa"
    assert A.apply_implementation(m, "keep") == "sdpa"
    assert A.apply_implementation(m, "sdpa") == A.KTINJECT_SDPA
    assert A.apply_implementation(m, "sdpa") == A.KTINJECT_SDPA  # idempotent
    assert A.apply_implementation(m, "eager") == "eager"
    assert A.apply_implementation(m, "sdpa") == A.KTINJECT_SDPA
    oss = build_tiny_model("gpt_oss")  # attention sinks: no SDPA, stays eager
    assert A.apply_implementation(oss, "sdpa") == oss.config._attn_implementation == "eager"


def _left_padded():
    ids = tiny_prompts(2, 9, seed=2)
    mask = torch.ones_like(ids)
    ids[0, :3] = 0
    mask[0, :3] = 0
    return ids, mask


@torch.no_grad()
def _static_logits(model, impl, ids, mask, steps=6):
    """Logits [B, S + steps, V] of a prefill + greedy decode steps through a StaticCache, under ``impl``."""
    from transformers import StaticCache

    model.set_attn_implementation(impl)
    cache = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=32)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(ids, attention_mask=mask, position_ids=pos, **compat.cache_arg(cache))
    logits, tok, am = [out.logits], out.logits[:, -1:].argmax(-1), mask
    for _ in range(steps):
        am = torch.cat([am, torch.ones_like(tok)], 1)
        out = model(tok, attention_mask=am, position_ids=(am.cumsum(-1) - 1)[:, -1:], **compat.cache_arg(cache))
        logits.append(out.logits)
        tok = out.logits[:, -1:].argmax(-1)
    return torch.cat(logits, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_families_match_hf_sdpa(family, monkeypatch):
    packed = []
    hf_handles = A._hf_handles
    monkeypatch.setattr(A, "_hf_handles", lambda *a: hf_handles(*a) or packed.append(1))
    model = build_tiny_model(family)
    try:
        ktinject.inject(model, gpu="cpu")
        for m in model.modules():  # this test is about ktinject_sdpa: decode steps through HF's module forward
            decode_attention.uninstall(m)
        impl = model.config._attn_implementation
        assert impl == ("eager" if family == "gpt_oss" else A.KTINJECT_SDPA)
        if impl != A.KTINJECT_SDPA:
            return
        ids, mask = _left_padded()
        ours = _static_logits(model, A.KTINJECT_SDPA, ids, mask)
        groups = model.config.num_attention_heads // getattr(model.config, "num_key_value_heads", 0)
        assert len(packed) == (6 * model.config.num_hidden_layers if groups > 1 else 0)  # decode steps packed
        hf = _static_logits(model, "sdpa", ids, mask)
        keep = torch.ones(ours.shape[:2], dtype=torch.bool)
        keep[0, :3] = False  # logits at padding positions are not defined
        torch.testing.assert_close(ours[keep], hf[keep], atol=2e-5, rtol=1e-5)
        # greedy tokens through ktinject.generate (static cache), batch with left padding
        kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
        model.set_attn_implementation("sdpa")
        ref = ktinject.generate(model, ids, **kw)
        model.set_attn_implementation(A.KTINJECT_SDPA)
        assert torch.equal(ktinject.generate(model, ids, **kw), ref)
    finally:
        disable(model)
