"""Native MoE forward: every ISA this machine has against the generic ISA and against float64 torch; packing; tasks.

Legend: T tokens, k experts per token, E experts, H hidden, I expert intermediate. Errors are relative Frobenius
errors ||out - ref|| / ||ref||. Outputs are poisoned with NaN before each run to catch unwritten elements.

Tolerances (measured maxima on the cases below in brackets):
- REF: the same function in float64 on the stored weights ex.get(), emulating the library's roundings (bf16: x and
  h rounded to bf16; int8: x and h quantized per row in float32 exactly as the library does). What is left is fp32
  accumulation (~1e-7 relative) and rare one-ulp flips of h where its fp32 value lies within fp32 error of a
  rounding boundary: TOL_REF_F32 = 1e-4 [bf16 9e-6, int8 1.4e-7]. A bf16 output adds one round-to-nearest,
  <= 2^-9 = 1.95e-3 relative per element, hence in Frobenius norm: TOL_REF_BF16 = 2^-9 + 5e-4 [1.7e-3].
- TRUTH: unquantized float64 on the original weights, nothing rounded. bf16 weights, x and h each carry up to
  2^-9 relative rounding (rms ~1.1e-3 each, adding in quadrature, plus a bf16 output): TOL_TRUTH_BF16 = 2e-2
  [4.5e-3]. W8A8: quantization noise of ~0.8% per quantized operand (step = max/127, uniform noise / sqrt(12), max
  ~3.5 sigma) over 4 operands (weights twice, x, h): TOL_TRUTH_INT8 = 6e-2 [1.9e-2].
- ISA vs the generic reference: only the fp32 summation order differs (and, rarely, a one-ulp flip of a bf16 h or
  output element): TOL_ISA_F32 = 1e-4 [5e-6], TOL_ISA_BF16 = 1e-3 [1.6e-5].
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ktinject import native as kn

TOL_REF_F32, TOL_REF_BF16 = 1e-4, 2**-9 + 5e-4
TOL_TRUTH_BF16, TOL_TRUTH_INT8 = 2e-2, 6e-2
TOL_ISA_F32, TOL_ISA_BF16 = 1e-4, 1e-3

ISAS = [pytest.param(i, marks=pytest.mark.amx) if i == "amx" else i for i in ("generic", "avx2", "avx512", "amx")]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture
def use_isa():
    """set_isa for one test, restored afterwards; skips ISAs this machine/build does not have."""
    before = kn.isa()

    def use(name: str) -> None:
        if name not in kn.available_isas():
            pytest.skip(f"ISA {name} not available here (have {kn.available_isas()})")
        kn.set_isa(name)

    yield use
    kn.set_isa(before)


# ---- float64 references ----
def quant_rows(x: torch.Tensor) -> torch.Tensor:
    """Per-row symmetric int8 quantize + dequantize (float64 result), as the library does: in float32, scale =
    max|x| / 127 and q = round_half_even(x / scale). (float32 matters: bf16/f16 inputs hit exact .5 ties often.)"""
    x = x.float()
    s = x.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(s > 0, torch.round(x / torch.where(s > 0, s, 1)).clamp(-127, 127), 0)
    return q.double() * s.double()


def act_fn(g, u, activation, alpha, limit):
    if activation == "silu":
        return torch.nn.functional.silu(g) * u
    g = g.clamp(max=limit)
    u = u.clamp(-limit, limit)
    return g * torch.sigmoid(alpha * g) * (u + 1)


def reference(mats, biases, hidden, ids, weights, skip, quant, activation="silu", alpha=1.702, limit=7.0,
              emulate=True):
    """out [T, H] float64. mats[e] = (gate [I, H], up [I, H], down [H, I]); biases[e] = (bg, bu, bd) or None.
    emulate: apply the library's roundings (bf16 x and h, or per-row int8 x and h)."""
    T, k = ids.shape
    x = hidden.double()
    if emulate:
        x = quant_rows(hidden.float().double()) if quant == "int8" else hidden.bfloat16().double()
    out = torch.zeros(T, hidden.shape[1], dtype=torch.float64)
    w = weights.double()
    for e in ids.unique().tolist():
        if skip is not None and bool(skip[e]):
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gate, up, down = (m.double() for m in mats[e])
        bg, bu, bd = (b.double() for b in biases[e]) if biases else (0, 0, 0)
        h = act_fn(x[tok] @ gate.T + bg, x[tok] @ up.T + bu, activation, alpha, limit)
        if emulate:
            h = quant_rows(h) if quant == "int8" else h.bfloat16().double()
        out.index_add_(0, tok, w[tok, slot, None] * (h @ down.T + bd))
    return out


def stored(ex: kn.Experts):
    return [tuple(ex.get(e, m) for m in ("gate", "up", "down")) for e in range(ex.num_experts)]


