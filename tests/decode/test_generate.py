"""ktinject.generate on the CPU (eager, static cache): the same tokens as Hugging Face's generate."""
from __future__ import annotations

import copy

import pytest
import torch

import ktinject
from ktinject import native
from ktinject.decode.generate import disable, enable, get_runner
from ktinject.tiny_models import build_tiny_model, tiny_prompts

FAMILIES = ("qwen3_moe", "deepseek_v3", "mixtral")


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    m = build_tiny_model(request.param)
    yield m
    disable(m)


def _hf(m, *args, **kwargs):
    return type(m).generate(m, *args, **kwargs)


def _left_padded(batch=2, length=9, pads=(3, 0), seed=2):
    ids = tiny_prompts(batch, length, seed=seed)
    mask = torch.ones_like(ids)
    for row, n in enumerate(pads):
        ids[row, :n] = 0
        mask[row, :n] = 0
    return ids, mask


def test_greedy_equals_hf(model):
    ids = tiny_prompts(1, 7, seed=1)
    ref = _hf(model, ids, max_new_tokens=32, do_sample=False)
    out = ktinject.generate(model, ids, max_new_tokens=32, do_sample=False)
    assert torch.equal(out, ref)
    runner = get_runner(model)
    assert runner.stats.eager_decode == 31 and runner.stats.replays == 0  # every decode step came to the runner


