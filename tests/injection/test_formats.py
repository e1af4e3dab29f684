"""Quantized safetensors checkpoints (FP8 block-scaled, compressed-tensors int4, MXFP4) through from_pretrained.

Each tiny checkpoint is written by ``quantized_checkpoints`` with its float32 dequantization beside it (computed by
the test's own code). A format whose values are quantized again (FP8 or MXFP4 experts into int8 / bf16) must load
bit for bit as that float32 checkpoint loads with the same quant; a format mapped without loss (int4 group 32) must
hold exactly the stored values; and every loaded model is checked against HF float32 on the dequantized weights.
Damaged, inconsistent or mislabelled files give an error naming file and tensor.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import ktinject
from ktinject.injection.loading import LoadError
from ktinject.tiny_models import build_tiny_model, tiny_prompts
from tests.injection import quantized_checkpoints as qc

_CACHE: dict = {}


def _bf16(tmp_path_factory, family: str, **overrides):
    key = ("bf16", family, tuple(sorted(overrides.items())))
    if key not in _CACHE:
        d = tmp_path_factory.mktemp(f"bf16-{family}")
        build_tiny_model(family, seed=1, dtype=torch.bfloat16, **overrides).save_pretrained(d)
        _CACHE[key] = d
    return _CACHE[key]


def _quantized(tmp_path_factory, fmt: str, family: str, **overrides):
    """(quantized checkpoint, its float32 dequantization), written once per session."""
    key = (fmt, family, tuple(sorted(overrides.items())))
    if key not in _CACHE:
        src = _bf16(tmp_path_factory, family, **overrides)
        root = tmp_path_factory.mktemp(f"{fmt}-{family}")
        writer = {"fp8": qc.write_fp8, "ct-int4": qc.write_compressed_int4, "mxfp4": qc.write_mxfp4}[fmt]
        _CACHE[key] = (writer(src, root / "q", root / "ref"), root / "ref")
    return _CACHE[key]


def _load(d, **kw):
    return ktinject.from_pretrained(d, gpu="cpu", cache_dir=False, progress=False, dtype=torch.float32, **kw)


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    return model(tiny_prompts(2, 9, seed=5)).logits


@torch.no_grad()
def _hf_float32(ref):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    return model.eval()


def _experts(model):
    from ktinject.operators.moe import HybridMoE

    return [m for m in model.modules() if isinstance(m, HybridMoE)]


FP8_CASES = [("qwen3_moe", "int8"), ("deepseek_v3", "int8"), ("mixtral", "bf16"), ("qwen3_moe", "int4")]


@pytest.mark.parametrize("family,quant", FP8_CASES)
def test_fp8_loads_as_its_float32_dequantization(tmp_path_factory, family, quant):
    q, ref = _quantized(tmp_path_factory, "fp8", family)
    model = _load(q, quant=quant)
    want = _load(ref, quant=quant)
    assert torch.equal(_logits(model), _logits(want))
    stats = model._ktinject_load_stats
    assert stats["formats"] == ["fp8 e4m3, 32x32 block scales"]
    if quant != "bf16":  # requantized: the error is measured and reported
        (entry,) = stats["experts"]
        assert entry["to"] == quant and 0 < entry["rel_rms_error"] < (0.02 if quant == "int8" else 0.2)
    hf = _logits(_hf_float32(ref))
    got = _logits(model)
    tol = {"bf16": 0.03, "int8": 0.08, "int4": 0.5}[quant]
    assert (got - hf).abs().max() / hf.abs().max() < tol


def test_fp8_default_format_and_bf16_scales(tmp_path_factory, tmp_path):
    src = _bf16(tmp_path_factory, "qwen3_moe")
    q = qc.write_fp8(src, tmp_path / "q", tmp_path / "ref", block=(16, 48), scale_dtype=torch.bfloat16)
    model = _load(q)  # no quant: the release's format, int8 for FP8 experts
    assert {m.quant for m in _experts(model)} == {"int8"}
    assert torch.equal(_logits(model), _logits(_load(tmp_path / "ref", quant="int8")))


def test_compressed_int4_is_stored_exactly(tmp_path_factory):
    q, ref = _quantized(tmp_path_factory, "ct-int4", "deepseek_v3")
    model = _load(q)  # default: int4 group 32, the stored values
    blocks = _experts(model)
    assert blocks and {(m.quant, m.native_experts.group_size) for m in blocks} == {("int4", 32)}
    assert model._ktinject_load_stats["experts"] == []  # nothing quantized again
    deq = qc.read_all(ref)
    for m in blocks:
        name = next(n for n, mod in model.named_modules() if mod is m)
        for e in (0, m.num_experts - 1):
            for which, key in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                want = deq[f"{name}.experts.{e}.{key}.weight"]
                assert torch.equal(m.native_experts.get(e, which), want), (name, e, which)
    hf = _logits(_hf_float32(ref))
    assert (_logits(model) - hf).abs().max() / hf.abs().max() < 0.08  # W4A8: int8 activations only
    # asked for int8: quantized again from the stored values, the error reported
    m8 = _load(q, quant="int8")
    assert torch.equal(_logits(m8), _logits(_load(ref, quant="int8")))
    assert m8._ktinject_load_stats["experts"][0]["from"] == "compressed-tensors int4, group 32"


@pytest.mark.parametrize("quant", ["int8", "bf16"])
def test_mxfp4_gpt_oss(tmp_path_factory, quant):
    q, ref = _quantized(tmp_path_factory, "mxfp4", "gpt_oss", intermediate_size=64)
    model = _load(q, quant=quant)
    assert torch.equal(_logits(model), _logits(_load(ref, quant=quant)))
    hf = _logits(_hf_float32(ref))
    assert (_logits(model) - hf).abs().max() / hf.abs().max() < (0.03 if quant == "bf16" else 0.08)


def test_mxfp4_bf16_experts_hold_the_values_exactly(tmp_path_factory):
    """e2m1 x 2^e has at most 2 significant bits: bf16 experts hold every MXFP4 value exactly."""
    q, ref = _quantized(tmp_path_factory, "mxfp4", "gpt_oss", intermediate_size=64)
    model = _load(q, quant="bf16")
    deq = qc.read_all(ref)
    for m in _experts(model):
        name = next(n for n, mod in model.named_modules() if mod is m)
        gate_up = deq[f"{name}.experts.gate_up_proj"][3]  # [H, 2I], gate at even columns
        assert torch.equal(m.native_experts.get(3, "gate"), gate_up[:, 0::2].t())
        assert torch.equal(m.native_experts.get(3, "down"), deq[f"{name}.experts.down_proj"][3].t())


# ---------------------------------------------------------------------------------------------- errors


def _edit_shard(d, key_part: str, edit):
    for f in sorted(d.glob("*.safetensors")):
        tensors = load_file(f)
        hit = [k for k in tensors if key_part in k]
        if hit:
            edit(tensors, hit[0])
            save_file(tensors, f, metadata={"format": "pt"})
            return hit[0], f
    raise AssertionError(key_part)


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _quantization_config(d) -> dict:
    return json.loads((d / "config.json").read_text())["quantization_config"]


def _set_quantization_config(d, qconf: dict) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = qconf
    (d / "config.json").write_text(json.dumps(cfg))


def test_fp8_scales_of_another_block_size_are_refused(tmp_path_factory, tmp_path):
    q, _ = _quantized(tmp_path_factory, "fp8", "qwen3_moe")
    d = _copy(q, tmp_path / "q")
    _set_quantization_config(d, dict(_quantization_config(d), weight_block_size=[16, 16]))
    with pytest.raises(LoadError, match=r"weight_scale_inv|fp8 e4m3.*needs stored parts"):
        _load(d)


def test_config_and_tensors_must_agree(tmp_path_factory, tmp_path):
    q, _ = _quantized(tmp_path_factory, "fp8", "qwen3_moe")
    d = _copy(q, tmp_path / "q")
    _set_quantization_config(d, {"quant_method": "mxfp4", "weight_block_size": [32, 32]})
    with pytest.raises(LoadError, match=r"says 'mxfp4' but the tensors hold fp8"):
        _load(d)
    _set_quantization_config(d, {"quant_method": "awq", "bits": 4, "weight_block_size": [32, 32]})
    with pytest.raises(LoadError, match=r"quant_method 'awq'.*compressed-tensors, fp8, mxfp4"):
        _load(d)


def test_damaged_quantized_tensors_are_named(tmp_path_factory, tmp_path):
    q, _ = _quantized(tmp_path_factory, "ct-int4", "qwen3_moe")
    d = _copy(q, tmp_path / "a")
    key, f = _edit_shard(d, "weight_shape", lambda t, k: t.__setitem__(k, torch.tensor([7, 3])))
    with pytest.raises(LoadError, match=rf"weight_shape \[7, 3\] does not fit"):
        _load(d)
    d = _copy(q, tmp_path / "b")
    key, f = _edit_shard(d, "gate_proj.weight_scale", lambda t, k: t.__setitem__(k, t[k][:, :1].contiguous()))
    with pytest.raises(LoadError, match=r"gate_proj.weight.*groups of 64.*declares \[\(4, 32\)\]"):
        _load(d)
    q, _ = _quantized(tmp_path_factory, "mxfp4", "gpt_oss", intermediate_size=64)
    d = _copy(q, tmp_path / "c")
    _edit_shard(d, "gate_up_proj_scales", lambda t, k: t.__setitem__(k, t[k][:, :-1].contiguous()))
    with pytest.raises(LoadError, match=r"gate_up_proj_blocks.*do not match"):
        _load(d)


def test_inject_on_transformers_quantized_modules_names_from_pretrained():
    from ktinject.injection.apply import InjectError

    model = build_tiny_model("qwen3_moe")
    model.hf_quantizer = object()  # what transformers sets when it built its own FP8 / MXFP4 modules (on a GPU)
    model.config.quantization_config = {"quant_method": "fp8"}
    with pytest.raises(InjectError, match=r"quant_method 'fp8'.*ktinject.from_pretrained"):
        ktinject.inject(model, gpu="cpu")
