"""Base layer of ktinject.native: lazy load, NativeError, argument checks, library functions, thread pools.

Import from ktinject.native (which re-exports the public names); this module exists to keep files short.

Layering (PyNaCl style): ``ktinject.native._core`` is the cffi module (``lib`` = the C functions as declared in the
header, ``ffi``); this module checks Python-side arguments (types, device, dtype, shapes, contiguity), passes raw
pointers and raises :class:`NativeError` for any non-zero return code with the native message. The native module
is loaded on first use, never at import. cffi API-mode calls release the GIL, so a forward does not hold it while
the pool runs.

Legend: T tokens, k experts per token, E experts, H hidden, I expert intermediate.

Error codes of Python-side checks: wrong object type (e.g. not a tensor) -> KTK_ERR_NULL, wrong device or dtype ->
KTK_ERR_DTYPE, wrong shape or non-contiguous -> KTK_ERR_SHAPE, index out of range -> KTK_ERR_RANGE, closed object
-> KTK_ERR_STATE.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import os
import threading
import weakref
from typing import Any, NamedTuple

import torch

from ktinject import envs

log = logging.getLogger(__name__)

OK, ERR_NULL, ERR_SHAPE, ERR_RANGE, ERR_DTYPE, ERR_ISA, ERR_NOMEM, ERR_STATE, ERR_THREAD = range(9)
ERROR_NAMES = {ERR_NULL: "KTK_ERR_NULL", ERR_SHAPE: "KTK_ERR_SHAPE", ERR_RANGE: "KTK_ERR_RANGE",
               ERR_DTYPE: "KTK_ERR_DTYPE", ERR_ISA: "KTK_ERR_ISA", ERR_NOMEM: "KTK_ERR_NOMEM",
               ERR_STATE: "KTK_ERR_STATE", ERR_THREAD: "KTK_ERR_THREAD"}
ISA_NAMES = ("generic", "avx2", "avx512", "amx")
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
QUANTS = {"bf16": 0, "int8": 1, "int4": 2}
GROUP_SIZES = (32, 64, 128)  # int4: inputs per scale
ACTIVATIONS = {"silu": 0, "gptoss": 1}
MATRICES = {"gate": 0, "up": 1, "down": 2}
_INT_MAX = 2**31 - 1


class NativeError(RuntimeError):
    """A native call (or a Python-side argument check) failed: ``code`` is the KTK_ERR_* code, ``message`` the text."""

    def __init__(self, code: int, message: str):
        self.code = code
        self.message = message
        super().__init__(f"{ERROR_NAMES.get(code, f'error {code}')}: {message}")

    def __reduce__(self):
        return type(self), (self.code, self.message)


NativeError.__module__ = "ktinject.native"  # where users import it from


# ---- lazy load ----
_load_lock = threading.Lock()
_mod: Any = None


def _native():
    """(ffi, lib) of ktinject.native._core, imported on first use."""
    global _mod
    if _mod is None:
        with _load_lock:
            if _mod is None:
                _mod = importlib.import_module("ktinject.native._core")
                log.debug("loaded %s", _mod.__file__)
    return _mod.ffi, _mod.lib


def library_path() -> str:
    """Path of the compiled native module (loads it)."""
    _native()
    return _mod.__file__


def _check(rc: int) -> int:
    if rc != OK:
        ffi, lib = _native()
        raise NativeError(rc, ffi.string(lib.ktk_last_error()).decode("utf-8", "replace"))
    return rc


def _cint(name: str, value: Any, lo: int = -_INT_MAX - 1, hi: int = _INT_MAX, code: int = ERR_SHAPE) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = int(value.__index__())
        except (AttributeError, TypeError):
            raise NativeError(ERR_NULL, f"{name}: expected an int, got {type(value).__name__}") from None
    if not lo <= value <= hi:
        raise NativeError(code, f"{name} = {value} is out of range (expected {lo}..{hi})")
    return value


def _shape_ok(got: torch.Size, want: tuple) -> bool:
    if len(got) != len(want):
        return False
    for w, g in zip(want, got):
        if w is not None and w != g:
            return False
    return True


def _tensor(name: str, t: Any, dtypes: tuple, shape: tuple | None = None, contiguous: bool = True) -> torch.Tensor:
    """Check a tensor argument; ``shape`` entries may be None (any size). The checks that pass are one condition
    (a one-token forward checks four tensors, and Python time there is decode time); the messages are built only
    when one fails."""
    if (isinstance(t, torch.Tensor) and t.is_cpu and t.dtype in dtypes and (shape is None or _shape_ok(t.shape, shape))
            and (not contiguous or t.is_contiguous())):
        return t
    if not isinstance(t, torch.Tensor):
        raise NativeError(ERR_NULL, f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise NativeError(ERR_DTYPE, f"{name}: expected a CPU tensor, got device {t.device}")
    if t.dtype not in dtypes:
        want = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise NativeError(ERR_DTYPE, f"{name}: dtype {str(t.dtype).replace('torch.', '')} is not supported "
                                     f"(expected {want})")
    if shape is not None and not _shape_ok(t.shape, shape):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise NativeError(ERR_SHAPE, f"{name}: expected shape {want}, got {list(t.shape)}")
    raise NativeError(ERR_SHAPE, f"{name}: must be contiguous (got strides {t.stride()} for shape "
                                 f"{list(t.shape)}); call .contiguous()")


def _ptr(t: torch.Tensor, ctype: str = "void *"):
    return _native()[0].cast(ctype, t.data_ptr())


# ---- library ----
def version() -> str:
    ffi, lib = _native()
    return ffi.string(lib.ktk_version()).decode()


def cpu_features() -> list[str]:
    """Names of the KTK_CPU_* bits this CPU/OS has (asks the OS for AMX permission once)."""
    _, lib = _native()
    bits = lib.ktk_cpu_features()
    names = sorted((getattr(lib, n), n[len("KTK_CPU_"):].lower()) for n in dir(lib) if n.startswith("KTK_CPU_"))
    return [name for bit, name in names if bits & bit]


def isa() -> str:
    """ISA in use; raises NativeError(KTK_ERR_ISA) while KTINJECT_ISA names an unknown/unavailable ISA."""
    _, lib = _native()
    rc = lib.ktk_isa_get()
    if rc < 0:
        _check(-rc)
    return ISA_NAMES[rc]


def best_isa() -> str:
    _, lib = _native()
    return ISA_NAMES[lib.ktk_isa_best()]


def available_isas() -> list[str]:
    """ISAs this CPU/OS and this build can run, lowest first."""
    _, lib = _native()
    return [name for i, name in enumerate(ISA_NAMES) if lib.ktk_isa_available(i)]


def set_isa(name: str) -> None:
    """Force an ISA for later forwards (process-wide; also clears a KTINJECT_ISA error)."""
    if name not in ISA_NAMES:
        raise NativeError(ERR_ISA, f"set_isa: unknown ISA {name!r} (expected one of {', '.join(ISA_NAMES)})")
    _, lib = _native()
    _check(lib.ktk_isa_set(ISA_NAMES.index(name)))


def physical_cores() -> int:
    _, lib = _native()
    return lib.ktk_physical_cores()


def default_threads() -> int:
    """Threads of the default pool when nothing says otherwise: one per physical core, less one from 8 cores up.

    The spare core was for the thread that drives the pool (Python, the CUDA driver, the host side of a graph
    replay) while each phase of a forward waited at a barrier for every thread, so for one that thread preempted.
    The pool has no barrier now (a thread that loses its core holds up at most its chunk): on the GPU machine
    (16 cores, int4 Qwen3-30B-A3B shapes, graph decode, 2026-11-25) 16 unpinned threads decoded 70.3 tok/s against
    65.6 with 15, and kept 93 / 87 / 80% of it beside 1 / 2 / 4 busy processes (15: 96 / 89 / 81%). Prefill and
    the serve engine were not timed with 16; KTINJECT_THREADS or set_default_threads picks another count."""
    n = physical_cores()
    return n - 1 if n >= 8 else n


def usable_cpus() -> int:
    """Logical CPUs this process may run on: its affinity mask where the OS has one, else ``os.cpu_count()``."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def warn_if_oversubscribed(n: int, source: str) -> bool:
    """Log a warning (and return True) when ``n`` expert threads outnumber the CPUs this process may use: the
    pool's threads then wait for preempted ones at every phase of a forward, several times slower. ``source``
    names the setting in the message (``set_default_threads(64)``, ``--threads 64``)."""
    cpus = usable_cpus()
    if n <= cpus:
        return False
    log.warning("%s: more expert threads than the %d CPUs this process may run on; every forward then waits for "
                "preempted threads (64 threads on 2 cores decoded 12x slower). Use at most %d, or leave it unset for "
                "the default: %d here (one per physical core, less one from 8 cores up)",
                source, cpus, cpus, default_threads())
    return True


