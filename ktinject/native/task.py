"""``Task``: one forward's arguments at a fixed address, run asynchronously on a pool (``ktk_task_*``).

A task is what a CUDA stream drives (a host function launched with ``host_fn_addresses()``, or a pool thread
watching a go flag in pinned memory) and what expert deferral splits into its immediate and deferred parts
(``select``, ``split``; ``valid_defer`` says which settings are ones). Users import these names from ktinject.native.
"""
from __future__ import annotations

from typing import Any

import torch

from ktinject.native.experts import Experts
from ktinject.native.library import ERR_NULL, ERR_SHAPE, ERR_STATE, NativeError, check_rc, checked_int, ffi_lib
from ktinject.native.pool import Pool, default_pool


class Task:
    """One forward's arguments at a fixed address, run asynchronously on a pool (ktk_task_*).

    bind() keeps references to the bound tensors; the native side reads their memory each time the task runs, so
    refill them in place between runs. The task's address and host_fn_addresses() are for cuLaunchHostFunc; watch()
    lets a pool thread run it when a 32-bit go flag (e.g. pinned memory written by a CUDA stream) becomes 1."""

    def __init__(self, pool: Pool | None = None):
        ffi, lib = ffi_lib()
        self.pool = default_pool() if pool is None else pool
        out = ffi.new("ktk_task **")
        check_rc(lib.ktk_task_create(self.pool.ptr, out))
        self._p = ffi.gc(out[0], lib.ktk_task_destroy)
        self._bound: tuple = ()
        self._watch: tuple = ()
        self._signal: torch.Tensor | None = None
        self.pool._tasks.add(self)

    @property
    def ptr(self):
        if self._p is None:
            raise NativeError(ERR_STATE, "Task is closed")
        return self._p

    @property
    def address(self) -> int:
        """The ktk_task* as an int (argument of ktk_submit_fn / ktk_wait_fn)."""
        ffi, _ = ffi_lib()
        return int(ffi.cast("uintptr_t", self.ptr))

    @property
    def out(self) -> torch.Tensor | None:
        return self._bound[-1] if self._bound else None

    def bind(self, experts: Experts, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
             skip: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Bind a forward (same arguments as Experts.forward); returns out (allocated when None). T must be >= 1."""
        _, lib = ffi_lib()
        if not isinstance(experts, Experts):
            raise NativeError(ERR_NULL, f"experts: expected ktinject.native.Experts, got {type(experts).__name__}")
        args, keep = experts._forward_args(hidden, ids, weights, skip, out)
        if args[0] == 0:
            raise NativeError(ERR_SHAPE, "Task.bind: hidden has no tokens (T = 0); a task runs at least one")
        check_rc(lib.ktk_task_bind(self.ptr, experts._p, *args))
        self._bound = (experts,) + keep
        return keep[-1]

    def submit(self) -> None:
        _, lib = ffi_lib()
        check_rc(lib.ktk_submit(self.ptr))

    def wait(self) -> None:
        """Wait for the latest run; raises its error (or one kept from a host-function or watched run)."""
        _, lib = ffi_lib()
        check_rc(lib.ktk_wait(self.ptr))

    def signal(self, word: torch.Tensor | None) -> None:
        """Every submitted run stores 1 to ``word`` (one int32 element, page-locked where a GPU reads it) at its end
        (out complete, or the run failed: wait() then raises its error), before the task is idle: a CUDA kernel
        polling the word waits for the run while the host goes on (ktk_task_signal). The waiter resets it to 0
        before the next submit. None: none. Kept across bind(); the task holds a reference to it."""
        ffi, lib = ffi_lib()
        if word is not None and (not isinstance(word, torch.Tensor) or word.dtype != torch.int32
                                 or word.numel() != 1 or word.device.type != "cpu"):
            raise NativeError(ERR_SHAPE, f"signal: expected one int32 element in host memory, got "
                              f"{type(word).__name__ if not isinstance(word, torch.Tensor) else word.dtype} x "
                              f"{word.numel() if isinstance(word, torch.Tensor) else '?'}")
        ptr = ffi.NULL if word is None else ffi.cast("volatile uint32_t *", word.data_ptr())
        check_rc(lib.ktk_task_signal(self.ptr, ptr))
        self._signal = word

    def times(self) -> tuple[float, float]:
        """The latest run's (start, end) in seconds on time.perf_counter's clock (CLOCK_MONOTONIC), (0.0, 0.0)
        before any run; call when the task is not running (after wait(), or once its signal word is 1 and wait()
        returned)."""
        ffi, lib = ffi_lib()
        begin, end = ffi.new("int64_t *"), ffi.new("int64_t *")
        check_rc(lib.ktk_task_times(self.ptr, begin, end))
        return begin[0] / 1e9, end[0] / 1e9

    def select(self, slots: str = "all", defer: int | float = 0) -> None:
        """Which of each token's k slots the bound forward computes (expert deferral): "all", "top" (the token's
        immediate slots) or "rest" (its deferred ones). ``defer``: an int d, the d lowest-weighted slots deferred
        (ktk_task_select), or a float share 0 < m < 1, the lowest-weighted slots whose cumulative share of the
        token's routing weight stays <= m, never the top one (ktk_task_select_share; m is read as a C float).
        Ranking: equal weights, the lower slot first. bind() resets it to "all"."""
        _, lib = ffi_lib()
        codes = {"all": lib.KTK_SLOTS_ALL, "top": lib.KTK_SLOTS_TOP, "rest": lib.KTK_SLOTS_REST}
        if slots not in codes:
            raise NativeError(ERR_SHAPE, f"select: slots {slots!r}: expected one of {', '.join(codes)}")
        if isinstance(defer, float):
            check_rc(lib.ktk_task_select_share(self.ptr, codes[slots], defer))
        else:
            check_rc(lib.ktk_task_select(self.ptr, codes[slots], checked_int("defer", defer, 0, 2**31 - 1)))

    def split(self, defer: int | float, out2: torch.Tensor | None = None, done_top_addr: int | None = None
              ) -> torch.Tensor:
        """Both parts of expert deferral in one run (ktk_task_split): the immediate slots into the bound out, the
        deferred ones (``defer`` as in select) into out2 (allocated like out when None), and 1 stored to the uint32
        word at ``done_top_addr`` (if given; it must stay valid while the task runs) as soon as out is complete.
        Returns out2. bind() undoes it."""
        ffi, lib = ffi_lib()
        out = self.out
        if out is None:
            raise NativeError(ERR_STATE, "split: bind a forward first")
        if out2 is None:
            out2 = torch.empty_like(out)
        if out2.shape != out.shape or out2.dtype != out.dtype or not out2.is_contiguous() or out2.device.type != "cpu":
            raise NativeError(ERR_SHAPE, f"split: out2 must be a contiguous CPU tensor like out ({tuple(out.shape)}, "
                                         f"{out.dtype}), got {tuple(out2.shape)}, {out2.dtype}")
        top = ffi.NULL if done_top_addr is None else ffi.cast("volatile uint32_t *", checked_int(
            "done_top_addr", done_top_addr, 1, 2**64 - 1, code=ERR_NULL))
        d, share = (0, defer) if isinstance(defer, float) else (checked_int("defer", defer, 0, 2**31 - 1), 0.0)
        check_rc(lib.ktk_task_split(self.ptr, d, share, ffi.cast("void *", out2.data_ptr()), top))
        self._bound = self._bound[:-1] + (out2, self._bound[-1])  # kept alive; out stays last
        return out2

    def slots_rest(self, reset: bool = False) -> int:
        """Of slots_run, the rows of a split task's deferred part (ktk_task_slots_rest)."""
        _, lib = ffi_lib()
        return int(lib.ktk_task_slots_rest(self.ptr, int(bool(reset))))

    def slots_run(self, reset: bool = False) -> int:
        """(token, slot) rows computed (selected and not skipped), summed over the runs since the task was made or
        last reset (bind keeps the sum); ``reset``: set it to 0 after reading. Read it while the task is idle."""
        _, lib = ffi_lib()
        return int(lib.ktk_task_slots_run(self.ptr, int(bool(reset))))

    def watch(self, go_addr: int, done_addr: int, then_addr: int | None = None) -> None:
        """Run whenever *go == 1 (a pool thread stores 0 to *go, runs, stores 1 to *done, then 1 to *then if
        given: another watched task's go word, so that task runs next). go/done/then: addresses of 4-byte aligned
        uint32 words that stay valid until unwatch()/close()."""
        ffi, lib = ffi_lib()
        go, done = (checked_int(n, a, 1, 2**64 - 1, code=ERR_NULL) for n, a in (("go_addr", go_addr),
                                                                                ("done_addr", done_addr)))
        then = ffi.NULL if then_addr is None else ffi.cast(
            "uint32_t *", checked_int("then_addr", then_addr, 1, 2**64 - 1, code=ERR_NULL))
        check_rc(lib.ktk_task_watch_then(self.ptr, ffi.cast("uint32_t *", go), ffi.cast("uint32_t *", done), then))
        self._watch = (go, done, then_addr)

    @property
    def watched(self) -> bool:
        """Whether watch() holds (no unwatch() or close() since)."""
        return bool(self._watch)

    def unwatch(self) -> None:
        """Stop watching; raises the first error of a watched run since watch(), if any."""
        _, lib = ffi_lib()
        self._watch = ()
        check_rc(lib.ktk_task_unwatch(self.ptr))

    def close(self) -> None:
        """Unwatch, wait for a running forward, free the task. Idempotent."""
        if self._p is not None:
            ffi, _ = ffi_lib()
            p, self._p = self._p, None
            ffi.release(p)
            self._bound = self._watch = ()
            self._signal = None

    def __enter__(self) -> "Task":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


Task.__module__ = "ktinject.native"  # where users import it from


def valid_defer(value: Any, k: int | None = None) -> bool:
    """Whether ``value`` is an expert-deferral setting (Task.select's ``defer``) for k slots per token: an int
    0 <= d < k (a bool is not one), or a float 0 < m < 1; k None: d is not checked against it."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 0 and (k is None or value < k)
    return isinstance(value, float) and 0 < value < 1


def host_fn_addresses() -> tuple[int, int]:
    """Addresses of ktk_submit_fn and ktk_wait_fn (void(*)(void *)), for cuLaunchHostFunc with Task.address."""
    ffi, lib = ffi_lib()
    return (int(ffi.cast("uintptr_t", ffi.addressof(lib, "ktk_submit_fn"))),
            int(ffi.cast("uintptr_t", ffi.addressof(lib, "ktk_wait_fn"))))
