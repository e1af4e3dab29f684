"""A ring of two device buffers of packed experts, filled over PCIe on a copy stream (streamed prefill, ``stream``).

An item is a set of experts of one layer (a whole layer, a part of one, or the experts a split gave the GPU), copied
as stored (the bytes of ``native.Experts``' packed regions, page-locked: ``upload.PackedRegion``) into one slot, one
``cudaMemcpyAsync`` per run of consecutive experts. Two slots, so one item is read (dequantized) while the next is
copied; the order is kept by events, with no host wait:

    copy stream:     wait free[s] -> copies into slot s -> record done[s]
    compute stream:  wait done[s] -> dequantize slot s into scratch -> record free[s] (release) -> matmuls ...

Only the dequantization reads a slot, so a slot is free again before the item's matmuls run. At most two items are
in flight: the one being read and one fetched ahead (``prefetch``), which a later ``fetch`` of the same key takes; a
prefetch that turns out unwanted is dropped (its slot is free once its copy is done). On a CPU device the copies are
plain copies and the events are not needed (tests run the same code).

Legend: B bytes of one packed expert, n experts of an item.
"""
from __future__ import annotations

import logging
from typing import Hashable, NamedTuple, Sequence

import torch

log = logging.getLogger(__name__)


class Item(NamedTuple):
    key: Hashable  # e.g. (layer, part)
    experts: tuple  # expert ids, in slot order
    slot: int
    nbytes: int


def runs(experts: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first expert, count, slot position) of each run of consecutive ids in ``experts`` (slot order)."""
    out: list[tuple[int, int, int]] = []
    for pos, e in enumerate(experts):
        if out and out[-1][0] + out[-1][1] == e:
            out[-1] = (out[-1][0], out[-1][1] + 1, out[-1][2])
        else:
            out.append((int(e), 1, pos))
    return out


class timed:
    """``span = timed(trace, what)`` ... ``span.close()``: timing events recorded on the current stream around the
    work queued between, appended to ``trace`` as (what, start, end); nothing when ``trace`` is None."""

    def __init__(self, trace: list | None, what):
        self.trace, self.what = trace, what
        if trace is not None:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()

    def close(self) -> None:
        if self.trace is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.trace.append((self.what, self.start, end))


def intervals(trace: list) -> list[tuple]:
    """(what, start ms, end ms) of each traced span, from the first span's start (synchronizes)."""
    if not trace:
        return []
    torch.cuda.synchronize()
    t0 = trace[0][1]
    return [(what, t0.elapsed_time(a), t0.elapsed_time(b)) for what, a, b in trace]


class Ring:
    """Two slots of ``slot_bytes`` on ``device``; on CUDA a copy stream and done/free events per slot."""

    def __init__(self, device, slot_bytes: int):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.slots = [torch.empty(max(1, int(slot_bytes)), dtype=torch.uint8, device=self.device) for _ in range(2)]
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.done = [torch.cuda.Event() for _ in range(2)] if self.cuda else None
        self.free = [torch.cuda.Event() for _ in range(2)] if self.cuda else None
        self.pending: Item | None = None
        self.copied = 0  # bytes copied in (statistics)
        self.trace: list | None = None  # a list: (key, start, end) timing events of each copy are appended (CUDA)
        self.spans: dict | None = None  # a dict: key -> (start, end, experts) timing events of each copy (CUDA)
        self._next = 0

    @property
    def slot_bytes(self) -> int:
        return self.slots[0].numel()

    @property
    def nbytes(self) -> int:
        return 2 * self.slot_bytes

    def _issue(self, key: Hashable, region: torch.Tensor, expert_bytes: int, experts: Sequence[int]) -> Item:
        """Queue the copy of ``experts``' packed regions (rows of ``region``, uint8 [E * B] on the host) into the
        next slot."""
        B, n = int(expert_bytes), len(experts)
        if n * B > self.slot_bytes:
            raise ValueError(f"ring: {n} experts of {B} bytes do not fit a slot of {self.slot_bytes} bytes")
        s = self._next
        self._next ^= 1
        dst = self.slots[s]
        if self.cuda:
            self.stream.wait_event(self.free[s])  # the slot's last reader is done with it
            with torch.cuda.stream(self.stream):
                span = timed(self.trace, ("copy", key))
                ends = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.spans is not None else None
                if ends:
                    ends[0].record(self.stream)
                for first, count, pos in runs(experts):
                    dst[pos * B:(pos + count) * B].copy_(region[first * B:(first + count) * B], non_blocking=True)
                span.close()
                if ends:
                    ends[1].record(self.stream)
                    self.spans[key] = (ends[0], ends[1], n)
                self.done[s].record(self.stream)
        else:
            for first, count, pos in runs(experts):
                dst[pos * B:(pos + count) * B].copy_(region[first * B:(first + count) * B])
        self.copied += n * B
        return Item(key, tuple(int(e) for e in experts), s, n * B)

    def drop(self) -> None:
        """Forget the item fetched ahead (its slot is free once its copy is done)."""
        item, self.pending = self.pending, None
        if item is not None and self.cuda:
            self.free[item.slot].record(self.stream)  # after the copy, on the copy stream itself

    def prefetch(self, key: Hashable, region: torch.Tensor, expert_bytes: int, experts: Sequence[int]) -> None:
        """Start copying an item that a later ``fetch`` of ``key`` (with the same experts) will take."""
        self.drop()
        self.pending = self._issue(key, region, expert_bytes, experts)

    def fetch(self, key: Hashable, region: torch.Tensor, expert_bytes: int, experts: Sequence[int]) -> Item:
        """The item of ``key``: the prefetched one when it holds these experts, else copied now."""
        item = self.pending
        if item is not None and item.key == key and item.experts == tuple(int(e) for e in experts):
            self.pending = None
            return item
        self.drop()
        return self._issue(key, region, expert_bytes, experts)

    def acquire(self, item: Item) -> torch.Tensor:
        """Slot bytes of ``item`` (uint8 [n * B]) once its copy is done, in the current stream's order."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.done[item.slot])
        return self.slots[item.slot][:item.nbytes]

    def release(self, item: Item) -> None:
        """Nothing queued after this on the current stream reads ``item``'s slot: the next copy may overwrite it."""
        if self.cuda:
            self.free[item.slot].record(torch.cuda.current_stream(self.device))

    def measure_h2d(self, region: torch.Tensor, nbytes: int = 256 << 20, reps: int = 3) -> float:
        """Bytes per second of one large copy from ``region`` (page-locked) into a slot, the best of ``reps``;
        call with nothing in flight."""
        n = min(int(nbytes), region.numel(), self.slot_bytes)
        if not self.cuda or n <= 0:
            return float("inf")
        dst, src = self.slots[0][:n], region[:n]
        best = float("inf")
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)  # warm-up
            for _ in range(reps):
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record(self.stream)
                dst.copy_(src, non_blocking=True)
                t1.record(self.stream)
                t1.synchronize()
                best = min(best, t0.elapsed_time(t1) / 1e3)
        return n / best if best > 0 else float("inf")