def _host_load() -> float | None:
    """The host's 1-minute load average (runnable and running threads of every process), None where unknown."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def warn_if_host_busy(n: int, source: str = "default") -> bool:
    """Log a warning (and return True) when the host looks oversubscribed at pool start: the load average, less
    this process's own driving thread, plus ``n`` expert threads exceeds the CPUs this process may use. Then other
    processes hold cores, and any thread that spin-waits for a preempted partner at every step (torch's OpenMP
    intra-op team, whose default size is the core count) stalls for time slices; fewer threads run faster. The
    message names the settings to lower (``source``: where ``n`` came from)."""
    load, cpus = _host_load(), usable_cpus()
    if load is None or max(0.0, load - 1.0) + n <= cpus:
        return False
    try:
        import torch
        torch_threads = torch.get_num_threads()
    except Exception:  # (torch missing or broken: the message still names the pool's settings)
        torch_threads = None
    fewer = max(1, cpus - int(load))
    log.warning("the host looks oversubscribed: load average %.1f on the %d CPUs this process may use, with %d expert "
                "threads (%s)%s. Threads that lose their core to other processes stall every decode step; use fewer: "
                "--threads %d, or KTINJECT_THREADS=%d plus torch.set_num_threads(%d) / OMP_NUM_THREADS=%d (or "
                "OMP_WAIT_POLICY=PASSIVE) for torch's own threads",
                load, cpus, n, source, "" if torch_threads is None else f" and {torch_threads} torch threads",
                fewer, fewer, fewer, fewer)
    return True


# ---- pool ----
class Pool:
    """Persistent native thread pool (threads start at once, pinned one to a core when ``pin``; env KTINJECT_PIN=0/1
    overrides). ``threads=None``: one per physical core. Close explicitly (or use as a context manager); tasks
    created on it are closed first.

    Not pinned by default: a pinned thread whose core another process takes cannot move to a freer one. GPU machine,
    15 threads, int4 graph decode, busy processes beside it: 92 / 89 / 78% of the quiet speed with 1 / 2 / 4 of
    them pinned, 96 / 89 / 81% unpinned, quiet 65.1 and 65.6 tok/s (2026-11-25, same session)."""

    def __init__(self, threads: int | None = None, pin: bool = False):
        ffi, lib = _native()
        n = 0 if threads is None else _cint("threads", threads, 1, 4096)
        out = ffi.new("ktk_pool **")
        _check(lib.ktk_pool_create(n, 1 if pin else 0, out))
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
        _, lib = _native()
        return int(lib.ktk_pool_watch_spin_us(self.ptr))

    @watch_spin_us.setter
    def watch_spin_us(self, us: int) -> None:
        _, lib = _native()
        _check(lib.ktk_pool_set_watch_spin_us(self.ptr, _cint("watch_spin_us", us, 0, 10_000_000)))

    def wake(self) -> None:
        """While tasks are watched: open the watch spin window now and wake sleeping threads (call just before a
        graph replay that raises go flags). A no-op otherwise."""
        _, lib = _native()
        _check(lib.ktk_pool_wake(self.ptr))

    def set_profile(self, on: bool = True) -> None:
        """Time every job (forward) of this pool from now on, its parallel phases and the chunks each thread runs
        (``profile()`` reads the sums); ``False`` stops. For measurements: a clock read per chunk."""
        _, lib = _native()
        _check(lib.ktk_pool_set_profile(self.ptr, 1 if on else 0))

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
        ffi, lib = _native()
        n = lib.KTK_PROFILE_LEN
        out = ffi.new("int64_t[]", n)
        got = lib.ktk_pool_profile(self.ptr, out, n)
        if got < 0:
            _check(-got)
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
            ffi, _ = _native()
            p, self._p = self._p, None
            ffi.release(p)

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Pool(threads={self.threads}, pin={self.pin}{', closed' if self._p is None else ''})"


# Pools alive, closed (with their tasks) by an atexit hook registered with the first one: at interpreter exit the
# host memory that watched tasks poll (go/done words, pinned staging) is freed in any order, while the pools'
# threads still poll and write it (heap corruption after the GPU soak; ASan: use-after-free in the watch scan).
# atexit runs before any module or object is torn down, and after torch's own hooks were registered (LIFO: first).
_live_pools: weakref.WeakSet = weakref.WeakSet()
_exit_hook = False


def _track(pool: Pool) -> None:
    global _exit_hook
    with _load_lock:
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
        _cint("threads", n, 1, 4096)
        warn_if_oversubscribed(n, source or f"set_default_threads({n})")
    with _default_lock:
        if _default_pool is not None and _default_pool._p is not None:
            if n is None or n == _default_pool.threads:
                return
            raise NativeError(ERR_STATE, f"set_default_threads({n}): the default pool already runs with "
                                         f"{_default_pool.threads} threads; call it before first use or use Pool({n})")
        _default_threads = n


# ---- zero-copy views of packed experts (ktk_experts_raw / ktk_experts_region) ----
class RawMatrix(NamedTuple):
    """One packed matrix of one expert, as ktk_experts_raw describes it: addresses (ints) inside the experts' packed
    storage, valid while the native.Experts lives. Layouts (native/src/kernels/kernels.h): bf16 data = bf16 bits
    [Np/16][Kp/2][16][2]; int8 data = int8 [Np/16][Kp/4][16][4] with value q * scale[n]; int4 data = nibbles
    [Np/16][Kp/8][16][4] (low nibble inputs 8r..8r+3, high 8r+4..8r+7) with scale [Np/16][Kp/G][16]. ``scale``/``bias``
    are 0 when absent (bf16 / no bias); ``expert``, ``expert_bytes``: the expert's whole region (all its matrices)."""

    quant: str
    N: int
    K: int
    Np: int
    Kp: int
    data: int
    data_bytes: int
    scale: int
    bias: int
    expert: int
    expert_bytes: int


