"""The serving engine's model runner: the KV cache's rows, a prefill forward of prompt chunks, a decode forward of
the running rows. No requests, no threads: the engine (``engine.py``) decides what runs (``scheduler.py`` which
rows), ``ModelRunner`` runs it on the model.

- ``setup()`` (on the engine thread): the model's ``GraphRunner`` with the engine's batch buckets, its KV cache
  (``max_batch`` rows x ``max_context`` tokens, allocated once: fixed addresses for the graphs), and, with
  ``warmup``, K/V of every row allocated and every bucket's decode graph captured before the first request;
- ``next_tokens`` [max_batch] (int64, on the device): each row's next input token, written by the sampling of the
  step before (or of its prompt's last chunk) on the device, so a decode step never waits for the host to hand it
  its tokens; rows without a decoding request hold ``pad_id`` (the padding rows of a bucket);
- ``prefill(jobs, sample)``: one forward of the jobs' prompt chunks in consecutive rows, right-padded to the
  longest, rounded up (``padded_width``: a bounded set of shapes on CUDA), and the first tokens of the prompts it
  ends (into their rows' ``next_tokens`` and to the host);
- ``decode(n, b, sample)``: queues one token for rows 0..n-1 in the bucket b >= n (on CUDA a graph replay; rows
  n..b-1 are padding whose cache lengths are put back), its sampling into ``next_tokens`` and one copy of the n new
  tokens to pinned host memory, and returns at once: a ``Decoded`` whose ``tokens()`` waits for them;
- ``move_row`` / ``reset_rows``: the scheduler's row moves and freed rows, queued on the device without waiting
  (the step in flight still reads the old layout; stream order puts them after it);
- ``after_decode()``: the dynamic hot-expert placement's step, where there is one.
Legend: B rows of a prefill forward, S its width (longest chunk, rounded up), n running rows, b bucket, V vocabulary.
"""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import torch

from ktinject.decode import linear_attention_state as linear_state
from ktinject.serve.scheduler import PrefillJob

log = logging.getLogger("ktinject.serve")


