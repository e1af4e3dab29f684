"""Quantized safetensors checkpoints (FP8 block-scaled, compressed-tensors int4, MXFP4) through from_pretrained.

Each tiny checkpoint is written by ``quantized_checkpoints`` with its float32 dequantization beside it (computed by
the test's own code). A format whose values are quantized again (FP8 or MXFP4 experts into int8 / bf16) must load
bit for bit as that float32 checkpoint loads with the same quant; a format mapped without loss (int4 group 32; MXFP4
experts into mxfp4, the release's bytes as they are) must hold exactly the stored values; and every loaded model is
checked against HF float32 on the dequantized weights.
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


def test_fp8_blocks_of_other_sizes_and_bf16_scales(tmp_path_factory, tmp_path):
    """Blocks of 48 inputs are no native fp8 group (32, 64, 128): such a release loads as int8, requantized."""
    src = _bf16(tmp_path_factory, "qwen3_moe")
    q = qc.write_fp8(src, tmp_path / "q", tmp_path / "ref", block=(16, 48), scale_dtype=torch.bfloat16)
    model = _load(q)  # no quant: the closest native format
    assert {m.quant for m in _experts(model)} == {"int8"}
    assert torch.equal(_logits(model), _logits(_load(tmp_path / "ref", quant="int8")))


def _stored_exactly(model, deq, key_of) -> int:
    """How many expert matrices were compared: each native matrix (ktk_experts_get: e4m3 * scale in float32)
    equals the float32 dequantization the test wrote, bit for bit."""
    n = 0
    for m in _experts(model):
        name = next(n for n, mod in model.named_modules() if mod is m)
        for e in (0, m.num_experts - 1):
            for which in ("gate", "up", "down"):
                assert torch.equal(m.native_experts.get(e, which), key_of(deq, name, e, which)), (name, e, which)
                n += 1
    return n


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_fp8_experts_stay_fp8(tmp_path_factory, family):
    """The default: FP8 experts as released (the bytes and block scales), nothing quantized again."""
    q, ref = _quantized(tmp_path_factory, "fp8", family)
    model = _load(q)
    assert {(m.quant, m.native_experts.group_size) for m in _experts(model)} == {("fp8", 32)}
    assert model._ktinject_load_stats["experts"] == []
    keys = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    assert _stored_exactly(model, qc.read_all(ref),
                           lambda d, name, e, w: d[f"{name}.experts.{e}.{keys[w]}.weight"]) > 0
    hf = _logits(_hf_float32(ref))
    assert (_logits(model) - hf).abs().max() / hf.abs().max() < 0.03  # W8A16: bf16 activations only


def _gpt_oss_want(d, name, e, which):
    """Expert ``e``'s ``which`` matrix [out, in] of a gpt-oss experts module's float tensors in ``d``."""
    if which == "down":
        return d[f"{name}.experts.down_proj"][e].t()
    first = 0 if which == "gate" else 1  # gate_up [H, 2I]: gate at even columns, up at odd ones
    return d[f"{name}.experts.gate_up_proj"][e][:, first::2].t()


def test_mxfp4_experts_stay_mxfp4(tmp_path_factory):
    """The default for an MXFP4 release: mxfp4 experts holding the checkpoint's bytes as they are (e2m1 pairs and
    e8m0 exponents of every output row, 4.25 bits a weight), nothing decoded or quantized again; the model matches
    HF float32 on the dequantized weights."""
    from tests.native.test_mxfp4 import raw_parts

    q, ref = _quantized(tmp_path_factory, "mxfp4", "gpt_oss", intermediate_size=64)
    model = _load(q)
    assert {(m.quant, m.native_experts.group_size) for m in _experts(model)} == {("mxfp4", 32)}
    assert model._ktinject_load_stats["experts"] == []
    stored = qc.read_all(q)  # gate_up_proj_blocks [E, 2I, H/32, 16] (rows interleaved: gate, up), scales [E, 2I, H/32]
    n = 0
    for m in _experts(model):
        name = next(n for n, mod in model.named_modules() if mod is m)
        for e in (0, 1, m.num_experts - 1):
            for which in ("gate", "up", "down"):
                leaf = "down_proj" if which == "down" else "gate_up_proj"
                rows = slice(None) if which == "down" else slice(0 if which == "gate" else 1, None, 2)
                blocks = stored[f"{name}.experts.{leaf}_blocks"][e, rows].flatten(1)
                scales = stored[f"{name}.experts.{leaf}_scales"][e, rows]
                got_b, got_s, raw = raw_parts(m.native_experts, e, which)
                assert raw.quant == "mxfp4"
                assert torch.equal(got_b[:raw.N, :raw.K // 2], blocks), (name, e, which)
                assert torch.equal(got_s[:raw.N, :raw.K // 32], scales), (name, e, which)
                n += 1
    assert n > 0
    assert _stored_exactly(model, qc.read_all(ref), _gpt_oss_want) > 0
    hf = _logits(_hf_float32(ref))
    assert (_logits(model) - hf).abs().max() / hf.abs().max() < 0.03  # W4A16: bf16 activations only


def test_mxfp4_packed_cache_holds_mxfp4(tmp_path_factory, tmp_path):
    q, _ = _quantized(tmp_path_factory, "mxfp4", "gpt_oss", intermediate_size=64)
    load = lambda **kw: ktinject.from_pretrained(q, gpu="cpu", progress=False, dtype=torch.float32,  # noqa: E731
                                                 cache_dir=tmp_path / "cache", **kw)
    first, second = load(), load()
    assert (first._ktinject_load_stats["cache"], second._ktinject_load_stats["cache"]) == ("written", "hit")
    assert {m.quant for m in _experts(second)} == {"mxfp4"}
    for a, b in zip(_experts(first), _experts(second)):
        assert torch.equal(a.native_experts.export(), b.native_experts.export())
    assert torch.equal(_logits(first), _logits(second))
    assert load(quant="fp8")._ktinject_load_stats["cache"] == "written"  # another packing: another entry


def test_mxfp4_experts_are_fp8_exactly(tmp_path_factory):
    """Asked for fp8: MXFP4's e2m1 x 2^e lands in fp8 with groups of 32 without a changed value (blocks of 16 rows
    take their largest power of two; 8 bits a weight); the model matches HF float32 on the dequantized weights."""
    q, ref = _quantized(tmp_path_factory, "mxfp4", "gpt_oss", intermediate_size=64)
    model = _load(q, quant="fp8")
    assert {(m.quant, m.native_experts.group_size) for m in _experts(model)} == {("fp8", 32)}
    assert model._ktinject_load_stats["experts"] == []
    assert _stored_exactly(model, qc.read_all(ref), _gpt_oss_want) > 0
    hf = _logits(_hf_float32(ref))
    assert (_logits(model) - hf).abs().max() / hf.abs().max() < 0.03


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


@pytest.mark.parametrize("quant", ["int8", "int4", "bf16"])
def test_mxfp4_gpt_oss(tmp_path_factory, quant):
    """Asked for another format: bf16 holds the values exactly; int8 / int4 quantize them again, the error
    reported, and load as the float32 dequantization loads with that quant."""
    q, ref = _quantized(tmp_path_factory, "mxfp4", "gpt_oss", intermediate_size=64)
    model = _load(q, quant=quant)
    assert {m.quant for m in _experts(model)} == {quant}
    assert torch.equal(_logits(model), _logits(_load(ref, quant=quant)))
    if quant != "bf16":
        (entry,) = model._ktinject_load_stats["experts"]
        assert entry["from"] == "mxfp4 (e2m1, e8m0 scales per 32)" and entry["to"] == quant
        assert 0 < entry["rel_rms_error"] < (0.02 if quant == "int8" else 0.2)
    hf = _logits(_hf_float32(ref))
    assert (_logits(model) - hf).abs().max() / hf.abs().max() < {"bf16": 0.03, "int8": 0.08, "int4": 0.5}[quant]


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


@pytest.mark.parametrize("choice", ["attention", "mlp", "all"])
def test_dense_fp8_keeps_the_release_bits(tmp_path_factory, choice):
    """dense_fp8: the chosen kinds' FP8 linears become FP8Linear modules holding the checkpoint's bytes and scales
    (here on the CPU: the kernel's torch reference, x rounded to bf16); the rest is dequantized as by default."""
    from safetensors import safe_open

    from ktinject.operators.fp8_linear import FP8Linear, kind_of

    q, ref = _quantized(tmp_path_factory, "fp8", "deepseek_v3")
    model = _load(q, dense_fp8=choice, quant="int8")
    kept = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    kinds = {"attention", "mlp"} if choice == "all" else {choice}
    assert kept and {kind_of(n) for n in kept} == kinds
    plain = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear and kind_of(n) in kinds]
    assert all(not n.startswith("model.layers.") or "experts" in n or n.endswith("gate") for n in plain), plain
    stored = {}
    for f in q.glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            stored.update({k: fh.get_tensor(k) for k in fh.keys() if k.endswith((".weight", ".weight_scale_inv"))})
    for name, m in list(kept.items())[:6]:
        assert torch.equal(m.weight.view(torch.uint8), stored[f"{name}.weight"].view(torch.uint8)), name
        assert torch.equal(m.weight_scale_inv, stored[f"{name}.weight_scale_inv"].float()), name
        # the module's product: x rounded to bf16 (the kernel's A16), the dequantized weight in float32
        x = torch.randn(3, m.in_features)
        w = stored[f"{name}.weight"].float() * m.weight_scale_inv.repeat_interleave(32, 0).repeat_interleave(32, 1)[
            :m.out_features, :m.in_features]
        want = x.to(torch.bfloat16).float() @ w.t()
        assert torch.allclose(m(x), want, rtol=1e-5, atol=1e-5), name
    # a bf16-rounded activation can flip a routing choice of these tiny random models: the bound is loose
    hf = _logits(_hf_float32(ref))
    assert (_logits(model) - hf).abs().max() / hf.abs().max() < 0.2


def test_dense_fp8_bad_choice_is_named(tmp_path_factory):
    q, _ = _quantized(tmp_path_factory, "fp8", "qwen3_moe")
    with pytest.raises(LoadError, match=r"dense_fp8='some'.*none, attention, mlp, all"):
        _load(q, dense_fp8="some", quant="int8")