# ---- random problems ----
CASES = [  # E, H, I, T, k, routing, skip, hidden dtype, weights dtype, out dtype, weight src dtype
    (1, 37, 19, 1, 1, "random", None, "f32", "f32", "f32", "f32"),
    (8, 64, 48, 1, 8, "random", None, "bf16", "bf16", "bf16", "bf16"),
    (16, 37, 19, 7, 4, "random", "some", "f32", "bf16", "f32", "bf16"),
    (300, 40, 24, 64, 8, "random", "some", "bf16", "f32", "f32", "f32"),
    (12, 96, 80, 600, 2, "random", None, "f16", "f32", "f32", "f16"),
    (10, 72, 33, 300, 3, "one_expert", None, "bf16", "bf16", "bf16", "bf16"),
    (32, 130, 100, 50, 6, "few_experts", "some", "f32", "f32", "bf16", "f32"),
    (6, 64, 64, 20, 2, "random", "all", "f32", "f32", "f32", "f32"),
    (8, 64, 48, 1, 8, "random", "all", "bf16", "bf16", "bf16", "bf16"),  # one token, no row: zeros written inline
    (4, 32, 16, 1500, 2, "random", None, "bf16", "f32", "bf16", "f32"),  # > 1 token chunk, > 256 rows/expert
]
DT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def make_problem(case, seed, quant, activation="silu", bias=False):
    E, H, I, T, k, routing, skip_mode, hd, wd, od, sd = case
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    down = torch.randn(E, H, I, generator=g) / I**0.5
    ex = kn.Experts(E, H, I, quant=quant, activation=activation, bias=bias)
    biases = None
    for e in range(E):
        ex.set(e, "gate", gate_up[e, :I].to(DT[sd]))
        ex.set(e, "up", gate_up[e, I:].to(DT[sd]))
        ex.set(e, "down", down[e].to(DT[sd]))
    if bias:
        biases = [tuple(torch.randn(n, generator=g) * 0.5 for n in (I, I, H)) for _ in range(E)]
        for e, (bg, bu, bd) in enumerate(biases):
            ex.set_bias(e, "gate", bg)
            ex.set_bias(e, "up", bu)
            ex.set_bias(e, "down", bd)
    hidden = (torch.randn(T, H, generator=g) * (3.0 if activation == "gptoss" else 1.0)).to(DT[hd])
    if routing == "one_expert":
        ids = torch.stack([torch.full((T,), E // 2)] + [torch.randint(0, E, (T,), generator=g)
                                                        for _ in range(k - 1)], 1)
    else:
        pool = E if routing == "random" else min(E, 3 * k)
        ids = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(T)])
        if routing == "repeat":  # each token's last slot names its first slot's expert again (two rows of it)
            ids[:, -1] = ids[:, 0]
    weights = torch.rand(T, k, generator=g).to(DT[wd])
    skip = None
    if skip_mode == "some":
        skip = torch.rand(E, generator=g) < 0.3
    elif skip_mode == "all":
        skip = torch.ones(E, dtype=torch.uint8)
    truth_mats = [(gate_up[e, :I].to(DT[sd]), gate_up[e, I:].to(DT[sd]), down[e].to(DT[sd])) for e in range(E)]
    return ex, hidden, ids.long(), weights, skip, DT[od], truth_mats, biases


def run(ex, hidden, ids, weights, skip, out_dtype, pool=None):
    out = torch.full((hidden.shape[0], ex.hidden), float("nan"), dtype=out_dtype)
    y = ex.forward(hidden, ids, weights, skip=skip, out=out, pool=pool)
    assert y is out
    assert not torch.isnan(out).any(), "unwritten (NaN) output elements"
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("quant", ["bf16", "int8"])
@pytest.mark.parametrize("ci", range(len(CASES)))
def test_forward_silu(use_isa, isa, quant, ci):
    ex, hidden, ids, weights, skip, od, truth, _ = make_problem(CASES[ci], 100 + ci, quant)
    use_isa("generic")
    base = run(ex, hidden, ids, weights, skip, od)
    use_isa(isa)
    out = run(ex, hidden, ids, weights, skip, od)
    if skip is not None and bool(skip.bool().all()):
        assert (out == 0).all()
        return
    ref = reference(stored(ex), None, hidden, ids, weights, skip, quant)
    assert rel(out, ref) < (TOL_REF_F32 if od == torch.float32 else TOL_REF_BF16)
    truth_ref = reference(truth, None, hidden, ids, weights, skip, quant, emulate=False)
    assert rel(out, truth_ref) < (TOL_TRUTH_BF16 if quant == "bf16" else TOL_TRUTH_INT8)
    assert rel(out, base) < (TOL_ISA_F32 if od == torch.float32 else TOL_ISA_BF16)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("quant", ["bf16", "int8"])
