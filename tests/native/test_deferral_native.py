"""Expert deferral's native slot selection (ktk_task_select, ktk_task_select_share, ktk_task_slots_run) on the CPU.

By count (defer=d, an int) and by weight mass (defer=m, a float): a task's "top" / "rest" parts equal the full
forward with the other slots' weights zeroed, bit for bit (ties, awkward T, skipped experts), against
``ktinject.tiny_models.deferred_slots``, and the two parts' rows add up to every slot; a table of hand-computed mass rows
(dyadic weights: every sum exact); both forms' errors; the rows counter over runs; a watched task chained to another
raises its go. The model-level deferral tests are in tests/operators/test_deferral.py.
Legend: T tokens, H hidden, E experts, k experts per token.
"""
from __future__ import annotations

import pytest
import torch

from ktinject import native
from tests.references import deferred_slots


# ---- parts by count and by mass ------------------------------------------------------------------------------------
def _experts(E=8, H=48, I=40, quant="bf16", seed=0):
    gen = torch.Generator().manual_seed(seed)
    gu = torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5
    dn = torch.randn(E, H, I, generator=gen) / I ** 0.5
    return native.Experts.from_hf(gu, dn, quant=quant)


def _run_part(ex, x, ids, w, part: str, defer, skip=None) -> tuple[torch.Tensor, int]:
    """(out [T, H] bf16, rows computed) of a task running the ``part`` of ``defer``'s split."""
    with native.Task() as task:
        out = torch.empty(x.shape[0], x.shape[1], dtype=torch.bfloat16)
        task.bind(ex, x, ids, w, skip=skip, out=out)
        task.select(part, defer)
        task.submit()
        task.wait()
        return out, task.slots_run()


@pytest.fixture
def row_independent_kernels(monkeypatch):
    """Kernels whose result for a row does not depend on how many rows an expert has.

    The AMX table picks its kernel by an expert's row count (AMX tiles from KTK_AMX_MIN_ROWS_*, the AVX-512 ones
    below; int4 dequantizes to bf16 from KTK_AMX_INT4_DEQUANT_ROWS), and a split part gives an expert fewer rows than
    the full forward, so on AMX the same row can go through another kernel. The AVX-512 table and the direct int4 path
    do not choose by rows: int8 and direct int4 are exact integer dot products on every ISA, and bf16 FMA keeps one
    order per row."""
    before = native.isa()
    if before == "amx":
        native.set_isa("avx512")
    monkeypatch.setenv("KTINJECT_INT4_PATH", "direct")
    yield
    native.set_isa(before)


def _split_cases():
    return pytest.mark.parametrize("T,k,defer", [(1, 4, 1), (3, 4, 3), (5, 3, 1), (7, 8, 5), (3, 4, 0.3),
                                                 (7, 8, 0.25), (40, 8, 0.5), (5, 3, 0.6)])


def _split_inputs(quant, T, k, defer):
    E, H = 8, 48
    ex = _experts(E, H, quant=quant, seed=T)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen)
    w[0, -1] = w[0, 0]  # a tie: the lower slot ranks first
    skip = torch.zeros(E, dtype=torch.uint8)
    skip[int(ids[-1, 0])] = 1
    later = deferred_slots(w, defer)
    assert bool(later[0, -1]) or not bool(later[0, 0])
    return ex, x, ids, w, skip, later


@pytest.mark.parametrize("quant", ["bf16", "int8", "int4"])
@_split_cases()
def test_task_select_equals_zeroed_weights(quant, T, k, defer, row_independent_kernels):
    """With the same kernel for the same rows, each part is the full forward with the other part's weights zeroed,
    bit for bit, and the two parts' rows add up to every computed slot."""
    ex, x, ids, w, skip, later = _split_inputs(quant, T, k, defer)
    kept = ~skip.bool()[ids]  # [T, k]: slots whose expert is computed here
    for part, mask in (("top", ~later), ("rest", later)):
        out, rows = _run_part(ex, x, ids, w, part, defer, skip)
        assert torch.equal(out, ex.forward(x, ids, w * mask, skip=skip)), part
        assert rows == int((mask & kept).sum()), part  # the two parts split every token's slots exactly


