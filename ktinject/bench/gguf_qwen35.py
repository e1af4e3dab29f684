"""Random-weight GGUF files of the Qwen3.5-MoE bench model (llama.cpp architecture ``qwen35moe``), for the peer.

The file is what llama.cpp's converter (``Qwen3_5MoeTextModel``, without the MTP block) + ``llama-quantize`` would
write for a ``Qwen3_5MoeTextConfig``, through ``bench.gguf_file``'s writer, blocks, vocabulary (pre-tokenizer
qwen35) and ``TYPES``. Per layer, by ``config.layer_types`` (every ``full_attention_interval``-th layer full
attention, the rest gated DeltaNet):

    both            attn_norm, post_attention_norm F32; the router ffn_gate_inp [H, E] F32; the routed experts
                    ffn_{gate,up}_exps [H, I, E], ffn_down_exps [I, H, E]; the shared expert ffn_{gate,up}_shexp
                    [H, Is], ffn_down_shexp [Is, H] and its sigmoid gate ffn_gate_inp_shexp [H] (F32)
    full attention  attn_q [H, 2 Nh D] (each head's query, then its output gate), attn_k / attn_v [H, Nkv D],
                    attn_output [Nh D, H], attn_q_norm / attn_k_norm [D] F32
    linear          attn_qkv [H, 2 Nk Dk + Nv Dv], attn_gate (z) [H, Nv Dv], ssm_beta / ssm_alpha [H, Nv],
                    ssm_out [Nv Dv, H]; F32: ssm_conv1d [kernel, 2 Nk Dk + Nv Dv], ssm_dt.bias [Nv], ssm_a [Nv]
                    (-exp(A_log): -1 here, a decay in (0, 1)), ssm_norm [Dv]

(ggml order: ne[0], the row, first). The matrices take the format's main type (``fitted`` to their rows as
llama-quantize falls back), the 1-D tensors and ssm_conv1d stay F32 (llama-quantize leaves them: fewer than two
dimensions, ``_norm.weight``, ``ssm_conv1d``; ggml's CPU ssm_conv and the ssm_a / ssm_dt adds need F32). Q4_K_M's
Q6_K goes to the attn_v-like tensor of each layer llama.cpp's ``use_more_bits`` picks (attn_v, or attn_qkv: each
layer has one, so its count is the layer) and to both its ffn_down tensors (routed and shared).

Hyperparameters (``qwen35moe.*``): the qwen3moe ones without feed_forward_length (the config has no dense
intermediate), expert_shared_feed_forward_length, ssm.{conv_kernel, state_size (Dk), group_count (Nk),
time_step_rank (Nv), inner_size (Nv Dv)}, full_attention_interval, rope.dimension_count (D x
partial_rotary_factor) and rope.dimension_sections (mrope_section padded to four; the converter's [11, 11, 10, 0]
where the config has none). Legend: H hidden, E experts, I expert intermediate, Is shared expert intermediate, Nh /
Nkv query / KV heads of D, Nk / Nv linear-attention key / value heads of Dk / Dv, L layers.
"""
from __future__ import annotations

from pathlib import Path

from ktinject.bench.gguf_file import (Tensor, add_header, add_moe_hparams, add_tokenizer, check_format, mixes,
                                      output_type, weight, write_file)

ARCH = "qwen35moe"
MROPE_SECTION = [11, 11, 10]  # the converter's default (transformers' Qwen3.5 rotary takes the same)


def full_attention_interval(config) -> int:
    """The interval of ``config.layer_types`` (layer i full attention when (i + 1) % interval == 0), as
    ``qwen35moe.full_attention_interval`` says it; ValueError where the layers follow another pattern."""
    kinds = list(config.layer_types)
    if "full_attention" not in kinds:
        raise ValueError(f"layer_types {kinds}: no full-attention layer; qwen35moe needs one every interval")
    n = kinds.index("full_attention") + 1
    want = ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(len(kinds))]
    if kinds != want:
        raise ValueError(f"layer_types {kinds}: not one full-attention layer every {n} (llama.cpp's "
                         f"full_attention_interval); give a number of layers that is a multiple of {n}")
    return n


def rope_sections(config) -> list[int]:
    """rope.dimension_sections: the config's mrope_section (or the converter's default), padded to four."""
    sections = list((config.rope_parameters or {}).get("mrope_section") or MROPE_SECTION)
    return (sections + [0] * 4)[:4]


def rope_dims(config) -> int:
    return int(config.head_dim * float((config.rope_parameters or {}).get("partial_rotary_factor", 1.0)))


def _attention(p: str, config, main: str, v_type: str) -> list[Tensor]:
    """A full-attention layer's tensors (query and its gate interleaved per head in attn_q)."""
    H, D = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * D, config.num_key_value_heads * D
    return [weight(p + "attn_q.weight", (H, 2 * q), main, H), weight(p + "attn_k.weight", (H, kv), main, H),
            weight(p + "attn_v.weight", (H, kv), v_type, H), weight(p + "attn_output.weight", (q, H), main, H),
            Tensor(p + "attn_q_norm.weight", (D,), "F32", 0.0), Tensor(p + "attn_k_norm.weight", (D,), "F32", 0.0)]


