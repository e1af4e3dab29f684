"""The serving engine's thread: it owns the model and runs every request in one loop of steps. ``EngineLoop`` is
the state of ``engine.Engine`` and the part of it that this thread runs; ``engine.py`` adds what other threads call.

Each step of the loop:
1. drops the requests cancelled since the last step (a client that went away): their rows are free at once;
2. prefills: prompt chunks of waiting requests, oldest first, into their rows of the KV cache
   (``kv_cache.forward`` on the rows of the forward), at most ``prefill_chunk`` tokens in the step while other
   requests decode, so a long prompt delays the running streams by one chunk per step, never by its whole length;
   short prompts that arrive together share one forward (right-padded to the longest; each row's cache length is
   set back to its own end), so the routed experts are read once for all of them, not once per prompt; a request
   whose last chunk went in samples its first token from that chunk's logits and is running. A prompt is cut at the
   same places whatever else runs (``scheduler.py``), so its forwards are the ones it gets alone;
3. decodes one token for every running request as one forward of the batch bucket b >= n (rows 0..n-1: the
   running requests, each at its own position and cache length; rows n..b-1: padding, whose cache lengths are put
   back after the step), through the model's ``GraphRunner``: on CUDA the step replays the graph captured for b;
   each row is sampled with its own parameters on the device (``sampling.py``) into the row's next input token;
4. reads the tokens of the step before (one copy to the host per step) and hands each request its new text.
Steps are queued ahead (``overlap``, on by default): a decode step takes its input tokens from the device, so the
host queues step t+1 before it waits for step t's tokens, and their text, stop checks, events and the next step's
bookkeeping run while the device computes step t+1: the device does not wait for the host between decode steps
while the host's share of a step is shorter than the step (a prefill still waits: its first tokens go out at once).
The price: a request learns that it ended (end-of-sequence, stop string, cancel) one step late, so its row decodes
one step more, whose token is dropped; a request at max_tokens gives its row back before its last token arrives,
without that step. ``EngineConfig(overlap=False)``: each step's tokens are read before the next is queued.
Rows and admission: ``scheduler.py`` (running requests stay in rows 0..n-1; a finished row is refilled by moving
the last one into it, so the bucket always fits the running batch). The forwards themselves (cache, graphs,
padding): ``steps.py``. Text and stop strings: ``text.py``.

Batch invariance (greedy tokens alone = among others): on the CPU a row's logits are bit-identical in any batch
(tests/serve/test_batch_invariance.py: the router's logits row by row, the native experts per row, torch's bf16 GEMMs
and SDPA at the demo model's shapes, chunks cut at fixed places). Not covered: GPU kernels picked by batch size
(cuBLAS), torch's CPU bf16 GEMM at larger shapes (oneDNN rounds one row otherwise than two or more at H = 2048), and
expert kernels that change arithmetic with an expert's rows (int4 dequantized to bf16 from 32 rows on AMX).

Requests fail alone (a prefill error); a failed decode step fails the requests of that step; the engine goes on.
Legend: n running requests, b bucket, V vocabulary, S prompt chunk.
"""
from __future__ import annotations

import logging
import threading
import time

import torch

from ktinject.serve.metrics import Metrics
from ktinject.serve.request import EngineConfig, Output, Request
from ktinject.serve.sampling import Sampler
from ktinject.serve.scheduler import Scheduler
from ktinject.serve.steps import ModelSteps, eos_ids, pad_id

log = logging.getLogger("ktinject.serve")


