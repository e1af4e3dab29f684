"""What the engine takes and gives, near the bottom of ``ktinject.serve`` (below it: ``errors.py``): its settings
(``EngineConfig``), a request inside it (``Request``), the events a request gets (``Output``) and a whole completion
(``Result``), a decode step in flight (``DecodeStep``). Plain data, shared by the engine and the API without either importing the other.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ktinject.serve.errors import RequestError

if TYPE_CHECKING:  # leaves of the package: neither imports this module
    from ktinject.serve.detokenizer import Detokenizer
    from ktinject.serve.sampling import SamplingParams

#: batch sizes that get a decode graph (up to --max-batch, which gets one too)
BUCKETS = (1, 2, 4, 8, 16, 32)


@dataclass
class EngineConfig:
    """``max_batch``: KV-cache rows = requests decoding together; ``max_context``: tokens per row (prompt +
    completion); ``max_queue``: requests waiting for a row before new ones get QueueFull; ``prefill_chunk``:
    prompt tokens per step while others decode; ``graphs``: CUDA graphs (None: on CUDA); ``warmup``: capture every
    bucket's graph and allocate the cache before serving; ``overlap``: queue each decode step before reading the
    tokens of the one before (``engine.py``), False: one step at a time; ``prefill_pad``: a prefill forward's width
    (its longest chunk) rounded up to the next power of two up to this, to a multiple of it beyond
    (``model_runner.padded_width``), None: 16 on CUDA, 1 (no rounding) on the CPU. Why: on CUDA every new matmul
    shape costs host memory once (kernels loaded, plans), and the prefill forwards of a server take (rows) x (width)
    shapes of 1..max_batch x 1..prefill_chunk: without rounding a long-running server's heap keeps growing long
    after its warm-up; with it, a few hundred shapes at most. The cost: up to pad - 1 tokens a
    row (never past the step's prefill_chunk) go through the model like a shared forward's padding, routed to
    experts (the hot-expert counts see them) but unseen by the row's tokens. ``prefix_cache``: a ``PrefixCache``
    (``ktinject.decode.prefix_cache``) every request shares: before a request's prefill its longest cached prefix
    (whole blocks) is restored into its row and only the rest is prefilled; after it, its new whole blocks are
    stored (docs/prefix-cache.md). None (the default): off."""

    max_batch: int = 8
    max_context: int = 4096
    max_queue: int = 128
    prefill_chunk: int = 512
    graphs: bool | None = None
    warmup: bool = True
    overlap: bool = True
    prefill_pad: int | None = None
    prefix_cache: object | None = None  # a ktinject.decode.prefix_cache.PrefixCache shared by every request; None: off

    def __post_init__(self):
        for name in ("max_batch", "max_context", "prefill_chunk"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_pad is not None and (type(self.prefill_pad) is not int or self.prefill_pad < 1):
            raise ValueError(f"prefill_pad must be None or an int >= 1, got {self.prefill_pad!r}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted({b for b in BUCKETS if b < self.max_batch} | {self.max_batch}))

    def check_length(self, prompt_len: int, max_tokens: int | None, prompt_param: str = "prompt",
                     limit_param: str = "max_tokens") -> int:
        """The request's max_tokens (None: what the context leaves); RequestError when it does not fit, naming the
        prompt where it alone leaves no room, else the limit (``limit_param``: max_tokens / max_completion_tokens)."""
        ctx = self.max_context
        if prompt_len < 1:
            raise RequestError("the prompt is empty (0 tokens)", param=prompt_param)
        if prompt_len >= ctx:
            raise RequestError(f"the prompt has {prompt_len} tokens, which leaves no room for a completion in the "
                               f"context of {ctx} tokens (--max-context)", param=prompt_param,
                               code="context_length_exceeded")
        if max_tokens is None:
            return ctx - prompt_len
        if prompt_len + max_tokens > ctx:
            raise RequestError(f"the prompt ({prompt_len} tokens) plus {limit_param} ({max_tokens}) is "
                               f"{prompt_len + max_tokens} tokens, more than the context of {ctx} tokens "
                               f"(--max-context)", param=limit_param, code="context_length_exceeded")
        return max_tokens


@dataclass
class Output:
    """One event of a request: new text and tokens; the last one has ``finish_reason`` (stop, length, cancelled,
    error; ``error`` says what went wrong) and, where a stop string ended the text, ``stop_string``. ``logprobs``:
    where the request asked for them, one ``logprobs.TokenLogprob`` per token of ``token_ids``."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache instead of prefilled
    logprobs: list | None = None
    stop_string: str | None = None


@dataclass
class Result:
    """A whole completion (``Engine.generate``)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft: float | None
    error: str | None = None
    cached_tokens: int = 0


@dataclass(eq=False)
class Request:
    """A request inside the engine. ``cancel()`` may be called from any thread."""

    id: str
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[Output], None]
    on_cancel: Callable[[Request], None]  # the engine's cancel: frees the row before the next step
    detokenizer: Detokenizer
    rng: object
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    out_ids: list[int] = field(default_factory=list)
    row: int | None = None
    prefilled: int = 0
    cancelled: bool = False
    done: bool = False
    pending: int = 0  # decode steps queued for it whose token has not been read yet (0 or 1)
    cached: int = 0  # prompt tokens its row gets from the prefix cache (its prefill starts there)
    hit: object = None  # the prefix cache's Hit, looked up and not yet restored
    hit_mark: int = -1  # the store's inserted blocks when ``hit`` was looked up (a later insert: look up again)
    cut_at: int | None = None  # a prompt position a prefill chunk ends at (a state checkpoint: prefix_reuse.py)
    matcher: object = None  # its grammar's grammar.Matcher (constrained decoding), or None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def cancel(self) -> None:
        self.on_cancel(self)

    def summary(self, reason: str, error: str | None = None) -> str:
        """One line for the log when the request ends."""
        now = time.perf_counter()
        n = len(self.out_ids)
        ttft = "n/a" if self.t_first is None else f"{self.t_first - self.t_arrival:.3f} s"
        rate = f"{(n - 1) / (now - self.t_first):.1f} tok/s" if self.t_first and n > 1 and now > self.t_first else "n/a"
        return (f"{self.id}: {reason} after {self.prompt_len} prompt + {n} completion tokens, first token {ttft}, "
                f"decode {rate}{f' ({error})' if error else ''}")


@dataclass(eq=False)
class DecodeStep:
    """A decode step in flight (the engine's): its requests, the model runner's ``Decoded``, the sampler's logprobs
    (a list of one, or empty) and, once read, its tokens."""

    reqs: list
    decoded: object
    got: list
    tokens: list | None = None
    failed: bool = False
