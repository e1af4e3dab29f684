"""The request plumbing every API of the server shares: errors raised as ``ApiError``, the model name checked, and
``Replies``: the engine requests of one HTTP request (its ``n`` choices of one prompt) with their events merged into
one asyncio queue, cancelled together when the client goes away.

``n`` > 1: each choice is a request of the engine (a row of its own), with ``seed + i`` as its seed where the
request has one (the same seed would give n equal choices). Where the engine's prefix cache would hold the prompt's
whole blocks once it is prefilled (``Engine.shares_prefixes``), choice 0 goes first and the others are submitted when
its first token is out: they restore the prompt's blocks instead of prefilling them again (only its last partial
block is computed n times). Otherwise all n go at once (short prompts then share one prefill forward).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

from ktinject.serve import constraints, reasoning, tool_parsers
from ktinject.serve.chat_output import ChatOutput
from ktinject.serve.errors import ApiError, EngineUnavailable, QueueFull, RequestError
from ktinject.serve.types import Output

log = logging.getLogger("ktinject.serve")


@dataclass
class ServerContext:
    """What the endpoints of one app share: the engine, the model names served (the first is the one listed), the
    tool-call parser's name (or None), whether replies are split at ``<think>``, and whether they are read as
    harmony's channels (gpt-oss: reasoning, content and calls at once; ``chat_output.ChatOutput``)."""

    engine: object
    names: tuple[str, ...]
    tool_parser: str | None
    think: bool
    error: Callable  # (status, message, path=..., **fields) -> a JSONResponse in the path's API's shape
    harmony: bool = False


def checked(fn, *args):
    try:
        return fn(*args)
    except RequestError as e:
        raise ApiError(400, str(e), param=e.param, code=e.code) from None


async def in_thread(fn, *args, **kwargs):
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except RequestError as e:
        raise ApiError(400, str(e), param=e.param, code=e.code) from None


async def grammar_for(engine, build: Callable[[], str | None], param: str) -> str | None:
    """A request's grammar: ``build()`` (``constraints.py``) and the engine's check that it compiles, in a worker
    thread (the first grammar builds the grammar engine's view of the tokenizer); a RequestError is a 400."""
    def run():
        text = build()
        if text is not None:
            engine.check_grammar(text, param)
        return text

    return await in_thread(run)


async def reply_parsing(ctx: ServerContext, prompt: list[int], tools) -> tuple[bool, bool | None]:
    """How a chat reply to ``prompt`` is read: (whether the tool-call parser reads its calls: there is one and the
    request offers ``tools``; whether the prompt already opened a ``<think>`` block, None where replies are not split
    at ``<think>``)."""
    parse = ctx.tool_parser is not None and bool(tools)
    inside = None
    if ctx.think:
        inside = reasoning.prompt_opens_think(await asyncio.to_thread(ctx.engine.prompt_tail_text, prompt))
    return parse, inside


def chat_output(ctx: ServerContext, tools, parse: bool, inside: bool | None) -> ChatOutput:
    """A reply's reader (``chat_output.ChatOutput``) from ``reply_parsing``'s answer."""
    return ChatOutput(tool_parsers.make(ctx.tool_parser, tools) if parse else None, inside, ctx.harmony)


async def forced_call_grammar(ctx: ServerContext, tools, forced, inside: bool | None) -> str | None:
    """The grammar of a forced tool call (``constraints.forced_call``: ``forced`` a tool's name or None for any),
    checked to compile; a RequestError is a 400 on ``tool_choice``."""
    engine = ctx.engine
    return await grammar_for(engine, lambda: constraints.forced_call(
        ctx.tool_parser, tools, forced, lambda text: engine.grammars.literal(text), bool(inside)), "tool_choice")


def check_model(name: str | None, names: tuple[str, ...]) -> None:
    if name is not None and name not in names:
        raise ApiError(404, f"model {name!r} is not served here; this server serves {names[0]!r}", param="model",
                       code="model_not_found")  # (OpenAI's and vLLM's status for it)


def choice_params(params, n: int) -> list:
    """The SamplingParams of each of ``n`` choices: ``seed + i`` for choice i where there is a seed."""
    if params.seed is None:
        return [params] * n
    return [params if i == 0 else dataclasses.replace(params, seed=params.seed + i) for i in range(n)]


