"""Tool calls and reasoning through the HTTP API and the official ``openai`` client, against an engine that replies
with recorded model outputs (the parsers' own tables: test_tool_parsers.py): a tool-call round trip streamed and
not, ``finish_reason: "tool_calls"``, ``reasoning_content`` split, ``tool`` messages reaching the template."""
from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from ktinject.serve.types import EngineConfig, Output  # noqa: E402

from tests.serve.test_serve import _free_server  # noqa: E402

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


class RecordedEngine:
    """The engine's face the API uses; each request's reply is the next of ``replies``, sent in 5-character pieces
    (markers split across events), ending with "stop". ``rendered``: what each chat request rendered."""

    name = "recorded"

    def __init__(self, model_type="qwen3_moe"):
        self.config = EngineConfig(max_context=4096)
        self.model = SimpleNamespace(config=SimpleNamespace(model_type=model_type))
        self.alive, self.failure = True, None
        self.replies, self.rendered, self.params = [], [], []
        self.tail = ""

    def counts(self):
        return {"running": 0, "waiting": 0, "free_rows": 8}

    def default_params(self):
        return {"temperature": 0.0, "top_p": 1.0, "top_k": 0}

    def check_length(self, prompt_len, max_tokens, prompt_param="prompt", limit_param="max_tokens"):
        return self.config.check_length(prompt_len, max_tokens, prompt_param, limit_param)

    def render_chat(self, messages, tools=None, **kw):
        self.rendered.append((messages, tools, kw))
        return [1, 2, 3]

    def prompt_tail_text(self, ids, tokens=4):
        return self.tail

    def encode(self, text):
        return [1]

    def submit(self, prompt, params, sink):
        self.params.append(params)
        text = self.replies.pop(0)
        req = SimpleNamespace(id=f"r{len(self.params)}", cancel=lambda: None)

        def run():
            pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
            for p in pieces[:-1]:
                sink(Output(req.id, p, [0]))
            sink(Output(req.id, pieces[-1] if pieces else "", [0], "stop", 3, len(pieces)))

        threading.Thread(target=run, daemon=True).start()
        return req


@pytest.fixture(scope="module")
def served():
    from ktinject.serve.api import create_app

    engine = RecordedEngine()
    server, thread, sock = _free_server(create_app(engine, "recorded"))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="x", max_retries=0)
    yield engine, client
    server.should_exit = True
    thread.join(10)


def _round_trip(engine, client, stream: bool):
    engine.replies[:] = ["<think>the user wants weather</think>\n\n" + CALL, "It is sunny in Paris."]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    if stream:
        calls, reasoning, content, finish = {}, "", "", None
        for chunk in client.chat.completions.create(model="recorded", messages=messages, tools=TOOLS, stream=True):
            d = chunk.choices[0].delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            for c in d.tool_calls or ():
                calls.setdefault(c.index, {"id": c.id, "name": "", "arguments": ""})
                calls[c.index]["name"] += c.function.name or ""
                calls[c.index]["arguments"] += c.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        call = calls[0]
    else:
        r = client.chat.completions.create(model="recorded", messages=messages, tools=TOOLS)
        m, finish = r.choices[0].message, r.choices[0].finish_reason
        reasoning, content = m.model_extra.get("reasoning_content"), m.content
        c = m.tool_calls[0]
        call = {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
    assert finish == "tool_calls" and reasoning == "the user wants weather" and not content
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert engine.params[-1].skip_special_tokens is False  # the markers may be special tokens
    messages += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "sunny"}'}]
    r = client.chat.completions.create(model="recorded", messages=messages, tools=TOOLS)
    assert r.choices[0].message.content == "It is sunny in Paris." and r.choices[0].finish_reason == "stop"
    rendered, tools, _ = engine.rendered[-1]
    assert tools == TOOLS
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object for the template
    assert rendered[2] == {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "sunny"}'}


def test_tool_call_round_trip(served):
    _round_trip(*served, stream=False)


def test_tool_call_round_trip_streamed(served):
    _round_trip(*served, stream=True)


def test_tool_choice_none_leaves_the_tools_out_and_the_reply_text(served):
    engine, client = served
    engine.replies[:] = [CALL]
    r = client.chat.completions.create(model="recorded", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                       tool_choice="none")
    assert r.choices[0].message.content == CALL and r.choices[0].finish_reason == "stop"
    assert engine.rendered[-1][1] is None and engine.params[-1].skip_special_tokens is True


