"""CPU memory read bandwidth: the limit the kernels and decode benchmarks print next to the decode figures.

    bw = measure_read_bandwidth(gb=1.0, threads=16)   # -> ReadBandwidth; bw.best_gbs, bw.summary()
    with ReadLoop(bw.nbytes, 16, bw.best_variant) as loop:   # the best variant, pass by pass
        gbs = loop.gbs()

A small native read loop (readloop.c beside this file, compiled with the system C compiler, loaded with ctypes: no cffi needed) reads a
buffer of at least 32x the last-level cache (sysfs or CPUID, the larger; at most a quarter of the memory available
unless `gb` asks more; 2 MB aligned, MADV_HUGEPAGE like the packed expert weights, filled with distinct words by the
reading threads) with one thread per physical core, pinned in the native pool's order. Each thread reads its slice, or chunks of 256 KB or
1 MB dealt round robin (all threads then read near each other, as the decode kernels do), as S interleaved
sequential streams (S = 1, 4, 16) with 64-byte loads (AVX-512 where the CPU has it, else AVX2, else 64-bit words)
xor-reduced, with software prefetch at a few distances (none, 1 KB, 4 KB ahead per stream). After a warm-up pass
of each, the variants are timed in `repeats` rounds of one pass each (interleaved: the host's bandwidth drifts over
seconds on a shared machine, and variants timed one after another would be ranked by the moment they ran in); a
variant's figure is the median of its passes, the limit is the best variant's (or torch's multi-threaded int64 sum
over the same buffer, also the median of its passes, if that is faster).

Why 32x and medians: the limit is the DRAM's sustained read speed, what a decode step's cache-cold expert reads can
get. Over a buffer a few times the LLC, part of each pass comes from the cache, and the figure rises above what the
DRAM delivers (and above what cache-cold decode reads); from about 32x it settles near the decode's own read rate.
The best single pass, or medians of variants timed one after another, pick the host's fastest few seconds rather
than its sustained speed (docs/performance.md, Why the defaults are what they are).
Nothing is compiled at import.
"""
from __future__ import annotations

import ctypes
import importlib.resources
import logging
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

STREAMS = (1, 4, 16)
PREFETCH = (0, 1024, 4096)  # bytes ahead per stream; 0 = no software prefetch
CHUNKS = (0, 256 << 10, 1 << 20)  # split between threads: 0 = a slice each, else chunks dealt round robin
LLC_MULTIPLE = 32.0  # the buffer: at least this many times the LLC (module docstring: why)
MEM_SHARE = 0.25  # ... and at most this share of the memory available


_LOADS = ("64-bit", "avx2", "avx512")
_lock = threading.Lock()
_lib: list = []  # [ctypes.CDLL or None] once compiled (or failed)


def _native_lib():
    """The compiled read loop (ctypes.CDLL), or None without a working C compiler. Compiled once per process."""
    with _lock:
        if not _lib:
            _lib.append(_compile())
        return _lib[0]


def _compile():
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        log.warning("no C compiler found: memory bandwidth from torch alone")
        return None
    try:
        code = importlib.resources.files(__package__).joinpath("readloop.c").read_text()
    except OSError as e:
        log.warning("the read loop's source readloop.c is missing from the installation (package data of "
                    "ktinject.bench: %s): memory bandwidth from torch alone", e)
        return None
    tmp = tempfile.mkdtemp(prefix="ktb_read_")
    src, so = os.path.join(tmp, "read.c"), os.path.join(tmp, "read.so")
    try:
        with open(src, "w") as f:
            f.write(code)
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-pthread", src, "-o", so], check=True, capture_output=True,
                       text=True, timeout=120)
        lib = ctypes.CDLL(so)
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", "") or str(e)
        log.warning("native read loop not built (%s): memory bandwidth from torch alone", err.strip()[:300])
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a loaded library stays mapped
    lib.ktb_run.restype = ctypes.c_double
    lib.ktb_run.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_size_t,
                            ctypes.POINTER(ctypes.c_uint64)]
    lib.ktb_alloc.restype = ctypes.c_void_p
    lib.ktb_alloc.argtypes = [ctypes.c_size_t]
    lib.ktb_free.argtypes = [ctypes.c_void_p]
    lib.ktb_loads.restype = ctypes.c_int
    lib.ktb_l3.restype = ctypes.c_long
    return lib


