"""GGUF files through from_pretrained: config from the metadata, names, ggml codecs, split sets, errors, tokenizer.

Each tiny GGUF is written by ``gguf_checkpoints`` from a tiny HF model (gguf-py's names, quantize and dequantize);
the oracle is that model in float32 holding the GGUF's own dequantized values (``gguf.quants.dequantize``).
Bounds on max |logits - oracle| / max |oracle| (measured on these files in brackets): F16 experts in bf16 0.03
(0.002); Q8_0 requantized into int8 0.08 (0.007); Q4_0 into int4 group 32, the stored values exactly, 0.05
(0.005: the int8 activations of W4A8); Q4_K_M (Q4_K + Q6_K) requantized into int4 0.25 (0.06), into int8 0.08
(0.012). Non-expert tensors equal the dequantized values exactly.
"""
from __future__ import annotations

import shutil
import struct

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import ktinject  # noqa: E402
from ktinject.injection.formats import open_checkpoint  # noqa: E402
from ktinject.injection.formats.gguf_codecs import GGMLCodec  # noqa: E402
from ktinject.injection.loading import LoadError  # noqa: E402
from ktinject.tiny_models import build_tiny_model, tiny_prompts  # noqa: E402
from tests.injection import gguf_checkpoints as gw  # noqa: E402

Q = gguf.GGMLQuantizationType
_CACHE: dict = {}


def _model(family: str, **overrides):
    key = (family, tuple(sorted(overrides.items())))
    if key not in _CACHE:
        _CACHE[key] = build_tiny_model(family, seed=1, **overrides).eval()
    return _CACHE[key]


def _experts_as(qtype, rest=Q.F16):
    return lambda name, x: qtype if "_exps" in name else rest


def _q4_k_m(name, x):
    """Q4_K_M's mix: down experts Q6_K, gate / up Q4_K; attention and dense Q4_K, the output Q6_K."""
    if x.shape[-1] % 256:
        return Q.Q8_0
    return Q.Q6_K if ("ffn_down" in name or name == "output.weight") else Q.Q4_K


_K_SIZES = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, num_experts=4, num_hidden_layers=2)


def _written(tmp_path_factory, family, qtype_of, tag, overrides=(), **kw):
    key = ("gguf", family, tag, overrides, tuple(sorted(kw.items())))
    if key not in _CACHE:
        d = tmp_path_factory.mktemp(f"gguf-{family}-{tag}")
        weights = gw.write_gguf(_model(family, **dict(overrides)), d / "model.gguf", qtype_of, **kw)
        files = sorted(d.glob("*.gguf"))
        _CACHE[key] = (files[0], weights)
    return _CACHE[key]


def _load(path, **kw):
    return ktinject.from_pretrained(path, gpu="cpu", cache_dir=False, progress=False, dtype=torch.float32, **kw)


@torch.no_grad()
def _logits(model):
    return model(tiny_prompts(2, 9, seed=5)).logits


def _rel(got, want):
    return float((got - want).abs().max() / want.abs().max())


def _blocks(model):
    from ktinject.operators.moe import HybridMoE

    return [(n, m) for n, m in model.named_modules() if isinstance(m, HybridMoE)]


_OVERRIDES = {"mixtral": (("intermediate_size", 64),)}  # (the tiny one's 40 is not whole blocks of 32)
CASES = [  # family, expert type, other tensors, quant asked (None: the default), bound
    ("qwen3_moe", Q.Q8_0, Q.Q8_0, None, 0.08),
    ("qwen3_moe", Q.Q4_0, Q.F16, None, 0.05),  # the stored int4 values: only the int8 activations differ
    ("qwen3_moe", Q.F16, Q.F16, "bf16", 0.03),
    ("qwen2_moe", Q.Q8_0, Q.F16, None, 0.08),
    ("mixtral", Q.Q4_0, Q.Q8_0, "int8", 0.08),
]


@pytest.mark.parametrize("family,experts,rest,quant,bound", CASES)
def test_loads_as_the_gguf_dequantized_model(tmp_path_factory, family, experts, rest, quant, bound):
    over = _OVERRIDES.get(family, ())
    f, weights = _written(tmp_path_factory, family, _experts_as(experts, rest), f"{experts.name}-{rest.name}", over)
    model = _load(f, quant=quant)
    ref = gw.reference_model(_model(family, **dict(over)), weights)
    assert model.config.model_type == family
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert getattr(model.config, k) == getattr(ref.config, k), k
    # the non-expert tensors are the dequantized values (Q / K un-permuted for Mixtral), exactly
    state = model.state_dict()
    for name, want in weights.items():
        if "experts" not in name and name in state:
            assert torch.equal(state[name], want), name
    assert _rel(_logits(model), _logits(ref)) < bound


