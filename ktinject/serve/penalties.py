"""Presence, frequency and repetition penalties: per-row token counts kept on the device beside the KV cache.

``PenaltyState`` holds, for every KV-cache row, how many times each token was generated in it (``counts``, int32
[R, V]) and which tokens its prompt holds (``prompt``, bool [R, V]); both are allocated when the first request with a
penalty starts (R x V x 5 bytes: 24 MB for 32 rows of a 152k vocabulary), never before. A row is tracked only while
a penalized request holds it (``start_row`` at its prompt's last chunk; ``move_row`` when the engine compacts the
rows, through the model runner's row hooks; ``reset_rows`` when it is freed): rows of other requests cost nothing,
and a step without a penalized row runs none of this.

``penalize`` is the arithmetic, vLLM's and HF's: first the repetition penalty over the tokens of the prompt or the
output (a positive logit divided by it, a negative one multiplied), then ``frequency x count`` and ``presence x
(count > 0)`` subtracted, over the output only. The sampler applies it after ``logit_bias`` and before temperature.
Legend: R rows of the cache, n rows of a step, m penalized rows, V vocabulary.
"""
from __future__ import annotations

import torch


def penalize(logits: torch.Tensor, counts: torch.Tensor, prompt: torch.Tensor, presence: torch.Tensor,
             frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """logits [m, V] float, counts [m, V] (output tokens), prompt [m, V] bool, presence/frequency/repetition [m]
    -> the penalized logits [m, V] (a new tensor)."""
    seen = prompt | (counts > 0)
    rep = repetition[:, None]
    out = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    out = out - frequency[:, None] * counts.to(out.dtype)
    return out - presence[:, None] * (counts > 0).to(out.dtype)


class PenaltyState:
    """The token counts of the penalized rows of a cache of ``rows`` rows over ``vocab`` tokens on ``device`` (see
    the module docstring). Driven by the engine thread only."""

    def __init__(self, rows: int, vocab: int, device):
        self.rows, self.vocab, self.device = rows, vocab, torch.device(device)
        self.counts = self.prompt = None  # [R, V] each, from the first start_row
        self.live: set[int] = set()  # rows holding a penalized request
        self._last = None  # (logits rows, KV rows) on the device of the last apply(), for count()

    def start_row(self, row: int, prompt_ids: list[int]) -> None:
        """``row`` now holds a penalized request whose prompt is ``prompt_ids``: its counts start at 0."""
        if self.counts is None:
            self.counts = torch.zeros((self.rows, self.vocab), dtype=torch.int32, device=self.device)
            self.prompt = torch.zeros((self.rows, self.vocab), dtype=torch.bool, device=self.device)
        self.counts[row].zero_()
        self.prompt[row].zero_()
        ids = torch.tensor(prompt_ids, dtype=torch.long)
        self.prompt[row].index_fill_(0, ids[ids < self.vocab].to(self.device), True)
        self.live.add(row)

    def move_row(self, src: int, dst: int) -> None:
        """Row ``dst`` becomes row ``src`` (the model runner's move, queued after the step in flight)."""
        if src in self.live:
            self.counts[dst].copy_(self.counts[src])
            self.prompt[dst].copy_(self.prompt[src])
            self.live.discard(src)
            self.live.add(dst)
        else:
            self.live.discard(dst)

    def reset_rows(self, a: int, b: int) -> None:
        """Rows a..b-1 are free (nothing to clear on the device: ``start_row`` clears a row it takes)."""
        self.live.difference_update(range(a, b))

    def _penalized(self, rows: list[int], params) -> tuple[list[int], list[int]]:
        """(logits rows, their KV rows) of the penalized requests; every one must have been started."""
        at = [i for i, p in enumerate(params) if p.penalized]
        kv = [rows[i] for i in at]
        missing = [r for r in kv if r not in self.live]
        if missing:
            raise RuntimeError(f"penalty counts of rows {missing} were never started")
        return at, kv

    def apply(self, logits: torch.Tensor, rows: list[int], params) -> torch.Tensor:
        """``logits`` [n, V] (the sampler's own copy) with the penalized rows' penalties applied in place; ``rows``:
        the KV row of each logits row."""
        at, kv = self._penalized(rows, params)
        cuda = self.device.type == "cuda"
        table = torch.tensor([(i, r, params[i].presence_penalty, params[i].frequency_penalty,
                               params[i].repetition_penalty) for i, r in zip(at, kv)], dtype=torch.float64,
                             pin_memory=cuda).to(self.device, non_blocking=True)  # [m, 5]: one upload
        idx, kv_idx = table[:, 0].long(), table[:, 1].long()
        sub = penalize(logits.index_select(0, idx), self.counts.index_select(0, kv_idx),
                       self.prompt.index_select(0, kv_idx), table[:, 2].float(), table[:, 3].float(),
                       table[:, 4].float())
        logits.index_copy_(0, idx, sub.to(logits.dtype))
        self._last = (idx, kv_idx)  # for count(): the same rows, already on the device
        return logits

    def count(self, tokens: torch.Tensor) -> None:
        """After sampling (the rows of the last ``apply``): each penalized row's picked token (``tokens`` [n])
        counted once more."""
        idx, kv_idx = self._last
        self._last = None
        picked = tokens.index_select(0, idx)
        self.counts.index_put_((kv_idx, picked), torch.ones_like(picked, dtype=torch.int32), accumulate=True)
