"""fp8 (W8A16) experts: float8 e4m3 weights with block scales, kept bit for bit or quantized per block; both kernel
paths on every ISA here against float64 references; the decode path; errors.

Legend: T tokens, k experts per token, E experts, H hidden, I expert intermediate, G inputs per scale (group_size),
BR output rows per scale (block_rows). Errors are relative Frobenius errors ||out - ref|| / ||ref|| (``rel``).

Paths (KTINJECT_FP8_PATH, read at each forward): ``direct`` runs the fp8 kernels (per group a float sum of x times
e4m3, then fma with the block's scale: bit-identical on every ISA, so the whole forward is too); ``dequant`` rounds
the called blocks' weights to bf16(e4m3 * scale) and runs the ISA's bf16 kernel, i.e. exactly a bf16 forward of those
rounded weights; ``auto`` picks by rows per call.

Tolerances (measured maxima over the cases below in brackets):
- REF (as test_native's bf16): float64 on the stored weights ex.get() (direct) or on them rounded to bf16 (dequant),
  x and h rounded to bf16 as the library does: TOL_REF_F32 = 1e-4 [direct 2e-7], bf16 output TOL_REF_BF16. On the
  dequantizing path (and on bf16 experts holding the same rounded weights, whose output is the same bits) rare
  one-ulp flips of an h element at a bf16 rounding boundary weigh more: TOL_REF_DQ = 5e-4 [1.3e-4].
- TRUTH: float64 on the unquantized weights and activations. e4m3 keeps 4 significant bits: a weight's rounding is
  uniform within +-2^-4 of its value, rms ~3.6% of its magnitude, and the block's largest value maps to 448 (no
  saturation); three matrices in a row plus bf16 activations: TOL_TRUTH_FP8 = 0.1 [0.047]. A wrong scale, block or
  byte order gives errors near 100%.
"""
from __future__ import annotations

import functools
import logging
import os

import pytest
import torch

from ktinject import native as kn
from tests.native.test_native import (ISAS, TOL_REF_BF16, TOL_REF_F32, make_problem, reference, rel, run, stored,
                                      use_isa)  # noqa: F401, F811  (use_isa is a fixture of test_native)

log = logging.getLogger(__name__)

TOL_REF_DQ = 5e-4
TOL_TRUTH_FP8 = 0.1
F8 = torch.float8_e4m3fn

FP8_CASES = [  # E, H, I, T, k, routing, skip, hidden dtype, weights dtype, out dtype, weight src dtype; G, BR
    ((1, 37, 19, 1, 1, "random", None, "f32", "f32", "f32", "f32"), 32, 16),           # one token, H, I < G
    ((8, 130, 72, 1, 8, "random", None, "bf16", "bf16", "bf16", "bf16"), 128, 128),    # decode: one token, k = 8
    ((16, 200, 100, 7, 4, "random", "some", "f32", "bf16", "f32", "bf16"), 128, 16),   # H, I not multiples of G
    ((300, 40, 24, 64, 8, "random", "some", "bf16", "f32", "f32", "f32"), 32, 128),    # most experts without tokens
    ((12, 96, 80, 300, 2, "random", None, "f16", "f32", "f32", "f16"), 48, 32),        # many rows; G not dividing Kp
    ((10, 72, 33, 300, 3, "one_expert", None, "bf16", "bf16", "bf16", "bf16"), 32, 16),  # all tokens on one expert
    ((6, 64, 64, 20, 2, "random", "all", "f32", "f32", "f32", "f32"), 128, 128),       # everything skipped
]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for name in ("KTINJECT_FP8_PATH", "KTINJECT_GEMV", "KTINJECT_PIPE"):
        monkeypatch.delenv(name, raising=False)


def blocks_of(scale: torch.Tensor, N: int, K: int, G: int, BR: int) -> torch.Tensor:
    """Block scales [ceil(N / BR), ceil(K / G)] expanded to one per element [N, K]."""
    return scale.repeat_interleave(BR, 0)[:N].repeat_interleave(G, 1)[:, :K]


