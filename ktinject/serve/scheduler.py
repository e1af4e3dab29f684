"""Which request holds which KV-cache row, and what the engine does next: pure bookkeeping, no torch.

Rows (slots of ``ktinject.decode.kv_cache``, ``max_batch`` of them, allocated once) are kept compact:

- rows 0..n-1 hold the n *running* requests (prompt in the cache, decoding), so one decode step of the bucket
  b >= n covers exactly them, plus b - n padding rows;
- row n holds at most one request whose prompt is *partly* prefilled (a long prompt is prefilled in chunks between
  decode steps; the chunk budget of a step is spent on the oldest admitted request first, and a prefill forward
  either continues or starts one long prompt, or takes several whole short ones, so at most one is left half done);
- the other rows are free.

A request's prompt is cut into chunks at multiples of ``chunk`` from its start, whatever else the step holds: a chunk
that does not fit what is left of a step's budget waits for the next step instead of being cut. So the forwards a
prompt goes through (how many tokens each, hence which kernels: a one-token chunk runs the decode-step attention,
torch's CPU GEMMs round 1-3 rows otherwise than more) are the same alone and among other requests, and so are its
tokens. For the same reason only chunks of at least ``MIN_SHARED`` tokens share a padded forward (a shorter prompt
alone would run those other kernels).

A running request that finishes or is cancelled frees its row at once: the last running row moves into the hole
(``copy_row``) and the half-prefilled request, if any, moves down one row behind it, so the layout above holds
again before the next step; the moves come back as (src, dst) pairs for the engine to apply to the cache, in
order. A waiting request takes the next row when its prefill starts and joins the running rows when its last prompt
chunk is in. Requests are admitted first come, first served.

``Scheduler`` works on any objects with a ``prompt_len`` attribute; it sets ``row`` and ``prefilled`` on them.
With ``reuse`` (the engine's prefix cache: ``reuse(seq)`` -> prompt tokens its row will get restored, whole
blocks, < prompt_len), a request's prefill starts at that position instead of 0; its chunks are cut as above from
there.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ktinject.serve.errors import QueueFull


#: the fewest tokens of a chunk that shares a padded prefill forward with others (see the module docstring)
MIN_SHARED = 4


@dataclass
class PrefillJob:
    """Prefill prompt tokens [start, end) of ``seq`` into ``row``; ``fresh``: the row must be reset first."""

    seq: object
    row: int
    start: int
    end: int

    @property
    def fresh(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.end == self.seq.prompt_len


class Scheduler:
    """Slots and admission (see the module docstring). Not thread-safe: the engine holds its lock around calls."""

    def __init__(self, max_batch: int, max_queue: int):
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} and {max_queue}")
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.waiting: deque = deque()
        self.running: list = []  # running[i] holds row i
        self.prefilling = None  # the half-prefilled request, in row len(running)
        self._group: list[PrefillJob] = []  # the jobs of the prefill forward under way
        self.reuse = None  # seq -> prompt tokens restored before its prefill (the prefix cache), or None: 0

    # ---- state ---------------------------------------------------------------------------------------------
    @property
    def held_rows(self) -> int:
        """Rows with a request in them: running, half-prefilled, or in the prefill forward under way."""
        return len(self.running) + (self.prefilling is not None) + len(self._group)

    @property
    def free_rows(self) -> int:
        return self.max_batch - self.held_rows

    def idle(self) -> bool:
        return not (self.waiting or self.held_rows)

    def holds(self, seq) -> bool:
        return seq is self.prefilling or any(s is seq for s in self.running) or any(s is seq for s in self.waiting)

    def check(self) -> None:
        """Assert the row layout (tests and debugging)."""
        for i, s in enumerate(self.running):
            assert s.row == i, f"running request in row {s.row} listed at {i}"
        if self.prefilling is not None:
            assert self.prefilling.row == len(self.running), "the half-prefilled request is not right after the running rows"
            assert 0 < self.prefilling.prefilled < self.prefilling.prompt_len
        assert len(self.running) + (self.prefilling is not None) <= self.max_batch
        assert all(s.row is None for s in self.waiting)

    # ---- admission -----------------------------------------------------------------------------------------
    def submit(self, seq) -> None:
        """Queue ``seq``; ``QueueFull`` when ``max_queue`` requests already wait beyond the free rows (a request
        that a free row takes at the next step does not count as waiting)."""
        if len(self.waiting) - self.free_rows >= self.max_queue:
            raise QueueFull(f"every row is busy and {self.max_queue} requests already wait for one (--max-queue); "
                            "retry later")
        seq.row, seq.prefilled = None, 0
        self.waiting.append(seq)

    def next_prefill(self, budget: int, chunk: int, max_len: int | None = None) -> list[PrefillJob]:
        """The prompt chunks of the next prefill forward, in rows n, n+1, ... (n running rows); [] when nothing
        waits, no row is free or the next chunk does not fit ``budget`` (prompt tokens left in this step). The first
        job continues the half-prefilled request, else starts the oldest waiting one: its next chunk, up to the next
        multiple of ``chunk`` of its prompt (never cut by the budget: see the module docstring); more waiting
        requests join while their whole prompts fit, padded to the longest chunk: (jobs) x (longest) <= ``chunk``
        tokens, every chunk at least ``MIN_SHARED`` tokens and, with ``max_len`` (cache length), every row's padded
        end within it. Many short prompts thus share one forward, which reads the expert weights once for all of
        them. Only the first job can be partial. Call ``prefilled(jobs)`` once the forward ran, or
        ``prefill_failed(jobs)``."""
        assert not self._group, "prefilled() or prefill_failed() of the previous jobs first"
        n = len(self.running)
        if budget <= 0 or n >= self.max_batch:
            return []
        seq = self.prefilling
        if seq is None and not self.waiting:
            return []
        done = self._reused(self.waiting[0]) if seq is None else seq.prefilled
        take = min((seq or self.waiting[0]).prompt_len - done, chunk - done % chunk)  # to the next chunk boundary
        cut = getattr(seq or self.waiting[0], "cut_at", None)  # a position a chunk must end at (a state checkpoint)
        if cut is not None and done < cut:
            take = min(take, cut - done)
        if take > budget:
            return []
        if seq is None:
            seq = self.waiting.popleft()
            seq.row, seq.prefilled = n, done
        jobs = [PrefillJob(seq, seq.row, seq.prefilled, seq.prefilled + take)]
        self.prefilling = None  # in the group now; prefilled() puts a partial one back
        width, budget = take, budget - take
        while jobs[0].last and take >= MIN_SHARED and self.waiting and n + len(jobs) < self.max_batch:
            nxt = self.waiting[0]
            start = self._reused(nxt)
            size = nxt.prompt_len - start
            wide = max(width, size)
            fits = (len(jobs) + 1) * wide <= chunk and MIN_SHARED <= size <= budget
            if max_len is not None:
                fits = fits and all(j.start + wide <= max_len for j in jobs) and start + wide <= max_len
            if not fits:
                break
            self.waiting.popleft()
            nxt.row, nxt.prefilled = n + len(jobs), start
            jobs.append(PrefillJob(nxt, nxt.row, start, nxt.prompt_len))
            width, budget = wide, budget - size
        self._group = jobs
        return jobs

    def _reused(self, seq) -> int:
        return 0 if self.reuse is None else int(self.reuse(seq))

    def prefilled(self, jobs: list[PrefillJob]) -> list:
        """Record that ``jobs`` ran; the requests whose whole prompt is in now (running from now on, in row order)."""
        assert jobs is self._group, "prefilled() takes the jobs next_prefill() gave"
        self._group = []
        done = []
        for job in jobs:
            job.seq.prefilled = job.end
            if job.last:
                done.append(job.seq)
            else:
                assert job is jobs[0] and len(jobs) == 1, "only a lone first job may be partial"
                self.prefilling = job.seq
        self.running.extend(done)
        return done

    def prefill_failed(self, jobs: list[PrefillJob]) -> list:
        """The forward of ``jobs`` failed: their requests leave (rows free; the caller fails them). Returns them."""
        assert jobs is self._group
        self._group = []
        for job in jobs:
            job.seq.row = None
        return [job.seq for job in jobs]

    # ---- release -------------------------------------------------------------------------------------------
    def release(self, seq) -> list[tuple[int, int]]:
        """Forget ``seq`` wherever it is; returns the row moves (src, dst) that keep the layout compact."""
        return self.release_many([seq])[0]

    def release_many(self, seqs) -> tuple[list[tuple[int, int]], list[int]]:
        """Forget several requests at once; (row moves (src, dst) to apply in order, rows free afterwards). Moves are
        as few as can be: only survivors above the new end of the running rows move, into the holes below it."""
        gone = {id(s) for s in seqs}
        held = len(self.running) + (self.prefilling is not None)
        self.waiting = deque(s for s in self.waiting if id(s) not in gone)
        survivors = [s for s in self.running if id(s) not in gone]
        n = len(survivors)
        holes = [s.row for s in self.running if id(s) in gone and s.row < n]
        movers = [s for s in survivors if s.row >= n]
        moves = []
        for s, hole in zip(movers, holes):
            moves.append((s.row, hole))
            s.row = hole
        for s in seqs:
            if s is not self.prefilling:
                s.row = None
        self.running = sorted(survivors, key=lambda s: s.row)
        if self.prefilling is not None and id(self.prefilling) in gone:
            self.prefilling.row, self.prefilling = None, None
        if self.prefilling is not None and self.prefilling.row != n:
            moves.append((self.prefilling.row, n))  # after the others: row n may have been a source above
            self.prefilling.row = n
        return moves, list(range(n + (self.prefilling is not None), held))
