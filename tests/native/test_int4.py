"""int4 (W4A8) experts: quantization, both kernel paths on every ISA here, against float64 references; errors.

Legend: T tokens, k experts per token, E experts, H hidden, I expert intermediate, G int4 group size (inputs per
scale). Errors are relative Frobenius errors ||out - ref|| / ||ref|| (``rel`` of test_native).

Paths (KTINJECT_INT4_PATH, read at each forward): ``direct`` runs the int4 x int8 kernels (per group an exact int32
dot product, then fma with the group's scale: bit-identical on every ISA, so the whole forward is too); ``dequant``
rounds the weights of the called blocks to bf16 and runs the ISA's bf16 kernel (AMX-BF16 on AMX machines);
``auto`` picks by rows per call (direct below the ISA's threshold; on AVX-512 without AMX always direct).

Tolerances (measured maxima over the cases below in brackets):
- REF (as test_native): float64 on the stored weights ex.get() (direct) or on them rounded to bf16 (dequant), with
  x and h quantized per row to int8 exactly as the library does: fp32 accumulation and rare flips of an h element
  at an int8 rounding boundary remain: TOL_REF_F32 = 1e-4 [6.9e-7], bf16 output TOL_REF_BF16 = 2^-9 + 5e-4
  [1.7e-3].
- TRUTH: float64 on the unquantized weights and activations. int4 rounding: the step is |m| / 8 for m the group's
  value of largest magnitude (~2.4 sigma for G = 64 Gaussian weights), uniform noise step / sqrt(12) ~ 8.7% of
  the weights' rms per matrix, ~7.9% (G = 32) to ~9.4% (G = 128); three matrices in a row add in quadrature
  to ~15%, int8 activations ~1%: TOL_TRUTH_INT4 = 0.3 [0.20, on the smallest case: H 37, I 19, G 32]. A wrong
  scale, group or nibble order gives errors near 100%.
- ISA vs generic: direct path bit-identical; dequant path only the fp32 summation order of the bf16 kernels:
  TOL_ISA_F32 = 1e-4, TOL_ISA_BF16 = 1e-3 (as test_native).
"""
from __future__ import annotations

import functools
import logging
import os
from types import SimpleNamespace

import pytest
import torch

from ktinject import native as kn
from tests.native.test_native import (ISAS, TOL_ISA_BF16, TOL_ISA_F32, TOL_REF_BF16, TOL_REF_F32, make_problem, reference, rel,
                         run, stored, use_isa)  # noqa: F401, F811  (use_isa is a fixture of test_native)

log = logging.getLogger(__name__)

TOL_TRUTH_INT4 = 0.3

INT4_CASES = [  # E, H, I, T, k, routing, skip, hidden dtype, weights dtype, out dtype, weight src dtype; G
    ((1, 37, 19, 1, 1, "random", None, "f32", "f32", "f32", "f32"), 32),          # one token, H, I < G
    ((8, 130, 72, 1, 8, "random", None, "bf16", "bf16", "bf16", "bf16"), 64),     # decode: one token, k = 8
    ((16, 200, 100, 7, 4, "random", "some", "f32", "bf16", "f32", "bf16"), 128),  # H, I not multiples of G
    ((300, 40, 24, 64, 8, "random", "some", "bf16", "f32", "f32", "f32"), 64),    # most experts without tokens
    ((12, 96, 80, 600, 2, "random", None, "f16", "f32", "f32", "f16"), 64),       # many rows per expert
    ((10, 72, 33, 300, 3, "one_expert", None, "bf16", "bf16", "bf16", "bf16"), 32),  # one expert has every token
    ((6, 64, 64, 20, 2, "random", "all", "f32", "f32", "f32", "f32"), 64),        # everything skipped
]


