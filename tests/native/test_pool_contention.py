"""The pool on a host whose cores other processes take (issue 45): a default pool keeps up with a 1-thread pool
beside a busy process, and pool start warns, naming the settings to lower, when the host looks oversubscribed."""
import logging
import statistics
import subprocess
import sys
import time

import pytest
import torch

from ktinject.native import library as _nativelib
from ktinject.native import Experts, Pool, Task, default_threads, usable_cpus

H, I, E, K = 512, 256, 16, 4


def test_warns_when_the_host_looks_oversubscribed(monkeypatch, caplog):
    cpus = usable_cpus()
    monkeypatch.setattr(_nativelib, "_host_load", lambda: float(cpus + 1))  # other processes hold every core
    with caplog.at_level(logging.WARNING, logger="ktinject.native.library"):
        assert _nativelib.warn_if_host_busy(2, "the default")
    msg = caplog.text
    assert "oversubscribed" in msg and "--threads" in msg and "KTINJECT_THREADS" in msg
    assert "torch.set_num_threads" in msg or "OMP_NUM_THREADS" in msg  # torch's own team spins too
    caplog.clear()
    monkeypatch.setattr(_nativelib, "_host_load", lambda: 0.5)  # quiet: this process's own thread at most
    with caplog.at_level(logging.WARNING, logger="ktinject.native.library"):
        assert not _nativelib.warn_if_host_busy(min(cpus, default_threads()), "the default")
    assert "oversubscribed" not in caplog.text
    monkeypatch.setattr(_nativelib, "_host_load", lambda: None)  # unknown (no getloadavg): no warning
    assert not _nativelib.warn_if_host_busy(cpus, "the default")


def _experts():
    gen = torch.Generator().manual_seed(0)
    return Experts.from_hf(torch.randn(E, 2 * I, H, generator=gen).bfloat16(),
                           torch.randn(E, H, I, generator=gen).bfloat16())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="busy loop pinned with sched_setaffinity")
def test_default_pool_keeps_up_with_one_thread_beside_a_busy_process():
    """A busy loop on one of this process's CPUs: decode-like steps (torch work, then a one-token forward, inline
    and as a submitted task) on the default thread count are not much slower than on one thread. Interleaved
    blocks, medians: robust to a shared CI host's noise."""
    ex = _experts()
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(1, H), torch.full((1, K), 1 / K)
    ids = torch.zeros(1, K, dtype=torch.int64)
    perms = [torch.randperm(E, generator=gen)[:K] for _ in range(32)]
    a, b = torch.randn(128, 128), torch.randn(128, 256)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's own team is not under test
    cpu = sorted(_nativelib.os.sched_getaffinity(0))[-1]
    busy = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    pools = {"default": Pool(default_threads()), "one": Pool(1)}
    tasks = {name: Task(p) for name, p in pools.items()}
    for t in tasks.values():
        t.bind(ex, x, ids, w)

    def block(name: str, n: int = 25) -> float:
        t0 = time.perf_counter()
        for r in range(n):
            torch.mm(a, b)  # the dense part between MoE layers
            ids[0] = perms[r & 31]
            ex.forward(x, ids, w, pool=pools[name])
            torch.mm(a, b)
            tasks[name].submit()
            tasks[name].wait()
        return (time.perf_counter() - t0) / n

    try:
        time.sleep(0.1)  # the busy loop runs
        for name in pools:
            block(name, 10)  # warm-up: scratch sized, threads started
        times = {name: [] for name in pools}
        for r in range(12):
            for name in (("default", "one") if r % 2 == 0 else ("one", "default")):
                times[name].append(block(name))
    finally:
        busy.kill()
        busy.wait()
        torch.set_num_threads(prev_threads)
        for p in pools.values():
            p.close()
    ratio = statistics.median(times["default"]) / statistics.median(times["one"])
    assert ratio < 1.5, (f"default pool ({default_threads()} threads) {ratio:.2f}x a 1-thread pool's step time "
                         f"beside a busy process: {times}")
