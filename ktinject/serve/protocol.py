"""The OpenAI request bodies the server takes, checked, and the response bodies it writes.

Requests are pydantic models in strict mode (a number sent as a string is an error, as OpenAI's API has it); unknown
fields are ignored, and null for an optional field is its default. Fields whose JSON type varies (``content``,
``stop``, ``prompt``) are checked here by hand so that errors name the field plainly (``messages[1].content``).
Parameters the engine does not implement (echo, suffix, best_of > 1) are refused with 400 rather than ignored.
``response_format`` (``text``, ``json_object``, ``json_schema``) and a forced ``tool_choice`` (``"required"``, a named
function) are checked for shape here and become grammars in ``constraints.py``. Extensions, as in vLLM:
``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``chat_template_kwargs``.
"""
from __future__ import annotations

import json
import re
import time
from typing import Any

from pydantic import Field

from ktinject.serve.errors import RequestError, check_unicode
from ktinject.serve.request_model import RequestModel
from ktinject.serve.logprobs import MAX_TOP
from ktinject.serve.sampling import STOP_MAX, TOP_K_MAX, SamplingParams

#: the most choices (``n``) a request may ask for: each is a request of the engine, holding a KV-cache row
N_MAX = 16




class StreamOptions(RequestModel):
    include_usage: bool = False


class _Common(RequestModel):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=TOP_K_MAX)
    seed: int | None = Field(None, ge=-2**63, lt=2**64)  # int64 or uint64, as clients send them
    stop: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    logit_bias: dict | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    ignore_eos: bool = False

    def check_unsupported(self, extra: dict) -> None:
        if not 1 <= self.n <= N_MAX:
            raise RequestError(f"n: choices per request must be in 1..{N_MAX}, got {self.n}", param="n")
        for name, (value, fine) in extra.items():
            if value is not None and value is not False and not fine(value):
                raise RequestError(f"{name} is not supported (got {_json(value)})", param=name)

    def logprob_count(self) -> int | None:
        """SamplingParams.logprobs: None (none), or how many top entries each token gets."""
        return None

    def sampling(self, defaults: dict, max_tokens: int) -> SamplingParams:
        pick = {k: getattr(self, k) if getattr(self, k) is not None else defaults[k]
                for k in ("temperature", "top_p", "top_k")}
        return SamplingParams(max_tokens=max_tokens, seed=self.seed, stop=stop_strings(self.stop),
                              ignore_eos=self.ignore_eos, min_p=self.min_p or 0.0,
                              logit_bias=logit_bias(self.logit_bias), logprobs=self.logprob_count(),
                              presence_penalty=self.presence_penalty or 0.0,
                              frequency_penalty=self.frequency_penalty or 0.0,
                              repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                              **pick)


class ChatRequest(_Common):
    messages: list[dict] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict] | None = None
    tool_choice: Any = None
    response_format: Any = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP)
    chat_template_kwargs: dict | None = None

    def check(self) -> None:
        self.check_unsupported({})
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs \"logprobs\": true", param="top_logprobs")
        _check_response_format(self.response_format)
        choice = self.tool_choice
        named = isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str)
        if choice not in (None, "none", "auto", "required") and not named:
            raise RequestError(f"tool_choice: expected \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                               f"\"function\": {{\"name\": ...}}}}, got {_json(choice)}", param="tool_choice")
        if self.forced_tool is not False and self.json_format:
            raise RequestError("response_format cannot be combined with a forced tool_choice (the reply is the "
                               "call)", param="response_format")
        for i, tool in enumerate(self.tools or []):
            fn = tool.get("function")
            if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise RequestError(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                                   param=f"tools[{i}]")

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def forced_tool(self) -> str | None | bool:
        """False: no call forced; None: a call of any tool ("required"); else the tool's name."""
        if self.tool_choice == "required":
            return None
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return False

    @property
    def json_format(self) -> bool:
        """Whether ``response_format`` holds the reply to JSON."""
        return isinstance(self.response_format, dict) and self.response_format.get("type") != "text"

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def limit_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def template_messages(self) -> list[dict]:
        """The messages as the chat template takes them: text content, roles checked."""
        out = []
        for i, m in enumerate(self.messages):
            role = m.get("role")
            if role not in ("system", "developer", "user", "assistant", "tool"):
                raise RequestError(f"messages[{i}].role: expected one of system, developer, user, assistant, tool; got "
                                   f"{role!r}", param=f"messages[{i}].role")
            # null is absent here too (a template testing `tool_calls is defined` or its length must not see None)
            msg = {k: v for k, v in m.items()
                   if k in ("name", "tool_calls", "tool_call_id", "reasoning_content") and v is not None}
            if isinstance(msg.get("tool_calls"), list):
                msg["tool_calls"] = _template_tool_calls(msg["tool_calls"])
            msg["role"] = "system" if role == "developer" else role
            text = _content_text(m.get("content", _ABSENT), i, tool_calls=bool(m.get("tool_calls")))
            msg["content"] = check_unicode(text, f"messages[{i}].content")
            if isinstance(msg.get("name"), str):
                check_unicode(msg["name"], f"messages[{i}].name")
            out.append(msg)
        return out

    def template_kwargs(self) -> dict:
        kw = dict(self.chat_template_kwargs or {})
        bad = [k for k in kw if k in _TEMPLATE_OWN]
        if bad:
            raise RequestError(f"chat_template_kwargs may not set {bad[0]}", param="chat_template_kwargs")
        return kw


#: apply_chat_template's own arguments, never the client's: the template itself (a client's Jinja would run on the
#: server, as long as it likes, and replace the model's prompt format), the conversation, tokenization and output
_TEMPLATE_OWN = frozenset(("chat_template", "tools", "tokenize", "add_generation_prompt", "continue_final_message",
                           "messages", "conversation", "padding", "truncation", "max_length", "return_tensors",
                           "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"))


