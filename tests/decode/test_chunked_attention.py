"""Llama 4's chunked-attention layers through ktinject's KVCache: ``kv_cache.attention_masks`` builds their mask
(a key is seen only from the query's own chunk of ``attention_chunk_size`` positions, counted from the row's first
real token) so the model decodes through ktinject's path (CUDA graphs where there is a GPU). Checked against Hugging
Face's ``create_chunked_causal_mask`` as a table, and end to end: greedy tokens of ``ktinject.generate`` equal HF's
generate on the tiny Llama 4 (chunks of 8) for prompts that cross chunk boundaries, left-padded rows beside full
ones."""
from __future__ import annotations

import pytest
import torch

import ktinject
from ktinject import compat
from ktinject.decode import kv_cache
from ktinject.decode.generate import disable, get_runner
from ktinject.tiny_models import build_tiny_model, missing_reason, tiny_prompts

from tests.references import assert_starts_as_hf_generate, engine_alone_and_together


def _model():
    why = missing_reason("llama4")
    if why:
        pytest.skip(why)
    return build_tiny_model("llama4")


def test_the_chunked_mask_is_hugging_faces():
    from transformers.masking_utils import create_chunked_causal_mask

    model = _model()
    cfg = model.config.get_text_config(decoder=True)
    size = cfg.attention_chunk_size
    assert "chunked_attention" in cfg.layer_types and size == 8
    B, L = 3, 21
    pad = torch.ones(B, L, dtype=torch.long)
    pad[1, :5] = 0  # a left-padded row
    pad[2, :1] = 0
    emb = torch.zeros(B, L, cfg.hidden_size)
    want = create_chunked_causal_mask(config=cfg, inputs_embeds=emb, attention_mask=pad,
                                      **{compat.cache_kwarg(): None},
                                      position_ids=torch.arange(L)[None].expand(B, L))
    got = kv_cache.attention_masks(cfg, torch.zeros(B, dtype=torch.long), L, L, pad)["chunked_attention"]
    assert want.dtype == torch.bool and got.shape == want.shape
    real = pad.bool()[:, None, :, None].expand_as(got)  # rows of padded queries: HF's and ours may differ there
    assert torch.equal(got[real], want[real])
    # one decode step at position 16 of row 0 sees keys 16.. only; row 1 (5 pads) sees keys 13..16
    step = kv_cache.attention_masks(cfg, torch.tensor([16, 16, 16]), 1, 17, pad[:, :17])["chunked_attention"]
    assert step[0, 0, 0].nonzero().flatten().tolist() == [16]
    assert step[1, 0, 0].nonzero().flatten().tolist() == [13, 14, 15, 16]


@pytest.mark.parametrize("quant", ["bf16", "int8"])
def test_generate_through_the_kv_cache_equals_hf_generate(quant):
    model = _model()
    ktinject.inject(model, gpu="cpu", quant=quant)
    ids = tiny_prompts(2, 13, seed=5)
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0  # left padding: the row's chunks start at its first real token
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    try:
        assert get_runner(model).cache_for(2, 32) is not None  # ktinject's KVCache takes the model
        ref = type(model).generate(model, ids, **kw)
        assert torch.equal(ktinject.generate(model, ids, **kw), ref)
    finally:
        disable(model)


def test_the_serving_engine_s_mixed_rows_get_what_each_gets_alone():
    """Rows at different positions in one step (chunked prefills of 8, rows reused): each request's greedy tokens
    are those it gets alone and HF's generate's."""
    model = _model()
    ktinject.inject(model, gpu="cpu")
    prompts = [tiny_prompts(1, n, seed=n)[0].tolist() for n in (1, 6, 13, 19)]
    alone, together = engine_alone_and_together(model, prompts, 7, max_batch=3, max_context=48, prefill_chunk=8)
    assert together == alone
    assert_starts_as_hf_generate(model, prompts, alone, 7)
