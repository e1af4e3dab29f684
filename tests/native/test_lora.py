"""The LoRA adapters' terms of routed rows (ktk_experts_lora / ktk_experts_lora_backward, ``Experts.lora`` /
``lora_backward``): t = A_e z, y += B_e t, and dt, dz, dA_e, dB_e, against float64 torch on awkward shapes (sizes
off every multiple of 16, rank 1 and 3, one row, experts with no rows, every row on one expert, rows unsorted);
on every ISA here (each ISA's dot and axpy loops, the generic ones elsewhere); bit-equal on one and two pool threads;
R = 0; errors.

Tolerance: float32 sums of at most a few hundred products against float64 (relative Frobenius 1e-5); a wrong
expert, transpose or missing scale is off by order 1.
Legend: R rows, E experts, K, N: the matrix's inputs and outputs.
"""
from __future__ import annotations

import pytest
import torch

from ktinject import native as kn
from tests.native.test_project import make, on_isa, rows  # noqa: F401  (on_isa: a fixture)

ISAS = kn.available_isas()

TOL = 1e-5
# (E, H, I); the last two past one 256-column block of the sums, with ranks past one 8-row block of the ISA loops
SHAPES = [(6, 100, 72), (3, 40, 17), (9, 130, 50)]
WIDE = [((5, 300, 530), 17), ((4, 513, 257), 9)]


def rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def adapters(ex, which, rank, seed=1):
    g = torch.Generator().manual_seed(seed)
    n_out, n_in = ex.shape(which)
    return (torch.randn(ex.num_experts, rank, n_in, generator=g),
            torch.randn(ex.num_experts, n_out, rank, generator=g) / rank)


def reference(a, b, ids, z, y0, dy):
    """float64: t, y and, for dy, (dz, dt, da, db) by autograd."""
    a64, b64 = a.double().requires_grad_(), b.double().requires_grad_()
    z64 = z.double().requires_grad_()
    t = torch.einsum("rjk,rk->rj", a64[ids], z64)
    y = y0.double() + torch.einsum("rnj,rj->rn", b64[ids], t)
    t.retain_grad()
    y.backward(dy.double())
    return t.detach(), y.detach(), z64.grad, t.grad, a64.grad, b64.grad


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["one", "one_expert", "random"])
@pytest.mark.parametrize("rank", [1, 3, 8])
@pytest.mark.parametrize("which", ["gate", "down"])
@pytest.mark.parametrize("shape", SHAPES)
def test_lora_matches_float64_autograd(on_isa, shape, which, rank, kind, isa):
    on_isa(isa)
    ex, _ = make(*shape, "bf16")
    a, b = adapters(ex, which, rank)
    ids = rows(kind, ex.num_experts)
    n_out, n_in = ex.shape(which)
    g = torch.Generator().manual_seed(2)
    z, y0, dy = (torch.randn(len(ids), n, generator=g) for n in (n_in, n_out, n_out))
    y = y0.clone()
    t = ex.lora(which, z, ids, a, b, y)
    t_ref, y_ref, dz_ref, dt_ref, da_ref, db_ref = reference(a, b, ids, z, y0, dy)
    assert rel(t, t_ref) < TOL and rel(y, y_ref) < TOL
    dz, dt, da, db = ex.lora_backward(which, z, t, dy, ids, a, b)
    assert rel(dt, dt_ref) < TOL and rel(dz, dz_ref) < TOL
    assert rel(da, da_ref) < TOL and rel(db, db_ref) < TOL
    idle = torch.ones(ex.num_experts, dtype=torch.bool)
    idle[ids] = False
    assert torch.count_nonzero(da[idle]) == 0 and torch.count_nonzero(db[idle]) == 0  # experts without rows


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("which", ["up", "down"])
@pytest.mark.parametrize("shape,rank", WIDE)
def test_wide_matrices_and_ranks(on_isa, shape, rank, which, isa):
    on_isa(isa)
    ex, _ = make(*shape, "bf16")
    a, b = adapters(ex, which, rank)
    ids = rows("random", ex.num_experts)
    n_out, n_in = ex.shape(which)
    g = torch.Generator().manual_seed(4)
    z, y0, dy = (torch.randn(len(ids), n, generator=g) for n in (n_in, n_out, n_out))
    y = y0.clone()
    t = ex.lora(which, z, ids, a, b, y)
    want = reference(a, b, ids, z, y0, dy)
    for got, ref in zip((t, y, *ex.lora_backward(which, z, t, dy, ids, a, b)), (want[0], want[1], *want[2:])):
        assert rel(got, ref) < TOL


def test_outputs_are_float32_whatever_the_default_dtype():
    ex, _ = make(3, 40, 17, "bf16")
    a, b = adapters(ex, "gate", 2)
    ids, z, y = torch.tensor([0, 2, 2]), torch.randn(3, 40), torch.zeros(3, 17)
    want = torch.einsum("rjk,rk->rj", a[ids], z)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        t = ex.lora("gate", z, ids, a, b, y)
        dz, dt, _, _ = ex.lora_backward("gate", z, t, y, ids, a, b)
    finally:
        torch.set_default_dtype(before)
    assert t.dtype == dz.dtype == dt.dtype == torch.float32 and rel(t, want.double()) < TOL


def test_threads_give_the_same_bits_and_no_rows_zero_the_gradients():
    ex, _ = make(9, 130, 50, "int8")
    a, b = adapters(ex, "up", 4)
    ids = torch.randint(0, 9, (300,), generator=torch.Generator().manual_seed(3))
    z, dy = torch.randn(300, 130), torch.randn(300, 50)
    out = []
    with kn.Pool(1) as one, kn.Pool(2) as two:
        for pool in (one, two):
            y = torch.zeros(300, 50)
            t = ex.lora("up", z, ids, a, b, y, pool=pool)
            out.append((t, y, *ex.lora_backward("up", z, t, dy, ids, a, b, pool=pool)))
    for x1, x2 in zip(*out):
        assert torch.equal(x1, x2)
    empty = torch.zeros(0, dtype=torch.int64)
    y = torch.zeros(0, 50)
    t = ex.lora("up", torch.zeros(0, 130), empty, a, b, y)
    assert t.shape == (0, 4)
    dz, dt, da, db = ex.lora_backward("up", torch.zeros(0, 130), t, y, empty, a, b)
    assert dz.shape == (0, 130) and not da.any() and not db.any()


def test_errors():
    ex, _ = make(3, 40, 17, "bf16")
    a, b = adapters(ex, "gate", 2)
    z, y = torch.randn(4, 40), torch.zeros(4, 17)
    with pytest.raises(kn.NativeError, match="out of range"):
        ex.lora("gate", z, torch.tensor([0, 1, 3, 0]), a, b, y)
    with pytest.raises(kn.NativeError, match="expected shape"):
        ex.lora("down", z, torch.tensor([0, 1, 2, 0]), a, b, y)  # down takes [R, 17]
    with pytest.raises(kn.NativeError, match="dtype"):
        ex.lora("gate", z.double(), torch.tensor([0, 1, 2, 0]), a, b, y)
    with pytest.raises(kn.NativeError, match="rank"):
        ex.lora("gate", z, torch.tensor([0, 1, 2, 0]), a[:, :0], b[:, :, :0], y)
    with pytest.raises(kn.NativeError, match="contiguous"):
        ex.lora("gate", z, torch.tensor([0, 1, 2, 0]), a, b, torch.zeros(17, 4).T)
