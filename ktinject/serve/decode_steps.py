"""The serving engine's decode steps: ``launch`` queues one step of every running request (the model runner's
forward of the bucket b >= n, then the sampling of each row into ``next_tokens``, then the copy of the n tokens to
the host) and returns without waiting; ``collect`` reads a step's tokens and hands them to the requests
(``request_outputs.py``). The engine calls ``launch`` for step t+1 before ``collect`` for step t (its ``overlap``).

A request whose step in flight brings its last token (``max_tokens``) gives its row back before the next launch:
it ends when that token arrives. Grammar rows (``Request.matcher``): their sampling needs their matchers advanced by
the tokens of the step in flight, so a step with one queues its forward, reads the step in flight's tokens (queued
earlier: ready first; ``tokens`` of a ``DecodeStep`` are read once), advances the matchers, fills the masks
(``grammar_masks.py``) and only then queues its sampling: the mask work runs on the host beside the device's
forward. A failed step fails its requests; the engine goes on.
Legend: n running requests, b bucket, V vocabulary.
"""
from __future__ import annotations

import logging

from ktinject.serve import grammar
from ktinject.serve.types import DecodeStep

log = logging.getLogger("ktinject.serve")


class DecodeSteps:
    """The decode steps of an engine (see the module docstring): its ``config`` (buckets), ``scheduler`` (the
    running requests), ``model_runner``, ``outputs`` (a ``RequestOutputs``), ``release(reqs, done)`` (rows given
    back), ``sampler``, ``penalties`` and ``masks`` (a ``GrammarMasks``, or None without the grammar engine)."""

    def __init__(self, config, scheduler, model_runner, outputs, release, sampler, penalties, masks):
        self.config, self.scheduler, self.model_runner = config, scheduler, model_runner
        self.outputs, self.release = outputs, release
        self.sampler, self.penalties, self.masks = sampler, penalties, masks

    def launch(self, inflight: DecodeStep | None) -> DecodeStep | None:
        """Queue one decode step of every running request, or None (none runs, or the step failed); ``inflight``:
        the step queued before and not yet collected, whose tokens a grammar row's sampling waits for."""
        ending = [r for r in self.scheduler.running if len(r.out_ids) + r.pending >= r.params.max_tokens]
        if ending:
            self.release(ending, done=False)
        running = list(self.scheduler.running)  # only the engine thread changes it
        n = len(running)
        if n == 0:
            return None
        b = next(x for x in self.config.buckets if x >= n)
        params, rngs = [r.params for r in running], [r.rng for r in running]
        got = []  # the sampler's logprobs of the step, if any row asks
        rows = list(range(n))
        constrained = any(r.matcher is not None for r in running)

        def sample(logits, out):  # logits [n, V] -> out [n]; called once the forward is queued
            masks = None
            if constrained:
                if inflight is not None:
                    self.tokens(inflight)  # its tokens advance the matchers while this forward runs
                masks = self.masks.of(running)
            got.append(self.sampler(logits, params, rngs, out, rows=rows, penalties=self.penalties, masks=masks))

        try:
            decoded = self.model_runner.decode(n, b, sample)
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the engine goes on
            log.exception("a decode step of %d requests failed", n)
            self.outputs.finish_many([(r, "error", f"decode step failed: {type(e).__name__}: {e}") for r in running])
            return None
        for r in running:
            r.pending += 1
        self.model_runner.after_decode()
        return DecodeStep(running, decoded, got)

    def collect(self, step: DecodeStep) -> tuple[int, float] | None:
        """The tokens of ``step`` to its requests still going; (their count, the forward's seconds), or None when
        the step failed."""
        reqs = step.reqs
        for r in reqs:
            r.pending -= 1
        tokens = self.tokens(step)
        if tokens is None:
            return None
        live = [i for i, r in enumerate(reqs) if not r.done]  # a request may have ended since the launch
        logprobs = step.got[0] if step.got else None
        self.outputs.take_tokens([reqs[i] for i in live], [tokens[i] for i in live],
                                 None if logprobs is None else [logprobs.entry(i) for i in live])
        return len(live), step.decoded.forward_seconds

    def tokens(self, step: DecodeStep) -> list[int] | None:
        """The tokens of ``step`` (waits for them, once: the one wait of a step, while the next step runs), its
        grammar rows' matchers advanced by them; None where the step failed (its requests fail)."""
        if step.tokens is None and not step.failed:
            try:
                step.tokens = step.decoded.tokens()
            except Exception as e:  # noqa: BLE001 - the step's requests fail, the engine goes on
                log.exception("a decode step of %d requests failed", len(step.reqs))
                step.failed = True
                self.outputs.finish_many([(r, "error", f"decode step failed: {type(e).__name__}: {e}")
                                          for r in step.reqs])
                return None
            grammar.advance(step.reqs, step.tokens)
        return step.tokens
