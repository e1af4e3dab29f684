"""Random-weight GGUF files of the bench model (architecture ``qwen3moe``), fast, for ``bench load`` and the peer;
the writer, blocks and vocabulary here are also ``bench.gguf_qwen35``'s (architecture ``qwen35moe``).

The file is what llama.cpp's converter + ``llama-quantize`` would write for a Qwen3-MoE model: the ``qwen3moe.*``
hyperparameters, a byte-level BPE vocabulary of exactly ``vocab_size`` tokens (``tokenizer.ggml.*``, pre-tokenizer
qwen2, a ChatML template: llama.cpp's tools load it), the experts stacked ``blk.N.ffn_{gate,up,down}_exps.weight``
[E, N, K], norms and the router (``ffn_gate_inp``) F32. Tensor types by format (``TYPES``):

    gguf-q8_0     Q8_0 everywhere                          (llama.cpp's Q8_0 keeps output.weight Q8_0)
    gguf-q4_0     Q4_0, output.weight Q6_K
    gguf-q6_k     Q6_K everywhere
    gguf-q4_k_m   Q4_K, and Q6_K for output.weight and for attn_v / ffn_down(_exps) of the layers llama.cpp's
                  ``use_more_bits`` picks (the first and last eighth, and every third layer between): its Q4_K_M mix

Where a tensor's rows are not whole blocks of its type, it gets what ``llama-quantize`` falls back to (``fitted``:
Q4_K -> Q5_0, Q6_K -> Q8_0, then F16 where 32-value blocks do not fit either; output.weight Q8_0 where the main
type does not fit).

No value is quantized: every block is random codes with sane scales (fp16 d / dmin small and finite, the K-quants'
sub-block scales in a narrow band), chosen so the values have about the standard deviation of the in-memory bench
model's weights (``model.weight_std``; the K-quants' sub-block means are zero). A pool of such blocks is made once per
(type, deviation) and tensors are written as windows of whole blocks from it at random offsets, straight from the
pool into the file: the writer runs at the disk's speed. Needs the ``gguf`` package (``ktinject[gguf]``) for the
header. Legend: E experts, H hidden, I expert intermediate, K a row's length (ne[0]), L layers.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: ggml type -> (values a block, bytes a block)
BLOCKS = {"F32": (1, 4), "F16": (1, 2), "Q8_0": (32, 34), "Q5_0": (32, 22), "Q4_0": (32, 18), "Q4_K": (256, 144),
          "Q6_K": (256, 210)}
#: llama-quantize's type for rows that are not whole blocks of the one asked (tensor_type_fallback); then F16
FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}
#: bench format -> (main type, output.weight type, llama_ftype name)
TYPES = {"gguf-q8_0": ("Q8_0", "Q8_0", "MOSTLY_Q8_0"), "gguf-q4_0": ("Q4_0", "Q6_K", "MOSTLY_Q4_0"),
         "gguf-q6_k": ("Q6_K", "Q6_K", "MOSTLY_Q6_K"), "gguf-q4_k_m": ("Q4_K", "Q6_K", "MOSTLY_Q4_K_M")}
POOL_BYTES = 32 << 20  # random blocks per (type, deviation); windows of at most half of it
CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% endif %}")


@dataclass
class Tensor:
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] the row
    qtype: str
    std: float  # 0: every value ``fill`` (norms: ones)
    fill: float = 1.0

    @property
    def nbytes(self) -> int:
        per, size = BLOCKS[self.qtype]
        if self.ne[0] % per:
            raise ValueError(f"{self.name}: rows of {self.ne[0]} are not whole {self.qtype} blocks of {per}")
        return math.prod(self.ne) // per * size


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in the _M mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def fitted(qtype: str, row: int) -> str:
    """``qtype``, or what llama-quantize writes where rows of ``row`` values are not whole blocks of it."""
    if row % BLOCKS[qtype][0] == 0:
        return qtype
    qtype = FALLBACK.get(qtype, qtype)
    return qtype if row % BLOCKS[qtype][0] == 0 else "F16"


def output_type(fmt: str, row: int) -> str:
    """output.weight's type: ``TYPES``' where the main type's blocks fit its rows, else Q8_0 (then ``fitted``)."""
    main, out, _ = TYPES[fmt]
    return fitted(out if row % BLOCKS[main][0] == 0 else "Q8_0", row)


