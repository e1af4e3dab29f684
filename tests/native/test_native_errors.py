"""Bad arguments give NativeError with a clear message (never a crash); import is side-effect free; ISA env var."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ktinject import native as kn


def run_py(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_import_starts_no_threads_and_loads_no_library():
    r = run_py("""
        import os, sys, threading
        import torch
        before = len(os.listdir('/proc/self/task'))
        import ktinject, ktinject.native, ktinject.native.library, ktinject.native.pool
        assert 'ktinject.native._core' not in sys.modules, 'native module loaded at import'
        assert len(os.listdir('/proc/self/task')) == before, 'threads started at import'
        assert threading.active_count() == 1
        assert ktinject.native.pool._default_pool is None
        ktinject.native.version()                     # first use loads it
        assert 'ktinject.native._core' in sys.modules
        assert len(os.listdir('/proc/self/task')) == before, 'loading the library started threads'
        print('ok')
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_isa_env_bogus_is_an_error_until_set():
    r = run_py("""
        from ktinject import native as kn
        for call in (kn.isa, lambda: kn.Experts(2, 8, 8)):
            try:
                call()
            except kn.NativeError as e:
                assert e.code == kn.ERR_ISA, e
                print(e.message)
            else:
                raise SystemExit('no error')
        kn.set_isa('generic')
        assert kn.isa() == 'generic'
        kn.Experts(2, 8, 8)
    """, KTINJECT_ISA="bogus")
    assert r.returncode == 0, r.stderr
    assert "KTINJECT_ISA=bogus: unknown ISA (expected generic, avx2, avx512 or amx)" in r.stdout


def test_isa_env_unavailable_and_valid():
    missing = [i for i in ("generic", "avx2", "avx512", "amx") if i not in kn.available_isas()]
    if missing:
        r = run_py("from ktinject import native as kn\nkn.isa()", KTINJECT_ISA=missing[-1])
        assert r.returncode != 0 and f"KTINJECT_ISA={missing[-1]}: not available" in r.stderr
    r = run_py("from ktinject import native as kn\nprint(kn.isa())", KTINJECT_ISA="GENERIC")
    assert r.returncode == 0 and r.stdout.strip() == "generic", r.stderr
    with pytest.raises(kn.NativeError, match="unknown ISA 'sse'"):
        kn.set_isa("sse")


@pytest.fixture(scope="module")
def ex():
    e = kn.Experts(4, 16, 8)
    for i in range(4):
        for w, shape in (("gate", (8, 16)), ("up", (8, 16)), ("down", (16, 8))):
            e.set(i, w, torch.randn(shape))
    return e


def args(T=3, k=2, E=4, H=16):
    return torch.randn(T, H), torch.randint(0, E, (T, k)), torch.rand(T, k)


def expect(code: int, match: str, fn, *a, **kw):
    with pytest.raises(kn.NativeError, match=match) as err:
        fn(*a, **kw)
    assert err.value.code == code, err.value
    return err.value


def test_forward_bad_tensors(ex):
    x, ids, w = args()
    expect(kn.ERR_NULL, "hidden: expected a torch.Tensor, got list", ex, x.tolist(), ids, w)
    expect(kn.ERR_NULL, "ids: expected a torch.Tensor, got NoneType", ex, x, None, w)
    expect(kn.ERR_SHAPE, r"hidden: expected shape \[\*, 16\], got \[3, 17\]", ex, torch.randn(3, 17), ids, w)
    expect(kn.ERR_SHAPE, r"ids: expected shape \[3, \*\], got \[2, 2\]", ex, x, ids[:2], w)
    expect(kn.ERR_SHAPE, r"weights: expected shape \[3, 2\], got \[3, 3\]", ex, x, ids, torch.rand(3, 3))
    expect(kn.ERR_DTYPE, "hidden: dtype int32 is not supported", ex, x.int(), ids, w)
    expect(kn.ERR_DTYPE, "ids: dtype int32 is not supported .expected int64", ex, x, ids.int(), w)
    expect(kn.ERR_DTYPE, "weights: dtype float16 is not supported", ex, x, ids, w.half())
    expect(kn.ERR_DTYPE, "expected a CPU tensor, got device meta", ex, x.to("meta"), ids, w)
    expect(kn.ERR_SHAPE, "hidden: must be contiguous", ex, torch.randn(16, 3).t(), ids, w)
    expect(kn.ERR_SHAPE, r"out: expected shape \[3, 16\]", ex, x, ids, w, out=torch.empty(3, 15))
    expect(kn.ERR_DTYPE, "out: dtype float16", ex, x, ids, w, out=torch.empty(3, 16, dtype=torch.half))
    expect(kn.ERR_SHAPE, r"skip: expected shape \[4\]", ex, x, ids, w, skip=torch.zeros(5, dtype=torch.bool))
    expect(kn.ERR_STATE, "Pool is closed", ex, x, ids, w, pool=_closed_pool())


