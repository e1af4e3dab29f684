"""The transformers compatibility layer (ktinject.compat) and the fast-path report (ktinject.operators.fast_path_report), on the
installed transformers release: CI runs this file on the newest release and on the lowest declared one.

Every family's decode goes through ktinject with no FutureWarning / DeprecationWarning raised from transformers'
moved interfaces, and the fast paths that cover the family are reported active (counters), the others inactive with
a reason, with no fallback warning."""
from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import pytest
import torch

import ktinject
from ktinject import compat
from ktinject.operators import fast_path_report as fastpaths
from ktinject.tiny_models import FAMILIES, build_tiny_model, tiny_prompts

# families whose attention class takes the one-token decode forward with full rotary (decode/attention.py)
DECODE_ATTENTION = {"qwen3_moe", "qwen2_moe", "mixtral"}
# families whose tiny router is softmax -> top-k -> renormalize (operators/routing.py, _SOFTMAX_TOPK_ROUTERS)
FAST_ROUTER = {"qwen3_moe", "mixtral"}  # Qwen2-MoE, OLMoE: only with norm_topk_prob (off in their tiny configs)


def test_version_and_cache_name_agree_with_the_installed_release():
    import inspect

    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    params = inspect.signature(m.Qwen3MoeAttention.forward).parameters
    assert compat.cache_kwarg() in params  # the name the attention modules take
    assert compat.LOWEST <= compat.transformers_version()
    assert compat.cache_from({compat.cache_kwarg(): 1}) == 1
    assert compat.cache_from({"past_key_values": 2}) == 2 and compat.cache_from({}) is None


def test_pyproject_range_is_the_tested_range():
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    lo, hi = compat.LOWEST, compat.NEWEST
    assert f'"transformers>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}"' in text, \
        "pyproject.toml's transformers range must be exactly compat.LOWEST .. the minor release after compat.NEWEST"
    assert compat.untested_release() is None or compat.transformers_version() > hi


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_runs_the_fast_paths_without_deprecation_warnings(family, caplog):
    model = build_tiny_model(family, dtype=torch.float32)
    ktinject.inject(model, gpu="cpu")
    prompt = tiny_prompts(2, 6, seed=3)
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.WARNING, logger="ktinject"):
        warnings.simplefilter("always")
        out = ktinject.generate(model, prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                                do_sample=False)
        out2 = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    moved = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in seen
             if issubclass(w.category, (FutureWarning, DeprecationWarning))
             and re.search(r"deprecat|renamed|will be removed", str(w.message), re.I)]
    assert not moved, moved
    assert out.shape == out2.shape == (2, 10) and torch.equal(out, out2)  # static and dynamic caches agree
    assert not [r.getMessage() for r in caplog.records if "fell back" in r.getMessage()]
    paths = ktinject.info(model)["fast_paths"]
    da, router, graph = paths["decode_attention"], paths["fast_router"], paths["graph_decode"]
    if family in DECODE_ATTENTION:
        assert da["active"] is True and da["fast_calls"] == 2 * 3 * model.config.num_hidden_layers, da
        assert da["fallback_calls"] == 0
    else:
        assert da["active"] is False and da["reason"], da
    if family in FAST_ROUTER:
        assert router["active"] is True and router["fallback_calls"] == 0, router
    else:
        assert router["active"] is False and "not a softmax" in router["reason"], router
    assert graph["active"] is False and "graphs need CUDA" in graph["reason"], graph  # CPU: eager by design


def test_an_unknown_cache_name_warns_once_per_model(caplog):
    """A cache under a name compat does not know (a future rename) is reported, not silently run slow."""
    from transformers import DynamicCache

    model = build_tiny_model("qwen3_moe", dtype=torch.float32)
    ktinject.inject(model, gpu="cpu")
    att = model.model.layers[0].self_attn
    x = torch.randn(1, 1, model.config.hidden_size)
    cos_sin = model.model.rotary_emb(x, torch.zeros(1, 1, dtype=torch.long))
    fwd = att.__dict__["_ktinject_hf_forward"]  # HF's forward, as if it took the cache under a new name
    att.__dict__["_ktinject_hf_forward"] = lambda *a, kv_store=None, **k: fwd(*a, **k, **compat.cache_arg(kv_store))
    with caplog.at_level(logging.WARNING, logger="ktinject"):
        for _ in range(3):
            att(x, position_embeddings=cos_sin, attention_mask=None, kv_store=DynamicCache(config=model.config))
    warned = [r.getMessage() for r in caplog.records if "fell back" in r.getMessage()]
    assert len(warned) == 1 and "decode_attention" in warned[0] and "'kv_store'" in warned[0], warned
    st = ktinject.info(model)["fast_paths"]["decode_attention"]
    assert st["active"] is False and st["fallback_calls"] == 3


def test_report_outside_a_model_and_info_errors():
    report = fastpaths.FastPaths("m")
    report.ran("graph_decode")
    report.fell_back("fast_router", "hooks", expected=True)
    d = report.as_dict()
    assert d["graph_decode"]["active"] is True and d["fast_router"] == {
        "active": False, "reason": "hooks", "fast_calls": 0, "fallback_calls": 1}
    assert d["decode_attention"]["active"] is None
    with pytest.raises(ValueError, match="not injected"):
        ktinject.info(torch.nn.Linear(2, 2))
    assert ktinject.info()["transformers_tested"] == compat.supported_range()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_cuda_generate_replays_graphs_and_reports_them(family, caplog):
    from ktinject.decode.generate import get_runner

    model = build_tiny_model(family, dtype=torch.bfloat16)
    ktinject.inject(model, gpu="cuda")
    prompt = tiny_prompts(2, 6, seed=3).cuda()
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.WARNING, logger="ktinject"):
        warnings.simplefilter("always")
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    assert not [w for w in seen if issubclass(w.category, (FutureWarning, DeprecationWarning))
                and re.search(r"deprecat|renamed|will be removed", str(w.message), re.I)]
    assert not [r.getMessage() for r in caplog.records if "fell back" in r.getMessage()]
    runner = get_runner(model)
    assert runner.stats.captures >= 1 and runner.stats.replays >= 8, runner.describe()
    paths = ktinject.info(model)["fast_paths"]
    assert paths["graph_decode"]["active"] is True and paths["graph_decode"]["fast_calls"] == runner.stats.replays
    if family in DECODE_ATTENTION:
        assert paths["decode_attention"]["active"] is True  # ran in the capture's warm-up steps
    eager = get_runner(model, use_graphs=False)
    ref = ktinject.generate(model, prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                            do_sample=False)
    assert eager.stats.replays == 0 and torch.equal(out, ref)


def test_the_chunked_mask_move_is_read_from_the_installed_release():
    """5.17's create_chunked_causal_mask cannot take the block_sequence_ids that create_masks_for_generate passes
    (ktinject builds Llama 4's masks there); 5.24's can."""
    works = compat.chunked_masks_for_generate_work()
    if compat.transformers_version() == (5, 17):
        assert not works
    if compat.transformers_version() >= (5, 24):
        assert works
    assert "deepseek_sparse_attention" in compat.DSA_LAYER_TYPES and "indexed_attention" in compat.DSA_LAYER_TYPES
