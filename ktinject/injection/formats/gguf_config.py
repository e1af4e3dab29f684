"""GGUF metadata -> a transformers config, and GGUF tensor names -> Hugging Face checkpoint keys.

The config of qwen3moe / qwen2moe / llama comes from transformers' own GGUF mapping (``load_gguf_checkpoint(...,
return_tensors=False)``), then what it leaves out is filled from the tensors' shapes (qwen3moe / qwen2moe:
``moe_intermediate_size``, the dense layers, the shared expert's width; llama with experts: a Mixtral config) and
every size the model is built from is checked against the tensors (hidden, vocab, layers, heads x head_dim, experts,
expert intermediate): a mismatch is a LoadError naming the config key and the tensor. deepseek2 / glm4moe / gpt-oss
configs are built from the metadata by ``gguf_arch``, checked the same way.

Names: ``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight`` etc. (gguf-py's ``TensorNameMap``,
the names llama.cpp's converter writes); the fused experts ``blk.N.ffn_{gate,up,down}_exps.weight`` [E, N, K] become
one ref per expert under the family's per-expert checkpoint key (``model.layers.N.mlp.experts.E.gate_proj.weight``,
Mixtral ``block_sparse_moe.experts.E.w1.weight``), whose bytes are that expert's slice of the GGUF tensor; the
loader fuses them as it fuses a safetensors checkpoint's. A model tensor made of several GGUF tensors is one ref
over all of them (``JOINS``: DeepSeek's ``kv_b_proj`` from the converter's ``attn_k_b`` + ``attn_v_b``; gpt-oss's
fused experts, whose GGUF tensors are split and transposed); NextN (MTP) blocks past the model's layers are skipped
as transformers skips them. Shapes here are in PyTorch order ([E, N, K]: the reverse
of ggml's ``ne``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ktinject.injection.formats import gguf_arch
from ktinject.injection.formats.base import LoadError


@dataclass(frozen=True)
class Family:
    """How one GGUF architecture maps onto a transformers model."""

    arch: str  # general.architecture
    model_type: str
    moe: str  # the MoE block's attribute: mlp / block_sparse_moe
    experts: tuple[str, str, str]  # per-expert checkpoint names of gate, up, down
    permute_qk: bool = False  # llama.cpp permuted Q / K rows (llama architecture)
    names: tuple[tuple[str, str], ...] = ()  # GGUF block leaf (or leaf.suffix) -> HF name, over _BLOCK's
    fused_experts: bool = False  # the model's checkpoints hold experts fused ([E, ...]): JOINS make them


_PROJ = ("gate_proj", "up_proj", "down_proj")
_SHARED = tuple((f"ffn_{p}_shexp", f"mlp.shared_experts.{p}_proj") for p in ("gate", "up", "down"))
_BIAS = (("exp_probs_b.bias", "mlp.gate.e_score_correction_bias"),)
FAMILIES: dict[str, Family] = {
    "qwen3moe": Family("qwen3moe", "qwen3_moe", "mlp", _PROJ),
    "qwen2moe": Family("qwen2moe", "qwen2_moe", "mlp", _PROJ),
    "llama": Family("llama", "mixtral", "block_sparse_moe", ("w1", "w3", "w2"), permute_qk=True),
    "deepseek2": Family("deepseek2", "deepseek_v3", "mlp", _PROJ, names=_SHARED + _BIAS),  # or deepseek_v2
    "glm4moe": Family("glm4moe", "glm4_moe", "mlp", _PROJ, names=_SHARED + _BIAS),
    "gpt-oss": Family("gpt-oss", "gpt_oss", "mlp", _PROJ, fused_experts=True, names=(
        ("attn_sinks.weight", "self_attn.sinks"), ("ffn_gate_inp", "mlp.router"),
        ("ffn_down_exps.bias", "mlp.experts.down_proj_bias"))),
}
SUPPORTED = ("qwen3moe (Qwen3-MoE), qwen2moe (Qwen1.5 / Qwen2-MoE), llama with experts (Mixtral), deepseek2 "
             "(DeepSeek-V2 / V3 / R1, Kimi-K2), glm4moe (GLM-4.5 / 4.6), gpt-oss")
#: arch -> [(GGUF leaves of one block, read in this order), HF leaf, how they make it (gguf_codecs)]
JOINS: dict[str, list[tuple[tuple[str, ...], str, str]]] = {
    "deepseek2": [(("attn_k_b.weight", "attn_v_b.weight"), "self_attn.kv_b_proj.weight", "mla_kv_b")],
    "gpt-oss": [(("ffn_gate_exps.weight", "ffn_up_exps.weight"), "mlp.experts.gate_up_proj", "interleave_t"),
                (("ffn_gate_exps.bias", "ffn_up_exps.bias"), "mlp.experts.gate_up_proj_bias", "interleave"),
                (("ffn_down_exps.weight",), "mlp.experts.down_proj", "transpose")],
}

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "{moe}.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
EXPERTS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
_NAME = re.compile(r"blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_BLOCK_OF = re.compile(r"blk\.(\d+)\.")


def family_of(meta: dict[str, Any], shapes: dict[str, tuple], file: Path) -> Family:
    """The family of a GGUF's ``general.architecture``; LoadError listing the supported ones."""
    arch = meta.get("general.architecture")
    fam = FAMILIES.get(arch)
    if fam is not None and fam.arch == "llama" and not any(n.endswith("ffn_gate_exps.weight") for n in shapes):
        raise LoadError(f"{file}: a llama-architecture GGUF without routed experts (ffn_gate_exps) is a dense model; "
                        f"ktinject runs MoE models: supported GGUF architectures are {SUPPORTED}")
    if fam is None:
        raise LoadError(f"{file}: GGUF architecture {arch!r} is not supported; supported are {SUPPORTED}")
    if arch == "deepseek2" and not any(n.endswith("exp_probs_b.bias") for n in shapes):
        return replace(fam, model_type="deepseek_v2")  # no router correction bias: V2 / V2-Lite (gguf_arch)
    return fam


