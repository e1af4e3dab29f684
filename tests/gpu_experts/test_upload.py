"""Zero-copy views of packed experts (ktk_experts_raw / ktk_experts_region) and the unpack that re-placement moves and
streamed prefill run on the device (ktinject.gpu_experts.hot.upload), here with torch ops on CPU tensors: bit-identical to
ktk_experts_get (HotExperts.host_weights) converted to the bank dtype, for bf16, int8, int4, fp8 and mxfp4, one
expert or n at once, shapes that are not multiples of 16 / 64 (mxfp4: multiples of 32, not of 64), with and without
gpt-oss biases.

Legend: E experts, H hidden, I intermediate, N/K a matrix's out/in sizes, Np/Kp padded.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ktinject import native as kn
from ktinject.native.packed_views import experts_raw, experts_region
from ktinject.gpu_experts.hot.bank import HotExperts
from ktinject.gpu_experts.hot.upload import (
    PackedRegion, StagingPool, Uploader, expert_layout, unpack_experts, unpack_matrix,
)

# (E, H, I); the last takes int4 groups of 128 by default
SHAPES = [(3, 37, 21), (2, 64, 16), (2, 130, 70), (1, 16, 64), (2, 1, 1), (2, 256, 128)]
MXFP4_SHAPES = [(3, 96, 32), (2, 32, 160), (2, 64, 64), (1, 224, 96)]  # mxfp4: sizes in whole groups of 32
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _experts(E, H, I, quant, bias=False, seed=0):
    """native.Experts with random weights; bias=True: gpt-oss experts, returned with the biases HybridMoE keeps
    for them ((gate_up_bias [E, 2I] gate then up, down_bias [E, H]) as ktinject.operators.families.gpt_oss_biases)."""
    g = torch.Generator().manual_seed(seed)
    if not bias:
        return kn.Experts.from_hf(torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g),
                                  quant=quant)
    gub, db = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)  # gate_up_bias interleaved
    ex = kn.Experts.from_gpt_oss(torch.randn(E, H, 2 * I, generator=g), gub, torch.randn(E, I, H, generator=g), db,
                                 quant=quant)
    return ex, (torch.cat([gub[:, 0::2], gub[:, 1::2]], dim=1), db)


def _up(x, m):
    return -(-x // m) * m


@pytest.mark.parametrize("quant", ["bf16", "int8", "int4", "fp8"])
@pytest.mark.parametrize("E, H, I", SHAPES)
def test_raw_view_describes_the_packed_matrix(quant, E, H, I):
    ex = _experts(E, H, I, quant)
    base, nbytes = experts_region(ex)
    assert nbytes == ex.nbytes and base % 4096 == 0
    region = PackedRegion(ex).tensor
    assert region.data_ptr() == base and region.numel() == nbytes
    for e in range(E):
        for which in ("gate", "up", "down"):
            r = experts_raw(ex, e, which)
            N, K = ex.shape(which)
            kq = max(64, ex.group_size) if quant == "int4" else 64
            assert (r.quant, r.N, r.K, r.Np, r.Kp) == (quant, N, K, _up(N, 16), _up(K, kq))
            assert r.expert == base + e * r.expert_bytes and r.expert_bytes * E == nbytes
            assert r.data_bytes == r.Np * r.Kp * {"bf16": 2, "int8": 1, "int4": 0.5, "fp8": 1}[quant]
            assert r.expert <= r.data and r.data + r.data_bytes <= r.expert + r.expert_bytes
            assert (r.scale != 0) == (quant != "bf16") and r.bias == 0
            # the documented element formula, read straight from the mapping
            ref = ex.get(e, which)
            data = region[r.data - base:r.data - base + r.data_bytes]
            n, c = N - 1, K - 1
            if quant == "bf16":
                q = data.view(torch.bfloat16)[((n // 16) * (r.Kp // 2) + c // 2) * 32 + (n % 16) * 2 + c % 2]
                assert float(q) == float(ref[n, c])
            elif quant == "fp8":
                byte = data[((n // 16) * r.Kp + c) * 16 + n % 16:][:1]
                ng = -(-r.Kp // ex.group_size)
                scales = region[r.scale - base:r.scale - base + 4 * (r.Np // 16) * ng].view(torch.float32)
                scale = scales[(n // 16) * ng + c // ex.group_size]
                assert float(byte.view(torch.float8_e4m3fn).float()[0] * scale) == float(ref[n, c])
            elif quant == "int4":
                byte = int(data[((n // 16) * (r.Kp // 8) + c // 8) * 64 + (n % 16) * 4 + c % 4])
                nib = (byte >> 4 * ((c // 4) % 2)) & 15
                ng = r.Kp // ex.group_size
                scales = region[r.scale - base:r.scale - base + 4 * r.Np * ng].view(torch.float32)
                scale = scales[((n // 16) * ng + c // ex.group_size) * 16 + n % 16]
                assert float(torch.tensor(float(nib - 16 if nib > 7 else nib)) * scale) == float(ref[n, c])
            else:
                q = data.view(torch.int8)[((n // 16) * (r.Kp // 4) + c // 4) * 64 + (n % 16) * 4 + c % 4]
                scale = region[r.scale - base:r.scale - base + 4 * r.Np].view(torch.float32)[n]
                assert float(torch.tensor(float(q)) * scale) == float(ref[n, c])


CASES = [(q, *s) for q in ("bf16", "int8", "int4", "fp8") for s in SHAPES] + [("mxfp4", *s) for s in MXFP4_SHAPES]


@pytest.mark.parametrize("quant, E, H, I", CASES)
def test_unpack_matrix_equals_get(quant, E, H, I):
    ex = _experts(E, H, I, quant, seed=E + H)
    layout = expert_layout(ex)
    packed = PackedRegion(ex)
    work = torch.empty(layout.work_bytes, dtype=torch.uint8)
    for e in range(E):
        buf = packed.expert(e).clone()  # as the device staging buffer would hold it
        for m, which in zip(layout.mats, ("gate", "up", "down")):
            ref = ex.get(e, which)
            for dtype in DTYPES:
                dst = torch.full((m.N, m.K), float("nan"), dtype=dtype)
                unpack_matrix(buf, m, quant, dst, work, layout.group)
                assert torch.equal(dst, ref.to(dtype)), f"{quant} {which} e={e} {dtype}"


@pytest.mark.parametrize("quant, E, H, I", CASES + [(q, 4, 128, 64) for q in ("bf16", "int8", "int4", "fp8",
                                                                              "mxfp4")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unpack_experts_batched(quant, E, H, I, dtype):
    """n experts at once from a strided [n, expert_bytes] view (every other expert of the region, as a ring slot
    holds a gathered set), into strided destinations: each the same as ktk_experts_get."""
    ex = _experts(E, H, I, quant, seed=3)
    layout = expert_layout(ex)
    rows = PackedRegion(ex).tensor.view(E, layout.expert_bytes)[::2]  # experts 0, 2, ...
    n = rows.shape[0]
    gate_up = torch.full((n + 1, 2 * I, H), float("nan"), dtype=dtype)[1:]
    down = torch.full((n, H, I), float("nan"), dtype=dtype)
    work = torch.empty(n * layout.work_bytes, dtype=torch.uint8)
    unpack_experts(rows, layout, gate_up, down, work)
    for j, e in enumerate(range(0, E, 2)):
        assert torch.equal(gate_up[j, :I], ex.get(e, "gate").to(dtype))
        assert torch.equal(gate_up[j, I:], ex.get(e, "up").to(dtype))
        assert torch.equal(down[j], ex.get(e, "down").to(dtype))


def _hot(ex, dtype, biases=None) -> HotExperts:
    spec = SimpleNamespace(num_experts=ex.num_experts, hidden=ex.hidden, intermediate=ex.intermediate,
                           has_bias=biases is not None)
    block = SimpleNamespace(spec=spec, native_experts=ex, device=torch.device("cpu"), expert_biases=biases)
    return HotExperts(block, ex.num_experts, dtype=dtype, dynamic=True)


@pytest.mark.parametrize("quant", ["bf16", "int8", "int4", "fp8", "mxfp4"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_upload_equals_host_weights(quant, bias, dtype):
    E, H, I = (3, 45, 27) if quant != "mxfp4" else (3, 96, 32)
    ex, biases = _experts(E, H, I, quant, bias=True, seed=7) if bias else (_experts(E, H, I, quant, seed=7), None)
    ref, got = _hot(ex, dtype, biases), _hot(ex, dtype, biases)
    assert got.packed is not None and not got.packed.pinned
    up = Uploader("cpu", got.packed.layout.expert_bytes, got.packed.layout.work_bytes)
    for slot, e in enumerate([2, 0, 1]):
        ref.write_slot(slot, ref.host_weights(e))
        up.upload(got, slot, got.packed.expert(e))
    names = ["gate_up", "down"] + (["gate_up_bias", "down_bias"] if bias else [])
    for name in names:
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    got.close()


def test_gpt_oss_biases_in_the_raw_view():
    E, H, I = 2, 20, 12
    ex, (gate_up_bias, down_bias) = _experts(E, H, I, "bf16", bias=True, seed=1)
    packed = PackedRegion(ex)
    base = packed.tensor.data_ptr()
    for e in range(E):
        for which, want in (("gate", gate_up_bias[e, :I]), ("up", gate_up_bias[e, I:]), ("down", down_bias[e])):
            r = experts_raw(ex, e, which)
            got = packed.tensor[r.bias - base:r.bias - base + 4 * r.Np].view(torch.float32)
            assert torch.equal(got[:r.N], want) and not got[r.N:].any()  # zero padding


def test_staging_pool_copies_bytes():
    ex = _experts(2, 33, 17, "int8")
    packed = PackedRegion(ex)
    pool = StagingPool(1, packed.layout.expert_bytes, pin=False)
    i, fut = pool.fill(packed.expert(1))
    assert pool.fill(packed.expert(0)) is None  # one buffer only
    fut.result()
    assert torch.equal(pool.view(i, packed.layout.expert_bytes), packed.expert(1))
    pool.release(i)
    assert pool.fill(packed.expert(0)) is not None
    pool.close()


def test_raw_view_errors():
    ex = _experts(2, 8, 8, "bf16")
    with pytest.raises(kn.NativeError) as err:
        experts_raw(ex, 2, "gate")
    assert err.value.code == kn.ERR_RANGE
    with pytest.raises(kn.NativeError) as err:
        experts_raw(ex, 0, "gates")
    assert err.value.code == kn.ERR_RANGE and "not a matrix" in err.value.message
    ffi, lib = kn._native()
    out = ffi.new("ktk_raw *")

    def msg():
        return ffi.string(lib.ktk_last_error()).decode()

    assert lib.ktk_experts_raw(ffi.NULL, 0, 0, out) == kn.ERR_NULL and "'ex' is NULL" in msg()
    assert lib.ktk_experts_raw(ex._p, 0, 0, ffi.NULL) == kn.ERR_NULL and "'out' is NULL" in msg()
    assert lib.ktk_experts_raw(ex._p, -1, 0, out) == kn.ERR_RANGE and "expert = -1" in msg()
    assert lib.ktk_experts_raw(ex._p, 0, 3, out) == kn.ERR_RANGE and "which = 3" in msg()
    base, nbytes = ffi.new("const void **"), ffi.new("int64_t *")
    assert lib.ktk_experts_region(ffi.NULL, base, nbytes) == kn.ERR_NULL
    assert lib.ktk_experts_region(ex._p, ffi.NULL, nbytes) == kn.ERR_NULL
    assert lib.ktk_experts_region(ex._p, base, ffi.NULL) == kn.ERR_NULL
    assert lib.ktk_experts_region(ex._p, base, nbytes) == kn.OK and nbytes[0] == ex.nbytes


def test_int4_moves_packed_too():
    """int4 has a raw view like the others: a dynamic bank keeps its packed region, so re-placement on CUDA copies
    packed bytes (the host path stays the choice on a CPU 'bank', or when asked for)."""
    from ktinject.gpu_experts.hot.rebalance import Rebalancer

    ex = kn.Experts.from_hf(torch.randn(2, 2 * 16, 64), torch.randn(2, 64, 16), quant="int4")
    assert experts_raw(ex, 0, "gate").quant == "int4"
    hot = _hot(ex, torch.bfloat16)
    assert hot.packed is not None and hot.packed.layout.group == ex.group_size
    block = SimpleNamespace(hot=hot, num_experts=2, counts=torch.zeros(2, dtype=torch.int64))
    assert Rebalancer([block]).kinds == ["host"]
    assert Rebalancer([block], transfer="packed").kinds == ["packed"]
    hot.close()
