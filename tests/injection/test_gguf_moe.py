"""GGUF files of DeepSeek-V2 / V3 (arch deepseek2), GLM-4.5 (glm4moe) and gpt-oss through from_pretrained.

Each tiny GGUF is written by ``gguf_checkpoints`` as llama.cpp's converter writes it (gguf-py's names, MLA's
``attn_k_b`` / ``attn_v_b`` split or the older ``attn_kv_b``, GLM's NextN block, gpt-oss's split experts); the
oracle is the HF model in float32 holding the GGUF's own dequantized values (``gguf.quants.dequantize``). Bounds on
|logits - oracle| / max |oracle| (measured in brackets): F16 experts in bf16, max 0.03 (deepseek_v3 0.003); MXFP4
experts in bf16 (every MXFP4 value exactly) max 0.03 (0.005), in mxfp4 (the stored bytes as they are, bf16
activations) max 0.03 (0.005); Q4_0 experts into int4 group 32 (the stored values exactly; the int8 activations of
W4A8 alone differ, and on a near-tie they flip one token's routing: deepseek_v3's max is 0.14 on one token) the 75th
percentile of the per-token error 0.02 (0.003-0.006). Non-expert tensors equal the dequantized values exactly.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from ktinject.injection.formats import open_checkpoint  # noqa: E402
from ktinject.injection.formats.codecs import MXFP4  # noqa: E402
from ktinject.injection.formats.gguf_codecs import GGMLCodec  # noqa: E402
from ktinject.injection.loading import LoadError  # noqa: E402
from tests.injection import gguf_checkpoints as gw  # noqa: E402
from tests.injection.test_gguf import _blocks, _load, _logits, _model, _rel  # noqa: E402

Q = gguf.GGMLQuantizationType
_CACHE: dict = {}
_OVER = {"deepseek_v3": (), "deepseek_v2": (("moe_intermediate_size", 32),),  # experts in whole blocks of 32
         "glm4_moe": (("hidden_size", 64), ("head_dim", 16), ("moe_intermediate_size", 32)),
         "gpt_oss": (("intermediate_size", 64),)}


def _as(experts):
    """``experts`` for the routed experts, F16 elsewhere (F16 too where a row is not whole blocks, as llama.cpp)."""
    def qtype_of(name, x):
        q = experts if "_exps" in name else Q.F16
        return q if x.shape[-1] % gguf.GGML_QUANT_SIZES[q][0] == 0 else Q.F16
    return qtype_of


def _written(tmp_path_factory, family, experts, mla_split=True, extra=None, tag=""):
    key = (family, experts, mla_split, tag)
    if key not in _CACHE:
        d = tmp_path_factory.mktemp(f"gguf-{family}")
        weights = gw.write_gguf(_model(family, **dict(_OVER[family])), d / "model.gguf", _as(experts),
                                mla_split=mla_split, extra=extra)
        _CACHE[key] = (d / "model.gguf", weights)
    return _CACHE[key]


def _typical(got, want) -> float:
    """The 75th percentile over tokens of max |got - want| / max |want|."""
    per_token = (got - want).abs().amax(-1).flatten() / want.abs().max()
    return float(torch.quantile(per_token, 0.75))


CASES = [  # family, expert type, MLA split (deepseek2), quant asked, check
    ("deepseek_v3", Q.F16, True, "bf16", "max"),
    ("deepseek_v3", Q.Q4_0, True, None, "int4"),
    ("deepseek_v2", Q.Q4_0, False, None, "int4"),  # V2-Lite's layout: q_proj (no q_lora_rank), older attn_kv_b
    ("glm4_moe", Q.Q4_0, True, None, "int4"),
    ("gpt_oss", Q.MXFP4, True, "bf16", "max"),
]


@pytest.mark.parametrize("family,experts,split,quant,check", CASES)
def test_loads_as_the_gguf_dequantized_model(tmp_path_factory, family, experts, split, quant, check):
    f, weights = _written(tmp_path_factory, family, experts, split)
    model = _load(f, quant=quant)
    ref = gw.reference_model(_model(family, **dict(_OVER[family])), weights)
    assert model.config.model_type == family
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
              "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
              "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor",
              "norm_topk_prob", "topk_method", "head_dim", "use_qk_norm", "sliding_window", "layer_types",
              "num_local_experts", "tie_word_embeddings"):
        assert getattr(model.config, k, None) == getattr(ref.config, k, None), k
    assert model.config.rope_parameters == ref.config.rope_parameters
    state = model.state_dict()
    for name, want in weights.items():
        if "experts." not in name and name in state:
            assert torch.equal(state[name], want), name
    got, want = _logits(model), _logits(ref)
    if check == "max":
        assert _rel(got, want) < 0.03
    else:
        assert _typical(got, want) < 0.02
        blocks = _blocks(model)
        assert blocks and {(m.quant, m.native_experts.group_size) for _, m in blocks} == {("int4", 32)}
        for name, m in blocks:
            gate_up, down = weights[f"{name}.experts.gate_up_proj"], weights[f"{name}.experts.down_proj"]
            I = down.shape[-1]
            for e in (0, m.num_experts - 1):
                assert torch.equal(m.native_experts.get(e, "gate"), gate_up[e, :I]), (name, e)
                assert torch.equal(m.native_experts.get(e, "up"), gate_up[e, I:]), (name, e)
                assert torch.equal(m.native_experts.get(e, "down"), down[e]), (name, e)


def test_glm_nextn_block_is_skipped(tmp_path_factory):
    f, _ = _written(tmp_path_factory, "glm4_moe", Q.Q4_0)
    reader = open_checkpoint(f)
    L = reader.config().num_hidden_layers
    assert reader.meta["glm4moe.block_count"] == L + 1 and f"blk.{L}.nextn.eh_proj.weight" in reader.tensors
    assert not any(f"layers.{L}." in r.key for r in reader.refs)


def test_gpt_oss_mxfp4_experts_hold_the_values_exactly(tmp_path_factory):
    f, weights = _written(tmp_path_factory, "gpt_oss", Q.MXFP4)
    model = _load(f, quant="bf16")
    assert model._ktinject_load_stats["experts"][0]["from"] == "gguf MXFP4"
    for name, m in _blocks(model):
        gate_up, down = weights[f"{name}.experts.gate_up_proj"], weights[f"{name}.experts.down_proj"]
        for e in (0, m.num_experts - 1):
            assert torch.equal(m.native_experts.get(e, "gate"), gate_up[e][:, 0::2].t()), (name, e)
            assert torch.equal(m.native_experts.get(e, "up"), gate_up[e][:, 1::2].t()), (name, e)
            assert torch.equal(m.native_experts.get(e, "down"), down[e].t()), (name, e)


def _repack(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """convert_hf_to_gguf.py's GptOssModel.repack_mxfp4: the release's [.., 16] bytes (element 2j low nibble, 2j+1
    high) and e8m0 scales -> ggml MXFP4 blocks (scale byte, then elements 0..15 low nibbles, 16..31 high)."""
    lo, hi = blocks & 0x0F, blocks >> 4
    codes = np.stack([lo, hi], -1).reshape(*blocks.shape[:-1], 32)  # element order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], qs], -1).astype(np.uint8)


def test_gpt_oss_mxfp4_experts_stay_mxfp4(tmp_path_factory):
    """The default for MXFP4 experts: native mxfp4 holding the GGUF's codes and exponents as they are (the nibbles
    in the release's order: the native bytes repacked as llama.cpp does give the file's blocks back), nothing
    quantized again; the model matches the oracle as bf16 experts do (W4A16: bf16 activations only)."""
    from tests.native.test_mxfp4 import raw_parts

    f, weights = _written(tmp_path_factory, "gpt_oss", Q.MXFP4)
    model = _load(f)
    blocks = _blocks(model)
    assert blocks and {(m.quant, m.native_experts.group_size) for _, m in blocks} == {("mxfp4", 32)}
    assert model._ktinject_load_stats["experts"] == []
    stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(f).tensors}
    for layer, (name, m) in enumerate(blocks):
        gate_up, down = weights[f"{name}.experts.gate_up_proj"], weights[f"{name}.experts.down_proj"]
        for e in (0, 1, m.num_experts - 1):
            assert torch.equal(m.native_experts.get(e, "gate"), gate_up[e][:, 0::2].t()), (name, e)
            assert torch.equal(m.native_experts.get(e, "up"), gate_up[e][:, 1::2].t()), (name, e)
            assert torch.equal(m.native_experts.get(e, "down"), down[e].t()), (name, e)
            for which, leaf in (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps")):
                got_b, got_s, raw = raw_parts(m.native_experts, e, which)
                release = got_b[:raw.N, :raw.K // 2].numpy().reshape(raw.N, raw.K // 32, 16)
                ggml = _repack(release, got_s[:raw.N, :raw.K // 32].numpy()).reshape(raw.N, -1)
                assert np.array_equal(ggml, stored[f"blk.{layer}.{leaf}.weight"][e]), (name, e, which)
    assert _rel(_logits(model), _logits(gw.reference_model(_model("gpt_oss", **dict(_OVER["gpt_oss"])),
                                                           weights))) < 0.03


def test_mxfp4_decodes_as_gguf_and_as_the_release():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (6, 4, 16), dtype=np.uint8)  # 6 rows of 128 values
    scales = rng.integers(112, 140, (6, 4), dtype=np.uint8)
    ggml = _repack(blocks, scales).reshape(6, -1)
    got = GGMLCodec("MXFP4").decode(torch.from_numpy(ggml.reshape(-1).copy()), (6, 128))
    want = gw.dequantize(ggml, Q.MXFP4).reshape(6, 128)
    assert torch.equal(got, torch.from_numpy(want))
    release = torch.from_numpy(np.concatenate([blocks.reshape(-1), scales.reshape(-1)]))
    assert torch.equal(got, MXFP4().decode(release, (6, 128)))  # transformers' dequantization of the release


def test_deepseek_yarn_and_groups_from_the_metadata(tmp_path_factory):
    def yarn(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(40.0)
        w.add_rope_scaling_orig_ctx_len(64)
        w.add_rope_scaling_yarn_log_mul(0.1 * 1.0)
    f, _ = _written(tmp_path_factory, "deepseek_v3", Q.F16, extra=yarn, tag="yarn")
    cfg = open_checkpoint(f).config()
    rope = cfg.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 40.0, 64)
    assert rope["mscale"] == rope["mscale_all_dim"] == 1.0
    assert (cfg.n_group, cfg.topk_group, cfg.num_key_value_heads) == (4, 2, cfg.num_attention_heads)


def test_mismatched_metadata_is_named(tmp_path_factory, tmp_path):
    real = gguf.GGUFWriter.add_kv_lora_rank
    gguf.GGUFWriter.add_kv_lora_rank = lambda self, n: real(self, n + 8)
    try:
        gw.write_gguf(_model("deepseek_v3"), tmp_path / "rank.gguf", _as(Q.F16))
    finally:
        gguf.GGUFWriter.add_kv_lora_rank = real
    with pytest.raises(LoadError, match=r"kv_lora_rank \+ qk_rope_head_dim = 40 \+ 8 .* tensor "
                                        r"'blk.2.attn_kv_a_mqa.weight' of shape \[40, 64\]"):
        open_checkpoint(tmp_path / "rank.gguf")
    real_gating = gguf.GGUFWriter.add_expert_gating_func
    gguf.GGUFWriter.add_expert_gating_func = lambda self, v: real_gating(self, gguf.ExpertGatingFuncType.SOFTMAX)
    try:
        gw.write_gguf(_model("deepseek_v3"), tmp_path / "gating.gguf", _as(Q.F16))
    finally:
        gguf.GGUFWriter.add_expert_gating_func = real_gating
    with pytest.raises(LoadError, match=r"expert_gating_func is 1 but the blocks hold the router's correction bias"):
        open_checkpoint(tmp_path / "gating.gguf")
