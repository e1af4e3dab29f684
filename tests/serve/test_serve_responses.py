"""OpenAI's Responses API (``POST /v1/responses``) through the official ``openai`` client: on the demo model (the
reply the same as chat's for the same messages, streamed and not, usage, ``incomplete`` at ``max_output_tokens``),
and against an engine of recorded replies (reasoning and function_call items, a tool round trip, the stream's event
order, gpt-oss's harmony replies); unsupported fields refused with a 400 in OpenAI's shape that names them."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.serve.test_serve import NAME, _free_server, served  # noqa: E402,F401
from tests.serve.test_serve_tools import CALL, HARMONY_CALL, RecordedEngine  # noqa: E402

TOOL = {"type": "function", "name": "get_weather", "description": "weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


# ---- the demo model ------------------------------------------------------------------------------------------
def test_text_reply_is_chats_reply(served):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea."}]
    chat = served.client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    r = served.client.responses.create(model=NAME, instructions="Be brief.", input="Tell me about the sea.",
                                       max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.output_text == chat.choices[0].message.content
    assert [i.type for i in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    want = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert r.status == want and (r.incomplete_details is None) == (want == "completed")
    # the same as message items
    r2 = served.client.responses.create(model=NAME, input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me about the sea."}]}],
        max_output_tokens=8, temperature=0)
    assert r2.output_text == r.output_text


def test_streamed_reply_is_the_whole_reply(served):
    kw = dict(model=NAME, input="Tell me about the sea.", max_output_tokens=8, temperature=0)
    whole = served.client.responses.create(**kw)
    events = list(served.client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text and events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


# ---- recorded replies ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recorded():
    from ktinject.serve.api import create_app

    apps = {}
    for kind in ("qwen3_moe", "gpt_oss"):
        engine = RecordedEngine(kind)
        server, thread, sock = _free_server(create_app(engine, "recorded"))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        apps[kind] = (engine, openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0), url, server, thread)
    yield apps
    for _, _, _, server, thread in apps.values():
        server.should_exit = True
        thread.join(10)


def _items(r):
    return [(i.type, getattr(i, "name", None)) for i in r.output]


@pytest.mark.parametrize("kind,reply", [("qwen3_moe", "<think>the user wants weather</think>\n\n" + CALL),
                                        ("gpt_oss", HARMONY_CALL)])
def test_tool_round_trip(recorded, kind, reply):
    engine, client = recorded[kind][:2]
    engine.replies[:] = [reply, "It is sunny."]
    r = client.responses.create(model="recorded", input="Weather in Paris?", tools=[TOOL])
    assert _items(r) == [("reasoning", None), ("function_call", "get_weather")] and r.status == "completed"
    assert r.output[0].content[0].text == "the user wants weather"
    call = r.output[1]
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    assert engine.rendered[-1][1] == [{"type": "function", "function": {
        k: TOOL[k] for k in ("name", "description", "parameters")}}]
    r2 = client.responses.create(model="recorded", tools=[TOOL], input=[
        {"role": "user", "content": "Weather in Paris?"}, r.output[0].model_dump(), call.model_dump(),
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}])
    assert r2.output_text == "It is sunny." and _items(r2) == [("message", None)]
    messages = engine.rendered[-1][0]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert messages[2] == {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "sunny"}'}


@pytest.mark.parametrize("kind,reply", [("qwen3_moe", "<think>plan</think>\n\nLet me check. " + CALL),
                                        ("gpt_oss", "<|channel|>analysis<|message|>plan<|end|><|start|>assistant"
                                                    "<|channel|>commentary<|message|>Let me check. <|end|>"
                                         + HARMONY_CALL.split("<|end|>")[1])])
def test_streamed_items_in_order(recorded, kind, reply):
    engine, client = recorded[kind][:2]
    engine.replies[:] = [reply]
    events = list(client.responses.create(model="recorded", input="Weather?", tools=[TOOL], stream=True))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert added == [i.type for i in done] == ["reasoning", "message", "function_call"]
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1, 2]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "plan"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta").strip() == "Let me check."
    args = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert [json.loads(a) for a in args] == [{"city": "Paris"}] and events[-1].type == "response.completed"
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message", "function_call"]


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": "hi", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": "hi", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": ""}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_unsupported_and_bad_fields_get_a_400_naming_them(recorded, body, param):
    url = recorded["qwen3_moe"][2]
    r = httpx.post(f"{url}/v1/responses", json={"model": "recorded", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    client = recorded["qwen3_moe"][1]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="recorded", **body)