def test_q4_0_experts_hold_the_stored_values(tmp_path_factory):
    f, weights = _written(tmp_path_factory, "qwen3_moe", _experts_as(Q.Q4_0), "Q4_0-F16")
    model = _load(f)  # default: the release's format, int4 group 32
    blocks = _blocks(model)
    assert blocks and {(m.quant, m.native_experts.group_size) for _, m in blocks} == {("int4", 32)}
    assert model._ktinject_load_stats["experts"] == []  # nothing quantized again
    for name, m in blocks:
        gate_up, down = weights[f"{name}.experts.gate_up_proj"], weights[f"{name}.experts.down_proj"]
        I = down.shape[-1]
        for e in range(m.num_experts):
            assert torch.equal(m.native_experts.get(e, "gate"), gate_up[e, :I]), (name, e)
            assert torch.equal(m.native_experts.get(e, "up"), gate_up[e, I:]), (name, e)
            assert torch.equal(m.native_experts.get(e, "down"), down[e]), (name, e)


def test_q8_0_is_requantized_and_the_error_reported(tmp_path_factory):
    f, _ = _written(tmp_path_factory, "qwen3_moe", _experts_as(Q.Q8_0, Q.Q8_0), "Q8_0-Q8_0")
    model = _load(f)
    assert {m.quant for _, m in _blocks(model)} == {"int8"}
    (entry,) = model._ktinject_load_stats["experts"]
    assert entry["from"] == "gguf Q8_0" and entry["to"] == "int8" and 0 < entry["rel_rms_error"] < 0.01


