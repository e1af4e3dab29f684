"""The request kinds of ``soak_serve.py --mix``: how each is built and how its stream is checked.

Kinds: ``plain`` (chat), ``tools`` (chat with two tools, tool_choice "auto", or "required" where llguidance is
installed), ``json`` (response_format json_schema; a reply that finished with "stop" must parse and validate),
``anthropic`` (/v1/messages streamed; the event order is checked), ``n4`` (chat with n = 4: four choices back).
Every kind streams, so that any of them can be the one a client leaves mid-stream."""
from __future__ import annotations

import importlib.util
import json

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "days", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "a city's weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]
SCHEMA_OF = {"get_weather": WEATHER, "add": ADD}
REPLY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                          "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                   "maxItems": 3}},
         "required": ["name", "age", "tags"], "additionalProperties": False}

ALL_KINDS = ("plain", "tools", "json", "anthropic", "n4")
N = 4  # choices of an n4 request


def grammar_ok() -> bool:
    """Whether the grammar kinds can run: llguidance in the server, jsonschema to judge the replies."""
    return all(importlib.util.find_spec(m) for m in ("llguidance", "jsonschema"))


def kinds(grammar: bool) -> tuple[str, ...]:
    return ALL_KINDS if grammar else tuple(k for k in ALL_KINDS if k != "json")


def build(kind: str, rng, name: str, text: str, max_tokens: int, sampled: dict, drop: bool,
          grammar: bool) -> tuple[str, dict]:
    """(path, body) of one streamed request of ``kind``. ``ignore_eos`` where the client may go away (a grammar
    refuses it: those requests may end before the client leaves, which then is no disconnect)."""
    messages = [{"role": "user", "content": text}]
    if kind == "anthropic":
        return "/v1/messages", {"model": name, "max_tokens": max_tokens, "messages": messages, "stream": True,
                                **{k: v for k, v in sampled.items() if k == "temperature"}}
    body = {"model": name, "messages": messages, "max_tokens": max_tokens, "stream": True, **sampled}
    if kind == "tools":
        body["tools"] = TOOLS
        body["tool_choice"] = "required" if grammar and rng.random() < 0.5 else "auto"
    elif kind == "json":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "reply", "schema": REPLY, "strict": True}}
    elif kind == "n4":
        body["n"] = N
    if drop and "response_format" not in body and body.get("tool_choice") != "required":
        body["ignore_eos"] = True
    return "/v1/chat/completions", body


def stream(client, kind: str, path: str, body: dict, drop: bool, after: int) -> tuple[int, bool, str | None]:
    """One streamed request: (chunks, disconnected, error or None). A client that was to go away but saw its
    stream end first (a grammar's or the model's end) returns disconnected False and judges the reply."""
    try:
        with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                return 0, False, f"{kind}: HTTP {resp.status_code}: {resp.read()[:200]!r}"
            read = _anthropic if kind == "anthropic" else _openai
            chunks, left, error = read(resp.iter_lines(), kind, body, after if drop else None)
            return chunks, left, error
    except Exception as e:  # noqa: BLE001 - counted and reported
        return 0, False, f"{kind}: {type(e).__name__}: {e}"


def _openai(lines, kind: str, body: dict, after: int | None) -> tuple[int, bool, str | None]:
    chunks, text, finish, calls = 0, {}, {}, {}
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        data = json.loads(line[6:])
        if "error" in data:
            return chunks, False, f"{kind}: error in the stream: {data['error']}"
        for choice in data.get("choices") or ():
            i, delta = choice["index"], choice.get("delta") or {}
            text[i] = text.get(i, "") + (delta.get("content") or "")
            for t in delta.get("tool_calls") or ():
                call = calls.setdefault((i, t["index"]), {"name": "", "arguments": ""})
                fn = t.get("function") or {}
                call["name"] += fn.get("name") or ""
                call["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                finish[i] = choice["finish_reason"]
        chunks += 1
        if after is not None and chunks >= after:
            return chunks, True, None  # leaving the block closes the connection mid-stream
    return chunks, False, _judge_openai(kind, body, text, finish, calls)


def _judge_openai(kind: str, body: dict, text: dict, finish: dict, calls: dict) -> str | None:
    want = list(range(N if kind == "n4" else 1))
    if sorted(finish) != want:
        return f"{kind}: choices that finished {sorted(finish)}, want {want}"
    ok = ("stop", "length", "tool_calls") if kind == "tools" else ("stop", "length")
    if any(f not in ok for f in finish.values()):
        return f"{kind}: finish_reason {finish}"
    if kind == "json" and finish[0] == "stop":
        import jsonschema

        try:
            jsonschema.validate(json.loads(text[0]), REPLY)
        except (ValueError, jsonschema.ValidationError) as e:
            return f"json: the reply {text[0][:200]!r} does not validate: {e}"
    if kind == "tools" and body["tool_choice"] == "required" and finish[0] != "length":
        if finish[0] != "tool_calls" or not calls:
            return f"tools required: finish {finish[0]}, {len(calls)} calls"
    if kind == "tools" and finish[0] == "tool_calls":
        import jsonschema

        for call in calls.values():
            try:
                jsonschema.validate(json.loads(call["arguments"]), SCHEMA_OF[call["name"]])
            except (ValueError, KeyError, jsonschema.ValidationError) as e:
                return f"tools: the call {call} does not validate: {type(e).__name__}: {e}"
    return None


def _anthropic(lines, kind: str, body: dict, after: int | None) -> tuple[int, bool, str | None]:
    names, event, chunks, stop_reason = [], None, 0, None
    for line in lines:
        if line.startswith("event: "):
            event = line[7:]
            continue
        if not line.startswith("data: ") or event is None:
            continue
        data = json.loads(line[6:])
        if event == "error":
            return chunks, False, f"anthropic: error event {data}"
        if event != "ping":
            names.append(event)
        if event == "message_delta":
            stop_reason = (data.get("delta") or {}).get("stop_reason")
        if event == "content_block_delta":
            chunks += 1
            if after is not None and chunks >= after:
                return chunks, True, None
        event = None
    return chunks, False, _judge_events(names, stop_reason)


def _judge_events(names: list[str], stop_reason: str | None) -> str | None:
    """message_start, then blocks of content_block_start, content_block_delta..., content_block_stop, then
    message_delta and message_stop."""
    bad = f"anthropic: event order {names}"
    if names[:1] != ["message_start"] or names[-2:] != ["message_delta", "message_stop"]:
        return bad
    inside = False
    for n in names[1:-2]:
        if n == "content_block_start" and not inside:
            inside = True
        elif n in ("content_block_delta", "content_block_stop") and inside:
            inside = n == "content_block_delta"
        else:
            return bad
    if inside:
        return bad
    if stop_reason not in ("end_turn", "max_tokens", "stop_sequence"):
        return f"anthropic: stop_reason {stop_reason}"
    return None
