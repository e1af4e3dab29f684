"""What the serving engine tells its requests: each new token's text and event, the stop checks, and the endings.

``RequestOutputs.take_tokens`` gives each request its new token (on the engine thread): the text from its
detokenizer, then whether it ends there (an end-of-sequence token unless ``ignore_eos``, a stop string, its grammar's
end, ``max_tokens``); an ending gives its row back (the engine's ``release``) and sends the last event with the
finish reason and the counts. A request with a grammar (``grammar.Matcher``, advanced by the engine as its tokens
arrive) ends with ``stop`` once the grammar's reply is over, and with ``error`` where its matcher failed. A
consumer (``sink``) that raises cancels its request, nothing else. ``tell_ended`` (any thread) ends requests the
scheduler no longer holds (the engine stopped or failed).
"""
from __future__ import annotations

import logging
import threading
import time

from ktinject.serve.types import Output, Request

log = logging.getLogger("ktinject.serve")


class RequestOutputs:
    """The events of an engine's requests (see the module docstring): ``eos_ids`` end a completion, ``metrics``
    count, ``release(reqs, done=True)`` frees rows, ``cancel(req)`` cancels a request whose consumer failed."""

    def __init__(self, eos_ids, metrics, release, cancel):
        self.eos_ids, self.metrics, self.release, self.cancel = eos_ids, metrics, release, cancel
        self.lock = threading.Lock()  # the detokenizers' tokenizer is the engine's: one user at a time

    def take_tokens(self, reqs: list[Request], tokens: list[int], logprobs=None) -> None:
        """Each request's new token: text, stop checks, its event; finished ones release their rows. ``logprobs``:
        a ``StepLogprobs`` of the step's rows (prefill), a list of each request's ``TokenLogprob`` or None (decode),
        or None."""
        ended = []
        now = time.perf_counter()
        if logprobs is not None and not isinstance(logprobs, list):
            logprobs = [logprobs.entry(i) for i in range(len(reqs))]
        with self.lock:
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
                    self.send(req, Output(req.id, text, [tok], logprobs=lp))
                elif finish == "error":
                    ended.append((req, finish, text, "", [tok], lp))
                else:
                    ended.append((req, finish, None, text, [tok], lp))
        self.metrics.token(len(reqs))
        if ended:
            self.finish_many(ended)

    def _text(self, req: Request, tok: int) -> tuple[str | None, str]:
        """(finish reason or None, the text to send) after ``tok``; for ``error``, the error instead of text."""
        matcher = req.matcher
        if matcher is not None and matcher.error is not None:
            return "error", f"token {tok} broke the request's grammar: {matcher.error}"
        if tok in self.eos_ids and not req.params.ignore_eos:
            return "stop", req.detokenizer.finish()
        text = req.detokenizer.push(tok)
        if req.detokenizer.stopped is not None or (matcher is not None and matcher.done):
            return "stop", text + req.detokenizer.finish()
        if len(req.out_ids) >= req.params.max_tokens:
            return "length", text + req.detokenizer.finish()
        return None, text

    def finish_many(self, items) -> None:
        """End requests: (req, reason, error[, text, tokens, logprobs]); rows freed and the layout compacted."""
        items = [it for it in items if not it[0].done]
        if not items:
            return
        self.release([it[0] for it in items], done=True)
        for it in items:
            req, reason, error = it[:3]
            text, toks, lp = (it[3], it[4], it[5]) if len(it) > 3 else ("", [], None)
            self.metrics.finish(reason)
            self.send(req, Output(req.id, text, toks, reason, req.prompt_len, len(req.out_ids), error,
                                  req.cached, lp, req.detokenizer.stopped))
            log.info("%s", req.summary(reason, error))

    def send(self, req: Request, out: Output) -> None:
        try:
            req.sink(out)
        except Exception:  # noqa: BLE001 - a broken consumer cancels its request, nothing else
            log.exception("the consumer of %s failed; cancelling it", req.id)
            if out.finish_reason is None:
                self.cancel(req)

    def tell_ended(self, reqs, failure: BaseException | None) -> None:
        """Each of ``reqs`` not yet done ends (``cancelled``, "the engine stopped"; ``error`` after a ``failure``)
        and is told so (any thread; the caller took them out of the scheduler)."""
        why = "the engine stopped" if failure is None else f"the engine failed: {failure}"
        for req in reqs:
            if not req.done:
                req.done = True
                self.send(req, Output(req.id, "", [], "cancelled" if failure is None else "error",
                                      req.prompt_len, len(req.out_ids), why))
