"""mxfp4 (W4A16) experts through the Python bindings: a release's bytes kept bit for bit (set_mxfp4), floats
quantized per (row, group of 32) by set(), the forward on every ISA here against float64 torch, sizes, errors.

Legend: T tokens, k experts per token, E experts, H hidden, I expert intermediate. Errors are relative Frobenius
errors ||out - ref|| / ||ref|| (``rel``). An mxfp4 weight is e2m1 * 2^(e - 127): e2m1 codes (sign, 2 exponent
bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6) two to a byte, the lower input in the low nibble, and an e8m0
byte e per output row and 32 inputs.

Tolerances (measured maxima over the cases below in brackets):
- REF (as test_native's bf16): float64 on the stored weights ex.get(), x and h rounded to bf16 as the library does.
  The direct path sums x * e2m1 per group in float32, then times 2^(e - 127); the dequantizing path rounds the
  weights to bf16, which holds every e2m1 * 2^k exactly: both leave float32 accumulation and rare one-ulp flips of
  a bf16 h: TOL_REF_F32 = 1e-4 [7.4e-8], bf16 output TOL_REF_BF16 [1.7e-3].
- TRUTH: float64 on the unquantized weights: e2m1 keeps 2 significant bits under a power-of-two scale per 32
  inputs (a matrix's rms rounding error is ~10% of its rms value), three matrices in a row: ~0.2 [0.195] where many
  products average, more for one token through one small expert (case 0 [0.346]): TOL_TRUTH_MXFP4 = 0.5. A wrong
  nibble order, scale or row gives errors near 100% or more.
"""
from __future__ import annotations

import logging

import pytest
import torch

from ktinject import native as kn
from tests.native.test_native import (ISAS, TOL_REF_BF16, TOL_REF_F32, make_problem, reference, rel, run, stored,
                                      use_isa)  # noqa: F401, F811  (use_isa is a fixture of test_native)

log = logging.getLogger(__name__)

TOL_TRUTH_MXFP4 = 0.5
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=torch.float64)

