"""The serving engine: continuous batching over one model, no HTTP (``api.py`` puts the OpenAI API on it).

``Engine`` is what other threads call: ``start()``/``stop()``, ``submit(prompt_ids, params, sink)`` (a request's
``Output`` events go to ``sink``, called on the engine thread: keep it short, the API puts the event on its asyncio
queue), ``cancel``, the blocking ``generate``, ``counts()``, and the tokenizer's side (``encode``, ``render_chat``).
The engine thread's loop of steps (prefill chunks, one batched decode step of every running request, queued one
ahead of the tokens it reads) is ``loop.py``; rows and admission ``scheduler.py``; the forwards ``steps.py``;
sampling ``sampling.py``; text and stop strings ``text.py``.
"""
from __future__ import annotations

import copy
import itertools
import json
import logging
import threading
import uuid
from typing import Callable

from ktinject.serve.loop import EngineLoop
from ktinject.serve.request import (
    EngineConfig, EngineUnavailable, Output, Request, RequestError, Result, check_unicode,
)
from ktinject.serve.sampling import SamplingParams
from ktinject.serve.scheduler import QueueFull
from ktinject.serve.text import TextStream

log = logging.getLogger(__name__)
__all__ = ["Engine", "EngineConfig", "EngineUnavailable", "Output", "QueueFull", "RequestError", "Result",
           "SamplingParams"]