# ---- machine ----
def _first_cpu(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().replace("-", ",").split(",")[0])
    except (OSError, ValueError):
        return None


def cpu_order() -> list[int]:
    """CPUs in the native pool's pinning order: the first CPU of each physical core (of this process's affinity),
    then the remaining SMT siblings."""
    cpus = sorted(os.sched_getaffinity(0))
    firsts, seconds, seen = [], [], set()
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        core = _first_cpu(base + "core_cpus_list")
        core = _first_cpu(base + "thread_siblings_list") if core is None else core
        core = cpu if core is None else core
        (seconds if core in seen else firsts).append(cpu)
        seen.add(core)
    return firsts + seconds


def llc_bytes() -> int:
    """Last-level cache of the machine in bytes: the larger of sysfs (summed over distinct LLC instances) and
    glibc's sysconf L3 size (CPUID; a VM's sysfs may show less); 32 MiB if neither is known."""
    root = "/sys/devices/system/cpu"
    best: dict[str, int] = {}
    level_max = 0
    try:
        for cpu in os.listdir(root):
            if not (cpu.startswith("cpu") and cpu[3:].isdigit()):
                continue
            cache = os.path.join(root, cpu, "cache")
            for idx in os.listdir(cache) if os.path.isdir(cache) else ():
                d = os.path.join(cache, idx)
                with open(os.path.join(d, "level")) as f:
                    level = int(f.read())
                with open(os.path.join(d, "type")) as f:
                    if f.read().strip() == "Instruction":
                        continue
                with open(os.path.join(d, "size")) as f:
                    size = f.read().strip()
                with open(os.path.join(d, "shared_cpu_list")) as f:
                    shared = f.read().strip()
                mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
                nbytes = int(size.rstrip("KMG")) * mult
                if level > level_max:
                    level_max, best = level, {}
                if level == level_max:
                    best[shared] = nbytes
    except (OSError, ValueError):
        pass
    lib = _native_lib()
    return max(sum(best.values()), lib.ktb_l3() if lib is not None else 0) or 32 << 20


# ---- measurement ----
@dataclass(frozen=True)
class Variant:
    """One way to read the buffer: streams per thread, software prefetch distance (bytes ahead per stream, 0: none),
    and the split between threads (chunk 0: one contiguous slice each; else chunks of that many bytes dealt round
    robin, so all threads read near each other as the decode kernels do)."""
    streams: int = 1
    prefetch: int = 0
    chunk: int = 0

    @property
    def name(self) -> str:
        pf = "no-pf" if self.prefetch == 0 else (f"pf{self.prefetch // 1024}K" if self.prefetch % 1024 == 0
                                                 else f"pf{self.prefetch}")
        return f"{self.streams}s/{pf}" + (f"/c{self.chunk // 1024}K" if self.chunk else "")


