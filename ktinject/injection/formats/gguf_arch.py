"""Transformers configs of the GGUF architectures transformers has no GGUF mapping for (deepseek2, glm4moe) or an
incomplete one (gpt-oss), built from the metadata keys llama.cpp's ``convert_hf_to_gguf.py`` writes, every size
checked against the tensors' shapes (a mismatch: a LoadError naming the config key and the tensor).

    deepseek2  DeepSeek-V2 / V2-Lite / V3 / R1, Kimi-K2: ``deepseek_v3`` when the blocks hold the router's correction
               bias (``exp_probs_b``, with sigmoid gating), else ``deepseek_v2`` (softmax). MLA sizes from
               ``attention.{q,kv}_lora_rank``, ``key_length_mla`` / ``value_length_mla`` (older files without them,
               with ``attn_kv_b``: ``key_length`` / ``value_length``) and ``rope.dimension_count``; the metadata's
               ``head_count_kv`` (1: llama.cpp runs MLA as MQA) is not the model's (its heads). Yarn:
               ``rope.scaling.*``, ``mscale_all_dim`` = ``yarn_log_multiplier`` / 0.1 (as the converter writes it)
    glm4moe    GLM-4.5 / 4.6 (``glm4_moe``): ``block_count`` counts the NextN (MTP) blocks
               (``nextn_predict_layers``), which the model does not have
    gpt-oss    gpt-oss (``gpt_oss``): ``sliding_window``, head_dim from ``key_length``, yarn rope

Routing groups come from ``expert_group_count`` / ``expert_group_used_count`` when the file has them, else none
(n_group 1: what llama.cpp itself then runs). Shapes are PyTorch order ([out, in]; experts [E, out, in]).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ktinject.injection.formats.base import LoadError

_SIGMOID, _SOFTMAX = 2, 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE


class _Meta:
    """``{arch}.*`` metadata values; a missing required key is a LoadError naming it."""

    def __init__(self, meta: dict[str, Any], arch: str, file: Path):
        self.meta, self.arch, self.file = meta, arch, file

    def __call__(self, key: str, default: Any = LoadError):
        full = f"{self.arch}.{key}"
        if full in self.meta:
            return self.meta[full]
        if default is LoadError:
            raise LoadError(f"{self.file}: the GGUF metadata lacks {full}, which a {self.arch} model needs")
        return default


def check_shapes(file: Path, shapes: dict[str, tuple], checks) -> None:
    """``checks``: (config key, its value, tensor, dimension, the size the tensor needs there); a tensor absent
    from the file is not checked."""
    for key, value, tensor, dim, want in checks:
        shape = shapes.get(tensor)
        if shape is not None and (len(shape) <= dim or shape[dim] != want):
            raise LoadError(f"{file}: config {key} = {value} (from the GGUF metadata) does not fit tensor "
                            f"{tensor!r} of shape {list(shape)} (dimension {dim} should be {want}): a damaged or "
                            f"mislabelled GGUF")


def _common(m: _Meta, shapes: dict[str, tuple], layers: int) -> dict[str, Any]:
    vocab = m("vocab_size", None) or len(m.meta.get("tokenizer.ggml.tokens", ())) or shapes["token_embd.weight"][0]
    return dict(hidden_size=int(m("embedding_length")), num_hidden_layers=layers,
                num_attention_heads=int(m("attention.head_count")), vocab_size=int(vocab),
                rms_norm_eps=float(m("attention.layer_norm_rms_epsilon")),
                max_position_embeddings=int(m("context_length")),
                tie_word_embeddings="output.weight" not in shapes)


def _rope(m: _Meta, **yarn_defaults) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(m("rope.freq_base", 10000.0))}
    kind = m("rope.scaling.type", "none")
    if kind == "yarn":
        rope.update(rope_type="yarn", factor=float(m("rope.scaling.factor")),
                    original_max_position_embeddings=int(m("rope.scaling.original_context_length")), **yarn_defaults)
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if m(f"rope.scaling.{key}", None) is not None:
                rope[name] = float(m(f"rope.scaling.{key}"))
    elif kind not in ("none", None):
        raise LoadError(f"{m.file}: {m.arch}.rope.scaling.type {kind!r} is not supported (none or yarn)")
    return rope


def _moe(m: _Meta, shapes, layers: int, first_dense: int) -> tuple[int, int, dict[str, Any]]:
    """(experts E, expert intermediate I, the routing keys) of a DeepSeek-style router, checked."""
    moe = [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" in shapes]
    if moe != list(range(first_dense, layers)):
        raise LoadError(f"{m.file}: config first_k_dense_replace = {first_dense} ({m.arch}.leading_dense_block_count)"
                        f" but the routed experts (blk.N.ffn_gate_exps.weight) are in blocks {moe}")
    E, I = int(m("expert_count")), int(m("expert_feed_forward_length"))
    groups, used = int(m("expert_group_count", 1) or 1), int(m("expert_group_used_count", 1) or 1)
    return E, I, dict(n_routed_experts=E, moe_intermediate_size=I, num_experts_per_tok=int(m("expert_used_count")),
                      n_shared_experts=int(m("expert_shared_count", 0)), first_k_dense_replace=first_dense,
                      routed_scaling_factor=float(m("expert_weights_scale", 1.0)),
                      norm_topk_prob=bool(m("expert_weights_norm", False)), n_group=groups, topk_group=used)


def _moe_checks(cfg: dict, shapes, layers: int) -> list[tuple]:
    E, I, H, S = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"], cfg["n_shared_experts"]
    M, L = cfg["first_k_dense_replace"], layers - 1
    checks = [("n_routed_experts", E, f"blk.{M}.{t}", 0, E) for t in
              ("ffn_gate_exps.weight", "ffn_down_exps.weight", "ffn_gate_inp.weight", "exp_probs_b.bias")]
    checks += [("moe_intermediate_size", I, f"blk.{M}.ffn_gate_exps.weight", 1, I),
               ("moe_intermediate_size", I, f"blk.{M}.ffn_down_exps.weight", 2, I),
               ("hidden_size", H, f"blk.{M}.ffn_up_exps.weight", 2, H),
               ("moe_intermediate_size x n_shared_experts", f"{I} x {S}", f"blk.{L}.ffn_up_shexp.weight", 0, I * S)]
    if M:
        F = cfg["intermediate_size"]
        checks.append(("intermediate_size", F, "blk.0.ffn_gate.weight", 0, F))
    return checks


def _deepseek2(m: _Meta, shapes, layers: int) -> tuple[dict, list]:
    cfg = _common(m, shapes, layers)
    v3 = any(n.endswith("exp_probs_b.bias") for n in shapes)
    gating = m("expert_gating_func", None)
    if gating is not None and int(gating) != (_SIGMOID if v3 else _SOFTMAX):
        raise LoadError(f"{m.file}: {m.arch}.expert_gating_func is {gating} but the blocks "
                        f"{'hold' if v3 else 'lack'} the router's correction bias (exp_probs_b): DeepSeek-V3 routes "
                        f"with sigmoid + bias ({_SIGMOID}), V2 with softmax ({_SOFTMAX}); a mislabelled GGUF")
    E, I, moe = _moe(m, shapes, layers, int(m("leading_dense_block_count", 0)))
    heads, rope_dim = cfg["num_attention_heads"], int(m("rope.dimension_count"))
    split = m("attention.key_length_mla", None) is not None
    qk = int(m("attention.key_length_mla" if split else "attention.key_length"))
    v = int(m("attention.value_length_mla" if split else "attention.value_length"))
    rank, q_rank = int(m("attention.kv_lora_rank")), m("attention.q_lora_rank", None)
    rope = _rope(m)
    if rope["rope_type"] == "yarn":
        scale = round(float(m("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)
        rope.update(mscale=scale, mscale_all_dim=scale)
    cfg.update(moe, model_type="deepseek_v3" if v3 else "deepseek_v2", num_key_value_heads=heads,
               intermediate_size=int(m("feed_forward_length")), kv_lora_rank=rank,
               q_lora_rank=int(q_rank) if q_rank else None, qk_rope_head_dim=rope_dim, qk_nope_head_dim=qk - rope_dim,
               v_head_dim=v, rope_parameters=rope)
    if not v3:
        grouped = moe["n_group"] > 1 and moe["topk_group"] < moe["n_group"]
        cfg["topk_method"] = "group_limited_greedy" if grouped else "greedy"
    L, H, nope = layers - 1, cfg["hidden_size"], qk - rope_dim
    q = ("q_lora_rank", q_rank, f"blk.{L}.attn_q_b.weight", 1, q_rank) if q_rank else \
        ("num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim)", f"{heads} x {qk}", f"blk.{L}.attn_q.weight",
         0, heads * qk)
    checks = _moe_checks(cfg, shapes, layers) + [
        ("hidden_size", H, "token_embd.weight", 1, H), ("vocab_size", cfg["vocab_size"], "token_embd.weight", 0,
                                                        cfg["vocab_size"]), q,
        ("num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim)", f"{heads} x {qk}", f"blk.{L}.attn_q_b.weight",
         0, heads * qk),
        ("kv_lora_rank + qk_rope_head_dim", f"{rank} + {rope_dim}", f"blk.{L}.attn_kv_a_mqa.weight", 0,
         rank + rope_dim),
        ("kv_lora_rank", rank, f"blk.{L}.attn_kv_a_norm.weight", 0, rank),
        ("num_attention_heads x (qk_nope_head_dim + v_head_dim)", f"{heads} x ({nope} + {v})",
         f"blk.{L}.attn_kv_b.weight", 0, heads * (nope + v)),
        ("num_attention_heads", heads, f"blk.{L}.attn_k_b.weight", 0, heads),
        ("kv_lora_rank", rank, f"blk.{L}.attn_k_b.weight", 1, rank),
        ("qk_nope_head_dim", nope, f"blk.{L}.attn_k_b.weight", 2, nope),
        ("num_attention_heads", heads, f"blk.{L}.attn_v_b.weight", 0, heads),
        ("v_head_dim", v, f"blk.{L}.attn_v_b.weight", 1, v),
        ("num_attention_heads x v_head_dim", f"{heads} x {v}", f"blk.{L}.attn_output.weight", 1, heads * v)]
    check_shapes(m.file, shapes, checks)
    if split:  # the converter's MQA view of MLA: keys of kv_lora_rank + rope, values of kv_lora_rank
        for key, want in (("attention.key_length", rank + rope_dim), ("attention.value_length", rank)):
            if m(key, want) != want:
                raise LoadError(f"{m.file}: {m.arch}.{key} is {m(key)}, but kv_lora_rank {rank} and "
                                f"rope.dimension_count {rope_dim} make it {want}: a damaged GGUF")
    return cfg, []


def _glm4moe(m: _Meta, shapes, layers: int) -> tuple[dict, list]:
    cfg = _common(m, shapes, layers)
    E, I, moe = _moe(m, shapes, layers, int(m("leading_dense_block_count", 0)))
    head_dim, rope_dim = int(m("attention.key_length")), int(m("rope.dimension_count"))
    rope = _rope(m)
    rope["partial_rotary_factor"] = rope_dim / head_dim
    L = layers - 1
    cfg.update(moe, model_type="glm4_moe", num_key_value_heads=int(m("attention.head_count_kv")), head_dim=head_dim,
               intermediate_size=int(m("feed_forward_length")), rope_parameters=rope,
               attention_bias=f"blk.{L}.attn_q.bias" in shapes, use_qk_norm=f"blk.{L}.attn_q_norm.weight" in shapes,
               num_nextn_predict_layers=int(m("nextn_predict_layers", 0)))
    return cfg, _moe_checks(cfg, shapes, layers) + _attention_checks(cfg, shapes, L)


def _gpt_oss(m: _Meta, shapes, layers: int) -> tuple[dict, list]:
    cfg = _common(m, shapes, layers)
    E, I = int(m("expert_count")), int(m("expert_feed_forward_length"))
    L = layers - 1
    cfg.update(model_type="gpt_oss", num_key_value_heads=int(m("attention.head_count_kv")),
               head_dim=int(m("attention.key_length")), intermediate_size=I, num_local_experts=E,
               num_experts_per_tok=int(m("expert_used_count")), sliding_window=int(m("attention.sliding_window")),
               attention_bias=f"blk.{L}.attn_q.bias" in shapes,
               rope_parameters=_rope(m, beta_fast=32.0, beta_slow=1.0, truncate=False))
    H = cfg["hidden_size"]
    checks = _attention_checks(cfg, shapes, L) + [
        ("num_local_experts", E, f"blk.{L}.ffn_gate_exps.weight", 0, E),
        ("num_local_experts", E, f"blk.{L}.ffn_gate_inp.weight", 0, E),
        ("intermediate_size", I, f"blk.{L}.ffn_gate_exps.weight", 1, I),
        ("intermediate_size", I, f"blk.{L}.ffn_down_exps.weight", 2, I),
        ("hidden_size", H, f"blk.{L}.ffn_up_exps.weight", 2, H),
        ("num_attention_heads", cfg["num_attention_heads"], f"blk.{L}.attn_sinks.weight", 0,
         cfg["num_attention_heads"])]
    return cfg, checks


def _attention_checks(cfg: dict, shapes, L: int) -> list[tuple]:
    H, heads, kv, hd, V = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                            "vocab_size"))
    return [("hidden_size", H, "token_embd.weight", 1, H), ("vocab_size", V, "token_embd.weight", 0, V),
            ("num_attention_heads x head_dim", f"{heads} x {hd}", f"blk.{L}.attn_q.weight", 0, heads * hd),
            ("num_key_value_heads x head_dim", f"{kv} x {hd}", f"blk.{L}.attn_k.weight", 0, kv * hd),
            ("num_key_value_heads x head_dim", f"{kv} x {hd}", f"blk.{L}.attn_v.weight", 0, kv * hd),
            ("hidden_size", H, f"blk.{L}.attn_output.weight", 0, H),
            ("head_dim", hd, f"blk.{L}.attn_q_norm.weight", 0, hd)]


BUILDERS = {"deepseek2": _deepseek2, "glm4moe": _glm4moe, "gpt-oss": _gpt_oss}


def model_layers(meta: dict[str, Any], arch: str, file: Path) -> int:
    """The model's decoder layers: ``block_count`` less the NextN (MTP) blocks llama.cpp counts in it."""
    m = _Meta(meta, arch, file)
    return int(m("block_count")) - int(m("nextn_predict_layers", 0) or 0)


def build(arch: str, meta: dict[str, Any], shapes: dict[str, tuple], file: Path):
    """The transformers config of a GGUF of ``arch`` (one of ``BUILDERS``), checked against ``shapes``."""
    from transformers import CONFIG_MAPPING

    m = _Meta(meta, arch, file)
    layers = model_layers(meta, arch, file)
    blocks = sorted({int(n.split(".")[1]) for n in shapes if n.startswith("blk.")})
    if blocks != list(range(int(m("block_count")))):
        raise LoadError(f"{file}: {arch}.block_count is {m('block_count')} but the tensors hold blocks "
                        f"{blocks[:3]}..{blocks[-3:] if blocks else []}: a damaged or mislabelled GGUF")
    cfg, checks = BUILDERS[arch](m, shapes, layers)
    check_shapes(file, shapes, checks)
    if cfg["num_experts_per_tok"] > cfg.get("n_routed_experts", cfg.get("num_local_experts")):
        raise LoadError(f"{file}: config num_experts_per_tok = {cfg['num_experts_per_tok']} ({arch}.expert_used_count)"
                        f" exceeds the experts ({arch}.expert_count)")
    return CONFIG_MAPPING[cfg.pop("model_type")](**cfg)
