"""The native thread pool: ``Pool``, the process-wide default pool, and closing every pool at interpreter exit.

A pool's threads run the forwards of ``Experts`` and ``Task`` (experts.py, task.py); tasks made on a pool are closed
with it. The default pool is made on first use with ``default_threads()`` threads (library.py) unless
``set_default_threads`` or KTINJECT_THREADS says otherwise. Users import these names from ktinject.native.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import weakref

from ktinject import envs
from ktinject.native.library import (ERR_SHAPE, ERR_STATE, NativeError, check_rc, checked_int, default_threads,
                                     ffi_lib, warn_if_host_busy, warn_if_oversubscribed)

log = logging.getLogger(__name__)


class Pool:
    """Persistent native thread pool (threads start at once, pinned one to a core when ``pin``; env KTINJECT_PIN=0/1
    overrides). ``threads=None``: one per physical core. Close explicitly (or use as a context manager); tasks
    created on it are closed first.

    Not pinned by default: a pinned thread whose core another process takes cannot move to a freer one, so graph
    decode beside busy processes kept more of its quiet speed unpinned (docs/performance.md, "The native
    bindings")."""

    def __init__(self, threads: int | None = None, pin: bool = False):
        ffi, lib = ffi_lib()
        n = 0 if threads is None else checked_int("threads", threads, 1, 4096)
        out = ffi.new("ktk_pool **")
        check_rc(lib.ktk_pool_create(n, 1 if pin else 0, out))
        self._p = ffi.gc(out[0], lib.ktk_pool_destroy)
        self.threads: int = lib.ktk_pool_threads(self._p)
        self.pin = bool(pin)
        self._tasks: weakref.WeakSet = weakref.WeakSet()
        _track(self)

    @property
    def ptr(self):
        if self._p is None:
            raise NativeError(ERR_STATE, "Pool is closed")
        return self._p

    @property
    def watch_spin_us(self) -> int:
        """Microseconds the threads keep spinning after a watched (CUDA-graph driven) run, instead of sleeping:
        a go flag raised within this window starts all of them at once (default: env KTINJECT_WATCH_SPIN_US, else
        1000; 0 = sleep after the short spin)."""
        _, lib = ffi_lib()
        return int(lib.ktk_pool_watch_spin_us(self.ptr))

    @watch_spin_us.setter
    def watch_spin_us(self, us: int) -> None:
        _, lib = ffi_lib()
        check_rc(lib.ktk_pool_set_watch_spin_us(self.ptr, checked_int("watch_spin_us", us, 0, 10_000_000)))

    def wake(self) -> None:
        """While tasks are watched: open the watch spin window now and wake sleeping threads (call just before a
        graph replay that raises go flags). A no-op otherwise."""
        _, lib = ffi_lib()
        check_rc(lib.ktk_pool_wake(self.ptr))

    def set_profile(self, on: bool = True) -> None:
        """Time every job (forward) of this pool from now on, its parallel phases and the chunks each thread runs
        (``profile()`` reads the sums); ``False`` stops. For measurements: a clock read per chunk."""
        _, lib = ffi_lib()
        check_rc(lib.ktk_pool_set_profile(self.ptr, 1 if on else 0))

    @contextlib.contextmanager
    def profiling(self):
        """Profile the jobs started inside the ``with`` block: yields a dict that ``profile()`` fills at its end
        (the sums from before the block are dropped)."""
        self.profile()
        self.set_profile(True)
        out: dict = {}
        try:
            yield out
        finally:
            self.set_profile(False)
            out.update(self.profile())

    def profile(self) -> dict:
        """The sums since the last call (then zeroed), per job: ``jobs``; ``job_us`` (mean, a job's start to its
        end); ``serial_us`` (mean time outside parallel phases: routing, one-item steps, hand-offs); ``phases``: per
        parallel phase of a job in order, ``wall_us`` (its publication to its last chunk's end), ``busy_us`` (time
        of all threads in its chunks), ``chunks`` (means per job) and ``use`` = busy / (wall x threads); and the
        forwards of at most 16 tokens (decode steps): ``decode_jobs``, the sums of their active experts
        ``decode_experts`` (the distinct experts they read) and of their tokens ``decode_tokens``; the split tasks'
        (expert deferral) immediate parts: ``top_jobs`` that raised their done word during the job and ``top_us``
        (mean, the job's start to that word: what the GPU waits for; failed or empty runs raise it after the job,
        uncounted); ``head_us`` (mean, a job's start to its first parallel phase: routing, gather, planning; the
        rest of ``serial_us`` is between and after its phases). Phases are numbered in each job's order, so jobs of different
        shapes (one token, whose gather runs inline, and several) add different phases into one slot: profile one
        kind of forward at a time. ``use`` counts the pool's threads, not a caller that helps (it can exceed 1)."""
        ffi, lib = ffi_lib()
        n = lib.KTK_PROFILE_LEN
        out = ffi.new("int64_t[]", n)
        got = lib.ktk_pool_profile(self.ptr, out, n)
        if got < 0:
            check_rc(-got)
        v = [int(out[i]) for i in range(got)]
        jobs = max(v[0], 1)
        phases = []
        for i in range(lib.KTK_PROFILE_PHASES):
            count, wall, busy, chunks = v[2 + 4 * i: 6 + 4 * i]
            if count or chunks:
                phases.append({"wall_us": wall / jobs / 1e3, "busy_us": busy / jobs / 1e3, "chunks": chunks / jobs,
                               "use": busy / (wall * self.threads) if wall else float("nan")})
        d = lib.KTK_PROFILE_DECODE
        return {"jobs": v[0], "job_us": v[1] / jobs / 1e3, "phases": phases,
                "serial_us": (v[1] - sum(v[3 + 4 * i] for i in range(lib.KTK_PROFILE_PHASES))) / jobs / 1e3,
                "decode_jobs": v[d], "decode_experts": v[d + 1], "decode_tokens": v[d + 2],
                "top_jobs": v[lib.KTK_PROFILE_TOP], "top_us": v[lib.KTK_PROFILE_TOP + 1] / max(1, v[lib.KTK_PROFILE_TOP])
                / 1e3, "head_us": v[lib.KTK_PROFILE_HEAD] / jobs / 1e3}

    def close(self) -> None:
        """Close tasks made on this pool, then stop and join the threads (after running queued work)."""
        for task in list(self._tasks):
            task.close()
        if self._p is not None:
            ffi, _ = ffi_lib()
            p, self._p = self._p, None
            ffi.release(p)

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Pool(threads={self.threads}, pin={self.pin}{', closed' if self._p is None else ''})"


Pool.__module__ = "ktinject.native"  # where users import it from


# Pools alive, closed (with their tasks) by an atexit hook registered with the first one: at interpreter exit the
# host memory that watched tasks poll (go/done words, pinned staging) is freed in any order, while the pools'
# threads still poll and write it (heap corruption after the GPU soak; ASan: use-after-free in the watch scan).
# atexit runs before any module or object is torn down, and after torch's own hooks were registered (LIFO: first).
_live_pools: weakref.WeakSet = weakref.WeakSet()
_live_lock = threading.Lock()
_exit_hook = False


def _track(pool: Pool) -> None:
    global _exit_hook
    with _live_lock:
        _live_pools.add(pool)
        if not _exit_hook:
            atexit.register(close_all_pools)
            _exit_hook = True


def close_all_pools() -> None:
    """Close every pool and its tasks (unwatch, wait, free). Runs at interpreter exit; a pool used afterwards
    raises NativeError(KTK_ERR_STATE)."""
    for pool in list(_live_pools):
        pool.close()


_default_lock = threading.Lock()
_default_pool: Pool | None = None
_default_threads: int | None = None


def default_pool() -> Pool:
    """The process-wide pool, created on first use: threads = set_default_threads(n), else env KTINJECT_THREADS,
    else ``default_threads()`` (one per physical core, less one from 8 cores up); not pinned (``Pool``)."""
    global _default_pool
    if _default_pool is None:
        with _default_lock:
            if _default_pool is None:
                n = _default_threads
                if n is None:
                    try:
                        n = envs.get("KTINJECT_THREADS")  # None when unset
                    except ValueError as e:  # (names the variable and what to write)
                        raise NativeError(ERR_SHAPE, str(e)) from None
                    if n is not None:
                        warn_if_oversubscribed(n, f"KTINJECT_THREADS={n}")
                _default_pool = Pool(n if n is not None else default_threads())
                log.info("ktinject default pool: %d threads", _default_pool.threads)
                warn_if_host_busy(_default_pool.threads, "set_default_threads / --threads" if _default_threads
                                  else "KTINJECT_THREADS" if n is not None else "the default")
    return _default_pool


def set_default_threads(n: int | None, *, source: str | None = None) -> None:
    """Thread count of the default pool. Before the pool exists: takes effect when it is created. After: a no-op if
    the count matches, else NativeError(KTK_ERR_STATE) (tasks and operators may hold the running pool; make a
    separate Pool(n) instead). Logs a warning when ``n`` exceeds the CPUs this process may use; ``source`` names
    the setting there (default ``set_default_threads(n)``; a CLI passes its flag, ``--threads 64``)."""
    global _default_threads
    if n is not None:
        checked_int("threads", n, 1, 4096)
        warn_if_oversubscribed(n, source or f"set_default_threads({n})")
    with _default_lock:
        if _default_pool is not None and _default_pool._p is not None:
            if n is None or n == _default_pool.threads:
                return
            raise NativeError(ERR_STATE, f"set_default_threads({n}): the default pool already runs with "
                                         f"{_default_pool.threads} threads; call it before first use or use Pool({n})")
        _default_threads = n
