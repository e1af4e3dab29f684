"""The serving engine: continuous batching over one model, no HTTP (``api.py`` puts the OpenAI API on it).

``Engine`` owns the model on a thread of its own and runs every request in a loop of steps, each one schedule ->
execute -> update: cancelled requests leave (their rows are free at once); the scheduler (``scheduler.py``) hands
out prompt chunks of waiting requests, oldest first, at most ``prefill_chunk`` tokens a step, and the model runner
(``model_runner.py``) prefills them into their KV-cache rows, short prompts sharing one forward; a request whose last
chunk went in samples its first token and is running; then one decode step of every running request, one forward of
the batch bucket b >= n (on CUDA a graph replay), each row sampled on the device with its own parameters
(``sampling.py``); each request gets its tokens and text (``detokenizer.py``), and finished ones give their rows back.
Other threads call ``start``/``stop``, ``submit`` (a request's ``Output`` events go to its ``sink``, called on the
engine thread: keep it short), ``cancel``, the blocking ``generate``, ``counts``, and the tokenizer's side
(``encode``, ``render_chat``: ``tokenizer.py``).

Decode steps are queued one ahead (``overlap``): a step takes its input tokens from the device, so the host queues
step t+1 before it waits for step t's tokens, and does their text, stop checks and events while the device runs. The
price: a request that ends by end-of-sequence, a stop string or a cancel decodes one step more, whose token is
dropped. ``EngineConfig(overlap=False)``: one step at a time.

With ``EngineConfig.prefix_cache`` (a ``PrefixCache`` every request shares), a request that the scheduler starts
is looked up (``_reuse``: its longest cached prefix, whole blocks), that prefix is restored into its row before its
first chunk (``_restore``) and its prefill starts after it; once its last chunk is in, its new whole blocks are
stored (``_store``). Its replies' ``cached_tokens`` say how many prompt tokens were restored.

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
from ktinject.serve.errors import EngineUnavailable, QueueFull, RequestError
from ktinject.serve.metrics import Metrics
from ktinject.serve.model_runner import ModelRunner, eos_ids, pad_id
from ktinject.serve.penalties import PenaltyState
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
        self._tok_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ready = threading.Event()
        self.failure: BaseException | None = None  # what stopped the engine thread, if anything did
        self.sampler: Sampler | None = None  # made on the engine thread (pinned memory on CUDA)
        self.penalties: PenaltyState | None = None  # the penalized rows' token counts (made with the sampler)
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
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        req = Request(rid, prompt, params, sink or (lambda out: None), self.cancel,
                      Detokenizer(self.tokenizer, prompt, params.stop, params.skip_special_tokens), params.rng())
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
        store = self.prefix_cache
        if store is not None:
            reason = store.why_uncached(self.model)
            if reason is not None:
                log.warning("%s", reason)
            else:
                store.root(self.model)  # the model's root key once, not in the first request's step
                self.scheduler.reuse = self._reuse
                log.info("%s", "; ".join(store.describe()))

    # ---- the prefix cache (engine thread) ------------------------------------------------------------------
    def _reuse(self, req: Request) -> int:
        """The prompt tokens of ``req`` the prefix cache holds (whole blocks, < its prompt): the scheduler starts its
        prefill there. Looked up again only where blocks were stored since (the scheduler may ask at every step
        while it waits for a row or budget)."""
        store = self.prefix_cache
        mark = store.stats.inserted_blocks
        if req.hit is None or req.hit_mark != mark:
            req.hit, req.hit_mark = store.lookup(self.model, req.prompt), mark
        return req.hit.tokens

    def _restore(self, jobs) -> None:
        """Before a prefill forward: the cached prefix of each request that starts in it goes into its row; where a
        block went missing meanwhile, its job starts earlier (what was restored)."""
        for j in jobs:
            req = j.seq
            hit, req.hit = req.hit, None
            if hit is None or not hit.tokens:
                continue
            got = self.prefix_cache.restore(hit, self.kv, j.row)
            if got < j.start:
                log.warning("%s: prefix cache restored %d of %d tokens; prefilling the rest", req.id, got, j.start)
                j.start = req.prefilled = got
            req.cached = got

    def _store(self, jobs) -> None:
        """After a prefill forward: the whole blocks of the prompts it completed go into the prefix cache (a failure
        is logged; the requests go on)."""
        for j in jobs:
            if not j.last:
                continue
            try:
                self.prefix_cache.insert(self.model, j.seq.prompt, self.kv, j.row, length=j.seq.prompt_len)
            except Exception:  # noqa: BLE001 - the cache is an optimisation: the request goes on
                log.exception("storing the prompt of %s in the prefix cache failed", j.seq.id)

    def _step(self) -> bool:
        """One step of the loop (False once stopping): the cancelled requests end; prompt chunks are prefilled
        (``_prefill``); one decode step is queued (``_launch``) and the tokens of the step before it are read
        (``_collect``): with ``overlap`` the step just queued stays in flight until the next one."""
        with self._cond:
            while not (self._stopping or self._cancels or self._inflight or not self.scheduler.idle()):
                self._cond.wait()
            if self._stopping:
                return False
            cancels, self._cancels = self._cancels, []
        t0 = time.perf_counter()
        self._finish_many([(r, "cancelled", None) for r in cancels if not r.done])
        prefill = time.perf_counter()
        self._prefill()
        prefill = time.perf_counter() - prefill
        launched = self._launch()
        ready = [s for s in (self._inflight, launched) if s is not None]  # oldest first
        ahead = ready.pop() if launched is not None and self.config.overlap else None
        for step in ready:
            got = self._collect(step)
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
            ends = [j.seq for j in jobs if j.last]
            caching = self.scheduler.reuse is not None
            got = []  # the sampler's logprobs of the first tokens, if any
            try:
                if caching:
                    self._restore(jobs)
                firsts = self.model_runner.prefill(jobs, lambda logits, out: got.append(self._sample_first(
                    [j for j in jobs if j.last], logits, out)))
            except Exception as e:  # noqa: BLE001 - these requests fail, the others go on
                log.exception("prefill of %s failed", ", ".join(r.id for r in reqs))
                with self._cond:
                    self.scheduler.prefill_failed(jobs)
                self.model_runner.reset_rows([j.row for j in jobs])
                self._finish_many([(r, "error", f"prefill failed: {type(e).__name__}: {e}") for r in reqs])
                continue
            tokens = sum(j.end - j.start for j in jobs)
            self.metrics.prefill(tokens, time.perf_counter() - t0)
            if caching:
                self._store(jobs)
            budget -= tokens
            with self._cond:
                done = self.scheduler.prefilled(jobs)
            if done:
                self._take_tokens(done, firsts, got[0] if got else None)

    def _sample_first(self, ends, logits, out):
        """The first tokens of the prompts that the prefill jobs ``ends`` complete (their logits [k, V] -> out [k]):
        a penalized request's row starts its counts from its prompt first."""
        reqs = [j.seq for j in ends]
        for j in ends:
            if j.seq.params.penalized:
                self.penalties.start_row(j.row, j.seq.prompt)
        return self.sampler(logits, [r.params for r in reqs], [r.rng for r in reqs], out, rows=[j.row for j in ends],
                            penalties=self.penalties)

    def _launch(self):
        """Queue one decode step of every running request: (its requests, ``Decoded``), or None. A request whose
        step in flight brings its last token (max_tokens) gives its row back first: it ends when that token
        arrives."""
        ending = [r for r in self.scheduler.running if len(r.out_ids) + r.pending >= r.params.max_tokens]
        if ending:
            self._release(ending, done=False)
        running = list(self.scheduler.running)  # only this thread changes it
        n = len(running)
        if n == 0:
            return None
        b = next(x for x in self.config.buckets if x >= n)
        params, rngs = [r.params for r in running], [r.rng for r in running]
        got = []  # the sampler's logprobs of the step, if any row asks
        rows = list(range(n))
        try:
            decoded = self.model_runner.decode(n, b, lambda logits, out: got.append(self.sampler(
                logits, params, rngs, out, rows=rows, penalties=self.penalties)))
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the engine goes on
            log.exception("a decode step of %d requests failed", n)
            self._finish_many([(r, "error", f"decode step failed: {type(e).__name__}: {e}") for r in running])
            return None
        for r in running:
            r.pending += 1
        self.model_runner.after_decode()
        return running, decoded, got

    def _collect(self, step) -> tuple[int, float] | None:
        """The tokens of a step queued by ``_launch`` to its requests still going; (their count, the forward's
        seconds), or None when the step failed."""
        reqs, decoded, got = step
        for r in reqs:
            r.pending -= 1
        try:
            tokens = decoded.tokens()  # the one wait of a step: for its tokens, while the next step runs
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the engine goes on
            log.exception("a decode step of %d requests failed", len(reqs))
            self._finish_many([(r, "error", f"decode step failed: {type(e).__name__}: {e}") for r in reqs])
            return None
        live = [i for i, r in enumerate(reqs) if not r.done]  # a request may have ended since the launch
        logprobs = got[0] if got else None
        self._take_tokens([reqs[i] for i in live], [tokens[i] for i in live],
                          None if logprobs is None else [logprobs.entry(i) for i in live])
        return len(live), decoded.forward_seconds

    # ---- tokens and endings --------------------------------------------------------------------------------
    def _take_tokens(self, reqs: list[Request], tokens: list[int], logprobs=None) -> None:
        """Each request's new token: text, stop checks, its event; finished ones release their rows. ``logprobs``:
        a ``StepLogprobs`` of the step's rows (prefill), a list of each request's ``TokenLogprob`` or None (decode),
        or None."""
        ended = []
        now = time.perf_counter()
        if logprobs is not None and not isinstance(logprobs, list):
            logprobs = [logprobs.entry(i) for i in range(len(reqs))]
        with self._tok_lock:
            for i, (req, tok) in enumerate(zip(reqs, tokens)):
                lp = [logprobs[i]] if logprobs is not None and logprobs[i] is not None else None
                if req.t_first is None:
                    req.t_first = now
                    self.metrics.first_token(now - req.t_arrival)
                req.out_ids.append(tok)
                try:
                    finish, text = self._text(req, tok)
                except Exception as e:  # noqa: BLE001 - a token the tokenizer cannot decode fails its request only
                    log.exception("decoding the text of %s failed", req.id)
                    ended.append((req, "error", f"decoding token {tok} failed: {type(e).__name__}: {e}"))
                    continue
                if finish is None:
                    self._send(req, Output(req.id, text, [tok], logprobs=lp))
                else:
                    ended.append((req, finish, None, text, [tok], lp))
        self.metrics.token(len(reqs))
        if ended:
            self._finish_many(ended)

    def _text(self, req: Request, tok: int) -> tuple[str | None, str]:
        """(finish reason or None, the text to send) after ``tok``."""
        if tok in self.eos_ids and not req.params.ignore_eos:
            return "stop", req.detokenizer.finish()
        text = req.detokenizer.push(tok)
        if req.detokenizer.stopped is not None:
            return "stop", text
        if len(req.out_ids) >= req.params.max_tokens:
            return "length", text + req.detokenizer.finish()
        return None, text

    def _finish_many(self, items) -> None:
        """End requests: (req, reason, error[, text, tokens, logprobs]); rows freed and the layout compacted."""
        items = [it for it in items if not it[0].done]
        if not items:
            return
        self._release([it[0] for it in items], done=True)
        for it in items:
            req, reason, error = it[:3]
            text, toks, lp = (it[3], it[4], it[5]) if len(it) > 3 else ("", [], None)
            self.metrics.finish(reason)
            self._send(req, Output(req.id, text, toks, reason, req.prompt_len, len(req.out_ids), error,
                                   req.cached, lp, req.detokenizer.stopped))
            log.info("%s", req.summary(reason, error))

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

    def _send(self, req: Request, out: Output) -> None:
        try:
            req.sink(out)
        except Exception:  # noqa: BLE001 - a broken consumer cancels its request, nothing else
            log.exception("the consumer of %s failed; cancelling it", req.id)
            if out.finish_reason is None:
                self.cancel(req)

    def _close(self) -> None:
        """The thread ends: every request still held is told so."""
        with self._cond:
            self._stopping = True
            held = list(self.scheduler.waiting) + list(self.scheduler.running) + list(self._ending) + \
                ([self.scheduler.prefilling] if self.scheduler.prefilling else [])
        self._tell_ended(held)

    def _tell_ended(self, reqs) -> None:
        """Each of ``reqs`` not yet done ends (``cancelled``, "the engine stopped"; ``error`` after a failure) and is
        told so (any thread; the caller took them out of the scheduler)."""
        why = "the engine stopped" if self.failure is None else f"the engine failed: {self.failure}"
        for req in reqs:
            if not req.done:
                req.done = True
                self._send(req, Output(req.id, "", [], "cancelled" if self.failure is None else "error",
                                       req.prompt_len, len(req.out_ids), why))