def hf_name(fam: Family, gguf_name: str, file: Path, layers: int | None = None) -> tuple[str | None, int | None]:
    """(HF checkpoint key, or its per-expert pattern with ``{e}``; which expert part 0/1/2 or None). Key None: a
    tensor the model has no place for on purpose (NextN blocks at or past ``layers``)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name], None
    b = _BLOCK_OF.match(gguf_name)
    if b and layers is not None and int(b.group(1)) >= layers:
        return None, None
    m = _NAME.fullmatch(gguf_name)
    if m and m.group(2) in EXPERTS and m.group(3) == "weight" and not fam.fused_experts:
        part = EXPERTS[m.group(2)]
        return f"model.layers.{m.group(1)}.{fam.moe}.experts.{{e}}.{fam.experts[part]}.weight", part
    names = dict(fam.names)
    if m and f"{m.group(2)}.{m.group(3)}" in names:
        return f"model.layers.{m.group(1)}.{names[f'{m.group(2)}.{m.group(3)}']}", None
    leaf = names.get(m.group(2), _BLOCK.get(m.group(2))) if m else None
    if leaf is not None:
        return f"model.layers.{m.group(1)}.{leaf.format(moe=fam.moe)}.{m.group(3)}", None
    raise LoadError(f"tensor {gguf_name!r} in {file}: ktinject has no place for it in a {fam.model_type} model "
                    f"(GGUF architecture {fam.arch}); a GGUF of another layout or a newer llama.cpp converter?")


def joins(fam: Family, names, file: Path, layers: int) -> list[tuple[str, tuple[str, ...], str]]:
    """(HF key, the GGUF tensors it is made of, how) for each model tensor of ``JOINS`` the file holds; LoadError
    when only some of a join's tensors are there."""
    out = []
    names = set(names)
    for parts, leaf, how in JOINS.get(fam.arch, []):
        for i in range(layers):
            have = [f"blk.{i}.{p}" for p in parts if f"blk.{i}.{p}" in names]
            if have and len(have) != len(parts):
                missing = sorted({f"blk.{i}.{p}" for p in parts} - set(have))
                raise LoadError(f"{file}: tensor {have[0]!r} comes without {', '.join(missing)}: "
                                f"{fam.model_type}'s {leaf} is made of both")
            if have:
                out.append((f"model.layers.{i}.{leaf}", tuple(have), how))
    return out


