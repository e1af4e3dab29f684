"""OpenAI's Responses API on the engine: ``POST /v1/responses`` (``add_routes(app, ctx)``), whole or streamed.

A request (``responses_protocol.ResponsesRequest``) is rendered by the chat template as a chat request is, submitted
as one engine request (``api_requests.Replies``) and its reply read as a chat reply is (``chat_output.ChatOutput``:
reasoning, content and tool calls by the model's parsers); a forced ``tool_choice`` holds it to one call
(``constraints.py``). The reply's parts become output items in order: ``reasoning``, ``message`` (``output_text``),
``function_call``. A reply cut at ``max_output_tokens`` has status ``incomplete``. Errors are OpenAI's shape.

Streamed, as server-sent events each named by its ``type`` and numbered by ``sequence_number``:
``response.created``, ``response.in_progress``, then per item ``response.output_item.added``, its deltas
(``response.reasoning_text.delta``; ``response.content_part.added``, ``response.output_text.delta``;
``response.function_call_arguments.delta``: a call's whole arguments at once, as calls are parsed when complete),
their ``.done`` events and ``response.output_item.done``; last ``response.completed`` (or ``response.incomplete``)
with the whole response and its usage. A generation that fails ends with ``response.failed``.
"""
from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.responses import StreamingResponse

from ktinject.serve import responses_protocol as rp
from ktinject.serve.api_requests import Replies, ServerContext, check_model, checked, failure, in_thread, \
    start_chat_reply
from ktinject.serve.chat_output import ChatOutput

log = logging.getLogger("ktinject.serve")


def add_routes(app, ctx: ServerContext) -> None:
    engine = ctx.engine

    @app.post("/v1/responses")
    async def responses(body: rp.ResponsesRequest, request: Request):
        check_model(body.model, ctx.names)
        checked(body.check)
        messages = checked(body.template_messages)
        tools = checked(body.chat_tools) if body.tool_choice != "none" else None
        prompt = await in_thread(engine.render_chat, messages, tools, **body.template_kwargs())
        replies, output, params = await start_chat_reply(ctx, request, body, prompt, tools, body.max_output_tokens,
                                                         "input", "max_output_tokens")
        rid, created = f"resp_{replies.id}", rp.now()
        if body.stream:
            stream = _Stream(replies, output, rid, created, ctx.names[0], body, params)
            return StreamingResponse(stream.events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        events = await replies.collect()
        if events is None:  # the client left
            return ctx.error(499, "client closed the request")
        last = events[0][-1]
        bad = failure([last])
        if bad is not None and bad.finish_reason == "error":
            return ctx.error(500, bad.error or "generation failed", code="generation_failed")
        if bad is not None:
            return ctx.error(503, bad.error or "the request was cancelled", code="cancelled")
        items = rp.message_items(output.message("".join(o.text for o in events[0])))
        return rp.response(rid, body, ctx.names[0], created, items, _status(last), _usage(last), params)


def _status(last) -> str:
    return "incomplete" if last.finish_reason == "length" else "completed"


def _usage(last) -> dict:
    return rp.usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)


class _Stream:
    """The server-sent events of a streamed response (see the module docstring)."""

    def __init__(self, replies: Replies, output: ChatOutput, rid: str, created: int, model: str, body, params):
        self.replies, self.output, self.rid, self.created, self.model = replies, output, rid, created, model
        self.body, self.params = body, params
        self.seq = 0
        self.items: list[dict] = []  # the items done
        self.open: dict | None = None  # the item being streamed: reasoning or message
        self.text = ""  # the open item's text so far

    def sse(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def response(self, status: str, use: dict | None = None) -> dict:
        return rp.response(self.rid, self.body, self.model, self.created, list(self.items), status, use, self.params)

    def close(self) -> list[str]:
        """The events that end the open item, if any."""
        item, self.open = self.open, None
        if item is None:
            return []
        at = {"item_id": item["id"], "output_index": len(self.items), "content_index": 0}
        if item["type"] == "reasoning":
            done = rp.reasoning_item(self.text, item["id"])
            out = [self.sse("response.reasoning_text.done", **at, text=self.text)]
        else:
            done = rp.message_item(self.text, item["id"])
            out = [self.sse("response.output_text.done", **at, text=self.text, logprobs=[]),
                   self.sse("response.content_part.done", **at, part=rp.output_text(self.text))]
        self.items.append(done)
        return out + [self.sse("response.output_item.done", output_index=len(self.items) - 1, item=done)]

    def text_delta(self, kind: str, text: str) -> list[str]:
        """Events of reasoning (``kind`` "reasoning") or content text: the item opened where it is a new one."""
        out = []
        if self.open is None or self.open["type"] != kind:
            out = self.close()
            self.open = rp.reasoning_item("", status="in_progress") if kind == "reasoning" else \
                rp.message_item(None, status="in_progress")
            self.text = ""
            out.append(self.sse("response.output_item.added", output_index=len(self.items), item=self.open))
            if kind == "message":
                out.append(self.sse("response.content_part.added", item_id=self.open["id"],
                                    output_index=len(self.items), content_index=0, part=rp.output_text("")))
        self.text += text
        at = {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        return out + [self.sse(name, **at, delta=text, **({} if kind == "reasoning" else {"logprobs": []}))]

    def call(self, call: dict) -> list[str]:
        out = self.close()
        item = rp.call_item(call)
        at = {"item_id": item["id"], "output_index": len(self.items)}
        out.append(self.sse("response.output_item.added", output_index=len(self.items),
                            item={**item, "arguments": "", "status": "in_progress"}))
        out.append(self.sse("response.function_call_arguments.delta", **at, delta=item["arguments"]))
        out.append(self.sse("response.function_call_arguments.done", **at, name=item["name"],
                            arguments=item["arguments"]))
        self.items.append(item)
        return out + [self.sse("response.output_item.done", output_index=len(self.items) - 1, item=item)]

    def parts(self, deltas: list[dict]) -> list[str]:
        out = []
        for d in deltas:
            if d.get("reasoning_content"):
                out += self.text_delta("reasoning", d["reasoning_content"])
            if d.get("content"):
                out += self.text_delta("message", d["content"])
            for c in d.get("tool_calls", ()):
                out += self.call(c)
        return out

    async def events(self):
        try:
            yield self.sse("response.created", response=self.response("in_progress"))
            yield self.sse("response.in_progress", response=self.response("in_progress"))
            while True:
                got = await self.replies.next()
                if got is None:
                    log.info("%s: the client went away; cancelled", self.replies.id)
                    return
                _, out = got
                if out.finish_reason in ("error", "cancelled"):
                    failed = self.response("failed")
                    failed["error"] = {"code": "server_error", "message": out.error or f"the request was "
                                                                                       f"{out.finish_reason}"}
                    yield self.sse("response.failed", response=failed)
                    return
                deltas = self.output.feed(out.text) if out.text else []
                if out.finish_reason is not None:
                    deltas += self.output.finish()
                for line in self.parts(deltas):
                    yield line
                if out.finish_reason is None:
                    continue
                for line in self.close():
                    yield line
                status = _status(out)
                yield self.sse(f"response.{status}", response=self.response(status, _usage(out)))
                return
        finally:
            self.replies.close()