def quant_fp8(w: torch.Tensor, G: int, BR: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], scale [ceil(N/BR), ceil(K/G)]) as the library quantizes w [N, K], by torch's own cast: per block
    scale = amax / 448 in float32 (1 for an all-zero block), q = float8_e4m3fn(w / scale)."""
    w = w.float()
    N, K = w.shape
    nb, ng = -(-N // BR), -(-K // G)
    wp = torch.zeros(nb * BR, ng * G)
    wp[:N, :K] = w
    amax = wp.abs().view(nb, BR, ng, G).amax((1, 3))
    scale = torch.where(amax > 0, amax / 448, torch.ones(()))
    return (w / blocks_of(scale, N, K, G, BR)).to(F8), scale


def raw_parts(ex: kn.Experts, e: int, which: str) -> tuple[torch.Tensor, torch.Tensor, kn.RawMatrix]:
    """(e4m3 bits [Np, Kp], scales [Np/16, ceil(Kp/G)]) of a stored matrix, read through ktk_experts_raw."""
    raw = kn.experts_raw(ex, e, which)
    base, region = kn.experts_region_view(ex)
    data = region[raw.data - base:raw.data - base + raw.data_bytes]
    ng = -(-raw.Kp // ex.group_size)
    scale = region[raw.scale - base:raw.scale - base + 4 * raw.Np // 16 * ng].view(torch.float32)
    q = data.view(raw.Np // 16, raw.Kp, 16).permute(0, 2, 1).reshape(raw.Np, raw.Kp)
    return q.clone(), scale.view(raw.Np // 16, ng).clone(), raw


def random_fp8(N: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """e4m3 bits [N, K]: every code but the NaN ones (subnormals, both zeros, +-448)."""
    q = torch.randint(0, 256, (N, K), generator=gen, dtype=torch.uint8)
    return torch.where((q & 0x7F) == 0x7F, q ^ 0x01, q)


# ---- set_fp8: the release's bits ----
@pytest.mark.parametrize("G, BR", [(128, 128), (32, 16), (48, 32), (512, 16)])
def test_set_fp8_keeps_bits_and_scales(G, BR):
    ex = kn.Experts(3, 200, 100, quant="fp8", group_size=G, block_rows=BR)
    gen = torch.Generator().manual_seed(G + BR)
    for which in ("gate", "up", "down"):
        N, K = ex.shape(which)
        q = random_fp8(N, K, gen)
        scale = (torch.rand(-(-N // BR), -(-K // G), generator=gen) - 0.3) * 0.01   # both signs
        scale[0, 0] = 0.0
        src = q.view(F8) if which == "up" else q  # float8 tensors as well as their bits
        if which == "down":  # strided sources
            src, scale = q.t().contiguous().t(), scale.t().contiguous().t()
        ex.set_fp8(1, which, src, scale)
        bits, sc, raw = raw_parts(ex, 1, which)
        assert (raw.quant, raw.N, raw.K, raw.Np, raw.Kp, raw.data_bytes) == ("fp8", N, K, -(-N // 16) * 16,
                                                                           -(-K // 64) * 64, raw.Np * raw.Kp)
        assert torch.equal(bits[:N, :K], q) and not bits[N:].any() and not bits[:, K:].any()
        want = scale.repeat_interleave(BR, 0)[:raw.Np:16]  # each 16-row block: its BR block's scale
        assert torch.equal(sc[:, :want.shape[1]], want) and not sc[:, want.shape[1]:].any()
        assert torch.equal(ex.get(1, which), q.view(F8).float() * blocks_of(scale, N, K, G, BR))
    assert not ex.get(0, "gate").any()  # other experts untouched


def test_set_fp8_strides_of_a_stacked_release():
    """An HF-style [E, 2I, H] weight with its [E, 2I/BR, H/G] weight_scale_inv, views into both."""
    E, H, I, G, BR = 2, 256, 128, 128, 128
    gen = torch.Generator().manual_seed(3)
    q = random_fp8(E * 2 * I, H, gen).view(E, 2 * I, H)
    s = torch.rand(E, 2 * I // BR, H // G, generator=gen) * 1e-3
    ex = kn.Experts(E, H, I, quant="fp8")
    for e in range(E):
        ex.set_fp8(e, "gate", q[e, :I].view(F8), s[e, :I // BR])
        ex.set_fp8(e, "up", q[e, I:], s[e, I // BR:])
        assert torch.equal(ex.get(e, "up"), q[e, I:].view(F8).float() * blocks_of(s[e, I // BR:], I, H, G, BR))


# ---- set: quantized per block, as torch casts ----
def special_block(scale_exp: int) -> torch.Tensor:
    """128 values whose quotients by the block's scale 2^scale_exp (amax = 448 * 2^scale_exp) are e4m3 ties and edge
    cases: exact codes, ties to even among normals and subnormals, the subnormal / normal boundary, +-448, zeros."""
    t = [448.0, -448.0, 0.0, -0.0, 1.0625, 1.1875, 17.0, 19.0, -17.0, 3 * 2**-10, 2**-10, 5 * 2**-10, 15 * 2**-10,
         2**-6, 2**-9, -2**-9, 2**-11, 0.99 * 2**-10, 1.01 * 2**-10, 432.0, 440.0, 447.9, 416.0, 240.0, 248.0,
         -232.0, 0.5 + 2**-6, 0.75 - 2**-7, 7 * 2**-9, 6.5 * 2**-9, 7.5 * 2**-9, -7.5 * 2**-9]
    t = torch.tensor(t + [0.0] * (128 - len(t)))
    t[len(t) // 2:] = torch.linspace(-447, 447, 64)
    return t * 2.0**scale_exp


@pytest.mark.parametrize("G, BR", [(128, 128), (32, 16), (48, 32)])
def test_set_quantizes_as_torch_casts(G, BR):
    N, K = 70, 300
    gen = torch.Generator().manual_seed(G)
    w = torch.randn(N, K, generator=gen) * torch.logspace(-4, 1, N)[:, None]
    w[:BR, :G] = 0.0  # an all-zero block (scale 1)
    r0 = BR if BR < N else 0  # block (r0 / BR, 1): one row of special values, the rest zero
    w[r0:r0 + BR, G:2 * G] = 0.0
    w[r0, G:2 * G] = special_block(-5)[:G]  # its scale is 2^-5 exactly: the quotients are the values above
    w[-1, -3] = 1e-30  # tiny against its block: flushed to zero
    ex = kn.Experts(1, K, N, quant="fp8", group_size=G, block_rows=BR)
    for src in (w, w.t().contiguous().t()):
        ex.set(0, "gate", src)
        q, scale = quant_fp8(w, G, BR)
        bits, sc, _ = raw_parts(ex, 0, "gate")
        assert torch.equal(bits[:N, :K], q.view(torch.uint8))
        assert torch.equal(sc[:, :scale.shape[1]], scale.repeat_interleave(BR, 0)[:sc.shape[0] * 16:16])
        assert torch.equal(ex.get(0, "gate"), q.float() * blocks_of(scale, N, K, G, BR))
    assert scale[r0 // BR, 1] == 2.0**-5
    codes = bits[r0, G:G + 16].tolist()  # 448, -448, 0, -0, 1 (tie down), 1.25 (tie up), 16, 20, -16, 2 * 2^-9,
    assert codes == [0x7E, 0xFE, 0x00, 0x80, 0x38, 0x3A, 0x58, 0x5A, 0xD8, 0x02, 0x00, 0x02, 0x08, 0x08, 0x01, 0x81]
    # (0 (tie to even), 2 * 2^-9 (tie down), 2^-6 (subnormal tie up to the smallest normal), 2^-6, 2^-9, -2^-9)
    # every float32 exponent e4m3 covers, quotient by a scale of 1 (amax 448): torch's cast bit for bit
    v = torch.randn(64, 2048, generator=gen) * torch.exp2(torch.randint(-14, 9, (64, 2048), generator=gen).float())
    v = v.clamp(-447.99, 447.99)
    v[:, ::512] = 448.0  # every block: scale 1
    ex2 = kn.Experts(1, 2048, 64, quant="fp8", group_size=512, block_rows=64)
    ex2.set(0, "gate", v)
    assert torch.equal(raw_parts(ex2, 0, "gate")[0][:64, :2048], v.to(F8).view(torch.uint8))
    # bf16 / f16 sources: quantized from their float values
    ex.set(0, "up", w.bfloat16())
    assert torch.equal(raw_parts(ex, 0, "up")[0][:N, :K], quant_fp8(w.bfloat16(), G, BR)[0].view(torch.uint8))


def test_set_non_finite_block():
    w = torch.randn(32, 64)
    w[20, 40] = float("inf")
    ex = kn.Experts(1, 64, 32, quant="fp8", group_size=32, block_rows=16)
    ex.set(0, "up", w)
    got = ex.get(0, "up")
    assert torch.isnan(got[16:, 32:]).all()
    q, scale = quant_fp8(w[:16], 32, 16)
    assert torch.equal(got[:16], q.float() * blocks_of(scale, 16, 64, 32, 16))


# ---- forward ----
def fp8_problem(ci, seed, activation="silu", bias=False):
    """make_problem with fp8 experts of FP8_CASES[ci]'s blocks (same weights and inputs as test_native's)."""
    case, G, BR = FP8_CASES[ci]
    _, hidden, ids, weights, skip, od, truth, biases = make_problem(case, seed, "bf16", activation, bias)
    E, H, I = case[:3]
    ex = kn.Experts(E, H, I, quant="fp8", group_size=G, block_rows=BR, activation=activation, bias=bias)
    for e, mats in enumerate(truth):
        for which, m in zip(("gate", "up", "down"), mats):
            ex.set(e, which, m)
        if bias:
            for which, b in zip(("gate", "up", "down"), biases[e]):
                ex.set_bias(e, which, b)
    return ex, hidden, ids, weights, skip, od, truth, biases


def with_env(name, value, fn, *args):
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn(*args)
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


@functools.lru_cache(maxsize=64)
def expected(ci: int, seed: int, activation: str, bias: bool):
    """(problem, generic direct output, REF, REF on bf16-rounded weights, TRUTH, bf16 experts on the rounded weights)
    of FP8_CASES[ci], computed once for all ISAs."""
    problem = fp8_problem(ci, seed, activation, bias)
    ex, hidden, ids, weights, skip, od, truth, biases = problem
    before = kn.isa()
    try:
        kn.set_isa("generic")
        base = with_env("KTINJECT_FP8_PATH", "direct", run, ex, hidden, ids, weights, skip, od)
    finally:
        kn.set_isa(before)
    mats = stored(ex)
    rounded = [tuple(m.bfloat16().float() for m in ms) for ms in mats]
    ref = reference(mats, biases, hidden, ids, weights, skip, "bf16", activation)
    ref_dq = reference(rounded, biases, hidden, ids, weights, skip, "bf16", activation)
    truth_ref = reference(truth, biases, hidden, ids, weights, skip, "bf16", activation, emulate=False)
    exb = kn.Experts(ex.num_experts, ex.hidden, ex.intermediate, activation=activation, bias=bias)
    for e, ms in enumerate(rounded):
        for which, m in zip(("gate", "up", "down"), ms):
            exb.set(e, which, m)
        if bias:
            for which, b in zip(("gate", "up", "down"), biases[e]):
                exb.set_bias(e, which, b)
    return problem, base, ref, ref_dq, truth_ref, exb


def check_forward(use_isa, monkeypatch, isa, path, ci, seed, activation="silu", bias=False):
    problem, base, ref, ref_dq, truth_ref, exb = expected(ci, seed, activation, bias)
    ex, hidden, ids, weights, skip, od, _, _ = problem
    monkeypatch.setenv("KTINJECT_FP8_PATH", path)
    use_isa(isa)
    out = run(ex, hidden, ids, weights, skip, od)
    if skip is not None and bool(skip.bool().all()):
        assert (out == 0).all()
        return
    e_ref, e_dq, e_truth = rel(out, ref), rel(out, ref_dq), rel(out, truth_ref)
    log.info("fp8 %s %s case %d T=%d: vs ref %.2e, vs bf16-rounded ref %.2e, vs truth %.3f", isa, path, ci,
             hidden.shape[0], e_ref, e_dq, e_truth)
    assert e_truth < TOL_TRUTH_FP8
    bf16_out = od == torch.bfloat16
    if path == "direct":
        assert e_ref < (TOL_REF_BF16 if bf16_out else TOL_REF_F32)
        assert torch.equal(out, base), f"direct path differs from generic: {rel(out, base):.3g}"
    elif path == "dequant":  # a bf16 forward of the rounded weights, on the same ISA: the same bits
        assert e_dq < (TOL_REF_BF16 if bf16_out else TOL_REF_DQ)
        assert torch.equal(out, run(exb, hidden, ids, weights, skip, od))
    else:  # per call, one of the two
        assert min(e_ref, e_dq) < (TOL_REF_BF16 if bf16_out else TOL_REF_DQ)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("path", ["direct", "dequant", "auto"])
@pytest.mark.parametrize("ci", range(len(FP8_CASES)))
def test_forward_silu(use_isa, monkeypatch, isa, path, ci):
    check_forward(use_isa, monkeypatch, isa, path, ci, 500 + ci)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("path", ["direct", "dequant"])
@pytest.mark.parametrize("ci", [0, 2, 4, 5])
def test_forward_gptoss_bias(use_isa, monkeypatch, isa, path, ci):
    check_forward(use_isa, monkeypatch, isa, path, ci, 600 + ci, "gptoss", True)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("ci", [0, 1, 2])
@pytest.mark.parametrize("pipe", ["0", "1"])
def test_decode_path_equals_item_path(use_isa, monkeypatch, isa, ci, pipe):
    """The gemv decode path (KTINJECT_GEMV=1, with and without the pipeline) gives the item path's bits: the gemv
    kernels are bit-identical to gemm with one row, the sums run in the same order. An expert with several rows
    (one_expert routing) mixes a gemm into the decode path."""
    (ex, hidden, ids, weights, skip, od, _, _), base = expected(ci, 500 + ci, "silu", False)[:2]
    use_isa(isa)
    monkeypatch.setenv("KTINJECT_PIPE", pipe)
    outs = []
    for gemv in ("0", "1"):
        monkeypatch.setenv("KTINJECT_GEMV", gemv)
        outs.append(run(ex, hidden, ids, weights, skip, od))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], base)
    if ex.num_experts < 4:
        return
    T = 3  # three tokens on expert 0 (a gemm in the decode path), each also on a one-row expert (gemv)
    ids3 = torch.stack([torch.zeros(T, dtype=torch.long), torch.arange(1, T + 1)], 1)
    x3 = torch.randn(T, ex.hidden, generator=torch.Generator().manual_seed(ci))
    w3 = torch.rand(T, 2, generator=torch.Generator().manual_seed(ci + 1))
    got = []
    for gemv in ("0", "1"):
        monkeypatch.setenv("KTINJECT_GEMV", gemv)
        got.append(run(ex, x3, ids3, w3, None, torch.float32))
    assert torch.equal(got[0], got[1])


def test_deterministic_across_thread_counts(monkeypatch):
    ex, hidden, ids, weights, skip, od, _, _ = fp8_problem(4, 7)
    for path in ("direct", "dequant"):
        monkeypatch.setenv("KTINJECT_FP8_PATH", path)
        outs = []
        for n in (1, 2, 3):
            with kn.Pool(n) as pool:
                outs.append(run(ex, hidden, ids, weights, skip, od, pool=pool))
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), path


def test_set_fp8_forward_matches_set_of_the_same_values():
    """Blocks whose largest value is 448 * scale: set() recovers the release's bits and scales exactly."""
    E, H, I, G, BR = 2, 128, 64, 64, 32
    a, b = (kn.Experts(E, H, I, quant="fp8", group_size=G, block_rows=BR) for _ in range(2))
    gen = torch.Generator().manual_seed(9)
    for e in range(E):
        for which in ("gate", "up", "down"):
            N, K = a.shape(which)
            q = random_fp8(N, K, gen)
            q[::BR, ::G] = 0x7E  # 448 in every block
            scale = torch.exp2(torch.randint(-12, -4, (N // BR, K // G), generator=gen).float())
            a.set_fp8(e, which, q, scale)
            b.set(e, which, q.view(F8).float() * blocks_of(scale, N, K, G, BR))
    assert torch.equal(a.export(), b.export())


# ---- sizes, export/import, repr ----
@pytest.mark.parametrize("G, BR", [(128, 128), (32, 16), (48, 64), (512, 16)])
def test_packed_nbytes_and_roundtrip(G, BR):
    for E, H, I in ((1, 1, 1), (3, 37, 19), (2, 2048, 768), (5, 100, 129), (2, 130, 257)):
        for bias in (False, True):
            ex = kn.Experts(E, H, I, quant="fp8", group_size=G, block_rows=BR, bias=bias)
            assert ex.nbytes == kn.Experts.packed_nbytes(E, H, I, "fp8", bias, group_size=G) == ex.export().numel()
    # 2048 x 768 with 128 x 128 blocks: a byte per weight + a float per 16 x 128 weights (no padding there)
    assert kn.Experts.packed_nbytes(1, 2048, 768, "fp8") * 8 == 3 * 2048 * 768 * (8 + 32 / (16 * 128))
    ex, hidden, ids, weights, skip, od, _, _ = fp8_problem(2, 12, "gptoss", True)
    ex2 = kn.Experts(ex.num_experts, ex.hidden, ex.intermediate, quant="fp8", group_size=ex.group_size,
                     block_rows=ex.block_rows, activation="gptoss", bias=True)
    ex2.load_packed(ex.export())
    assert torch.equal(run(ex, hidden, ids, weights, skip, od), run(ex2, hidden, ids, weights, skip, od))
    assert "quant='fp8', group_size=128, block_rows=16" in repr(ex2)
    assert (ex2.group_size, ex2.block_rows) == (128, 16)
    assert (kn.Experts(1, 8, 8, quant="fp8").group_size, kn.Experts(1, 8, 8, quant="fp8").block_rows) == (128, 128)


def test_from_hf_fp8():
    E, H, I = 3, 96, 40
    gen = torch.Generator().manual_seed(5)
    gate_up, down = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    ex = kn.Experts.from_hf(gate_up, down, quant="fp8", group_size=32, block_rows=16)
    q, s = quant_fp8(down[1], 32, 16)
    assert torch.equal(ex.get(1, "down"), q.float() * blocks_of(s, H, I, 32, 16))


# ---- errors ----
def expect(code: int, match: str, fn, *a, **kw):
    with pytest.raises(kn.NativeError, match=match) as err:
        fn(*a, **kw)
    assert err.value.code == code, err.value


def test_set_fp8_errors():
    ex = kn.Experts(2, 64, 40, quant="fp8", group_size=32, block_rows=16)
    N, K = ex.shape("gate")  # [40, 64]: scales [3, 2]
    q = torch.full((N, K), 0x38, dtype=torch.uint8)  # 1.0
    ex.set_fp8(0, "gate", q, torch.ones(3, 2))
    before = ex.export()
    for code in (0x7F, 0xFF):
        bad = q.clone()
        bad[3, 5] = code
        expect(kn.ERR_RANGE, rf"q\[3\]\[5\] = 0x{code:02x} is a NaN code of float8 e4m3 \(expert 0, matrix 0\)",
               ex.set_fp8, 0, "gate", bad, torch.full((3, 2), 2.0))
    for v in (float("nan"), float("inf"), -float("inf")):
        s = torch.ones(3, 2)
        s[2, 1] = v
        expect(kn.ERR_RANGE, r"scale of block \(2, 1\) \(rows 32\.\., inputs 32\.\.\) is .* \(expert 0, matrix 0\)",
               ex.set_fp8, 0, "gate", q, s)
    assert torch.equal(ex.export(), before)  # nothing stored by the refused calls
    s = torch.ones(4, 2)
    s[3, 0] = float("nan")  # down [64, 40]: 4 x 2 blocks
    expect(kn.ERR_RANGE, r"scale of block \(3, 0\) \(rows 48\.\., inputs 0\.\.\) is nan \(expert 1, matrix 2\)",
           ex.set_fp8, 1, "down", torch.zeros(64, 40, dtype=torch.uint8), s)
    expect(kn.ERR_SHAPE, r"gate scales of expert 0: expected shape \[3, 2\], got \[40, 2\]", ex.set_fp8, 0, "gate", q,
           torch.ones(N, 2))
    expect(kn.ERR_DTYPE, r"gate values of expert 0: dtype int8 is not supported \(expected uint8, float8_e4m3fn\)",
           ex.set_fp8, 0, "gate", q.view(torch.int8), torch.ones(3, 2))
    expect(kn.ERR_DTYPE, "set_fp8: experts of quant 'int4'", kn.Experts(1, 64, 40, quant="int4").set_fp8, 0, "gate", q,
           torch.ones(3, 2))
    expect(kn.ERR_DTYPE, r"quantized values are stored only in int8 \(1\) or int4 \(2\) experts \(fp8 experts take "
           r"ktk_experts_set_fp8\)", ex.set_quantized, 0, "gate", q.view(torch.int8), torch.ones(N, 2))
    ffi, lib = kn._native()  # the C entry point checks on its own
    ex8 = kn.Experts(1, 64, 40, quant="int8")
    assert lib.ktk_experts_set_fp8(ex8._p, 0, 0, ffi.cast("uint8_t *", q.data_ptr()), 64, 1,
                                   ffi.cast("float *", torch.ones(3, 2).data_ptr()), 2, 1) == kn.ERR_DTYPE
    assert "float8 e4m3 values are stored only in fp8 (3) experts" in ffi.string(lib.ktk_last_error()).decode()


def test_config_errors():
    expect(kn.ERR_SHAPE, r"group_size = 40 \(expected a multiple of 16 from 16 to 512: fp8 inputs per scale\)",
           kn.Experts, 2, 8, 8, quant="fp8", group_size=40)
    expect(kn.ERR_SHAPE, "group_size = 1024", kn.Experts, 2, 8, 8, quant="fp8", group_size=1024)
    expect(kn.ERR_SHAPE, r"block_rows = 24 \(expected a multiple of 16 from 16 to 1048576: fp8 output rows",
           kn.Experts, 2, 8, 8, quant="fp8", block_rows=24)
    expect(kn.ERR_SHAPE, "block_rows = 0", kn.Experts, 2, 8, 8, quant="fp8", block_rows=0)
    expect(kn.ERR_SHAPE, "block_rows = 128: only fp8 experts have block scales", kn.Experts, 2, 8, 8, quant="int4",
           block_rows=128)
    expect(kn.ERR_SHAPE, "group_size = 40", kn.Experts.packed_nbytes, 2, 8, 8, "fp8", group_size=40)
    ffi, lib = kn._native()
    out = ffi.new("ktk_experts **")
    for quant, group, rows, code, msg in (
            (3, 520, 0, kn.ERR_SHAPE, "group_size = 520 for fp8 (expected inputs per scale, a multiple of 16 up "),
            (3, 40, 0, kn.ERR_SHAPE, "group_size = 40 for fp8"),
            (3, 128, 8, kn.ERR_SHAPE, "block_rows = 8 for fp8 (expected output rows per scale, a multiple of 16"),
            (3, 128, -16, kn.ERR_SHAPE, "block_rows = -16 for fp8"),
            (0, 0, 16, kn.ERR_SHAPE, "block_rows = 16 (only fp8 experts have block scales; expected 0)"),
            (2, 64, 128, kn.ERR_SHAPE, "block_rows = 128 (only fp8"),
            (5, 0, 0, kn.ERR_DTYPE, "KTK_QUANT_FP8=3 or KTK_QUANT_MXFP4=4")):
        cfg = ffi.new("ktk_experts_config *", {"num_experts": 2, "hidden": 8, "intermediate": 8, "quant": quant,
                                               "group_size": group, "block_rows": rows})
        assert lib.ktk_experts_create(cfg, out) == code and out[0] == ffi.NULL
        assert msg in ffi.string(lib.ktk_last_error()).decode()
    cfg = ffi.new("ktk_experts_config *", {"num_experts": 2, "hidden": 8, "intermediate": 8, "quant": 3})
    assert lib.ktk_experts_create(cfg, out) == kn.OK  # group_size, block_rows 0: the defaults 128
    lib.ktk_experts_destroy(out[0])


def test_bad_path_env(monkeypatch):
    ex, hidden, ids, weights, *_ = fp8_problem(0, 13)
    monkeypatch.setenv("KTINJECT_FP8_PATH", "fast")
    expect(kn.ERR_SHAPE, "KTINJECT_FP8_PATH=fast: expected auto, direct or dequant", ex, hidden, ids, weights)
