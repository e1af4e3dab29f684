"""The prefix cache on the hybrid families (gated-DeltaNet layers beside full attention: Qwen3.5-MoE, Qwen3-Next):
a generate prefills up to the prompt's last whole block and stores those blocks with the linear-attention state at
their end (a checkpoint); a later prompt that starts the same restores K/V and that state and prefills only the
rest, with the greedy tokens of the cache off; a hit ends at a block that has a checkpoint; a checkpoint gone
missing makes the prompt computed whole; batches are prefilled whole."""
from __future__ import annotations

import pytest
import torch

import ktinject
from ktinject.decode.prefix_cache import PrefixCache
from ktinject.decode.prefix_cache.store import state_key
from ktinject.tiny_models import build_tiny_model, tiny_prompts

BLOCK = 8


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def hybrid(request):
    m = build_tiny_model(request.param)
    ktinject.inject(m, gpu="cpu")
    return m


def _gen(m, ids, cache=None, n=6):
    return ktinject.generate(m, ids, max_new_tokens=n, do_sample=False, prefix_cache=cache)


def test_a_follow_up_restores_state_and_equals_the_cache_off(hybrid):
    first = tiny_prompts(1, 29, seed=1)  # 3 whole blocks before the last token: a checkpoint at 24
    follow = torch.cat([first, tiny_prompts(1, 13, seed=2)], dim=1)  # 42 tokens: resumes at 24, checkpoint at 40
    cache = PrefixCache(device="cpu", tier="ram", block_size=BLOCK)
    plain = [_gen(hybrid, first), _gen(hybrid, follow)]
    got = [_gen(hybrid, first, cache), _gen(hybrid, follow, cache)]
    assert all(torch.equal(a, b) for a, b in zip(got, plain))
    assert cache.stats.hit_tokens == 24 and cache.stats.state_checkpoints == 2
    assert cache.lookup(hybrid, follow[0]).tokens == 40
    again = _gen(hybrid, follow, cache)  # all 5 blocks with their last checkpoint
    assert torch.equal(again, plain[1]) and cache.stats.hit_tokens == 24 + 40


def test_a_hit_ends_at_a_block_with_a_checkpoint(hybrid):
    cache = PrefixCache(device="cpu", tier="ram", block_size=BLOCK)
    ids = tiny_prompts(1, 33, seed=3)
    _gen(hybrid, ids, cache)  # blocks 0..3 stored, the state checkpoint at 32 only
    keys = cache.keys(hybrid, ids[0].tolist())
    assert [cache.tiers.holds(state_key(k)) for k in keys] == [False, False, False, True]
    assert cache.lookup(hybrid, ids[0, :30].tolist() + [5]).tokens == 0  # 3 blocks held, none with a checkpoint
    assert cache.lookup(hybrid, ids[0].tolist() + [5]).tokens == 32


def test_a_missing_checkpoint_computes_the_prompt_whole(hybrid):
    cache = PrefixCache(device="cpu", tier="ram", block_size=BLOCK)
    ids = tiny_prompts(1, 20, seed=4)
    plain = _gen(hybrid, ids)
    _gen(hybrid, ids, cache)
    hit = cache.lookup(hybrid, ids[0].tolist())
    assert hit.tokens == 16
    ram = cache.tiers.memory[0]
    ram.blocks.pop(state_key(hit.keys[-1]))  # gone after the lookup, before the restore
    from ktinject.decode.generate import get_runner

    kv = get_runner(hybrid).cache_for(1, 32)
    assert cache.restore(hit, kv, 0) == 0 and int(kv.lengths[0, 0]) == 0
    assert torch.equal(_gen(hybrid, ids, cache), plain)


def test_batches_are_prefilled_whole_and_equal(hybrid):
    cache = PrefixCache(device="cpu", tier="ram", block_size=BLOCK)
    ids = tiny_prompts(2, 21, seed=5)
    plain = _gen(hybrid, ids)
    assert torch.equal(_gen(hybrid, ids, cache), plain) and torch.equal(_gen(hybrid, ids, cache), plain)
    assert cache.stats.hit_tokens == 0
