"""The one-pass dequant kernel of streamed prefill (ktinject.operators.kernels.dequant) against upload.py's torch ops and
ktk_experts_get: bit for bit, every quant, int4 at group sizes 32, 64 and 128, shapes that are not multiples of the
16 x 64 packing nor of the kernel's 32 x 128 tiles, one expert, strided packed rows and strided destinations.

On CUDA (the GPU machine) or, with ``TRITON_INTERPRET=1``, in Triton's interpreter on CPU tensors (the interpreter's
float32 -> bf16 cast truncates; tests/operators/test_fused_kernels.py patches it to the GPU's round to nearest even). Skipped
where neither is possible (CI without Triton). The sm_90 compile check runs where Triton is but no GPU is.

Legend: E experts, n unpacked at once, H hidden, I intermediate, G int4 group size.
"""
from __future__ import annotations

import pytest
import torch

from ktinject import native as kn
from ktinject.operators.kernels import dequant
from ktinject.gpu_experts.hot import upload
from ktinject.gpu_experts.hot.upload import PackedRegion, expert_layout
from ktinject.operators.kernels import common as fused
# the decode kernels' fixture: "cuda", or "cpu" under TRITON_INTERPRET=1 with the interpreter's bf16 rounding fixed
from tests.operators.test_fused_kernels import dev  # noqa: F401

BF = torch.bfloat16
SHAPES = [(3, 130, 70), (2, 200, 96), (1, 16, 64), (2, 64, 16), (2, 1, 1), (3, 37, 21)]  # (E, H, I)
CASES = [("int4", 32), ("int4", 64), ("int4", 128), ("int8", 0), ("bf16", 0), ("fp8", 128), ("fp8", 32)]


def _experts(E, H, I, quant, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    return kn.Experts.from_hf(torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g), quant=quant,
                              group_size=group or 64)


def _torch_path(rows, lay, gate_up, down):
    """upload.py's torch ops (unpack_matrix has no kernel hook), on CPU copies."""
    rows, I = rows.cpu(), lay.mats[0].N
    work = torch.empty(rows.shape[0] * lay.work_bytes, dtype=torch.uint8)
    for m, dst in zip(lay.mats, (gate_up[:, :I], gate_up[:, I:], down)):
        upload.unpack_matrix(rows, m, lay.quant, dst, work, lay.group)


@pytest.mark.parametrize("quant, group", CASES)
@pytest.mark.parametrize("E, H, I", SHAPES)
def test_kernel_equals_torch_path(dev, quant, group, E, H, I):
    """Every other expert of the packed region (strided rows; one expert where E <= 2) into destinations with a
    gap between experts: the same bits as the torch path and as ktk_experts_get rounded to bf16."""
    ex = _experts(E, H, I, quant, group, seed=E * H + I + group)
    lay = expert_layout(ex)
    assert lay.group == group
    rows = PackedRegion(ex).tensor.view(E, lay.expert_bytes)[::2].to(dev)
    n = rows.shape[0]
    gate_up = torch.full((n, 2 * I + 3, H), float("nan"), dtype=BF, device=dev)[:, 1:2 * I + 1]
    down = torch.full((n + 1, H, I), float("nan"), dtype=BF, device=dev)[1:]
    dequant.unpack_experts(rows, lay, gate_up, down)
    ref_gu = torch.empty(n, 2 * I, H, dtype=BF)
    ref_d = torch.empty(n, H, I, dtype=BF)
    _torch_path(rows, lay, ref_gu, ref_d)
    assert torch.equal(gate_up.cpu(), ref_gu) and torch.equal(down.cpu(), ref_d)
    for j, e in enumerate(range(0, E, 2)):
        assert torch.equal(ref_gu[j, :I], ex.get(e, "gate").to(BF))
        assert torch.equal(ref_d[j], ex.get(e, "down").to(BF))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("quant, group", [("int4", 32), ("int8", 0), ("bf16", 0)])
def test_kernel_other_destination_dtypes(dev, quant, group, dtype):
    ex = _experts(2, 130, 70, quant, group, seed=5)
    lay = expert_layout(ex)
    rows = PackedRegion(ex).tensor.view(2, lay.expert_bytes).to(dev)
    gate_up = torch.empty(2, 140, 130, dtype=dtype, device=dev)
    down = torch.empty(2, 130, 70, dtype=dtype, device=dev)
    dequant.unpack_experts(rows, lay, gate_up, down)
    ref_gu, ref_d = torch.empty(2, 140, 130, dtype=dtype), torch.empty(2, 130, 70, dtype=dtype)
    _torch_path(rows, lay, ref_gu, ref_d)
    assert torch.equal(gate_up.cpu(), ref_gu) and torch.equal(down.cpu(), ref_d)


