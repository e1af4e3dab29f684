"""The decode-step attention forward (decode/attention.py) against the unmodified HF modules.

Whole tiny models of every family: one copy keeps HF's attention, the other gets the decode forward on every
attention module it supports; logits of a left-padded batch through a static cache (prefill, then decode steps)
and of a single prompt through a dynamic cache must agree (float32: to float rounding; bf16: each no further from
the float32 result than HF bf16 is, with slack for one rounding)."""
from __future__ import annotations

import copy

import pytest
import torch

import ktinject
from ktinject import compat
from ktinject.decode import attention as DA
from ktinject.tiny_models import FAMILIES, build_tiny_model, tiny_prompts


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
def _logits(model, ids, mask, cache_kind="static", steps=5, forced=None):
    """Logits of a prefill and ``steps`` decode steps (greedy, or the tokens ``forced`` [B, steps])."""
    from transformers import DynamicCache, StaticCache

    cfg = model.config.get_text_config(decoder=True)
    cache = StaticCache(config=cfg, max_cache_len=40) if cache_kind == "static" else DynamicCache(config=cfg)
    ids, mask = ids.to(model.device), mask.to(model.device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(ids, attention_mask=mask, position_ids=pos, **compat.cache_arg(cache))
    logits, am = [out.logits], mask
    for i in range(steps):
        tok = logits[-1][:, -1:].argmax(-1) if forced is None else forced[:, i:i + 1].to(ids.device)
        am = torch.cat([am, torch.ones_like(tok)], 1)
        out = model(tok, attention_mask=am, position_ids=(am.cumsum(-1) - 1)[:, -1:], **compat.cache_arg(cache))
        logits.append(out.logits)
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
    """bf16 logits against the float32 model with the same (bf16-rounded) weights, all fed the float32 model's
    greedy tokens: within HF bf16's error (on CUDA the scores come from bmm with a float32 output, on the CPU from
    float32 copies)."""
    ref16, fast16, _ = _pair(family, torch.bfloat16, device)
    truth = copy.deepcopy(ref16).float()
    ids, mask, keep = _left_padded(seed=5)
    t = _logits(truth, ids, mask)
    forced = t[:, -6:-1].argmax(-1)  # the truth's greedy token after the prompt and after each decode step
    torch.testing.assert_close(_logits(truth, ids, mask, forced=forced), t)
    err_hf = (_logits(ref16, ids, mask, forced=forced) - t)[keep].abs()
    err_fast = (_logits(fast16, ids, mask, forced=forced) - t)[keep].abs()
    assert fast_calls["fast"] > 0
    # per position (the median: one routing near-tie flipped by a last-bit difference moves a single position's
    # logits by far more than rounding does, on either side)
    med_fast, med_hf = float(err_fast.mean(-1).median()), float(err_hf.mean(-1).median())
    assert med_fast <= 1.2 * med_hf + 1e-3, (med_fast, med_hf)


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


def test_inject_installs():
    import ktinject

    m = build_tiny_model("qwen3_moe")
    ktinject.inject(m, gpu="cpu")
    assert all(DA.installed(a) for a in _attention_modules(m))


def test_projections_share_one_buffer_and_replaced_parameters_are_joined_again(fast_calls):
    ref, fast, _ = _pair("qwen2_moe")  # q/k/v biases
    ids, mask, keep = _left_padded()
    _logits(fast, ids, mask)
    att = _attention_modules(fast)[0]
    st = att.__dict__[DA._STATE]
    assert att.q_proj.weight.data_ptr() == st["w"].data_ptr() and att.v_proj.bias.data_ptr() != 0
    assert DA._views_of(st["w"], [att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
    assert DA._views_of(st["b"], [att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])
    new = {k: v * 1.25 for k, v in ref.state_dict().items() if "self_attn" in k}
    for m in (ref, fast):  # assign: new parameter objects, no longer views of the joined buffer
        m.load_state_dict(new, strict=False, assign=True)
    torch.testing.assert_close(_logits(fast, ids, mask)[keep], _logits(ref, ids, mask)[keep], atol=3e-5, rtol=1e-5)
    assert DA._views_of(att.__dict__[DA._STATE]["w"], [att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])


def test_hooks_grad_and_no_mask_fall_back_or_agree(fast_calls):
    ref, fast, _ = _pair("qwen3_moe")
    ids, mask, keep = _left_padded()
    atts = _attention_modules(fast)
    handle = atts[0].q_proj.register_forward_hook(lambda mod, args, out: out * 2)
    ref_handle = _attention_modules(ref)[0].q_proj.register_forward_hook(lambda mod, args, out: out * 2)
    torch.testing.assert_close(_logits(fast, ids, mask)[keep], _logits(ref, ids, mask)[keep], atol=3e-5, rtol=1e-5)
    # the hooked layer's decode steps: HF's forward (prefill is HF's forward too, not counted as a fallback)
    assert fast_calls["hf"] == 5 and fast_calls["fast"] == 5 * (len(atts) - 1)
    handle.remove(), ref_handle.remove()
    x = torch.randn(1, 1, fast.config.hidden_size)
    with torch.enable_grad():  # autograd through the projections: HF's forward, gradients reach the weights
        fast_calls.update(fast=0, hf=0)
        for p in (atts[0].q_proj, atts[0].k_proj, atts[0].v_proj):
            p.weight.requires_grad_(True)
        from transformers import DynamicCache

        cos_sin = fast.model.rotary_emb(x, torch.zeros(1, 1, dtype=torch.long))
        out, _ = atts[0](x, position_embeddings=cos_sin, attention_mask=None,
                         **compat.cache_arg(DynamicCache(config=fast.config)))
        out.sum().backward()
        assert fast_calls == {"fast": 0, "hf": 1} and atts[0].q_proj.weight.grad is not None
    one = tiny_prompts(1, 7, seed=9)  # no padding, dynamic cache: the mask may be None
    a = _logits(ref, one, torch.ones_like(one), "dynamic")
    torch.testing.assert_close(_logits(fast, one, torch.ones_like(one), "dynamic"), a, atol=3e-5, rtol=1e-5)


def test_float_masks_of_eager_attention(fast_calls):
    ref, fast, _ = _pair("mixtral")
    for m in (ref, fast):
        m.set_attn_implementation("eager")
    ids, mask, keep = _left_padded()
    torch.testing.assert_close(_logits(fast, ids, mask)[keep], _logits(ref, ids, mask)[keep], atol=3e-5, rtol=1e-5)
    assert fast_calls["fast"] == 5 * fast.config.num_hidden_layers


def test_inference_mode():
    with torch.inference_mode():
        ref, fast, _ = _pair("qwen3_moe")
        ids, mask, keep = _left_padded()
        torch.testing.assert_close(_logits(fast, ids, mask)[keep], _logits(ref, ids, mask)[keep], atol=3e-5,
                                   rtol=1e-5)


def test_operator_kwarg(tmp_path):
    from ktinject.operators.attention import AttentionOperator
    from ktinject.operators.base import OperatorError

    att = _attention_modules(build_tiny_model("qwen3_moe"))[0]
    with pytest.raises(OperatorError, match="fast_decode"):
        AttentionOperator.check(att, "model.layers.0.self_attn", {"fast_decode": "yes"})
    assert not DA.installed(AttentionOperator.build(att, "x", {}, torch.device("cpu")))  # the operator alone: HF's
    on = build_tiny_model("qwen3_moe")
    ktinject.inject(on, gpu="cpu")  # injection installs the decode forward (apply.finish), unless the rule says no
    assert all(DA.installed(m) for m in _attention_modules(on))
    rules = tmp_path / "no_fast_decode.yaml"
    rules.write_text("- match: {name: 'model\\.layers\\.\\d+\\.self_attn'}\n  replace: attention\n  device: gpu\n"
                     "  kwargs: {fast_decode: false}\n- match: {class: Qwen3MoeSparseMoeBlock}\n  replace: moe\n"
                     "  device: gpu\n- match: {name: ''}\n  device: gpu\n")
    off = build_tiny_model("qwen3_moe")
    ktinject.inject(off, str(rules), gpu="cpu")
    assert not any(DA.installed(m) for m in _attention_modules(off))

# The Triton kernels of the decode forward are checked against float64 and these torch ops in test_fused_kernels.py.
