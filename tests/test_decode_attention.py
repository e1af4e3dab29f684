"""The decode-step attention forward (operators/decode_attention.py) against the unmodified HF modules.

Whole tiny models of every family: one copy keeps HF's attention, the other gets the decode forward on every
attention module it supports; logits of a left-padded batch through a static cache (prefill, then decode steps)
and of a single prompt through a dynamic cache must agree (float32: to float rounding; bf16: each no further from
the float32 result than HF bf16 is, with slack for one rounding)."""
from __future__ import annotations

import copy

import pytest
import torch

from ktinject.operators import decode_attention as DA
from ktinject.testing import FAMILIES, build_tiny_model, tiny_prompts


def _attention_modules(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


@pytest.fixture
def fast_calls(monkeypatch):
    """Counts of decode-forward calls that took the fast path / fell back to HF's forward."""
    calls = {"fast": 0, "hf": 0}
    orig = DA._fallback_reason

    def counted(*a):
        r = orig(*a)
        calls["hf" if r else "fast"] += 1
        return r
    monkeypatch.setattr(DA, "_fallback_reason", counted)
    return calls


_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu,
                                    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


def _pair(family, dtype=torch.float32, device="cpu"):
    ref = build_tiny_model(family, dtype=dtype).to(device)
    fast = copy.deepcopy(ref)
    installed = [DA.install(m) for m in _attention_modules(fast)]
    return ref, fast, installed


@torch.no_grad()
def _logits(model, ids, mask, cache_kind="static", steps=5):
    from transformers import DynamicCache, StaticCache

    cfg = model.config.get_text_config(decoder=True)
    cache = StaticCache(config=cfg, max_cache_len=40) if cache_kind == "static" else DynamicCache(config=cfg)
    ids, mask = ids.to(model.device), mask.to(model.device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
    logits, tok, am = [out.logits], out.logits[:, -1:].argmax(-1), mask
    for _ in range(steps):
        am = torch.cat([am, torch.ones_like(tok)], 1)
        out = model(tok, attention_mask=am, position_ids=(am.cumsum(-1) - 1)[:, -1:], past_key_values=cache)
        logits.append(out.logits)
        tok = out.logits[:, -1:].argmax(-1)
    return torch.cat(logits, 1).float().cpu()


def _left_padded(seed=3):
    ids = tiny_prompts(2, 9, seed=seed)
    mask = torch.ones_like(ids)
    ids[1, :4] = 0
    mask[1, :4] = 0
    keep = torch.ones(2, 9 + 5, dtype=torch.bool)
    keep[1, :4] = False  # logits at padding positions are not defined
    return ids, mask, keep


def _rotary_is_full(model) -> bool:
    cfg = model.config
    factor = getattr(cfg, "partial_rotary_factor", None) or (getattr(cfg, "rope_parameters", None) or {}).get(
        "partial_rotary_factor", 1.0)
    return float(factor or 1.0) == 1.0


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_equals_hf(family, fast_calls):
    ref, fast, installed = _pair(family)
    supported = {type(m).__name__ for m in _attention_modules(ref)} <= DA.SUPPORTED
    assert all(installed) == supported and (any(installed) == supported)
    ids, mask, keep = _left_padded()
    for kind in ("static", "dynamic"):
        a, b = _logits(ref, ids, mask, kind), _logits(fast, ids, mask, kind)
        torch.testing.assert_close(b[keep], a[keep], atol=3e-5, rtol=1e-5)
    layers = fast.config.num_hidden_layers
    if supported and _rotary_is_full(fast):
        assert fast_calls["fast"] == 2 * 5 * layers  # every decode step of every layer, both caches
    else:
        assert fast_calls["fast"] == 0  # GLM partial rotary, MLA, sinks: HF's forward throughout


@pytest.mark.parametrize("device", ["cpu", _CUDA])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_bf16_no_worse_than_hf(family, device, fast_calls):
    """bf16 logits against the float32 model with the same (bf16-rounded) weights: within HF bf16's error (on
    CUDA the scores come from bmm with a float32 output, on the CPU from float32 copies)."""
    ref16, fast16, _ = _pair(family, torch.bfloat16, device)
    truth = copy.deepcopy(ref16).float()
    ids, mask, keep = _left_padded(seed=5)
    t = _logits(truth, ids, mask)
    err_hf = (_logits(ref16, ids, mask) - t)[keep].abs()
    err_fast = (_logits(fast16, ids, mask) - t)[keep].abs()
    assert fast_calls["fast"] > 0
    assert float(err_fast.mean()) <= 1.2 * float(err_hf.mean()) + 1e-3, (float(err_fast.mean()), float(err_hf.mean()))
    assert float(err_fast.max()) <= 2.0 * float(err_hf.max()) + 1e-2


def test_weight_change_is_seen_and_uninstall(fast_calls):
    ref, fast, _ = _pair("qwen3_moe")
    ids, mask, keep = _left_padded()
    _logits(fast, ids, mask)
    with torch.no_grad():
        for m in (ref, fast):  # the same in-place change to a projection and a q norm of every layer
            for att in _attention_modules(m):
                att.k_proj.weight.mul_(1.5)
                att.q_norm.weight.add_(0.25)
    torch.testing.assert_close(_logits(fast, ids, mask)[keep], _logits(ref, ids, mask)[keep], atol=3e-5, rtol=1e-5)
    mods = _attention_modules(fast)
    for m in mods:
        DA.uninstall(m)
    assert not any(DA.installed(m) for m in mods) and "forward" not in mods[0].__dict__


def test_problems_are_named():
    ref = build_tiny_model("deepseek_v3")
    why = DA.problem(_attention_modules(ref)[0])
    assert "DeepseekV3Attention" in why and "Qwen3MoeAttention" in why
    q = _attention_modules(build_tiny_model("qwen3_moe"))[0]
    assert DA.problem(q) is None
    q.q_norm.variance_epsilon = 1e-3
    assert "q/k norms" in DA.problem(q)


def test_inject_installs_unless_asked_not_to():
    import ktinject

    m = build_tiny_model("qwen3_moe")
    ktinject.inject(m, gpu="cpu")
    assert all(DA.installed(a) for a in _attention_modules(m))