def _closed_pool():
    p = kn.Pool(1)
    p.close()
    p.close()  # idempotent
    return p


def test_forward_bad_ids_and_k(ex):
    x, ids, w = args()
    ids[2, 1] = 4
    err = expect(kn.ERR_RANGE, r"ids\[2\]\[1\] \(token 2, slot 1\) = 4, expected 0 <= id < E = 4", ex, x, ids, w)
    assert "out of range" in str(err)
    ids[2, 1] = -3
    expect(kn.ERR_RANGE, r"= -3, expected 0 <= id < E = 4", ex, x, ids, w)
    x, ids, w = args(k=5)
    expect(kn.ERR_SHAPE, r"k = 5 experts per token \(expected 1 <= k <= min\(E = 4", ex, x, ids.clamp(0, 3), w)
    x, ids, w = args(k=0)  # (the empty ids had been reported as a NULL pointer)
    expect(kn.ERR_SHAPE, r"ids has shape \[\d+, 0\]: each token needs at least one expert", ex, x, ids, w)
    x, ids, w = args()
    with pytest.raises(kn.NativeError, match=r"Task.bind: hidden has no tokens \(T = 0\)"):
        kn.Task(kn.Pool(1)).bind(ex, x[:0], ids[:0], w[:0])


def test_experts_bad_config_and_set():
    expect(kn.ERR_SHAPE, "num_experts = 0", kn.Experts, 0, 8, 8)
    expect(kn.ERR_SHAPE, "hidden = -1", kn.Experts, 2, -1, 8)
    expect(kn.ERR_SHAPE, r"intermediate = 4294967296 is out of range", kn.Experts, 2, 8, 2**32)
    expect(kn.ERR_DTYPE, "quant = 'fp4'", kn.Experts, 2, 8, 8, quant="fp4")
    expect(kn.ERR_DTYPE, "activation = 'gelu'", kn.Experts, 2, 8, 8, activation="gelu")
    expect(kn.ERR_SHAPE, "limit > 0", kn.Experts, 2, 8, 8, activation="gptoss", limit=0.0)
    expect(kn.ERR_NULL, "num_experts: expected an int, got str", kn.Experts, "2", 8, 8)
    e = kn.Experts(2, 16, 8)
    expect(kn.ERR_RANGE, r"expert = 2 is out of range \(expected 0..1\)", e.set, 2, "gate", torch.randn(8, 16))
    expect(kn.ERR_SHAPE, "which = 'w1' is not a matrix", e.set, 0, "w1", torch.randn(8, 16))
    expect(kn.ERR_SHAPE, r"gate weight of expert 0: expected shape \[8, 16\], got \[16, 8\]", e.set, 0, "gate",
           torch.randn(16, 8))
    expect(kn.ERR_DTYPE, "dtype float64", e.set, 0, "down", torch.randn(16, 8, dtype=torch.float64))
    expect(kn.ERR_STATE, "has_bias = 0", e.set_bias, 0, "gate", torch.randn(8))
    expect(kn.ERR_SHAPE, "size = 3 bytes, expected ktk_experts_nbytes", e.load_packed,
           torch.zeros(3, dtype=torch.uint8))
    x, ids, w = args(E=2)
    expect(kn.ERR_STATE, "expert 0 is routed to but its gate weights were never set", e, x, ids.clamp(0, 0), w)


