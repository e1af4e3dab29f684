"""ktinject.serve's parts without a model: the scheduler's admission and row logic, per-row sampling, incremental
text with stop strings, the Prometheus text and the request checks. Fast (no model, no server)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from ktinject.serve.metrics import Metrics
from ktinject.serve.sampling import Sampler, SamplingParams, sample
from ktinject.serve.errors import QueueFull
from ktinject.serve.scheduler import MIN_SHARED, Scheduler
from ktinject.serve.detokenizer import Detokenizer


@dataclass(eq=False)
class Seq:
    name: str
    prompt_len: int
    row: int | None = None
    prefilled: int = 0


def _prefill_all(s: Scheduler, budget: int = 10**9, chunk: int = 10**9, max_len: int | None = None) -> list:
    """Run next_prefill/prefilled until nothing is left in the budget: per forward, its jobs as (name, row, start,
    end)."""
    forwards = []
    while jobs := s.next_prefill(budget, chunk, max_len):
        forwards.append([(j.seq.name, j.row, j.start, j.end) for j in jobs])
        rows = [j.row for j in jobs]
        assert rows == list(range(len(s.running), len(s.running) + len(jobs)))  # consecutive, after the running
        budget -= sum(j.end - j.start for j in jobs)
        s.prefilled(jobs)
        s.check()
    return forwards


# ---- scheduler -----------------------------------------------------------------------------------------------
def test_admission_fills_rows_in_order_and_queues_the_rest():
    s = Scheduler(max_batch=3, max_queue=2)
    seqs = [Seq(f"r{i}", 4) for i in range(5)]
    for q in seqs:
        s.submit(q)
    assert _prefill_all(s) == [[("r0", 0, 0, 4), ("r1", 1, 0, 4), ("r2", 2, 0, 4)]]  # one forward for three
    assert [q.row for q in s.running] == [0, 1, 2] and len(s.waiting) == 2 and s.free_rows == 0
    with pytest.raises(QueueFull, match="max-queue"):
        s.submit(Seq("r5", 1))  # 3 rows busy, 2 waiting = the limit
    assert s.next_prefill(100, 100) == []  # no free row


def test_queue_limit_counts_only_requests_beyond_the_free_rows():
    s = Scheduler(max_batch=2, max_queue=0)
    s.submit(Seq("a", 1))
    s.submit(Seq("b", 1))  # two free rows take both at the next step
    with pytest.raises(QueueFull):
        s.submit(Seq("c", 1))


def test_chunked_prefill_spends_the_budget_oldest_first_and_leaves_one_half_done():
    s = Scheduler(max_batch=4, max_queue=8)
    long, short, other = Seq("long", 10), Seq("short", 2), Seq("other", 5)
    for q in (long, short, other):
        s.submit(q)
    assert _prefill_all(s, budget=4, chunk=4) == [[("long", 0, 0, 4)]]
    assert s.prefilling is long and long.prefilled == 4 and not s.running
    assert _prefill_all(s, budget=4, chunk=4) == [[("long", 0, 4, 8)]]
    # the end of "long" (2 tokens) and "short" (2) are each too short to share a padded forward; "other"'s first
    # chunk (4) does not fit the 1 token left: it waits for the next step instead of being cut
    assert _prefill_all(s, budget=5, chunk=4) == [[("long", 0, 8, 10)], [("short", 1, 0, 2)]]
    assert [q.name for q in s.running] == ["long", "short"] and s.prefilling is None and s.waiting[0] is other
    assert _prefill_all(s, budget=4, chunk=4) == [[("other", 2, 0, 4)]]
    assert _prefill_all(s, budget=4, chunk=4) == [[("other", 2, 4, 5)]] and s.running[-1] is other


def test_a_prompt_is_cut_at_the_same_places_whatever_else_the_steps_hold(seed=0):
    """The chunks of a prompt are [0, c), [c, 2c), ... of its own tokens, alone or among other requests and
    whatever budget earlier requests left in a step (so its forwards, and its tokens, do not depend on them);
    only chunks of at least MIN_SHARED tokens share a forward."""
    rng = random.Random(seed)
    for trial in range(50):
        chunk = rng.randint(1, 12)
        s = Scheduler(max_batch=rng.randint(1, 6), max_queue=100)
        seqs = [Seq(f"s{i}", rng.randint(1, 40)) for i in range(rng.randint(1, 12))]
        cuts = {q.name: [] for q in seqs}
        pending = list(seqs)
        for step in range(500):
            while pending and rng.random() < 0.5:
                s.submit(pending.pop(0))
            budget = chunk
            while jobs := s.next_prefill(budget, chunk):
                assert sum(j.end - j.start for j in jobs) <= budget
                assert len(jobs) == 1 or all(j.end - j.start >= MIN_SHARED for j in jobs)
                for j in jobs:
                    cuts[j.seq.name].append((j.start, j.end))
                budget -= sum(j.end - j.start for j in jobs)
                s.prefilled(jobs)
                s.check()
            if s.running and rng.random() < 0.3:
                s.release_many(rng.sample(s.running, rng.randint(1, len(s.running))))
            if not pending and s.idle():
                break
        for q in seqs:
            grid = [(a, min(a + chunk, q.prompt_len)) for a in range(0, q.prompt_len, chunk)]
            assert cuts[q.name] == grid, (chunk, q.prompt_len, cuts[q.name])


def test_short_prompts_share_a_forward_within_the_chunk_and_the_cache():
    s = Scheduler(max_batch=8, max_queue=8)
    seqs = [Seq(n, k) for n, k in (("a", 5), ("b", 4), ("c", 4), ("d", 9), ("e", 2), ("f", 4))]
    for q in seqs:
        s.submit(q)
    # padded: 2 x 5 = 10, 3 x 5 = 15 <= 16; d would make 4 x 9 = 36; then d alone (e is shorter than MIN_SHARED);
    # e alone; f alone (the last)
    assert _prefill_all(s, chunk=16) == [[("a", 0, 0, 5), ("b", 1, 0, 4), ("c", 2, 0, 4)], [("d", 3, 0, 9)],
                                         [("e", 4, 0, 2)], [("f", 5, 0, 4)]]
    t = Scheduler(max_batch=8, max_queue=8)
    for q in (Seq("x", 14), Seq("y", 5), Seq("z", 4)):
        t.submit(q)
    assert _prefill_all(t, budget=10, chunk=10) == [[("x", 0, 0, 10)]]
    # x's last 4 tokens start at 10: padded to y's 5 they would end at 15 > the cache of 14, so y waits; z joins y
    assert _prefill_all(t, budget=10, chunk=10, max_len=14) == [[("x", 0, 10, 14)], [("y", 1, 0, 5)]]
    assert _prefill_all(t, budget=10, chunk=10, max_len=14) == [[("z", 2, 0, 4)]]


def test_a_failed_prefill_forward_gives_its_rows_back():
    s = Scheduler(max_batch=4, max_queue=4)
    for q in (Seq("a", 4), Seq("b", 4)):
        s.submit(q)
    jobs = s.next_prefill(100, 100)
    assert s.free_rows == 2 and not s.idle()
    assert [q.name for q in s.prefill_failed(jobs)] == ["a", "b"]
    assert s.free_rows == 4 and s.idle()


def test_release_moves_the_last_row_into_the_hole_and_the_half_prefilled_one_behind_it():
    s = Scheduler(max_batch=5, max_queue=8)
    seqs = [Seq(f"r{i}", 2) for i in range(4)]
    late = Seq("late", 9)
    for q in (*seqs, late):
        s.submit(q)
    _prefill_all(s, budget=2 * 4 + 3, chunk=3)
    assert [q.row for q in seqs] == [0, 1, 2, 3] and s.prefilling is late and late.row == 4
    assert s.release(seqs[1]) == [(3, 1), (4, 3)]  # r3 fills row 1, the half-prefilled request moves to row 3
    s.check()
    assert [q.name for q in s.running] == ["r0", "r3", "r2"] and late.row == 3 and seqs[1].row is None
    assert s.release(seqs[2]) == [(3, 2)]  # the last running row: only the prefilling one moves down
    s.check()
    assert s.release(late) == [] and s.prefilling is None and s.free_rows == 3
    assert s.release(Seq("stranger", 1)) == []


def test_release_many_frees_the_top_rows_with_fewest_moves():
    s = Scheduler(max_batch=6, max_queue=8)
    seqs = [Seq(f"r{i}", 1) for i in range(6)]
    for q in seqs:
        s.submit(q)
    _prefill_all(s)
    moves, freed = s.release_many([seqs[1], seqs[5], seqs[3]])
    s.check()
    assert moves == [(4, 1)]  # r4, the one survivor above the new end (row 3), fills the hole at row 1
    assert sorted(q.name for q in s.running) == ["r0", "r2", "r4"] and freed == [3, 4, 5]


def test_a_waiting_request_takes_a_freed_row_at_the_next_prefill():
    s = Scheduler(max_batch=2, max_queue=4)
    a, b, c = Seq("a", 1), Seq("b", 1), Seq("c", 3)
    for q in (a, b, c):
        s.submit(q)
    _prefill_all(s)
    assert s.waiting[0] is c
    s.release(a)
    assert _prefill_all(s) == [[("c", 1, 0, 3)]] and [q.name for q in s.running] == ["b", "c"]
    s.release(c)  # a waiting request cancelled before it got a row
    s.submit(d := Seq("d", 1))
    s.release(d)
    assert not s.waiting and s.free_rows == 1


def test_random_admissions_and_releases_keep_the_layout(seed=0):
    rng = random.Random(seed)
    s = Scheduler(max_batch=5, max_queue=50)
    live = []
    for step in range(400):
        if rng.random() < 0.5:
            q = Seq(f"s{step}", rng.randint(1, 12))
            try:
                s.submit(q)
                live.append(q)
            except QueueFull:
                pass
        _prefill_all(s, budget=rng.randint(0, 8), chunk=rng.randint(1, 6))
        if live and rng.random() < 0.4:
            gone = rng.sample(live, rng.randint(1, min(3, len(live))))
            rows_before = {q.name: q.row for q in s.running}
            moves, freed = s.release_many(gone)
            for q in gone:
                live.remove(q)
            assert all(src > dst for src, dst in moves)  # rows only move down
            assert all(q.row == i for i, q in enumerate(s.running)) and rows_before is not None
        s.check()


# ---- sampling ------------------------------------------------------------------------------------------------
def test_greedy_rows_take_the_argmax_and_sampled_rows_follow_their_own_seed():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    greedy, hot = SamplingParams(max_tokens=1, temperature=0), SamplingParams(max_tokens=1, temperature=1.0, seed=7)
    first = sample(logits, [greedy, hot, greedy], [greedy.rng(), hot.rng(), greedy.rng()])
    assert first[0] == int(logits[0].argmax()) and first[2] == int(logits[2].argmax())
    alone = sample(logits[1:2], [hot], [hot.rng()])  # the same seed alone: the same token
    assert alone == [first[1]]


def test_top_k_1_and_tiny_top_p_are_greedy_and_the_distribution_is_followed():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    rng = random.Random(3)
    for p in (SamplingParams(max_tokens=1, temperature=1.5, top_k=1), SamplingParams(max_tokens=1, top_p=1e-6)):
        assert {sample(logits, [p], [rng])[0] for _ in range(30)} == {1}
    p = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.8)  # probs .09 .64 .24 .03: tokens 1, 2 kept
    counts = torch.bincount(torch.tensor([sample(logits, [p], [rng])[0] for _ in range(2000)]), minlength=4)
    assert counts[0] == 0 and counts[3] == 0 and 0.68 < counts[1] / 2000 < 0.78  # .64 / (.64 + .24)


def test_sampler_writes_each_row_into_its_slot_as_alone_step_after_step():
    """The engine's Sampler: tokens into a view of the rows' next tokens (other rows untouched), a seeded row draws
    what it draws alone whatever the rows beside it, and its staging buffers (two, used in turn) keep no stale
    parameters from the step before."""
    g = torch.Generator().manual_seed(1)
    params = [SamplingParams(max_tokens=1, temperature=0), SamplingParams(max_tokens=1, temperature=0.7, seed=3),
              SamplingParams(max_tokens=1, temperature=1.3, top_p=0.8, top_k=9, seed=4),
              SamplingParams(max_tokens=1, temperature=0)]
    sampler = Sampler(6, torch.device("cpu"))
    together = [p.rng() for p in params]
    alone = [p.rng() for p in params]
    next_tokens = torch.full((6,), -1, dtype=torch.long)
    for step in range(4):
        logits = torch.randn(4, 300, generator=g).to(torch.bfloat16)
        rows = [0, 1, 2, 3] if step % 2 == 0 else [1, 3]  # the sampled rows change from step to step
        sampler(logits[rows], [params[i] for i in rows], [together[i] for i in rows], next_tokens[1:1 + len(rows)])
        want = [sample(logits[i:i + 1], [params[i]], [alone[i]])[0] for i in rows]
        assert next_tokens[1:1 + len(rows)].tolist() == want, step
        assert next_tokens[0] == -1 and next_tokens[5] == -1


def test_sampling_params_name_the_bad_field():
    from ktinject.serve.engine import RequestError

    for kw, field in [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 1, "top_p": 0}, "top_p"),
                      ({"max_tokens": 1, "temperature": -1}, "temperature"), ({"max_tokens": 1, "stop": ("",)}, "stop")]:
        with pytest.raises(RequestError) as e:
            SamplingParams(**kw)
        assert e.value.param == field


def test_tiny_temperatures_are_greedy_and_top_k_is_bounded():
    """A temperature too small for float32 logits / temperature to stay finite samples greedily (it gave noise), and
    a top_k past TOP_K_MAX is refused (a 400-digit one failed the whole prefill forward it shared)."""
    from ktinject.serve import sampling
    from ktinject.serve.engine import RequestError

    for t in (0.0, 1e-300, 5e-324, sampling.GREEDY_BELOW / 2):
        assert SamplingParams(max_tokens=1, temperature=t).greedy
    assert not SamplingParams(max_tokens=1, temperature=sampling.GREEDY_BELOW).greedy
    logits = torch.randn(3, 50)
    params = [SamplingParams(max_tokens=1, temperature=1e-300)] * 3
    assert sample(logits, params, [random.Random(0)] * 3) == logits.argmax(-1).tolist()
    assert SamplingParams(max_tokens=1, top_k=sampling.TOP_K_MAX).top_k == sampling.TOP_K_MAX
    with pytest.raises(RequestError) as e:
        SamplingParams(max_tokens=1, top_k=10 ** 400)
    assert e.value.param == "top_k"


# ---- text ----------------------------------------------------------------------------------------------------
class CharTokenizer:
    """Token i decodes to VOCAB[i]; '\\xff' stands for an incomplete byte (decodes to U+FFFD until its pair)."""

    VOCAB = ["", "Hel", "lo", " wor", "ld", "!", " ST", "OP", "\xe2", "\x82\xac", "END"]

    def decode(self, ids, **kw):
        raw = "".join(self.VOCAB[i] for i in ids).encode("latin-1")
        return raw.decode("utf-8", errors="replace")


def _run(stream: Detokenizer, ids) -> list[str]:
    return [stream.push(i) for i in ids] + [stream.finish()]


def test_text_waits_for_whole_characters():
    out = _run(Detokenizer(CharTokenizer()), [1, 2, 8, 9, 5])
    assert out == ["Hel", "lo", "", "\u20ac", "!", ""]


def test_stop_string_across_tokens_ends_the_text_before_it():
    s = Detokenizer(CharTokenizer(), stop=("STOP",))
    out = _run(s, [1, 2, 6, 7, 3])
    assert "".join(out) == "Hello " and s.stopped == "STOP"
    assert out[2] == " "  # "ST" is held: it may be the start of STOP
    assert s.push(4) == ""  # nothing after the stop


def test_held_text_is_released_when_it_turns_out_not_to_be_a_stop():
    s = Detokenizer(CharTokenizer(), stop=("STOP", "!!"))
    assert _run(s, [1, 6, 3, 5]) == ["Hel", " ", "ST wor", "", "!"]
    assert s.stopped is None


# ---- metrics and protocol ------------------------------------------------------------------------------------
def test_prometheus_text_has_the_gauges_counters_and_histogram():
    m = Metrics()
    m.first_token(0.07)
    m.first_token(3.0)
    m.decode_step(4, 0.01)
    m.token(5)
    m.finish("length")
    text = m.render(running=2, waiting=1, slots=8)
    assert "ktinject_requests_running 2" in text and "ktinject_requests_waiting 1" in text
    assert "ktinject_generation_tokens_total 5" in text
    assert 'ktinject_time_to_first_token_seconds_bucket{le="0.1"} 1' in text
    assert 'ktinject_time_to_first_token_seconds_bucket{le="+Inf"} 2' in text
    assert 'ktinject_requests_finished_total{finish_reason="length"} 1' in text
    assert m.decode_rate() > 0
    for line in text.splitlines():  # every sample line: name{labels} number
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


def test_request_checks_name_the_field():
    from ktinject.serve.engine import RequestError
    pydantic = pytest.importorskip("pydantic", reason="the request schemas need the serve extra (pip install -e "
                                   "\".[serve]\")")
    from ktinject.serve.protocol import ChatRequest, CompletionRequest, stop_strings

    def param(fn):
        with pytest.raises(RequestError) as e:
            fn()
        return e.value.param

    chat = ChatRequest.model_validate
    assert param(lambda: chat({"messages": [{"role": "robot", "content": "x"}]}).template_messages()) == \
        "messages[0].role"
    assert param(lambda: chat({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
                 .template_messages()) == "messages[0].content[0]"
    assert param(lambda: chat({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]})
                 .template_messages()) == "messages[0].content[0].text"
    for msg, got in (({"role": "user"}, "got nothing"), ({"role": "user", "content": None}, "got null")):
        with pytest.raises(RequestError, match=f"messages\\[0\\].content: expected a string .*, {got} "):
            chat({"messages": [msg]}).template_messages()
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    as_object = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]
    # a message with tool_calls may have no content; its calls' arguments (JSON text) reach the template as objects
    assert chat({"messages": [{"role": "assistant", "content": None, "tool_calls": calls}]}).template_messages() == [
        {"role": "assistant", "content": "", "tool_calls": as_object}]
    assert calls[0]["function"]["arguments"] == "{}"  # the request itself is left as it was
    odd = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]  # not an object: as sent
    assert chat({"messages": [{"role": "assistant", "tool_calls": odd}]}).template_messages()[0]["tool_calls"] == odd
    # null keys of a message are left out (a template must not see tool_calls None), and do not excuse the content
    assert chat({"messages": [{"role": "user", "content": "x", "name": None}]}).template_messages() == [
        {"role": "user", "content": "x"}]
    assert param(lambda: chat({"messages": [{"role": "user", "content": None, "tool_calls": None}]})
                 .template_messages()) == "messages[0].content"
    for bad, got in (({"text": "x"}, "got a part without a type"), (None, "got null"), (3, "got int"),
                     ({"type": "image_url"}, "got type 'image_url'")):
        with pytest.raises(RequestError, match=f"content\\[0\\]: only text parts are supported, {got}$"):
            chat({"messages": [{"role": "user", "content": [bad]}]}).template_messages()
    assert param(lambda: chat({"messages": [{"role": "user", "content": "x"}], "n": 17}).check()) == "n"
    assert param(lambda: chat({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}).check()) == \
        "top_logprobs"  # (without "logprobs": true)
    assert param(lambda: chat({"messages": [{"role": "user", "content": "x"}], "tool_choice": "always"})
                 .check()) == "tool_choice"
    assert param(lambda: stop_strings(["a", 3])) == "stop"
    assert param(lambda: CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompt_value()) == "prompt"
    assert param(lambda: CompletionRequest.model_validate({"prompt": ""}).prompt_value()) == "prompt"
    assert CompletionRequest.model_validate({"prompt": [[5, 6]]}).prompt_value() == [5, 6]
    msgs = chat({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]}]})
    assert msgs.template_messages() == [{"role": "system", "content": "ab"}]
    # null is the default for every optional field (OpenAI's schema makes them nullable), never for a required one
    nulls = {k: None for k in ("stream", "n", "ignore_eos", "stream_options", "temperature", "max_tokens", "stop")}
    req = chat({"messages": [{"role": "user", "content": "x"}], **nulls})
    req.check()
    assert req.stream is False and req.n == 1 and req.ignore_eos is False and req.temperature is None
    done = CompletionRequest.model_validate({"prompt": "x", "echo": None, "best_of": None, **nulls})
    done.check()
    assert done.echo is False and done.stream is False
    with pytest.raises(pydantic.ValidationError, match="messages"):
        chat({"messages": None})
    with pytest.raises(pydantic.ValidationError, match="stream"):
        chat({"messages": [{"role": "user", "content": "x"}], "stream": "yes"})  # a wrong type is still refused


def test_held_text_matches_a_plain_search(seed=0):
    """Detokenizer._held (the longest end of the text that begins a stop string) against the plain definition, on
    random texts and stop strings over a small alphabet (many partial matches)."""
    rng = random.Random(seed)
    for _ in range(2000):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
        stops = tuple("".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3)))
        ts = Detokenizer(CharTokenizer(), stop=stops)
        ts.text = text
        want = max((n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])),
                   default=0)
        assert ts._held() == want, (text, stops)


def test_body_limit_middleware_reads_chunks_and_hands_the_body_on_whole():
    """serve.api_middleware.BodyLimit at the ASGI level: a body in several messages reaches the app as one, later
    receives go to the connection; over the limit by Content-Length (nothing read) or mid-stream: 413 and no app; a
    client gone before its body is whole: nothing at all."""
    pytest.importorskip("fastapi", reason="the server needs the serve extra (pip install -e \".[serve]\")")
    import asyncio

    from ktinject.serve.api_middleware import BodyLimit

    def run(messages, headers=(), limit=10, path="/v1/completions"):
        got, sent, reads = [], [], []

        async def receive():
            reads.append(1)
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def app(scope, receive, send):
            got.append(await receive())
            got.append(await receive())

        async def send(message):
            sent.append(message)

        def reply(status, message, **kw):
            async def respond(scope, receive, send):
                await send({"status": status, "message": message})
            return respond

        scope = {"type": "http", "method": "POST", "headers": list(headers), "path": path}
        asyncio.run(BodyLimit(app, limit, reply)(scope, receive, send))
        return got, sent, len(reads)

    part = lambda body, more: {"type": "http.request", "body": body, "more_body": more}  # noqa: E731
    got, sent, _ = run([part(b"abc", True), part(b"def", True), part(b"g", False)])
    assert got == [part(b"abcdefg", False), {"type": "http.disconnect"}] and sent == []
    got, sent, reads = run([part(b"abcdef", True), part(b"ghijkl", True), part(b"m", False)])
    assert got == [] and sent[0]["status"] == 413 and reads == 2  # stopped reading at the 11th byte
    got, sent, reads = run([part(b"x" * 50, False)], headers=[(b"content-length", b"50")])
    assert got == [] and sent[0]["status"] == 413 and reads == 0  # by its Content-Length: nothing read
    got, sent, _ = run([part(b"abc", True), {"type": "http.disconnect"}])
    assert got == [] and sent == []  # the client went away mid-body: no answer, no app
    assert run([part(b"0123456789", False)])[0][0] == part(b"0123456789", False)  # exactly the limit: served
    got, sent, reads = run([part(b"x", False)], headers=[(b"content-length", b"9" * 5000)])
    assert sent[0]["status"] == 413 and reads == 0  # a 5,000-digit Content-Length: too big, not a 500
    got, sent, reads = run([part(b"x" * 50, True), part(b"", False)], path="/health")
    assert got[0] == part(b"x" * 50, True) and sent == [] and reads == 2  # not an endpoint with a body: untouched
