"""Logprobs, penalties and n > 1 through the HTTP API and the official ``openai`` client, on the demo model (the
``served`` fixture of test_serve.py: one engine and server for this module)."""
from __future__ import annotations

import collections
import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.serve.test_serve import NAME, NO_EOS, served  # noqa: E402,F401

MESSAGES = [{"role": "user", "content": "Tell me a story about a robot."}]


def _check_entries(content, k: int):
    for e in content:
        assert e.bytes == list(e.token.encode("utf-8")) and len(e.top_logprobs) == k
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy


def test_chat_logprobs_streamed_and_not(served):
    kw = dict(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
              extra_body=NO_EOS)
    r = served.client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    _check_entries(content, 3)
    assert "".join(e.token for e in content) == r.choices[0].message.content
    chunks = list(served.client.chat.completions.create(**kw, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = served.client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(served):
    r = served.client.completions.create(model=NAME, prompt=served.prompt(5), max_tokens=6, temperature=0, logprobs=2,
                                         extra_body=NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(len(t) <= 2 and max(t.values()) == pytest.approx(x) for t, x in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert "".join(lp.tokens) == r.choices[0].text


def test_a_large_frequency_penalty_stops_a_greedy_reply_repeating(served):
    kw = dict(model=NAME, prompt=served.prompt(5), max_tokens=60, temperature=0, extra_body=NO_EOS)
    ids = served.engine.encode

    def most_repeated(text: str) -> int:
        return collections.Counter(ids(text)).most_common(1)[0][1]

    plain = served.client.completions.create(**kw).choices[0].text
    penalized = served.client.completions.create(**kw, frequency_penalty=2.0).choices[0].text
    assert most_repeated(plain) >= 4, plain
    assert most_repeated(penalized) < most_repeated(plain), (plain, penalized)
    strong = served.client.completions.create(**{**kw, "extra_body": {**NO_EOS, "repetition_penalty": 1.5}})
    assert strong.choices[0].text != plain


def test_n_choices_whole_and_streamed(served):
    kw = dict(model=NAME, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=11, n=3, extra_body=NO_EOS)
    r = served.client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1, texts  # seed + i per choice: not three copies
    assert r.usage.completion_tokens == 30
    assert r.usage.prompt_tokens == len(served.engine.render_chat(MESSAGES))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 30
    chunks = list(served.client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    got, finish = collections.defaultdict(str), {}
    for c in chunks:
        for ch in c.choices:
            got[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert [got[i] for i in range(3)] == texts and finish == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.completion_tokens == 30 and not chunks[-1].choices
    c = served.client.completions.create(model=NAME, prompt="hi", max_tokens=4, n=2, temperature=0, extra_body=NO_EOS)
    assert [x.index for x in c.choices] == [0, 1] and c.choices[0].text == c.choices[1].text  # greedy: the same
    served.wait_idle()
    assert served.engine.scheduler.free_rows == served.engine.config.max_batch


@pytest.mark.parametrize("path,extra,param,words", [
    ("chat/completions", {"n": 0}, "n", "1..16"),
    ("chat/completions", {"n": 17}, "n", "1..16"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ("chat/completions", {"top_logprobs": 3}, "top_logprobs", "logprobs"),
    ("chat/completions", {"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ("chat/completions", {"frequency_penalty": -2.5}, "frequency_penalty", "greater than or equal to -2"),
    ("chat/completions", {"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ("completions", {"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ("completions", {"logprobs": True}, "logprobs", "integer"),
    ("completions", {"best_of": 3}, "best_of", "best_of"),
])
def test_bad_sampling_fields_get_400_naming_them(served, path, extra, param, words):
    body = {"messages": MESSAGES} if path.startswith("chat") else {"prompt": "hi"}
    r = httpx.post(f"{served.url}/v1/{path}", json={**body, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_a_stream_of_n_choices_is_interleaved_by_index(served):
    body = {"model": NAME, "prompt": served.prompt(3), "max_tokens": 6, "n": 2, "stream": True, **NO_EOS}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    order = [c["choices"][0]["index"] for c in chunks]
    assert set(order) == {0, 1} and order != sorted(order), order  # both choices stream at once
