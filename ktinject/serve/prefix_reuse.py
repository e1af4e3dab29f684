"""The serving engine's use of a shared prefix cache (``EngineConfig.prefix_cache``, a ``PrefixCache`` of
``ktinject.decode``): a request that the scheduler starts is looked up (``lookup``: its longest cached prefix, whole
blocks), that prefix is restored into its row before its first chunk (``restore``) and its prefill starts after it;
once its last chunk is in, its new whole blocks are stored (``store``). For a model whose rows hold linear-attention
state (a hybrid family), a chunk also ends at the prompt's last whole block (``cut_at``, read by the scheduler), where
the blocks so far and the state at their end (a checkpoint) are stored, so a later request resumes there. ``Request.cached`` says how many prompt
tokens were restored (its replies' ``cached_tokens``). All on the engine thread.
"""
from __future__ import annotations

import logging

log = logging.getLogger("ktinject.serve")


class PrefixReuse:
    """The prefix cache ``store`` over ``model``'s rows of the KV cache ``kv`` (see the module docstring)."""

    def __init__(self, store, model, kv):
        from ktinject.decode import stateful_layers

        self.store, self.model, self.kv = store, model, kv
        self.checkpoints = stateful_layers.needs_state_checkpoints(model)  # linear-attention state (hybrid models)

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
        mark = self.store.stats.inserted_blocks + self.store.stats.state_checkpoints
        if req.hit is None or req.hit_mark != mark:
            req.hit, req.hit_mark = self.store.lookup(self.model, req.prompt), mark
            if self.checkpoints:  # a chunk ends at the prompt's last whole block: its state is stored there
                cut = (req.prompt_len - 1) // self.store.block_size * self.store.block_size
                req.cut_at = cut if cut > req.hit.tokens else None
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
            cut = getattr(j.seq, "cut_at", None)
            if not j.last and not (cut is not None and j.end == cut):
                continue
            try:  # (at a cut: the blocks so far and the state at their end)
                self.store.insert(self.model, j.seq.prompt, self.kv, j.row, length=j.seq.prompt_len if j.last else cut)
            except Exception:  # noqa: BLE001 - the cache is an optimisation: the request goes on
                log.exception("storing the prompt of %s in the prefix cache failed", j.seq.id)
