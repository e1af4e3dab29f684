"""The HTTP face of the engine: an OpenAI-compatible FastAPI app (``create_app(engine)``).

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (both streamed as server-sent
events ending with ``data: [DONE]`` when ``stream`` is true), ``GET /health``, ``GET /metrics`` (Prometheus text).
Every error is OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input (malformed
JSON, wrong types, a prompt that does not fit the context, unsupported parameters, a body of too many JSON objects),
401 without the API key, 404 for unknown paths and models, 413 for a body over ``max_body`` bytes, 429 when the queue
is full, 503 when the engine is down or stopping. With an API key, every path but ``/health`` needs
``Authorization: Bearer KEY``.

Requests are tokenized in a worker thread (the chat template, under the engine's tokenizer lock), submitted to the
engine, and their events come back through an asyncio queue. A client that goes away (its connection closes) is
noticed while the reply waits or streams, and its request is cancelled: the engine frees its row before its next
step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ktinject.serve import protocol, reasoning, tool_parsers
from ktinject.serve.chat_output import ChatOutput, chat_parsers
from ktinject.serve.errors import ApiError, EngineUnavailable, QueueFull, RequestError
from ktinject.serve.types import Output

log = logging.getLogger("ktinject.serve")

#: bytes of a request body, by default: room for a prompt of a long context as JSON, while parsing, which takes many
#: times the body's size in Python objects, stays bounded (docs/performance.md)
MAX_BODY = 8 << 20
_BODY_PATHS = ("/v1/chat/completions", "/v1/completions")  # the endpoints that read a body
#: a body with more '{' and '[' than max(MIN_CONTAINERS, CONTAINERS_PER_TOKEN x --max-context) gets 400 before it is
#: parsed: parsing runs on the event loop, and a body of many tiny objects ("[{},{},...]") parses slowly there,
#: stalling every stream (json.loads and pydantic hold the GIL: a thread would not help); a request that fits the
#: context has far fewer (the count includes braces inside strings: 64 a token of context is generous for code)
MIN_CONTAINERS, CONTAINERS_PER_TOKEN = 10_000, 64
MAX_CONTAINERS = 250_000  # a cap: beyond it, 64 a token of a long context would let no MAX_BODY body trip the limit


def create_app(engine, model_names: tuple[str, ...] | str | None = None, api_key: str | None = None,
               max_body: int = MAX_BODY, tool_call_parser: str | None = "auto", reasoning_parser: str | None = "auto"):
    """The FastAPI app serving ``engine`` (started by the caller) under ``model_names`` (the first one is listed
    by /v1/models; the others are accepted aliases). A request body over ``max_body`` bytes gets 413 before it
    is parsed (FastAPI reads a body whole into memory, and uvicorn sets no limit). ``tool_call_parser`` and
    ``reasoning_parser``: a name (``tool_parsers.PARSERS``; ``"think"``), "auto" (from the model's type) or
    None / "none" (the reply stays text)."""
    names = (model_names,) if isinstance(model_names, str) else tuple(model_names or (engine.name,))
    tool_parser, think = chat_parsers(engine, tool_call_parser, reasoning_parser)
    created = int(time.time())

    def error(status: int, message: str, **kw) -> JSONResponse:
        if status >= 500:
            kw.setdefault("type_", "server_error")
        return JSONResponse(protocol.error_body(message, **kw), status_code=status)

    app = FastAPI(title="ktinject", description="OpenAI-compatible server of a ktinject model", docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.add_middleware(_BodyLimit, limit=max_body, reply=error,
                       containers=max(MIN_CONTAINERS, min(MAX_CONTAINERS,
                                                          CONTAINERS_PER_TOKEN * engine.config.max_context)))
    if api_key:  # added last: runs first, so a request without the key is refused before its body is read
        app.add_middleware(_KeyCheck, key=api_key, reply=error)
    app.state.engine = engine

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error(e.status, str(e), type_=e.type, param=e.param, code=e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e: RequestValidationError):
        kind = request.headers.get("content-type", "")
        whole = any(tuple(x.get("loc", ())) == ("body",) for x in e.errors())  # the body as such, not a field
        if whole and not _json_type(kind):  # FastAPI parses JSON only under these types
            got = f"Content-Type {kind!r}" if kind else "no Content-Type"
            return error(400, f"send the request body as JSON with 'Content-Type: application/json' (got {got})")
        if whole and any(x.get("type") == "missing" for x in e.errors()):
            return error(400, "the request body is empty: expected a JSON object")
        message, param = _validation_message(e.errors())
        return error(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        if e.status_code == 400 and e.detail == "There was an error parsing the body":  # json.loads raised a
            # ValueError / RecursionError other than a syntax error: say what it can be
            return error(400, "the request body could not be parsed as JSON: text that does not decode, an integer "
                              "of more than 4,300 digits or nesting deeper than a few hundred levels")
        if e.status_code == 404:
            return error(404, f"no such endpoint: {request.method} {request.url.path}", code="not_found")
        if e.status_code == 405:
            return error(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
        return error(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return error(500, f"internal error: {type(e).__name__}: {e}")

    @app.get("/health")
    async def health():
        if not engine.alive:
            why = f": {engine.failure}" if engine.failure else ""
            return error(503, f"the engine is not running{why}", code="engine_down")
        return {"status": "ok", "model": names[0], **engine.counts()}

    @app.get("/metrics")
    async def metrics():
        c = engine.counts()
        return PlainTextResponse(engine.metrics.render(c["running"], c["waiting"], engine.config.max_batch),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": names[0], "object": "model", "created": created,
                                            "owned_by": "ktinject", "max_model_len": engine.config.max_context}]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        _check_model(name, names)
        return {"id": names[0], "object": "model", "created": created, "owned_by": "ktinject",
                "max_model_len": engine.config.max_context}

    @app.post("/v1/chat/completions")
    async def chat(body: protocol.ChatRequest, request: Request):
        _check_model(body.model, names)
        _checked(body.check)
        messages = _checked(body.template_messages)
        tools = body.tools if body.tool_choice != "none" else None
        kwargs = _checked(body.template_kwargs)
        prompt = await _in_thread(engine.render_chat, messages, tools, **kwargs)
        parser = tool_parsers.make(tool_parser, tools) if tool_parser and tools else None
        inside = None
        if think:
            inside = reasoning.prompt_opens_think(await asyncio.to_thread(engine.prompt_tail_text, prompt))
        output = ChatOutput(parser, inside) if parser is not None or inside is not None else None
        return await _serve(engine, body, prompt, request, names[0], chat=True, output=output)

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, request: Request):
        _check_model(body.model, names)
        _checked(body.check)
        value = _checked(body.prompt_value)
        prompt = await _in_thread(engine.encode, value) if isinstance(value, str) else value
        return await _serve(engine, body, prompt, request, names[0], chat=False)

    async def _serve(engine, body, prompt: list[int], request, model_name: str, chat: bool,
                     output: ChatOutput | None = None):
        max_tokens = _checked(engine.check_length, len(prompt), body.limit, "messages" if chat else "prompt",
                              body.limit_param)
        params = _checked(body.sampling, engine.default_params(), max_tokens)
        if output is not None and output.tools is not None:  # a family's markers may be special tokens
            params = dataclasses.replace(params, skip_special_tokens=False)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(out: Output):  # the engine thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the event loop closed (the server stopped): nobody waits for it
                pass

        prefix = "chatcmpl" if chat else "cmpl"
        try:
            req = engine.submit(prompt, params, sink)
        except RequestError as e:
            raise ApiError(400, str(e), param=e.param, code=e.code) from None
        except QueueFull as e:
            raise ApiError(429, str(e), type_="rate_limit_error", code="queue_full") from None
        except EngineUnavailable as e:
            raise ApiError(503, str(e), type_="server_error", code="engine_down") from None
        rid = f"{prefix}-{req.id}"
        # watches the connection from now on, whether or not the reply ever starts: a client gone cancels
        gone = asyncio.ensure_future(_cancel_on_disconnect(request, req))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _stream(req, queue, gone, rid, model_name, chat, include_usage, output)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        parts, last = await _collect(req, queue, gone)
        if last is None:  # the client left
            return error(499, "client closed the request")
        if last.finish_reason == "error":
            return error(500, last.error or "generation failed", code="generation_failed")
        if last.finish_reason == "cancelled":
            return error(503, last.error or "the request was cancelled", code="cancelled")
        text = "".join(parts)
        if chat and output is not None:
            message = output.message(text)
            finish = "tool_calls" if message.get("tool_calls") and last.finish_reason == "stop" else last.finish_reason
            return protocol.chat_response(rid, model_name, text, finish, last.prompt_tokens, last.completion_tokens,
                                          message, cached=last.cached_tokens)
        build = protocol.chat_response if chat else protocol.completion_response
        return build(rid, model_name, text, last.finish_reason, last.prompt_tokens, last.completion_tokens,
                     cached=last.cached_tokens)

    return app


class _KeyCheck:
    """ASGI middleware: every path but /health needs ``Authorization: Bearer <key>`` (checked before the body is
    read, so a request without the key gets 401 whatever it sends)."""

    def __init__(self, app, key: str, reply):
        self.app, self.key, self.reply = app, key.encode(), reply

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") != "/health":
            given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                why = "no" if not given else "a wrong"
                response = self.reply(401, f"invalid API key ({why} 'Authorization: Bearer ...' header)",
                                      type_="authentication_error", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimit:
    """ASGI middleware: a request body of the completion endpoints longer than ``limit`` bytes gets 413 (by its
    Content-Length at once, else once that many bytes have come), never a server holding gigabytes; a body within it
    is read here and handed on whole, and later receives (the disconnect the API waits for) go to the client's
    connection as before; one with more than ``containers`` '{' and '[' gets 400 unparsed (MIN_CONTAINERS: why).
    Other paths pass untouched (their bodies are never read: 404 / 405)."""

    def __init__(self, app, limit: int, reply, containers: int | None = None):
        self.app, self.limit, self.reply, self.containers = app, limit, reply, containers

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in _BODY_PATHS:
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), b"")
        too_big = declared.isdigit() and (len(declared) > 18 or int(declared) > self.limit)  # (no 4,300-digit int)
        body = bytearray()
        while not too_big:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client went away before its request was whole: nothing to answer
            body += message.get("body", b"")
            too_big = len(body) > self.limit
            if not message.get("more_body", False):
                break
        if too_big:
            response = self.reply(413, f"the request body is over {self.limit:,} bytes (the server's "
                                       f"--max-request-mb)", code="request_too_large")
            await response(scope, receive, send)
            return
        n = body.count(b"{") + body.count(b"[")
        if self.containers is not None and n > self.containers:
            response = self.reply(400, f"the request body has {n:,} JSON objects and arrays (counting '{{' and '[' "
                                       f"in its strings too), more than the {self.containers:,} this server parses",
                                  code="request_too_complex")
            await response(scope, receive, send)
            return
        whole = {"type": "http.request", "body": bytes(body), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is None:
                return await receive()
            message, whole = whole, None
            return message

        await self.app(scope, replay, send)


async def _in_thread(fn, *args, **kwargs):
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except RequestError as e:
        raise ApiError(400, str(e), param=e.param, code=e.code) from None


def _checked(fn, *args):
    try:
        return fn(*args)
    except RequestError as e:
        raise ApiError(400, str(e), param=e.param, code=e.code) from None


def _check_model(name: str | None, names: tuple[str, ...]) -> None:
    if name is not None and name not in names:
        raise ApiError(404, f"model {name!r} is not served here; this server serves {names[0]!r}", param="model",
                       code="model_not_found")  # (OpenAI's and vLLM's status for it)


async def _cancel_on_disconnect(request, req) -> None:
    """Cancel ``req`` when the client goes away (the ASGI server reports http.disconnect; it also does once the
    response is complete, when cancelling is a no-op)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            req.cancel()
            return


async def _next(queue: asyncio.Queue, gone: asyncio.Task) -> Output | None:
    """The request's next event, or None once the client is gone."""
    get = asyncio.ensure_future(queue.get())
    await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    return None


async def _collect(req, queue, gone: asyncio.Task):
    """(texts, the last event) of a request answered in one piece; (…, None) when the client left."""
    parts = []
    try:
        while True:
            out = await _next(queue, gone)
            if out is None:
                return parts, None
            parts.append(out.text)
            if out.finish_reason is not None:
                return parts, out
    finally:
        gone.cancel()
        req.cancel()  # a no-op once finished


async def _stream(req, queue, gone: asyncio.Task, rid: str, model: str, chat: bool, include_usage: bool,
                  output: ChatOutput | None = None):
    """Server-sent events of a streamed request: chunks, the final chunk with finish_reason, [DONE]. ``output``:
    a chat reply's text is sent as its parts' deltas (reasoning_content, content, tool_calls)."""
    created = int(time.time())

    def sse(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def chunk_sse(body: dict) -> str:  # with include_usage every chunk has "usage": null but the last (OpenAI's)
        if include_usage:
            body.setdefault("usage", None)
        return sse(body)

    def parts(text: str, final: bool = False):
        if output is None:
            return [chunk(text)] if text else []
        deltas = output.feed(text) if text else []
        if final:
            deltas += output.finish()
        return [chunk_sse(protocol.chat_chunk(rid, model, created, d)) for d in deltas]

    def chunk(text: str | None, finish: str | None = None, use: dict | None = None) -> str:
        if chat:
            delta = None if text is None else ({"content": text} if text or finish is None else {})
            return chunk_sse(protocol.chat_chunk(rid, model, created, delta, finish, use))
        return chunk_sse(protocol.completion_chunk(rid, model, created, text, finish, use))

    try:
        if chat:
            yield chunk_sse(protocol.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
        while True:
            out = await _next(queue, gone)
            if out is None:
                log.info("%s: the client went away; cancelled", req.id)
                return
            if out.finish_reason in ("error", "cancelled"):
                kind = "server_error"
                yield sse(protocol.error_body(out.error or f"the request was {out.finish_reason}", type_=kind,
                                              code=out.finish_reason))
                break
            if out.finish_reason is None:
                for line in parts(out.text):
                    yield line
                continue
            for line in parts(out.text, final=True):
                yield line
            finish = out.finish_reason
            if output is not None and output.calls and finish == "stop":
                finish = "tool_calls"
            yield chunk("", finish)
            if include_usage:
                yield chunk(None, use=protocol.usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens))
            break
        yield "data: [DONE]\n\n"
    finally:
        gone.cancel()
        req.cancel()


def _json_type(content_type: str) -> bool:
    """Whether FastAPI reads a body of this Content-Type as JSON: application/json or application/*+json."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _validation_message(errors) -> tuple[str, str | None]:
    """One sentence naming the field of the first validation error, and that field (OpenAI's ``param``)."""
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [x for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        detail = (e.get("ctx") or {}).get("error") or e.get("msg")
        return f"the request body is not valid JSON: {detail}", None
    if not loc:
        if e.get("type") in ("model_attributes_type", "dict_type", "model_type"):
            return "the request body must be a JSON object", None
        return f"the request body: {e.get('msg')}", None
    param = ""
    for x in loc:
        param += f"[{x}]" if isinstance(x, int) else (f".{x}" if param else str(x))
    if e.get("type") == "missing":
        return f"{param}: this field is required", param
    got = e.get("input")
    shown = json.dumps(got)[:80] if isinstance(got, (str, int, float, bool, list, dict, type(None))) else repr(got)
    return f"{param}: {e.get('msg')} (got {shown})", param