@pytest.mark.parametrize("ci", [0, 2, 4, 6])
def test_forward_gptoss_bias(use_isa, isa, quant, ci):
    ex, hidden, ids, weights, skip, od, truth, biases = make_problem(CASES[ci], 200 + ci, quant, "gptoss", True)
    use_isa("generic")
    base = run(ex, hidden, ids, weights, skip, od)
    use_isa(isa)
    out = run(ex, hidden, ids, weights, skip, od)
    ref = reference(stored(ex), biases, hidden, ids, weights, skip, quant, "gptoss")
    assert rel(out, ref) < (TOL_REF_F32 if od == torch.float32 else TOL_REF_BF16)
    truth_ref = reference(truth, biases, hidden, ids, weights, skip, quant, "gptoss", emulate=False)
    assert rel(out, truth_ref) < (TOL_TRUTH_BF16 if quant == "bf16" else TOL_TRUTH_INT8)
    assert rel(out, base) < (TOL_ISA_F32 if od == torch.float32 else TOL_ISA_BF16)


def test_deterministic_across_thread_counts():
    """One task owns each (tokens, columns) block of out and sums experts in ascending order: bitwise equal."""
    ex, hidden, ids, weights, skip, od, _, _ = make_problem(CASES[3], 7, "bf16")
    outs = []
    for n in (1, 2, 3):
        with kn.Pool(n) as pool:
            outs.append(run(ex, hidden, ids, weights, skip, od, pool=pool))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


