"""Tiny random-weight models of every supported MoE family: for trying the library without a checkpoint, for its
tests and benchmarks.

``build_tiny_model(family)`` returns a Hugging Face ``*ForCausalLM`` with 2-3 layers, hidden sizes around 64 and
4-16 experts, built from ``tiny_config(family)``. The layouts follow each family's real checkpoints: dense first
layers (DeepSeek/GLM ``first_k_dense_replace``, Qwen ``mlp_only_layers``), shared experts where the family has
them, grouped top-k routing (DeepSeek), attention sinks and sliding windows (gpt-oss). Weights are drawn from a
seeded generator with scales that keep activations O(1), logits spread over a few units and routing decisive but
not degenerate, so numerical comparisons mean something. Casting to a lower precision follows ``from_pretrained``:
the tensors a model class keeps in float32 (``_keep_in_fp32_modules``) stay in float32.

Legend: H hidden, I expert intermediate, E experts, k experts per token.
"""
from __future__ import annotations

import logging
import math
import re
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

#: the families every test suite iterates (decode, KV cache, loading, placement, ...)
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss")
#: families added later: checked end to end against HF in tests/operators/test_families.py, kept out of the slower
#: suites that iterate FAMILIES (CI time); their attention runs HF's own forward (no decode fast path)
MORE_FAMILIES = ("minimax_m2", "glm4_moe_lite", "ernie4_5_moe", "hunyuan_v1_moe", "dots1", "qwen3_next", "qwen3_5_moe",
                 "kimi_k25", "deepseek_v32", "glm_moe_dsa", "llama4", "deepseek_v4")
ALL_FAMILIES = FAMILIES + MORE_FAMILIES
#: the transformers release that first has each family's model_type (the others: every supported release, 5.17+)
MIN_TRANSFORMERS: dict[str, str] = {}

_VOCAB = 128
_COMMON: dict[str, Any] = dict(
    vocab_size=_VOCAB,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.02,
)