def test_c_level_null_and_ranges():
    """The C API itself checks pointers and codes (the Python layer is not the only guard)."""
    ffi, lib = kn._native()

    def msg():
        return ffi.string(lib.ktk_last_error()).decode()

    assert lib.ktk_forward(ffi.NULL, ffi.NULL, 1, 1, ffi.NULL, 0, ffi.NULL, ffi.NULL, 0, ffi.NULL, ffi.NULL, 0) \
        == kn.ERR_NULL and "argument 'pool' is NULL" in msg()
    assert lib.ktk_experts_create(ffi.NULL, ffi.new("ktk_experts **")) == kn.ERR_NULL and "'cfg'" in msg()
    assert lib.ktk_submit(ffi.NULL) == kn.ERR_NULL
    lib.ktk_submit_fn(ffi.NULL)   # void forms ignore NULL
    lib.ktk_wait_fn(ffi.NULL)
    lib.ktk_pool_destroy(ffi.NULL)
    lib.ktk_experts_destroy(ffi.NULL)
    lib.ktk_task_destroy(ffi.NULL)
    assert lib.ktk_isa_set(9) == kn.ERR_ISA and "isa = 9" in msg()
    assert lib.ktk_isa_name(7) == ffi.NULL and lib.ktk_isa_available(-1) == 0
    assert lib.ktk_pool_threads(ffi.NULL) < 0 and lib.ktk_experts_nbytes(ffi.NULL) < 0
    assert lib.ktk_pool_watch_spin_us(ffi.NULL) == -kn.ERR_NULL and "argument 'pool' is NULL" in msg()
    assert lib.ktk_pool_set_watch_spin_us(ffi.NULL, 5) == kn.ERR_NULL and lib.ktk_pool_wake(ffi.NULL) == kn.ERR_NULL
    assert lib.ktk_pool_set_watch_spin_us(kn.default_pool().ptr, -1) == kn.ERR_SHAPE and "out of range" in msg()
    ex = kn.Experts(2, 8, 8)
    src = torch.zeros(8, 8)
    assert lib.ktk_experts_set(ex._p, 0, 0, ffi.cast("void *", src.data_ptr()), 7, 8, 1) == kn.ERR_DTYPE
    assert "src_dtype = 7" in msg()
    assert lib.ktk_experts_set(ex._p, 0, 0, ffi.cast("void *", src.data_ptr()), 0, 1 << 41, 1) == kn.ERR_SHAPE
    assert lib.ktk_experts_get(ex._p, 0, 3, ffi.cast("float *", src.data_ptr())) == kn.ERR_RANGE
    x, ids, w = torch.zeros(1, 8), torch.zeros(1, 1, dtype=torch.long), torch.ones(1)
    p = lambda t: ffi.cast("void *", t.data_ptr())  # noqa: E731
    ids_p = ffi.cast("int64_t *", ids.data_ptr())
    pool = kn.Pool(1)
    assert lib.ktk_forward(pool.ptr, ex._p, 0, 1, p(x), 0, ids_p, p(w), 0, ffi.NULL, p(x), 0) == kn.ERR_SHAPE
    assert "T = 0 tokens" in msg()
    assert lib.ktk_forward(pool.ptr, ex._p, 1, 1, p(x), 0, ids_p, p(w), 2, ffi.NULL, p(x), 0) == kn.ERR_DTYPE
    assert "weights_dtype = 2" in msg()
    assert lib.ktk_forward(pool.ptr, ex._p, 1, 1, p(x), 0, ids_p, p(w), 0, ffi.NULL, p(x), 5) == kn.ERR_DTYPE
    task = kn.Task(pool)
    expect(kn.ERR_STATE, "no bound forward", task.submit)
    expect(kn.ERR_STATE, "not watched", task.unwatch)
    expect(kn.ERR_NULL, "go_addr = 0", task.watch, 0, 4)
    expect(kn.ERR_NULL, "experts: expected ktinject.native.Experts", task.bind, None, x, ids, w)
    pool.close()
    expect(kn.ERR_STATE, "Task is closed", task.submit)


def test_default_pool_threads():
    r = run_py("""
        from ktinject import native as kn
        kn.set_default_threads(1)
        assert kn.default_pool().threads == 1
        kn.set_default_threads(1)   # same count: fine
        try:
            kn.set_default_threads(2)
        except kn.NativeError as e:
            assert e.code == kn.ERR_STATE and 'already runs with 1 threads' in e.message
        else:
            raise SystemExit('no error')
    """)
    assert r.returncode == 0, r.stderr
    r = run_py("from ktinject import native as kn\nprint(kn.default_pool().threads)", KTINJECT_THREADS="3")
    assert r.stdout.strip() == "3", r.stderr


