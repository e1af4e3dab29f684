"""Base layer of ktinject.native: lazy load, NativeError, argument checks, library functions, thread counts.

The pool (``pool.py``), the experts (``experts.py``) and the tasks (``task.py``) are built on what is here: the
library handle (``ffi_lib``), the return-code check (``check_rc``) and the argument checks (``checked_int``,
``checked_tensor``, ``pointer``). Users import from ktinject.native, which re-exports the public names.

Layering (PyNaCl style): ``ktinject.native._core`` is the cffi module (``lib`` = the C functions as declared in the
header, ``ffi``); this package checks Python-side arguments (types, device, dtype, shapes, contiguity), passes raw
pointers and raises :class:`NativeError` for any non-zero return code with the native message. The native module
is loaded on first use, never at import. cffi API-mode calls release the GIL, so a forward does not hold it while
the pool runs.

Error codes of Python-side checks: wrong object type (e.g. not a tensor) -> KTK_ERR_NULL, wrong device or dtype ->
KTK_ERR_DTYPE, wrong shape or non-contiguous -> KTK_ERR_SHAPE, index out of range -> KTK_ERR_RANGE, closed object
-> KTK_ERR_STATE.
"""
from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import Any

import torch

log = logging.getLogger(__name__)

OK, ERR_NULL, ERR_SHAPE, ERR_RANGE, ERR_DTYPE, ERR_ISA, ERR_NOMEM, ERR_STATE, ERR_THREAD = range(9)
ERROR_NAMES = {ERR_NULL: "KTK_ERR_NULL", ERR_SHAPE: "KTK_ERR_SHAPE", ERR_RANGE: "KTK_ERR_RANGE",
               ERR_DTYPE: "KTK_ERR_DTYPE", ERR_ISA: "KTK_ERR_ISA", ERR_NOMEM: "KTK_ERR_NOMEM",
               ERR_STATE: "KTK_ERR_STATE", ERR_THREAD: "KTK_ERR_THREAD"}
ISA_NAMES = ("generic", "avx2", "avx512", "amx")
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
QUANTS = {"bf16": 0, "int8": 1, "int4": 2, "fp8": 3, "mxfp4": 4}
GROUP_SIZES = (32, 64, 128)  # int4: inputs per scale (fp8: any multiple of 16 up to FP8_MAX_GROUP)
FP8_MAX_GROUP = 512  # fp8: inputs per scale at most
FP8_DEFAULT_BLOCK = 128  # fp8: inputs and output rows per scale when none are given (the FP8 releases' 128 x 128)
MXFP4_GROUP = 32  # mxfp4: inputs per e8m0 scale (the only size; hidden and intermediate must be multiples of it)
ACTIVATIONS = {"silu": 0, "gptoss": 1, "swiglu_limit": 2}
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


def ffi_lib():
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
    ffi_lib()
    return _mod.__file__


def check_rc(rc: int) -> int:
    """``rc`` when it is KTK_OK, else NativeError(rc) with the native message (``ktk_last_error``)."""
    if rc != OK:
        ffi, lib = ffi_lib()
        raise NativeError(rc, ffi.string(lib.ktk_last_error()).decode("utf-8", "replace"))
    return rc


def checked_int(name: str, value: Any, lo: int = -_INT_MAX - 1, hi: int = _INT_MAX, code: int = ERR_SHAPE) -> int:
    """``value`` as an int in lo..hi: NativeError(KTK_ERR_NULL) for a non-integer, ``code`` for one out of range."""
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


def checked_tensor(name: str, t: Any, dtypes: tuple, shape: tuple | None = None,
                   contiguous: bool = True) -> torch.Tensor:
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


def pointer(t: torch.Tensor, ctype: str = "void *"):
    """The data pointer of tensor ``t`` as a cffi ``ctype``."""
    return ffi_lib()[0].cast(ctype, t.data_ptr())


# ---- library ----
def version() -> str:
    ffi, lib = ffi_lib()
    return ffi.string(lib.ktk_version()).decode()


def cpu_features() -> list[str]:
    """Names of the KTK_CPU_* bits this CPU/OS has (asks the OS for AMX permission once)."""
    _, lib = ffi_lib()
    bits = lib.ktk_cpu_features()
    names = sorted((getattr(lib, n), n[len("KTK_CPU_"):].lower()) for n in dir(lib) if n.startswith("KTK_CPU_"))
    return [name for bit, name in names if bits & bit]


def isa() -> str:
    """ISA in use; raises NativeError(KTK_ERR_ISA) while KTINJECT_ISA names an unknown/unavailable ISA."""
    _, lib = ffi_lib()
    rc = lib.ktk_isa_get()
    if rc < 0:
        check_rc(-rc)
    return ISA_NAMES[rc]


def best_isa() -> str:
    _, lib = ffi_lib()
    return ISA_NAMES[lib.ktk_isa_best()]


def available_isas() -> list[str]:
    """ISAs this CPU/OS and this build can run, lowest first."""
    _, lib = ffi_lib()
    return [name for i, name in enumerate(ISA_NAMES) if lib.ktk_isa_available(i)]


def set_isa(name: str) -> None:
    """Force an ISA for later forwards (process-wide; also clears a KTINJECT_ISA error)."""
    if name not in ISA_NAMES:
        raise NativeError(ERR_ISA, f"set_isa: unknown ISA {name!r} (expected one of {', '.join(ISA_NAMES)})")
    _, lib = ffi_lib()
    check_rc(lib.ktk_isa_set(ISA_NAMES.index(name)))


def physical_cores() -> int:
    _, lib = ffi_lib()
    return lib.ktk_physical_cores()


def default_threads() -> int:
    """Threads of the default pool when nothing says otherwise: one per physical core, less one from 8 cores up.

    The spare core was for the thread that drives the pool (Python, the CUDA driver, the host side of a graph
    replay) while each phase of a forward waited at a barrier for every thread, so for one that thread preempted.
    The pool has no barrier now (a thread that loses its core holds up at most its chunk), and graph decode ran a
    little faster with a thread on every core, quiet and beside busy processes (docs/performance.md, "The native
    bindings"); the spare core stays until prefill and the serve engine are timed that way too. KTINJECT_THREADS or
    set_default_threads picks another count."""
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
