"""Anthropic's Messages API through the official ``anthropic`` client: a tool round trip (tool_use -> tool_result ->
answer) whole and streamed against recorded replies (test_serve_tools.py's engine), the stream's event order, errors in
Anthropic's shape, count_tokens; stop reasons and the API key against the demo model (test_serve.py's server)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")

from tests.serve.test_serve import NAME, _free_server, served  # noqa: E402,F401
from tests.serve.test_serve_tools import CALL, RecordedEngine  # noqa: E402

TOOLS = [{"name": "get_weather", "description": "weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def recorded():
    from ktinject.serve.api import create_app

    engine = RecordedEngine()
    server, thread, sock = _free_server(create_app(engine, "recorded"))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield engine, anthropic.Anthropic(base_url=url, api_key="x", max_retries=0), url
    server.should_exit = True
    thread.join(10)


def _round_trip(engine, client, stream: bool):
    engine.replies[:] = ["<think>the user wants weather</think>\n\n" + CALL, "It is sunny in Paris."]
    kw = dict(model="recorded", max_tokens=100, tools=TOOLS, messages=ASK)
    if stream:
        with client.messages.stream(**kw) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**kw)
    assert [b.type for b in message.content] == ["thinking", "tool_use"] and message.stop_reason == "tool_use"
    thinking, call = message.content
    assert thinking.thinking == "the user wants weather"
    assert call.name == "get_weather" and call.input == {"city": "Paris"}
    assert engine.params[-1].skip_special_tokens is False
    messages = ASK + [{"role": "assistant", "content": [b.model_dump() for b in message.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                    "content": [{"type": "text", "text": '{"sky": "sunny"}'}]}]}]
    answer = client.messages.create(model="recorded", max_tokens=100, tools=TOOLS, messages=messages)
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text == "It is sunny in Paris."
    assert answer.stop_reason == "end_turn" and answer.usage.input_tokens == 3
    rendered, tools, _ = engine.rendered[-1]
    assert tools == [{"type": "function", "function": {"name": "get_weather", "parameters": TOOLS[0]["input_schema"],
                                                       "description": "weather of a city"}}]
    assert rendered[1] == {"role": "assistant", "content": "", "reasoning_content": "the user wants weather",
                           "tool_calls": [{"id": call.id, "type": "function",
                                           "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert rendered[2] == {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}


def test_tool_round_trip(recorded):
    _round_trip(*recorded[:2], stream=False)


def test_tool_round_trip_streamed(recorded):
    _round_trip(*recorded[:2], stream=True)


def _events(url: str, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", f"{url}/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert len(names) == len(datas) and all(d["type"] == n for n, d in zip(names, datas))
    return list(zip(names, datas))


def test_stream_event_order(recorded):
    engine, _, url = recorded
    engine.replies[:] = ["<think>hmm</think>Let me look." + CALL]
    events = _events(url, {"model": "recorded", "max_tokens": 50, "tools": TOOLS, "messages": ASK, "stream": True})
    names = [n for n, _ in events]
    # collapse runs of deltas: the order of the blocks is what Anthropic's clients rely on
    order = [n for i, n in enumerate(names) if n != "content_block_delta" or names[i - 1] != n]
    assert order == ["message_start"] + ["content_block_start", "content_block_delta", "content_block_stop"] * 3 + \
        ["message_delta", "message_stop"]
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    kinds = {d["delta"]["type"] for n, d in events if n == "content_block_delta"}
    assert kinds == {"thinking_delta", "text_delta", "input_json_delta"}
    assert [d["index"] for n, d in events if n == "content_block_start"] == [0, 1, 2]
    args = "".join(d["delta"]["partial_json"] for n, d in events
                   if d.get("delta", {}).get("type") == "input_json_delta")
    assert json.loads(args) == {"city": "Paris"}
    delta = next(d for n, d in events if n == "message_delta")
    assert delta["delta"]["stop_reason"] == "tool_use" and delta["usage"]["output_tokens"] > 0


def test_tool_choice_none_renders_no_tools(recorded):
    engine, client, _ = recorded
    engine.replies[:] = [CALL]
    m = client.messages.create(model="recorded", max_tokens=10, tools=TOOLS, tool_choice={"type": "none"},
                               messages=ASK)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == CALL and engine.rendered[-1][1] is None


@pytest.mark.parametrize("body,words", [
    ({"messages": ASK}, "max_tokens: this field is required"),
    ({"max_tokens": 0, "messages": ASK}, "greater than or equal to 1"),
    ({"max_tokens": 5, "messages": []}, "at least 1"),
    ({"max_tokens": 5, "messages": ASK, "temperature": 1.5}, "less than or equal to 1"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]: a user message may hold text, tool_result blocks, got \"image\""),
    ({"max_tokens": 5, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0]"),
    ({"max_tokens": 5, "messages": ASK, "stop_sequences": [""]}, "stop_sequences"),
])
def test_bad_requests_get_anthropic_errors(recorded, body, words):
    r = httpx.post(f"{recorded[2]}/v1/messages", json={"model": "recorded", **body})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert words in r.json()["error"]["message"], r.text


def test_errors_of_the_client_and_of_other_paths(recorded):
    _, client, url = recorded
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-opus", max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-opus" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="recorded", max_tokens=5, messages=ASK, tool_choice={"type": "tool", "name": "x"},
                               tools=TOOLS)
    r = httpx.post(f"{url}/v1/messages", content=b'{"max_tokens": 5', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "error" in httpx.post(f"{url}/v1/completions", json={"prompt": 5}).json()  # OpenAI's shape stays there
    assert httpx.post(f"{url}/v1/completions", json={"prompt": 5}).json()["error"]["param"] == "prompt"


def test_count_tokens(recorded):
    engine, client, _ = recorded
    got = client.messages.count_tokens(model="recorded", messages=ASK, system="Be brief.", tools=TOOLS)
    assert got.input_tokens == 3  # (the recorded engine renders every chat as 3 tokens)
    messages, tools, _ = engine.rendered[-1]
    assert messages[0] == {"role": "system", "content": "Be brief."} and tools[0]["function"]["name"] == "get_weather"


# ---- the demo model ------------------------------------------------------------------------------------------
def test_stop_reasons_and_usage_on_the_demo_model(served):
    client = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0)
    ask = [{"role": "user", "content": "Tell me a story."}]
    long = client.messages.create(model=NAME, max_tokens=12, extra_body={"temperature": 0}, messages=ask,
                                  system=[{"type": "text", "text": "Be brief."}])
    prompt = served.engine.render_chat([{"role": "system", "content": "Be brief."}] + ask)
    assert long.usage.input_tokens + long.usage.cache_read_input_tokens == len(prompt)
    assert long.stop_reason in ("max_tokens", "end_turn") and long.usage.output_tokens <= 12
    text = long.content[0].text
    word = next(w for w in text.split() if len(w) > 2 and text.index(w) > 0)
    cut = client.messages.create(model=NAME, max_tokens=12, extra_body={"temperature": 0}, messages=ask,
                                 stop_sequences=[word], system="Be brief.")
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == text[:text.index(word)]
    with client.messages.stream(model=NAME, max_tokens=12, extra_body={"temperature": 0}, messages=ask,
                                system="Be brief.") as s:
        streamed = s.get_final_message()
    assert streamed.content[0].text == text and streamed.stop_reason == long.stop_reason


def test_x_api_key_is_accepted_and_errors_under_messages_are_anthropic(served):
    from fastapi.testclient import TestClient

    from ktinject.serve.api import create_app

    body = {"model": NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(create_app(served.engine, NAME, api_key="sekret")) as client:
        r = client.post("/v1/messages", json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert client.post("/v1/messages", json=body, headers={"x-api-key": "sekret"}).status_code == 200
        assert client.post("/v1/messages", json=body, headers={"x-api-key": "wrong"}).status_code == 401
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                           headers={"x-api-key": "sekret"}).status_code == 200