CASES = [  # E, H, I, T, k, routing, skip, hidden dtype, weights dtype, out dtype, weight src dtype
    (1, 32, 32, 1, 1, "random", None, "f32", "f32", "f32", "f32"),             # one token, the smallest sizes
    (8, 96, 160, 1, 8, "random", None, "bf16", "bf16", "bf16", "bf16"),       # decode: k = 8, H, I not of 64
    (16, 160, 96, 7, 4, "random", "some", "f32", "bf16", "f32", "bf16"),      # skipped experts
    (300, 32, 96, 64, 8, "random", "some", "bf16", "f32", "f32", "f32"),      # most experts without tokens
    (12, 224, 32, 300, 2, "random", None, "f16", "f32", "f32", "f16"),        # many rows: the dequantizing path
    (10, 96, 224, 300, 3, "one_expert", None, "bf16", "bf16", "bf16", "bf16"),  # all tokens on one expert
    (6, 64, 64, 20, 2, "random", "all", "f32", "f32", "f32", "f32"),          # everything skipped
]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for name in ("KTINJECT_FP8_PATH", "KTINJECT_GEMV", "KTINJECT_PIPE"):
        monkeypatch.delenv(name, raising=False)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e2m1 * 2^(e - 127) in float64 of blocks uint8 [N, K/2] and scales uint8 [N, K/32] (the release's layout)."""
    N = blocks.shape[0]
    q = torch.stack([E2M1[(blocks & 0x0F).long()], E2M1[(blocks >> 4).long()]], -1).reshape(N, -1)
    return q * torch.exp2(scales.double() - 127).repeat_interleave(32, 1)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [N, K/2], scales uint8 [N, K/32]) as the header says ktk_experts_set quantizes, computed in
    float64: e = the smallest e8m0 exponent (>= 0) with amax <= 6 * 2^(e - 127) (127 for an all-zero group), the
    code nearest to w / 2^(e - 127), ties to the even code."""
    N, K = w.shape
    x = w.double().view(N, K // 32, 32)
    amax = x.abs().amax(-1)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6)) + 127, torch.full_like(amax, 127.0)).clamp(0, 254)
    e = torch.where((amax > 0) & (e > 0) & (amax <= 6 * torch.exp2(e - 128)), e - 1, e)  # log2's rounding
    e = torch.where(amax > 6 * torch.exp2(e - 127), e + 1, e)
    v = (x / torch.exp2(e - 127).unsqueeze(-1)).reshape(N, K)
    dist = (v.abs().unsqueeze(-1) - E2M1[:8]).abs()
    best = dist.min(-1, keepdim=True).values
    even = torch.arange(8) % 2 == 0
    code = torch.where((dist == best) & even, 0, torch.where(dist == best, 1, 2)).argmin(-1)  # a tie: the even code
    code = torch.where((v < 0) & (code > 0), code + 8, code)
    return (code[:, 0::2] | code[:, 1::2] << 4).to(torch.uint8), e.to(torch.uint8)


def random_release(N: int, K: int, gen: torch.Generator, lo: int = 0, hi: int = 255):
    """(blocks [N, K/2] with every byte value, scales [N, K/32] in lo..hi-1): a release's bytes."""
    blocks = torch.randint(0, 256, (N, K // 2), generator=gen, dtype=torch.uint8)
    return blocks, torch.randint(lo, hi, (N, K // 32), generator=gen, dtype=torch.uint8)


def raw_parts(ex: kn.Experts, e: int, which: str) -> tuple[torch.Tensor, torch.Tensor, kn.RawMatrix]:
    """(blocks [Np, Kp/2], scales [Np, Kp/32]) in the release's order, read back from ktk_experts_raw's layout."""
    raw = kn.experts_raw(ex, e, which)
    base, region = kn.experts_region_view(ex)
    data = region[raw.data - base:raw.data - base + raw.data_bytes]
    scale = region[raw.scale - base:raw.scale - base + raw.Np * raw.Kp // 32]
    # byte ((n/16)*(Kp/8) + c/8)*64 + (n%16)*4 + (c%8)/2: [Np/16][Kp/8][16][4] -> [Np][Kp/2]
    blocks = data.view(raw.Np // 16, raw.Kp // 8, 16, 4).permute(0, 2, 1, 3).reshape(raw.Np, raw.Kp // 2)
    scales = scale.view(raw.Np // 16, raw.Kp // 32, 16).permute(0, 2, 1).reshape(raw.Np, raw.Kp // 32)
    return blocks.clone(), scales.clone(), raw


# ---- set_mxfp4: the release's bytes ----
@pytest.mark.parametrize("H, I", [(32, 32), (96, 160), (224, 64)])
def test_set_mxfp4_keeps_the_bytes(H, I):
    ex = kn.Experts(3, H, I, quant="mxfp4", bias=True, activation="gptoss")
    gen = torch.Generator().manual_seed(H + I)
    for which in ("gate", "up", "down"):
        N, K = ex.shape(which)
        blocks, scales = random_release(N, K, gen)
        src_b, src_s = blocks, scales
        if which == "up":  # the torch dtypes of the release's tensors
            src_b, src_s = blocks.view(torch.float4_e2m1fn_x2), scales.view(torch.float8_e8m0fnu)
        if which == "down":  # every other row of a larger tensor (a fused gate_up's gate): rows strided
            big_b, big_s = torch.zeros(2 * N, K // 2, dtype=torch.uint8), torch.zeros(2 * N, K // 32, dtype=torch.uint8)
            big_b[0::2], big_s[0::2] = blocks, scales
            src_b, src_s = big_b[0::2], big_s[0::2]
        ex.set_mxfp4(1, which, src_b, src_s)
        got_b, got_s, raw = raw_parts(ex, 1, which)
        assert (raw.quant, raw.N, raw.K, raw.Np, raw.Kp) == ("mxfp4", N, K, -(-N // 16) * 16, -(-K // 64) * 64)
        assert raw.data_bytes == raw.Np * raw.Kp // 2
        assert torch.equal(got_b[:N, :K // 2], blocks) and torch.equal(got_s[:N, :K // 32], scales)
        assert not got_b[N:].any() and not got_b[:, K // 2:].any() and not got_s[N:].any() and not got_s[:, K // 32:].any()
        assert torch.equal(ex.get(1, which), dequantize(blocks, scales).float())  # e2m1 * 2^(e - 127), exact
    assert not ex.get(0, "gate").any() and not ex.get(2, "down").any()  # other experts untouched


def test_set_mxfp4_extreme_exponents_read_back_exactly():
    ex = kn.Experts(1, 64, 32, quant="mxfp4")
    blocks = torch.full((32, 32), 0x71, dtype=torch.uint8)  # 0.5 (low nibble) and 6 (high)
    scales = torch.tensor([0, 254], dtype=torch.uint8).repeat(32, 1)  # 2^-127 (float32 subnormal) and 2^127
    ex.set_mxfp4(0, "gate", blocks, scales)
    got = ex.get(0, "gate")
    assert got[0, 0] == 2.0**-128 and got[0, 1] == 6 * 2.0**-127 and got[0, 33] == 6 * 2.0**127
    assert torch.equal(got, dequantize(blocks, scales).float())


def test_set_mxfp4_nan_scale_is_refused_and_nothing_stored():
    ex = kn.Experts(2, 64, 32, quant="mxfp4")
    gen = torch.Generator().manual_seed(1)
    blocks, scales = random_release(32, 64, gen, 100, 140)
    ex.set_mxfp4(0, "gate", blocks, scales)
    before = ex.get(0, "gate")
    bad = scales.clone()
    bad[5, 1] = 255
    with pytest.raises(kn.NativeError, match=r"row 5, group 1.*0xff") as e:
        ex.set_mxfp4(0, "gate", torch.zeros_like(blocks), bad)
    assert e.value.code == kn.ERR_RANGE
    assert torch.equal(ex.get(0, "gate"), before)


# ---- set: quantized per (row, group of 32) ----
def test_set_quantizes_as_the_header_says():
    N, K = 64, 160
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(N, K, generator=gen) * torch.logspace(-30, 30, N)[:, None]  # exponents far from 127
    w[0, :32] = 0.0  # an all-zero group: e 127
    # ties between codes (scale 1: amax 6), each to the even code, and the boundaries of every code
    w[1, :32] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, -2.5, 0.26, 0.74, 4.9,
                              5.1, -6.0, -0.0, 1e-9, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 2.4, 2.6, 3.4, 3.6, 1.3, 1.7, 0.1])
    w[2, 32:64] = 6.0 * 2.0**-20  # amax exactly 6 * 2^(e - 127): e = 107, every code 6
    w[3, 64:96] = torch.linspace(-1, 1, 32) * 6.0 * 2.0**-20 * (1 + 2**-20)  # just above: e = 108
    for src in (w, w.t().contiguous().t(), w.bfloat16(), w.clamp(-6e4, 6e4).half()):
        ex = kn.Experts(1, K, N, quant="mxfp4")
        ex.set(0, "gate", src)
        blocks, scales = quantize(src.float())
        got_b, got_s, _ = raw_parts(ex, 0, "gate")
        assert torch.equal(got_s[:N, :K // 32], scales)
        assert torch.equal(got_b[:N, :K // 2], blocks)
        assert torch.equal(ex.get(0, "gate"), dequantize(blocks, scales).float())
    blocks, scales = quantize(w)
    assert scales[0, 0] == 127 and scales[1, 0] == 127 and scales[2, 1] == 107 and scales[3, 2] == 108
    codes = [int(b) >> (4 * (c % 2)) & 15 for c, b in zip(range(16), blocks[1, :8].repeat_interleave(2))]
    assert codes == [7, 0, 2, 2, 4, 4, 6, 6, 0, 10, 14, 12, 1, 1, 6, 7]


def test_set_refuses_non_finite_weights():
    ex = kn.Experts(1, 64, 32, quant="mxfp4")
    w = torch.randn(32, 64)
    w[3, 40] = float("nan")
    with pytest.raises(kn.NativeError, match=r"\[3\]\[40\]") as e:
        ex.set(0, "up", w)
    assert e.value.code == kn.ERR_RANGE and not ex.get(0, "up").any()


# ---- forward ----
def mxfp4_problem(ci, seed, activation="silu", bias=False):
    """make_problem with mxfp4 experts: the same weights and inputs as test_native's, quantized by set()."""
    case = CASES[ci]
    _, hidden, ids, weights, skip, od, truth, biases = make_problem(case, seed, "bf16", activation, bias)
    E, H, I = case[:3]
    ex = kn.Experts(E, H, I, quant="mxfp4", activation=activation, bias=bias)
    for e, mats in enumerate(truth):
        for which, m in zip(("gate", "up", "down"), mats):
            ex.set(e, which, m)
        if bias:
            for which, b in zip(("gate", "up", "down"), biases[e]):
                ex.set_bias(e, which, b)
    return ex, hidden, ids, weights, skip, od, truth, biases


_EXPECTED: dict = {}


def expected(ci, seed, activation="silu", bias=False):
    """(problem, REF, TRUTH) of CASES[ci], once for all ISAs and paths."""
    key = (ci, seed, activation, bias)
    if key not in _EXPECTED:
        problem = mxfp4_problem(ci, seed, activation, bias)
        ex, hidden, ids, weights, skip, od, truth, biases = problem
        ref = reference(stored(ex), biases, hidden, ids, weights, skip, "bf16", activation)
        truth_ref = reference(truth, biases, hidden, ids, weights, skip, "bf16", activation, emulate=False)
        _EXPECTED[key] = problem, ref, truth_ref
    return _EXPECTED[key]


def check_forward(use_isa, monkeypatch, isa, path, ci, seed, activation="silu", bias=False):
    (ex, hidden, ids, weights, skip, od, _, _), ref, truth_ref = expected(ci, seed, activation, bias)
    monkeypatch.setenv("KTINJECT_FP8_PATH", path)  # mxfp4 takes fp8's path switch
    use_isa(isa)
    out = run(ex, hidden, ids, weights, skip, od)
    if skip is not None and bool(skip.bool().all()):
        assert (out == 0).all()
        return out
    e_ref, e_truth = rel(out, ref), rel(out, truth_ref)
    log.info("mxfp4 %s %s case %d T=%d: vs ref %.2e, vs truth %.3f", isa, path, ci, hidden.shape[0], e_ref, e_truth)
    assert e_ref < (TOL_REF_BF16 if od == torch.bfloat16 else TOL_REF_F32)
    assert e_truth < TOL_TRUTH_MXFP4
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("path", ["direct", "dequant", "auto"])
@pytest.mark.parametrize("ci", range(len(CASES)))
def test_forward_silu(use_isa, monkeypatch, isa, path, ci):
    check_forward(use_isa, monkeypatch, isa, path, ci, 700 + ci)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("path", ["direct", "dequant"])
@pytest.mark.parametrize("ci", [0, 2, 4, 5])
def test_forward_gptoss_bias(use_isa, monkeypatch, isa, path, ci):
    check_forward(use_isa, monkeypatch, isa, path, ci, 800 + ci, "gptoss", True)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("ci", [0, 1, 2])
def test_decode_path_equals_item_path(use_isa, monkeypatch, isa, ci):
    """The gemv decode path (KTINJECT_GEMV=1) gives the item path's bits."""
    (ex, hidden, ids, weights, skip, od, _, _), _, _ = expected(ci, 700 + ci)
    use_isa(isa)
    monkeypatch.setenv("KTINJECT_FP8_PATH", "direct")
    outs = []
    for gemv in ("0", "1"):
        monkeypatch.setenv("KTINJECT_GEMV", gemv)
        outs.append(run(ex, hidden, ids, weights, skip, od))
    assert torch.equal(outs[0], outs[1])


def test_set_mxfp4_forward_equals_set_of_the_same_values():
    """A release's bytes through set_mxfp4 and their float values through set() store the same bits (the values'
    groups reach 6 * 2^(e - 127), so set() picks the release's exponents; -0, code 8, becomes +0, code 0, in set(),
    so none is used here), hence the same forward."""
    E, H, I = 3, 96, 64
    a, b = (kn.Experts(E, H, I, quant="mxfp4") for _ in range(2))
    gen = torch.Generator().manual_seed(12)
    for e in range(E):
        for which in ("gate", "up", "down"):
            N, K = a.shape(which)
            blocks, scales = random_release(N, K, gen, 120, 130)
            blocks.view(N, K // 32, 16)[:, :, 0] = 0x77  # 6 in each group: its largest value
            blocks = torch.where(blocks & 0x0F == 8, blocks & 0xF0, blocks)
            blocks = torch.where(blocks >> 4 == 8, blocks & 0x0F, blocks)
            a.set_mxfp4(e, which, blocks, scales)
            b.set(e, which, dequantize(blocks, scales).float())
            assert torch.equal(raw_parts(a, e, which)[0], raw_parts(b, e, which)[0])
    x = torch.randn(5, H, generator=gen)
    ids = torch.tensor([[0, 1], [2, 0], [1, 1], [0, 2], [2, 1]])
    w = torch.rand(5, 2, generator=gen)
    assert torch.equal(a(x, ids, w), b(x, ids, w))


def test_from_gpt_oss_and_from_hf_take_mxfp4():
    E, H, I = 4, 64, 96
    gen = torch.Generator().manual_seed(2)
    gate_up, down = torch.randn(E, H, 2 * I, generator=gen), torch.randn(E, I, H, generator=gen)
    ex = kn.Experts.from_gpt_oss(gate_up, torch.randn(E, 2 * I, generator=gen), down, torch.randn(E, H), quant="mxfp4")
    assert ex.quant == "mxfp4" and ex.group_size == 32
    assert torch.equal(ex.get(2, "up"), dequantize(*quantize(gate_up[2, :, 1::2].t())).float())
    hf = kn.Experts.from_hf(gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous(), quant="mxfp4")
    assert torch.equal(hf.get(3, "down"), dequantize(*quantize(down[3].t())).float())


def test_backward_on_the_stored_values():
    """ktk_backward of mxfp4 experts: float64 autograd through the forward on the stored (dequantized) weights."""
    (ex, hidden, ids, weights, skip, _, _, _), _, _ = expected(2, 700 + 2)
    dy = torch.randn(hidden.shape[0], ex.hidden, generator=torch.Generator().manual_seed(5))
    dx, dw = ex.backward(hidden.float(), ids, weights.float(), dy, skip=skip)
    x = hidden.double().requires_grad_()
    w = weights.double().requires_grad_()
    out = reference(stored(ex), None, x, ids, w, skip, "bf16", emulate=False)
    (out * dy.double()).sum().backward()
    assert rel(dx, x.grad) < 1e-5 and rel(dw, w.grad) < 1e-5


# ---- sizes ----
@pytest.mark.parametrize("bias", [False, True])
def test_packed_nbytes_and_export_import(bias):
    for E, H, I in ((1, 32, 32), (3, 96, 160), (2, 2880, 2880), (5, 224, 32), (7, 32, 1056)):
        ex = kn.Experts(E, H, I, quant="mxfp4", activation="gptoss" if bias else "silu", bias=bias)
        assert ex.nbytes == kn.Experts.packed_nbytes(E, H, I, "mxfp4", bias) == ex.export().numel(), (E, H, I)
        assert kn.Experts.packed_nbytes(E, H, I, "mxfp4", bias, group_size=32) == ex.nbytes
    ex, hidden, ids, weights, skip, od, _, _ = mxfp4_problem(2, 3, "gptoss", True)
    ex2 = kn.Experts(ex.num_experts, ex.hidden, ex.intermediate, quant="mxfp4", activation="gptoss", bias=True)
    ex2.load_packed(ex.export())
    assert torch.equal(run(ex, hidden, ids, weights, skip, od), run(ex2, hidden, ids, weights, skip, od))
    assert "quant='mxfp4', group_size=32" in repr(ex2)
    # 4.25 bits a weight (plus padding to 16 rows x 64 inputs): half the bytes of fp8 at these sizes, and some
    assert kn.Experts.packed_nbytes(8, 2880, 2880, "mxfp4") * 8 / (8 * 3 * 2880 * 2880) < 4.3


# ---- errors ----
def test_bad_configs_are_named():
    for kw, code, what in ((dict(group_size=64), kn.ERR_SHAPE, r"group_size = 64 for mxfp4.*pass 32 or None"),
                           (dict(hidden=48), kn.ERR_SHAPE, r"hidden = 48, intermediate = 64: mxfp4 .*multiples of 32"),
                           (dict(intermediate=80), kn.ERR_SHAPE, r"intermediate = 80: mxfp4"),
                           (dict(block_rows=16), kn.ERR_SHAPE, r"block_rows = 16: only fp8")):
        args = dict(hidden=64, intermediate=64) | kw
        with pytest.raises(kn.NativeError, match=what) as e:
            kn.Experts(2, args.pop("hidden"), args.pop("intermediate"), quant="mxfp4", **args)
        assert e.value.code == code
        if "block_rows" in kw:  # (packed_nbytes takes none)
            continue
        with pytest.raises(kn.NativeError, match=what):
            kn.Experts.packed_nbytes(2, kw.get("hidden", 64), kw.get("intermediate", 64), "mxfp4",
                                     group_size=kw.get("group_size"))
    assert kn.Experts(1, 64, 64, quant="mxfp4", group_size=32).group_size == 32


def test_bad_set_mxfp4_arguments_are_named():
    ex = kn.Experts(2, 64, 96, quant="mxfp4")  # gate [96, 64]: blocks [96, 32], scales [96, 2]
    b, s = torch.zeros(96, 32, dtype=torch.uint8), torch.full((96, 2), 127, dtype=torch.uint8)
    cases = [
        ((b.float(), s), kn.ERR_DTYPE, r"gate blocks of expert 0: dtype float32 is not supported"),
        ((b, s.float()), kn.ERR_DTYPE, r"gate scales of expert 0: dtype float32"),
        ((b[:, :16], s), kn.ERR_SHAPE, r"gate blocks of expert 0: expected shape \[96, 32\], got \[96, 16\]"),
        ((b, s[:, :1]), kn.ERR_SHAPE, r"expected shape \[96, 2\], got \[96, 1\]"),
        ((b.view(96, 2, 16), s), kn.ERR_SHAPE, r"expected shape \[96, 32\], got \[96, 2, 16\]"),
        ((b.t().contiguous().t(), s), kn.ERR_SHAPE, r"each row's bytes must be consecutive.*contiguous"),
    ]
    for args, code, what in cases:
        with pytest.raises(kn.NativeError, match=what) as e:
            ex.set_mxfp4(0, "gate", *args)
        assert e.value.code == code, what
    with pytest.raises(kn.NativeError, match=r"expert = 2 is out of range"):
        ex.set_mxfp4(2, "gate", b, s)
    with pytest.raises(kn.NativeError, match=r"which = 'gates'"):
        ex.set_mxfp4(0, "gates", b, s)
    with pytest.raises(kn.NativeError, match=r"set_mxfp4: experts of quant 'fp8'") as e:
        kn.Experts(1, 64, 96, quant="fp8").set_mxfp4(0, "gate", b, s)
    assert e.value.code == kn.ERR_DTYPE
    with pytest.raises(kn.NativeError, match=r"set_fp8: experts of quant 'mxfp4'"):
        ex.set_fp8(0, "gate", torch.zeros(96, 64, dtype=torch.uint8), torch.ones(1, 1))
    with pytest.raises(kn.NativeError, match=r"ktk_experts_set_quantized.*mxfp4 experts take ktk_experts_set_mxfp4"):
        ex.set_quantized(0, "gate", torch.zeros(96, 64, dtype=torch.int8), torch.ones(96, 2))
