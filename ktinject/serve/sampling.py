"""Per-row sampling of one step's logits: each row its own temperature, top_p, top_k and random stream.

Greedy rows (temperature 0) take the argmax. Sampled rows: logits / temperature, sorted, softmax; the top_k first
and the smallest prefix whose probability reaches top_p are kept (the most likely token always is); then one
uniform number u per row picks the token by inverse CDF over what is kept. u comes from the request's own
``random.Random`` (seeded with the request's ``seed``, else at random), drawn on the host: a request's draws do
not depend on which other requests share its step, nor on the device: a seeded request samples the same tokens
alone or in a batch wherever its logits come out bit-identical (bf16 on the CPU; on a GPU another batch size may
pick other GEMM kernels and move the last bits, enough to flip a token at a top_p edge).
All rows are computed together (one sort for the whole batch, only when some row samples).
Legend: n rows, V vocabulary.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ktinject.serve.request import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of its tokens. ``temperature`` 0 is greedy; ``top_p`` in (0, 1]; ``top_k`` 0 = all;
    ``stop``: strings that end the text (not included in it); ``ignore_eos``: go on past end-of-sequence tokens."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        problems = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}"))
        if not 0 <= self.temperature <= 100 or self.temperature != self.temperature:
            problems.append(("temperature", f"must be in [0, 100] (0 = greedy), got {self.temperature!r}"))
        if not 0 < self.top_p <= 1:
            problems.append(("top_p", f"must be in (0, 1], got {self.top_p!r}"))
        if not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(("top_k", f"must be an integer >= 0 (0 = no limit), got {self.top_k!r}"))
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append(("stop", "stop strings must be non-empty strings"))
        if problems:
            raise RequestError(problems[0][1], param=problems[0][0])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def rng(self) -> random.Random:
        """The request's random stream (a fresh one per request)."""
        return random.Random(self.seed if self.seed is not None else random.SystemRandom().getrandbits(64))


def sample(logits: torch.Tensor, params: list[SamplingParams], rngs: list[random.Random]) -> list[int]:
    """One token per row of ``logits`` [n, V] (any float dtype, any device): a list of n ints."""
    n = logits.shape[0]
    logits = logits.float()
    greedy = logits.argmax(dim=-1)  # [n]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return greedy.tolist()
    dev = logits.device
    rows = torch.tensor(sampled, device=dev)
    temps = torch.tensor([params[i].temperature for i in sampled], device=dev)
    top_p = torch.tensor([params[i].top_p for i in sampled], device=dev)
    top_k = torch.tensor([params[i].top_k or logits.shape[1] for i in sampled], device=dev)
    u = torch.tensor([rngs[i].random() for i in sampled], dtype=torch.float64, device=dev)
    picked = _sample_rows(logits[rows], temps, top_p, top_k, u)  # [m]
    out = greedy.index_copy(0, rows, picked)
    return out.tolist() if n else []


def _sample_rows(logits, temps, top_p, top_k, u):
    """logits [m, V], temps/top_p/top_k/u [m] -> tokens [m] (inverse CDF over the kept tokens)."""
    scaled = logits / temps[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [m, V]
    probs = sorted_logits.softmax(dim=-1).double()
    rank = torch.arange(probs.shape[1], device=probs.device)
    before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each
    keep = (before < top_p[:, None]) & (rank[None, :] < top_k[:, None])
    keep[:, 0] = True
    kept = probs * keep
    cdf = kept.cumsum(dim=-1)  # [m, V]
    target = (u * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True)
    # the kept tokens are a prefix (both cuts are): u < 1 lands inside it, rounding at its end must not leave it
    idx = torch.minimum(idx, keep.sum(dim=-1, keepdim=True) - 1)
    return order.gather(1, idx)[:, 0]
