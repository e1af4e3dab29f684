"""The HTTP face of the engine: a FastAPI app (``create_app(engine)``) serving OpenAI's API and Anthropic's.

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (``openai_api.py``),
``POST /v1/responses`` (``responses_api.py``), ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (``anthropic_api.py``), ``GET /health``, ``GET
/metrics`` (Prometheus text). Errors come in the shape of the API a path belongs to: OpenAI's ``{"error":
{"message", "type", "param", "code"}}``, Anthropic's ``{"type": "error", "error": {"type", "message"}}`` under
``/v1/messages``: 400 for bad input (malformed JSON, wrong types, a prompt that does not fit the context,
unsupported parameters, a body of too many JSON objects), 401 without the API key, 404 for unknown paths and models,
413 for a body over ``max_body`` bytes, 429 when the queue is full, 503 when the engine is down or stopping. With an
API key, every path but ``/health`` needs ``Authorization: Bearer KEY`` or ``x-api-key: KEY``
(``api_middleware.py``).

Requests are tokenized in a worker thread (the chat template, under the request side's tokenizer lock), submitted
to the engine, and their events come back through an asyncio queue (``api_requests.py``). A client that goes away
(its connection closes) is noticed while the reply waits or streams, and its request is cancelled: the engine frees
its row before its next step.
"""
from __future__ import annotations

import json
import logging
import time

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ktinject.serve import anthropic_api, anthropic_protocol, openai_api, protocol, responses_api
from ktinject.serve.api_middleware import CONTAINERS_PER_TOKEN, MAX_BODY, BodyLimit, KeyCheck, container_limit
from ktinject.serve.api_requests import ServerContext, check_model
from ktinject.serve.chat_output import chat_parsers, harmony_replies
from ktinject.serve.errors import ApiError

log = logging.getLogger("ktinject.serve")
__all__ = ["CONTAINERS_PER_TOKEN", "MAX_BODY", "create_app"]


def create_app(engine, model_names: tuple[str, ...] | str | None = None, api_key: str | None = None,
               max_body: int = MAX_BODY, tool_call_parser: str | None = "auto", reasoning_parser: str | None = "auto"):
    """The FastAPI app serving ``engine`` (started by the caller) under ``model_names`` (the first one is listed
    by /v1/models; the others are accepted aliases). A request body over ``max_body`` bytes gets 413 before it
    is parsed (FastAPI reads a body whole into memory, and uvicorn sets no limit). ``tool_call_parser`` and
    ``reasoning_parser``: a name (``tool_parsers.PARSERS``; ``reasoning.PARSERS``), "auto" (from the model's type)
    or None / "none" (the reply stays text)."""
    names = (model_names,) if isinstance(model_names, str) else tuple(model_names or (engine.name,))
    tool_parser, think = chat_parsers(engine, tool_call_parser, reasoning_parser)
    created = int(time.time())

    def error(status: int, message: str, path: str = "", **kw) -> JSONResponse:
        if anthropic_api.owns(path):
            return JSONResponse(anthropic_protocol.error_body(status, message), status_code=status)
        if status >= 500:
            kw.setdefault("type_", "server_error")
        return JSONResponse(protocol.error_body(message, **kw), status_code=status)

    app = FastAPI(title="ktinject", description="OpenAI- and Anthropic-compatible server of a ktinject model",
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=max_body, reply=error, containers=container_limit(engine.config.max_context))
    if api_key:  # added last: runs first, so a request without the key is refused before its body is read
        app.add_middleware(KeyCheck, key=api_key, reply=error)
    app.state.engine = engine

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error(e.status, str(e), path=request.url.path, type_=e.type, param=e.param, code=e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e: RequestValidationError):
        kind, path = request.headers.get("content-type", ""), request.url.path
        whole = any(tuple(x.get("loc", ())) == ("body",) for x in e.errors())  # the body as such, not a field
        if whole and not _json_type(kind):  # FastAPI parses JSON only under these types
            got = f"Content-Type {kind!r}" if kind else "no Content-Type"
            return error(400, f"send the request body as JSON with 'Content-Type: application/json' (got {got})",
                         path=path)
        if whole and any(x.get("type") == "missing" for x in e.errors()):
            return error(400, "the request body is empty: expected a JSON object", path=path)
        message, param = _validation_message(e.errors())
        return error(400, message, path=path, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        path = request.url.path
        if e.status_code == 400 and e.detail == "There was an error parsing the body":  # json.loads raised a
            # ValueError / RecursionError other than a syntax error: say what it can be
            return error(400, "the request body could not be parsed as JSON: text that does not decode, an integer "
                              "of more than 4,300 digits or nesting deeper than a few hundred levels", path=path)
        if e.status_code == 404:
            return error(404, f"no such endpoint: {request.method} {path}", path=path, code="not_found")
        if e.status_code == 405:
            return error(405, f"{request.method} is not allowed on {path}", path=path, code="method_not_allowed")
        return error(e.status_code, str(e.detail), path=path)

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return error(500, f"internal error: {type(e).__name__}: {e}", path=request.url.path)

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

    def listed() -> dict:
        return {"id": names[0], "object": "model", "created": created, "owned_by": "ktinject",
                "max_model_len": engine.config.max_context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [listed()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name, names)
        return listed()

    ctx = ServerContext(engine, names, tool_parser, think == "think", error,
                        harmony=harmony_replies(tool_parser, think))
    openai_api.add_routes(app, ctx)
    anthropic_api.add_routes(app, ctx)
    responses_api.add_routes(app, ctx)
    return app


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
