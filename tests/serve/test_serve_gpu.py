"""ktinject.serve's engine on CUDA (no HTTP: the GPU machine has no FastAPI): concurrent greedy requests decoded
through the batched decode graphs (buckets 1, 2, 4, 8) get exactly the tokens each gets alone, while requests
finish at different steps (rows move down, buckets shrink, padding rows come and go); every decode step replays a
graph. The demo model in float32, so a batch size does not move the numbers by more than rounding (as in
test_kv_cache_gpu.py)."""
from __future__ import annotations

import threading

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LENGTHS = (1, 4, 9, 17, 26, 40, 55, 70)  # prompt tokens: several prefill chunks of 16 for the longer ones
WORDS = "the small robot wanted to learn to paint by the sea in a quiet town".split()


@pytest.fixture(scope="module")
def engine():
    from ktinject.cli.chat import load_model
    from ktinject.demo import demo_model_dir
    from ktinject.serve.engine import Engine, EngineConfig

    model, tokenizer, _ = load_model(demo_model_dir(), progress=False, gpu="cuda", dtype=torch.float32)
    eng = Engine(model, tokenizer, EngineConfig(max_batch=8, max_context=512, prefill_chunk=16), name="demo").start()
    yield eng
    eng.stop()
    eng.runner.close()


def _prompts(eng):
    return [eng.encode(" ".join((WORDS * 10)[:n])) for n in LENGTHS]


def _together(eng, prompts, params):
    out = [None] * len(prompts)

    def one(i):
        out[i] = eng.generate(prompts[i], params[i], timeout=300)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_graphs_captured_for_every_bucket(engine):
    r = engine.runner
    assert r.graphs_enabled() and not r.stats.capture_failures, r.describe()
    assert sorted(k[0] for k, g in r.graphs.items() if g is not None) == [1, 2, 4, 8], r.describe()


def test_concurrent_requests_through_batched_graphs_match_alone(engine):
    from ktinject.serve.sampling import SamplingParams

    prompts = _prompts(engine)
    # different lengths: requests end at different steps, so the batch shrinks through the buckets
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    alone = [engine.generate(p, q, timeout=300).token_ids for p, q in zip(prompts, params)]
    stats = engine.runner.stats
    replays, eager = stats.replays, stats.eager_decode
    m = engine.metrics
    steps, rows = m.decode_steps, m.decode_rows
    got = _together(engine, prompts, params)
    assert all(g.error is None for g in got), [g.error for g in got]
    same = sum(a == g.token_ids for a, g in zip(alone, got))
    assert same == len(prompts), f"{same}/{len(prompts)} requests got the tokens they get alone"
    assert stats.eager_decode == eager, engine.runner.describe()
    assert stats.replays - replays == m.decode_steps - steps
    assert (m.decode_rows - rows) / (m.decode_steps - steps) > 2  # they did decode together
    c = engine.counts()
    assert c["running"] == 0 and c["free_rows"] == 8


def test_seeded_sampling_repeats(engine):
    """Alone, twice. (Beside other requests the batch's GEMM kernels can move logits in the last bits, and a
    sampled token near a top_p edge then differs: the CPU test with bf16 checks the batch case bit for bit.)"""
    from ktinject.serve.sampling import SamplingParams

    prompts = _prompts(engine)
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    first = [engine.generate(p, q, timeout=300).token_ids for p, q in zip(prompts, params)]
    assert [engine.generate(p, q, timeout=300).token_ids for p, q in zip(prompts, params)] == first
    together = _together(engine, prompts, params)
    same = sum(a == g.token_ids for a, g in zip(first, together))
    print(f"seeded requests in a batch: {same}/{len(prompts)} identical to alone")


def test_cancelled_requests_free_their_rows_and_the_rest_goes_on(engine):
    from ktinject.serve.sampling import SamplingParams

    prompts = _prompts(engine)
    keep = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = engine.generate(prompts[3], keep, timeout=300).token_ids
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    doomed = [engine.submit(p, long) for p in prompts[4:]]
    events, done = [], threading.Event()

    def sink(out):
        events.append(out)
        if out.finish_reason is not None:
            done.set()

    engine.submit(prompts[3], keep, sink)
    for d in doomed:
        d.cancel()
    assert done.wait(300)
    assert [t for e in events for t in e.token_ids] == alone and events[-1].finish_reason == "length"
    assert all(d.done for d in doomed)
    c = engine.counts()
    assert c["running"] == 0 and c["free_rows"] == 8