def experts_raw(experts: Any, expert: int, which: str) -> RawMatrix:
    """ktk_experts_raw for a ktinject.native.Experts (every quant): NativeError(KTK_ERR_RANGE) for a bad expert or
    matrix."""
    ffi, lib = _native()
    if which not in MATRICES:
        raise NativeError(ERR_RANGE, f"which = {which!r} is not a matrix (expected 'gate', 'up' or 'down')")
    e = _cint("expert", expert, 0, int(experts.num_experts) - 1, code=ERR_RANGE)
    out = ffi.new("ktk_raw *")
    _check(lib.ktk_experts_raw(experts._p, e, MATRICES[which], out))
    addr = lambda p: int(ffi.cast("uintptr_t", p))  # noqa: E731  (NULL -> 0)
    quant = {v: k for k, v in QUANTS.items()}.get(out.quant, str(out.quant))
    return RawMatrix(quant, out.N, out.K, out.Np, out.Kp, addr(out.data), int(out.data_bytes), addr(out.scale),
                     addr(out.bias), addr(out.expert), int(out.expert_bytes))


def experts_region(experts: Any) -> tuple[int, int]:
    """(address, bytes) of a ktinject.native.Experts' packed storage (ktk_experts_region): one page-aligned mapping
    that lives as long as the Experts object."""
    ffi, lib = _native()
    base, nbytes = ffi.new("const void **"), ffi.new("int64_t *")
    _check(lib.ktk_experts_region(experts._p, base, nbytes))
    return int(ffi.cast("uintptr_t", base[0])), int(nbytes[0])


def experts_region_view(experts: Any) -> tuple[int, torch.Tensor]:
    """(address, uint8 CPU tensor [nbytes]) over a ktinject.native.Experts' packed storage (zero copy): valid while
    the Experts object lives, so keep a reference to it beside the tensor."""
    ffi, _ = _native()
    addr, nbytes = experts_region(experts)
    return addr, torch.frombuffer(ffi.buffer(ffi.cast("char *", addr), nbytes), dtype=torch.uint8)
