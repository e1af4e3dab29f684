"""Tiny GGUF files written the way llama.cpp's converter writes them, from a tiny HF model, for the GGUF tests.

Names come from gguf-py's own ``TensorNameMap`` (not from ktinject's table); the experts are stacked [E, N, K] as
``blk.N.ffn_{gate,up,down}_exps.weight``; llama-architecture (Mixtral) Q / K rows are permuted as
``convert_hf_to_gguf.py`` permutes them. Q8_0 / Q4_0 / F16 bytes come from ``gguf.quants.quantize``; gguf-py cannot
quantize K-quants, so Q4_K / Q6_K blocks are packed here (a simple round-to-nearest, any valid blocks will do: the
oracle is what gguf's own ``dequantize`` makes of them). ``write_gguf`` returns {HF model tensor name: float32
values as dequantized by ``gguf.quants.dequantize``}, the reference model's weights.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType
ARCH = {"qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE, "mixtral": gguf.MODEL_ARCH.LLAMA}


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


def gguf_tensors(model) -> list[tuple[str, str, np.ndarray]]:
    """(GGUF name, HF name, float32 values as GGUF stores them) for every tensor; experts as [E, N, K] under the
    HF fused name with ``#gate`` / ``#up`` appended for the halves of gate_up_proj."""
    cfg = model.config
    tmap = gguf.get_tensor_name_map(ARCH[cfg.model_type], cfg.num_hidden_layers)
    out = []
    for name, t in model.state_dict().items():
        x = t.detach().float().numpy()
        if name.endswith("experts.gate_up_proj"):
            bid = name.split(".")[2]
            half = x.shape[1] // 2
            out.append((f"blk.{bid}.ffn_gate_exps.weight", name + "#gate", x[:, :half]))
            out.append((f"blk.{bid}.ffn_up_exps.weight", name + "#up", x[:, half:]))
            continue
        if name.endswith("experts.down_proj"):
            out.append((f"blk.{name.split('.')[2]}.ffn_down_exps.weight", name, x))
            continue
        base, _, suffix = name.rpartition(".")
        gname = tmap.get_name(base)
        if gname is None and ".mlp." in base:  # dense layers of the tiny qwen3_moe (no real qwen3moe GGUF has them)
            bid, proj = base.split(".")[2], base.rsplit(".", 1)[1]
            gname = {"gate_proj": f"blk.{bid}.ffn_gate", "up_proj": f"blk.{bid}.ffn_up",
                     "down_proj": f"blk.{bid}.ffn_down"}.get(proj)
        assert gname is not None, name
        if gname.endswith("ffn_gate_inp_shexp"):
            x = x.reshape(-1)
        if cfg.model_type == "mixtral" and gname.endswith(("attn_q", "attn_k")):
            heads = cfg.num_attention_heads if gname.endswith("attn_q") else cfg.num_key_value_heads
            x = _permute(x, heads)
        out.append((f"{gname}.{suffix}", name, x))
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


def write_gguf(model, path: Path, qtype_of, split_max_tensors: int = 0, tokenizer: bool = False):
    """Write ``model`` as GGUF at ``path``; ``qtype_of(gguf_name, values) -> GGMLQuantizationType``. Returns
    {HF model tensor name: float32 torch tensor of the stored values, dequantized by gguf} (the HF layout)."""
    cfg = model.config
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[ARCH[cfg.model_type]],
                        split_max_tensors=split_max_tensors)
    _metadata(w, cfg, tokenizer)
    deq: dict[str, np.ndarray] = {}
    for gname, hname, x in gguf_tensors(model):
        qtype = qtype_of(gname, x) if x.ndim >= 2 else Q.F32
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
        deq[hname] = back.reshape(1, -1) if gname.endswith("ffn_gate_inp_shexp.weight") else back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = {}
    for name, x in deq.items():
        if name.endswith("#gate"):
            out[name[:-5]] = torch.from_numpy(np.concatenate([x, deq[name[:-5] + "#up"]], 1))
        elif not name.endswith("#up"):
            out[name] = torch.from_numpy(np.ascontiguousarray(x))
    return out


def reference_model(model, weights: dict[str, torch.Tensor]):
    """A float32 copy of ``model`` holding ``weights`` (the GGUF's dequantized values)."""
    import copy

    ref = copy.deepcopy(model).float()
    missing, unexpected = ref.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return ref.eval()