def mixes(fmt: str, layers: int):
    """(main type, type of layer i's attn_v-like and ffn_down tensors) of ``fmt``."""
    main = TYPES[fmt][0]
    if fmt == "gguf-q4_k_m":
        return main, lambda i: "Q6_K" if use_more_bits(i, layers) else main
    return main, lambda i: main


def weight(name: str, ne: tuple[int, ...], qtype: str, hidden: int, hf: str = "") -> Tensor:
    """A tensor of ``qtype`` (``fitted`` to its rows) whose values have the deviation the in-memory model draws its
    HF tensor ``hf`` with (``model.weight_std``; by default 1 / sqrt(row))."""
    from ktinject.bench.model import weight_std

    return Tensor(name, ne, fitted(qtype, ne[0]), weight_std(hf, tuple(reversed(ne)), hidden))


def plan(config, fmt: str) -> list[Tensor]:
    """The tensors of ``config`` (a Qwen3-MoE config) as ``fmt`` writes them, in the converter's order."""
    H, L, E, I = config.hidden_size, config.num_hidden_layers, config.num_experts, config.moe_intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    main, more = mixes(fmt, L)

    def w(name, ne, qtype, hf):
        return weight(name, ne, qtype, H, hf)

    ts = [w("token_embd.weight", (H, config.vocab_size), main, "model.embed_tokens.weight")]
    for i in range(L):
        p = f"blk.{i}."
        ts += [Tensor(p + "attn_norm.weight", (H,), "F32", 0.0), w(p + "attn_q.weight", (H, q), main, ""),
               w(p + "attn_k.weight", (H, kv), main, ""), w(p + "attn_v.weight", (H, kv), more(i), ""),
               w(p + "attn_output.weight", (q, H), main, ""),
               Tensor(p + "attn_q_norm.weight", (config.head_dim,), "F32", 0.0),
               Tensor(p + "attn_k_norm.weight", (config.head_dim,), "F32", 0.0),
               Tensor(p + "ffn_norm.weight", (H,), "F32", 0.0),
               w(p + "ffn_gate_inp.weight", (H, E), "F32", "mlp.gate.weight"),
               w(p + "ffn_gate_exps.weight", (H, I, E), main, ""),
               w(p + "ffn_down_exps.weight", (I, H, E), more(i), ""),
               w(p + "ffn_up_exps.weight", (H, I, E), main, "")]
    ts.append(Tensor("output_norm.weight", (H,), "F32", 0.0))
    ts.append(w("output.weight", (H, config.vocab_size), output_type(fmt, H), "lm_head.weight"))
    return ts


# ---- random blocks -------------------------------------------------------------------------------------------
def _fp16(x: float) -> np.ndarray:
    return np.array([x], dtype=np.float16).view(np.uint8)


