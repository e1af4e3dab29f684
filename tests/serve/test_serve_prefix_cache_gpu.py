"""The server's shared prefix cache on CUDA: concurrent requests that share a prefix, decoded through the batched
decode graphs, restore whole blocks from the GPU tier (or from page-locked RAM, the GPU tier off) and get exactly the
greedy tokens of the cache off; the restored counts are the blocks a request's prompt shares with one stored before
it. The tiny qwen3_moe model in float32 (a batch size moves nothing beyond rounding)."""
from __future__ import annotations

import threading

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BLOCK = 8


@pytest.fixture(scope="module")
def tiny():
    import ktinject
    from ktinject.tiny_models import build_tiny_model

    m = build_tiny_model("qwen3_moe").cuda()
    ktinject.inject(m, gpu="cuda", gpu_experts_budget=0)
    return m


def _run(model, prompts, store):
    from ktinject.serve.engine import Engine, EngineConfig
    from ktinject.serve.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    config = EngineConfig(max_batch=4, max_context=160, prefill_chunk=16, prefix_cache=store)
    with Engine(model, None, config) as engine:
        first = engine.generate(prompts[0], params, timeout=300)  # stores the shared blocks
        out = [None] * (len(prompts) - 1)

        def one(i):
            out[i] = engine.generate(prompts[i + 1], params, timeout=300)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(out))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        replays = engine.runner.stats.replays
    return [first, *out], replays


@pytest.mark.parametrize("tier", ["gpu", "ram"])
def test_concurrent_hits_through_decode_graphs_equal_the_cache_off(tiny, tier):
    from ktinject.decode.prefix_cache import PrefixCache
    from ktinject.tiny_models import tiny_prompts

    shared = tiny_prompts(1, 43, seed=3)[0].tolist()
    prompts = [shared + tiny_prompts(1, n, seed=10 + n)[0].tolist() for n in (1, 5, 17, 30)]
    plain, _ = _run(tiny, prompts, None)
    store = PrefixCache(tier=tier, block_size=BLOCK, device="cuda", gpu_bytes=None if tier == "gpu" else 0)
    cached, replays = _run(tiny, prompts, store)
    assert [r.token_ids for r in cached] == [r.token_ids for r in plain]
    assert [r.cached_tokens for r in plain] == [0] * 4
    assert cached[0].cached_tokens == 0
    assert [r.cached_tokens for r in cached[1:]] == [40, 40, 40]  # the 5 whole blocks of the shared 43 tokens
    assert store.stats.hits[tier] >= 15 and replays > 0
    assert [t.name for t in store.tiers.memory] == ([tier] if tier == "gpu" else ["ram"])
