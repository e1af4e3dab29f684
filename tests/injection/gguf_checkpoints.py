"""Tiny GGUF files written the way llama.cpp's converter writes them, from a tiny HF model, for the GGUF tests.

Names come from gguf-py's own ``TensorNameMap`` (not from ktinject's table); the experts are stacked [E, N, K] as
``blk.N.ffn_{gate,up,down}_exps.weight``; the tensors are transformed as ``convert_hf_to_gguf.py`` transforms them:
llama-architecture (Mixtral) Q / K rows permuted; DeepSeek's ``kv_b_proj`` split per head into ``attn_k_b``
(transposed) and ``attn_v_b`` (``mla_split``; older files keep ``attn_kv_b``), ``e_score_correction_bias`` renamed
``exp_probs_b.bias``; gpt-oss's fused experts transposed and split into gate (even) and up (odd) rows; GLM-4.5's
NextN block (a copy of the last layer + ``nextn.*``) appended, as real GGUFs carry it. Q8_0 / Q4_0 / F16 / MXFP4
bytes come from ``gguf.quants.quantize``; gguf-py cannot quantize K-quants, so Q4_K / Q6_K blocks are packed here (a
simple round-to-nearest, any valid blocks will do: the oracle is what gguf's own ``dequantize`` makes of them).
``write_gguf`` returns {HF model tensor name: float32 values as dequantized by ``gguf.quants.dequantize``}, the
reference model's weights.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType
ARCH = {"qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE, "mixtral": gguf.MODEL_ARCH.LLAMA,
        "deepseek_v2": gguf.MODEL_ARCH.DEEPSEEK2, "deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2,
        "glm4_moe": gguf.MODEL_ARCH.GLM4_MOE, "gpt_oss": gguf.MODEL_ARCH.GPT_OSS}


def _q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K blocks of rows x [R, K] (K % 256 == 0): 8 sub-blocks of 32, value = d*sc*q - dmin*m, q in 0..15."""
    b = x.reshape(-1, 8, 32).astype(np.float32)
    lo, hi = b.min(-1).clip(max=0), b.max(-1).clip(min=0)
    scale, mn = (hi - lo) / 15, -lo
    d, dmin = (scale.max(-1) / 63).astype(np.float16), (mn.max(-1) / 63).astype(np.float16)
    df, dmf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.where(df > 0, np.round(scale / np.where(df > 0, df, 1)), 0).clip(0, 63).astype(np.uint8)
    m = np.where(dmf > 0, np.round(mn / np.where(dmf > 0, dmf, 1)), 0).clip(0, 63).astype(np.uint8)
    step, off = (df * sc)[..., None], (dmf * m)[..., None]
    q = np.where(step > 0, np.round((b + off) / np.where(step > 0, step, 1)), 0).clip(0, 15).astype(np.uint8)
    scales = np.zeros((b.shape[0], 12), np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    qs = q.reshape(-1, 4, 2, 32)
    qs = (qs[:, :, 0] | (qs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], 1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks: 16 sub-blocks of 16, int8 scales, value = d * sc * (q - 32), q in 0..63."""
    b = x.reshape(-1, 16, 16).astype(np.float32)
    amax = np.abs(b).max(-1)
    d = (amax.max(-1) / 31 / 127).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    sc = np.where(df > 0, np.round(amax / 31 / np.where(df > 0, df, 1)), 0).clip(-128, 127).astype(np.int8)
    step = (df * sc)[..., None]
    q = (np.where(step > 0, np.round(b / np.where(step > 0, step, 1)), 0).clip(-32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # per 128-half: 4 rows of 32 (l, l+32, l+64, l+96)
    ql = np.concatenate([(q[:, h, 0] & 15) | ((q[:, h, 2] & 15) << 4) for h in range(2)] +
                        [(q[:, h, 1] & 15) | ((q[:, h, 3] & 15) << 4) for h in range(2)], 1)
    ql = ql.reshape(-1, 2, 2, 32).transpose(0, 2, 1, 3).reshape(-1, 128)
    qh = np.concatenate([(q[:, h, 0] >> 4) | ((q[:, h, 1] >> 4) << 2) | ((q[:, h, 2] >> 4) << 4)
                         | ((q[:, h, 3] >> 4) << 6) for h in range(2)], 1)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], 1)


def quantize(x: np.ndarray, qtype) -> np.ndarray:
    """Bytes of ``x`` [..., K] as ``qtype`` ([..., K / block * bytes] uint8, or the float array for F32/F16)."""
    if qtype == Q.Q4_K:
        return _q4_k(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
    if qtype == Q.Q6_K:
        return _q6_k(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
    return gguf.quants.quantize(x, qtype)


def dequantize(data: np.ndarray, qtype) -> np.ndarray:
    return gguf.quants.dequantize(data, qtype).astype(np.float32)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _mla_split(x: np.ndarray, cfg) -> tuple[np.ndarray, np.ndarray]:
    """convert_hf_to_gguf.py's DeepseekV2Model: kv_b [heads * (nope + v), rank] -> k_b [heads, rank, nope] (transposed),
    v_b [heads, v, rank]."""
    kv_b = x.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, x.shape[-1])
    return kv_b[:, :cfg.qk_nope_head_dim].transpose(0, 2, 1), kv_b[:, cfg.qk_nope_head_dim:]


def _tensors_of(model, mtp: bool) -> list[tuple[str, np.ndarray]]:
    """The HF checkpoint's tensors; ``mtp``: with a NextN block after the last layer (GLM-4.5's checkpoints)."""
    items = [(n, t.detach().float().numpy()) for n, t in model.state_dict().items()]
    if mtp:
        L = model.config.num_hidden_layers
        H = model.config.hidden_size
        last = f"model.layers.{L - 1}."
        items += [(f"model.layers.{L}." + n[len(last):], x) for n, x in items if n.startswith(last)]
        rng = np.random.default_rng(3)
        items += [(f"model.layers.{L}.eh_proj.weight", rng.standard_normal((H, 2 * H)).astype(np.float32))]
        items += [(f"model.layers.{L}.{n}.weight", np.ones(H, np.float32))
                  for n in ("enorm", "hnorm", "shared_head.norm")]
    return items


def gguf_tensors(model, mla_split: bool = True) -> list[tuple[str, str, np.ndarray]]:
    """(GGUF name, HF name, float32 values as GGUF stores them) for every tensor; experts as [E, N, K] under the
    HF fused name with ``#gate`` / ``#up`` appended for the halves of gate_up_proj (``#k_b`` / ``#v_b``: MLA's)."""
    cfg = model.config
    mt, mtp = cfg.model_type, cfg.model_type == "glm4_moe"
    tmap = gguf.get_tensor_name_map(ARCH[mt], cfg.num_hidden_layers + mtp)
    out = []
    for name, x in _tensors_of(model, mtp):
        if mt == "gpt_oss" and ".experts." in name:
            out += _gpt_oss_experts(name, x)
            continue
        if name.endswith("experts.gate_up_proj"):
            bid = name.split(".")[2]
            half = x.shape[1] // 2
            out.append((f"blk.{bid}.ffn_gate_exps.weight", name + "#gate", x[:, :half]))
            out.append((f"blk.{bid}.ffn_up_exps.weight", name + "#up", x[:, half:]))
            continue
        if name.endswith("experts.down_proj"):
            out.append((f"blk.{name.split('.')[2]}.ffn_down_exps.weight", name, x))
            continue
        hf = name
        if name.endswith("e_score_correction_bias"):  # the converter's rename
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if name.endswith(".sinks"):
            name += ".weight"
        base, _, suffix = name.rpartition(".")
        if mla_split and base.endswith("kv_b_proj"):
            k_b, v_b = _mla_split(x, cfg)
            out.append((tmap.get_name(base.replace("kv_b_proj", "k_b_proj")) + ".weight", hf + "#k_b", k_b))
            out.append((tmap.get_name(base.replace("kv_b_proj", "v_b_proj")) + ".weight", hf + "#v_b", v_b))
            continue
        gname = tmap.get_name(base)
        if gname is None and ".mlp." in base:  # dense layers of the tiny qwen3_moe (no real qwen3moe GGUF has them)
            bid, proj = base.split(".")[2], base.rsplit(".", 1)[1]
            gname = {"gate_proj": f"blk.{bid}.ffn_gate", "up_proj": f"blk.{bid}.ffn_up",
                     "down_proj": f"blk.{bid}.ffn_down"}.get(proj)
        assert gname is not None, name
        if gname.endswith("ffn_gate_inp_shexp"):
            x = x.reshape(-1)
        if mt == "mixtral" and gname.endswith(("attn_q", "attn_k")):
            heads = cfg.num_attention_heads if gname.endswith("attn_q") else cfg.num_key_value_heads
            x = _permute(x, heads)
        out.append((f"{gname}.{suffix}", hf, x))
    return out


def _gpt_oss_experts(name: str, x: np.ndarray) -> list[tuple[str, str, np.ndarray]]:
    """GptOssModel.modify_tensors (unquantized experts): gate_up [E, H, 2I] -> transposed, even rows gate, odd up;
    down [E, I, H] -> transposed; biases split the same way."""
    blk = f"blk.{name.split('.')[2]}"
    leaf = name.rsplit(".", 1)[1]
    if leaf == "gate_up_proj":
        t = x.swapaxes(-1, -2)
        return [(f"{blk}.ffn_gate_exps.weight", name + "#gate", t[:, 0::2]),
                (f"{blk}.ffn_up_exps.weight", name + "#up", t[:, 1::2])]
    if leaf == "gate_up_proj_bias":
        return [(f"{blk}.ffn_gate_exps.bias", name + "#gate", x[..., 0::2]),
                (f"{blk}.ffn_up_exps.bias", name + "#up", x[..., 1::2])]
    if leaf == "down_proj":
        return [(f"{blk}.ffn_down_exps.weight", name + "#t", x.swapaxes(-1, -2))]
    return [(f"{blk}.ffn_down_exps.bias", name, x)]


def _hf_layout(deq: dict[str, np.ndarray], cfg) -> dict[str, torch.Tensor]:
    """The dequantized GGUF tensors back in the HF model's layout (the converter's transforms undone)."""
    out = {}
    for name, x in deq.items():
        base, _, how = name.partition("#")
        if how == "gate":
            up = deq[base + "#up"]
            if cfg.model_type == "gpt_oss":
                pair = np.stack([x, up], -1)  # [E, I, H, 2] or [E, I, 2]
                x = pair.swapaxes(1, 2).reshape(x.shape[0], x.shape[2], -1) if x.ndim == 3 else pair.reshape(
                    x.shape[0], -1)
            else:
                x = np.concatenate([x, up], 1)
        elif how == "t":
            x = x.swapaxes(-1, -2)
        elif how == "k_b":
            kv_b = np.concatenate([x.transpose(0, 2, 1), deq[base + "#v_b"]], 1)
            x = kv_b.reshape(-1, kv_b.shape[-1])
        elif how in ("up", "v_b"):
            continue
        out[base] = torch.from_numpy(np.ascontiguousarray(x))
    return out


def _metadata(w: gguf.GGUFWriter, cfg, tokenizer: bool) -> None:
    w.add_name(f"tiny {cfg.model_type}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.model_type == "mixtral":
        w.add_expert_count(cfg.num_local_experts)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    else:  # qwen3moe: llama.cpp writes expert_feed_forward_length; transformers' mapping ignores it
        w.add_expert_count(cfg.num_experts)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "head_dim", None) and cfg.model_type == "qwen3_moe":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if cfg.model_type == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if tokenizer:
        add_tokenizer(w, cfg.vocab_size)


def _moe_metadata(w: gguf.GGUFWriter, cfg, mla_split: bool) -> None:
    """What convert_hf_to_gguf.py's TextModel + DeepseekV2Model / Glm4MoeModel / GptOssModel write (the tiny configs
    have no rope scaling); glm4moe and gpt-oss take the vocabulary from the token list, as real files do."""
    mt = cfg.model_type
    w.add_name(f"tiny {mt}")
    w.add_block_count(cfg.num_hidden_layers + (mt == "glm4_moe"))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1 if mt.startswith("deepseek") else cfg.num_key_value_heads)  # MLA as MQA
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_local_experts if mt == "gpt_oss" else cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if mt == "gpt_oss":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        add_tokenizer(w, cfg.vocab_size)
        return
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX if mt == "deepseek_v2"
                             else gguf.ExpertGatingFuncType.SIGMOID)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    if mt == "glm4_moe":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
        w.add_nextn_predict_layers(1)
        add_tokenizer(w, cfg.vocab_size)
        return
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    if mla_split:
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
    else:  # the converter before the MLA split
        w.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.v_head_dim)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def add_tokenizer(w: gguf.GGUFWriter, vocab: int) -> None:
    """A byte-level BPE (gpt2 model) of ``vocab`` tokens: 3 specials, printable ASCII, 'Ġ' (space), merges."""
    chars = [chr(c) for c in range(33, 127)] + ["\u0120"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("\u0120", "w")]
    tokens = specials + chars + ["".join(m) for m in merges]
    tokens += [f"<|extra_{i}|>" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (len(chars) + len(merges)) + [3] * (vocab - 3 - len(chars) - len(merges)))
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)