def padded_width(width: int, pad: int, room: int) -> int:
    """A prefill forward's width: ``width`` (its longest chunk) up to the next power of two while that is <= ``pad``,
    else up to a multiple of ``pad``; never past ``room`` (>= width: what the rows' cache has left, and the step's
    prefill_chunk over the rows) nor below width. ``pad`` 1: the width as is. So about log2(pad) + prefill_chunk /
    pad widths, and a few where room cuts them (EngineConfig.prefill_pad: why)."""
    if pad <= 1:
        return width
    out = 1 << (width - 1).bit_length()
    if out > pad:
        out = -(-width // pad) * pad
    return max(width, min(out, room))


class ModelRunner:
    """The forwards of a serving engine over ``model`` with ``config`` (an EngineConfig); ``pad_id`` fills padding.
    ``runner`` is the model's ``GraphRunner`` (``ktinject.decode``), which this class drives."""

    def __init__(self, model, config, pad_id: int):
        self.model, self.config, self.pad_id = model, config, pad_id
        self.runner = self.kv = self.next_tokens = None
        self._rebalancer = None
        self.pad = 1  # prefill widths rounded (padded_width); setup() sets it from the config and the device
        self.hybrid = False  # linear-attention state in the cache (setup() reads it): no padding, rows kept
        self._host: list[_HostSlot] = []  # two: a step in flight and the one whose tokens the host reads
        self._slot = 0
        self.row_hooks: list = []  # per-row state beside the cache (serve's penalty counts): _move_row_state

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def setup(self) -> None:
        """The runner, its cache and, on CUDA, every bucket's graph (see the module docstring)."""
        from ktinject.decode.generate import get_runner

        cfg = self.config
        self.runner = get_runner(self.model, buckets=cfg.buckets, max_cache_len=cfg.max_context,
                                 use_graphs=cfg.graphs)
        for b in reversed(cfg.buckets):
            self.runner.cache_for(b, cfg.max_context)
        self.kv = self.runner.kv
        self.next_tokens = torch.full((self.kv.slots,), self.pad_id, dtype=torch.long, device=self.device)
        cuda = self.device.type == "cuda"
        self.pad = cfg.prefill_pad if cfg.prefill_pad is not None else (16 if cuda else 1)
        self.hybrid = getattr(self.kv, "linear", None) is not None  # linear-attention state beside K/V
        if self.hybrid:  # a recurrent state has no padding mask: a padded position would move it
            self.pad = 1
        # the host waits for a step's tokens as it waits for the GPU elsewhere: sleeping where the runner
        # leaves the cores to the native expert threads ("block"), else spinning
        blocking = cuda and self.runner.host_wait == "block"
        self._host = [_HostSlot(self.kv.slots, cuda, blocking) for _ in range(2)]
        self._rebalancer = _rebalancer(self.model)
        if cfg.warmup:
            t0 = time.perf_counter()
            k = min(8, cfg.max_context)
            probe = SimpleNamespace(prompt=[self.pad_id] * k, prompt_len=k)
            self.prefill([PrefillJob(probe, 0, 0, k)])  # allocates K/V of every row
            for b in cfg.buckets if self.runner.graphs_enabled() else cfg.buckets[-1:]:
                self._forward(b, b)
            self.reset_rows(range(self.kv.slots))
            if cuda:
                torch.cuda.synchronize(self.device)
            log.info("warm-up in %.1f s (%s)", time.perf_counter() - t0, self.runner.describe())
            self._prepare_prefill(cuda)

    def _prepare_prefill(self, cuda: bool) -> None:
        """The streamed prefill's one-time work (page-locking the experts, the ring, auto's measurements) at start,
        after the cache and the graphs took their memory, not inside the first long prompt's forward, where it
        would stall every running stream."""
        from ktinject.gpu_experts.prefill import streamer as stream

        streamer = stream.streamer_of(self.model)
        if cuda and streamer is not None and streamer.mode != "cpu":
            log.info("streamed prefill (%s) set up in %.1f s", streamer.mode, streamer.prepare())

    def prefill(self, jobs: list[PrefillJob], sample=None) -> list[int]:
        """One forward of the jobs' prompt chunks in their rows (consecutive; a job that starts its prompt resets its
        row first), each after what its row holds, right-padded to the longest. ``sample(logits [k, V], out [k])``
        (the logits after the last prompt token of the k jobs that end their prompts) writes their first tokens
        into those rows' ``next_tokens``; returns them (waits: a request's first token is sent at once).
        A padded row's extra tokens come after its own, so its tokens never see them, and its cache length is set
        back to its own end afterwards."""
        from ktinject.decode import kv_cache

        r0, B = jobs[0].row, len(jobs)
        self.reset_rows([j.row for j in jobs if j.fresh])
        sizes = [j.end - j.start for j in jobs]
        if self.hybrid and len(set(sizes)) > 1:  # no padding into a recurrent state: one forward per job
            first = []
            for j in jobs:
                first += self.prefill([j], sample)
            return first
        room = min(self.kv.max_len - max(j.start for j in jobs), max(self.config.prefill_chunk // B, max(sizes)))
        S = padded_width(max(sizes), self.pad, room)  # padding never takes a forward past the step's chunk
        ids = torch.full((B, S), self.pad_id, dtype=torch.long)  # [B, S]
        for i, j in enumerate(jobs):
            ids[i, :sizes[i]] = torch.tensor(j.seq.prompt[j.start:j.end])
        ends = sorted({n - 1 for n, j in zip(sizes, jobs) if j.last})
        keep = 1 if B == 1 and sizes[0] == S else torch.tensor(ends or [S - 1], device=self.device)
        out = kv_cache.forward(self.model, self.kv.rows(r0, r0 + B), ids.to(self.device), logits_to_keep=keep)
        if min(sizes) < S:
            self.kv.lengths[:, r0:r0 + B] = torch.tensor([j.end for j in jobs], device=self.device)
        done = [i for i, j in enumerate(jobs) if j.last]  # a suffix of the jobs: only the first may be partial
        if sample is None or not done:
            return []
        if B == 1:
            logits = out.logits[:, -1]  # [1, V]: the one position kept
        else:
            logits = torch.stack([out.logits[i, ends.index(sizes[i] - 1)] for i in done])  # [k, V]
        first = self.next_tokens[r0 + done[0]:r0 + B]
        sample(logits, first)
        return first.tolist()

    def decode(self, n: int, b: int, sample) -> "Decoded":
        """Queue one decode step of rows 0..n-1 in the bucket ``b`` from their ``next_tokens``; ``sample(logits [n, V],
        out [n])`` writes the new tokens into ``next_tokens[:n]`` (on the device, without waiting); their copy to the
        host is queued too. Returns without waiting for any of it (on CUDA; on the CPU the step has run)."""
        slot = self._host[self._slot]
        self._slot ^= 1
        slot.claim()
        try:
            logits = self._forward(n, b, slot)
            out = self.next_tokens[:n]
            sample(logits, out)
            slot.copy(out)
        except BaseException:
            slot.busy = False
            raise
        return Decoded(slot, n)

    def _forward(self, n: int, b: int, slot: "_HostSlot | None" = None) -> torch.Tensor:
        """The forward of a decode step (``slot``: where its duration is noted); logits [n, V]."""
        from ktinject import compat

        cache = self.runner.rows(b)
        ids = self.next_tokens[:b].view(b, 1)  # a graph copies it into its static input; eager reads it first
        pos = cache.row_lengths[:b, None].clone()  # [b, 1]: every row at its own position (the forward moves them)
        saved = linear_state.save_rows(self.kv.linear, n, b) if self.hybrid and b > n else None
        if slot is not None:
            slot.start()
        out = self.runner(input_ids=ids, position_ids=pos, use_cache=True, **compat.cache_arg(cache))
        if slot is not None:
            slot.stop()
        if b > n:
            self.kv.lengths[:, n:b] -= 1  # padding rows: their dummy token is forgotten
            if saved is not None:  # (a recurrent state forgets it only by being put back)
                linear_state.restore_rows(self.kv.linear, n, b, saved)
        return out.logits[:n, -1]

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Row ``dst`` becomes row ``src`` (K/V of its first ``length`` positions, an upper bound of what it holds;
        lengths; next token), queued after the step in flight."""
        self.kv.copy_row(src, dst, min(int(length), self.kv.max_len))
        self.next_tokens[dst:dst + 1].copy_(self.next_tokens[src:src + 1])
        self._move_row_state(src, dst)

    def _move_row_state(self, src: int, dst: int) -> None:
        """Each row hook's state of row ``src`` to ``dst`` (``row_hooks``: objects with ``move_row(src, dst)`` and
        ``reset_rows(a, b)``, queued on the device like the cache's moves)."""
        for hook in self.row_hooks:
            hook.move_row(src, dst)

    def _reset_row_state(self, a: int, b: int) -> None:
        """Rows a..b-1 freed: each row hook forgets them."""
        for hook in self.row_hooks:
            hook.reset_rows(a, b)

    def reset_rows(self, rows) -> None:
        """Forget ``rows`` (consecutive): no tokens held, padding as next token; slices, so no host sync."""
        rows = list(rows)
        if not rows:
            return
        a, b = rows[0], rows[-1] + 1
        if rows != list(range(a, b)):
            raise ValueError(f"reset_rows takes consecutive rows, got {rows}")
        self.kv.reset_rows(slice(a, b))  # lengths 0 and, for hybrid models, zero linear-attention state
        self.next_tokens[a:b] = self.pad_id
        self._reset_row_state(a, b)

    def after_decode(self) -> None:
        if self._rebalancer is not None:
            self._rebalancer.step()


class _HostSlot:
    """Pinned host memory for one decode step's tokens, the event that says they arrived, and the step's forward
    timing (CUDA events; on the CPU the forward's wall time). ``claim`` before reuse: the previous step that used
    the slot must have been read."""

    def __init__(self, rows: int, cuda: bool, blocking: bool):
        self.cuda = cuda
        self.tokens = torch.zeros(rows, dtype=torch.long, pin_memory=cuda)
        self.arrived = torch.cuda.Event(blocking=blocking) if cuda else None
        self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        self.busy = False
        self.t0 = self.seconds = 0.0

    def claim(self) -> None:
        if self.busy:
            raise RuntimeError("a decode step's tokens were not read before its host slot was reused")
        self.busy = True

    def start(self) -> None:
        if self.cuda:
            self.events[0].record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.events[1].record()
        else:
            self.seconds = time.perf_counter() - self.t0

    def copy(self, out: torch.Tensor) -> None:
        n = out.shape[0]
        if self.cuda:
            self.tokens[:n].copy_(out, non_blocking=True)
            self.arrived.record()
        else:
            self.tokens[:n].copy_(out)


class Decoded:
    """A decode step queued by ``ModelRunner.decode``: ``tokens()`` waits for its n new tokens (a list of ints) and
    frees the host slot; ``forward_seconds`` (after ``tokens()``): the forward's time on the device."""

    def __init__(self, slot: _HostSlot, n: int):
        self._slot, self.n = slot, n
        self.forward_seconds = 0.0

    def tokens(self) -> list[int]:
        slot = self._slot
        try:
            if slot.cuda:
                slot.arrived.synchronize()
                self.forward_seconds = slot.events[0].elapsed_time(slot.events[1]) / 1e3
            else:
                self.forward_seconds = slot.seconds
            return slot.tokens[:self.n].tolist()
        finally:
            slot.busy = False


def pad_id(model, tokenizer) -> int:
    """The token that fills padding: the tokenizer's or the generation config's pad token, else 0."""
    for v in (getattr(tokenizer, "pad_token_id", None), getattr(model.generation_config, "pad_token_id", None)
              if getattr(model, "generation_config", None) is not None else None):
        if isinstance(v, int):
            return v
    return 0


def eos_ids(model, tokenizer) -> frozenset[int]:
    """The tokens that end a completion (``ktinject.decode.stop_tokens.stop_token_ids``): the generation config's
    end-of-sequence ids and the tokenizer's, the chat template's end-of-turn token, the end-of-text tokens."""
    from ktinject.decode.stop_tokens import stop_token_ids

    return frozenset(stop_token_ids(tokenizer, getattr(model, "generation_config", None)))


def _rebalancer(model):
    """The dynamic hot-expert placement's Rebalancer (stepped once per decode step), or None."""
    try:
        from ktinject.gpu_experts.hot import placement
    except ImportError:
        return None
    get = getattr(placement, "rebalancer", None)
    return get(model) if get is not None else None