def test_decode_steps_are_queued_without_waiting_for_the_device(engine, monkeypatch):
    """What lets the engine queue step t+1 before it reads step t's tokens: a decode step (inputs from the rows'
    next tokens, graph replay, greedy and sampled rows, the tokens' copy to the host) makes no synchronising call;
    torch's sync debug mode turns one into an error (the step's requests would fail)."""
    from ktinject.serve.sampling import SamplingParams

    decode = engine.model_runner.decode

    def strict(n, b, sample):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return decode(n, b, sample)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(engine.model_runner, "decode", strict)
    prompts = _prompts(engine)[:5]
    params = [SamplingParams(max_tokens=8, temperature=0 if i % 2 else 0.8, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    got = _together(engine, prompts, params)
    assert all(g.error is None and g.completion_tokens == 8 for g in got), [g.error for g in got]
    assert engine.config.overlap and engine.metrics.decode_forward_seconds > 0


def test_logprobs_and_penalties_through_graph_decode(engine):
    """Through the captured decode graphs, beside other requests: a greedy request's logprobs are the log-softmax of a
    plain forward of the model, and a penalized one's tokens follow the penalties applied to the plain forward's logits
    (its counts kept on the device and moved with its row as the others end)."""
    from ktinject.serve.sampling import SamplingParams

    prompts = _prompts(engine)[:4]
    replays = engine.runner.stats.replays
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True) for i in range(4)]
    params[1] = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=4)
    params[3] = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, frequency_penalty=1.5,
                               repetition_penalty=1.3)
    events = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    with engine._cond:
        for i, p in enumerate(prompts):
            engine.submit(p, params[i], lambda o, i=i: (events[i].append(o), o.finish_reason and done[i].set()))
    assert all(d.wait(300) for d in done)
    assert engine.runner.stats.replays > replays
    model = engine.model
    ids = [t for o in events[1] for t in o.token_ids]
    entries = [e for o in events[1] for e in o.logprobs]
    with torch.no_grad():
        ref = model(torch.tensor([prompts[1] + ids], device=engine.device)).logits[0].float().log_softmax(-1)
    for k, e in enumerate(entries):
        row = ref[len(prompts[1]) - 1 + k]
        assert e.token == ids[k] and abs(e.logprob - row[ids[k]].item()) < 1e-3
        assert [t for t, _ in e.top] == row.topk(4).indices.tolist()
    prompt, out = prompts[3], []
    for _ in range(16):
        with torch.no_grad():
            last = model(torch.tensor([prompt + out], device=engine.device)).logits[0, -1].float()
        seen = torch.zeros_like(last, dtype=torch.bool)
        seen[prompt + out] = True
        last = torch.where(seen, torch.where(last > 0, last / 1.3, last * 1.3), last)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=last.shape[0]).to(last) if out else 0
        out.append(int((last - 1.5 * counts).argmax()))
    assert [t for o in events[3] for t in o.token_ids] == out
    assert engine.penalties.live == set()


def test_grammar_masks_inside_graph_decode_steps(engine):
    """JSON-schema rows beside plain rows through the decode graphs: every grammar reply validates, the plain rows
    get the tokens they get alone, and every decode step of the run replayed a graph (the mask is applied in the
    sampling after the replay, the matchers advanced while the next forward runs)."""
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    import json

    from ktinject.serve import grammar
    from ktinject.serve.sampling import SamplingParams

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 3}},
              "required": ["name", "n", "tags"], "additionalProperties": False}
    rule = grammar.json_schema(schema, "response_format")
    engine.check_grammar(rule, "response_format")
    prompts = _prompts(engine)
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    held = [SamplingParams(max_tokens=120, temperature=t, seed=i, grammar=rule) for i, t in enumerate((0, 1, 0, 1))]
    alone = [engine.generate(p, plain, timeout=300) for p in prompts[0::2]]
    eager = engine.runner.stats.eager_decode
    mixed = _together(engine, prompts, [plain, held[0], plain, held[1], plain, held[2], plain, held[3]])
    assert engine.runner.stats.eager_decode == eager
    assert [m.token_ids for m in mixed[0::2]] == [a.token_ids for a in alone]
    for r in mixed[1::2]:
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), schema)
