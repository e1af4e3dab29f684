"""Anthropic's Messages API bodies: the request (``MessagesRequest``, ``CountTokensRequest``), checked and turned into
what the chat template takes, and the reply's message, stream events and errors.

A request is strict pydantic as OpenAI's are (``protocol.py``; unknown fields ignored, null is absent). ``system``
(text or text blocks) becomes the first message; each message's content blocks become template messages: ``text``
the content, ``thinking`` an assistant's ``reasoning_content``, ``tool_use`` an assistant's ``tool_calls`` (input as
the arguments object), ``tool_result`` a ``tool`` message (``tool_call_id``: its ``tool_use_id``) before the rest of
its user message; other blocks (images, documents) get 400. ``tools`` (``name``, ``description``, ``input_schema``)
go to the template as functions; ``tool_choice`` ``auto`` (the default), ``none`` (no tools rendered, nothing
parsed), ``any`` or ``{"type": "tool", "name": ...}`` (one call forced by a grammar: ``constraints.py``).
``thinking`` ``{"type": "enabled"}`` / ``{"type": "disabled"}`` reaches the template as ``enable_thinking``.

Usage as Anthropic counts it: ``input_tokens`` the prompt tokens computed, ``cache_read_input_tokens`` those restored
from the prefix cache (their sum is the prompt), ``output_tokens`` the reply's.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import Field

from ktinject.serve.errors import RequestError, check_unicode
from ktinject.serve.request_model import RequestModel
from ktinject.serve.sampling import STOP_MAX, TOP_K_MAX, SamplingParams

#: Anthropic's error type of each status (anything else >= 500: api_error)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 529: "overloaded_error"}




class CountTokensRequest(RequestModel):
    """The conversation: what ``/v1/messages/count_tokens`` takes, and the start of a messages request."""

    model: str | None = None
    messages: list[dict] = Field(min_length=1)
    system: Any = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None

    def check(self) -> None:
        kind = (self.tool_choice or {}).get("type", "auto")
        if kind not in ("auto", "none", "any", "tool"):
            raise RequestError(f"tool_choice.type: expected \"auto\", \"none\", \"any\" or \"tool\", got {_json(kind)}",
                               param="tool_choice")
        if kind == "tool" and not isinstance(self.tool_choice.get("name"), str):
            raise RequestError("tool_choice: {\"type\": \"tool\"} needs the tool's \"name\"", param="tool_choice")
        if self.thinking is not None and self.thinking.get("type") not in ("enabled", "disabled"):
            raise RequestError(f"thinking.type: expected \"enabled\" or \"disabled\", got "
                               f"{_json(self.thinking.get('type'))}", param="thinking.type")

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates take them (OpenAI's function form), None with tool_choice none or no tools."""
        if not self.tools or (self.tool_choice or {}).get("type") == "none":
            return None
        out = []
        for i, tool in enumerate(self.tools):
            name, schema = tool.get("name"), tool.get("input_schema")
            if not isinstance(name, str) or not isinstance(schema, dict) or tool.get("type") not in (None, "custom"):
                raise RequestError(f"tools[{i}]: expected {{\"name\": ..., \"input_schema\": {{...}}}} (a client tool; "
                                   f"server tools are not supported)", param=f"tools[{i}]")
            fn = {"name": name, "parameters": schema}
            if isinstance(tool.get("description"), str):
                fn["description"] = tool["description"]
            out.append({"type": "function", "function": fn})
        return out

    @property
    def forced_tool(self) -> str | None | bool:
        """False: no call forced; None: a call of any tool ("any"); else the tool's name."""
        choice = self.tool_choice or {}
        return None if choice.get("type") == "any" else choice["name"] if choice.get("type") == "tool" else False

    def template_kwargs(self) -> dict:
        return {} if self.thinking is None else {"enable_thinking": self.thinking["type"] == "enabled"}

    def template_messages(self) -> list[dict]:
        out = []
        if self.system is not None:
            out.append({"role": "system", "content": _text(self.system, "system")})
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            role = m.get("role") if isinstance(m, dict) else None
            if role not in ("user", "assistant"):
                raise RequestError(f"{where}.role: expected \"user\" or \"assistant\", got {_json(role)}",
                                   param=f"{where}.role")
            content = m.get("content")
            if isinstance(content, str):
                out.append({"role": role, "content": check_unicode(content, f"{where}.content")})
                continue
            if not isinstance(content, list):
                raise RequestError(f"{where}.content: expected a string or a list of content blocks",
                                   param=f"{where}.content")
            out += _blocks(role, content, f"{where}.content")
        return out


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=TOP_K_MAX)
    stream: bool = False
    metadata: dict | None = None

    def sampling(self, defaults: dict, max_tokens: int, special: bool) -> SamplingParams:
        stops = list(dict.fromkeys(self.stop_sequences or ()))
        if len(stops) > STOP_MAX or not all(stops):
            raise RequestError(f"stop_sequences: at most {STOP_MAX} non-empty strings, got {len(stops)}",
                               param="stop_sequences")
        for s in stops:
            check_unicode(s, "stop_sequences")
        pick = {k: getattr(self, k) if getattr(self, k) is not None else defaults[k]
                for k in ("temperature", "top_p", "top_k")}
        return SamplingParams(max_tokens=max_tokens, stop=tuple(stops), skip_special_tokens=not special, **pick)