class CompletionRequest(_Common):
    prompt: Any
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP)

    def check(self) -> None:
        self.check_unsupported({"echo": (self.echo, _no), "suffix": (self.suffix, _no),
                                "best_of": (self.best_of, lambda v: v == self.n)})

    def logprob_count(self) -> int | None:
        return self.logprobs

    @property
    def limit(self) -> int | None:
        return self.max_tokens

    @property
    def limit_param(self) -> str:
        return "max_tokens"

    def prompt_value(self) -> str | list[int]:
        """The one prompt: a string, or token ids."""
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise RequestError("prompt: the prompt is empty", param="prompt")
            return p  # (its characters: Engine.encode checks them, as for every prompt)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
            raise RequestError(f"prompt: one prompt per request is supported, got {len(p)}", param="prompt")
        raise RequestError("prompt: expected a non-empty string or a list of token ids", param="prompt")


def _no(value) -> bool:
    return False


def _json(value) -> str:
    """A client's value as JSON (true, {"type": ...}), as it was sent, for messages; cut at 80 characters."""
    try:
        text = json.dumps(value)  # ASCII: a lone surrogate stays an escape (UTF-8 cannot carry it)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


#: response_format's json_schema name: OpenAI's pattern
_SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _check_response_format(value) -> None:
    """RequestError naming the field where ``response_format`` is not OpenAI's shape."""
    param = "response_format"
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise RequestError(f"{param}: expected {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or {{\"type\": "
                           f"\"json_schema\", \"json_schema\": {{...}}}}, got {_json(value)}", param=param)
    if kind != "json_schema":
        return
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError(f"{param}.json_schema: expected an object with name and schema",
                           param=f"{param}.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise RequestError(f"{param}.json_schema.name: expected 1-64 letters, digits, _ or -, got {_json(name)}",
                           param=f"{param}.json_schema.name")
    if "schema" in spec and not isinstance(spec["schema"], dict):
        raise RequestError(f"{param}.json_schema.schema: expected a JSON schema object, got {_json(spec['schema'])}",
                           param=f"{param}.json_schema.schema")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise RequestError(f"{param}.json_schema.strict: expected a boolean", param=f"{param}.json_schema.strict")


def logit_bias(bias: dict | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` as (id, bias) pairs; RequestError naming the field for a key that is no id or
    a bias that is no number (SamplingParams checks the ranges)."""
    out = []
    for key, value in (bias or {}).items():
        if not (isinstance(key, str) and key.isdigit()) or isinstance(value, bool) or \
                not isinstance(value, (int, float)):
            raise RequestError(f"logit_bias: expected token ids (as strings) mapped to numbers, got {_json(key)}: "
                               f"{_json(value)}", param="logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


def stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise RequestError("stop: expected a non-empty string or a list of non-empty strings", param="stop")
    if len(items) > STOP_MAX:  # (counted before duplicates go: SamplingParams counts what is left)
        raise RequestError(f"stop: at most {STOP_MAX} stop strings, got {len(items)}", param="stop")
    for s in items:
        check_unicode(s, "stop")
    return tuple(dict.fromkeys(items))


def _template_tool_calls(calls: list) -> list:
    """An assistant message's tool calls as chat templates read them: each call's ``arguments`` (JSON text, as
    OpenAI clients send them back) as an object where it parses as one (templates render it with ``tojson`` or
    iterate over its items; a string would come out quoted twice)."""
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            out.append(call)
            continue
        fn = dict(call["function"])
        if isinstance(fn.get("arguments"), str):
            try:
                parsed = json.loads(fn["arguments"])
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                fn["arguments"] = parsed
        out.append({**call, "function": fn})
    return out


_ABSENT = object()  # a message without "content" (its error says so, not "null")


def _content_text(content, i: int, tool_calls: bool) -> str:
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if content is None or content is _ABSENT:
        if tool_calls:
            return ""
        raise RequestError(f"{where}: expected a string or a list of text parts, got "
                           f"{'nothing' if content is _ABSENT else 'null'} (only a message with tool_calls may have no "
                           f"content)", param=where)
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                got = (f"type {part['type']!r}" if isinstance(part, dict) and part.get("type") is not None
                       else "a part without a type" if isinstance(part, dict)
                       else "null" if part is None else type(part).__name__)
                raise RequestError(f"{where}[{j}]: only text parts are supported, got {got}", param=f"{where}[{j}]")
            if not isinstance(part.get("text"), str):
                text = part.get("text")
                got = "nothing" if "text" not in part else "null" if text is None else type(text).__name__
                raise RequestError(f"{where}[{j}].text: expected a string, got {got}", param=f"{where}[{j}].text")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}: expected a string or a list of text parts, got {type(content).__name__}",
                       param=where)


# ---- responses -----------------------------------------------------------------------------------------------
def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    """OpenAI's usage; ``cached``: prompt tokens restored from the prefix cache (``prompt_tokens_details``)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # a surrogate in it: escaped, never a 500
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def chat_choice(index: int, message: dict, finish: str, logprobs: dict | None = None) -> dict:
    """One choice of a chat reply: ``message`` (``chat_output.ChatOutput.message``, or role and content)."""
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def chat_response(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict | None, finish: str | None = None,
               use: dict | None = None, index: int = 0, logprobs: dict | None = None) -> dict:
    choices = [] if delta is None else [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish}]
    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


def completion_choice(index: int, text: str, finish: str, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def completion_response(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": use}


def completion_chunk(rid: str, model: str, created: int, text: str | None, finish: str | None = None,
                     use: dict | None = None, index: int = 0, logprobs: dict | None = None) -> dict:
    choices = [] if text is None else [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]
    body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body