@pytest.mark.parametrize("quant", ["bf16", "int8", "int4"])
@_split_cases()
def test_task_select_default_kernels(quant, T, k, defer):
    """With the host's own kernel choice (AMX where it has it): bit for bit off AMX; on AMX, where a part's fewer
    rows can take an expert below a row-count crossover, within the two kernels' rounding: bf16 products summed in
    another order, int4 weights rounded to bf16 (<= 2^-9 relative) on the dequantizing path; each output is rounded
    to bf16 once, so the parts may differ from the zeroed forward by a bf16 step or two of the output's scale."""
    ex, x, ids, w, skip, later = _split_inputs(quant, T, k, defer)
    for part, mask in (("top", ~later), ("rest", later)):
        out, _ = _run_part(ex, x, ids, w, part, defer, skip)
        ref = ex.forward(x, ids, w * mask, skip=skip)
        if native.isa() != "amx" or quant == "int8":
            assert torch.equal(out, ref), part
            continue
        scale = ref.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-3)
        err = ((out.float() - ref.float()).abs() / scale).max().item()
        assert err <= 2 ** -6, (part, err)


# (weights of one token, m, deferred slots): dyadic weights, so that every sum is exact
MASS_ROWS = [
    ([0.5, 0.25, 0.125, 0.125], 0.25, [2, 3]),  # cum(3) = 1/8, cum(2) = 1/4 <= m (inclusive), cum(1) = 1/2
    ([0.5, 0.25, 0.125, 0.125], 0.2, [3]),  # the tie: slot 3 ranks below slot 2
    ([0.125, 0.5, 0.125, 0.25], 0.125, [2]),  # ranks 2, 0, 3, 1: of the tied slots the later one goes first
    ([2.0, 1.0, 0.5, 0.5], 0.25, [2, 3]),  # shares of the token's total, not of 1
    ([0.5, 0.5], 0.3, []),  # the lowest slot alone is over m
    ([0.75, 0.25], 0.3, [1]),
    ([0.0, 1.0, 0.0, 0.0], 0.1, [0, 2, 3]),  # the top slot holds all the weight: the others' cum is 0, never the top
    ([1.0, 0.0, 0.0, 0.0], 0.99, [1, 2, 3]),
    ([0.125] * 8, 0.3, [6, 7]),  # uniform: cum(7) = 1/8, cum(6) = 1/4, cum(5) = 3/8
    ([0.125] * 8, 0.25, [6, 7]),
    ([0.0] * 4, 0.5, []),  # total 0: nothing
    ([float("inf"), 1.0, 1.0, 1.0], 0.5, []),  # total not finite: nothing
    ([float("nan"), 1.0, 1.0, 1.0], 0.5, []),
    ([-1.0, 0.5, 0.25, 0.25], 0.5, []),  # total 0 again
]


@pytest.mark.parametrize("weights,m,later", MASS_ROWS)
def test_task_select_share_table(weights, m, later):
    k, H = len(weights), 48
    ex = _experts(8, H)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(1, H, generator=gen).bfloat16()
    ids = torch.randperm(8, generator=gen)[:k].view(1, k)
    w = torch.tensor([weights])
    expected = torch.zeros(1, k, dtype=torch.bool)
    expected[0, later] = True
    assert torch.equal(deferred_slots(w, m), expected)  # the reference agrees with the hand count
    safe = torch.where(w.isfinite(), w, torch.zeros_like(w))  # the zeroed-weights forward needs finite weights
    for part, mask in (("top", ~expected), ("rest", expected)):
        out, rows = _run_part(ex, x, ids, w, part, m)
        assert rows == int(mask.sum()), part
        if bool(w.isfinite().all()):
            assert torch.equal(out, ex.forward(x, ids, safe * mask)), part


def test_slots_run_counts_rows_over_runs():
    ex = _experts()
    gen = torch.Generator().manual_seed(2)
    x, ids = torch.randn(3, 48, generator=gen), torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(3)])
    w = torch.rand(3, 4, generator=gen)
    skip = torch.zeros(8, dtype=torch.uint8)
    skip[int(ids[0, 0])] = 1
    kept = int((skip[ids] == 0).sum())  # rows computed: the slots of experts not skipped
    assert kept < 12
    with native.Task() as task:
        assert task.slots_run() == 0
        task.bind(ex, x, ids, w, skip=skip)
        for _ in range(2):
            task.submit()
            task.wait()
        assert task.slots_run() == 2 * kept
        task.bind(ex, x, ids, w)  # bind keeps the sum
        task.select("rest", 1)
        task.submit()
        task.wait()
        assert task.slots_run(reset=True) == 2 * kept + 3 and task.slots_run() == 0
        task.select("rest", 0.9)  # each token's slots but its top one (the top holds >= 1/4 of the weight)
        task.submit()
        task.wait()
        assert task.slots_run() == 9 and bool((task.out != 0).any())
        w.zero_()  # total 0: nothing deferred; a run of no rows writes zeros
        task.submit()
        task.wait()
        assert task.slots_run() == 9 and bool((task.out == 0).all())


