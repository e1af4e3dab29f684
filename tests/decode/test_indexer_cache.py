"""DeepSeek Sparse Attention's lightning-indexer keys in ktinject's KVCache (DeepSeek-V3.2, GLM-5): each layer keeps
them per row beside K/V (``update_indexer``: written at the positions ``update`` has just written, at a fixed
address a CUDA graph replays), so these models decode through ktinject's path. Greedy tokens of
``ktinject.generate`` equal HF's generate for prompts longer than the indexer's top-k (so it selects), with
left-padded rows; the serving engine's mixed rows equal each request alone; ``copy_row`` copies the indexer keys;
a prefix cache's blocks carry the indexer keys beside K/V: a hit restores them, and the greedy tokens with a hit
(RAM and disk tiers, a follow-up turn) equal those without."""
from __future__ import annotations

import pytest
import torch

import ktinject
from ktinject.decode import kv_cache
from ktinject.decode.generate import disable, get_runner
from ktinject.decode.prefix_cache import uncacheable_reason
from ktinject.tiny_models import build_tiny_model, missing_reason, tiny_prompts

from tests.references import assert_starts_as_hf_generate, engine_alone_and_together

FAMILIES = ("deepseek_v32", "glm_moe_dsa")


def _model(family):
    """The family's tiny model with 16 indexer heads: a key's score is a sum over heads of ReLU'd products, so with
    the tiny config's 2 heads a quarter of the keys score exactly 0, and torch.topk breaks those ties by position
    differently over HF's T keys than over the cache's max_len (both choices are right; the tokens then differ)."""
    why = missing_reason(family)
    if why:
        pytest.skip(why)
    return build_tiny_model(family, index_n_heads=16)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_through_the_kv_cache_equals_hf_generate(family):
    model = _model(family)
    ktinject.inject(model, gpu="cpu")
    cfg = model.config.get_text_config(decoder=True)
    ids = tiny_prompts(2, 14, seed=6)
    assert ids.shape[1] > cfg.index_topk  # the indexer drops keys
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    try:
        assert get_runner(model).cache_for(2, 32) is not None
        ref = type(model).generate(model, ids, **kw)
        assert torch.equal(ktinject.generate(model, ids, **kw), ref)
    finally:
        disable(model)
    assert uncacheable_reason(model) is None  # the prefix cache carries the indexer keys


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_keep_their_own_indexer_keys_and_copy_them(family):
    model = _model(family)
    ktinject.inject(model, gpu="cpu")
    cache = kv_cache.new(model.config, 3, 24, torch.device("cpu"))
    ids = tiny_prompts(2, 9, seed=2)
    with torch.no_grad():
        kv_cache.forward(model, cache.rows(0, 2), ids)
    layers = [layer for layer in cache.kv_layers() if layer.indexer_buffer() is not None]
    assert layers and all(layer.indexer_buffer().shape[:2] == (3, 24) for layer in layers)
    keys = [layer.indexer_buffer()[:2, :9].clone() for layer in layers]
    assert all(k.abs().sum() > 0 and not torch.equal(k[0], k[1]) for k in keys)
    cache.copy_row(1, 2)
    for layer, k in zip(layers, keys):
        assert torch.equal(layer.indexer_buffer()[2, :9], k[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_serving_engine_s_mixed_rows_get_what_each_gets_alone(family):
    model = _model(family)
    ktinject.inject(model, gpu="cpu")
    prompts = [tiny_prompts(1, n, seed=n)[0].tolist() for n in (2, 7, 15)]
    alone, together = engine_alone_and_together(model, prompts, 6, max_batch=2, max_context=40, prefill_chunk=8)
    assert together == alone
    assert_starts_as_hf_generate(model, prompts, alone, 6)


@pytest.mark.parametrize("tier", ["ram", "disk"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefix_hit_restores_the_indexer_keys(family, tier, tmp_path):
    from ktinject.decode.prefix_cache import PrefixCache

    model = _model(family)
    ktinject.inject(model, gpu="cpu")
    block = 8
    store = PrefixCache(device="cpu", tier=tier, block_size=block, disk_path=tmp_path)
    ids = tiny_prompts(1, 27, seed=1)
    kw = dict(max_new_tokens=8, do_sample=False)
    plain = ktinject.generate(model, ids, **kw)
    first = ktinject.generate(model, ids, prefix_cache=store, **kw)
    second = ktinject.generate(model, ids, prefix_cache=store, **kw)
    assert torch.equal(first, plain) and torch.equal(second, plain)
    assert store.stats.hit_tokens == 3 * block, store.describe()
    follow = torch.cat([second, tiny_prompts(1, 5, seed=3)], dim=1)
    assert torch.equal(ktinject.generate(model, follow, prefix_cache=store, **kw), ktinject.generate(model, follow, **kw))
    assert store.stats.hit_tokens == 2 * 3 * block
    # the restored row holds the same indexer keys as the computed one
    hit = store.lookup(model, ids[0].tolist())
    restored, computed = kv_cache.new(model.config, 1, 40, "cpu"), kv_cache.new(model.config, 1, 40, "cpu")
    assert store.restore(hit, restored, 0) == 3 * block
    with torch.no_grad():
        kv_cache.forward(model, computed, ids[:, :3 * block])
    for a, b in zip(restored.export_index_keys(0, 0, 3 * block), computed.export_index_keys(0, 0, 3 * block)):
        assert a is not None and torch.equal(a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_serving_engine_s_prefix_cache_restores_the_indexer_keys(family):
    """A request that starts with an earlier one's whole blocks restores them, indexer keys included
    (cached_tokens), and gets the greedy tokens of the cache off."""
    from ktinject.decode.prefix_cache import PrefixCache
    from ktinject.serve.engine import Engine, EngineConfig
    from ktinject.serve.sampling import SamplingParams

    model = _model(family)
    ktinject.inject(model, gpu="cpu")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    a = tiny_prompts(1, 16, seed=7)[0].tolist()
    b = a + tiny_prompts(1, 5, seed=8)[0].tolist()
    config = dict(max_batch=2, max_context=48, prefill_chunk=8)
    with Engine(model, None, EngineConfig(**config)) as engine:
        plain = [engine.generate(p, greedy, timeout=300).token_ids for p in (a, b)]
    store = PrefixCache(device="cpu", tier="ram", block_size=8)
    with Engine(model, None, EngineConfig(**config, prefix_cache=store)) as engine:
        cached = [engine.generate(p, greedy, timeout=300) for p in (a, b)]
    assert [r.token_ids for r in cached] == plain
    assert [r.cached_tokens for r in cached] == [0, 16], store.describe()
