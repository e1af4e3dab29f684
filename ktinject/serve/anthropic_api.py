"""Anthropic's Messages API on the engine (``add_routes(app, ctx)``): ``POST /v1/messages``, whole or streamed, and
``POST /v1/messages/count_tokens``. Its errors are Anthropic's (``owns(path)``: the app writes every error under
these paths in that shape).

A reply is read as a chat reply is (``chat_output.ChatOutput``: reasoning split at ``<think>``, tool calls by the
family's parser; a forced ``tool_choice``, ``any`` or a named tool, holds it to one call: ``constraints.py``) and
given as content blocks: ``thinking``, ``text``, ``tool_use``. Streamed, it is Anthropic's
event sequence: ``message_start``; per block ``content_block_start``, its deltas (``thinking_delta``,
``text_delta``, ``input_json_delta`` with the call's whole arguments, as a call is parsed once complete),
``content_block_stop``; then ``message_delta`` (``stop_reason``: ``end_turn``, ``max_tokens``, ``stop_sequence``
with the string, ``tool_use``; the output tokens) and ``message_stop``. A failure mid-stream is an ``error`` event.
"""
from __future__ import annotations

import logging

from fastapi import Request
from fastapi.responses import StreamingResponse

from ktinject.serve import anthropic_protocol as ap
from ktinject.serve.api_requests import Replies, ServerContext, check_model, checked, in_thread, \
    start_chat_reply
from ktinject.serve.chat_output import ChatOutput

log = logging.getLogger("ktinject.serve")
PATHS = ("/v1/messages", "/v1/messages/count_tokens")


def owns(path: str) -> bool:
    """Whether errors on ``path`` are Anthropic's."""
    return path in PATHS


def add_routes(app, ctx: ServerContext) -> None:
    engine = ctx.engine

    async def render(body: ap.CountTokensRequest) -> tuple[list[int], list | None]:
        check_model(body.model, ctx.names)
        checked(body.check)
        messages = checked(body.template_messages)
        tools = checked(body.template_tools)
        prompt = await in_thread(engine.render_chat, messages, tools, **body.template_kwargs())
        return prompt, tools

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: ap.CountTokensRequest):
        prompt, _ = await render(body)
        return {"input_tokens": len(prompt)}

    @app.post("/v1/messages")
    async def messages(body: ap.MessagesRequest, request: Request):
        prompt, tools = await render(body)
        replies, output, params = await start_chat_reply(ctx, request, body, prompt, tools, body.max_tokens,
                                                         "messages", "max_tokens")
        mid = ap.message_id()
        if body.stream:
            return StreamingResponse(_stream(replies, output, mid, ctx.names[0], len(prompt)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        events = await replies.collect()
        if events is None:
            return ctx.error(499, "client closed the request", path=request.url.path)
        last = events[0][-1]
        if last.finish_reason in ("error", "cancelled"):
            status = 500 if last.finish_reason == "error" else 503
            return ctx.error(status, last.error or f"the request was {last.finish_reason}", path=request.url.path)
        message = output.message("".join(o.text for o in events[0]))
        stop = ap.stop_reason(last.finish_reason, last.stop_string, bool(message.get("tool_calls")))
        return ap.message_body(mid, ctx.names[0], ap.blocks(message), stop, last.stop_string,
                               ap.usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens))


class _Blocks:
    """The content blocks of a streamed reply as events: the block open, and its index."""

    def __init__(self):
        self.kind: str | None = None  # the open block's type
        self.index = -1

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [ap.event("content_block_stop", {"index": self.index})]

    def open(self, kind: str, block: dict) -> list[str]:
        out = self.close()
        self.kind, self.index = kind, self.index + 1
        return out + [ap.event("content_block_start", {"index": self.index, "content_block": block})]

    def delta(self, part: dict) -> list[str]:
        """The events of one of ChatOutput's parts."""
        if "reasoning_content" in part:
            out = [] if self.kind == "thinking" else self.open("thinking", {"type": "thinking", "thinking": "",
                                                                             "signature": ""})
            return out + [self._delta({"type": "thinking_delta", "thinking": part["reasoning_content"]})]
        if "content" in part:
            out = [] if self.kind == "text" else self.open("text", {"type": "text", "text": ""})
            return out + [self._delta({"type": "text_delta", "text": part["content"]})]
        out = []
        for call in part.get("tool_calls", ()):
            fn = call["function"]
            out += self.open("tool_use", {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}})
            out += [self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})]
            out += self.close()
        return out

    def _delta(self, delta: dict) -> str:
        return ap.event("content_block_delta", {"index": self.index, "delta": delta})


async def _stream(replies: Replies, output: ChatOutput, mid: str, model: str, prompt_len: int):
    blocks = _Blocks()
    try:
        start = ap.message_body(mid, model, [], None, None, ap.usage(prompt_len, 0, 0))
        yield ap.event("message_start", {"message": start})
        while True:
            got = await replies.next()
            if got is None:
                log.info("%s: the client went away; cancelled", replies.id)
                return
            _, out = got
            if out.finish_reason in ("error", "cancelled"):
                kind = "api_error" if out.finish_reason == "error" else "overloaded_error"
                yield ap.event("error", {"error": {"type": kind, "message": out.error or
                                                   f"the request was {out.finish_reason}"}})
                return
            parts = output.feed(out.text) if out.text else []
            if out.finish_reason is not None:
                parts += output.finish()
            for part in parts:
                for line in blocks.delta(part):
                    yield line
            if out.finish_reason is None:
                continue
            for line in blocks.close():
                yield line
            stop = ap.stop_reason(out.finish_reason, out.stop_string, output.calls > 0)
            use = ap.usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
            yield ap.event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": out.stop_string},
                                             "usage": use})
            yield ap.event("message_stop", {})
            return
    finally:
        replies.close()