class Engine(EngineLoop):
    """Continuous batching over one model (see the module docstring). ``tokenizer`` may be None: token ids only.

    ``engine.start()`` loads the device state (cache, graphs) on the engine thread and waits until it is ready;
    ``submit(prompt_ids, params, sink)`` queues a request; ``generate(...)`` is the blocking form; ``stop()``."""

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, name: str = "model"):
        super().__init__(model, tokenizer, config)
        self.name = name
        self._ids = itertools.count()
        # request_tokenizer: requests are tokenized and rendered on a copy of the tokenizer, with a lock of its own:
        # under the engine thread's lock (which it takes for every token's text) one long prompt or template
        # stalled every stream. (A fast tokenizer is not safe from two threads at once: each copy has one user.)
        self.request_tokenizer = _copy_tokenizer(tokenizer)
        self._req_lock = threading.Lock()
        self._max_token_chars: int | None = None

    # ---- lifetime ------------------------------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> "Engine":
        """Start the engine thread; returns once the cache is allocated and the graphs captured."""
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._main, name="ktinject-engine", daemon=True)
        self._thread.start()
        self._ready.wait(timeout)
        if self.failure is not None:
            raise EngineUnavailable(f"the engine failed to start: {type(self.failure).__name__}: "
                                    f"{self.failure}") from self.failure
        return self

    def stop(self, timeout: float | None = 30) -> None:
        """Finish: every request still held ends with ``cancelled``; the thread exits. Those waiting for a row end
        here at once (a step of the engine may take seconds); those in rows at the engine's next step."""
        with self._cond:
            self._stopping = True
            waiting = list(self.sched.waiting)
            self.sched.waiting.clear()
            self._cond.notify_all()
        self._tell_ended(waiting)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ---- requests (any thread) -----------------------------------------------------------------------------
    def default_params(self) -> dict:
        """Sampling defaults from the model's generation_config: temperature 0 unless it samples."""
        gc = getattr(self.model, "generation_config", None)
        if gc is None or not getattr(gc, "do_sample", False):
            return {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
        return {"temperature": float(gc.temperature if gc.temperature is not None else 1.0),
                "top_p": float(gc.top_p if gc.top_p is not None else 1.0), "top_k": int(gc.top_k or 0)}

    def check_length(self, prompt_len: int, max_tokens: int | None, prompt_param: str = "prompt",
                     limit_param: str = "max_tokens") -> int:
        """The request's max_tokens (None: what the context leaves); RequestError when it does not fit."""
        return self.config.check_length(prompt_len, max_tokens, prompt_param, limit_param)

    def submit(self, prompt_ids, params: SamplingParams, sink: Callable[[Output], None] | None = None,
               request_id: str | None = None) -> Request:
        """Queue a request; its events go to ``sink`` (on the engine thread). Raises RequestError (bad input),
        QueueFull, EngineUnavailable."""
        prompt = [int(t) for t in prompt_ids]
        self.check_length(len(prompt), params.max_tokens)
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})", param="prompt")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer (this engine has none)", param="stop")
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        req = Request(rid, prompt, params, sink or (lambda out: None), self,
                      TextStream(self.tokenizer, prompt, params.stop), params.rng())
        with self._cond:
            if not self.alive or self.failure is not None:
                raise EngineUnavailable("the engine is not running" + (
                    f" ({type(self.failure).__name__}: {self.failure})" if self.failure else ""))
            try:
                self.sched.submit(req)
            except QueueFull:
                self.metrics.reject("queue_full")
                raise
            self._cond.notify_all()
        return req

    def generate(self, prompt_ids, params: SamplingParams, timeout: float | None = None) -> Result:
        """Submit and wait for the whole completion (any thread but the engine's)."""
        done = threading.Event()
        parts: list[Output] = []

        def sink(out: Output):
            parts.append(out)
            if out.finish_reason is not None:
                done.set()

        req = self.submit(prompt_ids, params, sink)
        if not done.wait(timeout):
            req.cancel()
            raise TimeoutError(f"request {req.id} did not finish in {timeout} s")
        last = parts[-1]
        return Result("".join(p.text for p in parts), [t for p in parts for t in p.token_ids], last.finish_reason,
                      last.prompt_tokens, last.completion_tokens,
                      None if req.t_first is None else req.t_first - req.t_arrival, last.error)

    def counts(self) -> dict:
        """{running, waiting, free_rows}: running counts every request holding a row (prefilling or decoding)."""
        with self._cond:
            s = self.sched
            return {"running": s.held_rows + len(self._ending), "waiting": len(s.waiting), "free_rows": s.free_rows}

    # ---- tokenizer (any thread) ----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens added as the tokenizer does). RequestError where it cannot be
        tokenized, or is too long for the context whatever its tokens (checked before tokenizing it)."""
        self._need_tokenizer()
        check_unicode(text, "prompt")
        self._check_chars(text, "prompt")
        try:
            with self._req_lock:
                return list(self.request_tokenizer(text, add_special_tokens=True).input_ids)
        except Exception as e:  # noqa: BLE001 - text the tokenizer refuses (a lone surrogate): the client's input
            raise RequestError(f"the prompt cannot be tokenized: {type(e).__name__}: {str(e)[:200]}",
                               param="prompt") from e

    def render_chat(self, messages: list[dict], tools: list | None = None, **template_kwargs) -> list[int]:
        """Token ids of ``messages`` through the tokenizer's chat template, with the generation prompt; ``tools``
        and ``template_kwargs`` (``enable_thinking``, ...) go to the template. RequestError when it fails."""
        self._need_tokenizer()
        if not getattr(self.request_tokenizer, "chat_template", None):
            raise RequestError("this model's tokenizer has no chat template: use /v1/completions",
                               param="messages")
        self._check_chars(str(messages) + str(tools or ""), "messages")
        for value, param in ((tools, "tools"), (template_kwargs, "chat_template_kwargs"), (messages, "messages")):
            if value:  # surrogates anywhere in them (the texts themselves: protocol.py names their fields)
                check_unicode(json.dumps(value, ensure_ascii=False, default=str), param, where=False)

        def render(tools, kwargs) -> str:
            with self._req_lock:
                return self.request_tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                                  add_generation_prompt=True, **kwargs)

        try:
            text = render(tools, template_kwargs)
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation: the client's input
            param = "messages"  # which part: the conversation may render without the kwargs, or without the tools
            parts = ([("chat_template_kwargs", tools, {})] if template_kwargs else []) + \
                ([("tools", None, template_kwargs)] if tools else [])
            for name, part_tools, part_kwargs in parts:
                try:
                    render(part_tools, part_kwargs)
                except Exception:  # noqa: BLE001 - fails that way as well: not this part alone
                    continue
                param = name
                break
            raise RequestError(f"the chat template rejected the {param.replace('_', ' ')}: {type(e).__name__}: "
                               f"{str(e)[:200]}", param=param) from e
        self._check_chars(text, "messages")
        check_unicode(text, "messages")
        try:
            with self._req_lock:
                return list(self.request_tokenizer(text, add_special_tokens=False).input_ids)
        except Exception as e:  # noqa: BLE001
            raise RequestError(f"the messages cannot be tokenized: {type(e).__name__}: {str(e)[:200]}",
                               param="messages") from e

    def _check_chars(self, text: str, param: str) -> None:
        """RequestError where ``text`` has more characters than max_context tokens of the longest token can hold:
        too long for the context whatever it tokenizes to (so a huge prompt is refused before it is tokenized)."""
        if self._max_token_chars is None:
            with self._req_lock:
                vocab = self.request_tokenizer.get_vocab()  # byte-level keys: no shorter than their text
            self._max_token_chars = max((len(k) for k in vocab), default=1) or 1
        limit = self.config.max_context * self._max_token_chars
        if len(text) > limit:
            raise RequestError(f"{param} is {len(text):,} characters: more than the context of "
                               f"{self.config.max_context:,} tokens can hold (at most {self._max_token_chars} "
                               f"characters a token)", param=param, code="context_length_exceeded")

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise RequestError("this engine has no tokenizer: send token ids", param="prompt")


def _copy_tokenizer(tokenizer):
    """A copy of ``tokenizer`` for the request side (the engine thread keeps the original), or the tokenizer itself
    where it cannot be copied (logged; its two users then stall each other as before)."""
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception as e:  # noqa: BLE001 - a tokenizer class that does not deep-copy
        log.warning("serve: the tokenizer cannot be copied (%s: %s); requests share the engine's", type(e).__name__, e)
        return tokenizer
