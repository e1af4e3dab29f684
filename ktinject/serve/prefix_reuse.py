"""The serving engine's use of a shared prefix cache (``EngineConfig.prefix_cache``, a ``PrefixCache`` of
``ktinject.decode``): a request that the scheduler starts is looked up (``lookup``: its longest cached prefix, whole
blocks), that prefix is restored into its row before its first chunk (``restore``) and its prefill starts after it;
once its last chunk is in, its new whole blocks are stored (``store``). ``Request.cached`` says how many prompt
tokens were restored (its replies' ``cached_tokens``). All on the engine thread.
"""
from __future__ import annotations

import logging

log = logging.getLogger("ktinject.serve")


class PrefixReuse:
    """The prefix cache ``store`` over ``model``'s rows of the KV cache ``kv`` (see the module docstring)."""

    def __init__(self, store, model, kv):
        self.store, self.model, self.kv = store, model, kv

    @classmethod
    def attach(cls, store, model, kv) -> "PrefixReuse | None":
        """The reuse of ``store`` for ``model``, or None where the store cannot cache this model (logged)."""
        reason = store.why_uncached(model)
        if reason is not None:
            log.warning("%s", reason)
            return None
        store.root(model)  # the model's root key once, not in the first request's step
        log.info("%s", "; ".join(store.describe()))
        return cls(store, model, kv)

    def lookup(self, req) -> int:
        """The prompt tokens of ``req`` the prefix cache holds (whole blocks, < its prompt): the scheduler starts its
        prefill there. Looked up again only where blocks were stored since (the scheduler may ask at every step
        while it waits for a row or budget)."""
        mark = self.store.stats.inserted_blocks
        if req.hit is None or req.hit_mark != mark:
            req.hit, req.hit_mark = self.store.lookup(self.model, req.prompt), mark
        return req.hit.tokens

    def restore(self, jobs) -> None:
        """Before a prefill forward: the cached prefix of each request that starts in it goes into its row; where a
        block went missing meanwhile, its job starts earlier (what was restored)."""
        for j in jobs:
            req = j.seq
            hit, req.hit = req.hit, None
            if hit is None or not hit.tokens:
                continue
            got = self.store.restore(hit, self.kv, j.row)
            if got < j.start:
                log.warning("%s: prefix cache restored %d of %d tokens; prefilling the rest", req.id, got, j.start)
                j.start = req.prefilled = got
            req.cached = got

    def insert(self, jobs) -> None:
        """After a prefill forward: the whole blocks of the prompts it completed go into the prefix cache (a failure
        is logged; the requests go on)."""
        for j in jobs:
            if not j.last:
                continue
            try:
                self.store.insert(self.model, j.seq.prompt, self.kv, j.row, length=j.seq.prompt_len)
            except Exception:  # noqa: BLE001 - the cache is an optimisation: the request goes on
                log.exception("storing the prompt of %s in the prefix cache failed", j.seq.id)
