"""Logprobs and penalties in the engine: the penalty arithmetic against a plain reference, and the engine's greedy
tokens and logprobs against the same model's plain forwards (a tiny float32 Qwen3-MoE, injected, no KV cache in the
reference), alone and among other rows that move when requests end."""
from __future__ import annotations

import threading

import pytest
import torch

import ktinject
from ktinject import tiny_models as testing
from ktinject.serve.engine import Engine, EngineConfig
from ktinject.serve.errors import RequestError
from ktinject.serve.penalties import penalize
from ktinject.serve.sampling import SamplingParams

PROMPTS = [list(range(5, 25)), list(range(40, 47)), [7] * 10]  # (the tiny model repeats itself on the last)


def _reference_penalty(logits: list[float], prompt: list[int], out: list[int], presence: float, frequency: float,
                       repetition: float) -> list[float]:
    """HF's RepetitionPenaltyLogitsProcessor, then OpenAI's presence / frequency formula, token by token."""
    got = []
    for tok, x in enumerate(logits):
        if tok in prompt or tok in out:
            x = x / repetition if x > 0 else x * repetition
        n = out.count(tok)
        got.append(x - frequency * n - presence * (n > 0))
    return got


@pytest.mark.parametrize("presence,frequency,repetition", [
    (0.0, 0.0, 1.0), (0.5, 0.0, 1.0), (0.0, 1.5, 1.0), (0.0, 0.0, 1.3), (0.0, 0.0, 0.7), (-1.0, -0.5, 1.0),
    (2.0, 2.0, 2.0)])
def test_penalize_matches_the_reference(presence, frequency, repetition):
    g = torch.Generator().manual_seed(0)
    V = 12
    logits = torch.randn(3, V, generator=g) * 3
    prompts, outs = [[1, 2, 2], [], [11]], [[2, 5, 5, 5], [0, 7], []]
    counts = torch.zeros(3, V, dtype=torch.int32)
    mask = torch.zeros(3, V, dtype=torch.bool)
    for i in range(3):
        for t in outs[i]:
            counts[i, t] += 1
        for t in prompts[i]:
            mask[i, t] = True
    coef = [torch.full((3,), c) for c in (presence, frequency, repetition)]
    got = penalize(logits, counts, mask, *coef)
    for i in range(3):
        want = _reference_penalty(logits[i].tolist(), prompts[i], outs[i], presence, frequency, repetition)
        assert got[i].tolist() == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("kw,param", [({"presence_penalty": 2.5}, "presence_penalty"),
                                      ({"frequency_penalty": -3.0}, "frequency_penalty"),
                                      ({"repetition_penalty": 0.0}, "repetition_penalty"),
                                      ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs")])
def test_bad_values_name_the_field(kw, param):
    with pytest.raises(RequestError) as e:
        SamplingParams(max_tokens=1, **kw)
    assert e.value.param == param


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = testing.build_tiny_model("qwen3_moe", dtype=torch.float32)
    ktinject.inject(model, gpu="cpu")
    engine = Engine(model, None, EngineConfig(max_batch=4, max_context=128, prefill_chunk=16)).start()
    yield model, engine
    engine.stop()
    torch.set_num_threads(threads)


def _forward_logits(model, ids: list[int]) -> torch.Tensor:
    """Log-softmax of the model's plain forward (no cache) at every position of ``ids``: [len, V]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _greedy_reference(model, prompt, n, presence=0.0, frequency=0.0, repetition=1.0) -> list[int]:
    out = []
    for _ in range(n):
        with torch.no_grad():
            last = model(torch.tensor([prompt + out])).logits[0, -1].float()
        logits = _reference_penalty(last.tolist(), prompt, out, presence, frequency, repetition)
        out.append(max(range(len(logits)), key=logits.__getitem__))
    return out


def _run_together(engine, jobs):
    """Submit (prompt, params) jobs before one step; each one's events once all finished."""
    done = [threading.Event() for _ in jobs]
    outs = [[] for _ in jobs]
    with engine._cond:  # the engine thread waits for this lock: all are queued before its next step
        for i, (prompt, params) in enumerate(jobs):
            engine.submit(prompt, params, lambda o, i=i: (outs[i].append(o), o.finish_reason and done[i].set()))
    assert all(d.wait(120) for d in done)
    return outs


def test_greedy_logprobs_are_the_forwards_log_softmax(tiny):
    """Every token's logprob (the first one's from the prefill forward, the others' from decode steps) and its top
    entries are the plain forward's, for rows that ask beside rows that do not, with other rows ending early."""
    model, engine = tiny
    jobs = [(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, logprobs=5, ignore_eos=True)),
            (PROMPTS[1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)),
            (PROMPTS[2], SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=0, ignore_eos=True))]
    outs = _run_together(engine, jobs)
    assert all(o.logprobs is None for o in outs[1])
    for (prompt, params), events in zip([jobs[0], jobs[2]], [outs[0], outs[2]]):
        ids = [t for o in events for t in o.token_ids]
        entries = [e for o in events for e in o.logprobs]
        assert len(entries) == len(ids) == params.max_tokens
        ref = _forward_logits(model, prompt + ids)
        for k, (tok, e) in enumerate(zip(ids, entries)):
            row = ref[len(prompt) - 1 + k]
            assert e.token == tok and e.logprob == pytest.approx(row[tok].item(), abs=1e-4)
            assert len(e.top) == params.logprobs
            assert [t for t, _ in e.top] == row.topk(params.logprobs).indices.tolist()
            assert [lp for _, lp in e.top] == pytest.approx(row.topk(params.logprobs).values.tolist(), abs=1e-4)
            assert all(a[1] >= b[1] for a, b in zip(e.top, e.top[1:]))
        if params.greedy:
            assert all(e.top[0] == (e.token, e.logprob) for e in entries)  # the greedy token is the most likely


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 1.5}, {"presence_penalty": 2.0},
                                     {"repetition_penalty": 1.8}, {"repetition_penalty": 0.6, "presence_penalty": -1}])
def test_penalized_greedy_tokens_match_the_reference_while_rows_move(tiny, penalty):
    """A penalized greedy request in row 2 of 3: the rows before it end early (its row moves down twice, its counts
    with it), and the unpenalized rows beside it get the tokens they get alone."""
    model, engine = tiny
    n = 20
    want = _greedy_reference(model, PROMPTS[2], n, penalty.get("presence_penalty", 0.0),
                             penalty.get("frequency_penalty", 0.0), penalty.get("repetition_penalty", 1.0))
    plain = _greedy_reference(model, PROMPTS[2], n)
    assert want != plain, "the penalty changes nothing on this prompt: no test"
    alone = engine.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)).token_ids
    jobs = [(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)),
            (PROMPTS[1], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, frequency_penalty=0.7)),
            (PROMPTS[2], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **penalty))]
    outs = _run_together(engine, jobs)
    got = [[t for o in events for t in o.token_ids] for events in outs]
    assert got[2] == want and got[0] == alone
    assert got[1] == _greedy_reference(model, PROMPTS[1], 5, frequency=0.7)
    assert engine.penalties.live == set()  # every penalized row was let go
