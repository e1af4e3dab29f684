"""Families whose layers keep state ktinject's KVCache does not hold (DSA indexers, chunked attention): their decode
steps run eagerly through Hugging Face's generate and cache, and the plan, the inject log line and the fast-path
report say so by name. The other families, the hybrid linear-attention ones among them (their states are in the
KVCache: test_linear_attention_state.py), keep the graph path; an image-text wrapper's decoder layers are its
language model's, not its vision tower's."""
from __future__ import annotations

import logging

import pytest
import torch

import ktinject
from ktinject.decode.generate import disable, get_runner
from ktinject.decode.graph_capture import decoder_layers
from ktinject.decode.stateful_layers import eager_decode_reason
from ktinject.tiny_models import build_tiny_model, missing_reason, tiny_prompts

STATEFUL = {"deepseek_v4": "DeepseekV4Attention"}


def _tiny(family: str, **kw):
    why = missing_reason(family)
    if why:
        pytest.skip(why)
    return build_tiny_model(family, **kw)


@pytest.mark.parametrize("family", sorted(STATEFUL))
def test_plan_report_and_log_name_the_eager_decode(family, caplog):
    model = _tiny(family)
    p = ktinject.plan(model, gpu="cpu")
    assert STATEFUL[family] in p.eager_decode and "decode: eager" in str(p)
    with caplog.at_level(logging.INFO, logger="ktinject"):
        ktinject.inject(model, gpu="cpu")
    assert any(STATEFUL[family] in r.getMessage() for r in caplog.records)
    graph = ktinject.info(model)["fast_paths"]["graph_decode"]
    assert graph["active"] is False and STATEFUL[family] in graph["reason"]


@pytest.mark.parametrize("family", sorted(STATEFUL))
def test_generate_runs_hf_generate_and_cache(family):
    """ktinject.generate hands these models to HF's generate (HF's cache holds their state): the same tokens; the
    KVCache refuses them by name."""
    model = _tiny(family)
    ktinject.inject(model, gpu="cpu")
    ids = tiny_prompts(2, 9, seed=5)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    try:
        ref = type(model).generate(model, ids, **kw)
        assert torch.equal(ktinject.generate(model, ids, **kw), ref)
        with pytest.raises(ValueError, match=STATEFUL[family]):
            get_runner(model).cache_for(2, 32)
    finally:
        disable(model)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "kimi_k25", "minimax_m2", "qwen3_next",
                                    "qwen3_5_moe", "llama4", "deepseek_v32", "glm_moe_dsa"])
def test_other_families_keep_the_graph_path(family):
    model = _tiny(family)
    assert eager_decode_reason(model) is None
    assert ktinject.plan(model, gpu="cpu").eager_decode is None


def test_wrapper_decoder_layers_are_the_language_models():
    model = _tiny("kimi_k25")
    text_layers = list(model.model.language_model.layers)
    assert len(model.model.vision_tower.layers) > 1  # a vision ModuleList named layers comes first
    assert decoder_layers(model) == text_layers
