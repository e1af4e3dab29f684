"""The serving engine: continuous batching over one model, no HTTP (``api.py`` puts the OpenAI API on it).

``Engine`` owns the model on a thread of its own and runs every request in a loop of steps, each one schedule ->
execute -> update: cancelled requests leave (their rows are free at once); the scheduler (``scheduler.py``) hands
out prompt chunks of waiting requests, oldest first, at most ``prefill_chunk`` tokens a step, and the model runner
(``model_runner.py``) prefills them into their KV-cache rows, short prompts sharing one forward; a request whose last
chunk went in samples its first token and is running; then one decode step of every running request, one forward of
the batch bucket b >= n (on CUDA a graph replay), each row sampled on the device with its own parameters
(``sampling.py``; the steps queued and read: ``decode_steps.py``); each request gets its tokens and text
(``detokenizer.py``), and finished ones give their rows back.
Other threads call ``start``/``stop``, ``submit`` (a request's ``Output`` events go to its ``sink``, called on the
engine thread: keep it short), ``cancel``, the blocking ``generate``, ``counts``, and the tokenizer's side
(``encode``, ``render_chat``: ``tokenizer.py``).

Decode steps are queued one ahead (``overlap``): a step takes its input tokens from the device, so the host queues
step t+1 before it waits for step t's tokens, and does their text, stop checks and events while the device runs. The
price: a request that ends by end-of-sequence, a stop string or a cancel decodes one step more, whose token is
dropped. ``EngineConfig(overlap=False)``: one step at a time.

With ``EngineConfig.prefix_cache`` (a ``PrefixCache`` every request shares), a request that the scheduler starts
is looked up, its longest cached prefix restored into its row before its first chunk and its prefill started after
it; its new whole blocks are stored once its prompt is in (``prefix_reuse.py``). Its replies' ``cached_tokens`` say
how many prompt tokens were restored. What each request is told, token by token and at its end:
``request_outputs.py``.

Constrained decoding (``SamplingParams.grammar``: ``grammar.py``): such a request has a matcher, advanced with each
of its tokens as the host reads it; the step that samples its next token masks the tokens its grammar forbids
(``grammar_masks.py``, on the device, in the sampler). With ``overlap``, the next step's forward is queued first and
the tokens of the step in flight are read while it runs, to advance the matchers and fill the masks before its
sampling is queued: the host's mask work runs beside the device's forward. Steps without a grammar row do none of
this.

Batch invariance (greedy tokens alone = among others) holds on the CPU: a prompt is cut at the same places whatever
else runs, and a row's logits are bit-identical in any batch (tests/serve/test_batch_invariance.py; what it does not
cover: docs/serving.md). Requests fail alone (a prefill error); a failed decode step fails the requests of that
step; the engine goes on.
Legend: n running requests, b bucket, V vocabulary.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from typing import Callable

import torch

from ktinject.serve.detokenizer import Detokenizer
from ktinject.serve import grammar
from ktinject.serve.decode_steps import DecodeSteps
from ktinject.serve.errors import EngineUnavailable, QueueFull, RequestError
from ktinject.serve.grammar_masks import GrammarMasks
from ktinject.serve.metrics import Metrics
from ktinject.serve.model_runner import ModelRunner, eos_ids, pad_id
from ktinject.serve.penalties import PenaltyState
from ktinject.serve.prefix_reuse import PrefixReuse
from ktinject.serve.request_outputs import RequestOutputs
from ktinject.serve.sampling import Sampler, SamplingParams
from ktinject.serve.scheduler import Scheduler
from ktinject.serve.tokenizer import PromptTokenizer
from ktinject.serve.types import EngineConfig, Output, Request, Result

log = logging.getLogger("ktinject.serve")
__all__ = ["Engine", "EngineConfig", "EngineUnavailable", "Output", "QueueFull", "RequestError", "Result",
           "SamplingParams"]


class Engine:
    """Continuous batching over one model (see the module docstring). ``tokenizer`` may be None: token ids only.

    ``engine.start()`` loads the device state (cache, graphs) on the engine thread and waits until it is ready;
    ``submit(prompt_ids, params, sink)`` queues a request; ``generate(...)`` is the blocking form; ``stop()``.
    The engine has a ``scheduler`` (rows and admission), a ``model_runner`` (the forwards) and a ``sampler``."""

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, name: str = "model"):
        self.model, self.tokenizer = model, tokenizer
        self.config = config or EngineConfig()
        text_cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") \
            else model.config
        self.vocab_size = int(text_cfg.vocab_size)
        limit = getattr(text_cfg, "max_position_embeddings", None)
        if limit and self.config.max_context > limit:
            raise ValueError(f"max_context {self.config.max_context} exceeds the model's max_position_embeddings "
                             f"{limit}")
        self.eos_ids = eos_ids(model, tokenizer)
        self.model_runner = ModelRunner(model, self.config, pad_id(model, tokenizer))
        self.metrics = Metrics()
        self.scheduler = Scheduler(self.config.max_batch, self.config.max_queue)
        self.prefix_cache = self.config.prefix_cache  # the shared PrefixCache, or None
        self.metrics.prefix_cache = self.prefix_cache
        self._cond = threading.Condition()
        self._cancels: list[Request] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ready = threading.Event()
        self.failure: BaseException | None = None  # what stopped the engine thread, if anything did
        self.sampler: Sampler | None = None  # made on the engine thread (pinned memory on CUDA)
        self.penalties: PenaltyState | None = None  # the penalized rows' token counts (made with the sampler)
        self.masks: GrammarMasks | None = None  # the grammar rows' masks (made with the sampler)
        self.steps: DecodeSteps | None = None  # queues and reads the decode steps (made with the sampler)
        self.reuse: PrefixReuse | None = None  # the prefix cache's use (at start, where it can cache this model)
        self.outputs = RequestOutputs(self.eos_ids, self.metrics, self._release, self.cancel)
        self.grammars = grammar.Grammars(tokenizer, self.vocab_size, grammar.end_token(tokenizer, self.eos_ids))
        self._inflight = None  # the decode step queued and not yet read: (its requests, model_runner.Decoded)
        self._ending: set[Request] = set()  # requests whose rows went back and whose last token is in flight
        self._decode_clock = 0.0  # decode time of the loop not yet given to a collected step
        self.name = name
        self._ids = itertools.count()
        # requests are tokenized and rendered on a copy of the tokenizer, never under the engine thread's lock
        self.prompts = PromptTokenizer(tokenizer, self.config.max_context)

    @property
    def device(self) -> torch.device:
        return self.model_runner.device

    @property
    def runner(self):
        """The model's GraphRunner (None before start)."""
        return self.model_runner.runner

    @property
    def kv(self):
        """The KV cache: ``max_batch`` rows x ``max_context`` tokens (None before start)."""
        return self.model_runner.kv

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
            waiting = list(self.scheduler.waiting)
            self.scheduler.waiting.clear()
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
        bad = next((t for t, _ in params.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"logit_bias: token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})",
                               param="logit_bias")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer (this engine has none)", param="stop")
        if params.grammar is not None:
            grammar.require("grammar")
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        req = Request(rid, prompt, params, sink or (lambda out: None), self.cancel,
                      Detokenizer(self.tokenizer, prompt, params.stop, params.skip_special_tokens), params.rng())
        if params.grammar is not None:
            req.matcher = self.grammars.matcher(params.grammar)
        with self._cond:
            if not self.alive or self.failure is not None:
                raise EngineUnavailable("the engine is not running" + (
                    f" ({type(self.failure).__name__}: {self.failure})" if self.failure else ""))
            try:
                self.scheduler.submit(req)
            except QueueFull:
                self.metrics.reject("queue_full")
                raise
            self._cond.notify_all()
        return req

    def cancel(self, req: Request) -> None:
        """Stop ``req`` (any thread): its row is freed before the next step (idempotent)."""
        with self._cond:
            if req.done or req.cancelled:
                return
            req.cancelled = True
            self._cancels.append(req)
            self._cond.notify_all()

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
                      None if req.t_first is None else req.t_first - req.t_arrival, last.error, last.cached_tokens)

    def counts(self) -> dict:
        """{running, waiting, free_rows}: running counts every request holding a row (prefilling or decoding)."""
        with self._cond:
            s = self.scheduler
            return {"running": s.held_rows + len(self._ending), "waiting": len(s.waiting), "free_rows": s.free_rows}

    # ---- tokenizer (any thread) ----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (``PromptTokenizer.encode``); RequestError where it cannot be a prompt."""
        return self.prompts.encode(text)

    def prompt_tail_text(self, ids: list[int], tokens: int = 4) -> str:
        """The text of a prompt's last ``tokens`` tokens, special tokens kept (``PromptTokenizer.tail_text``)."""
        return self.prompts.tail_text(ids, tokens)

    def token_texts(self, ids) -> dict[int, str]:
        """Each token id's own text (logprobs' tokens: ``PromptTokenizer.token_texts``)."""
        return self.prompts.token_texts(ids)

    def shares_prefixes(self, prompt_len: int) -> bool:
        """Whether a prompt of ``prompt_len`` tokens, once prefilled, leaves whole blocks in the prefix cache that a
        request of the same prompt then restores (the API prefills the prompt of ``n`` choices once)."""
        store = self.prefix_cache
        return store is not None and self.scheduler.reuse is not None and prompt_len > store.block_size

    def render_chat(self, messages: list[dict], tools: list | None = None, **template_kwargs) -> list[int]:
        """Token ids of ``messages`` through the chat template (``PromptTokenizer.render_chat``)."""
        return self.prompts.render_chat(messages, tools, **template_kwargs)

    def check_grammar(self, text: str, param: str) -> None:
        """RequestError naming ``param`` where the grammar ``text`` does not compile for this model's tokenizer
        (``grammar.Grammars.check``; the first call builds the grammar engine's view of the tokenizer)."""
        grammar.require(param)
        self.grammars.check(text, param)

    # ---- the engine thread ---------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            with torch.no_grad():
                self._setup()
                self._ready.set()
                while self._step():
                    pass
        except BaseException as e:  # noqa: BLE001 - the thread must report, not vanish
            self.failure = e
            log.exception("the engine stopped")
        finally:
            self._ready.set()
            self._close()

    def _setup(self) -> None:
        """The model side (cache, graphs, warm-up) on the engine thread."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model_runner.setup()
        self.sampler = Sampler(self.kv.slots, self.device)
        self.penalties = PenaltyState(self.kv.slots, self.vocab_size, self.device)  # (tensors at first use)
        self.model_runner.row_hooks.append(self.penalties)
        if grammar.available():
            self.masks = GrammarMasks(self.kv.slots, self.vocab_size, self.device)
        self.steps = DecodeSteps(self.config, self.scheduler, self.model_runner, self.outputs, self._release,
                                 self.sampler, self.penalties, self.masks)
        if self.prefix_cache is not None:
            self.reuse = PrefixReuse.attach(self.prefix_cache, self.model, self.kv)
            if self.reuse is not None:
                self.scheduler.reuse = self.reuse.lookup

    def _step(self) -> bool:
        """One step of the loop (False once stopping): the cancelled requests end; prompt chunks are prefilled
        (``_prefill``); one decode step is queued and the tokens of the step before it are read
        (``decode_steps.DecodeSteps``): with ``overlap`` the step just queued stays in flight until the next one."""
        with self._cond:
            while not (self._stopping or self._cancels or self._inflight or not self.scheduler.idle()):
                self._cond.wait()
            if self._stopping:
                return False
            cancels, self._cancels = self._cancels, []
        t0 = time.perf_counter()
        self.outputs.finish_many([(r, "cancelled", None) for r in cancels if not r.done])
        prefill = time.perf_counter()
        self._prefill()
        prefill = time.perf_counter() - prefill
        launched = self.steps.launch(self._inflight)
        ready = [s for s in (self._inflight, launched) if s is not None]  # oldest first
        ahead = ready.pop() if launched is not None and self.config.overlap else None
        for step in ready:
            got = self.steps.collect(step)
            # decode time: the loop's time but the prefill forwards', given to the step collected
            t1 = time.perf_counter()
            self._decode_clock += t1 - t0 - prefill
            t0, prefill = t1, 0.0
            if got is not None:
                self.metrics.decode_step(got[0], self._decode_clock, got[1])
                self._decode_clock = 0.0
        # the step queued ahead becomes the one in flight only now: until the steps above are read and counted,
        # the engine is not idle (whoever waits for it to be, e.g. to read the metrics, sees them complete)
        self._inflight = ahead
        self._decode_clock = 0.0 if ahead is None else self._decode_clock + time.perf_counter() - t0 - prefill
        return True

    def _prefill(self) -> None:
        """The scheduler's prefill forwards of this step, until its ``prefill_chunk`` budget is spent: each one's
        requests that end their prompts get their first tokens; a failed forward fails its requests only."""
        cfg = self.config
        budget = cfg.prefill_chunk
        while True:
            with self._cond:
                jobs = self.scheduler.next_prefill(budget, cfg.prefill_chunk, cfg.max_context)
            if not jobs:
                return
            reqs = [j.seq for j in jobs]
            t0 = time.perf_counter()
            caching = self.scheduler.reuse is not None
            got = []  # the sampler's logprobs of the first tokens, if any
            try:
                if caching:
                    self.reuse.restore(jobs)
                firsts = self.model_runner.prefill(jobs, lambda logits, out: got.append(self._sample_first(
                    [j for j in jobs if j.last], logits, out)))
            except Exception as e:  # noqa: BLE001 - these requests fail, the others go on
                log.exception("prefill of %s failed", ", ".join(r.id for r in reqs))
                with self._cond:
                    self.scheduler.prefill_failed(jobs)
                self.model_runner.reset_rows([j.row for j in jobs])
                self.outputs.finish_many([(r, "error", f"prefill failed: {type(e).__name__}: {e}") for r in reqs])
                continue
            tokens = sum(j.end - j.start for j in jobs)
            self.metrics.prefill(tokens, time.perf_counter() - t0)
            if caching:
                self.reuse.insert(jobs)
            budget -= tokens
            with self._cond:
                done = self.scheduler.prefilled(jobs)
            if done:
                grammar.advance(done, firsts)
                self.outputs.take_tokens(done, firsts, got[0] if got else None)

    def _sample_first(self, ends, logits, out):
        """The first tokens of the prompts that the prefill jobs ``ends`` complete (their logits [k, V] -> out [k]):
        a penalized request's row starts its counts from its prompt first."""
        reqs = [j.seq for j in ends]
        for j in ends:
            if j.seq.params.penalized:
                self.penalties.start_row(j.row, j.seq.prompt)
        return self.sampler(logits, [r.params for r in reqs], [r.rng for r in reqs], out, rows=[j.row for j in ends],
                            penalties=self.penalties, masks=self.masks and self.masks.of(reqs))

    # ---- endings -------------------------------------------------------------------------------------------
    def _release(self, reqs: list[Request], done: bool) -> None:
        """Give the rows of ``reqs`` back and compact the layout (queued on the device after the step in flight);
        ``done``: they have ended, else they end when the token in flight arrives (``_ending`` until then)."""
        with self._cond:
            for r in reqs:
                if done:
                    r.done = True
                    self._ending.discard(r)
                else:
                    self._ending.add(r)
            s = self.scheduler
            # what each held row holds at most (positions to copy when it moves): prompt + decode steps queued
            held = {r.row: r.prompt_len + len(r.out_ids) + r.pending for r in s.running}
            if s.prefilling is not None:
                held[s.prefilling.row] = s.prefilling.prefilled
            moves, freed = s.release_many(reqs)
        try:
            for src, dst in moves:
                self.model_runner.move_row(src, dst, held[src])
            self.model_runner.reset_rows(freed)
        except Exception:  # noqa: BLE001 - a broken cache breaks every row: stop the engine
            log.exception("moving KV-cache rows failed")
            raise

    def _close(self) -> None:
        """The thread ends: every request still held is told so."""
        with self._cond:
            self._stopping = True
            held = list(self.scheduler.waiting) + list(self.scheduler.running) + list(self._ending) + \
                ([self.scheduler.prefilling] if self.scheduler.prefilling else [])
        self._tell_ended(held)

    def _tell_ended(self, reqs) -> None:
        self.outputs.tell_ended(reqs, self.failure)
