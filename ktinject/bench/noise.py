"""Background load for the decode bench's interference mode (``--noise N``), and the scheduler's view meanwhile.

``Noise(n)`` starts n processes of one thread each that copy 1 GiB buffers back and forth (memory-bound, like a
busy neighbour on a shared host), held stopped (SIGSTOP) until ``set(k)`` lets the first k run (SIGCONT): quiet and noisy
turns alternate in one run, so a drifting host load falls on both. ``Sched`` reads /proc before and after a timed
turn: how long our native pool's threads waited runnable without a core (schedstat), their involuntary context
switches, the CPU time the noise processes got and the host's steal time.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

_CHILD = """
import sys
n = int(sys.argv[1]) << 20
a = bytearray(b"\\x01") * n   # written now: reads of untouched pages would hit the shared zero page
b = bytearray(a)
print("ready", flush=True)
while True:
    b[:] = a   # memcpy of n bytes
    a[:] = b
"""


class Noise:
    """n background copy processes (n may be 0), all stopped until set(k)."""

    def __init__(self, n: int, mib: int = 1024, settle_s: float = 0.3):
        self.procs: list[subprocess.Popen] = []
        self.settle_s = settle_s
        self.running = 0
        try:
            for _ in range(n):
                p = subprocess.Popen([sys.executable, "-c", _CHILD, str(mib)], stdout=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
                self.procs.append(p)
            for p in self.procs:
                if p.stdout.readline().strip() != b"ready":
                    raise RuntimeError(f"noise process {p.pid} did not start (exit code {p.poll()})")
            self.running = len(self.procs)
            self.set(0)
        except BaseException:
            self.close()
            raise

    def set(self, k: int) -> None:
        """Let the first k processes run, stop the others (returns once they are stopped); wait settle_s when k > 0
        (the copies are under way)."""
        for i, p in enumerate(self.procs):
            if i < k:
                os.kill(p.pid, signal.SIGCONT)
            elif i < self.running:
                os.kill(p.pid, signal.SIGSTOP)
                os.waitpid(p.pid, os.WUNTRACED)  # its stop, reported (not reaped)
        self.running = min(k, len(self.procs))
        if k:
            time.sleep(self.settle_s)

    def close(self) -> None:
        for p in self.procs:
            try:
                p.kill()
                os.kill(p.pid, signal.SIGCONT)
            except (ProcessLookupError, OSError):
                pass
            p.wait()
        self.procs = []

    def __enter__(self) -> "Noise":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


@dataclass
class Sched:
    """A /proc snapshot: per thread of this process (name, ns waited runnable, involuntary switches), CPU ticks of
    the given processes, the host's steal ticks, and the time."""
    threads: dict
    proc_ticks: int
    steal: int
    total: int
    t: float

    @classmethod
    def take(cls, pids=()) -> "Sched":
        threads = {}
        for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
            d = f"/proc/self/task/{tid}"
            stat = _read(f"{d}/schedstat").split()
            invol = [ln for ln in _read(f"{d}/status").splitlines() if ln.startswith("nonvoluntary_ctxt_switches")]
            threads[tid] = (_read(f"{d}/comm").strip(), int(stat[1]) if len(stat) > 1 else 0,
                            int(invol[0].split()[1]) if invol else 0)
        ticks = 0
        for pid in pids:
            f = _read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
            ticks += int(f[11]) + int(f[12]) if len(f) > 12 else 0
        cpu = _read("/proc/stat").splitlines()[0].split()[1:] if _read("/proc/stat") else []
        vals = [int(x) for x in cpu]
        return cls(threads, ticks, vals[7] if len(vals) > 7 else 0, sum(vals[:8]), time.perf_counter())

    def since(self, before: "Sched", prefix: str = "ktk-") -> str:
        """One line: what the threads named prefix* (the native pool) and the host went through between the two."""
        wait = {tid: v[1] - before.threads[tid][1] for tid, v in self.threads.items()
                if v[0].startswith(prefix) and tid in before.threads}
        invol = sum(v[2] - before.threads[tid][2] for tid, v in self.threads.items()
                    if v[0].startswith(prefix) and tid in before.threads)
        dt = max(self.t - before.t, 1e-9)
        hz = os.sysconf("SC_CLK_TCK")
        total = max(self.total - before.total, 1)
        return (f"pool threads waited runnable {sum(wait.values()) / 1e6 / dt:.1f} ms/s in all (most "
                f"{max(wait.values(), default=0) / 1e6 / dt:.1f} ms/s one thread), {invol / dt:.0f} involuntary "
                f"switches/s; noise got {(self.proc_ticks - before.proc_ticks) / hz / dt:.2f} cores; host steal "
                f"{100 * (self.steal - before.steal) / total:.1f}%")