def test_task_select_errors():
    """Both forms' errors name the function and what it expects; a watched task keeps its selection."""
    ex = _experts()
    x, ids, w = torch.zeros(2, 48), torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3)
    flags = torch.zeros(32, dtype=torch.int32)  # go, done on their own 64-byte lines
    with native.Task() as task:
        for defer, fn in ((1, "ktk_task_select"), (0.3, "ktk_task_select_share")):
            with pytest.raises(native.NativeError, match=f"{fn}: task has no bound forward"):
                task.select("top", defer)
        task.bind(ex, x, ids, w)
        for d in (0, 3):
            with pytest.raises(native.NativeError, match=rf"d = {d} deferred slots of k = 3 \(expected 1 <= d < k\)"):
                task.select("rest", d)
        for m in (0.0, 1.0, float("nan"), -0.1, float("inf"), 1e-50):  # 1e-50: 0 as the native float
            with pytest.raises(native.NativeError, match=r"KTK_ERR_SHAPE: ktk_task_select_share: share = .* of the "
                                                         r"routing weight \(expected a finite 0 < share < 1\)"):
                task.select("rest", m)
        with pytest.raises(native.NativeError, match=r"ktk_task_select_share: slots = 0 \(expected KTK_SLOTS_TOP"):
            task.select("all", 0.3)
        with pytest.raises(native.NativeError, match="slots 'some'"):
            task.select("some", 1)
        task.watch(flags.data_ptr(), flags.data_ptr() + 64)
        for defer, fn in ((1, "ktk_task_select"), (0.3, "ktk_task_select_share")):
            with pytest.raises(native.NativeError, match=f"{fn}: task is watched"):
                task.select("top", defer)
        task.unwatch()
        task.select("all")
        task.select("top", 0.3)
        task.select("top", 1)  # a count replaces the share, and back
        task.select("rest", 0.5)


def test_watch_then_runs_the_chained_task():
    """The first task's end raises the second's go (after its own done): both ran, in that order."""
    ex = _experts()
    gen = torch.Generator().manual_seed(3)
    x, ids, w = torch.randn(2, 48, generator=gen), torch.randint(0, 8, (2, 4), generator=gen), torch.rand(2, 4)
    flags = torch.zeros(64, dtype=torch.int32)  # go, done, go_d, done_d on their own 64-byte lines
    addr = flags.data_ptr()
    a, b = native.Task(), native.Task()
    oa, ob = torch.empty(2, 48), torch.empty(2, 48)
    a.bind(ex, x, ids, w, out=oa)
    a.select("top", 1)
    b.bind(ex, x, ids, w, out=ob)
    b.select("rest", 1)
    try:
        b.watch(addr + 128, addr + 192)
        a.watch(addr, addr + 64, then_addr=addr + 128)
        for _ in range(3):  # a step, three times: the GPU's role played by the host
            flags[16] = 0
            flags[48] = 0
            flags[0] = 1
            while int(flags[48]) != 1:
                pass
            assert int(flags[16]) == 1 and int(flags[0]) == 0 and int(flags[32]) == 0
        later = deferred_slots(w, 1)
        assert torch.equal(oa, ex.forward(x, ids, w * ~later)) and torch.equal(ob, ex.forward(x, ids, w * later))
    finally:
        a.close()
        b.close()


