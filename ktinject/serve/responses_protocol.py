"""OpenAI's Responses API bodies: the request (``ResponsesRequest``), checked and turned into what the chat template
takes, and the response object and its output items.

A request is strict pydantic as the chat API's are (``protocol.py``; unknown fields ignored, null is absent).
``input`` is a string (one user message) or a list of items: messages (``role`` user / system / developer /
assistant; content a string or ``input_text`` / ``output_text`` parts), ``function_call`` items (an assistant's
tool calls, consecutive ones in one message), ``function_call_output`` items (``tool`` messages) and ``reasoning``
items (dropped: a template renders no past reasoning). ``instructions`` is a system message before them. ``tools``
are function tools (``{"type": "function", "name", "description", "parameters"}``), given to the template as chat
tools; ``tool_choice`` ``auto`` / ``none`` / ``required`` / ``{"type": "function", "name"}`` as in chat.
``reasoning.effort`` reaches the template as ``reasoning_effort`` (gpt-oss's template reads it).

The server keeps no responses: ``previous_response_id``, ``conversation`` and ``background`` get 400 (send the
whole conversation as ``input``), and so do other tool types, ``text.format`` other than text and input parts
other than text. Output items: ``reasoning`` (its text as ``reasoning_text`` content), ``message`` (one
``output_text``) and ``function_call``, in the reply's order; usage as the Responses API counts it.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pydantic import Field

from ktinject.serve.errors import RequestError, check_unicode
from ktinject.serve.request_model import RequestModel
from ktinject.serve.sampling import SamplingParams

#: fields of a stored-conversation API this stateless server refuses (name -> what to do instead)
_STATEFUL = {"previous_response_id": "send the whole conversation as input",
             "conversation": "send the whole conversation as input",
             "background": "send the request and wait for it (or stream it)"}
_ROLES = ("user", "system", "developer", "assistant")




class ResponsesRequest(RequestModel):
    model: str | None = None
    input: Any
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    reasoning: dict | None = None
    text: dict | None = None
    previous_response_id: Any = None
    conversation: Any = None
    background: bool = False
    parallel_tool_calls: bool = True
    metadata: dict | None = None

    def check(self) -> None:
        for name, instead in _STATEFUL.items():
            if getattr(self, name) not in (None, False):
                raise RequestError(f"{name} is not supported: this server keeps no responses; {instead}",
                                   param=name)
        fmt = (self.text or {}).get("format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise RequestError(f"text.format: only {{\"type\": \"text\"}} is supported, got {_json(fmt)}",
                               param="text.format")
        choice = self.tool_choice
        named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str)
        if choice not in (None, "none", "auto", "required") and not named:
            raise RequestError(f"tool_choice: expected \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                               f"\"name\": ...}}, got {_json(choice)}", param="tool_choice")
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and effort not in ("minimal", "low", "medium", "high"):
            raise RequestError(f"reasoning.effort: expected low, medium or high, got {_json(effort)}",
                               param="reasoning.effort")

    @property
    def forced_tool(self) -> str | None | bool:
        """False: no call forced; None: a call of any tool ("required"); else the tool's name."""
        if self.tool_choice == "required":
            return None
        return self.tool_choice["name"] if isinstance(self.tool_choice, dict) else False

    def chat_tools(self) -> list[dict] | None:
        """The function tools as chat tools (what templates and tool parsers take); None without any."""
        out = []
        for i, tool in enumerate(self.tools or ()):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                got = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
                raise RequestError(f"tools[{i}].type: only function tools are supported, got {_json(got)}",
                                   param=f"tools[{i}].type")
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise RequestError(f"tools[{i}].name: expected the function's name", param=f"tools[{i}].name")
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            out.append({"type": "function", "function": fn})
        return out or None

    def template_kwargs(self) -> dict:
        effort = (self.reasoning or {}).get("effort")
        return {"reasoning_effort": effort} if effort else {}

    def template_messages(self) -> list[dict]:
        """``instructions`` and ``input`` as the chat template's messages."""
        out = [{"role": "system", "content": check_unicode(self.instructions, "instructions")}] \
            if self.instructions else []
        if isinstance(self.input, str):
            if not self.input:
                raise RequestError("input: the input is empty", param="input")
            return out + [{"role": "user", "content": check_unicode(self.input, "input")}]
        if not isinstance(self.input, list) or not self.input:
            raise RequestError("input: expected a string or a non-empty list of items", param="input")
        for i, item in enumerate(self.input):
            _add_item(out, item, f"input[{i}]")
        if not out:
            raise RequestError("input: no message in it", param="input")
        return out

    def sampling(self, defaults: dict, max_tokens: int, special: bool) -> SamplingParams:
        pick = {k: getattr(self, k) if getattr(self, k) is not None else defaults[k] for k in ("temperature", "top_p")}
        return SamplingParams(max_tokens=max_tokens, top_k=defaults["top_k"], skip_special_tokens=not special, **pick)


