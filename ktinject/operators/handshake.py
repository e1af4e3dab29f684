"""Drive one MoE layer's native experts from the CUDA stream, so that a decode step can be captured as a graph.

The eager HybridMoE path waits on an event from the host between the copies and the native task: graph capture
cannot record that. Here the stream itself does the handshake (docs/internals/architecture.md, One decode step):

    start(x, ids, w):  async D2H copies x [T,H], ids [T,k], w [T,k] -> pinned staging
                       cuStreamWriteValue32(go, 1)   ----> a pool thread (ktk_task_watch) sees go == 1, clears it,
    ... the block's own GPU work (shared experts, GPU-resident experts) runs here ...    runs the task, sets done = 1
    finish() -> [T,H]: cuStreamWaitValue32(done == 1); then one kernel (kernels.common.copy) reads the pinned
                       output into a static device buffer (returned) and sets done = 0; where the copy is one
                       program (T x H <= 2048) that kernel polls done itself, no wait node (without Triton:
                       cuStreamWriteValue32(done, 0) and an async H2D copy)

or, with ``mode="hostfn"`` (the slower fallback, kept for comparison): host-callback nodes calling the native
``ktk_submit_fn`` / ``ktk_wait_fn`` instead of the two flag operations.

Where the one-kernel router made the inputs (``kernels.common.router_topk`` with ``stage`` and ``go``: the MoE
operator's routing) it has also raised go, and ``start`` queues nothing: at one token a decode layer's
handshake is then no stream operation at all, only the router kernel and the collect kernel.

Expert deferral (``defer``: d slots or a weight share m, ``ktinject.operators.deferral``): the layer's one task
computes both parts (``Task.split``, memops mode): each token's immediate slots into o, raising done as soon as o
is written, inside its run, then the deferred ones into o_d, its run's end raising done_d; so the CPU goes straight
on to the deferred experts while the stream goes on to the next layer, which collects them with
``finish_deferred()`` (or inside its own collect kernel, ``operators.deferral.LazyCollect``):

    start:  copies; go = 1                          ----> immediate slots; done = 1; deferred slots ...
    finish:  wait done == 1; done = 0; copy out         (meanwhile: the next layer's attention on the GPU)
    (next layer) finish_deferred: wait done_d == 1; done_d = 0; copy out_d   <----------------------- done_d = 1

One job a layer instead of two: two chained tasks (the first's end raising the second's go, ``ktk_task_watch_then``)
paid a second routing, gather and phase start and tail (docs/performance.md, Why the defaults are what they are;
the switch back to them is retired). (hostfn: two tasks, both submitted at ``start``; the pool runs a pool's tasks
in submission order.)

Everything a captured graph touches (staging buffers, the go/done words, the task and its binding, the device
output) is allocated once per (layer, T) and keeps its address until ``close()``. ``finish()`` returns the same
device tensor every time: it is valid until this runner's next ``start``.

Legend: T tokens, k experts per token, E experts, H hidden.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref

import torch

from ktinject.native import cuda_driver
from ktinject.operators.kernels import common as fused
from ktinject.operators.kernels import dense as fused_dense

log = logging.getLogger(__name__)
_state = threading.local()


def active() -> bool:
    """True while the caller (GraphRunner warm-up and capture) wants HybridMoE to go through StreamExperts."""
    return getattr(_state, "active", False)


@contextlib.contextmanager
def stream_mode(enabled: bool = True):
    """Within this block (this thread), ``active()`` is ``enabled``."""
    prev = active()
    _state.active = enabled
    try:
        yield
    finally:
        _state.active = prev


def host_dtype(dtype: torch.dtype) -> torch.dtype:
    """What native reads/writes for a device tensor of ``dtype`` (activations, outputs, routing weights): bf16 stays
    bf16, anything else is float32."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


