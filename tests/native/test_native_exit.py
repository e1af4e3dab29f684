"""Native lifetimes at interpreter exit and in any destruction order (the GPU soak's glibc abort at exit).

Each scenario ends a subprocess interpreter with live watched tasks, a watch_then chain (expert deferral) and a
thread playing the GPU (go = 1, wait for done, clear), the go/done words in an ordinary heap tensor that teardown
frees: rc 0 and no sanitizer report. With the ASan build of the native core (KTINJECT_CFLAGS="-fsanitize=address",
LD_PRELOAD=libasan) these scenarios reported use-after-free before the fix: ktk_task_destroy unwatching from a
destroyed pool (set_watch freeing its list a second time) and the watch scan reading freed go words at exit.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ktinject import native

SCRIPT = textwrap.dedent("""
    import sys, threading, time
    import torch
    from ktinject import native

    scen = sys.argv[1]
    E, H, I, T, k = 4, 64, 32, 3, 2
    ex = native.Experts.from_hf(torch.randn(E, 2 * I, H), torch.randn(E, H, I))
    pool = native.default_pool() if scen == "default" else native.Pool(2)
    flags = torch.zeros(1024, dtype=torch.int32)  # go 0, done 16, deferred go 32, deferred done 48
    a = flags.data_ptr()
    h, ids, w = torch.randn(T, H), torch.randint(0, E, (T, k)), torch.rand(T, k)
    imm, dfr = native.Task(pool), native.Task(pool)
    imm.bind(ex, h, ids, w)
    imm.select("top", 1)
    dfr.bind(ex, h, ids, w)
    dfr.select("rest", 1)
    imm.watch(a, a + 64, then_addr=a + 128)
    dfr.watch(a + 128, a + 192)
    runs = [0]
    stop = threading.Event()

    def gpu():  # the stream's side of the handshake
        while not stop.is_set():
            flags[0] = 1
            while (int(flags[16]) != 1 or int(flags[48]) != 1) and not stop.is_set():
                time.sleep(0)
            flags[16] = flags[48] = 0
            runs[0] += 1

    if scen in ("running", "default"):  # exit while the pool runs and polls
        th = threading.Thread(target=gpu, daemon=True)
        th.start()
        while runs[0] < 20:
            time.sleep(0.001)
        # the thread playing the GPU stops first (a Python thread still inside torch while the interpreter tears
        # torch down can abort in torch's own C++ teardown: 'terminate called without an active exception', seen
        # once in CI at 48c99c6), then one more go: the pool is running a chain when the interpreter exits
        stop.set()
        th.join()
        flags[0] = 1
    elif scen == "pool_first":  # a Task's attributes drop its pool before its native task
        del pool, imm, dfr
    elif scen == "raised":  # exit with a go raised
        flags[0] = 1
    elif scen == "closed_pool":  # the pool closed, its tasks kept
        pool.close()
    print("end", flush=True)
""")


@pytest.mark.parametrize("scen", ["running", "default", "pool_first", "raised", "closed_pool"])
def test_exit_with_live_watched_tasks(scen):
    env = dict(os.environ, MALLOC_CHECK_="3", KTINJECT_THREADS="2")
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", SCRIPT, scen], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0 and r.stdout.strip() == "end", (r.returncode, r.stdout, r.stderr[-3000:])
        assert "AddressSanitizer" not in r.stderr and "corrupted" not in r.stderr, r.stderr[-3000:]


def test_task_outlives_destroyed_pool():
    """ktk_pool_destroy first, then the task: calls fail with KTK_ERR_STATE, destroy is clean (no double free)."""
    ffi, lib = native._native()
    pp, tp = ffi.new("ktk_pool **"), ffi.new("ktk_task **")
    assert lib.ktk_pool_create(2, 0, pp) == native.OK
    assert lib.ktk_task_create(pp[0], tp) == native.OK
    ex = native.Experts.from_hf(torch.randn(2, 32, 16), torch.randn(2, 16, 16))
    h, ids, w, out = torch.randn(1, 16), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1), torch.empty(1, 16)
    assert lib.ktk_task_bind(tp[0], ex._p, 1, 1, native._ptr(h), 0, native._ptr(ids, "int64_t *"), native._ptr(w), 0,
                             ffi.NULL, native._ptr(out), 0) == native.OK
    flags = torch.zeros(32, dtype=torch.int32)
    go, done = (ffi.cast("uint32_t *", flags.data_ptr() + 64 * i) for i in range(2))
    assert lib.ktk_task_watch(tp[0], go, done) == native.OK
    lib.ktk_pool_destroy(pp[0])  # threads stop; the task stays watched from its side
    assert lib.ktk_task_unwatch(tp[0]) == native.OK
    assert lib.ktk_submit(tp[0]) == native.ERR_STATE
    assert b"destroyed" in ffi.string(lib.ktk_last_error())
    assert lib.ktk_task_watch(tp[0], go, done) == native.ERR_STATE
    lib.ktk_task_destroy(tp[0])  # frees the pool's memory too


def test_close_all_pools_closes_tasks(monkeypatch):
    """The exit hook: every live pool (here only this test's: not the default pool of this process) and its tasks
    closed; a pool used afterwards raises."""
    import weakref

    from ktinject.native import pool as pool_module

    monkeypatch.setattr(pool_module, "_live_pools", weakref.WeakSet())
    pool = native.Pool(1)
    t = native.Task(pool)
    pool_module.close_all_pools()
    assert t._p is None and pool._p is None
    with pytest.raises(native.NativeError, match="closed"):
        native.Task(pool)
