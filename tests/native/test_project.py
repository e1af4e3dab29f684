"""One projection of routed rows with the stored weights (ktk_experts_project, ``Experts.project``): forward
(y = W x) and transposed (y = W^T x), every format on every ISA here, against float64 torch on the stored values
(``Experts.get``) and the ISA step against the generic one; awkward shapes (sizes off every multiple of 16, one row,
experts with no rows, every row on one expert over several 32-row chunks, rows in any order); errors.

Tolerances (relative Frobenius): the products are float32 sums of the exact stored values, so F32_TOL against
float64 (of test_experts_backward: sums of a few hundred terms) and TOL_ISA between the ISA's FMA order and the
generic step's (of test_backward_isa). A wrong block, transpose or scale is off by order 1.
Legend: R rows, E experts, H hidden, I expert intermediate.
"""
from __future__ import annotations

import pytest
import torch

from ktinject import native as kn
from tests.native.test_backward_isa import TOL_ISA
from tests.training.test_experts_backward import F32_TOL, QUANTS, rel

ISAS = kn.available_isas()
WHICH = ("gate", "up", "down")
# (E, H, I)
SHAPES = [(6, 100, 72), (3, 40, 17), (9, 130, 50)]


@pytest.fixture
def on_isa():
    before = kn.isa()
    yield kn.set_isa
    kn.set_isa(before)


def make(E, H, I, quant, seed=0):
    g = torch.Generator().manual_seed(seed)
    ex = kn.Experts.from_hf(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5,
                            torch.randn(E, H, I, generator=g) / I ** 0.5, quant=quant)
    return ex, {(e, w): ex.get(e, w).double() for e in range(E) for w in WHICH}


def rows(kind, E, seed=0):
    """Expert of each row: one row; every row on one expert (several 32-row chunks); random, unsorted, the last
    expert without rows."""
    g = torch.Generator().manual_seed(seed)
    if kind == "one":
        return torch.tensor([E - 1])
    if kind == "one_expert":
        return torch.full((70,), 1, dtype=torch.int64)
    return torch.randint(0, E - 1, (45,), generator=g)


def reference(W, which, ids, x, transpose):
    return torch.stack([(W[(e, which)].T if transpose else W[(e, which)]) @ x[r].double()
                        for r, e in enumerate(ids.tolist())])


def shape_in(ex, which, transpose):
    out, inp = ex.shape(which)
    return out if transpose else inp


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["one", "one_expert", "mixed"])
def test_project_matches_float64_and_generic(on_isa, quant, shape, kind):
    E, H, I = shape
    ex, W = make(E, H, I, quant)
    ids = rows(kind, E)
    g = torch.Generator().manual_seed(1)
    for which in WHICH:
        for transpose in (False, True):
            x = torch.randn(len(ids), shape_in(ex, which, transpose), generator=g)
            want = reference(W, which, ids, x, transpose)
            got = {}
            for isa in ISAS:
                on_isa(isa)
                got[isa] = ex.project(which, x, ids, transpose=transpose)
                assert rel(got[isa], want) < F32_TOL, (isa, which, transpose, rel(got[isa], want))
            for isa in ISAS:
                assert rel(got[isa], got["generic"]) < TOL_ISA, (isa, which, transpose)


def test_dtypes_threads_and_row_independence():
    """bf16 / f16 x and bf16 y as given; the same bits on one thread and two, and a row's result whatever rows
    come with it."""
    ex, W = make(5, 72, 40, "int4")
    ids = rows("mixed", 5, seed=3)
    x = torch.randn(len(ids), 72)
    with kn.Pool(1) as one, kn.Pool(2) as two:
        y1 = ex.project("gate", x, ids, pool=one)
        assert torch.equal(y1, ex.project("gate", x, ids, pool=two))
        yt = ex.project("down", x, ids, transpose=True, pool=one)
        assert torch.equal(yt, ex.project("down", x, ids, transpose=True, pool=two))
    for r in (0, 7, len(ids) - 1):
        assert torch.equal(ex.project("gate", x[r:r + 1], ids[r:r + 1]), y1[r:r + 1])
    for dt in (torch.bfloat16, torch.float16):
        xd = x.to(dt)
        assert torch.equal(ex.project("gate", xd, ids), ex.project("gate", xd.float(), ids))
    yb = ex.project("gate", x, ids, out=torch.empty(len(ids), 40, dtype=torch.bfloat16))
    assert torch.equal(yb, y1.bfloat16())
    assert ex.project("up", torch.empty(0, 72), torch.empty(0, dtype=torch.int64)).shape == (0, 40)


