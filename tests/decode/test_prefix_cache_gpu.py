"""The prefix cache on CUDA: the GPU tier holds device blocks, the RAM tier page-locked ones; greedy output with a
hit (restored into the runner's KVCache, decode steps replayed as CUDA graphs) equals the output without, for every
family; a hit in RAM or on disk is copied up to the GPU tier before use."""
from __future__ import annotations

import pytest
import torch

import ktinject
from ktinject.decode.generate import get_runner
from ktinject.decode.prefix_cache import PrefixCache
from ktinject.tiny_models import FAMILIES, build_tiny_model, tiny_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BLOCK = 8


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_with_a_hit_equals_output_without_through_graphs(family, tmp_path):
    m = build_tiny_model(family)
    ktinject.inject(m, gpu="cuda")
    cache = PrefixCache(tier="disk", block_size=BLOCK, disk_path=tmp_path, device="cuda")
    assert [t.name for t in cache.tiers.all] == ["gpu", "ram", "disk"]
    ids = tiny_prompts(1, 27, seed=1).cuda()
    kw = dict(max_new_tokens=16, do_sample=False)
    plain = ktinject.generate(m, ids, **kw)
    first = ktinject.generate(m, ids, prefix_cache=cache, **kw)
    second = ktinject.generate(m, ids, prefix_cache=cache, **kw)
    assert torch.equal(first, plain) and torch.equal(second, plain)
    assert cache.stats.hits["gpu"] == 3 and get_runner(m).stats.replays > 0
    block = cache.tiers.memory[0].get(cache.keys(m, ids[0].tolist())[0])
    assert all(t.is_cuda for t in block.values())


def test_lower_hits_are_copied_up_to_the_gpu_and_ram_is_pinned(tmp_path):
    m = build_tiny_model("qwen3_moe")
    ktinject.inject(m, gpu="cuda")
    ids = tiny_prompts(1, 33, seed=2).cuda()
    kw = dict(max_new_tokens=6, do_sample=False)
    plain = ktinject.generate(m, ids, **kw)
    ktinject.generate(m, ids, prefix_cache=PrefixCache(tier="disk", block_size=BLOCK, disk_path=tmp_path), **kw)
    restarted = PrefixCache(tier="disk", block_size=BLOCK, disk_path=tmp_path, gpu_bytes=0)
    assert torch.equal(ktinject.generate(m, ids, prefix_cache=restarted, **kw), plain)
    assert restarted.stats.hits["disk"] == 4
    ram = restarted.tiers.memory[0]  # no GPU tier (budget 0): the disk hits went up to RAM, page-locked
    assert [t.name for t in restarted.tiers.memory] == ["ram"]
    assert len(ram.blocks) == 4 and all(t.is_pinned() for b in ram.blocks.values() for t in b.values())
