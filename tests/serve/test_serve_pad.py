"""The serve engine's prefill widths (``EngineConfig.prefill_pad``, ``steps.padded_width``): rounded up so that a
server's prefill forwards take a bounded set of shapes (on CUDA each new one costs host memory once), without
changing any request's tokens; and Engine.stop() ending the waiting requests at once. The demo model on the CPU,
no HTTP."""
from __future__ import annotations

import pytest

from ktinject.decode import kv_cache
from ktinject.serve.engine import Engine, EngineConfig
from ktinject.serve.sampling import SamplingParams
from ktinject.serve.model_runner import padded_width

WORDS = "the small robot wanted to learn to paint by the sea in a quiet town".split()


@pytest.mark.parametrize("width, pad, room, want", [
    (1, 16, 99, 1), (2, 16, 99, 2), (3, 16, 99, 4), (5, 16, 99, 8), (9, 16, 99, 16), (16, 16, 99, 16),
    (17, 16, 99, 32), (33, 16, 99, 48), (300, 16, 999, 304), (512, 16, 999, 512),
    (17, 16, 20, 20), (5, 16, 6, 6), (5, 16, 5, 5),   # never past the room the rows' cache has left
    (5, 1, 99, 5), (37, 1, 99, 37), (37, 8, 99, 40), (3, 8, 99, 4),
    (17, 24, 99, 24), (20, 24, 99, 24), (12, 24, 99, 16), (25, 24, 99, 48),   # a pad that is not a power of two
    (100, 16, 100, 100),   # room: a step's whole chunk of 100 is not padded past it
])
def test_padded_width(width, pad, room, want):
    assert padded_width(width, pad, room) == want


def test_prefill_pad_is_checked():
    for bad in (0, -3, True, 2.5, "16"):
        with pytest.raises(ValueError, match="prefill_pad"):
            EngineConfig(prefill_pad=bad)
    assert EngineConfig(prefill_pad=16).prefill_pad == 16 and EngineConfig().prefill_pad is None


def _tokens(model, tokenizer, pad: int, prompts: list[list[int]], monkeypatch, chunk: int = 16) -> tuple[list, set]:
    """Each prompt's 8 greedy tokens, one request at a time, on an engine with prefill_pad = pad; the widths of
    its prefill forwards."""
    widths = set()
    forward = kv_cache.forward

    def spy(model, cache, ids, **kw):
        widths.add(ids.shape[1])
        return forward(model, cache, ids, **kw)

    monkeypatch.setattr(kv_cache, "forward", spy)
    eng = Engine(model, tokenizer, EngineConfig(max_batch=4, max_context=128, prefill_chunk=chunk, prefill_pad=pad),
                 name="demo").start()
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        out = [eng.generate(p, params).token_ids for p in prompts]
    finally:
        eng.stop()
        monkeypatch.setattr(kv_cache, "forward", forward)
    return out, widths


def test_padded_prefill_gives_the_tokens_of_the_unpadded(demo_engine_model, monkeypatch):
    """Prompts whose chunks (of 16) are 1 or >= 4 tokens: a width of >= 4 (SDPA, the native experts) gives each
    row the numbers it gets alone (tests/serve/test_batch_invariance.py), so padding 5 -> 8 or 10 -> 16 moves nothing."""
    model, tokenizer = demo_engine_model
    prompts = [tokenizer.encode(" ".join(WORDS[i % len(WORDS)] for i in range(n)))[:n] for n in (4, 5, 9, 17, 26, 40)]
    sizes = [len(p) for p in prompts]
    plain, w1 = _tokens(model, tokenizer, 1, prompts, monkeypatch)
    padded, w16 = _tokens(model, tokenizer, 16, prompts, monkeypatch)
    assert padded == plain, sizes
    assert w16 <= {1, 2, 4, 8, 16} and len(w16) < len(w1), (w1, w16)  # the warm-up's 8 and the rounded widths


def test_padding_never_takes_a_forward_past_the_prefill_chunk(demo_engine_model, monkeypatch):
    """A chunk of 12 (not a multiple of the pad) stays 12 wide: a prefill forward keeps within the step's budget."""
    model, tokenizer = demo_engine_model
    prompts = [tokenizer.encode(" ".join(WORDS[i % len(WORDS)] for i in range(n)))[:n] for n in (26, 7)]
    plain, _ = _tokens(model, tokenizer, 1, prompts, monkeypatch, chunk=12)
    padded, widths = _tokens(model, tokenizer, 16, prompts, monkeypatch, chunk=12)
    assert padded == plain and max(widths) == 12 and 8 in widths, widths  # 26 = 12 + 12 + 2; 7 -> 8



def test_stop_ends_waiting_requests_at_once(demo_engine_model):
    """Engine.stop() ends the requests waiting for a row on the caller's thread, before it returns (an engine step
    may take seconds: a server's graceful wait must not run out on them); the running one ends at the next step."""
    import threading


    model, tokenizer = demo_engine_model
    eng = Engine(model, tokenizer, EngineConfig(max_batch=1, max_context=512, prefill_chunk=16), name="demo").start()
    got: dict[str, list] = {"a": [], "b": []}
    started = threading.Event()

    def sink_a(out):
        got["a"].append(out)
        started.set()

    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    eng.submit(tokenizer.encode("the small robot"), params, sink_a)
    assert started.wait(60)
    b = eng.submit(tokenizer.encode("in a quiet town"), params, got["b"].append)  # no row free: it waits
    eng.stop(timeout=0)
    assert [o.finish_reason for o in got["b"]] == ["cancelled"] and got["b"][0].error == "the engine stopped"
    assert b.done
    eng.stop()  # joins
    assert not eng.alive and got["a"][-1].finish_reason == "cancelled"