DECODE_CASES = [  # E, H, I, T, k, routing, skip, dtypes...: every expert <= 4 rows (the decode path)
    (16, 200, 100, 1, 8, "random", None, "bf16", "f32", "bf16", "f32"),    # 8 one-row experts: gemv groups of 8
    (40, 130, 70, 1, 12, "random", "some", "f32", "bf16", "f32", "bf16"),  # 12: a group of 8, then the rest
    (12, 96, 80, 3, 8, "few_experts", None, "bf16", "f32", "f32", "f32"),  # one- and multi-row experts mixed
    (8, 2048, 768, 1, 8, "random", None, "bf16", "f32", "bf16", "f32"),    # Qwen3-30B-A3B layer shapes
    (10, 40, 10, 1, 3, "random", None, "f32", "f32", "f32", "bf16"),      # one gate/up block an expert, H % 32 != 0
    (10, 40, 10, 1, 3, "repeat", None, "f32", "f32", "f32", "bf16"),      # one token, an expert twice: two rows
    (48, 72, 40, 8, 6, "random", "some", "bf16", "f32", "bf16", "f32"),    # a batch's step: 1-4 rows an expert
    (10, 40, 24, 5, 3, "repeat", "some", "f32", "bf16", "f32", "bf16"),    # repeats, skipped experts, biases
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("quant", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("ci", range(len(DECODE_CASES)))
def test_decode_path_equals_item_path(use_isa, monkeypatch, isa, quant, ci):
    """Few-row forwards run the gemv decode path (chunks claimed per thread, gate+up and groups of down matrices
    streamed together), or as one phase (the pipeline, KTINJECT_PIPE): bitwise the same output as the item path
    (KTINJECT_GEMV=0 / 1), on 1 and 3 threads. (Tables
    without gemv, generic and avx2, take the item path both times: the reference comparison still holds.)"""
    use_isa(isa)
    ex, hidden, ids, weights, skip, od, _, biases = make_problem(DECODE_CASES[ci], 300 + ci, "bf16", bias=ci in (1, 7))
    if quant != "bf16":
        q = kn.Experts(ex.num_experts, ex.hidden, ex.intermediate, quant=quant, bias=ci in (1, 7),
                       **({"group_size": 32} if quant == "int4" else {}))
        for e in range(ex.num_experts):
            for m in ("gate", "up", "down"):
                q.set(e, m, ex.get(e, m))
            for m, b in zip(("gate", "up", "down"), biases[e] if biases else ()):
                q.set_bias(e, m, b)
        ex = q
    outs = []
    # gemv 1: the gemv path even where the table does not use it by default (AVX-512); pipe 1 runs gate/up and
    # down as one phase (moe/pipeline.c), 0 as two
    for gemv, pipe in (("0", "0"), ("1", "0"), ("1", "1")):
        monkeypatch.setenv("KTINJECT_GEMV", gemv)
        monkeypatch.setenv("KTINJECT_PIPE", pipe)
        for n in (1, 3):
            with kn.Pool(n) as pool:
                outs.append(run(ex, hidden, ids, weights, skip, od, pool=pool))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    ref = reference(stored(ex), biases, hidden, ids, weights, skip, "int8" if quant != "bf16" else "bf16")
    assert rel(outs[-1], ref) < (TOL_REF_F32 if od == torch.float32 else TOL_REF_BF16)


TILE_CASES = [  # many-row experts: x and h in AMX tile order (KTINJECT_TILES)
    (12, 96, 80, 600, 2, "random", None, "f16", "f32", "f32", "f16"),      # ~100 rows per expert, H, I % 64 != 0
    (10, 72, 33, 300, 3, "one_expert", None, "bf16", "bf16", "bf16", "bf16"),  # 300 rows: 256-row chunk + 44
    (4, 64, 40, 1100, 2, "random", "some", "bf16", "f32", "f32", "f32"),   # T > 1024: down rows not 16-aligned
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("quant", ["bf16", "int8", "int4", "int4-dequant"])
@pytest.mark.parametrize("ci", range(len(TILE_CASES)))
def test_tiles_equal_rows(use_isa, monkeypatch, isa, quant, ci):
    """x and h handed to the kernels in tile order as well as in rows (KTINJECT_TILES=N: from N rows on any table;
    generic and AMX read the tiles, the others ignore them): bitwise the same output as rows only (=0), on 1 and 3
    threads, with tiles for every expert (1) or only the larger ones (90)."""
    use_isa(isa)
    q = quant.split("-")[0]
    if quant == "int4-dequant":
        monkeypatch.setenv("KTINJECT_INT4_PATH", "dequant")
    ex, hidden, ids, weights, skip, od, _, _ = make_problem(TILE_CASES[ci], 400 + ci, q)
    outs = []
    for tiles in ("0", "1", "90"):
        monkeypatch.setenv("KTINJECT_TILES", tiles)
        for n in (1, 3):
            with kn.Pool(n) as pool:
                outs.append(run(ex, hidden, ids, weights, skip, od, pool=pool))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_from_hf_matches_set_and_transformers_layout():
    E, H, I = 5, 40, 24
    g = torch.Generator().manual_seed(3)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    ex = kn.Experts.from_hf(gate_up.bfloat16(), down.bfloat16())
    assert (ex.num_experts, ex.hidden, ex.intermediate, ex.quant) == (E, H, I, "bf16")
    for e in range(E):  # bf16 source: stored exactly
        assert torch.equal(ex.get(e, "gate"), gate_up[e, :I].bfloat16().float())
        assert torch.equal(ex.get(e, "up"), gate_up[e, I:].bfloat16().float())
        assert torch.equal(ex.get(e, "down"), down[e].bfloat16().float())
    t = torch.tensor([[1.5, -2.25], [3.0, 0.0]]).expand(2, 2)  # f32 -> bf16 round to nearest even
    assert torch.equal(t.bfloat16().float(), t)


def test_from_gpt_oss_matches_hf_formula():
    """Interleaved gate_up [E, H, 2I] (even = gate, odd = up) and [E, I, H] down, as transformers' GptOssExperts."""
    E, H, I, T, k, alpha, limit = 4, 48, 20, 9, 2, 1.702, 7.0
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(E, H, 2 * I, generator=g) / H**0.5
    gate_up_bias, down = torch.randn(E, 2 * I, generator=g), torch.randn(E, I, H, generator=g) / I**0.5
    down_bias = torch.randn(E, H, generator=g)
    ex = kn.Experts.from_gpt_oss(gate_up, gate_up_bias, down, down_bias, alpha, limit)
    x, ids = torch.randn(T, H, generator=g) * 3, torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    ref = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            gu = x[t].double() @ gate_up[e].double() + gate_up_bias[e].double()
            gate, up = gu[0::2].clamp(max=limit), gu[1::2].clamp(-limit, limit)
            h = (up + 1) * gate * torch.sigmoid(gate * alpha)
            ref[t] += w[t, j] * (h @ down[e].double() + down_bias[e].double())
    out = ex(x, ids, w)
    assert out.dtype == torch.float32 and rel(out, ref) < TOL_TRUTH_BF16


@pytest.mark.parametrize("quant", ["bf16", "int8"])
def test_export_import_roundtrip(quant):
    ex, hidden, ids, weights, skip, od, _, _ = make_problem(CASES[2], 11, quant, "gptoss", True)
    buf = ex.export()
    assert buf.dtype == torch.uint8 and buf.numel() == ex.nbytes
    ex2 = kn.Experts(ex.num_experts, ex.hidden, ex.intermediate, quant=quant, activation="gptoss", bias=True)
    ex2.load_packed(buf)
    assert torch.equal(run(ex, hidden, ids, weights, skip, od), run(ex2, hidden, ids, weights, skip, od))


@pytest.mark.parametrize("quant", ["bf16", "int8"])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_nbytes_formula(quant, bias):
    for E, H, I in ((1, 1, 1), (8, 64, 32), (3, 37, 19), (2, 2048, 768), (5, 100, 129)):
        ex = kn.Experts(E, H, I, quant=quant, activation="gptoss" if bias else "silu", bias=bias)
        assert ex.nbytes == kn.Experts.packed_nbytes(E, H, I, quant, bias) == ex.export().numel()


def test_int8_weights_per_channel():
    w = torch.randn(24, 40) * torch.linspace(0.01, 10, 24)[:, None]
    ex = kn.Experts(1, 40, 24, quant="int8")
    ex.set(0, "gate", w)
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((ex.get(0, "gate") - w).abs() <= step / 2 + 1e-6).all()
    assert torch.allclose(ex.get(0, "gate"), quant_rows(w.double()).float(), rtol=1e-5, atol=1e-6)


def test_default_out_dtype_and_empty():
    ex, hidden, ids, weights, _, _, _, _ = make_problem(CASES[0], 1, "bf16")
    assert ex(hidden.half(), ids, weights).dtype == torch.float32
    assert ex(hidden.bfloat16(), ids, weights).dtype == torch.bfloat16
    assert ex(hidden[:0], ids[:0], weights[:0]).shape == (0, ex.hidden)


# ---- tasks ----
def test_task_submit_wait_and_refill():
    ex, hidden, ids, weights, skip, od, _, _ = make_problem(CASES[3], 21, "bf16")
    task = kn.Task()
    out = task.bind(ex, hidden, ids, weights, skip=skip)
    for step in range(3):
        hidden.copy_(torch.randn_like(hidden))   # refilled in place: read when the task runs
        out.fill_(float("nan"))
        task.submit()
        task.wait()
        assert torch.equal(out, ex(hidden, ids, weights, skip=skip)), step
    task.close()


def test_task_double_submit_and_run_error(use_isa):
    use_isa("generic")  # slow on purpose: the blocker keeps the pool's one thread busy while we submit twice
    ex, hidden, ids, weights, _, _, _, _ = make_problem(CASES[4], 22, "bf16")
    with kn.Pool(1) as pool, kn.Task(pool) as blocker, kn.Task(pool) as task:
        blocker.bind(ex, hidden, ids, weights)
        task.bind(ex, hidden, ids, weights)
        blocker.submit()
        task.submit()
        with pytest.raises(kn.NativeError) as err:
            task.submit()
        assert err.value.code == kn.ERR_STATE and "already queued or running" in err.value.message
        task.wait()
        blocker.wait()
        ids[3, 1] = ex.num_experts + 5  # validated when the task runs: reported by wait
        task.submit()
        with pytest.raises(kn.NativeError, match=r"ids\[3\]\[1\].*= 17"):
            task.wait()


def test_task_signal_word_and_times():
    """A submitted run raises its signal word once out is complete (a polling waiter may read out then), also when it
    fails (wait() then raises); times() are the run's on perf_counter's clock; the word is kept across binds."""
    ex, hidden, ids, weights, skip, _, _, _ = make_problem(CASES[3], 27, "bf16")
    word = torch.zeros(2, dtype=torch.int32)
    with kn.Task() as task:
        assert task.times() == (0.0, 0.0)
        with pytest.raises(kn.NativeError, match="one int32 element") as err:
            task.signal(word)  # two elements
        assert err.value.code == kn.ERR_SHAPE
        with pytest.raises(kn.NativeError, match="one int32 element"):
            task.signal(word[:1].float())
        task.signal(word[:1])
        for step in range(3):
            out = task.bind(ex, hidden, ids, weights, skip=skip)  # a bind keeps the word
            word[0] = 0
            before = time.perf_counter()
            task.submit()
            deadline = time.monotonic() + 10
            while int(word[0]) != 1 and time.monotonic() < deadline:
                pass
            assert int(word[0]) == 1, step
            assert torch.equal(out, ex(hidden, ids, weights, skip=skip)), step  # complete once the word is 1
            task.wait()
            begin, end = task.times()
            assert before <= begin <= end <= time.perf_counter(), (before, begin, end)
            assert int(word[1]) == 0  # nothing beyond the word
        ids[2, 0] = ex.num_experts + 1
        word[0] = 0
        task.submit()
        deadline = time.monotonic() + 10
        while int(word[0]) != 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert int(word[0]) == 1  # raised when the run fails too: a waiting GPU must not hang
        with pytest.raises(kn.NativeError, match="out of range|ids"):
            task.wait()
        task.signal(None)
        ids[2, 0] = 0
        word[0] = 0
        task.bind(ex, hidden, ids, weights)
        task.submit()
        task.wait()
        assert int(word[0]) == 0  # no word: none raised
        flags = torch.zeros(2, dtype=torch.int32)
        task.watch(flags.data_ptr(), flags.data_ptr() + 4)
        with pytest.raises(kn.NativeError, match="watched") as err:
            task.signal(word[:1])
        assert err.value.code == kn.ERR_STATE
        with pytest.raises(kn.NativeError, match="watched") as err:
            task.times()
        assert err.value.code == kn.ERR_STATE
        task.unwatch()


def test_host_function_addresses():
    ffi, _ = kn._native()
    submit, wait = kn.host_fn_addresses()
    assert submit and wait and submit != wait
    ex, hidden, ids, weights, _, _, _, _ = make_problem(CASES[2], 23, "bf16")
    with kn.Task() as task:
        out = task.bind(ex, hidden, ids, weights)
        fn_t = "void(*)(void *)"
        ffi.cast(fn_t, submit)(ffi.cast("void *", task.address))
        ffi.cast(fn_t, wait)(ffi.cast("void *", task.address))
        task.wait()
        assert torch.equal(out, ex(hidden, ids, weights))


def test_watch_go_done_from_python_thread():
    """go/done flags in ordinary host memory, raised/polled by a Python thread like a CUDA stream would."""
    ex, hidden, ids, weights, _, _, _, _ = make_problem(CASES[1], 24, "bf16")
    flags = torch.zeros(2, dtype=torch.int32)
    results = []

    def driver(task, out):
        for step in range(20):
            hidden.copy_(torch.randn_like(hidden))
            out.fill_(float("nan"))
            flags[0] = 1
            deadline = time.monotonic() + 10
            while int(flags[1]) != 1:
                assert time.monotonic() < deadline, "task did not signal done"
                time.sleep(0)
            flags[1] = 0
            assert int(flags[0]) == 0  # the pool thread consumed go
            results.append(torch.equal(out, ex(hidden, ids, weights)))

    with kn.Task() as task:
        out = task.bind(ex, hidden, ids, weights)
        task.watch(flags.data_ptr(), flags.data_ptr() + 4)
        with pytest.raises(kn.NativeError, match="watched"):
            task.submit()
        th = threading.Thread(target=driver, args=(task, out))
        th.start()
        th.join(60)
        assert not th.is_alive()
        task.unwatch()
    assert results == [True] * 20


def _thread_states(tids) -> str:
    """One letter per thread id (R running, S sleeping, ...) from /proc."""
    out = ""
    for tid in tids:
        with open(f"/proc/self/task/{tid}/stat") as f:
            out += f.read().rsplit(")", 1)[1].split()[0]
    return out


def _named_threads(before, name: str, timeout: float = 5.0) -> list[str]:
    """Ids of this process's threads started since ``before`` (a set of ids) that are named ``name`` (threads name
    themselves when they start: wait for it)."""
    import os

    end = time.monotonic() + timeout
    while True:
        found = []
        for tid in set(os.listdir("/proc/self/task")) - before:
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() == name:
                        found.append(tid)
            except FileNotFoundError:
                pass
        if found or time.monotonic() > end:
            return found
        time.sleep(0.001)


def _mostly(tids, state: str, seconds: float = 0.1) -> bool:
    """The threads were in ``state`` in at least 80% of samples over ``seconds``."""
    hits = samples = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        hits += _thread_states(tids).count(state)
        samples += len(tids)
        time.sleep(0.002)
    assert samples, "no threads sampled"
    return hits >= 0.8 * samples


def test_watch_spin_keeps_workers_awake():
    """While tasks are watched, the pool's other threads spin (state R) within the watch spin window after a watched
    run or a wake(), and sleep (S) once it has passed, is set to 0, or nothing is watched any more."""
    import os

    ex, hidden, ids, weights, _, _, _, _ = make_problem((8, 64, 48, 8, 8, "random", None, "bf16", "bf16", "bf16",
                                                         "bf16"), 27, "bf16")
    flags = torch.zeros(2, dtype=torch.int32)
    before = set(os.listdir("/proc/self/task"))
    with kn.Pool(2, pin=False) as pool, kn.Task(pool) as task:
        workers = _named_threads(before, "ktk-1")
        assert len(workers) == 1
        out = task.bind(ex, hidden, ids, weights)
        expected = ex(hidden, ids, weights)

        def step():
            out.fill_(float("nan"))
            flags[0] = 1
            deadline = time.monotonic() + 10
            while int(flags[1]) != 1:
                assert time.monotonic() < deadline, "task did not signal done"
            flags[1] = 0
            assert torch.equal(out, expected)

        assert pool.watch_spin_us == 1000  # the default (KTINJECT_WATCH_SPIN_US unset)
        pool.watch_spin_us = 300_000
        time.sleep(0.02)
        assert _mostly(workers, "S", 0.03)  # idle pool: asleep
        pool.wake()  # nothing watched: no-op
        assert _mostly(workers, "S", 0.03)
        task.watch(flags.data_ptr(), flags.data_ptr() + 4)
        step()
        assert _mostly(workers, "R")  # watched run 'just now': spinning
        pool.watch_spin_us = 0  # takes effect at once
        time.sleep(0.02)
        assert _mostly(workers, "S", 0.05)
        pool.watch_spin_us = 30_000
        step()
        time.sleep(0.08)  # the window passed
        assert _mostly(workers, "S", 0.05)
        pool.watch_spin_us = 300_000
        assert _mostly(workers, "S", 0.03)  # asleep until something happens
        pool.wake()  # before a replay: awake and spinning without a run
        assert _mostly(workers, "R", 0.05)
        step()
        assert _mostly(workers, "R", 0.05)
        task.unwatch()  # nothing watched: sleep at once
        time.sleep(0.02)
        assert _mostly(workers, "S", 0.05)
        with pytest.raises(kn.NativeError, match="out of range"):
            pool.watch_spin_us = 10_000_001


def test_watched_run_error_is_kept_for_unwatch():
    ex, hidden, ids, weights, _, _, _, _ = make_problem(CASES[1], 25, "bf16")
    flags = torch.zeros(2, dtype=torch.int32)
    with kn.Task() as task:
        task.bind(ex, hidden, ids, weights)
        ids[0, 0] = -1
        task.watch(flags.data_ptr(), flags.data_ptr() + 4)
        flags[0] = 1
        deadline = time.monotonic() + 10
        while int(flags[1]) != 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert int(flags[1]) == 1  # done is raised even when the run fails (the GPU must not hang)
        with pytest.raises(kn.NativeError, match="= -1") as err:
            task.unwatch()
        assert err.value.code == kn.ERR_RANGE


def test_pool_close_with_queued_and_watched_tasks():
    ex, hidden, ids, weights, _, _, _, _ = make_problem(CASES[4], 26, "bf16")
    flags = torch.zeros(2, dtype=torch.int32)
    for _ in range(5):
        pool = kn.Pool(2)
        tasks = [kn.Task(pool) for _ in range(3)]
        for t in tasks:
            t.bind(ex, hidden, ids, weights)
        tasks[0].submit()
        tasks[1].submit()
        tasks[2].watch(flags.data_ptr(), flags.data_ptr() + 4)
        pool.close()  # closes (waits for) the tasks, then joins the threads
        with pytest.raises(kn.NativeError, match="closed"):
            kn.Task(pool)
    for n in (1, 2, 5):
        with kn.Pool(n, pin=False) as p:
            assert p.threads == n


def test_concurrent_forwards_from_python_threads():
    """Callers race for the pool: one runs inline, the others queue; every result is the single-caller one."""
    problems = [make_problem(CASES[i], 30 + i, "bf16") for i in (1, 2, 3, 4)]
    expected = [run(ex, h, ids, w, skip, od) for ex, h, ids, w, skip, od, _, _ in problems]
    errors = []

    def caller(i):
        ex, h, ids, w, skip, od, _, _ = problems[i]
        for _ in range(15):
            if not torch.equal(run(ex, h, ids, w, skip, od), expected[i]):
                errors.append(i)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads) and errors == []


class _CTestBuilder:
    """Builds native/tests/<name>.c against all native sources (native/src/**: a test build, -DKTK_TEST_BUILD, which
    compiles in the test hooks such as KTINJECT_TEST_DELAY) under a sanitizer (skips without gcc / its runtime).

    Each source is compiled on its own (all at once, one per core) and its object kept for the session, keyed by
    the sanitizer and the -D flags that the source or a project header names: the sanitized AVX-512 kernels take a
    minute or more to compile and are the same object in every build of one sanitizer (the -D flags of the stress
    builds change only pool.c, pipeline.c and the test file). Every file sees the flags one gcc command given them
    all would give it; the test file is compiled with all of them."""

    def __init__(self, cache: Path):
        self.root = Path(__file__).resolve().parents[2]
        self.cache = cache
        native = self.root / "native"
        self.srcs = sorted(native.glob("src/**/*.c"))
        headers = sorted(native.glob("include/**/*.h")) + sorted(native.glob("src/**/*.h"))
        self.headers_text = "\n".join(h.read_text() for h in headers)
        self.objects: dict[tuple, Path] = {}  # (source, sanitizer, its -D flags) -> object file

    def _flags(self, sanitizer: str) -> list[str]:
        return ["-std=c11", "-O1", "-g", f"-fsanitize={sanitizer}", "-pthread", "-DKTK_TEST_BUILD",
                f"-I{self.root / 'native' / 'include'}", f"-I{self.root / 'native' / 'src'}"]

    def _relevant(self, src: Path, defines) -> tuple:
        """The -DNAME[=VALUE] flags whose NAME the source or a project header mentions (the others cannot change it)."""
        text = src.read_text() + self.headers_text
        return tuple(d for d in defines if re.search(rf"\b{re.escape(d[2:].split('=', 1)[0])}\b", text))

    @staticmethod
    def _check(cc: subprocess.CompletedProcess) -> None:
        if cc.returncode != 0 and "cannot find" in cc.stderr and "san" in cc.stderr:
            pytest.skip(f"sanitizer runtime missing: {cc.stderr.strip()[-200:]}")
        assert cc.returncode == 0, cc.stderr

    def _compile(self, src: Path, sanitizer: str, defines: tuple, obj: Path) -> subprocess.CompletedProcess:
        return subprocess.run(["gcc", *self._flags(sanitizer), *defines, "-c", str(src), "-o", str(obj)],
                              capture_output=True, text=True, timeout=600)

    def build(self, tmp_path: Path, name: str, sanitizer: str, defines=()) -> Path:
        if not shutil.which("gcc"):
            pytest.skip("no gcc")
        defines = tuple(defines)
        keys = [(src, sanitizer, self._relevant(src, defines)) for src in self.srcs]
        todo = [k for k in dict.fromkeys(keys) if k not in self.objects]
        todo.sort(key=lambda k: k[0].parent.parent.name != "kernels")  # kernels/<isa>/*.c (intrinsics) take longest
        objs = {k: self.cache / f"{len(self.objects) + i}-{k[0].stem}.o" for i, k in enumerate(todo)}
        with ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0)))) as pool:
            done = list(pool.map(lambda k: self._compile(k[0], sanitizer, k[2], objs[k]), todo))
        for k, cc in zip(todo, done):
            self._check(cc)
            self.objects[k] = objs[k]
        test_obj = tmp_path / f"{name}.o"
        self._check(self._compile(self.root / "native" / "tests" / f"{name}.c", sanitizer, defines, test_obj))
        exe = tmp_path / name
        self._check(subprocess.run(["gcc", f"-fsanitize={sanitizer}", "-pthread", *(str(self.objects[k]) for k in keys),
                                    str(test_obj), "-o", str(exe), "-lm"], capture_output=True, text=True, timeout=300))
        return exe