# One entry per family: the config keywords that differ from that family's defaults. Sizes vary on purpose
# (hidden 64/80/96, expert intermediate 24..48, one odd intermediate) so kernels meet non-multiples of 16 and 32.
# Expert sizes stay multiples of 8: HF's grouped-mm experts need 16-byte strides in bf16.
_TINY: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=[0], decoder_sparse_step=1,
    ),
    "qwen2_moe": dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, mlp_only_layers=[0], decoder_sparse_step=1, qkv_bias=True,
    ),
    "mixtral": dict(
        hidden_size=64, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
    ),
    "olmoe": dict(
        hidden_size=96, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, clip_qkv=None,
    ),
    "deepseek_v2": dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.0,
        first_k_dense_replace=1,
    ),
    "deepseek_v3": dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
    ),
    "glm4_moe": dict(
        hidden_size=80, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=20, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, first_k_dense_replace=1,
        use_qk_norm=True,
    ),
    "gpt_oss": dict(
        hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # every layer sparse; sigmoid + bias routing (k of E as 8 of 256); q/k norms over all heads, half rotary
    "minimax_m2": dict(
        hidden_size=72, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=20, num_local_experts=12, num_experts_per_tok=4, router_jitter_noise=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    # MLA with interleaved rotary, DeepSeek-V3's router without groups, a dense first layer
    "glm4_moe_lite": dict(
        hidden_size=80, intermediate_size=96, moe_intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=24, n_routed_experts=12, n_shared_experts=1, num_experts_per_tok=4, n_group=1, topk_group=1,
        routed_scaling_factor=1.8, norm_topk_prob=True, mlp_layer_types=["dense", "sparse", "sparse"],
    ),
    # softmax routing with a correction bias choosing the experts; interleaved rotary; a dense first layer
    "ernie4_5_moe": dict(
        hidden_size=88, intermediate_size=96, moe_intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, moe_num_experts=10, moe_k=3, moe_num_shared_experts=1, moe_layer_start_index=1,
        moe_layer_interval=1, moe_layer_end_index=-1, use_bias=False,
    ),
    # every layer sparse, softmax top-k, an always-on shared MLP of the experts' size; q/k norms after rotary
    "hunyuan_v1_moe": dict(
        hidden_size=72, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=18, num_experts=8, moe_topk=2, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # DeepSeek-V3's router (sigmoid + bias, no groups) and block; Qwen3-style q/k norms; a dense first layer
    "dots1": dict(
        hidden_size=80, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=20, n_routed_experts=12, n_shared_experts=1, num_experts_per_tok=3,
        n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        sliding_window=None,
    ),
    # gated-DeltaNet linear attention 3:1 with gated full attention (partial rotary), zero-centered norms; a dense
    # first layer; a shared expert gated by sigmoid(shared_expert_gate)
    "qwen3_next": dict(
        hidden_size=72, intermediate_size=88, moe_intermediate_size=40, shared_expert_intermediate_size=56,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=20, num_experts=12,
        num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1,
        linear_conv_kernel_dim=4, linear_key_head_dim=12, linear_value_head_dim=20, linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    # the text model (model_type qwen3_5_moe_text): Qwen3-Next's layers, every layer sparse
    "qwen3_5_moe": dict(
        hidden_size=88, moe_intermediate_size=40, shared_expert_intermediate_size=44, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=20, num_experts=10, num_experts_per_tok=3,
        linear_conv_kernel_dim=4, linear_key_head_dim=12, linear_value_head_dim=20, linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    # Kimi-K2.5: DeepSeek-V3's text model (MLA, grouped sigmoid routing, a dense first layer) inside an image-text
    # wrapper (model.language_model) behind a vision tower of two layers, which text-only inputs never run
    "kimi_k25": dict(
        text_config=dict(
            hidden_size=72, intermediate_size=88, moe_intermediate_size=40, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=40, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=12, n_shared_experts=1, num_experts_per_tok=3,
            n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        ),
        vision_config=dict(hidden_size=40, intermediate_size=56, num_hidden_layers=2, num_attention_heads=2,
                           pos_emb_height=8, pos_emb_width=8),
        projection_hidden_size=40,
    ),
    # MLA plus the lightning indexer, which keeps the index_topk best-scored keys per query (fewer than a prompt's
    # tokens here, so the sparse mask matters); DeepSeek-V3's grouped router and block; a dense first layer
    "deepseek_v32": dict(
        hidden_size=72, intermediate_size=88, moe_intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=40, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, head_dim=8, n_routed_experts=12, n_shared_experts=1, num_experts_per_tok=3, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        mlp_layer_types=["dense", "sparse", "sparse"], index_topk=6,
        index_head_dim=24, index_n_heads=2,
    ),
    # GLM-5: the same layout, ungrouped routing
    "glm_moe_dsa": dict(
        hidden_size=80, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=24, qk_rope_head_dim=8,
        v_head_dim=24, head_dim=8, n_routed_experts=10, n_shared_experts=1, num_experts_per_tok=3, n_group=1,
        topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True, first_k_dense_replace=1,
        mlp_layer_types=["dense", "sparse", "sparse"],
        indexer_types=["full"] * 3, index_topk=5, index_head_dim=16, index_n_heads=2,
    ),
    # Llama 4 text (model_type llama4_text): top-1 sigmoid routing weighting the expert's input, a shared expert,
    # transposed experts; dense and sparse layers interleaved; chunked attention (chunks of 8, shorter than the test
    # prompts) with full-attention layers without rotary; L2-normed q/k
    "llama4": dict(
        hidden_size=72, intermediate_size=40, intermediate_size_mlp=88, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=18, num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2,
        attention_chunk_size=8, no_rope_layer_interval=2, use_qk_norm=True, router_jitter_noise=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # DeepSeek-V4: hash-routed MoE layers (a frozen token -> experts table, drawn below) then top-k ones (sqrtsoftplus
    # scores plus a correction bias), a clamped SwiGLU (limit reached by some activations) in routed and shared
    # experts; a sliding-window layer and compressed layers (CSA with its indexer keeping fewer entries than a test
    # prompt has, HCA) with windows shorter than the test prompts; hyper-connections of three streams
    "deepseek_v4": dict(
        hidden_size=72, moe_intermediate_size=40, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=24, partial_rotary_factor=1 / 3, q_lora_rank=40, o_groups=2, o_lora_rank=20, n_routed_experts=12,
        n_shared_experts=1, num_experts_per_tok=3, routed_scaling_factor=1.5, swiglu_limit=1.5,
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, sliding_window=8,
        index_n_heads=2, index_head_dim=16, index_topk=3, hc_mult=3,
    ),
}
#: the model_type a family's tiny model is built as, where it is not the family's name
_MODEL_TYPE = {"qwen3_5_moe": "qwen3_5_moe_text", "llama4": "llama4_text"}
#: the auto class that builds a family's tiny model, where it is not AutoModelForCausalLM (image-text wrappers)
_AUTO_CLASS = {"kimi_k25": "AutoModelForImageTextToText"}

# families whose RMSNorms scale by (1 + weight) (the gated-DeltaNet output norm scales by weight)
_ZERO_CENTERED_NORMS = {"qwen3_next", "qwen3_5_moe"}
# gpt-oss and Llama 4 experts are stored transposed ([E, H, 2I] and [E, I, H]): their fan-in is dim 1, not dim 2.
_TRANSPOSED_EXPERTS = {"gpt_oss", "llama4"}
# families whose non-strict _keep_in_fp32_modules is applied as from_pretrained applies it, for float16 only
# (DeepSeek-V4's lists compressor projections that take the model's bf16 activations: kept in float32 they would
# not run); the other families keep that list in float32 for every dtype, as their tests were measured
_FP32_LIST_FP16_ONLY = {"deepseek_v4"}
# gpt-oss gate_up is scaled up so the swiglu clamp (limit 7) is reached by some activations; down scaled back.
_EXPERT_SCALE = {"gpt_oss": (4.0, 0.25)}


def _check_family(family: str) -> None:
    if family not in _TINY:
        raise ValueError(f"no tiny model for family {family!r}; known families: {', '.join(ALL_FAMILIES)}")


def missing_reason(family: str) -> str | None:
    """Why the installed transformers cannot build ``family`` (its model_type is newer), or None when it can."""
    from transformers import CONFIG_MAPPING

    _check_family(family)
    if family in CONFIG_MAPPING:
        return None
    import transformers

    need = MIN_TRANSFORMERS.get(family, "a newer release")
    return f"{family} needs transformers {need}; {transformers.__version__} has no model_type {family!r}"


def tiny_config(family: str, **overrides):
    """The tiny ``PretrainedConfig`` of ``family`` (one of ``ALL_FAMILIES``); keywords override any field (of the
    text model's config for an image-text wrapper)."""
    from transformers import AutoConfig

    _check_family(family)
    entry = _TINY[family]
    if "text_config" in entry:  # a wrapper: the common keys and the overrides are its text model's
        text = {**_COMMON, **entry["text_config"], **overrides}
        kwargs = {**entry, "text_config": text, "tie_word_embeddings": text["tie_word_embeddings"]}
    else:
        kwargs = {**_COMMON, **entry, **overrides}
    return AutoConfig.for_model(_MODEL_TYPE.get(family, family), **kwargs)


def _fan_in(name: str, shape: torch.Size, transposed: bool) -> int:
    if len(shape) == 3:  # fused experts: [E, out, in], or [E, in, out] when transposed (gpt-oss)
        return shape[1] if transposed else shape[2]
    return shape[-1]


def _init_tensor(name: str, t: torch.Tensor, gen: torch.Generator, family: str) -> torch.Tensor:
    """A well-scaled random value for the parameter or buffer ``name`` (same shape, float32)."""
    shape = t.shape
    randn = torch.randn(shape, generator=gen, dtype=torch.float32)
    leaf = name.rsplit(".", 1)[-1]
    if family in _ZERO_CENTERED_NORMS and "norm" in name and ".linear_attn.norm." not in name:
        return 0.1 * randn  # (1 + weight) scales: around one
    if "norm" in name or "layernorm" in name:  # RMSNorm weights: around one
        return 1.0 + 0.1 * randn
    if "embed_tokens" in name:
        return randn
    if name.startswith("lm_head"):  # logits std ~2: argmax meaningful, not fixed
        return randn * (2.0 / math.sqrt(shape[-1]))
    if leaf == "e_score_correction_bias":
        return 0.05 * randn
    if leaf == "sinks":
        return 0.5 * randn
    if leaf.endswith("bias") or t.dim() == 1:
        return 0.1 * randn
    if ".gate.weight" in name or ".router.weight" in name or ".gate.wg.weight" in name:  # router [E, H]: std ~1.5
        return randn * (1.5 / math.sqrt(shape[-1]))
    std = 1.0 / math.sqrt(_fan_in(name, shape, family in _TRANSPOSED_EXPERTS))
    if t.dim() == 3 and family in _EXPERT_SCALE:
        up_scale, down_scale = _EXPERT_SCALE[family]
        std *= up_scale if "gate_up" in leaf else down_scale
    return randn * std


@torch.no_grad()
def _randomize(model: nn.Module, family: str, seed: int) -> None:
    """Overwrite every parameter and float buffer except rotary tables, in a fixed order."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        p.copy_(_init_tensor(name, p, gen, family))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(_init_tensor(name, b, gen, family))
    for name, router in model.named_modules():  # DeepSeek-V4's hash routers: k distinct experts for every token id
        table = getattr(router, "tid2eid", None)
        if isinstance(table, torch.Tensor) and not table.is_floating_point():
            V, k = table.shape
            table.copy_(torch.stack([torch.randperm(router.num_experts, generator=gen)[:k] for _ in range(V)]))


def _fp32_patterns(model: nn.Module, dtype: torch.dtype) -> list[re.Pattern]:
    names = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    family = getattr(getattr(model, "config", None), "model_type", None)
    if dtype == torch.float16 or family not in _FP32_LIST_FP16_ONLY:
        names += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return [re.compile(rf"(^|\.){re.escape(n)}(\.|$)") for n in names]


@torch.no_grad()
def cast_like_hf(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating parameters/buffers to ``dtype`` except those the class keeps in float32 (as from_pretrained).

    Rotary ``inv_freq`` buffers stay float32 too (HF never casts them)."""
    keep = _fp32_patterns(model, dtype)
    done: dict[int, torch.Tensor] = {}  # id(old tensor) -> new: tied tensors stay one tensor
    for mod_name, mod in model.named_modules():
        for store in (mod._parameters, mod._buffers):
            for key, t in store.items():
                if t is None or not t.is_floating_point():
                    continue
                if id(t) in done:
                    store[key] = done[id(t)]
                    continue
                full = f"{mod_name}.{key}" if mod_name else key
                target = torch.float32 if any(p.search(full) for p in keep) or "inv_freq" in key else dtype
                if t.dtype != target:
                    if isinstance(t, nn.Parameter):
                        store[key] = nn.Parameter(t.to(target), requires_grad=t.requires_grad)
                    else:
                        store[key] = t.to(target)
                    done[id(t)] = store[key]
    model.config.dtype = dtype
    return model


def build_tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """A tiny random ``*ForCausalLM`` of ``family`` in eval mode; same seed -> same float32 weights before the cast.

    ``overrides`` go to ``tiny_config`` (e.g. ``tie_word_embeddings=True``)."""
    import transformers

    config = tiny_config(family, **overrides)
    auto = getattr(transformers, _AUTO_CLASS.get(family, "AutoModelForCausalLM"))
    model = auto.from_config(config, dtype=torch.float32)
    _randomize(model, family, seed)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    if dtype != torch.float32:
        cast_like_hf(model, dtype)
    model.eval()
    model.requires_grad_(False)
    log.debug("built tiny %s (%s, seed %d): %d parameters", family, dtype, seed,
              sum(p.numel() for p in model.parameters()))
    return model


def tiny_prompts(n: int, length: int, seed: int = 0, vocab: int = _VOCAB) -> torch.Tensor:
    """Random token ids [n, length] avoiding the special ids 0-2 (pad, bos, eos)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen)
