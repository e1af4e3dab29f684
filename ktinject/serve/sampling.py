"""What a request asks of its tokens (``SamplingParams``, checked), and the per-row sampling of one step's logits
(``Sampler``): each row its own temperature, top_p, top_k and random stream.

Greedy rows (temperature 0) take the argmax. Sampled rows: logits / temperature, sorted, softmax; the top_k first
and the smallest prefix whose probability reaches top_p are kept (the most likely token always is); then one
uniform number u per row picks the token by inverse CDF over what is kept. u comes from the request's own
``random.Random`` (seeded with the request's ``seed``, else at random), drawn on the host: a request's draws do
not depend on which other requests share its step, nor on the device: a seeded request samples the same tokens
alone or in a batch wherever its logits come out bit-identical (bf16 on the CPU; on a GPU another batch size may
pick other GEMM kernels and move the last bits, enough to flip a token at a top_p edge).
All rows are computed together on the logits' device (one sort for the sampled rows, only when some row samples),
and ``Sampler`` does it without a host synchronisation: the engine queues the next decode step before it reads this
one's tokens (see ``engine.py``).
``logit_bias`` is added to a row's logits before either (greedy rows too), then the penalties of the rows that have
them (``penalties.py``: presence, frequency, repetition, from per-row token counts on the device); ``min_p`` keeps,
of a sampled row, the tokens at least min_p x the most likely one's probability (after temperature), with top_k and
top_p. Rows with a grammar (constrained decoding: ``grammar_masks.py``) get their forbidden tokens at -inf last,
before the argmax and the sampling. Rows that ask for ``logprobs`` get the log-softmax of the forward's own logits
(``logprobs.py``: before bias, penalties, grammar and temperature) for the token picked and their top ones. Each
of these costs nothing (no kernel, no copy) in a step where no row uses it.
Legend: n rows, m sampled rows, V vocabulary.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ktinject.serve import logprobs as token_logprobs
from ktinject.serve.errors import RequestError


#: temperatures below this sample greedily (float32 logits / 1e-5 stay finite for |logits| up to ~3e33; vLLM's bound)
GREEDY_BELOW = 1e-5
#: stop strings a request may give, and their longest (each is searched in the text at every token)
STOP_MAX, STOP_MAX_CHARS = 16, 1024
#: logit_bias: the most entries a request may give, and the range of a bias (OpenAI's)
BIAS_MAX, BIAS_RANGE = 300, 100.0
#: the largest top_k accepted (any larger keeps every token of any vocabulary; float64 holds it exactly)
TOP_K_MAX = 1 << 31
#: presence_penalty and frequency_penalty range (OpenAI's); the largest repetition_penalty
PENALTY_RANGE, REPETITION_MAX = 2.0, 100.0


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
    skip_special_tokens: bool = True  # False: special tokens stay in the text (tool-call markers that are special)
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # None: none; k >= 0: the picked token's logprob and the k most likely ones'
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # x how many times each token was generated so far, subtracted
    repetition_penalty: float = 1.0  # HF / vLLM: logits of tokens in the prompt or generated / it (x it if < 0)
    grammar: str | None = None  # llguidance's grammar text the tokens must follow (``grammar.py``), or None

    def __post_init__(self):
        problems = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}"))
        if not 0 <= self.temperature <= 100 or self.temperature != self.temperature:
            problems.append(("temperature", f"must be in [0, 100] (0 = greedy), got {self.temperature!r}"))
        if not 0 < self.top_p <= 1:
            problems.append(("top_p", f"must be in (0, 1], got {self.top_p!r}"))
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= TOP_K_MAX:
            problems.append(("top_k", f"must be an integer in [0, {TOP_K_MAX}] (0 = no limit), got "
                                      f"{str(self.top_k)[:40]}"))
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append(("stop", "stop strings must be non-empty strings"))
        elif len(self.stop) > STOP_MAX or any(len(s) > STOP_MAX_CHARS for s in self.stop):
            problems.append(("stop", f"at most {STOP_MAX} stop strings of at most {STOP_MAX_CHARS} characters each, "
                                     f"got {len(self.stop)} (longest {max(map(len, self.stop))})"))
        if not 0 <= self.min_p <= 1:
            problems.append(("min_p", f"must be in [0, 1] (0 = off), got {self.min_p!r}"))
        if len(self.logit_bias) > BIAS_MAX:
            problems.append(("logit_bias", f"at most {BIAS_MAX} entries, got {len(self.logit_bias)}"))
        elif any(not isinstance(t, int) or t < 0 or not -BIAS_RANGE <= b <= BIAS_RANGE for t, b in self.logit_bias):
            problems.append(("logit_bias", f"token ids >= 0 with biases in [-{BIAS_RANGE:g}, {BIAS_RANGE:g}]"))
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or
                                          not 0 <= self.logprobs <= token_logprobs.MAX_TOP):
            problems.append(("logprobs", f"must be an integer in [0, {token_logprobs.MAX_TOP}], got {self.logprobs!r}"))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                problems.append((name, f"must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}] (0 = off), got {value!r}"))
        if not 0 < self.repetition_penalty <= REPETITION_MAX:
            problems.append(("repetition_penalty", f"must be in (0, {REPETITION_MAX:g}] (1 = off), got "
                                                   f"{self.repetition_penalty!r}"))
        if self.grammar is not None and self.ignore_eos:
            problems.append(("ignore_eos", "ignore_eos cannot be combined with a grammar (response_format or a forced "
                                           "tool_choice): the grammar's reply ends with end-of-sequence"))
        if problems:
            raise RequestError(problems[0][1], param=problems[0][0])

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes this request's logits (its rows then keep token counts: ``penalties.py``)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that logits / temperature overflows float32 (and the sampled row would be
        noise, not near-greedy): below GREEDY_BELOW the argmax is what sampling converges to."""
        return self.temperature < GREEDY_BELOW

    def rng(self) -> random.Random:
        """The request's random stream (a fresh one per request). A seed is taken as 64 bits (a negative one as its
        two's complement): random.Random seeds with |seed|, so -7 and 7 would give the same stream."""
        seed = self.seed % 2**64 if self.seed is not None else random.SystemRandom().getrandbits(64)
        return random.Random(seed)