def random_blocks(qtype: str, n: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` valid ``qtype`` blocks (uint8 [n, bytes]) of random codes whose values have about deviation ``std``."""
    size = BLOCKS[qtype][1]
    if qtype == "F16":  # plain values (llama-quantize's last fallback)
        x = rng.standard_normal(n, dtype=np.float32) * np.float32(std)
        return x.astype(np.float16).view(np.uint8).reshape(n, size)
    b = np.frombuffer(rng.bytes(n * size), dtype=np.uint8).reshape(n, size).copy()
    if qtype == "Q8_0":  # d, then 32 int8 codes in -127..127 (std ~73.6)
        b[:, 2:][b[:, 2:] == 0x80] = 0x81
        b[:, :2] = _fp16(std / 73.6)
    elif qtype == "Q4_0":  # d, then 16 bytes of nibbles; value d * (nibble - 8) (std ~4.61)
        b[:, :2] = _fp16(std / 4.61)
    elif qtype == "Q5_0":  # d, 4 bytes of fifth bits, 16 bytes of nibbles; value d * (code - 16) (std ~9.23)
        b[:, :2] = _fp16(std / 9.23)
    elif qtype == "Q4_K":  # d, dmin, 12 bytes of 6-bit scales / mins of 8 sub-blocks, 128 bytes of nibbles
        sc = rng.integers(8, 16, (n, 8), dtype=np.uint8)  # value = d * sc * q - dmin * m, with m = sc and
        d = std / (4.61 * math.sqrt(float(np.mean(sc.astype(np.float32) ** 2))))  # dmin = 7.5 d: mean zero
        b[:, 0:2], b[:, 2:4] = _fp16(d), _fp16(7.5 * d)
        b[:, 4:8] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
        b[:, 8:12] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
        b[:, 12:16] = (sc[:, 4:] & 15) | ((sc[:, 4:] & 15) << 4)
    elif qtype == "Q6_K":  # 128 bytes low nibbles, 64 bytes high bits, 16 int8 scales, d; value d * sc * (q - 32)
        sc = rng.integers(8, 16, (n, 16), dtype=np.int8)
        b[:, 192:208] = sc.view(np.uint8)
        b[:, 208:210] = _fp16(std / (18.47 * math.sqrt(float(np.mean(sc.astype(np.float32) ** 2)))))
    else:
        raise ValueError(f"no random blocks of {qtype}")
    return b


class _Pools:
    """One pool of random blocks per (type, deviation), sized for the largest tensor that draws from it."""

    def __init__(self, tensors: list[Tensor], seed: int):
        self.rng = np.random.default_rng(seed)
        self.need: dict[tuple[str, float], int] = {}
        for t in tensors:
            if t.qtype != "F32":
                key = (t.qtype, t.std)
                self.need[key] = max(self.need.get(key, 0), t.nbytes)
        self.pools: dict[tuple[str, float], np.ndarray] = {}

    def windows(self, t: Tensor):
        """Memoryviews over whole blocks of the pool of ``t``'s kind, at random offsets, ``t.nbytes`` in all."""
        key, size = (t.qtype, t.std), BLOCKS[t.qtype][1]
        if key not in self.pools:
            blocks = max(2, min(POOL_BYTES, self.need[key]) // size)
            self.pools[key] = random_blocks(t.qtype, blocks, t.std, self.rng).reshape(-1)
        pool = self.pools[key]
        total, half = len(pool) // size, max(1, len(pool) // size // 2)
        left = t.nbytes // size
        while left:
            m = min(half, left)
            r = int(self.rng.integers(0, total - m + 1))
            yield memoryview(pool[r * size:(r + m) * size])
            left -= m


def _f32(t: Tensor, rng: np.random.Generator) -> memoryview:
    n = math.prod(t.ne)
    x = np.full(n, t.fill, np.float32) if t.std == 0 else rng.standard_normal(n, dtype=np.float32) * np.float32(t.std)
    return memoryview(x.view(np.uint8))


# ---- metadata ------------------------------------------------------------------------------------------------
def _byte_chars() -> list[str]:
    """GPT-2's printable character for each byte (byte-level BPE's base tokens)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def vocabulary(n: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE of exactly ``n`` tokens: the 256 byte tokens, tokens of a
    few hundred merges, fillers, then the three ChatML control tokens (the last ids)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    if n < 256 + len(specials) + 1:
        raise ValueError(f"vocab_size {n}: a byte-level BPE needs at least {256 + len(specials) + 1} tokens")
    tokens = _byte_chars()
    space, letters = tokens[ord(" ")], "etaoinshrdlcumwfgypbvkjxqz"
    pairs = [(space, c) for c in letters] + [(a, c) for a in letters for c in letters]
    pairs = pairs[:max(0, min(len(pairs), n - 256 - len(specials)))]
    tokens += [a + c for a, c in pairs]
    tokens += [f"tok{i}" for i in range(n - len(specials) - len(tokens))]
    types = [1] * len(tokens) + [3] * len(specials)  # NORMAL, CONTROL
    return tokens + specials, types, [f"{a} {c}" for a, c in pairs]


def add_header(w, arch: str, fmt: str) -> None:
    """The general.* keys: name, description, file type and quantization version."""
    import gguf

    w.add_name(f"random {arch} (ktinject bench)")
    w.add_description("random weights for benchmarks (ktinject.bench.gguf_file); not a trained model")
    w.add_file_type(int(getattr(gguf.LlamaFileType, TYPES[fmt][2])))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def add_tokenizer(w, vocab_size: int, pre: str) -> None:
    """``vocabulary(vocab_size)`` as tokenizer.ggml.* (pre-tokenizer ``pre``), its special ids, the ChatML template."""
    tokens, types, merges = vocabulary(vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 3)  # <|endoftext|>
    w.add_eos_token_id(len(tokens) - 1)  # <|im_end|>
    w.add_pad_token_id(len(tokens) - 3)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)


def add_moe_hparams(w, config, feed_forward: int | None = None) -> None:
    """The hyperparameters qwen3moe and qwen35moe share (feed_forward_length where the model has a dense one)."""
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    if feed_forward is not None:
        w.add_feed_forward_length(feed_forward)
    w.add_block_count(config.num_hidden_layers)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_expert_count(config.num_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    w.add_expert_feed_forward_length(config.moe_intermediate_size)


def _metadata(w, config, fmt: str) -> None:
    add_header(w, "qwen3moe", fmt)
    add_moe_hparams(w, config, config.intermediate_size)
    add_tokenizer(w, config.vocab_size, "qwen2")


# ---- the file ------------------------------------------------------------------------------------------------
def check_format(fmt: str) -> None:
    if fmt not in TYPES:
        raise ValueError(f"{fmt!r}: expected one of {', '.join(TYPES)}")


def write(path: Path, config, fmt: str, seed: int = 0) -> dict:
    """Write the GGUF of ``config`` in ``fmt`` at ``path``; returns {"bytes": tensor bytes, "layer_bytes": the
    largest layer's tensor bytes}."""
    check_format(fmt)
    return write_file(path, "qwen3moe", plan(config, fmt), lambda w: _metadata(w, config, fmt), seed)


def write_file(path: Path, arch: str, tensors: list[Tensor], metadata, seed: int = 0) -> dict:
    """The GGUF of architecture ``arch`` at ``path``: the keys ``metadata(writer)`` adds, then ``tensors`` (random
    blocks from the pools, F32 drawn here); returns ``write``'s sizes."""
    import gguf

    qt = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), arch)
    metadata(w)
    for t in tensors:  # numpy order (outermost first); the writer stores it reversed, as ggml's ne
        w.add_tensor_info(t.name, tuple(reversed(t.ne)), np.dtype(np.float32), t.nbytes, raw_dtype=qt[t.qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    align = w.data_alignment
    w.close()
    pools, rng = _Pools(tensors, seed), np.random.default_rng(seed + 1)
    with open(path, "r+b") as f:
        f.seek(0, os.SEEK_END)
        f.write(b"\0" * (-f.tell() % align))
        for t in tensors:
            for part in ([_f32(t, rng)] if t.qtype == "F32" else pools.windows(t)):
                f.write(part)
            f.write(b"\0" * (-t.nbytes % align))
        f.flush()
        os.fsync(f.fileno())
    layers: dict[str, int] = {}
    for t in tensors:
        if t.name.startswith("blk."):
            layer = t.name.split(".")[1]
            layers[layer] = layers.get(layer, 0) + t.nbytes
    return {"bytes": sum(t.nbytes for t in tensors), "layer_bytes": max(layers.values(), default=0)}