def test_without_tools_a_call_shaped_reply_is_text(served):
    engine, client = served
    engine.replies[:] = [CALL]
    r = client.chat.completions.create(model="recorded", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls


def test_reasoning_when_the_prompt_opened_the_think_block(served):
    engine, client = served
    engine.tail, engine.replies[:] = "<|im_start|>assistant\n<think>\n", ["weighing it</think>\n\nYes."]
    try:
        r = client.chat.completions.create(model="recorded", messages=[{"role": "user", "content": "hi"}])
    finally:
        engine.tail = ""
    m = r.choices[0].message
    assert (m.model_extra.get("reasoning_content"), m.content) == ("weighing it", "Yes.")


def test_a_malformed_call_stays_text_and_finishes_with_stop(served):
    engine, client = served
    bad = '<tool_call>{"name": "get_weather", "arguments": {</tool_call>'
    engine.replies[:] = [bad]
    chunks = list(client.chat.completions.create(model="recorded", messages=[{"role": "user", "content": "hi"}],
                                                 tools=TOOLS, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == bad
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("choice", ["sometimes", {"type": "function", "function": {"name": "get_time"}}])
def test_a_bad_or_unknown_tool_choice_is_refused_naming_it(served, choice):
    """(Forced calls themselves: test_serve_structured.py, through constrained decoding on the demo model.)"""
    engine, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="recorded", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                       tool_choice=choice)
    assert e.value.body["param"] == "tool_choice"


def test_parsers_chosen_and_overridden():
    from ktinject.serve.chat_output import chat_parsers

    engine = RecordedEngine("deepseek_v3")
    assert chat_parsers(engine, "auto", "auto") == ("deepseek_v3", "think")
    assert chat_parsers(engine, "hermes", "none") == ("qwen3", None)
    assert chat_parsers(RecordedEngine("mixtral"), "auto", "auto") == (None, None)
    with pytest.raises(ValueError):
        chat_parsers(engine, "nope", "auto")


HARMONY_CALL = ('<|channel|>analysis<|message|>the user wants weather<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')  # (<|call|>: end token)


@pytest.fixture(scope="module")
def served_gpt_oss():
    from ktinject.serve.api import create_app

    engine = RecordedEngine("gpt_oss")
    server, thread, sock = _free_server(create_app(engine, "recorded"))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="x", max_retries=0)
    yield engine, client, sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


@pytest.mark.parametrize("stream", [False, True])
def test_gpt_oss_harmony_call_and_reasoning(served_gpt_oss, stream):
    engine, client, _ = served_gpt_oss
    engine.replies[:] = [HARMONY_CALL]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    if stream:
        reasoning, content, names, args, finish = "", "", "", "", None
        for chunk in client.chat.completions.create(model="recorded", messages=messages, tools=TOOLS, stream=True):
            d = chunk.choices[0].delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            for c in d.tool_calls or ():
                names += c.function.name or ""
                args += c.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
    else:
        r = client.chat.completions.create(model="recorded", messages=messages, tools=TOOLS)
        m, finish = r.choices[0].message, r.choices[0].finish_reason
        reasoning, content = m.model_extra.get("reasoning_content"), m.content
        names, args = m.tool_calls[0].function.name, m.tool_calls[0].function.arguments
    assert (reasoning, content or "", names, json.loads(args), finish) == \
        ("the user wants weather", "", "get_weather", {"city": "Paris"}, "tool_calls")
    assert engine.params[-1].skip_special_tokens is False


def test_gpt_oss_answer_without_tools_is_split_by_channel(served_gpt_oss):
    """Without tools the markers are kept too (they are special tokens), the channels split, the reply no call."""
    engine, client, port = served_gpt_oss
    engine.replies[:] = ["<|channel|>analysis<|message|>greeting<|end|><|start|>assistant<|channel|>final"
                         "<|message|>Hello!"] * 2
    r = client.chat.completions.create(model="recorded", messages=[{"role": "user", "content": "hi"}])
    m = r.choices[0].message
    assert (m.model_extra.get("reasoning_content"), m.content, r.choices[0].finish_reason) == \
        ("greeting", "Hello!", "stop")
    assert engine.params[-1].skip_special_tokens is False
    import httpx

    body = httpx.post(f"http://127.0.0.1:{port}/v1/messages", json={
        "model": "recorded", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}).json()
    assert [b["type"] for b in body["content"]] == ["thinking", "text"] and body["content"][1]["text"] == "Hello!"
