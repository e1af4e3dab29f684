"""OpenAI's completion endpoints on the engine: ``POST /v1/chat/completions`` and ``POST /v1/completions``
(``add_routes(app, ctx)``), whole or streamed as server-sent events ending with ``data: [DONE]``.

A request's ``n`` choices are engine requests of one prompt (``api_requests.Replies``); streamed, their chunks go
out as their tokens come, each with its choice's ``index``, each choice ending with its own ``finish_reason`` chunk,
and with ``stream_options.include_usage`` one usage chunk after the last (the prompt counted once). A chat reply's
text is split into reasoning, content and tool calls per choice (``chat_output.ChatOutput``). ``response_format``
JSON and a forced ``tool_choice`` hold the replies to a grammar (``constraints.py``, built and checked in a worker
thread: an invalid schema or an unknown tool is a 400); a forced call ends with ``finish_reason: "tool_calls"``.
Logprobs (``logprobs`` / ``top_logprobs``; completions' ``logprobs``) come with the tokens they belong to; where a
chat parser holds a token's text back, its logprobs go out with the next chunk of that choice.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from ktinject.serve import constraints, logprob_format, protocol
from ktinject.serve.api_requests import Replies, ServerContext, chat_output, check_model, checked, choice_params, \
    failure, forced_call_grammar, grammar_for, in_thread, reply_parsing, summed_usage

log = logging.getLogger("ktinject.serve")


def add_routes(app, ctx: ServerContext) -> None:
    engine = ctx.engine

    @app.post("/v1/chat/completions")
    async def chat(body: protocol.ChatRequest, request: Request):
        check_model(body.model, ctx.names)
        checked(body.check)
        messages = checked(body.template_messages)
        tools = body.tools if body.tool_choice != "none" else None
        kwargs = checked(body.template_kwargs)
        prompt = await in_thread(engine.render_chat, messages, tools, **kwargs)
        parse, inside = await reply_parsing(ctx, prompt, tools)
        outputs = [chat_output(ctx, tools, parse, inside) if parse or inside is not None or ctx.harmony else None
                   for _ in range(body.n)]
        if body.forced_tool is not False:
            rule = await forced_call_grammar(ctx, tools, body.forced_tool, inside)
        elif body.json_format:
            rule = await grammar_for(engine, lambda: constraints.response_format(body.response_format, bool(inside)),
                                     "response_format")
        else:
            rule = None
        return await _serve(ctx, body, prompt, request, chat=True, outputs=outputs, special=parse or ctx.harmony,
                            grammar=rule)

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, request: Request):
        check_model(body.model, ctx.names)
        checked(body.check)
        value = checked(body.prompt_value)
        prompt = await in_thread(engine.encode, value) if isinstance(value, str) else value
        return await _serve(ctx, body, prompt, request, chat=False, outputs=[None] * body.n)


async def _serve(ctx: ServerContext, body, prompt: list[int], request, chat: bool, outputs: list, special=False,
                 grammar: str | None = None):
    """One request of ``len(outputs)`` choices: submitted, then answered whole or streamed. ``special``: keep
    special tokens in the text (a tool parser reads family markers that may be special tokens); ``grammar``: what
    the replies are held to (``constraints.py``)."""
    engine = ctx.engine
    max_tokens = checked(engine.check_length, len(prompt), body.limit, "messages" if chat else "prompt",
                         body.limit_param)
    params = checked(body.sampling, engine.default_params(), max_tokens)
    if special or grammar is not None:
        params = checked(lambda: dataclasses.replace(params, skip_special_tokens=not special, grammar=grammar))
    replies = Replies(engine, request)
    await replies.start(prompt, choice_params(params, len(outputs)))
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{replies.id}"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _Stream(ctx, replies, rid, chat, include_usage, outputs).events()
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    events = await replies.collect()
    if events is None:  # the client left
        return ctx.error(499, "client closed the request")
    last = [e[-1] for e in events]
    bad = failure(last)
    if bad is not None and bad.finish_reason == "error":
        return ctx.error(500, bad.error or "generation failed", code="generation_failed")
    if bad is not None:
        return ctx.error(503, bad.error or "the request was cancelled", code="cancelled")
    entries = [[lp for o in e for lp in (o.logprobs or ())] for e in events]
    texts = await _texts(engine, [x for e in entries for x in e])
    choices = []
    for i, (evs, out) in enumerate(zip(events, outputs)):
        text, finish = "".join(o.text for o in evs), last[i].finish_reason
        if chat:
            message = out.message(text) if out is not None else {"role": "assistant", "content": text}
            if message.get("tool_calls") and finish == "stop":
                finish = "tool_calls"
            lp = logprob_format.chat(entries[i], texts) if params.logprobs is not None else None
            choices.append(protocol.chat_choice(i, message, finish, lp))
        else:
            lp = logprob_format.completion(entries[i], texts) if params.logprobs is not None else None
            choices.append(protocol.completion_choice(i, text, finish, lp))
    use = protocol.usage(*summed_usage(last))
    return (protocol.chat_response if chat else protocol.completion_response)(rid, ctx.names[0], choices, use)


async def _texts(engine, entries) -> dict[int, str]:
    """The texts of the tokens ``entries`` name (decoded in a worker thread: the tokenizer's lock may be busy)."""
    ids = logprob_format.token_ids(entries)
    return await asyncio.to_thread(engine.token_texts, ids) if ids else {}


class _Stream:
    """Server-sent events of a streamed request (see the module docstring)."""

    def __init__(self, ctx: ServerContext, replies: Replies, rid: str, chat: bool, include_usage: bool,
                 outputs: list):
        self.engine, self.model, self.replies, self.rid = ctx.engine, ctx.names[0], replies, rid
        self.chat, self.include_usage, self.outputs = chat, include_usage, outputs
        self.created = int(time.time())
        self.held = [[] for _ in outputs]  # logprobs of tokens whose text a chat parser holds back
        self.offsets = [0] * len(outputs)  # completions: characters sent per choice (text_offset)

    def sse(self, body: dict) -> str:
        if self.include_usage and "usage" not in body:  # every chunk has "usage": null but the last (OpenAI's)
            body["usage"] = None
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def chunk(self, i: int, text: str | None, finish: str | None = None, lp: dict | None = None) -> str:
        if self.chat:
            delta = None if text is None else ({"content": text} if text or finish is None else {})
            return self.sse(protocol.chat_chunk(self.rid, self.model, self.created, delta, finish, index=i,
                                                logprobs=lp))
        return self.sse(protocol.completion_chunk(self.rid, self.model, self.created, text, finish, index=i,
                                                  logprobs=lp))

    async def lines(self, i: int, out, final: bool) -> list[str]:
        """The chunks of choice i's event ``out`` (its last one when ``final``, before the finish chunk)."""
        entries = self.held[i] + list(out.logprobs or ())
        self.held[i] = []
        texts = await _texts(self.engine, entries) if entries else {}
        output = self.outputs[i]
        if not self.chat:
            lp = logprob_format.completion(entries, texts, self.offsets[i]) if entries else None
            self.offsets[i] += len(out.text)
            return [self.chunk(i, out.text, lp=lp)] if out.text or entries else []
        deltas = [{"content": out.text}] if output is None and out.text else []
        if output is not None:
            deltas = (output.feed(out.text) if out.text else []) + (output.finish() if final else [])
        if not deltas:
            self.held[i] = entries
            return []
        lp = logprob_format.chat(entries, texts) if entries else None
        return [self.sse(protocol.chat_chunk(self.rid, self.model, self.created, d, index=i,
                                             logprobs=lp if k == 0 else None)) for k, d in enumerate(deltas)]

    async def events(self):
        replies, n = self.replies, len(self.outputs)
        last: list = [None] * n
        try:
            if self.chat:
                for i in range(n):
                    yield self.sse(protocol.chat_chunk(self.rid, self.model, self.created,
                                                       {"role": "assistant", "content": ""}, index=i))
            while any(x is None for x in last):
                got = await replies.next()
                if got is None:
                    log.info("%s: the client went away; cancelled", replies.id)
                    return
                i, out = got
                if out.finish_reason in ("error", "cancelled"):
                    yield self.sse(protocol.error_body(out.error or f"the request was {out.finish_reason}",
                                                       type_="server_error", code=out.finish_reason))
                    break
                for line in await self.lines(i, out, final=out.finish_reason is not None):
                    yield line
                if out.finish_reason is None:
                    continue
                last[i] = out
                finish = out.finish_reason
                output = self.outputs[i]
                if output is not None and output.calls and finish == "stop":
                    finish = "tool_calls"
                held = self.held[i]
                self.held[i] = []
                lp = None
                if held:
                    texts = await _texts(self.engine, held)
                    lp = logprob_format.chat(held, texts) if self.chat else logprob_format.completion(
                        held, texts, self.offsets[i])
                yield self.chunk(i, "", finish, lp)
            else:
                if self.include_usage:
                    use = protocol.usage(*summed_usage(last))
                    body = (protocol.chat_chunk if self.chat else protocol.completion_chunk)(
                        self.rid, self.model, self.created, None, use=use)
                    yield self.sse(body)
            yield "data: [DONE]\n\n"
        finally:
            replies.close()