def test_mxfp4(on_isa):
    """mxfp4 experts (no Python constructor: the C API) run the generic step on every ISA."""
    ffi, lib = kn._native()
    E, H, I = 4, 96, 64
    cfg = ffi.new("ktk_experts_config *", {"num_experts": E, "hidden": H, "intermediate": I, "quant": 4})
    out = ffi.new("ktk_experts **")
    assert lib.ktk_experts_create(cfg, out) == kn.OK
    p = out[0]
    try:
        g = torch.Generator().manual_seed(0)
        W = {}
        for e in range(E):
            for w, (n, k) in zip(WHICH, ((I, H), (I, H), (H, I))):
                src = torch.randn(n, k, generator=g)
                assert lib.ktk_experts_set(p, e, WHICH.index(w), ffi.cast("void *", src.data_ptr()), 0, k, 1) == kn.OK
                got = torch.empty(n, k)
                assert lib.ktk_experts_get(p, e, WHICH.index(w), ffi.cast("float *", got.data_ptr())) == kn.OK
                W[(e, w)] = got.double()
        ids = torch.tensor([2, 0, 2, 2, 1, 0, 2])
        pool = kn.default_pool()
        for isa in ISAS:
            on_isa(isa)
            for which in WHICH:
                for transpose in (0, 1):
                    n_in = (H if which != "down" else I) if not transpose else (I if which != "down" else H)
                    x = torch.randn(len(ids), n_in, generator=g)
                    n_out = (I if which != "down" else H) if not transpose else (H if which != "down" else I)
                    y = torch.empty(len(ids), n_out)
                    assert lib.ktk_experts_project(pool.ptr, p, WHICH.index(which), len(ids),
                                                   ffi.cast("int64_t *", ids.data_ptr()),
                                                   ffi.cast("void *", x.data_ptr()), 0,
                                                   ffi.cast("void *", y.data_ptr()), 0, transpose, 0) == kn.OK
                    assert rel(y, reference(W, which, ids, x, transpose)) < F32_TOL
    finally:
        lib.ktk_experts_destroy(p)


def expect(code, match, fn, *args, **kw):
    with pytest.raises(kn.NativeError, match=match) as info:
        fn(*args, **kw)
    assert info.value.code == code


