"""The rmsnorm operator (and the attention operator's fused norms) against the unmodified HF RMSNorm modules."""
from __future__ import annotations

import importlib

import pytest
import torch

from ktinject.operators.base import OperatorError
from ktinject.operators.norm import (KNOWN, ZERO_CENTERED, FusedRMSNorm, RMSNormOperator, ZeroCenteredRMSNorm, fuse,
                                     fuse_children)

FAMILY_OF = {"Qwen3MoeRMSNorm": "qwen3_moe", "Qwen2MoeRMSNorm": "qwen2_moe", "MixtralRMSNorm": "mixtral",
             "OlmoeRMSNorm": "olmoe", "DeepseekV2RMSNorm": "deepseek_v2", "DeepseekV3RMSNorm": "deepseek_v3",
             "Glm4MoeRMSNorm": "glm4_moe", "GptOssRMSNorm": "gpt_oss", "MiniMaxM2RMSNorm": "minimax_m2",
             "Glm4MoeLiteRMSNorm": "glm4_moe_lite", "Ernie4_5_MoeRMSNorm": "ernie4_5_moe",
             "HunYuanMoEV1RMSNorm": "hunyuan_v1_moe", "Dots1RMSNorm": "dots1", "DeepseekV32RMSNorm": "deepseek_v32",
             "GlmMoeDsaRMSNorm": "glm_moe_dsa", "DeepseekV4RMSNorm": "deepseek_v4"}
ZERO_CENTERED_FAMILY_OF = {"Qwen3NextRMSNorm": "qwen3_next", "Qwen3_5MoeRMSNorm": "qwen3_5_moe"}


def hf_norm(cls_name: str, hidden: int, eps: float = 1e-6):
    fam = FAMILY_OF[cls_name]
    mod = importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")
    norm = getattr(mod, cls_name)(hidden, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(hidden, generator=torch.Generator().manual_seed(5)))
    return norm


def test_known_is_every_family():
    assert set(FAMILY_OF) == KNOWN


@pytest.mark.parametrize("cls_name", sorted(KNOWN))
@pytest.mark.parametrize("shape", [(1, 1, 37), (2, 5, 64), (3, 200)])
def test_fused_equals_hf(cls_name, shape):
    """float32: equal to HF to rounding; bf16: within one bf16 ulp of HF and no further from float64 than HF."""
    H = shape[-1]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(H)) * 3
    for dtype in (torch.float32, torch.bfloat16):
        norm = hf_norm(cls_name, H).to(dtype)
        fused = fuse(norm)
        assert isinstance(fused, FusedRMSNorm) and fused.weight is norm.weight
        xd = x.to(dtype)
        with torch.no_grad():
            ref = norm(xd)
            got = fused(xd)
        assert got.dtype == ref.dtype == dtype and got.shape == ref.shape
        x64, w64 = xd.double(), norm.weight.double()
        truth = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        else:
            ulp = truth.abs().clamp_min(1e-3) * 2 ** -7
            assert ((got.double() - ref.double()).abs() <= 1.01 * ulp).all()
            err_f = (got.double() - truth).norm() / truth.norm()
            err_h = (ref.double() - truth).norm() / truth.norm()
            assert err_f <= err_h * 1.05


@pytest.mark.parametrize("cls_name", sorted(ZERO_CENTERED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centered_equals_hf(cls_name, dtype):
    """(1 + weight) * normalize(x) in float32, cast back (Qwen3-Next, Qwen3.5): HF's arithmetic in its order, so
    equal to rounding in float32 and within one bf16 ulp in bf16; never taken by the decode layer's fused norm."""
    from ktinject.operators.norm import fuse_problem
    from ktinject.tiny_models import missing_reason

    fam = ZERO_CENTERED_FAMILY_OF[cls_name]
    if missing_reason(fam):
        pytest.skip(missing_reason(fam))
    mod = importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")
    H = 44
    norm = getattr(mod, cls_name)(H, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.3 * torch.randn(H, generator=torch.Generator().manual_seed(5)))
    norm = norm.to(dtype)
    fused = fuse(norm)
    assert isinstance(fused, ZeroCenteredRMSNorm) and not isinstance(fused, FusedRMSNorm)
    assert fused.weight is norm.weight and fuse_problem(norm) is not None
    x = (torch.randn(3, 5, H, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    with torch.no_grad():
        ref, got = norm(x), fused(x)
    assert got.dtype == ref.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


def test_mixed_dtypes_fall_back_to_the_hf_formula():
    norm = hf_norm("Qwen3MoeRMSNorm", 48)  # float32 weight
    x = torch.randn(4, 48).to(torch.bfloat16)
    with torch.no_grad():
        got = fuse(norm)(x)
    assert got.dtype == torch.bfloat16
    x32 = x.float()
    want = (norm.weight * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).bfloat16()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_unknown_norm_refused_with_its_name():
    ln = torch.nn.LayerNorm(16)
    with pytest.raises(OperatorError, match=r"rmsnorm: cannot take module 'model.norm' \(LayerNorm\).*known"):
        RMSNormOperator.check(ln, "model.norm", {})


def test_injected_model_uses_fused_norms_and_keeps_keys():
    from ktinject import inject
    from ktinject.tiny_models import build_tiny_model

    model = build_tiny_model("qwen3_moe", seed=0, dtype=torch.bfloat16)
    keys = set(model.state_dict())
    plan = inject(model, gpu="cpu")
    ops = {e.name: e.operator for e in plan.operator_entries()}
    assert ops["model.norm"] == "rmsnorm" and ops["model.layers.0.input_layernorm"] == "rmsnorm"
    fused = [n for n, m in model.named_modules() if isinstance(m, FusedRMSNorm)]
    L = model.config.num_hidden_layers
    assert len(fused) == 4 * L + 1  # input, post-attention, q and k norm per layer; the final norm
    assert not [n for n, m in model.named_modules() if type(m).__name__ in KNOWN]
    assert set(model.state_dict()) == {k for k in keys if ".experts." not in k}  # experts live in native memory


def test_fuse_children_counts():
    from ktinject.tiny_models import build_tiny_model

    model = build_tiny_model("deepseek_v3", seed=0)
    attn = model.model.layers[0].self_attn
    before = sum(type(m).__name__ == "DeepseekV3RMSNorm" for m in attn.modules())
    assert before >= 1 and fuse_children(attn) == before
    assert sum(isinstance(m, FusedRMSNorm) for m in attn.modules()) == before