class StreamExperts:
    """One layer's routed experts for a fixed token count T, signalled from the CUDA stream.

    ``experts``: native.Experts; ``skip``: uint8 [E] host tensor read by native at run time (or None);
    ``mode``: "memops" (stream memory operations), "hostfn" (host-callback nodes) or None (best available);
    ``defer``: an int d > 0 splits each token's slots into k - d immediate and d deferred ones, a float 0 < m < 1
    into its lowest-weighted slots up to a share m of its routing weight, deferred, and the others (Task.select;
    ``finish_deferred``)."""

    DONE, DONE_D = 16, 48  # the done words' indices in ``flags`` (the waits' addresses and collect's resets)

    def __init__(self, experts, T: int, k: int, hidden: int, device, *, dtype=torch.bfloat16,
                 weights_dtype=torch.float32, skip: torch.Tensor | None = None, mode: str | None = None, pool=None,
                 defer: int | float = 0):
        from ktinject import native

        self.T, self.k, self.hidden, self.defer = int(T), int(k), int(hidden), defer
        if not native.valid_defer(defer, self.k):
            raise ValueError(f"StreamExperts defer={defer!r}: expected an int with 0 <= defer < k = {self.k} (slots "
                             f"per token) or a float with 0 < defer < 1 (share of each token's routing weight)")
        self.device = torch.device(device)
        self.dtype = dtype  # device dtype of hidden and output
        self.mode = mode or cuda_driver.default_sync_mode()
        if self.mode not in ("memops", "hostfn"):
            raise ValueError(f"StreamExperts mode {self.mode!r}: expected 'memops' or 'hostfn'")
        hdt, wdt = host_dtype(dtype), host_dtype(weights_dtype)
        pin = dict(pin_memory=True)
        self.h = torch.zeros((self.T, self.hidden), dtype=hdt, **pin)  # [T, H]
        self.ids = torch.zeros((self.T, self.k), dtype=torch.int64, **pin)  # [T, k]
        self.w = torch.zeros((self.T, self.k), dtype=wdt, **pin)  # [T, k]
        self.o = torch.zeros((self.T, self.hidden), dtype=hdt, **pin)  # [T, H]
        self.out = torch.zeros((self.T, self.hidden), dtype=dtype, device=self.device)  # [T, H] static, on device
        self.skip = skip
        # go at word 0, done at 16 (deferred task: go_d at 32, done_d at 48): separate 64-byte lines (the GPU
        # writes one while the CPU polls another)
        self.flags = torch.zeros(64, dtype=torch.int32, **pin)
        self.go_addr = self.flags.data_ptr()
        self.done_addr = self.go_addr + self.DONE * 4
        self.task = native.Task(pool)
        self.task.bind(experts, self.h, self.ids, self.w, skip=skip, out=self.o)
        self.dtask = None
        self.split = False  # one task computes both parts (memops mode), raising done mid-run
        if self.defer:
            # [T, H] deferred slots' sum; pinned like o (zeros_like would not pin it: no H2D copy in a capture)
            self.o_d = torch.zeros((self.T, self.hidden), dtype=hdt, **pin)
            self.out_d = torch.zeros_like(self.out)  # [T, H] static, on device
            self.split = self.mode == "memops"
            if self.split:  # done (word 16) once o is written, the run's end raising done_d (48)
                self.task.split(self.defer, self.o_d, self.done_addr)
            else:
                self.task.select("top", self.defer)
                self.dtask = native.Task(self.task.pool)
                self.dtask.bind(experts, self.h, self.ids, self.w, skip=skip, out=self.o_d)
                self.dtask.select("rest", self.defer)
        self._watched = False
        # the output's copy and the done word's reset as one kernel (decided once, outside any capture): memops
        # mode, Triton usable on this device (the host buffers are pinned above)
        self._collect_kernel = self.mode == "memops" and fused.available(self.out)
        # ... which also waits for done itself where one program does the copy: one poller saves the wait node,
        # but several programs polling host memory cost more than it does (docs/performance.md)
        self._spin = self._collect_kernel and self.T * self.hidden <= fused.COPY_BLOCK
        self.pending = False  # finish(lazy=True) left the collect to the caller (collect_add_rms_norm / flush)
        self.staged_ids = None  # the ids tensor of a routing whose kernel wrote h, ids and w itself (see start)
        self.raised_ids = None  # ... and raised go too (go_word)
        if self.mode == "memops":
            self.go_dptr = cuda_driver.host_device_pointer(self.go_addr)
            self.done_dptr = cuda_driver.host_device_pointer(self.done_addr)
            if self.defer:
                self.done_d_dptr = cuda_driver.host_device_pointer(self.go_addr + self.DONE_D * 4)
            self._watch()
        else:
            self.submit_fn, self.wait_fn = native.host_fn_addresses()

    def _watch(self) -> None:
        if self.split:
            self.task.watch(self.go_addr, self.go_addr + self.DONE_D * 4)  # (done: raised by the run itself)
        elif self.dtask is not None:
            go_d, done_d = self.go_addr + 32 * 4, self.go_addr + self.DONE_D * 4
            # immediate before deferred in the watch list: a pool's round-robin scan of go flags starts after
            # the task it took last, so each of the two finds the next one's go first
            self.task.watch(self.go_addr, self.done_addr, then_addr=go_d)
            self.dtask.watch(go_d, done_d)
        else:
            self.task.watch(self.go_addr, self.done_addr)
        self._watched = True

    def _tasks(self) -> list:
        """The open tasks, the immediate one first (its end raises the deferred task's go); a closed task (its
        pool closed, e.g. native's exit hook) is unwatched already."""
        return [t for t in (self.task, self.dtask) if t is not None and t._p is not None]

    def _unwatch(self) -> None:
        """Stop watching; returns once the pool no longer touches the words (a run in progress has ended). Every
        task is unwatched before the first error a watched run kept is raised."""
        if self._watched:
            self._watched = False
            _each(self._tasks(), lambda t: t.unwatch())

    def go_word(self) -> torch.Tensor | None:
        """The pinned go word [1] int32 for a routing kernel to raise itself (memops mode), else None."""
        return self.flags[0:1] if self._collect_kernel else None  # (the collect kernel runs in memops mode only)

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Queue on the current stream: copy x [T,H], ids [T,k], weights [T,k] to the host, then start the task.
        No copies when ``ids`` is ``staged_ids``: the routing kernel that made them wrote all three into h, ids
        and w already (operators/kernels/common.py, router_topk's stage; HybridMoE.routing sets it), and nothing at all
        when it is ``raised_ids``: that kernel raised go too (``go_word``)."""
        if x.shape != (self.T, self.hidden) or ids.shape != (self.T, self.k):
            raise ValueError(f"StreamExperts(T={self.T}, k={self.k}, H={self.hidden}) got hidden "
                             f"{tuple(x.shape)} and ids {tuple(ids.shape)}")
        stream = torch.cuda.current_stream(self.device).cuda_stream
        staged, self.staged_ids = self.staged_ids is ids, None
        raised, self.raised_ids = self.raised_ids is ids, None
        if raised:
            return
        if not staged:
            self.h.copy_(x.detach(), non_blocking=True)
            self.ids.copy_(ids, non_blocking=True)
            self.w.copy_(weights.detach(), non_blocking=True)
        if self.mode == "memops":  # the default write fences the copies before it
            cuda_driver.stream_write_value32(stream, self.go_dptr, 1)
        else:
            cuda_driver.launch_host_func(stream, self.submit_fn, self.task.address)
            if self.dtask is not None:  # runs after the immediate task (a pool runs its tasks in order)
                cuda_driver.launch_host_func(stream, self.submit_fn, self.dtask.address)

    def finish(self, lazy: bool = False) -> torch.Tensor:
        """Queue on the current stream: wait for the task, copy its output to the device. Returns [T,H] (static).
        ``lazy``, for one token where the collect kernel waits itself: queue nothing and return ``out`` still
        unwritten (``pending``): the caller then queues ``collect_add_rms_norm`` (the collect inside its residual
        add + norm) or ``flush`` before anything reads it."""
        if self.pending:  # a lazy finish never collected (a step cut short): its done word is unknown
            raise RuntimeError("StreamExperts.finish: the previous lazy finish was never collected (reset_flags "
                               "after an aborted step)")
        if lazy and self.lazy_ok():
            self.pending = True
            return self.out
        return self._collect(getattr(self, "done_dptr", None), self.DONE, self.task, self.o, self.out)

    def flush(self) -> torch.Tensor:
        """The collect a lazy ``finish`` left, queued now (nothing if none is pending). Returns ``out``."""
        if self.pending:
            self.pending = False
            self.finish()
        return self.out

    def collect_add_rms_norm(self, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                             round_twice: bool = False, deferred: StreamExperts | None = None) -> tuple[torch.Tensor,
                                                                                                       torch.Tensor]:
        """The pending collect and ``add_rms_norm(out, residual, weight, ...)`` in one launch
        (``fused_dense.collect_add_rms_norm``): (residual + out, its RMSNorm), each [1, H]; ``out`` written too.
        ``deferred``: the previous MoE layer's runner, whose deferred task's output joins ``out`` in the same launch
        (in place of its ``finish_deferred`` and the add; ``lazy_deferred_ok``)."""
        if not self.pending:
            raise RuntimeError("collect_add_rms_norm: no collect is pending (finish(lazy=True) first)")
        self.pending = False
        d = None if deferred is None else (deferred.o_d, deferred.flags[self.DONE_D:self.DONE_D + 1])
        return fused_dense.collect_add_rms_norm(self.o, self.flags[self.DONE:self.DONE + 1], self.out,
                                                residual.reshape(1, -1), weight, eps, round_twice, deferred=d)

    def lazy_ok(self) -> bool:
        """Whether ``finish(lazy=True)`` leaves the collect to the caller: one token, and the collect kernel polls
        the done word itself."""
        return self._spin and self.T == 1

    def lazy_deferred_ok(self) -> bool:
        """Whether this runner's deferred output can be collected inside the next layer's collect kernel."""
        return bool(self.defer) and self.lazy_ok()

    def finish_deferred(self) -> torch.Tensor:
        """Queue on the current stream (after this runner's ``finish``, typically at the next layer): wait for the
        deferred slots' task, copy its output to the device. Returns [T,H] (static; valid until the next start)."""
        if not self.defer:
            raise RuntimeError("finish_deferred: this StreamExperts defers nothing (defer=0)")
        return self._collect(getattr(self, "done_d_dptr", None), self.DONE_D, self.dtask or self.task, self.o_d,
                             self.out_d)

    def _collect(self, done_dptr, done_word: int, task, o: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Wait for ``task`` (its done word: ``done_dptr``, flags[done_word]), then reset the word and copy its host
        output ``o`` to ``out``: a wait-value and one kernel (kernels.common.copy; polling the word itself, no
        wait-value, where it is one program) where it can run, else a wait-value, a write-value and a copy."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if self.mode == "memops":
            if not self._spin:
                cuda_driver.stream_wait_value32(stream, done_dptr, 1, cuda_driver.CU_STREAM_WAIT_VALUE_EQ)
            if self._collect_kernel:  # (the kernel waits for done itself where _spin)
                fused.copy(o, out, self.flags[done_word:done_word + 1], wait=self._spin)
                return out
            cuda_driver.stream_write_value32(stream, done_dptr, 0)
        else:
            cuda_driver.launch_host_func(stream, self.wait_fn, task.address)
        if o.dtype == self.dtype:
            out.copy_(o, non_blocking=True)
        else:  # e.g. f16 models: native writes f32
            out.copy_(o.to(self.device, non_blocking=True))
        return out

    def drain_deferred(self, timeout: float = 30.0) -> None:
        """Host side, outside capture, for a step cut short after ``finish`` (its ``finish_deferred`` never ran):
        let the device and the deferred task finish, then clear done_d, so that the next step does not take it for
        its own."""
        if not self.defer:
            return
        torch.cuda.synchronize(self.device)  # the stream got past finish: the immediate task is done, go_d raised
        if self.mode != "memops":
            self.dtask.wait()
            return
        deadline = time.monotonic() + timeout
        while int(self.flags[self.DONE_D]) != 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"StreamExperts: the deferred task did not finish within {timeout} s")
            time.sleep(1e-4)
        self.flags[self.DONE_D] = 0

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """start + finish with nothing in between (tests, microbenchmarks)."""
        self.start(x, ids, weights)
        return self.finish()

    def reset_flags(self) -> None:
        """Host-side reset of go/done after an aborted step (call with the device idle and no task of this runner
        running: ``reset`` makes sure of that); a lazy finish left uncollected is dropped."""
        self.flags.zero_()
        self.pending = False
        self.staged_ids = self.raised_ids = None

    def reset(self) -> None:
        """After a step cut short (a failed graph warm-up or capture), host side, with the device synchronized:
        a go raised on the device whose collect was never queued would leave done = 1 behind, which the next
        step's collect would take for its own (reading the output before the CPU wrote it). Stops watching (a run
        already taken ends first; a go not yet taken never runs: its step was abandoned), zeroes the words, drops
        a pending collect, and watches again. A failed run's error is logged (its step is gone)."""
        from ktinject import native

        try:
            if self.mode == "memops":
                self._unwatch()
            else:  # host functions: the submitted tasks end by themselves
                _each(self._tasks(), lambda t: t.wait())
        except native.NativeError as e:
            log.warning("StreamExperts: a run of the abandoned step failed: %s", e)
        self.reset_flags()
        if self.mode == "memops" and self.task._p is not None:
            self._watch()

    def slots_run(self, reset: bool = False) -> tuple[int, int]:
        """(immediate, deferred) (token, slot) rows its tasks computed since the last reset (``Task.slots_run``; 0
        for a task it lacks or has closed); read with the device idle."""
        if self.split and self.task._p is not None:  # one task: both parts, the deferred one counted apart
            rest = self.task.slots_rest(reset)
            return self.task.slots_run(reset) - rest, rest
        return tuple(t.slots_run(reset) if t is not None and t._p is not None else 0
                     for t in (self.task, self.dtask))

    def close(self) -> None:
        """Stop watching and free the task (no captured graph that uses this runner may be replayed afterwards)."""
        try:
            self._unwatch()
        finally:
            self.task.close()
            if self.dtask is not None:
                self.dtask.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _each(tasks: list, op) -> None:
    """op(task) for every task, then the first error any of them raised (none is skipped for an earlier one)."""
    first = None
    for t in tasks:
        try:
            op(t)
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other tasks
            first = first or e
    if first is not None:
        raise first


# (experts object) -> {(T, k, H, device, dtype, weights dtype, mode, defer): StreamExperts}; weak on the experts so a
# dropped model frees its runners. defer as given: an int count or a float share (never equal: 0 < share < 1).
_runners: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_runners_strong: dict[int, tuple[object, dict]] = {}  # fallback for objects that take no weak references


def _table(experts) -> dict:
    try:
        return _runners.setdefault(experts, {})
    except TypeError:
        return _runners_strong.setdefault(id(experts), (experts, {}))[1]


def runner_for(experts, T: int, k: int, hidden: int, device, *, dtype=torch.bfloat16, weights_dtype=torch.float32,
               skip: torch.Tensor | None = None, mode: str | None = None, defer: int | float = 0) -> StreamExperts:
    """The cached StreamExperts of ``experts`` for T tokens (and the deferral setting ``defer``; made on first use:
    call outside graph capture)."""
    mode = mode or cuda_driver.default_sync_mode()
    key = (int(T), int(k), int(hidden), str(torch.device(device)), dtype, weights_dtype, mode, defer)
    table = _table(experts)
    r = table.get(key)
    if r is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"StreamExperts for T={T} was not made before graph capture (warm up first)")
        r = table[key] = StreamExperts(experts, T, k, hidden, device, dtype=dtype, weights_dtype=weights_dtype,
                                       skip=skip, mode=mode, defer=defer)
    return r


def runners(experts=None) -> list[StreamExperts]:
    """All cached runners (of one experts object, or of all)."""
    if experts is not None:
        return list(_table(experts).values())
    tables = list(_runners.values()) + [t for _, t in _runners_strong.values()]
    return [r for t in tables for r in t.values()]


def release(experts=None) -> None:
    """Close and forget the cached runners (of one experts object, or all). Captured graphs using them are dead."""
    if experts is None:
        for r in runners():
            r.close()
        _runners.clear()
        _runners_strong.clear()
        return
    for r in runners(experts):
        r.close()
    try:
        _runners.pop(experts, None)
    except TypeError:
        _runners_strong.pop(id(experts), None)
