"""The few CUDA driver entry points a captured decode step needs, through ctypes on libcuda.so.1.

Stream memory operations (cuStreamWriteValue32 / cuStreamWaitValue32) let a CUDA stream raise a flag in pinned host
memory and wait for another one: CUDA graph capture records them, so a captured step can hand work to a CPU thread
and wait for its result without Python. cuLaunchHostFunc (a host-callback node) is the fallback, several times
slower per submit + wait (the README's Performance section has both, measured with the native pool).

Nothing happens at import: the library is opened on first use. Every call raises CudaDriverError naming the entry
point and the driver's error name (cuGetErrorName) when the result is not CUDA_SUCCESS.
"""
from __future__ import annotations

import ctypes
import threading

from ktinject import envs

CUDA_SUCCESS = 0
# CUstreamWaitValue_flags
CU_STREAM_WAIT_VALUE_GEQ = 0x0
CU_STREAM_WAIT_VALUE_EQ = 0x1
CU_STREAM_WAIT_VALUE_AND = 0x2
CU_STREAM_WAIT_VALUE_NOR = 0x3
# CUstreamWriteValue_flags (DEFAULT puts a memory fence before the write: earlier copies are visible first)
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0
# CUctx_flags: how a host thread waits for the device (cudaDeviceSchedule*)
CU_CTX_SCHED = {"auto": 0x0, "spin": 0x1, "yield": 0x2, "block": 0x4}
CU_CTX_SCHED_MASK = 0x7
# CUdevice_attribute (cuda.h, CUDA 12/13): legacy (v1) stream memory operations usable without a module parameter.
# The v2 entry points (CUDA >= 11.7) need no attribute: they are supported on every device the driver runs.
CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1 = 92

#: environment variable forcing the handshake mechanism: "memops" or "hostfn" (default: memops when supported)
SYNC_ENV = "KTINJECT_STREAM_SYNC"


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; ``code`` is the CUresult and ``name`` its cuGetErrorName."""

    def __init__(self, func: str, code: int, name: str):
        super().__init__(f"{func} failed: {name} ({code})")
        self.func, self.code, self.name = func, code, name


class _Driver:
    """libcuda.so.1 with argument types set; one instance per process (``driver()``)."""

    def __init__(self) -> None:
        lib = None
        for name in ("libcuda.so.1", "libcuda.so"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if lib is None:
            raise OSError("libcuda.so.1 not found: the CUDA driver is not installed or not visible")
        self.lib = lib
        u32, u64, vp, c_int = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int
        self._get_error_name = self._sym("cuGetErrorName", [c_int, ctypes.POINTER(ctypes.c_char_p)])
        self._init = self._sym("cuInit", [ctypes.c_uint])
        self._ctx_get_device = self._sym("cuCtxGetDevice", [ctypes.POINTER(c_int)])
        self._get_attribute = self._sym("cuDeviceGetAttribute", [ctypes.POINTER(c_int), c_int, c_int])
        self._host_get_dptr = self._sym(
            ("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer"), [ctypes.POINTER(u64), vp, ctypes.c_uint]
        )
        self._launch_host_func = self._sym("cuLaunchHostFunc", [vp, vp, vp])
        self._driver_get_version = self._sym("cuDriverGetVersion", [ctypes.POINTER(c_int)])
        self._ctx_get_flags = self._sym("cuCtxGetFlags", [ctypes.POINTER(ctypes.c_uint)])
        try:  # CUDA >= 12.1: flags of the current (torch's primary) context, also while it is active
            self._ctx_set_flags = self._sym("cuCtxSetFlags", [ctypes.c_uint])
        except AttributeError:
            self._ctx_set_flags = None
        # v2 first: CUDA 12's cuda.h maps cuStreamWriteValue32 to the _v2 symbol; the plain name is the legacy v1.
        self.memops_version = 2
        try:
            self._write32 = self._sym("cuStreamWriteValue32_v2", [vp, u64, u32, ctypes.c_uint])
            self._wait32 = self._sym("cuStreamWaitValue32_v2", [vp, u64, u32, ctypes.c_uint])
        except AttributeError:
            self.memops_version = 1
            try:
                self._write32 = self._sym("cuStreamWriteValue32", [vp, u64, u32, ctypes.c_uint])
                self._wait32 = self._sym("cuStreamWaitValue32", [vp, u64, u32, ctypes.c_uint])
            except AttributeError:
                self.memops_version = 0
        self.check("cuInit", self._init(0))

    def _sym(self, names, argtypes):
        for name in (names,) if isinstance(names, str) else names:
            fn = getattr(self.lib, name, None)
            if fn is not None:
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
                return fn
        raise AttributeError(f"the CUDA driver exports none of {names}")

    def error_name(self, code: int) -> str:
        s = ctypes.c_char_p()
        if self._get_error_name(code, ctypes.byref(s)) != CUDA_SUCCESS or not s.value:
            return "CUDA_ERROR_UNKNOWN"
        return s.value.decode()

    def check(self, func: str, code: int) -> None:
        if code != CUDA_SUCCESS:
            raise CudaDriverError(func, code, self.error_name(code))


_driver: _Driver | None = None
_lock = threading.Lock()


def driver() -> _Driver:
    """The process's driver handle (opened on first use; raises OSError without libcuda)."""
    global _driver
    if _driver is None:
        with _lock:
            if _driver is None:
                _driver = _Driver()
    return _driver