def _linear_attention(p: str, config, main: str, qkv_type: str) -> list[Tensor]:
    """A gated DeltaNet layer's tensors, named and shaped as the converter writes them."""
    H, K = config.hidden_size, config.linear_conv_kernel_dim
    nv, dv = config.linear_num_value_heads, config.linear_value_head_dim
    key, value = config.linear_num_key_heads * config.linear_key_head_dim, nv * dv
    return [weight(p + "attn_qkv.weight", (H, 2 * key + value), qkv_type, H),
            weight(p + "attn_gate.weight", (H, value), main, H),
            Tensor(p + "ssm_conv1d.weight", (K, 2 * key + value), "F32", K ** -0.5),
            Tensor(p + "ssm_dt.bias", (nv,), "F32", 0.0),
            Tensor(p + "ssm_a", (nv,), "F32", 0.0, fill=-1.0),
            weight(p + "ssm_beta.weight", (H, nv), main, H), weight(p + "ssm_alpha.weight", (H, nv), main, H),
            Tensor(p + "ssm_norm.weight", (dv,), "F32", 0.0),
            weight(p + "ssm_out.weight", (value, H), main, H)]


def _moe(p: str, config, main: str, down: str) -> list[Tensor]:
    """The router, the routed experts and the gated shared expert."""
    H, E, I = config.hidden_size, config.num_experts, config.moe_intermediate_size
    Is = config.shared_expert_intermediate_size
    return [weight(p + "ffn_gate_inp.weight", (H, E), "F32", H, "mlp.gate.weight"),
            weight(p + "ffn_gate_exps.weight", (H, I, E), main, H),
            weight(p + "ffn_down_exps.weight", (I, H, E), down, H),
            weight(p + "ffn_up_exps.weight", (H, I, E), main, H),
            weight(p + "ffn_gate_inp_shexp.weight", (H,), "F32", H),
            weight(p + "ffn_gate_shexp.weight", (H, Is), main, H),
            weight(p + "ffn_down_shexp.weight", (Is, H), down, H),
            weight(p + "ffn_up_shexp.weight", (H, Is), main, H)]


def plan(config, fmt: str) -> list[Tensor]:
    """The tensors of ``config`` (a ``Qwen3_5MoeTextConfig``) as ``fmt`` writes them, layer by layer."""
    check_format(fmt)
    full_attention_interval(config)
    H, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    main, more = mixes(fmt, L)
    ts = [weight("token_embd.weight", (H, V), main, H, "model.embed_tokens.weight")]
    for i, kind in enumerate(config.layer_types):
        p = f"blk.{i}."
        ts.append(Tensor(p + "attn_norm.weight", (H,), "F32", 0.0))
        attn = _attention if kind == "full_attention" else _linear_attention
        ts += attn(p, config, main, more(i))
        ts.append(Tensor(p + "post_attention_norm.weight", (H,), "F32", 0.0))
        ts += _moe(p, config, main, more(i))
    ts.append(Tensor("output_norm.weight", (H,), "F32", 0.0))
    ts.append(weight("output.weight", (H, V), output_type(fmt, H), H, "lm_head.weight"))
    return ts


def _metadata(w, config, fmt: str) -> None:
    add_header(w, ARCH, fmt)
    add_moe_hparams(w, config)
    w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    w.add_ssm_state_size(config.linear_key_head_dim)
    w.add_ssm_group_count(config.linear_num_key_heads)
    w.add_ssm_time_step_rank(config.linear_num_value_heads)
    w.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    w.add_full_attention_interval(full_attention_interval(config))
    w.add_rope_dimension_count(rope_dims(config))
    w.add_rope_dimension_sections(rope_sections(config))
    add_tokenizer(w, config.vocab_size, "qwen35")


def check(config) -> None:
    """ValueError naming the field where llama.cpp's qwen35moe cannot take ``config``'s shapes."""
    if config.linear_key_head_dim != config.linear_value_head_dim:
        raise ValueError(f"linear_key_head_dim {config.linear_key_head_dim} != linear_value_head_dim "
                         f"{config.linear_value_head_dim}: llama.cpp's qwen35moe has one ssm.state_size for both")
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ValueError(f"linear_num_value_heads {config.linear_num_value_heads} is not a multiple of "
                         f"linear_num_key_heads {config.linear_num_key_heads}")
    if sum(rope_sections(config)) > rope_dims(config):
        raise ValueError(f"mrope_section {rope_sections(config)} sums past the {rope_dims(config)} rotary dims "
                         f"(head_dim x partial_rotary_factor): give rope_parameters a smaller mrope_section")


def write(path: Path, config, fmt: str, seed: int = 0) -> dict:
    """Write the qwen35moe GGUF of ``config`` in ``fmt`` at ``path``; returns ``gguf_file.write``'s sizes."""
    check(config)
    return write_file(path, ARCH, plan(config, fmt), lambda w: _metadata(w, config, fmt), seed)