class EngineLoop:
    """The engine thread's state and loop (see the module docstring); ``engine.Engine`` adds what other threads
    call. ``tokenizer`` may be None: token ids only."""

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None):
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
        self.steps = ModelSteps(model, self.config, pad_id(model, tokenizer))
        self.metrics = Metrics()
        self.sched = Scheduler(self.config.max_batch, self.config.max_queue)
        self._cond = threading.Condition()
        self._cancels: list[Request] = []
        self._tok_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ready = threading.Event()
        self.failure: BaseException | None = None  # what stopped the engine thread, if anything did
        self.sampler: Sampler | None = None  # made on the engine thread (pinned memory on CUDA)
        self._inflight = None  # the decode step queued and not yet read: (its requests, steps.Decoded)
        self._ending: set[Request] = set()  # requests whose rows went back and whose last token is in flight
        self._decode_clock = 0.0  # decode time of the loop not yet given to a collected step

    @property
    def device(self) -> torch.device:
        return self.steps.device

    @property
    def runner(self):
        """The model's GraphRunner (None before start)."""
        return self.steps.runner

    @property
    def kv(self):
        """The KV cache: ``max_batch`` rows x ``max_context`` tokens (None before start)."""
        return self.steps.kv

    def cancel(self, req: Request) -> None:
        """Stop ``req`` (any thread): its row is freed before the next step (idempotent)."""
        with self._cond:
            if req.done or req.cancelled:
                return
            req.cancelled = True
            self._cancels.append(req)
            self._cond.notify_all()

    # ---- the engine thread ---------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            with torch.no_grad():
                self._setup()
                self._ready.set()
                while self._next_step():
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
        self.steps.setup()
        self.sampler = Sampler(self.kv.slots, self.device)

    def _next_step(self) -> bool:
        with self._cond:
            while not (self._stopping or self._cancels or self._inflight or not self.sched.idle()):
                self._cond.wait()
            if self._stopping:
                return False
            cancels, self._cancels = self._cancels, []
        t0 = time.perf_counter()
        self._finish_many([(r, "cancelled", None) for r in cancels if not r.done])
        prefill = time.perf_counter()
        self._prefill_phase()
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

    def _prefill_phase(self) -> None:
        cfg = self.config
        budget = cfg.prefill_chunk
        while True:
            with self._cond:
                jobs = self.sched.next_prefill(budget, cfg.prefill_chunk, cfg.max_context)
            if not jobs:
                return
            reqs = [j.seq for j in jobs]
            t0 = time.perf_counter()
            ends = [j.seq for j in jobs if j.last]
            try:
                firsts = self.steps.prefill(jobs, lambda logits, out: self.sampler(
                    logits, [r.params for r in ends], [r.rng for r in ends], out))
            except Exception as e:  # noqa: BLE001 - these requests fail, the others go on
                log.exception("prefill of %s failed", ", ".join(r.id for r in reqs))
                with self._cond:
                    self.sched.prefill_failed(jobs)
                self.steps.reset_rows([j.row for j in jobs])
                self._finish_many([(r, "error", f"prefill failed: {type(e).__name__}: {e}") for r in reqs])
                continue
            tokens = sum(j.end - j.start for j in jobs)
            self.metrics.prefill(tokens, time.perf_counter() - t0)
            budget -= tokens
            with self._cond:
                done = self.sched.prefilled(jobs)
            if done:
                self._take_tokens(done, firsts)

    def _launch(self):
        """Queue one decode step of every running request: (its requests, ``Decoded``), or None. A request whose
        step in flight brings its last token (max_tokens) gives its row back first: it ends when that token
        arrives."""
        ending = [r for r in self.sched.running if len(r.out_ids) + r.pending >= r.params.max_tokens]
        if ending:
            self._release(ending, done=False)
        running = list(self.sched.running)  # only this thread changes it
        n = len(running)
        if n == 0:
            return None
        b = next(x for x in self.config.buckets if x >= n)
        params, rngs = [r.params for r in running], [r.rng for r in running]
        try:
            decoded = self.steps.decode(n, b, lambda logits, out: self.sampler(logits, params, rngs, out))
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the engine goes on
            log.exception("a decode step of %d requests failed", n)
            self._finish_many([(r, "error", f"decode step failed: {type(e).__name__}: {e}") for r in running])
            return None
        for r in running:
            r.pending += 1
        self.steps.after_decode()
        return running, decoded

    def _collect(self, step) -> tuple[int, float] | None:
        """The tokens of a step queued by ``_launch`` to its requests still going; (their count, the forward's
        seconds), or None when the step failed."""
        reqs, decoded = step
        for r in reqs:
            r.pending -= 1
        try:
            tokens = decoded.tokens()  # the one wait of a step: for its tokens, while the next step runs
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the engine goes on
            log.exception("a decode step of %d requests failed", len(reqs))
            self._finish_many([(r, "error", f"decode step failed: {type(e).__name__}: {e}") for r in reqs])
            return None
        live = [(r, t) for r, t in zip(reqs, tokens) if not r.done]  # a request may have ended since the launch
        self._take_tokens([r for r, _ in live], [t for _, t in live])
        return len(live), decoded.forward_seconds

    # ---- tokens and endings --------------------------------------------------------------------------------
    def _take_tokens(self, reqs: list[Request], tokens: list[int]) -> None:
        """Each request's new token: text, stop checks, its event; finished ones release their rows."""
        ended = []
        now = time.perf_counter()
        with self._tok_lock:
            for req, tok in zip(reqs, tokens):
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
                    self._send(req, Output(req.id, text, [tok]))
                else:
                    ended.append((req, finish, None, text, [tok]))
        self.metrics.token(len(reqs))
        if ended:
            self._finish_many(ended)

    def _text(self, req: Request, tok: int) -> tuple[str | None, str]:
        """(finish reason or None, the text to send) after ``tok``."""
        if tok in self.eos_ids and not req.params.ignore_eos:
            return "stop", req.text.finish()
        text = req.text.push(tok)
        if req.text.stopped is not None:
            return "stop", text
        if len(req.out_ids) >= req.params.max_tokens:
            return "length", text + req.text.finish()
        return None, text

    def _finish_many(self, items) -> None:
        """End requests: (req, reason, error[, text, tokens]); rows freed and the layout compacted."""
        items = [it for it in items if not it[0].done]
        if not items:
            return
        self._release([it[0] for it in items], done=True)
        for it in items:
            req, reason, error = it[:3]
            text, toks = (it[3], it[4]) if len(it) > 3 else ("", [])
            self.metrics.finish(reason)
            self._send(req, Output(req.id, text, toks, reason, req.prompt_len, len(req.out_ids), error))
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
            s = self.sched
            # what each held row holds at most (positions to copy when it moves): prompt + decode steps queued
            held = {r.row: r.prompt_len + len(r.out_ids) + r.pending for r in s.running}
            if s.prefilling is not None:
                held[s.prefilling.row] = s.prefilling.prefilled
            moves, freed = s.release_many(reqs)
        try:
            for src, dst in moves:
                self.steps.move_row(src, dst, held[src])
            self.steps.reset_rows(freed)
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
            held = list(self.sched.waiting) + list(self.sched.running) + list(self._ending) + \
                ([self.sched.prefilling] if self.sched.prefilling else [])
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
