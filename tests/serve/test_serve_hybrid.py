"""The serving engine on a hybrid family (Qwen3.5-MoE: gated-DeltaNet layers with recurrent state beside full
attention): concurrent requests of different prompt lengths, chunked prefills and rows reused after others finish
get the greedy tokens each gets alone, and those of ``ktinject.generate``; a reused row starts from zero state."""
from __future__ import annotations

import threading

import pytest
import torch

import ktinject
from ktinject.serve.engine import Engine, EngineConfig
from ktinject.serve.sampling import SamplingParams
from ktinject.tiny_models import build_tiny_model, tiny_prompts

FAMILIES = ("qwen3_5_moe", "qwen3_next")


def _greedy(n=6):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module", params=FAMILIES)
def hybrid(request):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    m = build_tiny_model(request.param)
    ktinject.inject(m, gpu="cpu")
    yield m
    torch.set_num_threads(threads)


def _together(engine, prompts):
    out = [None] * len(prompts)

    def one(i):
        out[i] = engine.generate(prompts[i], _greedy(), timeout=300)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_mixed_batch_equals_each_alone_and_generate(hybrid):
    prompts = [tiny_prompts(1, n, seed=n)[0].tolist() for n in (1, 5, 13, 22, 9, 3)]
    config = EngineConfig(max_batch=3, max_context=64, prefill_chunk=8)  # chunked prefills, rows reused
    with Engine(hybrid, None, config) as engine:
        alone = [engine.generate(p, _greedy(), timeout=300).token_ids for p in prompts]
        together = [r.token_ids for r in _together(engine, prompts)]
        again = [engine.generate(p, _greedy(), timeout=300).token_ids for p in prompts[:2]]  # rows used before
    assert together == alone and again == alone[:2]
    for p, got in zip(prompts, alone):
        ref = ktinject.generate(hybrid, torch.tensor([p]), max_new_tokens=6, do_sample=False)
        assert ref[0, len(p):].tolist() == got


def test_shared_prefix_restores_state_checkpoints_and_equals_the_cache_off(hybrid):
    """A prompt of whole blocks leaves a state checkpoint at its end; a later prompt that starts with it restores K/V
    and that state (cached_tokens) and gets the greedy tokens of the cache off."""
    from ktinject.decode.prefix_cache import PrefixCache

    a = tiny_prompts(1, 16, seed=7)[0].tolist()
    b = a + tiny_prompts(1, 5, seed=8)[0].tolist()
    config = EngineConfig(max_batch=2, max_context=64, prefill_chunk=8)
    with Engine(hybrid, None, config) as engine:
        plain = [engine.generate(p, _greedy(), timeout=300) for p in (a, b)]
    store = PrefixCache(device="cpu", tier="ram", block_size=8)
    with Engine(hybrid, None, EngineConfig(max_batch=2, max_context=64, prefill_chunk=8, prefix_cache=store)) as e:
        cached = [e.generate(p, _greedy(), timeout=300) for p in (a, b)]
    assert [r.token_ids for r in cached] == [r.token_ids for r in plain]
    assert [r.cached_tokens for r in cached] == [0, 16] and store.stats.state_checkpoints >= 1


def test_a_prompt_of_any_length_leaves_a_checkpoint_at_its_last_whole_block(hybrid):
    """The engine cuts a hybrid model's prefill at the prompt's last whole block and stores the state there: a later
    prompt sharing more than that block restores it and gets the greedy tokens of the cache off."""
    from ktinject.decode.prefix_cache import PrefixCache

    a = tiny_prompts(1, 21, seed=9)[0].tolist()  # whole blocks of 8 before its last token: a checkpoint at 16
    b = a + tiny_prompts(1, 6, seed=10)[0].tolist()
    config = dict(max_batch=2, max_context=64, prefill_chunk=32)
    with Engine(hybrid, None, EngineConfig(**config)) as engine:
        plain = [engine.generate(p, _greedy(), timeout=300) for p in (a, b)]
    store = PrefixCache(device="cpu", tier="ram", block_size=8)
    with Engine(hybrid, None, EngineConfig(**config, prefix_cache=store)) as engine:
        cached = [engine.generate(p, _greedy(), timeout=300) for p in (a, b)]
    assert [r.token_ids for r in cached] == [r.token_ids for r in plain]
    assert [r.cached_tokens for r in cached] == [0, 16] and store.stats.state_checkpoints == 2