def quant_int4(w: torch.Tensor, G: int) -> torch.Tensor:
    """Group-wise int4 quantize + dequantize of [N, K] as the library does, float32: per (row, group of G inputs),
    m = the first value of largest magnitude, scale = -m / 8, q = round_half_even(w / scale) clamped to [-8, 7]."""
    w = w.float()
    N, K = w.shape
    Kp = -(-K // G) * G
    wp = torch.zeros(N, Kp).index_copy_(1, torch.arange(K), w).view(N, Kp // G, G)
    m = wp.gather(2, wp.abs().argmax(2, keepdim=True))  # [N, ng, 1]
    s = -m / 8
    q = torch.where(s != 0, torch.round(wp / torch.where(s != 0, s, 1)).clamp(-8, 7), 0)
    return (q * s).view(N, Kp)[:, :K]


def int4_problem(case, G, seed, activation="silu", bias=False):
    """make_problem with int4 experts of group size G (same weights and inputs as test_native's problems)."""
    ex8, hidden, ids, weights, skip, od, truth, biases = make_problem(case, seed, "bf16", activation, bias)
    E, H, I = ex8.num_experts, ex8.hidden, ex8.intermediate
    ex = kn.Experts(E, H, I, quant="int4", group_size=G, activation=activation, bias=bias)
    for e, mats in enumerate(truth):
        for which, m in zip(("gate", "up", "down"), mats):
            ex.set(e, which, m)
        if bias:
            for which, b in zip(("gate", "up", "down"), biases[e]):
                ex.set_bias(e, which, b)
    return ex, hidden, ids, weights, skip, od, truth, biases


def bf16_rounded(mats):
    return [tuple(m.bfloat16().float() for m in ms) for ms in mats]


@functools.lru_cache(maxsize=64)
def expected(ci: int, seed: int, path: str, activation: str, bias: bool):
    """(problem, generic output, REF, TRUTH) of INT4_CASES[ci], computed once for all ISAs."""
    case, G = INT4_CASES[ci]
    problem = int4_problem(case, G, seed, activation, bias)
    ex, hidden, ids, weights, skip, od, truth, biases = problem
    before, env = kn.isa(), os.environ.get("KTINJECT_INT4_PATH")
    os.environ["KTINJECT_INT4_PATH"] = path
    try:
        kn.set_isa("generic")
        base = run(ex, hidden, ids, weights, skip, od)
    finally:
        kn.set_isa(before)
        if env is None:
            del os.environ["KTINJECT_INT4_PATH"]
        else:
            os.environ["KTINJECT_INT4_PATH"] = env
    mats = stored(ex) if path != "dequant" else bf16_rounded(stored(ex))
    ref = reference(mats, biases, hidden, ids, weights, skip, "int8", activation)  # int8: x, h per row
    truth_ref = reference(truth, biases, hidden, ids, weights, skip, "int8", activation, emulate=False)
    return problem, base, ref, truth_ref


def check_forward(use_isa, monkeypatch, isa, path, ci, seed, activation="silu", bias=False):
    problem, base, ref, truth_ref = expected(ci, seed, path, activation, bias)
    ex, hidden, ids, weights, skip, od, _, _ = problem
    monkeypatch.setenv("KTINJECT_INT4_PATH", path)
    use_isa(isa)
    out = run(ex, hidden, ids, weights, skip, od)
    if skip is not None and bool(skip.bool().all()):
        assert (out == 0).all()
        return
    e_ref, e_truth, e_isa = rel(out, ref), rel(out, truth_ref), rel(out, base)
    log.info("int4 %s %s case %d T=%d: vs ref %.2e, vs truth %.3f, vs generic %.2e", isa, path, ci, hidden.shape[0],
             e_ref, e_truth, e_isa)
    assert e_ref < (TOL_REF_F32 if od == torch.float32 else TOL_REF_BF16)
    assert e_truth < TOL_TRUTH_INT4
    if path != "dequant":
        assert torch.equal(out, base), f"direct path differs from generic: {e_isa:.3g}"
    else:
        assert e_isa < (TOL_ISA_F32 if od == torch.float32 else TOL_ISA_BF16)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("path", ["direct", "dequant"])
@pytest.mark.parametrize("ci", range(len(INT4_CASES)))
def test_forward_silu(use_isa, monkeypatch, isa, path, ci):
    check_forward(use_isa, monkeypatch, isa, path, ci, 300 + ci)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("ci", [1, 4, 5])
def test_forward_auto_path(use_isa, monkeypatch, isa, ci):
    """The ISA's own choice per call (the dequantizing path above its row threshold, e.g. on AMX): the result is
    one of the two paths' (direct on the exact stored weights, or dequantized on them rounded to bf16)."""
    (ex, hidden, ids, weights, skip, od, _, _), _, ref_direct, _ = expected(ci, 300 + ci, "direct", "silu", False)
    ref_dequant = expected(ci, 300 + ci, "dequant", "silu", False)[2]  # the same problem (same seed)
    monkeypatch.delenv("KTINJECT_INT4_PATH", raising=False)
    use_isa(isa)
    out = run(ex, hidden, ids, weights, skip, od)
    assert min(rel(out, ref_direct), rel(out, ref_dequant)) < (TOL_REF_F32 if od == torch.float32 else TOL_REF_BF16)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("path", ["direct", "dequant"])
@pytest.mark.parametrize("ci", [0, 2, 4])
def test_forward_gptoss_bias(use_isa, monkeypatch, isa, path, ci):
    check_forward(use_isa, monkeypatch, isa, path, ci, 400 + ci, "gptoss", True)


def test_deterministic_across_thread_counts(monkeypatch):
    """Both paths: results do not depend on the number of threads (bitwise)."""
    case, G = INT4_CASES[4]
    ex, hidden, ids, weights, skip, od, _, _ = int4_problem(case, G, 7)
    for path in ("direct", "dequant"):
        monkeypatch.setenv("KTINJECT_INT4_PATH", path)
        outs = []
        for n in (1, 2, 3):
            with kn.Pool(n) as pool:
                outs.append(run(ex, hidden, ids, weights, skip, od, pool=pool))
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), path


# ---- quantization ----
@pytest.mark.parametrize("G", [32, 64, 128])
def test_weights_group_wise(G):
    """ex.get() is q * scale exactly as quant_int4 computes it; |w - q * scale| <= |scale| / 2 except for values of
    the opposite sign to the group's largest, above 15/16 of it (clamped to q = 7: error < |scale|)."""
    N, K = 40, 3 * G + 21  # K not a multiple of G: the last group is partial (zero-padded)
    w = torch.randn(N, K) * torch.logspace(-3, 2, N)[:, None]
    w[3, :G] = 0.0  # an all-zero group
    w[5, 7] = -w[5, :G].abs().max() * 1.0001  # a group whose largest value is negative
    w[6, 2] = w[6, :G].abs().max() * 1.01
    w[6, 9] = -w[6, 2]  # equal magnitudes, opposite signs: the first one is m, the other clamps to 7
    ex = kn.Experts(1, K, N, quant="int4", group_size=G)
    ex.set(0, "gate", w)
    got = ex.get(0, "gate")
    assert torch.equal(got, quant_int4(w, G))
    assert (got[3, :G] == 0).all()
    Kp = -(-K // G) * G
    wp = torch.zeros(N, Kp)
    wp[:, :K] = w
    step = wp.view(N, -1, G).abs().amax(2, keepdim=True).expand(N, Kp // G, G).reshape(N, Kp)[:, :K] / 8
    err = (got - w).abs()
    assert (err <= step * 1.0001).all() and (err <= step / 2 * 1.0001).float().mean() > 0.99
    assert got[6, 2] == w[6, 2] and abs(got[6, 9] - 7 * w[6, 9] / 8) < 1e-6 * abs(w[6, 9])
    # bf16 / f16 sources and strided views give the same packing as float32
    ex2 = kn.Experts(1, K, N, quant="int4", group_size=G)
    ex2.set(0, "gate", w.t().contiguous().t().bfloat16())
    assert torch.equal(ex2.get(0, "gate"), quant_int4(w.bfloat16(), G))


def test_non_finite_weights_and_overwrite():
    w = torch.randn(16, 64)
    ex = kn.Experts(1, 64, 16, quant="int4", group_size=32)
    ex.set(0, "up", w)
    w2 = torch.randn(16, 64)  # a second set() overwrites every nibble and scale
    w2[1, 40] = float("inf")
    ex.set(0, "up", w2)
    got = ex.get(0, "up")
    assert torch.isnan(got[1, 32:]).all() and torch.equal(got[1, :32], quant_int4(w2[1:2, :32], 32)[0])
    assert torch.equal(got[2:], quant_int4(w2[2:], 32))


@torch.no_grad()
def test_int4_vs_bf16_output_error():
    """int4 forward against the bf16 forward of the same weights (decode and prefill shapes): relative error below
    INT4_VS_BF16 = 0.25. Why: int4 rounds each weight with uniform noise of rms step / sqrt(12), step = |m| / 8
    and |m| ~ 2.4 sigma for G = 64 Gaussian weights, i.e. ~8.7% of the weights' rms per matrix; gate and up errors
    reach h (~12%), down adds its own: ~15% in all [measured 0.13-0.16]; bf16 itself is ~0.5%. A wrong scale,
    group or nibble order gives ~100%. G = 32 must be more accurate than G = 128 (smaller groups, smaller |m|)."""
    E, H, I = 8, 256, 192
    g = torch.Generator().manual_seed(11)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5
    errs = {}
    for T in (1, 200):
        x = torch.randn(T, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(T)])
        w = torch.rand(T, 4, generator=g)
        ref = kn.Experts.from_hf(gate_up, down)(x, ids, w)
        for G in (32, 64, 128):
            errs[T, G] = rel(kn.Experts.from_hf(gate_up, down, quant="int4", group_size=G)(x, ids, w), ref)
    log.info("int4 vs bf16 relative error (T, G): %s", {k: round(v, 4) for k, v in errs.items()})
    assert all(e < 0.25 for e in errs.values())
    assert all(errs[T, 32] < errs[T, 128] for T in (1, 200))


# ---- sizes, export/import ----
@pytest.mark.parametrize("G", [32, 64, 128])
def test_packed_nbytes_and_roundtrip(G):
    for E, H, I in ((1, 1, 1), (3, 37, 19), (2, 2048, 768), (5, 100, 129), (2, 130, 257)):
        for bias in (False, True):
            ex = kn.Experts(E, H, I, quant="int4", group_size=G, activation="gptoss" if bias else "silu", bias=bias)
            assert ex.nbytes == kn.Experts.packed_nbytes(E, H, I, "int4", bias, group_size=G) == ex.export().numel()
    # 2048 x 768 at G = 64: half a byte per weight + a float per 64 weights = 4.5 bits (no padding there); the
    # default there is G = 128 (both sizes multiples of 128): 4.25 bits
    assert kn.Experts.packed_nbytes(1, 2048, 768, "int4", group_size=64) * 8 == 3 * 2048 * 768 * 4.5
    assert kn.Experts.packed_nbytes(1, 2048, 768, "int4") * 8 == 3 * 2048 * 768 * 4.25
    ex, hidden, ids, weights, skip, od, _, _ = int4_problem(INT4_CASES[2][0], G, 12, "gptoss", True)
    ex2 = kn.Experts(ex.num_experts, ex.hidden, ex.intermediate, quant="int4", group_size=G, activation="gptoss",
                     bias=True)
    ex2.load_packed(ex.export())
    assert torch.equal(run(ex, hidden, ids, weights, skip, od), run(ex2, hidden, ids, weights, skip, od))
    assert "group_size=%d" % G in repr(ex2)


@pytest.mark.parametrize("H, I, G", [(2048, 768, 128), (256, 128, 128), (192, 96, 64), (2880, 2880, 64),
                                     (128, 37, 64), (1, 1, 64)])
def test_default_group_size(H, I, G):
    """128 where both input sizes are multiples of 128, else 64; an explicit group size is kept."""
    assert kn.default_group_size(H, I) == G
    assert kn.Experts(1, H, I, quant="int4").group_size == G
    assert kn.Experts(1, H, I, quant="int4", group_size=32).group_size == 32
    assert kn.Experts.packed_nbytes(1, H, I, "int4") == kn.Experts.packed_nbytes(1, H, I, "int4", group_size=G)


def test_expert_stream_decides_the_group_once(monkeypatch):
    """A streamed block's group is fixed when its stream is made (the plan's bytes, the cache key and the experts
    agree whatever the environment does later); a given group is checked at once; bf16 / int8 have none."""
    import dataclasses

    from ktinject.operators.families import BlockSpec, ExpertStream

    spec = BlockSpec("gate", None, False, "hf", 4, 256, 128, True)
    s = ExpertStream(spec, "int4")
    monkeypatch.setenv("KTINJECT_INT4_GROUP", "32")
    assert s.group_size == 128 and s.new_experts(SimpleNamespace(experts=None)).group_size == 128
    assert s.nbytes == kn.Experts.packed_nbytes(4, 256, 128, "int4", group_size=128)
    assert ExpertStream(spec, "int4").group_size == 32  # a new stream reads it
    assert ExpertStream(spec, "bf16").group_size == 0
    assert dataclasses.replace(ExpertStream(spec, "bf16"), quant="int4").group_size == 32  # 0 carried over: decided
    with pytest.raises(kn.NativeError, match="group_size = 96"):
        ExpertStream(spec, "int4", 96)


def test_default_group_size_env(monkeypatch):
    monkeypatch.setenv("KTINJECT_INT4_GROUP", "64")
    assert kn.Experts(1, 2048, 768, quant="int4").group_size == 64
    assert kn.Experts(1, 2048, 768, quant="int4", group_size=128).group_size == 128
    monkeypatch.setenv("KTINJECT_INT4_GROUP", "100")
    expect(kn.ERR_SHAPE, r"KTINJECT_INT4_GROUP='100' \(expected one of 32, 64, 128", kn.Experts, 1, 256, 128,
           quant="int4")


def test_from_gpt_oss_int4():
    E, H, I = 4, 96, 40
    g = torch.Generator().manual_seed(5)
    gate_up, gub = torch.randn(E, H, 2 * I, generator=g) / H**0.5, torch.randn(E, 2 * I, generator=g)
    down, db = torch.randn(E, I, H, generator=g) / I**0.5, torch.randn(E, H, generator=g)
    ex = kn.Experts.from_gpt_oss(gate_up, gub, down, db, quant="int4", group_size=32)
    assert (ex.quant, ex.group_size, ex.activation, ex.bias) == ("int4", 32, "gptoss", True)
    assert torch.equal(ex.get(1, "gate"), quant_int4(gate_up[1, :, 0::2].t(), 32))
    assert torch.equal(ex.get(1, "down"), quant_int4(down[1].t(), 32))


# ---- errors ----
def expect(code: int, match: str, fn, *a, **kw):
    with pytest.raises(kn.NativeError, match=match) as err:
        fn(*a, **kw)
    assert err.value.code == code, err.value


def test_errors():
    expect(kn.ERR_SHAPE, r"group_size = 48 \(expected one of 32, 64, 128", kn.Experts, 2, 8, 8, quant="int4",
           group_size=48)
    expect(kn.ERR_SHAPE, "group_size = '64'", kn.Experts, 2, 8, 8, quant="int4", group_size="64")
    expect(kn.ERR_SHAPE, "group_size = 16", kn.Experts.packed_nbytes, 2, 8, 8, "int4", group_size=16)
    expect(kn.ERR_DTYPE, r"quant = 'int3' \(expected one of bf16, int8, int4, fp8, mxfp4\)", kn.Experts, 2, 8, 8,
           quant="int3")
    expect(kn.ERR_DTYPE, "quant = 'q4'.*bf16, int8, int4, fp8", kn.Experts.packed_nbytes, 2, 8, 8, "q4")
    ffi, lib = kn._native()  # the C API checks on its own
    out = ffi.new("ktk_experts **")
    for quant, group, code, msg in ((2, 48, kn.ERR_SHAPE, "group_size = 48 (expected 32, 64 or 128, or 0"),
                                    (0, -1, kn.ERR_SHAPE, "group_size = -1"),
                                    (5, 64, kn.ERR_DTYPE, "KTK_QUANT_FP8=3 or KTK_QUANT_MXFP4=4")):
        cfg = ffi.new("ktk_experts_config *", {"num_experts": 2, "hidden": 8, "intermediate": 8, "quant": quant,
                                               "group_size": group})
        assert lib.ktk_experts_create(cfg, out) == code and out[0] == ffi.NULL
        assert msg in ffi.string(lib.ktk_last_error()).decode()
    cfg = ffi.new("ktk_experts_config *", {"num_experts": 2, "hidden": 8, "intermediate": 8, "quant": 2})
    assert lib.ktk_experts_create(cfg, out) == kn.OK  # group_size 0: the default 64
    lib.ktk_experts_destroy(out[0])


def test_bad_path_env(monkeypatch):
    ex, hidden, ids, weights, skip, od, _, _ = int4_problem(INT4_CASES[0][0], 32, 13)
    monkeypatch.setenv("KTINJECT_INT4_PATH", "fast")
    expect(kn.ERR_SHAPE, "KTINJECT_INT4_PATH=fast: expected auto, direct or dequant", ex, hidden, ids, weights)