# ---- both parts in one run (ktk_task_split: graph decode's one job a layer) ----------------------------------------
@pytest.mark.parametrize("quant", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("T,k,defer", [(1, 8, 3), (1, 4, 0.3), (3, 4, 1), (8, 6, 0.4), (5, 3, 2), (1, 3, 0.01)])
@pytest.mark.parametrize("gemv,pipe,phases", [("1", "1", "one"), ("1", "1", "cut"), ("1", "1", "two"), ("1", "0", "one"),
                                              ("0", "0", "one")])
def test_split_equals_the_two_parts(monkeypatch, quant, T, k, defer, gemv, pipe, phases):
    """A split task's out and out2 are the "top" and "rest" tasks' outputs, bit for bit, on the decode pipeline
    (one phase, the immediate part's done word raised inside it; KTINJECT_DEFER_PHASES=cut: chunks cut at the
    parts' boundary; two: a phase a part), the
    two-phase decode path and the item path; its done word is 1 after the run; slots_run counts both parts and
    slots_rest the deferred one. (1, 3, 0.01): a step deferring no slot, so out2 is zeros.)"""
    monkeypatch.setenv("KTINJECT_GEMV", gemv)
    monkeypatch.setenv("KTINJECT_PIPE", pipe)
    monkeypatch.setenv("KTINJECT_DEFER_PHASES", phases)
    E, H = 12, 72
    ex = _experts(E, H, quant=quant, seed=T + k)
    gen = torch.Generator().manual_seed(T * k)
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen).softmax(-1)
    skip = torch.zeros(E, dtype=torch.uint8)
    skip[int(ids[0, -1])] = 1
    (top, n_top), (rest, n_rest) = (_run_part(ex, x, ids, w, p, defer, skip) for p in ("top", "rest"))
    flags = torch.zeros(4, dtype=torch.int32)
    with native.Pool(3) as pool, native.Task(pool) as task:
        out = task.bind(ex, x, ids, w, skip=skip, out=torch.full((T, H), 7.0, dtype=torch.bfloat16))
        out2 = task.split(defer, torch.full((T, H), 7.0, dtype=torch.bfloat16), flags.data_ptr())
        for _ in range(2):  # twice: the done word is raised by every run
            flags.zero_()
            task.submit()
            task.wait()
            assert int(flags[0]) == 1 and int(flags[1:].sum()) == 0
            assert torch.equal(out, top) and torch.equal(out2, rest)
        assert task.slots_run() == 2 * (n_top + n_rest) and task.slots_rest() == 2 * n_rest
    if defer == 0.01:
        assert not out2.any()