def test_errors():
    ex, _ = make(3, 40, 24, "int8")
    ids = torch.tensor([0, 2])
    x = torch.randn(2, 40)
    expect(kn.ERR_RANGE, r"experts?_of_row\[1\] = 3 is out of range \(expected 0 <= id < E = 3\)", ex.project,
           "gate", x, torch.tensor([0, 3]))
    expect(kn.ERR_RANGE, r"expert_of_row\[0\] = -1", ex.project, "gate", x, torch.tensor([-1, 0]))
    expect(kn.ERR_SHAPE, r"x: expected shape \[\*, 40\], got \[2, 24\]", ex.project, "gate", torch.randn(2, 24), ids)
    expect(kn.ERR_SHAPE, r"x: expected shape \[\*, 24\]", ex.project, "gate", x, ids, transpose=True)
    expect(kn.ERR_SHAPE, r"experts: expected shape \[2\]", ex.project, "gate", x, torch.tensor([0]))
    expect(kn.ERR_DTYPE, "experts: dtype int32", ex.project, "gate", x, ids.int())
    expect(kn.ERR_SHAPE, "which = 'gate_up' is not a matrix", ex.project, "gate_up", x, ids)
    expect(kn.ERR_SHAPE, "must be contiguous", ex.project, "gate", torch.randn(40, 2).T, ids)
    unset = kn.Experts(3, 40, 24, quant="int8")
    expect(kn.ERR_STATE, "expert 0 has rows but its gate weights were never set", unset.project, "gate", x, ids)
    ffi, lib = kn._native()
    y = torch.empty(2, 24)
    call = lambda which, R, tr, xd=0, yd=0, prec=0: lib.ktk_experts_project(  # noqa: E731
        kn.default_pool().ptr, ex._p, which, R, ffi.cast("int64_t *", ids.data_ptr()),
        ffi.cast("void *", x.data_ptr()), xd, ffi.cast("void *", y.data_ptr()), yd, tr, prec)
    msg = lambda: ffi.string(lib.ktk_last_error()).decode()  # noqa: E731
    assert call(3, 2, 0) == kn.ERR_RANGE and "which = 3 is not a matrix" in msg()
    assert call(0, 2, 2) == kn.ERR_SHAPE and "transpose = 2 (expected 0: y = W x, or 1: y = W^T x)" in msg()
    assert call(0, -1, 0) == kn.ERR_SHAPE and "R = -1 rows" in msg()
    assert call(0, 2, 0, xd=7) == kn.ERR_DTYPE and "x_dtype = 7" in msg()
    assert call(0, 2, 0, yd=2) == kn.ERR_DTYPE and "y_dtype = 2" in msg()
    assert call(0, 2, 0, prec=2) == kn.ERR_DTYPE and "precision = 2 (expected KTK_PRECISION_FLOAT = 0" in msg()
    assert call(0, 2, 0, prec=-1) == kn.ERR_DTYPE and "precision = -1" in msg()
    expect(kn.ERR_DTYPE, r"precision = 'half' \(expected 'float', 'bf16' or 'auto'\)", ex.project, "gate", x, ids,
           precision="half")
    assert call(0, 0, 0) == kn.OK
    assert lib.ktk_experts_project(kn.default_pool().ptr, ex._p, 0, 2, ffi.NULL, ffi.NULL, 0, ffi.NULL, 0,
                                   0, 1) == kn.ERR_NULL and "expert_of_row" in msg()


# ---- bf16 products (precision="bf16") ----
# Rows of experts with at least MIN_ROWS rows in the call: x and the stored values rounded to bf16 (nearest even: each
# off by at most 2^-8 of itself, 8 significant bits), their products summed in float. So per output
# |y - W x| <= (2 * 2^-8 + 2^-16) sum_c |x_c w_c| plus float32 sums (BF16_TOL: the bound itself; random data reach a
# quarter of it). Against float64 of the rounded factors only the float32 sums remain, at most K 2^-24 of
# sum_c |x~_c w~_c| for these K of at most 200 (ROUNDED_TOL; rounding by truncation or a misplaced pair is far above
# it, and so is any other kernel's error). The other experts' rows are the float step's, bit for bit.
MIN_ROWS = 16
BF16_TOL = 2 * 2 ** -8 + 2 ** -16 + 1e-5
ROUNDED_TOL = 2e-5
QUANTS_BF16 = QUANTS + ("mxfp4",)
# (E, H, I) per quant: sizes off every multiple of 16 / 64 (mxfp4: multiples of 32, not of 64)
BF16_SHAPES = {"wide": (5, 200, 72), "narrow": (4, 40, 17)}
MXFP4_SHAPES = {"wide": (5, 96, 64), "narrow": (4, 32, 96)}


def bf16_rows(kind, E, seed=0):
    """Expert of each row: one row; every row on expert 1 (300: two row chunks of the bf16 step); in random order,
    experts with 15 rows (just below the threshold: float), 16 (at it: bf16), 40, 3 and the last one without rows."""
    if kind == "one":
        return torch.tensor([0])
    if kind == "one_expert":
        return torch.full((300,), 1, dtype=torch.int64)
    counts = torch.tensor([15, 16, 40] + [3] * (E - 4) + [0])
    ids = torch.repeat_interleave(torch.arange(E), counts)
    return ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))]


def by_expert(W, which, ids, x, transpose):
    """float64 y[r] = W_e x[r] (transposed: W_e^T x[r]), one product per expert."""
    out = torch.zeros(len(ids), W[(0, which)].shape[1 if transpose else 0], dtype=torch.float64)
    for e in ids.unique().tolist():
        sel = ids == e
        w = W[(e, which)].T if transpose else W[(e, which)]
        out[sel] = x[sel].double() @ w.T
    return out