def test_q4_k_m_mix(tmp_path_factory):
    """Q4_K gate / up and Q6_K down: int4 group 32 by default (most experts' format); errors reported per type."""
    f, weights = _written(tmp_path_factory, "qwen3_moe", _q4_k_m, "Q4_K_M", tuple(sorted(_K_SIZES.items())))
    model = _load(f)
    assert {(m.quant, m.native_experts.group_size) for _, m in _blocks(model)} == {("int4", 32)}
    errors = {e["from"]: e["rel_rms_error"] for e in model._ktinject_load_stats["experts"]}
    assert set(errors) == {"gguf Q4_K", "gguf Q6_K"} and max(errors.values()) < 0.2
    ref = gw.reference_model(_model("qwen3_moe", **_K_SIZES), weights)
    assert _rel(_logits(model), _logits(ref)) < 0.25
    m8 = _load(f, quant="int8")
    assert _rel(_logits(m8), _logits(ref)) < 0.08


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16])
def test_codecs_decode_as_gguf_dequantizes(qtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    if qtype == Q.Q5_K:  # no quantizer anywhere: random blocks with sane fp16 scales
        data = rng.integers(0, 256, (3, 512 // 256 * 176), dtype=np.uint8)
        data.reshape(-1, 176)[:, :4] = np.array([0.01, 0.002], np.float16).view(np.uint8)
    else:
        data = gw.quantize(x, qtype) if qtype != Q.BF16 else gguf.quants.quantize(x, qtype)
    want = gw.dequantize(np.ascontiguousarray(data), qtype).reshape(3, 512)
    buf = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1).copy())
    got = GGMLCodec(qtype.name).decode(buf, (3, 512))
    assert torch.equal(got, torch.from_numpy(want))
    # straight to the model's dtype (the loader's path): the same values as casting, and never the read buffer
    # itself (it goes back to the pool)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        as_dtype = GGMLCodec(qtype.name).decode_as(buf, (3, 512), dtype)
        assert as_dtype.dtype == dtype and torch.equal(as_dtype, got.to(dtype))
        assert as_dtype.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()


def test_split_set_loads_as_one_file(tmp_path_factory, tmp_path):
    one, _ = _written(tmp_path_factory, "qwen3_moe", _experts_as(Q.Q4_0), "Q4_0-F16")
    first, _ = _written(tmp_path_factory, "qwen3_moe", _experts_as(Q.Q4_0), "Q4_0-F16", split_max_tensors=9)
    files = sorted(first.parent.glob("*.gguf"))
    assert len(files) > 2 and first.name.endswith("-00001-of-%05d.gguf" % len(files))
    reader = open_checkpoint(first)
    assert reader.signature_files() == files
    assert torch.equal(_logits(_load(first)), _logits(_load(one)))
    assert torch.equal(_logits(_load(first.parent)), _logits(_load(one)))  # the directory of one model
    d = tmp_path / "missing"
    shutil.copytree(first.parent, d)
    (d / files[1].name).unlink()
    with pytest.raises(LoadError, match=rf"lacks {files[1].name}"):
        open_checkpoint(d / first.name)
    with pytest.raises(LoadError, match="pass the first file"):
        open_checkpoint(files[2])


# ---------------------------------------------------------------------------------------------- errors


def _copy(f, tmp_path):
    dst = tmp_path / f.name
    shutil.copy(f, dst)
    return dst


def _dims_at(data: bytes, name: str) -> int:
    """Byte offset of the first dimension of tensor ``name`` in a GGUF header."""
    at = data.index(struct.pack("<Q", len(name)) + name.encode())
    return at + 8 + len(name) + 4


def test_damaged_files_are_named(tmp_path_factory, tmp_path):
    f, _ = _written(tmp_path_factory, "qwen3_moe", _experts_as(Q.Q8_0, Q.Q8_0), "Q8_0-Q8_0")
    d = _copy(f, tmp_path)
    d.write_bytes(f.read_bytes()[:-1000])  # truncated
    with pytest.raises(LoadError, match=rf"tensor '.*' in {d}.*the file ends at byte .*truncated"):
        open_checkpoint(d)
    raw = bytearray(f.read_bytes())  # a tensor whose shape needs more bytes than it has
    at = _dims_at(raw, "blk.1.attn_q.weight")
    raw[at + 8:at + 16] = struct.pack("<Q", 128)  # [64, 64] -> [128, 64]
    d.write_bytes(bytes(raw))
    with pytest.raises(LoadError, match=r"tensor 'blk.1.attn_q.weight' in .*Q8_0 \[128, 64\] needs .* bytes"):
        open_checkpoint(d)
    raw = bytearray(f.read_bytes())  # an unknown quant type: Q8_0 (8) -> IQ2_XXS (16)
    at = _dims_at(raw, "blk.1.attn_k.weight") + 16
    assert struct.unpack("<I", raw[at:at + 4])[0] == int(Q.Q8_0)
    raw[at:at + 4] = struct.pack("<I", int(Q.IQ2_XXS))
    d.write_bytes(bytes(raw))
    with pytest.raises(LoadError, match=r"'blk.1.attn_k.weight' in .* ggml type IQ2_XXS.*reads F32, F16, BF16, "
                                        r"Q8_0, Q4_0, Q4_K, Q5_K, Q6_K"):
        open_checkpoint(d)


def test_unsupported_architecture_and_mismatched_config(tmp_path):
    f = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(f, "qwen3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(LoadError, match=r"architecture 'qwen3' is not supported; supported are qwen3moe"):
        open_checkpoint(f)
    model = _model("qwen3_moe")
    wrong = tmp_path / "wrong.gguf"
    real_add = gguf.GGUFWriter.add_expert_feed_forward_length
    gguf.GGUFWriter.add_expert_feed_forward_length = lambda self, n: real_add(self, n + 16)
    try:
        gw.write_gguf(model, wrong, _experts_as(Q.F16))
    finally:
        gguf.GGUFWriter.add_expert_feed_forward_length = real_add
    with pytest.raises(LoadError, match=r"moe_intermediate_size = 48 .* tensor 'blk.1.ffn_gate_exps.weight' of "
                                        r"shape \[8, 32, 64\]"):
        open_checkpoint(wrong)


def test_tokenizer_from_the_metadata(tmp_path):
    from ktinject.cli.options import load_tokenizer

    f = tmp_path / "tok.gguf"
    gw.write_gguf(_model("qwen3_moe"), f, _experts_as(Q.F16), tokenizer=True)
    tok = load_tokenizer(f)
    ids = tok("hello world")["input_ids"]
    assert tok.decode(ids) == "hello world" and len(ids) < len("hello world")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert load_tokenizer(tmp_path).vocab_size == tok.vocab_size  # the directory of one GGUF
