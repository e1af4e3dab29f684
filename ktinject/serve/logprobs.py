"""Log-probabilities of a step's picked tokens, for the rows that ask (``SamplingParams.logprobs``).

What they are: the log-softmax of the forward's own logits (float32), before ``logit_bias``, penalties, temperature,
top_k / top_p / min_p: the model's distribution, as vLLM returns by default (its ``raw_logprobs``), so a greedy
token's logprob is the one a plain forward of the same model gives it, whatever the request's sampling settings.

``compute`` runs on the logits' device, for the asking rows only, after the sampler has written the step's tokens:
one log-softmax of those rows, the picked tokens' values, one top-k of the largest k any of them asks for, packed
into one tensor and copied to (pinned) host memory without waiting; the copy is queued before the step's tokens
are, so once the engine has read those the host has these too. ``StepLogprobs.entry(i)``: what row i got.
Legend: n rows, m asking rows, V vocabulary, K the largest top count asked.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

#: the most top logprobs a token may ask for (OpenAI's top_logprobs limit; vLLM's default max_logprobs is 20)
MAX_TOP = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob and, most likely first, the ``top`` (token id, logprob) pairs asked for."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class StepLogprobs:
    """The logprobs of a step's asking rows, on their way to the host (``compute``); ``entry(i)`` of logits row i
    (None where it did not ask) once the step's tokens have been read."""

    def __init__(self, host: torch.Tensor, rows: list[int], tops: list[int]):
        self._host, self._at, self._tops = host, {r: j for j, r in enumerate(rows)}, tops
        self._k = max(tops, default=0)  # the top entries packed per row (the largest asked)
        self._values: list[list[float]] | None = None

    def entry(self, i: int) -> TokenLogprob | None:
        j = self._at.get(i)
        if j is None:
            return None
        if self._values is None:
            self._values = self._host.tolist()
        row, k = self._values[j], self._tops[j]
        return TokenLogprob(int(row[0]), row[1], tuple((int(row[2 + c]), row[2 + self._k + c]) for c in range(k)))


def compute(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], tops: list[int]) -> StepLogprobs:
    """logits [n, V] (the forward's), tokens [n] (the picked ones, on the same device): the logprobs of rows ``rows``
    with ``tops[j]`` top entries each; queued, not waited for."""
    device = logits.device
    cuda = device.type == "cuda"
    if rows == list(range(len(rows))):
        lp, tok = logits[:len(rows)], tokens[:len(rows)]  # (the usual case: every row asks, or the first ones)
    else:
        at = torch.tensor(rows, dtype=torch.long, pin_memory=cuda).to(device, non_blocking=True)
        lp, tok = logits.index_select(0, at), tokens.index_select(0, at)
    lp = lp.float().log_softmax(dim=-1)  # [m, V]
    parts = [tok[:, None].double(), lp.gather(1, tok[:, None]).double()]  # [m, 1] each
    K = max(tops)
    if K:
        values, ids = lp.topk(K, dim=-1)  # [m, K] each, largest first
        parts += [ids.double(), values.double()]  # (ids < 2**53: exact in float64)
    packed = torch.cat(parts, dim=1)  # [m, 2 + 2K]
    host = torch.empty(packed.shape, dtype=torch.float64, pin_memory=cuda)
    host.copy_(packed, non_blocking=cuda)
    return StepLogprobs(host, rows, tops)