def test_batch_left_padding_and_second_call(model):
    ids, mask = _left_padded()
    ref = _hf(model, ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    out = ktinject.generate(model, ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    runner = get_runner(model)
    cache = runner.caches[2]
    ids2, mask2 = _left_padded(length=5, pads=(0, 2), seed=3)  # other prompt length: same cache object
    ref2 = _hf(model, ids2, attention_mask=mask2, max_new_tokens=8, do_sample=False, pad_token_id=0)
    out2 = ktinject.generate(model, ids2, attention_mask=mask2, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(out2, ref2)
    assert runner.caches[2] is cache


def test_runner_owns_decode_masks(model, monkeypatch):
    """Decode steps reach the runner with the 2D padding mask (the model builds the 4D mask itself, inside the graph
    on CUDA): the same scores and tokens as HF building the 4D mask every step (own_masks=False)."""
    from ktinject.decode.graph_runner import GraphRunner

    ids, mask = _left_padded(length=7, pads=(2, 0))
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    seen = []
    call = GraphRunner.__call__

    def spy(self, **k):
        if k["input_ids"].shape[1] == 1:
            seen.append(k["attention_mask"].dim())
        return call(self, **k)

    monkeypatch.setattr(GraphRunner, "__call__", spy)
    get_runner(model, own_masks=False)
    try:
        ref = ktinject.generate(model, ids, **kw)
        assert seen == [4] * 9
        assert get_runner(model, prefill_chunk=2048).own_masks  # the default
        seen.clear()
        out = ktinject.generate(model, ids, **kw)
        assert seen == [2] * 9
        assert "create_masks_for_generate" not in model.__dict__  # the hook is gone after the call
    finally:
        get_runner(model, prefill_chunk=2048)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_chunked_prefill(model):
    ids, mask = _left_padded(length=11)
    ref = _hf(model, ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    runner = get_runner(model, prefill_chunk=4)
    try:
        out = ktinject.generate(model, ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert runner.stats.eager_other >= 2  # the prompt went through the runner in chunks
    finally:
        get_runner(model, prefill_chunk=2048)
    assert torch.equal(out, ref)


def test_sampling_with_seed(model):
    ids = tiny_prompts(2, 6, seed=4)
    kw = dict(max_new_tokens=12, do_sample=True, top_k=20, temperature=1.3)
    torch.manual_seed(123)
    ref = _hf(model, ids, **kw)
    torch.manual_seed(123)
    out = ktinject.generate(model, ids, **kw)
    torch.manual_seed(123)
    again = ktinject.generate(model, ids, **kw)
    assert torch.equal(out, ref) and torch.equal(again, out)


def test_eos_and_streamer(model):
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    ids = tiny_prompts(1, 6, seed=5)
    free = _hf(model, ids, max_new_tokens=10, do_sample=False)
    eos = int(free[0, ids.shape[1] + 3])  # the 4th generated token becomes EOS: generation stops there
    ref = _hf(model, ids, max_new_tokens=10, do_sample=False, eos_token_id=eos)
    s = Collect()
    out = ktinject.generate(model, ids, max_new_tokens=10, do_sample=False, eos_token_id=eos, streamer=s)
    assert torch.equal(out, ref) and out.shape[1] <= ids.shape[1] + 4
    assert s.ended and sum(s.chunks, [])[-(out.shape[1] - ids.shape[1]):] == out[0, ids.shape[1]:].tolist()


def test_padded_batch_bucket(model):
    """A batch of 3 padded to the bucket of 4 gives the batch of 3's tokens."""
    ids = tiny_prompts(3, 5, seed=6)
    ref = _hf(model, ids, max_new_tokens=6, do_sample=False)
    runner = get_runner(model, pad_batches=True)
    try:
        out = ktinject.generate(model, ids, max_new_tokens=6, do_sample=False)
        assert 4 in runner.caches and 3 not in runner.caches
    finally:
        get_runner(model, prefill_chunk=2048)
    assert torch.equal(out, ref)


def test_enable_routes_model_generate(model):
    ids = tiny_prompts(1, 5, seed=7)
    ref = model.generate(ids, max_new_tokens=5, do_sample=False)
    enable(model)
    try:
        before = get_runner(model).stats.eager_decode  # the module's model: an earlier test's runner may be kept
        out = model.generate(ids, max_new_tokens=5, do_sample=False)
        assert get_runner(model).stats.eager_decode - before == 4
        beams = model.generate(ids, max_new_tokens=5, do_sample=False, num_beams=2)  # not served: HF's own
    finally:
        disable(model)
    assert torch.equal(out, ref)
    assert torch.equal(beams, _hf(model, ids, max_new_tokens=5, do_sample=False, num_beams=2))
    assert "generate" not in model.__dict__


def test_injected_model_matches_its_hf_loop():
    """On an injected model (native experts, gpu=cpu) the wrapper gives HF's own loop's tokens."""
    pytest.importorskip("ktinject.native")
    try:
        m = build_tiny_model("qwen3_moe")
        ktinject.inject(m, gpu="cpu")
    except Exception as e:  # native library or inject not available in this checkout
        pytest.skip(f"inject unavailable: {type(e).__name__}: {e}")
    ids = tiny_prompts(2, 6, seed=8)
    ref = _hf(m, ids, max_new_tokens=12, do_sample=False)
    out = ktinject.generate(m, ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref)


def test_deferred_stop_only_for_the_calls_runner_cache():
    """The deferred stop check serves exactly the cache registered for the running call (on CUDA); every other
    cache, and the same cache after the call, gets Hugging Face's own decision."""
    from transformers.generation import utils as gen_utils

    from ktinject.decode import generate as gen

    if not gen._install_deferred_stop():
        pytest.skip("this transformers has no DeferredStopCheck")
    cls = gen_utils.DeferredStopCheck
    assert gen._install_deferred_stop() and gen_utils.DeferredStopCheck is cls  # installed once
    ours, other = object(), object()
    cuda = torch.device("cuda")
    gen._DEFERRED[id(ours)] = ours
    try:
        assert cls.is_supported(cuda, ours, True, is_assistant=False)
        assert not cls.is_supported(cuda, ours, True, is_assistant=True)
        assert not cls.is_supported(torch.device("cpu"), ours, False, is_assistant=False)
        assert not cls.is_supported(cuda, other, False, is_assistant=False)  # HF: only "mps"
    finally:
        gen._DEFERRED.pop(id(ours))
    assert not cls.is_supported(cuda, ours, True, is_assistant=False)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_returned_cache_is_the_callers_and_continues_like_hf(family):
    """With return_dict_in_generate the cache handed back is the caller's own (HF's DynamicCache), not the runner's
    reusable one: a later call leaves it alone (continuing from it gives what continuing from a copy taken before
    that call gives), continuing from it runs past the length the runner's cache had (an index error before), and
    on this CPU's kernels it continues as generating from scratch does."""
    from ktinject import compat

    m = build_tiny_model(family, max_position_embeddings=2048)
    ktinject.inject(m, gpu="cpu")
    field = compat.cache_kwarg()
    a, b, more = tiny_prompts(1, 9, seed=1), tiny_prompts(1, 12, seed=7), tiny_prompts(1, 4, seed=3)
    first = ktinject.generate(m, a, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    before = copy.deepcopy(getattr(first, field))
    other = ktinject.generate(m, b, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    assert getattr(first, field) is not getattr(other, field)
    again = torch.cat([first.sequences, more], dim=1)
    for n in (6, 300):  # 300: past the runner's 256-token cache on the CPU
        kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False)  # (no early EOS: the whole length)
        kept = ktinject.generate(m, again, **{field: copy.deepcopy(getattr(first, field))}, **kw)
        snap = ktinject.generate(m, again, **{field: copy.deepcopy(before)}, **kw)
        assert kept.shape == (1, again.shape[1] + n) and torch.equal(kept, snap), (family, n)
    if native.isa() != "amx":  # (AMX takes prompts of 8+ rows through other kernels than decode steps: the 4
        # continued tokens and a whole prompt round differently, and a near-tie may flip)
        scratch = ktinject.generate(m, again, max_new_tokens=6, do_sample=False)
        kept = ktinject.generate(m, again, **{field: copy.deepcopy(before)}, max_new_tokens=6, do_sample=False)
        assert torch.equal(kept, scratch), family


def test_positional_arguments_bind_as_hf_binds_them():
    """model.generate(ids, generation_config) is HF's signature: the second positional argument is the generation
    config (it landed in attention_mask)."""
    from transformers import GenerationConfig

    m = build_tiny_model("qwen3_moe")
    ktinject.inject(m, gpu="cpu")
    ids = tiny_prompts(1, 7, seed=1)
    gc = GenerationConfig(max_new_tokens=5, do_sample=False)
    assert torch.equal(ktinject.generate(m, ids, gc), _hf(m, ids, gc))
    with pytest.raises(TypeError, match="multiple values for argument 'generation_config'"):
        ktinject.generate(m, ids, gc, generation_config=gc)


def test_padding_rows_never_reach_per_row_callbacks():
    """A batch padded up to a bucket (the default with CUDA graphs) must not show its padding rows to a
    prefix_allowed_tokens_fn, a stopping criterion or the sampler: such calls are not padded."""
    m = build_tiny_model("qwen3_moe")
    ktinject.inject(m, gpu="cpu")
    get_runner(m, pad_batches=True)
    ids = tiny_prompts(3, 6, seed=2)
    allowed = [[5, 6, 7], [8, 9], [10, 11, 12]]
    kw = dict(max_new_tokens=4, prefix_allowed_tokens_fn=lambda b, s: allowed[b])
    assert torch.equal(ktinject.generate(m, ids, **kw), _hf(m, ids, **kw))
    torch.manual_seed(0)
    sampled = ktinject.generate(m, ids, max_new_tokens=4, do_sample=True, top_k=0)
    torch.manual_seed(0)
    assert torch.equal(sampled, _hf(m, ids, max_new_tokens=4, do_sample=True, top_k=0))
