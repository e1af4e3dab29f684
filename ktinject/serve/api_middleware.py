"""The server's ASGI middleware, outside FastAPI's routing: the API key (``KeyCheck``) and the request body's limits
(``BodyLimit``: its bytes and its JSON containers, before it is parsed). Each answers through ``reply(status,
message, type_=, code=, path=)``, which writes the error in the shape of the API the path belongs to.
"""
from __future__ import annotations

import hmac

#: bytes of a request body, by default: room for a prompt of a long context as JSON, while parsing, which takes many
#: times the body's size in Python objects, stays bounded (docs/performance.md)
MAX_BODY = 8 << 20
#: the endpoints that read a body
BODY_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens")
#: a body with more '{' and '[' than max(MIN_CONTAINERS, CONTAINERS_PER_TOKEN x --max-context) gets 400 before it is
#: parsed: parsing runs on the event loop, and a body of many tiny objects ("[{},{},...]") parses slowly there,
#: stalling every stream (json.loads and pydantic hold the GIL: a thread would not help); a request that fits the
#: context has far fewer (the count includes braces inside strings: 64 a token of context is generous for code)
MIN_CONTAINERS, CONTAINERS_PER_TOKEN = 10_000, 64
MAX_CONTAINERS = 250_000  # a cap: beyond it, 64 a token of a long context would let no MAX_BODY body trip the limit


def container_limit(max_context: int) -> int:
    """The most '{' and '[' a body may have for a context of ``max_context`` tokens (MIN_CONTAINERS: why)."""
    return max(MIN_CONTAINERS, min(MAX_CONTAINERS, CONTAINERS_PER_TOKEN * max_context))


class KeyCheck:
    """ASGI middleware: every path but /health needs ``Authorization: Bearer <key>`` or ``x-api-key: <key>``
    (Anthropic's header), checked before the body is read, so a request without the key gets 401 whatever it
    sends."""

    def __init__(self, app, key: str, reply):
        self.app, self.key, self.reply = app, key.encode(), reply

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") != "/health":
            headers = scope.get("headers", ())
            given = next((v for k, v in headers if k == b"authorization"), b"")
            other = next((v for k, v in headers if k == b"x-api-key"), None)
            scheme, _, token = given.partition(b" ")
            bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
            if not bearer and not (other is not None and hmac.compare_digest(other.strip(), self.key)):
                why = "no" if not given and other is None else "a wrong"
                response = self.reply(401, f"invalid API key ({why} 'Authorization: Bearer ...' or 'x-api-key' "
                                           f"header)", type_="authentication_error", code="invalid_api_key",
                                      path=scope.get("path", ""))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body of the completion endpoints longer than ``limit`` bytes gets 413 (by its
    Content-Length at once, else once that many bytes have come), never a server holding gigabytes; a body within it
    is read here and handed on whole, and later receives (the disconnect the API waits for) go to the client's
    connection as before; one with more than ``containers`` '{' and '[' gets 400 unparsed (MIN_CONTAINERS: why).
    Other paths pass untouched (their bodies are never read: 404 / 405)."""

    def __init__(self, app, limit: int, reply, containers: int | None = None):
        self.app, self.limit, self.reply, self.containers = app, limit, reply, containers

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in BODY_PATHS:
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
                                       f"--max-request-mb)", code="request_too_large", path=scope["path"])
            await response(scope, receive, send)
            return
        n = body.count(b"{") + body.count(b"[")
        if self.containers is not None and n > self.containers:
            response = self.reply(400, f"the request body has {n:,} JSON objects and arrays (counting '{{' and '[' "
                                       f"in its strings too), more than the {self.containers:,} this server parses",
                                  code="request_too_complex", path=scope["path"])
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