@pytest.fixture(scope="session")
def c_test_builder(tmp_path_factory):
    return _CTestBuilder(tmp_path_factory.mktemp("native-objects"))


#: the tests built by c_test_builder run in one pytest-xdist worker (--dist loadgroup), which builds each object once
SANITIZER_BUILDS = pytest.mark.xdist_group("native-sanitizer-builds")


@SANITIZER_BUILDS
def test_activation_and_quantize_rows(tmp_path, c_test_builder):
    """native/tests/test_activation.c: the gate/up activations (the vector path where the CPU has AVX-512) and int8
    row quantization against float64 references, odd lengths, biases, NaN rows; under ASan+UBSan."""
    exe = c_test_builder.build(tmp_path, "test_activation", "address,undefined")
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.stdout + r.stderr)[-4000:]


@SANITIZER_BUILDS
@pytest.mark.parametrize("sanitizer, n", [("thread", 8000), ("address,undefined", 40000)])
def test_pool_wakeups(tmp_path, c_test_builder, sanitizer, n):
    """native/tests/test_wakeup.c: n tight submit / wait rounds on 1- and 2-thread pools, then submits racing the
    pool's destroy, under a watchdog (a task queued between the pool thread's look at the queue and its sleep was
    left queued: ktk_wait hung within a few hundred rounds before the fix); under TSan / ASan+UBSan."""
    exe = c_test_builder.build(tmp_path, "test_wakeup", sanitizer)
    r = subprocess.run([str(exe), str(n)], capture_output=True, text=True, timeout=300,
                       env={"TSAN_OPTIONS": "halt_on_error=1", "ASAN_OPTIONS": "detect_leaks=1"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.stdout + r.stderr)[-4000:]


@SANITIZER_BUILDS
@pytest.mark.parametrize("sanitizer", ["thread", "address,undefined"])
@pytest.mark.parametrize("decode", [False, True, "two-phase", "one-token"])
def test_pool_stress_sanitizers(tmp_path, c_test_builder, sanitizer, decode):
    """native/tests/stress_pool.c against all native sources, under ThreadSanitizer / ASan+UBSan, with pool threads
    delayed by the test hook; decode: 3 tokens x 4 experts of 8 (every expert <= 4 rows) on the gemv decode path
    (KTINJECT_GEMV=1, where the kernels have gemv) as the one-phase pipeline (down units waiting for their experts'
    h, one thread summing each column group), in claim windows of 7 items, its split task in the default layout cut
    (chunks stop at the parts' boundary, which windows shift), then also in one and two (KTINJECT_DEFER_PHASES); two-phase: the same
    as two phases (KTINJECT_PIPE=0); one-token: 1 token x 4 experts, I = 200, the pipeline in one window, in the
    three layouts (with chunks of several units: one crossing cut's boundary aborts, KTK_CHECK_CUT); else 33 tokens
    x 2, claim windows of 7 items (phases of several)."""
    flags = {False: ["-DCLAIM_BITS=3"], True: ["-DSTRESS_T=3", "-DSTRESS_K=4", "-DCLAIM_BITS=3"],
             "two-phase": ["-DSTRESS_T=3", "-DSTRESS_K=4"],
             "one-token": ["-DSTRESS_T=1", "-DSTRESS_K=4", "-DSTRESS_I=200", "-DKTK_CHECK_CUT"]}[decode]
    exe = c_test_builder.build(tmp_path, "stress_pool", sanitizer, flags)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300,
                       env={"TSAN_OPTIONS": "halt_on_error=1", "ASAN_OPTIONS": "detect_leaks=1",
                            "KTINJECT_GEMV": "1" if decode else "0",
                            "KTINJECT_PIPE": "0" if decode == "two-phase" else "1", "KTINJECT_TILES": "1"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.stdout + r.stderr)[-4000:]
    for phases in ("one", "two") if decode in (True, "one-token") else ():  # the split's other layouts, same build
        r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300,
                           env={"TSAN_OPTIONS": "halt_on_error=1", "ASAN_OPTIONS": "detect_leaks=1",
                                "KTINJECT_GEMV": "1", "KTINJECT_PIPE": "1", "KTINJECT_TILES": "1",
                                "KTINJECT_DEFER_PHASES": phases})
        assert r.returncode == 0 and r.stdout.strip() == "ok", (phases, (r.stdout + r.stderr)[-4000:])
