"""Runtime re-placement of hot experts, the ``Rebalancer`` of strategy ``dynamic`` (the default without statistics).

Every ``every`` generated tokens, each layer's experts are re-ranked by recent routed counts (exponentially decayed
by ``decay`` per period) and those whose rank changed are queued to move into the bank, each layer keeping its slot
count; a newcomer replaces a resident only when its score is larger by the fraction ``margin`` (no churn on noise).
Moves never stall decode and no graph is re-captured (bank and tables keep their addresses). One move:
  1. compute stream: retire the slot's expert (slot_of = -1, resident = 0: the CPU computes it from the next step
     on), record an event;
  2. side stream: wait for that event, copy the new expert's bytes into the slot, record an event;
  3. at a later token, once that event is complete (a query, never a wait): admit the new expert on the compute
     stream (slot_of, resident).
The native skip mask is the device ``resident`` table copied to the host inside each step (HybridMoE), so a step
never sees one side's update without the other's.

Rate: at most ``moves_per_step`` moves start per generated token and at most twice that many copies are in flight,
so the copy engine never holds more than a few ms of work; the queue of planned moves (at most ``max_moves`` over
all layers, largest gain first) is replaced at each period, so a queue that could not drain never goes stale.

How a move gets its bytes (``transfer``; "auto" picks, per layer, the first that applies):
  packed  from the layer's packed native region, page-locked once (HotExperts.packed): H2D copy of the bytes as
          stored (bf16, or int8 + scales) and an unpack on the device (``upload``); the CPU only
          launches a few operations;
  staged  the same through pinned staging buffers that a worker fills with a memcpy (the region could not be pinned);
  host    HotExperts.host_weights (float32 via ktk_experts_get) on ``workers`` threads: quants without a device
          unpack (they compete with the native expert threads for the CPU).
A CPU "bank" (gpu="cpu") moves synchronously with the host path ("packed"/"staged" may be asked for, for tests).

Legend: L layers with a bank, E experts per layer, C slots of a layer.
"""
from __future__ import annotations

import logging
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ktinject.gpu_experts.hot.upload import StagingPool, Uploader

log = logging.getLogger(__name__)

TRANSFERS = ("auto", "packed", "staged", "host")


@dataclass
class _Move:
    layer: int  # index into Rebalancer.blocks
    slot: int
    expert: int  # the incoming expert
    kind: str  # packed, staged or host
    future: Future | None = None  # staged/host: host bytes being prepared
    host: Any = None  # staged: staging buffer index; host: host_weights dict (kept alive until the copy is done)
    event: Any = None  # CUDA: the copy is complete