def write_gguf(model, path: Path, qtype_of, split_max_tensors: int = 0, tokenizer: bool = False,
               mla_split: bool = True, extra=None):
    """Write ``model`` as GGUF at ``path``; ``qtype_of(gguf_name, values) -> GGMLQuantizationType``; ``extra(writer)``
    adds metadata. Returns {HF model tensor name: float32 torch tensor of the stored values, dequantized by gguf}
    (the HF layout)."""
    cfg = model.config
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[ARCH[cfg.model_type]],
                        split_max_tensors=split_max_tensors)
    if cfg.model_type in ("deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss"):
        _moe_metadata(w, cfg, mla_split)
    else:
        _metadata(w, cfg, tokenizer)
    if extra is not None:
        extra(w)
    keys = set(model.state_dict())
    deq: dict[str, np.ndarray] = {}
    for gname, hname, x in gguf_tensors(model, mla_split):
        qtype = qtype_of(gname, x) if x.ndim >= 2 and not gname.endswith(".bias") else Q.F32
        data = quantize(np.ascontiguousarray(x), qtype)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(gname, data)
            back = data.astype(np.float32)
        else:
            w.add_tensor(gname, data, raw_dtype=qtype)
            back = dequantize(data, qtype).reshape(x.shape)
        if cfg.model_type == "mixtral" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if ".attn_q." in gname else cfg.num_key_value_heads
            back = back.reshape(heads, back.shape[0] // heads // 2, 2, -1).swapaxes(2, 1).reshape(back.shape)
        if hname.partition("#")[0] in keys:  # (not the NextN block)
            deq[hname] = back.reshape(1, -1) if gname.endswith("ffn_gate_inp_shexp.weight") else back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return _hf_layout(deq, cfg)


def reference_model(model, weights: dict[str, torch.Tensor]):
    """A float32 copy of ``model`` holding ``weights`` (the GGUF's dequantized values)."""
    import copy

    ref = copy.deepcopy(model).float()
    missing, unexpected = ref.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return ref.eval()