def test_bad_calls_name_the_problem():
    ex = _experts(2, 64, 32, "int4", 64)
    lay = expert_layout(ex)
    rows = PackedRegion(ex).tensor.view(2, lay.expert_bytes)
    m = lay.mats[0]
    with pytest.raises(ValueError, match="quant 'fp4'"):
        dequant.unpack_matrix(rows, m, "fp4", torch.empty(2, m.N, m.K, dtype=BF))
    with pytest.raises(ValueError, match=r"dst \[2, 32, 63\]"):
        dequant.unpack_matrix(rows, m, "int4", torch.empty(2, m.N, m.K - 1, dtype=BF), lay.group)
    with pytest.raises(ValueError, match="group size 48"):
        dequant.unpack_matrix(rows, m, "int4", torch.empty(2, m.N, m.K, dtype=BF), 48)
    with pytest.raises(ValueError, match="contiguous rows"):
        dequant.unpack_matrix(rows, m, "int4", torch.empty(2, m.K, m.N, dtype=BF).transpose(1, 2), lay.group)
    assert not dequant.usable(rows, torch.empty(2, 4, 4, dtype=BF))  # CPU tensors: the torch path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quant, group", CASES)
def test_unpack_experts_uses_the_kernel_on_cuda(monkeypatch, quant, group):
    """At Qwen3-30B-A3B's expert shapes: upload.unpack_experts on CUDA runs the kernel (when usable) and gives the
    bits of KTINJECT_FUSED=0's torch path."""
    ex = _experts(4, 2048, 768, quant, group, seed=2)
    lay = expert_layout(ex)
    rows = PackedRegion(ex).tensor.view(4, lay.expert_bytes).cuda()
    work = torch.empty(4 * lay.work_bytes, dtype=torch.uint8, device="cuda")
    out = {}
    for env in ("0", "1"):
        monkeypatch.setenv("KTINJECT_FUSED", env)
        gate_up = torch.full((4, 2 * 768, 2048), float("nan"), dtype=BF, device="cuda")
        down = torch.full((4, 2048, 768), float("nan"), dtype=BF, device="cuda")
        upload.unpack_experts(rows, lay, gate_up, down, work)
        out[env] = (gate_up, down)
    assert dequant.usable(rows, *out["1"]), "Triton missing on the GPU machine: the kernel is not checked"
    assert torch.equal(out["0"][0], out["1"][0]) and torch.equal(out["0"][1], out["1"][1])
    assert torch.equal(out["1"][1][3].cpu(), ex.get(3, "down").to(BF))


def test_kernel_compiles_for_sm90():
    """Where Triton is installed but no GPU is (and not interpreting): the kernel compiles for sm_90 at the model's
    shapes, every quant, without register spills (as tests/operators/test_fused_kernels.py checks the decode kernels)."""
    if fused.triton_language() is None or fused.interpreting() or torch.cuda.is_available():
        pytest.skip("needs Triton without a GPU and without TRITON_INTERPRET")
    import subprocess
    import tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = dequant._kernel()
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    # what Triton's launcher sees at Qwen3-30B-A3B's shapes: pointers, sizes and strides divisible by 16
    div = ("src", "scale", "dst", "K", "Kp", "s_src", "s_scale", "s_de", "s_dn")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in div}
    for quant, src in (("int4", "*i8"), ("int8", "*i8"), ("bf16", "*bf16")):
        for out in ("*bf16", "*fp32"):
            consts = dict(QUANT=dequant.QUANT_CODE[quant], G=64, BN=dequant.BN, BK=dequant.BK)
            sig = {a: "constexpr" if a in consts else {"src": src, "scale": "*fp32", "dst": out}.get(a, "i32")
                   for a in fn.arg_names}
            k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": dequant.WARPS})
            # 16-byte stores: the kernel is bound by writing dst, and scalar stores would multiply its L2 traffic
            assert "st.global.v4.b32" in k.asm["ptx"] and "st.global.b16" not in k.asm["ptx"], (quant, out)
            if cuobjdump.exists():
                cubin = Path(tempfile.mkdtemp()) / "k.cubin"
                cubin.write_bytes(k.asm["cubin"])
                sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True).stdout
                assert "STL" not in sass, f"{quant} -> {out} spills registers"