@dataclass
class ReadBandwidth:
    best_gbs: float                 # the limit: the best of every native variant and torch
    best: str                       # which variant gave it
    torch_gbs: float                # torch int64 sum over the same buffer (median of its passes)
    variants: dict[str, float] = field(default_factory=dict)  # native variant -> GB/s (median of its passes)
    peak_gbs: float = 0.0           # the fastest single pass of any variant (printed; not the limit)
    capped: bool = False            # the buffer was held below LLC_MULTIPLE x the LLC by the memory available
    nbytes: int = 0
    threads: int = 0
    llc: int = 0
    pinned: bool = False            # threads pinned in the native pool's order
    loads: str = ""                 # load width of the native loop ("" when it could not be built)
    repeats: int = 0
    best_variant: Variant | None = None  # the best native variant (None without the native loop)
    tried: list[Variant] = field(default_factory=list)  # every native variant timed, in order

    def top(self, n: int) -> list[Variant]:
        """The n native variants that read fastest (best first): a limit timed again later takes the best of
        several, since the single best of many noisy variants is partly luck."""
        return sorted(self.tried, key=lambda v: -self.variants[v.name])[:n]

    def summary(self) -> str:
        """One line: the limit, where it came from, and what every variant gave."""
        var = ", ".join(f"{k} {v:.1f}" for k, v in self.variants.items())
        native = (f"native {self.loads} read loop [GB/s, streams/thread / prefetch ahead / chunks dealt round robin]: {var}; "
                  if self.variants else "native read loop unavailable; ")
        pinned = " pinned as the pool" if self.pinned else ""
        capped = " (held there by the memory available: LLC hits may lift it)" if self.capped else ""
        peak = f"; fastest single pass {self.peak_gbs:.1f}" if self.variants else ""
        return (f"memory read {self.best_gbs:.1f} GB/s ({self.best}, median of {self.repeats} passes) over "
                f"{self.nbytes / 1e9:.2f} GB ({self.nbytes / self.llc:.0f}x the LLC of {self.llc / 2**20:.0f} MiB"
                f"{capped}), {self.threads} threads{pinned}{peak}; {native}torch int64 sum {self.torch_gbs:.1f}")


def _torch_sum_gbs(buf: torch.Tensor, threads: int, repeats: int) -> float:
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf.sum()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            buf.sum()
            times.append(time.perf_counter() - t0)
        return buf.numel() * 8 / statistics.median(times) / 1e9
    finally:
        torch.set_num_threads(prev)


