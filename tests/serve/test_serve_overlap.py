"""The serve engine queues each decode step before it reads the tokens of the one before (``EngineConfig.overlap``):
the order of its calls, and that requests get the same events with it as one step at a time (greedy and seeded,
ended by max_tokens, stop strings and cancels, rows moving as they end). The demo model on the CPU, no HTTP."""
from __future__ import annotations

import threading

import pytest

from ktinject.serve.engine import Engine, EngineConfig
from ktinject.serve.sampling import SamplingParams

WORDS = "the small robot wanted to learn to paint by the sea in a quiet town".split()


@pytest.fixture(scope="module")
def engine(demo_engine_model):
    model, tokenizer = demo_engine_model
    eng = Engine(model, tokenizer, EngineConfig(max_batch=4, max_context=256, prefill_chunk=16), name="demo").start()
    yield eng
    eng.stop()


@pytest.fixture
def overlap(engine):
    """Set the engine's overlap for a test (it is idle between tests), put back afterwards."""
    def set_to(on: bool):
        engine.config.overlap = on
    yield set_to
    engine.config.overlap = True


def _prompt(engine, words: int) -> list[int]:
    return engine.encode(" ".join((WORDS * (words // len(WORDS) + 1))[:words]))


def _run_together(engine, jobs, cancel_after: dict[int, int] | None = None) -> list[list[tuple]]:
    """Submit every (prompt, params) before one step; each request's events as (text, tokens, finish_reason,
    completion_tokens). ``cancel_after``: request index -> cancel it from its sink after that many events (on the
    engine thread, so with overlap its next step is already queued)."""
    events = [[] for _ in jobs]
    done = [threading.Event() for _ in jobs]
    reqs = []

    def sink(out, i):
        events[i].append((out.text, tuple(out.token_ids), out.finish_reason, out.completion_tokens))
        if cancel_after and len(events[i]) == cancel_after.get(i):
            reqs[i].cancel()
        if out.finish_reason is not None:
            done[i].set()

    with engine._cond:  # the engine thread waits for this lock: all are queued before its next step
        for i, (prompt, params) in enumerate(jobs):
            reqs.append(engine.submit(prompt, params, lambda out, i=i: sink(out, i)))
    assert all(d.wait(120) for d in done)
    _wait_idle(engine)
    return events


def _stop_in_middle(text: str) -> str:
    """A stop string that first occurs in the middle of ``text``."""
    mid = len(text) // 2
    return next(text[mid:mid + n] for n in range(3, len(text) - mid + 1) if text.find(text[mid:mid + n]) == mid)


def _wait_idle(engine, timeout: float = 20.0) -> None:
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        c = engine.counts()
        if c["running"] == 0 and c["waiting"] == 0 and engine._inflight is None:
            assert c["free_rows"] == engine.config.max_batch and engine.scheduler.free_rows == engine.config.max_batch
            assert not engine._ending
            return
        time.sleep(0.01)
    raise AssertionError(f"the engine still holds requests: {engine.counts()}")


def test_each_decode_step_is_queued_before_the_tokens_of_the_one_before_are_read(engine, overlap, monkeypatch):
    calls = []
    decode = engine.model_runner.decode

    def logged(n, b, sample):
        calls.append("decode")
        step = decode(n, b, sample)
        read = step.tokens
        step.tokens = lambda: (calls.append("read"), read())[1]
        return step

    monkeypatch.setattr(engine.model_runner, "decode", logged)
    prompt = _prompt(engine, 5)
    for on in (True, False):
        overlap(on)
        calls.clear()
        r = engine.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        _wait_idle(engine)
        assert len(r.token_ids) == 6
        # 5 decode steps (the first token comes from the prefill), no step beyond max_tokens
        want = ["decode", "decode", "read"] * 1 + ["decode", "read"] * 3 + ["read"] if on else ["decode", "read"] * 5
        assert calls == want, calls


def test_overlap_gives_every_request_the_events_it_gets_one_step_at_a_time(engine, overlap):
    eng = engine
    prompts = [_prompt(eng, n) for n in (3, 9, 20, 41, 6, 14)]
    full = eng.generate(prompts[1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    stop = _stop_in_middle(full.text)  # ends request 1 mid-way, inside its 12 tokens
    jobs = [
        (prompts[0], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)),
        (prompts[1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,))),
        (prompts[2], SamplingParams(max_tokens=7, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)),
        (prompts[3], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)),
        (prompts[4], SamplingParams(max_tokens=15, temperature=1.2, top_k=20, seed=5, ignore_eos=True)),
        (prompts[5], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)),  # waits for a row (4 rows)
    ]
    cancel = {4: 6}  # request 4 is cancelled from its sink after 6 events
    overlap(False)
    one_at_a_time = _run_together(eng, jobs, cancel)
    overlap(True)
    queued_ahead = _run_together(eng, jobs, cancel)
    assert queued_ahead == one_at_a_time
    ends = [e[-1][2] for e in queued_ahead]
    assert ends == ["length", "stop", "length", "length", "cancelled", "length"], ends
    assert "".join(t for t, *_ in queued_ahead[1]) == full.text[:full.text.find(stop)]
    alone = [eng.generate(p, q).token_ids for p, q in jobs if q.greedy and not q.stop]
    assert [[t for _, ts, *_ in e for t in ts] for e, (_, q) in zip(queued_ahead, jobs) if q.greedy and not q.stop] \
        == alone


def test_an_early_end_costs_one_dropped_step_and_max_tokens_none(engine, overlap):
    """With overlap a request ended by a stop string (or end-of-sequence, or a cancel) has its next step queued
    already: one more step whose token is dropped; one that ends at max_tokens gives its row back before it."""
    eng = engine
    prompt = _prompt(eng, 9)
    full = eng.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    stop = _stop_in_middle(full.text)
    steps = {}
    for on in (False, True):
        overlap(on)
        for name, params in (("length", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
                             ("stop", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,)))):
            before = eng.metrics.decode_steps
            r = eng.generate(prompt, params)
            _wait_idle(eng)
            assert r.finish_reason == name
            steps[on, name] = (eng.metrics.decode_steps - before, r.completion_tokens)
    assert steps[False, "length"] == steps[True, "length"] == (11, 12)
    stopped = steps[False, "stop"][1]
    assert steps[False, "stop"] == (stopped - 1, stopped) and steps[True, "stop"] == (stopped, stopped)
