"""The prefix cache through ``ktinject.generate`` on the CPU: greedy tokens with a hit equal those without for every
tiny family (state-carrying layouts: no hit, and the reason said), a follow-up prompt restores its earlier turn,
the disk tier serves a new process's store, and a damaged disk block is recomputed, never used."""
from __future__ import annotations

import logging

import pytest
import torch

import ktinject
from ktinject.decode.prefix_cache import PrefixCache, uncacheable_reason
from ktinject.tiny_models import ALL_FAMILIES, build_tiny_model, missing_reason, tiny_prompts

BLOCK = 8


def _injected(family: str):
    why = missing_reason(family)
    if why:
        pytest.skip(why)
    m = build_tiny_model(family)
    ktinject.inject(m, gpu="cpu")
    return m


def _greedy(m, ids, **kw):
    return ktinject.generate(m, ids, max_new_tokens=8, do_sample=False, **kw)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_greedy_output_with_a_hit_equals_output_without(family, tmp_path, caplog):
    m = _injected(family)
    cache = PrefixCache(device="cpu", tier="disk", block_size=BLOCK, disk_path=tmp_path)
    ids = tiny_prompts(1, 27, seed=1)
    plain = _greedy(m, ids)
    caplog.set_level(logging.INFO, logger="ktinject.decode.generate")
    first = _greedy(m, ids, prefix_cache=cache)
    second = _greedy(m, ids, prefix_cache=cache)
    follow = torch.cat([second, tiny_prompts(1, 5, seed=3)], dim=1)
    with_hit = _greedy(m, follow, prefix_cache=cache)
    assert torch.equal(first, plain) and torch.equal(second, plain)
    assert torch.equal(with_hit, _greedy(m, follow))
    reason = uncacheable_reason(m)
    if reason is None:
        # the second call and the follow-up reuse the prompt's 3 whole blocks (the reply is not stored by default)
        assert cache.stats.hit_tokens == 2 * 3 * BLOCK, cache.describe()
    else:
        assert cache.stats.hit_tokens == 0 and "prefix cache off" in caplog.text
        assert "prefix cache off" in reason


def test_disk_tier_serves_a_restarted_store_and_rejects_a_damaged_block(tmp_path, caplog):
    m = _injected("qwen3_moe")
    ids = tiny_prompts(1, 33, seed=4)
    plain = _greedy(m, ids)
    _greedy(m, ids, prefix_cache=PrefixCache(device="cpu", tier="disk", block_size=BLOCK, disk_path=tmp_path))
    restarted = PrefixCache(device="cpu", tier="disk", block_size=BLOCK, disk_path=tmp_path)  # as a new process finds it
    assert torch.equal(_greedy(m, ids, prefix_cache=restarted), plain)
    assert restarted.stats.hits["disk"] == 4 and restarted.stats.hit_tokens == 4 * BLOCK
    again = PrefixCache(device="cpu", tier="disk", block_size=BLOCK, disk_path=tmp_path)
    third = again.keys(m, ids[0])[2]
    path = again.tiers.disk.file_of(third)
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit of the third block
    assert torch.equal(_greedy(m, ids, prefix_cache=again), plain)
    assert again.stats.hit_tokens == 2 * BLOCK and again.tiers.disk.stats.rejected == 1  # the rest recomputed
    assert "checksum mismatch" in caplog.text
    assert again.tiers.disk.get(third) is not None  # and stored again


def test_inject_keyword_attaches_the_store():
    m = build_tiny_model("deepseek_v3")
    cache = PrefixCache(device="cpu", tier="ram", block_size=4)
    ktinject.inject(m, gpu="cpu", prefix_cache=cache)
    ids = tiny_prompts(1, 13, seed=2)
    a, b = ktinject.generate(m, ids, max_new_tokens=4, do_sample=False), ktinject.generate(
        m, ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(a, b) and cache.stats.hit_tokens == 12 and cache.stats.hits["ram"] == 3


def test_rows_of_a_batch_share_the_shortest_hit():
    m = _injected("qwen3_moe")
    cache = PrefixCache(device="cpu", tier="ram", block_size=4)
    ids = tiny_prompts(2, 14, seed=5)
    _greedy(m, ids[:1], prefix_cache=cache)  # row 0 cached, row 1 not
    out = _greedy(m, ids, prefix_cache=cache)
    assert torch.equal(out, _greedy(m, ids)) and cache.stats.hit_tokens == 0
    out = _greedy(m, ids, prefix_cache=cache)  # both rows cached now
    assert torch.equal(out, _greedy(m, ids)) and cache.stats.hit_tokens == 2 * 12  # (counted per row)


def test_keep_generated_stores_the_reply_for_a_follow_up():
    """With keep_generated (the chat's setting) a follow-up that resends the reply restores it too: only the new
    tokens are computed (greedy tokens as without the cache here; a decode step's values may round differently
    from a prefill's, so a near-tie could flip)."""
    m = _injected("qwen3_moe")
    cache = PrefixCache(device="cpu", tier="ram", block_size=BLOCK, keep_generated=True)
    ids = tiny_prompts(1, 27, seed=1)
    first = _greedy(m, ids, prefix_cache=cache)
    follow = torch.cat([first, tiny_prompts(1, 5, seed=3)], dim=1)
    assert torch.equal(_greedy(m, follow, prefix_cache=cache), _greedy(m, follow))
    fed = first.shape[1] - 1  # every token but the last reply token went through the model
    assert cache.stats.hit_tokens == fed // BLOCK * BLOCK > ids.shape[1]


def test_bad_settings_are_errors():
    with pytest.raises(ValueError, match="tier must be one of gpu, ram, disk"):
        PrefixCache(device="cpu", tier="ssd")
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        PrefixCache(block_size=0)


def test_the_calls_a_server_makes_on_a_slot():
    """lookup -> restore into slot s of a KVCache -> prefill the rest into that row -> insert: the last logits equal
    a whole prefill's into another slot (the API the server uses; docs/prefix-cache.md, "For a server")."""
    from ktinject.decode import kv_cache

    m = _injected("qwen3_moe")
    cache = PrefixCache(device="cpu", tier="ram", block_size=4)
    kv = kv_cache.new(m.config, 3, 64, "cpu")
    prompt = tiny_prompts(1, 18, seed=6)
    with torch.no_grad():
        whole = kv_cache.forward(m, kv.rows(0, 1), prompt).logits[:, -1]
        assert cache.insert(m, prompt[0], kv, 0) == 4  # the 16 positions of whole blocks
        hit = cache.lookup(m, prompt[0])
        assert hit.tokens == 16 and cache.restore(hit, kv, 2) == 16 and int(kv.lengths[0, 2]) == 16
        rest = kv_cache.forward(m, kv.rows(2, 3), prompt[:, hit.tokens:]).logits[:, -1]
    torch.testing.assert_close(rest, whole)
    assert int(kv.lengths[0, 2]) == 18 and cache.insert(m, prompt[0], kv, 2) == 0  # nothing new to store