def _add_item(out: list[dict], item, where: str) -> None:
    """One input item added to the template's messages ``out``."""
    if not isinstance(item, dict):
        raise RequestError(f"{where}: expected an object, got {type(item).__name__}", param=where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise RequestError(f"{where}.role: expected one of {', '.join(_ROLES)}; got {_json(role)}",
                               param=f"{where}.role")
        out.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"), where)})
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise RequestError(f"{where}.{key}: expected a string", param=f"{where}.{key}")
        try:
            args = json.loads(item["arguments"])
        except ValueError:
            args = item["arguments"]
        call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": args}}
        if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
            out[-1]["tool_calls"].append(call)
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if not isinstance(item.get("call_id"), str):
            raise RequestError(f"{where}.call_id: expected a string", param=f"{where}.call_id")
        text = output if isinstance(output, str) else _text(output, where, "output")
        out.append({"role": "tool", "tool_call_id": item["call_id"], "content": check_unicode(text, f"{where}.output")})
    elif kind != "reasoning":
        raise RequestError(f"{where}.type: expected message, function_call, function_call_output or reasoning, got "
                           f"{_json(kind)}", param=f"{where}.type")


def _text(content, where: str, key: str = "content") -> str:
    """A message's content (a string, or text parts) as its text."""
    where = f"{where}.{key}"
    if isinstance(content, str):
        return check_unicode(content, where)
    if not isinstance(content, list):
        raise RequestError(f"{where}: expected a string or a list of text parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{j}]: only text parts (input_text, output_text) are supported, got "
                               f"{_json(kind)}", param=f"{where}[{j}]")
        parts.append(part["text"])
    return check_unicode("".join(parts), where)


def _json(value) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---- responses -----------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str | None, item_id: str | None = None, status: str = "completed") -> dict:
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": item_id or new_id("msg"), "role": "assistant", "status": status,
            "content": content}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: dict, item_id: str | None = None, status: str = "completed", arguments: str | None = None) -> dict:
    """A function_call item of a chat tool call (``{"id", "function": {"name", "arguments"}}``)."""
    fn = call["function"]
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if arguments is None else arguments, "status": status}


def message_items(message: dict) -> list[dict]:
    """The output items of a whole reply's chat message (``chat_output.ChatOutput.message``)."""
    out = [reasoning_item(message["reasoning_content"])] if message.get("reasoning_content") else []
    if message.get("content"):
        out.append(message_item(message["content"]))
    return out + [call_item(c) for c in message.get("tool_calls", ())]


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def response(rid: str, body: ResponsesRequest, model: str, created: int, output: list[dict], status: str,
             use: dict | None = None, params: SamplingParams | None = None) -> dict:
    """The response object; ``status``: in_progress, completed, incomplete (the reply hit max_output_tokens)."""
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "usage": use, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
            "temperature": params.temperature if params else body.temperature,
            "top_p": params.top_p if params else body.top_p, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": None,
            "text": {"format": {"type": "text"}}, "reasoning": body.reasoning or {"effort": None},
            "metadata": body.metadata or {}, "store": False, "truncation": "disabled"}


def now() -> int:
    return int(time.time())