def _json(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _text(value, where: str) -> str:
    """A string, or a list of text blocks joined, as text."""
    if isinstance(value, str):
        return check_unicode(value, where)
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text" and
                                       isinstance(b.get("text"), str) for b in value):
        return check_unicode("".join(b["text"] for b in value), where)
    raise RequestError(f"{where}: expected a string or a list of text blocks", param=where)


def _blocks(role: str, blocks: list, where: str) -> list[dict]:
    """The template messages of one message's content blocks (see the module docstring)."""
    texts, thoughts, calls, results = [], [], [], []
    allowed = ("text", "thinking", "redacted_thinking", "tool_use") if role == "assistant" else ("text", "tool_result")
    for j, b in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind not in allowed:
            raise RequestError(f"{at}: a {role} message may hold {', '.join(allowed)} blocks, got "
                               f"{_json(kind) if kind is not None else 'a block without a type'}", param=at)
        if kind == "text":
            texts.append(_text([b], f"{at}.text"))
        elif kind == "thinking":
            thoughts.append(_text(b.get("thinking", ""), f"{at}.thinking"))
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or \
                    not isinstance(b.get("input"), dict):
                raise RequestError(f"{at}: a tool_use block needs id, name and an input object", param=at)
            calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b["input"]}})
        elif kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise RequestError(f"{at}.tool_use_id: expected a string", param=f"{at}.tool_use_id")
            result = b.get("content", "")
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": _text(result, f"{at}.content") if result != "" else ""})
    out = list(results)
    if role == "assistant":
        msg = {"role": "assistant", "content": "".join(texts)}
        if thoughts:
            msg["reasoning_content"] = "".join(thoughts)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif texts or not results:
        out.append({"role": "user", "content": "".join(texts)})
    return out


# ---- replies -----------------------------------------------------------------------------------------------------
def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"input_tokens": prompt - cached, "output_tokens": completion, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def stop_reason(finish: str, stop_string: str | None, calls: bool) -> str:
    """Anthropic's stop_reason of an engine finish reason."""
    if finish == "length":
        return "max_tokens"
    if stop_string is not None:
        return "stop_sequence"
    return "tool_use" if calls else "end_turn"


def blocks(message: dict) -> list[dict]:
    """The content blocks of a reply's message (``ChatOutput.message``): thinking, text, tool_use."""
    out = []
    if message.get("reasoning_content"):
        out.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        out.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls", ()):
        fn = call["function"]
        out.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": json.loads(fn["arguments"])})
    return out or [{"type": "text", "text": ""}]


def message_body(mid: str, model: str, content: list[dict], stop: str | None, stop_sequence: str | None,
                 use: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop, "stop_sequence": stop_sequence, "usage": use}


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message.encode("utf-8", "backslashreplace")
                                       .decode("utf-8")}}


def event(name: str, body: dict) -> str:
    """One server-sent event of Anthropic's stream: its ``event:`` line and its data (which repeats the type)."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **body}, ensure_ascii=False)}\n\n"