class Rebalancer:
    """Re-places the hot experts of ``blocks`` (HybridMoE with dynamic banks). Pass it to generate as a stopping
    criterion (it never stops anything; placement.place hooks it in) or call ``step()`` once per token yourself.
    Keywords: see the module docstring; ``workers``: threads of the host path; ``chunk_bytes``: H2D copy chunk."""

    def __init__(self, blocks: Sequence, every: int = 64, decay: float = 0.5, max_moves: int = 64,
                 margin: float = 0.25, workers: int = 2, moves_per_step: int = 4, transfer: str = "auto",
                 chunk_bytes: int = 4 << 20):
        self.blocks = [b for b in blocks if b.hot is not None]
        if not self.blocks:
            raise ValueError("Rebalancer: no block has hot experts (place some first)")
        for name, v in (("every", every), ("max_moves", max_moves), ("moves_per_step", moves_per_step)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Rebalancer: {name} must be a positive int, got {v!r}")
        if transfer not in TRANSFERS:
            raise ValueError(f"Rebalancer: transfer {transfer!r}: expected one of {', '.join(TRANSFERS)}")
        if not all(b.hot.dynamic for b in self.blocks):
            raise ValueError("Rebalancer: the banks were placed without re-placement (their steps, maybe already "
                             "captured, do not mirror the residency table): use placement.place(..., 'dynamic')")
        self.every, self.decay, self.max_moves, self.margin = every, float(decay), max_moves, float(margin)
        self.moves_per_step = moves_per_step
        device = self.blocks[0].hot.device
        self.cuda = device.type == "cuda"
        self.kinds = [self._kind(b.hot, transfer) for b in self.blocks]  # [L]
        E = self.blocks[0].num_experts
        self.scores = torch.zeros(len(self.blocks), E, dtype=torch.float64)  # [L, E]
        self._last = torch.stack([b.counts.detach().to("cpu") for b in self.blocks])  # [L, E]
        self._snap = self._snap_event = None
        self._uploader = self._staging = self._worker = None
        layouts = [b.hot.packed.layout for b, k in zip(self.blocks, self.kinds) if k in ("packed", "staged")]
        if layouts:
            eb = max(x.expert_bytes for x in layouts)
            self._uploader = Uploader(device, eb, max(x.work_bytes for x in layouts), chunk_bytes)
            if "staged" in self.kinds:
                self._staging = StagingPool(2 * moves_per_step, eb, pin=self.cuda)
        self._workers = max(1, int(workers))
        if "host" in self.kinds and self.cuda:
            self._worker = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="ktinject-rebalance")
        self._side = torch.cuda.Stream(device) if self.cuda else None
        self._queue: list[_Move] = []  # planned, not started (replaced at each period)
        self._loading: list[_Move] = []  # staged/host: host bytes being prepared
        self._flight: list[_Move] = []  # slot retired, copy queued (CUDA)
        self.tokens = self.periods = self.moved = self.started = 0
        log.info("re-placement: %d layers every %d tokens, at most %d moves per token; transfer %s",
                 len(self.blocks), every, moves_per_step,
                 ", ".join(f"{k} ({self.kinds.count(k)} layers)" for k in sorted(set(self.kinds))))

    def _kind(self, hot, transfer: str) -> str:
        if transfer == "host" or hot.packed is None:
            if transfer in ("packed", "staged"):
                raise ValueError(f"Rebalancer: transfer {transfer!r} needs a device unpack of quant "
                                 f"{hot.experts.quant!r} (bf16, int8 or int4); use 'auto' or 'host'")
            return "host"
        if transfer == "auto":
            return "host" if not self.cuda else "packed" if hot.packed.pinned else "staged"
        if transfer == "packed" and self.cuda and not hot.packed.pinned:
            raise ValueError("Rebalancer: transfer 'packed' but the packed experts could not be page-locked (see "
                             "the log); use 'auto' or 'staged'")
        return transfer

    # HF StoppingCriteria protocol: called once per generated token with the sequences so far
    def __call__(self, input_ids, scores=None, **kwargs) -> torch.Tensor:
        self.step()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def step(self) -> None:
        """One generated token: admit finished moves; every ``every`` tokens plan anew; start a few moves."""
        self.tokens += 1
        self._admit()
        if self.tokens % self.every == 0:
            self.periods += 1
            self._plan()
        self._start(self.moves_per_step, 2 * self.moves_per_step if self.cuda else math.inf)

    def pending(self) -> int:
        """Moves planned and not yet admitted (queued, loading or copying)."""
        return len(self._queue) + len(self._loading) + len(self._flight)

    def drain(self) -> None:
        """Run every planned move to the end (waits; for tests and before measuring)."""
        while self.pending():
            for m in self._loading:
                m.future.result()
            for m in self._flight:
                m.event.synchronize()
            self._admit()
            self._start(math.inf, math.inf)

    def close(self) -> None:
        """Drop the queue, finish the moves under way, stop the threads (before the banks go)."""
        self._queue = []
        self.drain()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        if self._staging is not None:
            self._staging.close()
        self._worker = self._staging = self._uploader = None

    # ---- internals ---------------------------------------------------------------------------------------------
    def _counts(self) -> torch.Tensor | None:
        """[L, E] cumulative counts as of the previous period (CUDA: async snapshot), or None if not ready yet."""
        if not self.cuda:
            return torch.stack([b.counts.detach().clone() for b in self.blocks])
        ready = None
        if self._snap is not None and self._snap_event.query():
            ready = self._snap.clone()
        if self._snap is None or ready is not None:
            if self._snap is None:
                self._snap = torch.zeros(self.scores.shape, dtype=torch.int64, pin_memory=True)
                self._snap_event = torch.cuda.Event()
            for i, b in enumerate(self.blocks):
                self._snap[i].copy_(b.counts, non_blocking=True)
            self._snap_event.record()
        return ready

    def _plan(self) -> None:
        counts = self._counts()
        if counts is None:
            return
        delta = (counts - self._last).clamp_min(0).double()
        self._last = counts
        self.scores.mul_(self.decay).add_(delta)
        under_way = self._loading + self._flight
        self._queue = []
        if len(under_way) >= self.max_moves:  # the previous moves are still loading: do not pile up
            return
        busy = {(m.layer, m.slot) for m in under_way}
        busy_experts = {(m.layer, m.expert) for m in under_way}
        cands = []  # (gain, layer, slot, new expert)
        for li, b in enumerate(self.blocks):
            hot, sc = b.hot, self.scores[li].tolist()
            slots = [s for s in range(hot.C) if (li, s) not in busy]
            resident = set(hot.slot_expert)
            order = sorted(range(hot.E), key=lambda e: (-sc[e], e not in resident, e))
            want = [e for e in order[:hot.C] if e not in resident and (li, e) not in busy_experts]
            outs = sorted(slots, key=lambda s: (-1.0 if hot.slot_expert[s] < 0 else sc[hot.slot_expert[s]]))
            top = set(order[:hot.C])
            outs = [s for s in outs if hot.slot_expert[s] not in top]
            for e, s in zip(want, outs):
                old = hot.slot_expert[s]
                old_score = 0.0 if old < 0 else sc[old]
                if old < 0 or sc[e] > old_score * (1 + self.margin):
                    cands.append((sc[e] - old_score, li, s, e))
        cands.sort(key=lambda c: -c[0])
        self._queue = [_Move(li, s, e, self.kinds[li]) for _, li, s, e in cands[:self.max_moves - len(under_way)]]

    def _start(self, budget: float, cap: float) -> None:
        """Prepare host bytes for queued staged/host moves (bounded by buffers and workers, not by the rate), then
        start up to ``budget`` moves, at most ``cap`` copies in flight: loaded ones first (they hold buffers), then
        queued packed ones, largest gain first."""
        rest = []
        for m in self._queue:
            if m.kind == "packed" or not self._load(m):
                rest.append(m)
        self._queue = rest
        ready = [m for m in self._loading if m.future.done()] + [m for m in self._queue if m.kind == "packed"]
        for m in ready:
            if budget <= 0 or len(self._flight) >= cap:
                break
            if m.future is not None:
                self._loading.remove(m)
                result = m.future.result()  # raises what failed in the worker
                if m.kind == "host":
                    m.host = result
            else:
                self._queue.remove(m)
            self._launch(m)
            budget -= 1

    def _load(self, m: _Move) -> bool:
        """Begin preparing the host bytes of a staged/host move; False when no buffer or worker is free."""
        hot = self.blocks[m.layer].hot
        if m.kind == "staged":
            got = self._staging.fill(hot.packed.expert(m.expert))
            if got is None:
                return False
            m.host, m.future = got
        elif len(self._loading) >= 2 * max(self._workers, self.moves_per_step):
            return False
        elif self.cuda:
            m.future = self._worker.submit(hot.host_weights, m.expert, True)
        else:  # CPU bank: synchronous, deterministic
            m.future = Future()
            m.future.set_result(hot.host_weights(m.expert))
        self._loading.append(m)
        return True

    def _launch(self, m: _Move) -> None:
        """Retire the slot, queue the copy on the side stream (CUDA) or do it now (CPU), count it started."""
        hot = self.blocks[m.layer].hot
        hot.retire(m.slot)  # compute stream: from the next step the CPU serves the old expert
        self.started += 1
        if not self.cuda:
            self._fill(m, hot)
            self._finish(m)
            return
        retired = torch.cuda.Event()
        retired.record()
        with torch.cuda.stream(self._side):
            self._side.wait_event(retired)
            self._fill(m, hot)
            m.event = torch.cuda.Event()
            m.event.record(self._side)
        self._flight.append(m)

    def _fill(self, m: _Move, hot) -> None:
        """Queue the slot's new contents on the current stream."""
        if m.kind == "packed":
            self._uploader.upload(hot, m.slot, hot.packed.expert(m.expert))
        elif m.kind == "staged":
            self._uploader.upload(hot, m.slot, self._staging.view(m.host, hot.packed.layout.expert_bytes))
        else:
            hot.write_slot(m.slot, m.host, non_blocking=self.cuda)

    def _finish(self, m: _Move) -> None:
        hot = self.blocks[m.layer].hot
        hot.admit(m.slot, m.expert)  # compute stream, after the copy (complete: no wait)
        if m.kind == "staged":
            self._staging.release(m.host)
        m.host = m.future = m.event = None
        self.moved += 1

    def _admit(self) -> None:
        keep = []
        for m in self._flight:
            if m.event.query():
                self._finish(m)
            else:
                keep.append(m)
        self._flight = keep