class Sampler:
    """Samples the rows of a step on the logits' device without waiting for it: ``sampler(logits, params, rngs,
    out)`` writes one token per row into ``out`` (int64, on the device) and returns at once. Greedy rows take the
    argmax; when some rows sample, their indices and parameters (temperature, top_p, top_k and the row's u, drawn
    here from its request's stream) go to the device in one copy from pinned memory, so a step costs one upload
    and no synchronisation (the engine reads the tokens back later, in one copy of the whole step).
    ``rows``: the most rows a call gets. With ``penalties`` (a ``penalties.PenaltyState``) and ``rows`` (the KV-cache
    row of each logits row), the rows whose requests have penalties are penalized and their counts updated; with
    ``masks`` (a ``grammar_masks.StepMask``) the rows it names are constrained to their grammars' tokens; a call
    returns the step's ``logprobs.StepLogprobs`` when some row asks for logprobs, else None."""

    _COLUMNS = 6  # row index, temperature, top_p, top_k, u, min_p: float64 holds each exactly (top_k, rows: < 2**53)

    def __init__(self, rows: int, device: torch.device):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        # two staging buffers: one may still be read by the device's copy of the step before when we fill the other
        self._stage = [torch.zeros((rows, self._COLUMNS), dtype=torch.float64, pin_memory=cuda) for _ in range(2)]
        self._uploaded = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._next = 0

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], rngs: list[random.Random],
                 out: torch.Tensor, rows: list[int] | None = None, penalties=None, masks=None):
        """logits [n, V], one SamplingParams and random stream per row -> out [n] (int64, logits' device); returns
        the rows' logprobs (``StepLogprobs``) where some row asks for them, else None."""
        raw = logits
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        logits = logits.float()  # torch's CPU argmax of bf16 is slower than the cast and the float argmax
        biased = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
        if biased:  # (a copy: the forward's logits may be a captured graph's output)
            logits = logits.clone()
            at_rows, cols, vals = zip(*biased)
            at = (torch.tensor(at_rows, device=logits.device), torch.tensor(cols, device=logits.device))
            logits.index_put_(at, torch.tensor(vals, dtype=logits.dtype, device=logits.device), accumulate=True)
        penalized = penalties is not None and any(p.penalized for p in params)
        if penalized:
            if rows is None:
                raise ValueError("penalties need the KV-cache row of each logits row (rows=)")
            logits = penalties.apply(logits if biased else logits.clone(), rows, params)
        if masks is not None:
            logits = masks.apply(logits if biased or penalized else logits.clone())
        torch.argmax(logits, dim=-1, out=out)
        if sampled:
            self._sample(logits, params, rngs, out, sampled)
        if penalized:
            penalties.count(out)
        asks = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not asks:
            return None
        return token_logprobs.compute(raw, out, asks, [params[i].logprobs for i in asks])

    def _sample(self, logits, params, rngs, out, sampled: list[int]) -> None:
        """The sampled rows' tokens into ``out`` (see the class docstring)."""
        V = logits.shape[1]
        k = self._next
        self._next ^= 1
        if self._uploaded[k] is not None:
            self._uploaded[k].synchronize()  # the last upload from this buffer has run (two steps ago: at once)
        stage = self._stage[k][:len(sampled)]  # [m, 6]
        stage.numpy()[:] = [(i, params[i].temperature, params[i].top_p, params[i].top_k or V, rngs[i].random(),
                             params[i].min_p) for i in sampled]
        dev = stage.to(self.device, non_blocking=True)
        if self._uploaded[k] is not None:
            self._uploaded[k].record()
        at = dev[:, 0].long()
        picked = _sample_rows(logits.index_select(0, at), dev[:, 1].float(), dev[:, 2].float(),
                              dev[:, 3].long(), dev[:, 4], dev[:, 5])  # [m]
        out.index_copy_(0, at, picked)


def sample(logits: torch.Tensor, params: list[SamplingParams], rngs: list[random.Random]) -> list[int]:
    """One token per row of ``logits`` [n, V] (any float dtype, any device): a list of n ints (waits for them)."""
    n = logits.shape[0]
    if n == 0:
        return []
    out = torch.empty(n, dtype=torch.long, device=logits.device)
    Sampler(n, logits.device)(logits, params, rngs, out)
    return out.tolist()


def _sample_rows(logits, temps, top_p, top_k, u, min_p=None):
    """logits [m, V], temps/top_p/top_k/u/min_p [m] -> tokens [m] (inverse CDF over the kept tokens)."""
    scaled = logits / temps[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [m, V]
    probs = sorted_logits.softmax(dim=-1).double()
    rank = torch.arange(probs.shape[1], device=probs.device)
    before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each
    keep = (before < top_p[:, None]) & (rank[None, :] < top_k[:, None])
    if min_p is not None:  # (probs sorted: the kept tokens stay a prefix)
        keep &= probs >= min_p[:, None] * probs[:, :1]
    keep[:, 0] = True
    kept = probs * keep
    cdf = kept.cumsum(dim=-1)  # [m, V]
    target = (u * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True)
    # the kept tokens are a prefix (both cuts are): u < 1 lands inside it, rounding at its end must not leave it
    idx = torch.minimum(idx, keep.sum(dim=-1, keepdim=True) - 1)
    return order.gather(1, idx)[:, 0]
