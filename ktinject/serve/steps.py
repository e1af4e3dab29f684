"""The model side of the serving engine's steps: the KV cache's rows, a prefill forward of prompt chunks, a decode
forward of the running rows. No requests, no threads: ``engine.py`` decides what runs (``scheduler.py`` which rows),
``ModelSteps`` runs it on the model.

- ``setup()`` (on the engine thread): the model's ``GraphRunner`` with the engine's batch buckets, its KV cache
  (``max_batch`` rows x ``max_context`` tokens, allocated once: fixed addresses for the graphs), and, with
  ``warmup``, K/V of every row allocated and every bucket's decode graph captured before the first request;
- ``prefill(jobs)``: one forward of the jobs' prompt chunks in consecutive rows, right-padded to the longest;
- ``decode(tokens, b)``: one token for rows 0..n-1 in the bucket b >= n (on CUDA a graph replay); rows n..b-1 are
  padding whose cache lengths are put back;
- ``after_decode()``: the dynamic hot-expert placement's step, where there is one.
Legend: B rows of a prefill forward, S its longest chunk, n running rows, b bucket, V vocabulary.
"""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import torch

from ktinject.serve.scheduler import PrefillJob

log = logging.getLogger("ktinject.serve")


class ModelSteps:
    """The forwards of a serving engine over ``model`` with ``config`` (an EngineConfig); ``pad_id`` fills padding."""

    def __init__(self, model, config, pad_id: int):
        self.model, self.config, self.pad_id = model, config, pad_id
        self.runner = self.kv = None
        self._rebalancer = None

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def setup(self) -> None:
        """The runner, its cache and, on CUDA, every bucket's graph (see the module docstring)."""
        from ktinject.generate import get_runner

        cfg = self.config
        self.runner = get_runner(self.model, buckets=cfg.buckets, max_cache_len=cfg.max_context,
                                 use_graphs=cfg.graphs)
        for b in reversed(cfg.buckets):
            self.runner.cache_for(b, cfg.max_context)
        self.kv = self.runner.kv
        self._rebalancer = _rebalancer(self.model)
        if cfg.warmup:
            t0 = time.perf_counter()
            k = min(8, cfg.max_context)
            probe = SimpleNamespace(prompt=[self.pad_id] * k, prompt_len=k)
            self.prefill([PrefillJob(probe, 0, 0, k)])  # allocates K/V of every row
            for b in cfg.buckets if self.runner.graphs_enabled() else cfg.buckets[-1:]:
                self.decode([self.pad_id] * b, b)
            self.kv.reset_rows(list(range(self.kv.slots)))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            log.info("warm-up in %.1f s (%s)", time.perf_counter() - t0, self.runner.describe())

    def prefill(self, jobs: list[PrefillJob]) -> torch.Tensor:
        """One forward of the jobs' prompt chunks in their rows (consecutive), each after what its row holds,
        right-padded to the longest; the logits [k, V] after the last prompt token of the k jobs that end a prompt.
        A padded row's extra tokens come after its own, so its tokens never see them, and its cache length is set
        back to its own end afterwards."""
        from ktinject import kv_cache

        r0, B = jobs[0].row, len(jobs)
        sizes = [j.end - j.start for j in jobs]
        S = max(sizes)
        ids = torch.full((B, S), self.pad_id, dtype=torch.long)  # [B, S]
        for i, j in enumerate(jobs):
            ids[i, :sizes[i]] = torch.tensor(j.seq.prompt[j.start:j.end])
        ends = sorted({n - 1 for n, j in zip(sizes, jobs) if j.last})
        keep = 1 if B == 1 else torch.tensor(ends, device=self.device)
        out = kv_cache.forward(self.model, self.kv.rows(r0, r0 + B), ids.to(self.device), logits_to_keep=keep)
        if min(sizes) < S:
            self.kv.lengths[:, r0:r0 + B] = torch.tensor([j.end for j in jobs], device=self.device)
        if B == 1:
            return out.logits[:, -1]  # [1, V]
        return torch.stack([out.logits[i, ends.index(n - 1)] for i, (n, j) in enumerate(zip(sizes, jobs)) if j.last])

    def decode(self, tokens: list[int], b: int) -> torch.Tensor:
        """One token for rows 0..n-1 (n = len(tokens)) in the bucket ``b``; logits [n, V]."""
        from ktinject import compat

        n = len(tokens)
        cache = self.runner.rows(b)
        ids = torch.tensor(tokens + [self.pad_id] * (b - n), dtype=torch.long).view(b, 1).to(self.device)
        pos = cache.row_lengths[:b, None].clone()  # [b, 1]: every row at its own position
        out = self.runner(input_ids=ids, position_ids=pos, use_cache=True, **compat.cache_arg(cache))
        if b > n:
            self.kv.lengths[:, n:b] -= 1  # padding rows: their dummy token is forgotten
        return out.logits[:n, -1]

    def after_decode(self) -> None:
        if self._rebalancer is not None:
            self._rebalancer.step()


def pad_id(model, tokenizer) -> int:
    """The token that fills padding: the tokenizer's or the generation config's pad token, else 0."""
    for v in (getattr(tokenizer, "pad_token_id", None), getattr(model.generation_config, "pad_token_id", None)
              if getattr(model, "generation_config", None) is not None else None):
        if isinstance(v, int):
            return v
    return 0


def _rebalancer(model):
    """The dynamic hot-expert placement's Rebalancer (stepped once per decode step), or None."""
    try:
        from ktinject.gpu_experts import placement
    except ImportError:
        return None
    get = getattr(placement, "rebalancer", None)
    return get(model) if get is not None else None