def test_threads_above_the_usable_cpus_warn():
    """64 threads on 2 cores decoded 12x slower: set_default_threads and KTINJECT_THREADS above the CPUs warn."""
    from ktinject.native.library import usable_cpus

    cpus = usable_cpus()
    default = kn.default_threads()
    r = run_py(f"from ktinject import native as kn\nkn.set_default_threads({cpus + 1})\nkn.set_default_threads(None)")
    assert r.returncode == 0, r.stderr
    assert f"set_default_threads({cpus + 1}): more expert threads than the {cpus} CPUs" in r.stderr
    assert f"the default: {default} here" in r.stderr
    r = run_py("from ktinject import native as kn\nprint(kn.default_pool().threads)", KTINJECT_THREADS=str(cpus + 1))
    assert r.stdout.strip() == str(cpus + 1) and f"KTINJECT_THREADS={cpus + 1}: more expert threads" in r.stderr
    r = run_py(f"from ktinject import native as kn\nkn.set_default_threads({cpus})")
    assert r.returncode == 0 and "more expert threads" not in r.stderr, r.stderr


def test_pool_destroy_never_hangs():
    """Create/destroy cycles, with queued work and a watched task, in a subprocess with a timeout."""
    r = run_py("""
        import torch
        from ktinject import native as kn
        ex = kn.Experts(4, 32, 16)
        for e in range(4):
            for w, s in (('gate', (16, 32)), ('up', (16, 32)), ('down', (32, 16))):
                ex.set(e, w, torch.randn(s))
        x, ids, w = torch.randn(64, 32), torch.randint(0, 4, (64, 2)), torch.rand(64, 2)
        flags = torch.zeros(2, dtype=torch.int32)
        ffi, lib = kn._native()
        for i in range(100):
            pool = kn.Pool(1 + i % 4, pin=bool(i % 2))
            if i % 3 == 0:
                t = kn.Task(pool); t.bind(ex, x, ids, w); t.submit()
                t2 = kn.Task(pool); t2.bind(ex, x, ids, w); t2.watch(flags.data_ptr(), flags.data_ptr() + 4)
            pool.close()
        print('ok')
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_python_constants_match_header():
    _, lib = kn._native()
    for code, name in kn.ERROR_NAMES.items():
        assert getattr(lib, name) == code
    for name, code in kn.QUANTS.items():
        assert getattr(lib, f"KTK_QUANT_{name.upper()}") == code
    for name, code in kn.ACTIVATIONS.items():
        assert getattr(lib, f"KTK_ACT_{name.upper()}") == code
    for name, code in kn.MATRICES.items():
        assert getattr(lib, f"KTK_MAT_{name.upper()}") == code
    for dtype, code in kn.DTYPES.items():
        assert getattr(lib, {0: "KTK_DTYPE_F32", 1: "KTK_DTYPE_BF16", 2: "KTK_DTYPE_F16"}[code]) == code
    ffi, _ = kn._native()
    assert [ffi.string(lib.ktk_isa_name(i)).decode() for i in range(4)] == list(kn.ISA_NAMES)
    assert set(kn.cpu_features()) <= {n[8:].lower() for n in dir(lib) if n.startswith("KTK_CPU_")}


def test_watch_spin_env():
    r = run_py("""
        from ktinject import native as kn
        with kn.Pool(1) as p:
            print(p.watch_spin_us)
    """, KTINJECT_WATCH_SPIN_US="250")
    assert r.returncode == 0 and r.stdout.strip() == "250", r.stderr
    r = run_py("""
        from ktinject import native as kn
        with kn.Pool(1) as p:
            print(p.watch_spin_us)
    """, KTINJECT_WATCH_SPIN_US="-7")
    assert r.returncode == 0 and r.stdout.strip() == "0", r.stderr


def test_default_threads_leaves_a_core_from_8_cores():
    from ktinject import native as kn

    n = kn.physical_cores()
    assert kn.default_threads() == (n - 1 if n >= 8 else n) >= 1