def check_bf16(W, which, ids, x, transpose, got, floats):
    """got (bf16 products) against float64 as the header says; floats: the float step's result."""
    rounded = {k: v.float().bfloat16().double() for k, v in W.items()}
    absolute = {k: v.abs() for k, v in W.items()}
    big = torch.bincount(ids)[ids] >= MIN_ROWS
    if big.any():
        g, sel = got.double()[big], ids[big]
        err = (g - by_expert(W, which, sel, x[big], transpose)).abs()
        assert (err / by_expert(absolute, which, sel, x[big].abs(), transpose)).max() <= BF16_TOL
        xr = x[big].bfloat16().double()
        err = (g - by_expert(rounded, which, sel, xr, transpose)).abs()
        scale = by_expert({k: v.abs() for k, v in rounded.items()}, which, sel, xr.abs(), transpose)
        assert (err / scale).max() <= ROUNDED_TOL
        assert not torch.equal(got[big], floats[big])   # (the bf16 step ran)
    assert torch.equal(got[~big], floats[~big])


def make_bf16(quant, shape):
    E, H, I = (MXFP4_SHAPES if quant == "mxfp4" else BF16_SHAPES)[shape]
    return make(E, H, I, quant), E


@pytest.mark.parametrize("quant", QUANTS_BF16)
@pytest.mark.parametrize("shape", list(BF16_SHAPES))
@pytest.mark.parametrize("kind", ["one", "one_expert", "mixed"])
def test_bf16_products_match_float64(on_isa, quant, shape, kind):
    (ex, W), E = make_bf16(quant, shape)
    ids = bf16_rows(kind, E)
    g = torch.Generator().manual_seed(2)
    for isa in ISAS:
        on_isa(isa)
        for which in WHICH:
            for transpose in (False, True):
                x = torch.randn(len(ids), shape_in(ex, which, transpose), generator=g)
                got = ex.project(which, x, ids, transpose=transpose, precision="bf16")
                floats = ex.project(which, x, ids, transpose=transpose, precision="float")
                check_bf16(W, which, ids, x, transpose, got, floats)


def test_bf16_products_threads_rows_dtypes(on_isa):
    """The same bits on one thread and two (other block groups per item), a row's result whatever other rows of
    its expert (two row chunks instead of one) or of other experts come with it, bf16 / f16 x as given, bf16 y the
    float y rounded, and "auto" (bf16 on amx, else float)."""
    ex, _ = make(3, 200, 72, "int4")
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([20, 40, 30]))
    x = torch.randn(len(ids), 200)
    d = torch.randn(len(ids), 72)
    for isa in ISAS:
        on_isa(isa)
        with kn.Pool(1) as one, kn.Pool(2) as two:
            for which, v, tr in (("gate", x, False), ("up", d, True), ("down", d, False), ("down", x, True)):
                y1 = ex.project(which, v, ids, transpose=tr, pool=one, precision="bf16")
                assert torch.equal(y1, ex.project(which, v, ids, transpose=tr, pool=two, precision="bf16"))
                more = torch.cat([ids, torch.full((300,), 1), torch.full((17,), 2)])
                vm = torch.cat([v, torch.randn(317, v.shape[1])])
                perm = torch.randperm(len(more))
                inv = torch.argsort(perm)
                ym = ex.project(which, vm[perm].contiguous(), more[perm].contiguous(), transpose=tr,
                                precision="bf16")[inv]
                assert torch.equal(ym[:len(ids)], y1), (isa, which, tr)
        y = ex.project("gate", x, ids, precision="bf16")
        for dt in (torch.bfloat16, torch.float16):
            xd = x.to(dt)
            assert torch.equal(ex.project("gate", xd, ids, precision="bf16"),
                               ex.project("gate", xd.float(), ids, precision="bf16"))
        yb = ex.project("gate", x, ids, out=torch.empty(len(ids), 72, dtype=torch.bfloat16), precision="bf16")
        assert torch.equal(yb, y.bfloat16())
        auto = "bf16" if isa == "amx" else "float"
        assert torch.equal(ex.project("gate", x, ids, precision="auto"), ex.project("gate", x, ids, precision=auto))