def driver_version() -> int:
    """The driver's CUDA version as 1000 * major + 10 * minor (12030 for 12.3); 0 where it cannot be read."""
    try:
        d = driver()
        v = ctypes.c_int()
        return int(v.value) if d._driver_get_version(ctypes.byref(v)) == CUDA_SUCCESS else 0
    except (OSError, AttributeError, CudaDriverError):
        return 0


def available() -> bool:
    """True if libcuda can be opened and initialized (does not create a context)."""
    try:
        driver()
        return True
    except (OSError, CudaDriverError, AttributeError):
        return False


def current_device() -> int:
    """The device of the calling thread's current context (torch makes its device's primary context current)."""
    d = driver()
    dev = ctypes.c_int()
    d.check("cuCtxGetDevice", d._ctx_get_device(ctypes.byref(dev)))
    return dev.value


def device_attribute(attr: int, device: int | None = None) -> int:
    d = driver()
    value = ctypes.c_int()
    dev = current_device() if device is None else device
    d.check("cuDeviceGetAttribute", d._get_attribute(ctypes.byref(value), attr, dev))
    return value.value


def stream_memops_supported(device: int | None = None) -> bool:
    """Whether cuStreamWriteValue32/cuStreamWaitValue32 can be used on ``device`` (default: current context's)."""
    try:
        d = driver()
    except (OSError, CudaDriverError):
        return False
    if d.memops_version == 2:
        return True
    if d.memops_version == 1:
        return device_attribute(CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1, device) == 1
    return False


def default_sync_mode() -> str:
    """"memops" (stream memory operations) when supported, else "hostfn"; KTINJECT_STREAM_SYNC overrides."""
    forced = envs.get(SYNC_ENV)  # None, "memops" or "hostfn" (anything else: a ValueError naming the variable)
    if forced:
        if forced == "memops" and not stream_memops_supported():
            raise RuntimeError(f"{SYNC_ENV}=memops but this driver/device does not support stream memory operations")
        return forced
    return "memops" if stream_memops_supported() else "hostfn"


def host_wait_mode() -> str:
    """How host threads wait for the current context's device: "auto", "spin", "yield" or "block"."""
    d = driver()
    flags = ctypes.c_uint()
    d.check("cuCtxGetFlags", d._ctx_get_flags(ctypes.byref(flags)))
    value = flags.value & CU_CTX_SCHED_MASK
    return next((k for k, v in CU_CTX_SCHED.items() if v == value), hex(value))