class ReadLoop:
    """A native read loop over a buffer of its own, pinned as the pool, timed pass by pass: measure_read_bandwidth
    runs every variant on one; the kernels bench keeps one for the best variant and alternates its passes with the
    decode forwards, so both see the same load on a shared host. A context manager; close() frees the buffer.

        with ReadLoop(nbytes, threads, Variant(16, 1024)) as loop:
            gbs = loop.gbs()"""

    def __init__(self, nbytes: int, threads: int, variant: Variant = Variant()):
        lib = _native_lib()
        if lib is None:
            raise RuntimeError("the native read loop could not be built (no working C compiler)")
        order = cpu_order()
        self.nbytes, self.threads, self.variant = nbytes, threads, variant
        self.pinned = threads <= len(order)  # more threads than CPUs: unpinned
        self._cpus = (ctypes.c_int * threads)(*[order[i] if self.pinned else -1 for i in range(threads)])
        self._lib, self._loads = lib, lib.ktb_loads()
        self.loads = _LOADS[self._loads]
        self._ptr = lib.ktb_alloc(nbytes)
        if not self._ptr:
            raise MemoryError(f"cannot allocate {nbytes} bytes for the read-bandwidth buffer")
        self._sink = ctypes.c_uint64()
        lib.ktb_run(self._ptr, nbytes, threads, self._cpus, 1, 0, self._loads, 1, 0, None)  # first touch, pinned

    def nbytes_read(self, variant: Variant | None = None) -> int:
        chunk = (variant or self.variant).chunk
        return self.nbytes // chunk * chunk if chunk else self.nbytes

    def seconds(self, variant: Variant | None = None) -> float:
        """One timed pass over the buffer (default: this loop's variant)."""
        if not self._ptr:
            raise RuntimeError("ReadLoop is closed")
        v = variant or self.variant
        return self._lib.ktb_run(self._ptr, self.nbytes, self.threads, self._cpus, v.streams, v.prefetch,
                                 self._loads, 0, v.chunk, ctypes.byref(self._sink))

    def gbs(self, variant: Variant | None = None) -> float:
        return self.nbytes_read(variant) / self.seconds(variant) / 1e9

    def torch_gbs(self, repeats: int) -> float:
        """torch's multi-threaded int64 sum over the same buffer, the median of `repeats` passes."""
        arr = (ctypes.c_int64 * (self.nbytes // 8)).from_address(self._ptr)
        return _torch_sum_gbs(torch.frombuffer(arr, dtype=torch.int64), self.threads, repeats)

    def close(self) -> None:
        if getattr(self, "_ptr", None):  # also when __init__ stopped before allocating
            self._lib.ktb_free(self._ptr)
            self._ptr = None

    def __enter__(self) -> "ReadLoop":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()


def measure_read_bandwidth(gb: float = 1.0, threads: int | None = None, repeats: int = 5,
                           streams=STREAMS, prefetch=PREFETCH, chunks=CHUNKS,
                           llc_multiple: float = LLC_MULTIPLE) -> ReadBandwidth:
    """Sustained read bandwidth over a buffer of max(gb GB, llc_multiple x the LLC), at most MEM_SHARE of the memory
    available unless gb GB asks more (whole 2 MB pages, at least one), with `threads` threads (default: one per
    physical core): every native variant (streams x prefetch x chunks) and torch's int64 sum, each the median of
    `repeats` passes; the limit is the best of those medians. See the module docstring."""
    order = cpu_order()
    threads = threads or _physical_cores(order)
    llc = llc_bytes()
    want = max(int(gb * 1e9), int(llc_multiple * llc))
    room = max(int(gb * 1e9), int(MEM_SHARE * _available_bytes()))
    nbytes = max(min(want, room), 2 << 20) // (2 << 20) * (2 << 20)
    res = ReadBandwidth(0.0, "torch int64 sum", 0.0, nbytes=nbytes, threads=threads, llc=llc, repeats=repeats,
                        capped=want > room)
    if res.capped:
        log.warning("read bandwidth: a buffer of %.2f GB (%.0fx the LLC) instead of %.0fx, held there by the memory "
                    "available; LLC hits may lift the figure", nbytes / 1e9, nbytes / llc, llc_multiple)
    if _native_lib() is None:
        buf = torch.ones(nbytes // 8, dtype=torch.int64)
        res.torch_gbs = res.best_gbs = _torch_sum_gbs(buf, threads, repeats)
        return res
    with ReadLoop(nbytes, threads) as loop:
        res.pinned, res.loads = loop.pinned, loop.loads
        res.tried = [Variant(s, pf, c) for c in chunks for s in streams for pf in prefetch]
        passes: dict[str, list[float]] = {v.name: [] for v in res.tried}
        for v in res.tried:
            loop.seconds(v)  # warm-up
        for _ in range(repeats):  # in rounds: a drift of the host's bandwidth meets every variant alike
            for v in res.tried:
                passes[v.name].append(loop.gbs(v))
        for v in res.tried:
            res.variants[v.name] = statistics.median(passes[v.name])
            res.peak_gbs = max(res.peak_gbs, *passes[v.name])
            if res.best_variant is None or res.variants[v.name] > res.variants[res.best_variant.name]:
                res.best_variant = v
        res.torch_gbs = loop.torch_gbs(repeats)
    name, gbs = max(res.variants.items(), key=lambda kv: kv[1])
    res.best, res.best_gbs = (name, gbs) if gbs >= res.torch_gbs else ("torch int64 sum", res.torch_gbs)
    return res


def _available_bytes() -> int:
    """Memory this process may still take: MemAvailable of /proc/meminfo (else the physical memory, else 8 GB), and
    at most what its cgroup (v2: memory.max - memory.current) leaves, in a container the smaller figure."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            avail = 8 << 30
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((line.strip().split("::", 1)[1] for line in f if line.startswith("0::")), None)
        if rel is not None:
            base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
            with open(os.path.join(base, "memory.max")) as f:
                limit = f.read().strip()
            if limit != "max":
                with open(os.path.join(base, "memory.current")) as f:
                    avail = min(avail, max(0, int(limit) - int(f.read().strip())))
    except (OSError, ValueError):
        pass
    return avail


def _physical_cores(order: list[int]) -> int:
    try:
        from ktinject import native
        return native.physical_cores()
    except Exception:  # noqa: BLE001 - the native module is not needed to measure memory
        return len(order)

