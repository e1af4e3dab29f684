"""ktinject.decode.kv_cache: rows at different positions in one forward give each row's tokens decoded alone.

Reference: the plain HF model, each prompt alone with a DynamicCache, greedy. Ours: every prompt prefilled into its
own row (``rows(b, b + 1)``), then batched decode steps of all rows together while their lengths differ: for every
family, sliding windows shorter than the sequences (gpt-oss, Mixtral), MLA (DeepSeek), eager and SDPA attention,
and an injected model whose decode attention takes the fast path. GPU graphs of the same: tests/decode/test_kv_cache_gpu.py."""
from __future__ import annotations

import pytest
import torch

import ktinject
from ktinject import compat
from ktinject.decode import kv_cache
from ktinject.tiny_models import FAMILIES, build_tiny_model, tiny_prompts

LENGTHS = (3, 7, 5)
STEPS = 6
WINDOW = {"gpt_oss": 4, "mixtral": 4}  # sliding windows shorter than the rows: the mask must carry them


def _model(family, impl=None):
    m = build_tiny_model(family, dtype=torch.float32, **({"sliding_window": WINDOW[family]}
                                                           if family in WINDOW else {})).eval()
    if impl:
        m.set_attn_implementation(impl)
    return m


def _prompts():
    return [tiny_prompts(1, n, seed=10 + i) for i, n in enumerate(LENGTHS)]


@torch.no_grad()
def _alone(model, prompt):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(prompt, use_cache=True, **compat.cache_arg(cache))
    tokens = []
    for _ in range(STEPS):
        tok = out.logits[:, -1:].argmax(-1)
        tokens.append(int(tok))
        out = model(tok, use_cache=True, **compat.cache_arg(cache))
    return tokens


@torch.no_grad()
def _rows(model, prompts, slots=4):
    cache = kv_cache.new(model.config, slots, 32, "cpu")
    first = [kv_cache.forward(model, cache.rows(b, b + 1), p).logits[:, -1:].argmax(-1) for b, p in enumerate(prompts)]
    tok = torch.cat(first)  # [B, 1]
    got = [[int(t)] for t in tok[:, 0]]
    rows = cache.rows(0, len(prompts))
    for _ in range(STEPS - 1):
        tok = kv_cache.forward(model, rows, tok).logits[:, -1:].argmax(-1)
        for b, t in enumerate(tok[:, 0]):
            got[b].append(int(t))
    return got, cache


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_at_different_positions_equal_each_row_alone(family):
    model = _model(family, "eager" if family == "gpt_oss" else "sdpa")
    prompts = _prompts()
    got, cache = _rows(model, prompts)
    assert got == [_alone(model, p) for p in prompts]
    assert cache.row_lengths.tolist() == [n + STEPS - 1 for n in LENGTHS] + [0]  # the fourth slot untouched


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_eager_attention_takes_additive_masks(family):
    model = _model(family, "eager")
    prompts = _prompts()
    assert _rows(model, prompts)[0] == [_alone(model, p) for p in prompts]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_injected_model_with_fast_decode_attention(family):
    ref = _model(family)
    model = _model(family)
    ktinject.inject(model, gpu="cpu")
    prompts = _prompts()
    got = _rows(model, prompts)[0]
    assert got == [_alone(ref, p) for p in prompts]
    st = ktinject.info(model)["fast_paths"]["decode_attention"]
    assert st["active"] is True and st["fallback_calls"] == 0, st


def test_row_operations():
    model = _model("qwen3_moe")
    prompts = _prompts()
    cache = kv_cache.new(model.config, 4, 32, "cpu")
    with torch.no_grad():
        for b, p in enumerate(prompts):
            kv_cache.forward(model, cache.rows(b, b + 1), p)
    assert cache.row_lengths.tolist() == [3, 7, 5, 0]
    saved = cache.export_row(1)
    assert len(saved) == model.config.num_hidden_layers and saved[0][0].shape[1] == 7
    cache.copy_row(1, 3)
    assert cache.row_lengths.tolist() == [3, 7, 5, 7]
    assert torch.equal(cache.layers[0].keys[3, :, :7], cache.layers[0].keys[1, :, :7])
    cache.reset_rows([1, 3])
    assert cache.row_lengths.tolist() == [3, 0, 5, 0] and cache.lengths[:, 1].eq(0).all()
    cache.import_row(2, saved)  # row 2 now holds prompt 1's K/V
    assert cache.lengths[:, 2].eq(7).all()
    with torch.no_grad():  # decoding row 2 now continues prompt 1
        nxt = kv_cache.forward(model, cache.rows(2, 3), torch.tensor([[5]])).logits
        ref = kv_cache.forward(model, _fresh(model, prompts[1]).rows(0, 1), torch.tensor([[5]])).logits
    torch.testing.assert_close(nxt, ref)
    view = cache.rows(1, 3)
    view.reset()
    assert cache.row_lengths.tolist() == [3, 0, 0, 0]
    with pytest.raises(IndexError, match="rows"):
        cache.rows(2, 5)
    with pytest.raises(ValueError, match="layers"):
        cache.import_row(0, saved[:1])


def test_a_view_made_before_its_cache_held_storage_reads_it_later():
    """A view of rows taken from an empty cache, then a forward through another view of those rows: the first view
    sees the written K/V (the prefix cache exports a row through such a view)."""
    model = _model("qwen3_moe")
    prompt = _prompts()[1]
    cache = kv_cache.new(model.config, 2, 32, "cpu")
    early = cache.rows(0, 2)
    with torch.no_grad():
        kv_cache.forward(model, early.rows(0, 1), prompt)
    assert early.initialized
    (k, v), ref = early.export_row(0)[0], _fresh(model, prompt).export_row(0)[0]
    assert torch.equal(k, ref[0]) and torch.equal(v, ref[1])
    early.copy_row(0, 1)
    assert torch.equal(cache.layers[0].keys[1, :, :7], cache.layers[0].keys[0, :, :7])


def _fresh(model, prompt):
    cache = kv_cache.new(model.config, 1, 32, "cpu")
    kv_cache.forward(model, cache, prompt)
    return cache


def test_mask_layout_and_padding():
    cfg = _model("gpt_oss").config
    takes_dict, full, sliding = kv_cache.mask_layout(cfg)
    assert takes_dict and full is None and sliding == 4
    m = kv_cache.attention_masks(cfg, torch.tensor([2, 6]), 2, 10, pad2d=torch.tensor([[0, 1, 1], [1, 1, 1]]))
    full_m, slide_m = m["full_attention"], m["sliding_attention"]
    assert full_m.shape == (2, 1, 2, 10) and full_m.dtype == torch.bool
    assert full_m[0, 0, 0].tolist() == [False, True, True] + [False] * 7  # pad at 0, query at position 2
    assert full_m[1, 0, 1].tolist() == [True] * 8 + [False] * 2  # query at position 7 sees 0..7
    assert slide_m[1, 0, 1].tolist() == [False] * 4 + [True] * 4 + [False] * 2  # window 4: positions 4..7
    f = kv_cache.attention_masks(_model("qwen3_moe").config, torch.tensor([1]), 1, 4, float_dtype=torch.float32)
    assert f.dtype == torch.float32 and f[0, 0, 0, :2].eq(0).all() and (f[0, 0, 0, 2:] < -1e30).all()