def set_host_wait_mode(mode: str) -> bool:
    """Make host threads spin, yield or block (sleep) while waiting for the device (current context).

    A host thread spinning in a CUDA wait takes a core from the native expert threads; during graph replay the
    host has nothing else to do, so "block" is the better choice there. Returns False if the driver cannot
    change the flags of an active context (cuCtxSetFlags needs CUDA 12.1)."""
    if mode not in CU_CTX_SCHED:
        raise ValueError(f"host wait mode {mode!r}: expected one of {', '.join(CU_CTX_SCHED)}")
    d = driver()
    if d._ctx_set_flags is None:
        return False
    flags = ctypes.c_uint()
    d.check("cuCtxGetFlags", d._ctx_get_flags(ctypes.byref(flags)))
    new = (flags.value & ~CU_CTX_SCHED_MASK) | CU_CTX_SCHED[mode]
    d.check("cuCtxSetFlags", d._ctx_set_flags(new))
    return True


def host_device_pointer(host_ptr: int) -> int:
    """Device address of pinned (page-locked, cudaHostAlloc) host memory. Call outside graph capture."""
    d = driver()
    dptr = ctypes.c_uint64()
    d.check("cuMemHostGetDevicePointer", d._host_get_dptr(ctypes.byref(dptr), ctypes.c_void_p(host_ptr), 0))
    return dptr.value


def stream_write_value32(stream: int, dptr: int, value: int, flags: int = CU_STREAM_WRITE_VALUE_DEFAULT) -> None:
    """Enqueue ``*dptr = value`` on ``stream`` (a CUstream handle, e.g. torch's ``stream.cuda_stream``)."""
    d = driver()
    if not d.memops_version:
        raise CudaDriverError("cuStreamWriteValue32", 801, "CUDA_ERROR_NOT_SUPPORTED")
    d.check("cuStreamWriteValue32", d._write32(ctypes.c_void_p(stream), dptr, value, flags))


def stream_wait_value32(stream: int, dptr: int, value: int, flags: int = CU_STREAM_WAIT_VALUE_EQ) -> None:
    """Enqueue a wait on ``stream`` until ``*dptr`` compares to ``value`` (flags: CU_STREAM_WAIT_VALUE_*)."""
    d = driver()
    if not d.memops_version:
        raise CudaDriverError("cuStreamWaitValue32", 801, "CUDA_ERROR_NOT_SUPPORTED")
    d.check("cuStreamWaitValue32", d._wait32(ctypes.c_void_p(stream), dptr, value, flags))


def launch_host_func(stream: int, fn_addr: int, user_data: int) -> None:
    """Enqueue the C function ``void fn(void*)`` at ``fn_addr`` with ``user_data`` on ``stream``.

    It runs on a driver thread and must not call CUDA."""
    d = driver()
    d.check(
        "cuLaunchHostFunc",
        d._launch_host_func(ctypes.c_void_p(stream), ctypes.c_void_p(fn_addr), ctypes.c_void_p(user_data)),
    )


def host_register(ptr: int, nbytes: int, flags: int = 0) -> None:
    """Page-lock existing host memory for the current context (cuMemHostRegister): async copies from it then need no
    staging. Through the driver, not torch's cudart binding: a failed runtime call would stay behind as the
    runtime's last error, which torch's next kernel-launch check raises as if that kernel had failed."""
    d = driver()
    fn = d._sym(("cuMemHostRegister_v2", "cuMemHostRegister"), [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint])
    d.check("cuMemHostRegister", fn(ctypes.c_void_p(ptr), nbytes, flags))


def host_unregister(ptr: int) -> None:
    """Undo host_register (cuMemHostUnregister); no copy from the memory may be in flight."""
    d = driver()
    fn = d._sym("cuMemHostUnregister", [ctypes.c_void_p])
    d.check("cuMemHostUnregister", fn(ctypes.c_void_p(ptr)))