class Replies:
    """The engine requests of one HTTP request and their events (see the module docstring): ``await start(prompt,
    params)``, then ``await next()`` -> (choice index, Output), or None once the client is gone; ``close()`` when
    done (cancels what still runs: a no-op for finished requests)."""

    def __init__(self, engine, request):
        self.engine, self.request = engine, request
        self.queue: asyncio.Queue = asyncio.Queue()
        self.reqs: list = []
        self.gone: asyncio.Future | None = None
        self._loop = asyncio.get_running_loop()
        self._early: list = []  # events taken while the later choices waited

    @property
    def id(self) -> str:
        return self.reqs[0].id

    async def start(self, prompt: list[int], params: list) -> None:
        """Submit the choices (ApiError 400 / 429 / 503 when the engine refuses one: those already in are
        cancelled)."""
        try:
            self._submit(prompt, params[0], 0)
            # watches the connection from now on, whether or not the reply ever starts: a client gone cancels
            self.gone = asyncio.ensure_future(self._watch())
            if len(params) > 1:
                shares = getattr(self.engine, "shares_prefixes", None)
                if shares is not None and shares(len(prompt)):
                    first = await self._next_event()
                    if first is None:
                        return
                    self._early.append(first)
                for i, p in enumerate(params[1:], 1):
                    self._submit(prompt, p, i)
        except BaseException:
            self.close()
            raise

    def _submit(self, prompt, params, index: int) -> None:
        def sink(out: Output):  # the engine thread
            try:
                self._loop.call_soon_threadsafe(self.queue.put_nowait, (index, out))
            except RuntimeError:  # the event loop closed (the server stopped): nobody waits for it
                pass

        try:
            self.reqs.append(self.engine.submit(prompt, params, sink))
        except RequestError as e:
            raise ApiError(400, str(e), param=e.param, code=e.code) from None
        except QueueFull as e:
            raise ApiError(429, str(e), type_="rate_limit_error", code="queue_full") from None
        except EngineUnavailable as e:
            raise ApiError(503, str(e), type_="server_error", code="engine_down") from None

    async def _watch(self) -> None:
        """Cancel every choice when the client goes away (the ASGI server reports http.disconnect; it also does
        once the response is complete, when cancelling is a no-op)."""
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                self.cancel()
                return

    async def _next_event(self):
        get = asyncio.ensure_future(self.queue.get())
        await asyncio.wait({get, self.gone}, return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            return get.result()
        get.cancel()
        return None

    async def next(self) -> tuple[int, Output] | None:
        """The next event of any choice, or None once the client is gone."""
        if self._early:
            return self._early.pop(0)
        return await self._next_event()

    async def collect(self) -> list[list[Output]] | None:
        """Every choice's events, in order, once all have finished; None when the client left."""
        events: list[list[Output]] = [[] for _ in self.reqs]
        left = len(self.reqs)
        try:
            while left:
                got = await self.next()
                if got is None:
                    return None
                i, out = got
                events[i].append(out)
                left -= out.finish_reason is not None
            return events
        finally:
            self.close()

    def cancel(self) -> None:
        for req in self.reqs:
            req.cancel()

    def close(self) -> None:
        if self.gone is not None:
            self.gone.cancel()
        self.cancel()


async def start_chat_reply(ctx: ServerContext, request, body, prompt: list[int], tools, limit: int | None,
                           what: str, param: str) -> tuple["Replies", ChatOutput, object]:
    """One chat reply of the Anthropic or Responses API, submitted: how it is read (``reply_parsing``), its sampling
    parameters (``limit`` new tokens checked against the context: a 400 names ``what`` / ``param``), a forced tool
    call's grammar. Returns (the replies, the reply's ChatOutput, the sampling parameters)."""
    engine = ctx.engine
    parse, inside = await reply_parsing(ctx, prompt, tools)
    output = chat_output(ctx, tools, parse, inside)
    max_tokens = checked(engine.check_length, len(prompt), limit, what, param)
    params = checked(body.sampling, engine.default_params(), max_tokens, parse or ctx.harmony)
    if body.forced_tool is not False:
        rule = await forced_call_grammar(ctx, tools, body.forced_tool, inside)
        params = checked(lambda: dataclasses.replace(params, grammar=rule))
    replies = Replies(engine, request)
    await replies.start(prompt, [params])
    return replies, output, params


def failure(last: list[Output]) -> Output | None:
    """The first of the choices' last events that did not end well (error, cancelled), or None."""
    return next((o for o in last if o.finish_reason in ("error", "cancelled")), None)


def summed_usage(last: list[Output]) -> tuple[int, int, int]:
    """(prompt tokens, completion tokens, cached tokens) of the choices whose last events are ``last``: the prompt
    once (it is one prompt), the completions summed, the cached tokens of choice 0 (the prompt as the first choice
    got it)."""
    return last[0].prompt_tokens, sum(o.completion_tokens for o in last), last[0].cached_tokens