def hf_shape(fam: Family, gguf_name: str, shape: tuple) -> tuple:
    """The HF tensor's shape: qwen2moe's shared-expert gate is stored [H], the model's is [1, H]."""
    return (1, *shape) if gguf_name.endswith("ffn_gate_inp_shexp.weight") and len(shape) == 1 else shape


#: llama.cpp architecture names -> transformers' (as load_gguf_checkpoint renames them)
_HF_ARCH = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}


def mapped_config(meta: dict[str, Any], shapes: dict[str, tuple], mapping: dict, defaults: dict) -> dict[str, Any]:
    """The config keys transformers' GGUF loader (``load_gguf_checkpoint``) takes from the metadata, through its own
    key table ``mapping`` (``GGUF_CONFIG_MAPPING``) and ``defaults``, from the metadata this reader already parsed:
    the file is not read again (transformers' reader parses every field, tokenizer arrays included, one numpy view
    at a time: most of a small GGUF's load time)."""
    arch = str(meta.get("general.architecture", ""))
    hf = _HF_ARCH.get(arch, arch)
    cfg: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in shapes}
    for key, value in (defaults.get(hf) or defaults.get(arch) or {}).items():
        cfg.setdefault(key, value)
    for key, value in meta.items():
        prefix, _, rest = key.replace(arch, hf).partition(".")
        renamed = (mapping.get(prefix) or {}).get(rest)
        if renamed is None or renamed == -1:
            continue
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, hf)
        cfg[renamed] = value
    if "vocab_size" not in cfg and "tokenizer.ggml.tokens" in meta:  # (as transformers: from the tokenizer)
        cfg["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    return cfg


def build_config(fam: Family, meta: dict[str, Any], shapes: dict[str, tuple], first: Path):
    """The transformers config of the GGUF model (see the module doc), checked against ``shapes``."""
    if fam.arch in gguf_arch.BUILDERS:
        try:
            return gguf_arch.build(fam.arch, meta, shapes, first)
        except ImportError as e:
            raise LoadError(f"{first}: building a {fam.arch} config needs transformers ({e})") from None
    try:
        from transformers import CONFIG_MAPPING
        from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    except ImportError as e:
        raise LoadError(f"{first}: reading a GGUF config needs transformers' GGUF support ({e})") from None
    cfg = mapped_config(meta, shapes, GGUF_CONFIG_MAPPING, GGUF_CONFIG_DEFAULTS_MAPPING)
    a = fam.arch
    layers = sorted({int(m.group(1)) for n in shapes if (m := _NAME.fullmatch(n))})
    moe_layers = [i for i in layers if f"blk.{i}.ffn_gate_exps.weight" in shapes]
    if not moe_layers:
        raise LoadError(f"{first}: no routed-expert tensors (blk.N.ffn_gate_exps.weight) in a {a} GGUF")
    E, I, _ = shapes[f"blk.{moe_layers[0]}.ffn_gate_exps.weight"]
    cfg["model_type"] = fam.model_type
    cfg["tie_word_embeddings"] = "output.weight" not in shapes  # (over every split, not just the first file)
    cfg.pop("_model_name_or_path", None)
    if fam.model_type in ("qwen3_moe", "qwen2_moe"):
        cfg["moe_intermediate_size"] = int(meta.get(f"{a}.expert_feed_forward_length", I))
        cfg["mlp_only_layers"] = [i for i in layers if i not in moe_layers]
        cfg["decoder_sparse_step"] = 1
        dense = [i for i in layers if f"blk.{i}.ffn_gate.weight" in shapes]
        if dense and f"{a}.feed_forward_length" not in meta:
            cfg["intermediate_size"] = shapes[f"blk.{dense[0]}.ffn_gate.weight"][0]
    if fam.model_type == "qwen2_moe":
        shexp = f"blk.{moe_layers[0]}.ffn_gate_shexp.weight"
        width = meta.get(f"{a}.expert_shared_feed_forward_length", shapes.get(shexp, (0,))[0])
        cfg["shared_expert_intermediate_size"] = int(width)
    if fam.model_type == "mixtral":
        cfg["num_local_experts"] = int(meta.get(f"{a}.expert_count", E))
        cfg["num_experts_per_tok"] = int(meta.get(f"{a}.expert_used_count", 2))
        cfg["intermediate_size"] = int(meta.get(f"{a}.expert_feed_forward_length", cfg.get("intermediate_size", I)))
    config = CONFIG_MAPPING[fam.model_type].from_dict(cfg)
    check_config(config, fam, shapes, layers, moe_layers, first)
    return config


def check_config(config, fam: Family, shapes: dict[str, tuple], layers: list[int], moe_layers: list[int],
                 file: Path) -> None:
    """Every config size the model is built from equals the tensors'; LoadError naming key and tensor."""
    H = config.hidden_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or H // heads
    experts_key = "num_local_experts" if fam.model_type == "mixtral" else "num_experts"
    inter_key = "intermediate_size" if fam.model_type == "mixtral" else "moe_intermediate_size"
    L, M = layers[-1], moe_layers[0]
    checks = [  # (config key, its value, tensor, dimension, the value the tensor needs there)
        ("hidden_size", H, "token_embd.weight", 1, H),
        ("vocab_size", config.vocab_size, "token_embd.weight", 0, config.vocab_size),
        ("num_attention_heads x head_dim", f"{heads} x {head_dim}", f"blk.{L}.attn_q.weight", 0, heads * head_dim),
        ("num_key_value_heads x head_dim", f"{kv} x {head_dim}", f"blk.{L}.attn_k.weight", 0, kv * head_dim),
        ("hidden_size", H, f"blk.{L}.attn_output.weight", 0, H),
        (experts_key, getattr(config, experts_key), f"blk.{M}.ffn_gate_exps.weight", 0, getattr(config, experts_key)),
        (experts_key, getattr(config, experts_key), f"blk.{M}.ffn_gate_inp.weight", 0, getattr(config, experts_key)),
        (inter_key, getattr(config, inter_key), f"blk.{M}.ffn_gate_exps.weight", 1, getattr(config, inter_key)),
        (inter_key, getattr(config, inter_key), f"blk.{M}.ffn_down_exps.weight", 2, getattr(config, inter_key)),
        ("hidden_size", H, f"blk.{M}.ffn_gate_exps.weight", 2, H),
        ("head_dim", head_dim, f"blk.{L}.attn_q_norm.weight", 0, head_dim),
    ]
    if fam.model_type != "mixtral":
        dense = [i for i in layers if i not in moe_layers]
        if dense:
            checks.append(("intermediate_size", config.intermediate_size, f"blk.{dense[0]}.ffn_gate.weight", 0,
                           config.intermediate_size))
    if fam.model_type == "qwen2_moe":
        w = config.shared_expert_intermediate_size
        checks.append(("shared_expert_intermediate_size", w, f"blk.{M}.ffn_gate_shexp.weight", 0, w))
    gguf_arch.check_shapes(file, shapes, checks)
    if config.num_hidden_layers != L + 1:
        raise LoadError(f"{file}: config num_hidden_layers = {config.num_hidden_layers} (from the GGUF metadata) "
                        f"but the tensors hold blocks 0..{L} (blk.{L}.*): a damaged or mislabelled GGUF")
    if config.num_experts_per_tok > getattr(config, experts_key):
        raise LoadError(f"{file}: config num_experts_per_tok = {config.num_experts_per_tok} exceeds {experts_key} = "
                        f"{getattr(config, experts_key)} (tensor {f'blk.{M}.ffn_gate_exps.weight'!r})")