@pytest.mark.parametrize("quant", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("case", ["many rows", "no immediate row"])
@pytest.mark.parametrize("gemv,tiles", [("0", "0"), ("0", "1"), ("1", "0")])
def test_split_off_the_pipeline_by_part(monkeypatch, quant, case, gemv, tiles):
    """Off the pipeline a split task runs each part's gate/up, h and down in turn (part 0's gate/up items, its
    quantized rows, then part 1's): the same bits as the two parts alone where an expert's rows span several item
    chunks (700 tokens on 4 experts: ~525 rows each, RT = 256), with and without AMX tile order, and where every
    immediate expert is skipped (GPU-resident) while deferred ones run (part 0 empty, R > 0: its zeros)."""
    monkeypatch.setenv("KTINJECT_GEMV", gemv)
    monkeypatch.setenv("KTINJECT_PIPE", "0")
    monkeypatch.setenv("KTINJECT_TILES", tiles)
    gen = torch.Generator().manual_seed(5)
    if case == "many rows":
        T, E = 700, 4
        ids = torch.tensor([[0, 1, 2 + t % 2] for t in range(T)])
    else:
        T, E = 3, 12
        ids = torch.tensor([[3 * t, 3 * t + 1, 3 * t + 2, 9 + t] for t in range(T)])
    H = 72
    ex = _experts(E, H, I=100, quant=quant, seed=3)
    x = torch.randn(T, H, generator=gen).bfloat16()
    w = torch.rand(T, ids.shape[1], generator=gen).sort(-1, descending=True).values  # the last slot is deferred
    skip = torch.zeros(E, dtype=torch.uint8)
    if case == "no immediate row":
        skip[:9] = 1  # every immediate expert GPU-resident: only the deferred slots (experts 9..11) run here
    (top, _), (rest, n_rest) = (_run_part(ex, x, ids, w, p, 1, skip) for p in ("top", "rest"))
    flags = torch.zeros(4, dtype=torch.int32)
    with native.Pool(3) as pool, native.Task(pool) as task:
        out = task.bind(ex, x, ids, w, skip=skip, out=torch.full((T, H), 7.0, dtype=torch.bfloat16))
        out2 = task.split(1, torch.full((T, H), 7.0, dtype=torch.bfloat16), flags.data_ptr())
        task.submit()
        task.wait()
        assert int(flags[0]) == 1 and torch.equal(out, top) and torch.equal(out2, rest)
    assert n_rest == T and out2.any() and (out.any() if case == "many rows" else not out.any())


def test_split_phases_variable_and_profile(monkeypatch):
    """KTINJECT_DEFER_PHASES other than one / cut / two fails a split forward with a message naming it (a plain forward never
    reads it); the pool's profile times a split job's immediate part (top_us: the job's start to its done word,
    within the job's time), one a run, none for a plain task."""
    E, H = 12, 72
    ex = _experts(E, H, quant="bf16", seed=3)  # every AVX-512 kernel table has a bf16 gemv
    pipelined = native.isa() in ("avx512", "amx")  # AVX2 and generic have no gemv: no decode pipeline
    counts = set()
    gen = torch.Generator().manual_seed(3)
    x, ids, w = torch.randn(1, H, generator=gen).bfloat16(), torch.randperm(E, generator=gen)[:8].view(1, 8), \
        torch.rand(1, 8, generator=gen).softmax(-1)
    flags = torch.zeros(4, dtype=torch.int32)
    monkeypatch.setenv("KTINJECT_GEMV", "1")  # the decode pipeline, whose layouts the variable picks
    monkeypatch.setenv("KTINJECT_PIPE", "1")
    with native.Pool(2) as pool, native.Task(pool) as task, native.Task(pool) as plain:
        task.bind(ex, x, ids, w)
        task.split(3, None, flags.data_ptr())
        plain.bind(ex, x, ids, w)
        for phases in ("one", "cut", "two"):
            monkeypatch.setenv("KTINJECT_DEFER_PHASES", phases)
            with pool.profiling() as prof:
                for _ in range(3):
                    task.submit()
                    task.wait()
            assert prof["jobs"] == prof["top_jobs"] == 3, prof
            assert 0 < prof["top_us"] <= prof["job_us"], prof
            if pipelined:
                assert len(prof["phases"]) == (2 if phases == "two" else 1), prof  # a phase a part, or one
            counts.add(len(prof["phases"]))
        assert pipelined or len(counts) == 1, counts  # off the pipeline the parts run their phases in turn
        with pool.profiling() as prof:
            plain.submit()
            plain.wait()
        assert prof["jobs"] == 1 and prof["top_jobs"] == 0
        monkeypatch.setenv("KTINJECT_DEFER_PHASES", "2")
        plain.submit()
        plain.wait()
        with pool.profiling() as prof:
            task.submit()
            with pytest.raises(native.NativeError, match="KTINJECT_DEFER_PHASES=2: expected one, cut or two"):
                task.wait()
        assert int(flags[0]) == 1 and prof["top_jobs"] == 0  # a failed run raises the word, uncounted


def test_split_errors():
    ex = _experts()
    x, ids, w = torch.randn(2, 48).bfloat16(), torch.tensor([[0, 1, 2], [3, 4, 5]]), torch.rand(2, 3)
    with native.Task() as task:
        with pytest.raises(native.NativeError, match="bind a forward first"):
            task.split(1)
        task.bind(ex, x, ids, w)
        with pytest.raises(native.NativeError, match="1 <= d < k"):
            task.split(3)
        with pytest.raises(native.NativeError, match="0 < share < 1"):
            task.split(1.0)
        with pytest.raises(native.NativeError, match="out2 must be"):
            task.split(1, torch.empty(2, 47, dtype=torch.bfloat16))
        with pytest.raises(native.NativeError, match="out2 is the bound out"):
            task.split(1, task.out)
        task.select("rest", 1)
        ffi, lib = native._native()
        out2 = torch.empty_like(task.out)
        assert lib.ktk_task_split(task.ptr, 1, 0.5, ffi.cast("void *", out2.data_ptr()), ffi.NULL) == native.ERR_SHAPE
        task.submit()  # the rejected split kept the selection: the deferred slot alone
        task.wait()
        assert torch.equal(task.out, ex.forward(x, ids, w * deferred_slots(w, 1)))
