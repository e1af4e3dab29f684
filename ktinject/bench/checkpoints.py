"""Random-weight checkpoints of the bench model in the release formats, written fast (``bench load --format``).

    bf16          safetensors, every tensor bf16, per-expert keys (``save_pretrained``'s layout), ~1 GB shards
    fp8           safetensors as DeepSeek-V3 / Qwen3 FP8 releases are laid out: every projection weight (attention,
                  experts) float8_e4m3fn + ``weight_scale_inv`` (float32, one per 128 x 128 block), embeddings,
                  lm_head, norms and routers bf16; ``quantization_config`` quant_method fp8, weight_block_size
    gguf-q8_0, gguf-q4_0, gguf-q4_k_m, gguf-q6_k
                  one GGUF file, llama.cpp's qwen3moe layout and types (``bench.gguf_file``), or with ``shapes``
                  qwen3_5_moe its qwen35moe layout (``bench.gguf_qwen35``; GGUF only, for llama-bench)

Shapes: Qwen3-30B-A3B's (``model.QWEN3_30B``) with ``layers`` layers, or ``TINY`` (``--tiny``: every format's blocks
whole, 128 x 128 FP8 blocks and 256-value K-quant blocks); with ``shapes`` qwen3_5_moe, Qwen3.5-35B-A3B's
(transformers' ``Qwen3_5MoeTextConfig`` defaults) or ``TINY_QWEN3_5``. Values are random (tiled from a pool of
random values or blocks at random offsets, no per-value quantizer), so a 12-layer file is written at about the
disk's speed.

``ensure(base, fmt, layers, tiny, shapes=...)`` writes the checkpoint under ``base`` (bf16: ``base/checkpoint``,
fp8: ``base/checkpoint-fp8``, GGUF: ``base/checkpoint-<type>.gguf``) unless one of the same shapes is there already
(a record in ``base/bench-checkpoints.json``), and returns where it is with its bytes and one layer's bytes.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ktinject.bench.model import DEFAULT_SHAPES, QWEN3_30B, SHAPES

SAFETENSORS = ("bf16", "fp8")
GGUF = ("gguf-q8_0", "gguf-q4_0", "gguf-q4_k_m", "gguf-q6_k")
FORMATS = SAFETENSORS + GGUF
#: small shapes whose rows are whole blocks of every format (256-value K-quant blocks, 128 x 128 FP8 blocks)
TINY = dict(QWEN3_30B, vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
            max_position_embeddings=4096)
#: Qwen3.5-MoE's tiny shapes: rows whole 256-value blocks, 16 experts, the default rotary sections (64 rotary dims)
TINY_QWEN3_5 = dict(vocab_size=2048, hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
                    linear_value_head_dim=128, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                    num_experts=16, num_experts_per_tok=2, max_position_embeddings=4096)
#: --shapes -> the formats it writes (the qwen35moe GGUF is for llama-bench: ktinject's GGUF reader has no qwen35moe)
SHAPES_FORMATS = {"qwen3_moe": FORMATS, "qwen3_5_moe": GGUF}
FP8_BLOCK = (128, 128)
_POOL_ELEMS = 64 << 20  # random values reused for every tensor (content does not matter for loading)
_RECORD = "bench-checkpoints.json"


@dataclass(frozen=True)
class Checkpoint:
    fmt: str
    path: Path  # a directory (safetensors) or a .gguf file
    nbytes: int  # tensor bytes
    layer_bytes: int  # the largest decoder layer's tensor bytes


def parse_formats(text: str) -> list[str]:
    """``--format`` (comma-separated) -> formats, SystemExit naming what is not one."""
    fmts = [f.strip().lower() for f in (text or "").split(",") if f.strip()]
    bad = [f for f in fmts if f not in FORMATS]
    if bad or not fmts:
        raise SystemExit(f"--format {text!r}: expected a comma-separated list of {', '.join(FORMATS)}")
    return list(dict.fromkeys(fmts))


def check_shapes(shapes: str, fmts, layers: int) -> None:
    """SystemExit naming the option where ``shapes`` cannot be written in ``fmts`` with ``layers`` layers."""
    if shapes not in SHAPES_FORMATS:
        raise SystemExit(f"--shapes {shapes}: checkpoints are written for {', '.join(SHAPES_FORMATS)}")
    bad = [f for f in fmts if f not in SHAPES_FORMATS[shapes]]
    if bad:
        raise SystemExit(f"--shapes {shapes}: --format {','.join(bad)} is not written for these shapes (only "
                         f"{', '.join(SHAPES_FORMATS[shapes])})")
    multiple = SHAPES[shapes].layer_multiple
    if layers < 1 or layers % multiple:
        raise SystemExit(f"--layers {layers}: {SHAPES[shapes].name} shapes take a positive multiple of {multiple} "
                         f"(its pattern of layer kinds)")


def bench_config(layers: int, tiny: bool = False, shapes: str = DEFAULT_SHAPES):
    import transformers

    if shapes == DEFAULT_SHAPES:
        options = TINY if tiny else QWEN3_30B
    else:
        options = TINY_QWEN3_5 if tiny else SHAPES[shapes].options
    config = getattr(transformers, SHAPES[shapes].config)(num_hidden_layers=layers, **options)
    config.dtype = torch.bfloat16
    return config


def _gguf_writer(shapes: str):
    """The module whose ``plan`` / ``write`` lay out ``shapes``' GGUF."""
    if shapes == "qwen3_5_moe":
        from ktinject.bench import gguf_qwen35

        return gguf_qwen35
    from ktinject.bench import gguf_file

    return gguf_file


def path_of(base: Path, fmt: str) -> Path:
    if fmt == "bf16":
        return base / "checkpoint"
    return base / ("checkpoint-fp8" if fmt == "fp8" else f"checkpoint-{fmt[len('gguf-'):]}.gguf")


def estimate_bytes(fmt: str, layers: int, tiny: bool = False, shapes: str = DEFAULT_SHAPES) -> float:
    """About how many bytes ``fmt`` takes (for the free-space check before writing; a qwen3_5_moe GGUF's exactly)."""
    if shapes != DEFAULT_SHAPES:
        return float(sum(t.nbytes for t in _gguf_writer(shapes).plan(bench_config(layers, tiny, shapes), fmt)))
    config = bench_config(1, tiny)
    H, V = config.hidden_size, config.vocab_size
    per_layer = sum(math.prod(s) for k, s in _tensors(config) if k.startswith("model.layers.0."))
    bits = {"bf16": 16, "fp8": 8.1, "gguf-q8_0": 8.5, "gguf-q4_0": 4.5, "gguf-q4_k_m": 5.2, "gguf-q6_k": 6.6}[fmt]
    return per_layer * layers * bits / 8 + 2 * H * V * (2 if fmt in SAFETENSORS else bits / 8)


def ensure(base: Path, fmt: str, layers: int, tiny: bool = False, log=print,
           shapes: str = DEFAULT_SHAPES) -> Checkpoint:
    """The checkpoint of ``fmt`` under ``base``, written unless the record says one of these shapes is there."""
    check_shapes(shapes, [fmt], layers)
    base.mkdir(parents=True, exist_ok=True)
    record_file = base / _RECORD
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    path, want = path_of(base, fmt), {"layers": layers, "tiny": tiny, "shapes": shapes}
    got = record.get(fmt)
    if got and {k: got.get(k, DEFAULT_SHAPES if k == "shapes" else None) for k in want} == want and path.exists():
        log(f"{fmt}: reusing {path} ({got['bytes'] / 1e9:.2f} GB)")
        return Checkpoint(fmt, path, got["bytes"], got["layer_bytes"])
    t0 = time.perf_counter()
    config = bench_config(layers, tiny, shapes)
    if fmt in SAFETENSORS:
        sizes = write_safetensors(path, config, fp8=fmt == "fp8")
    else:
        path.unlink(missing_ok=True)
        sizes = _gguf_writer(shapes).write(path, config, fmt)
    record[fmt] = dict(want, **sizes)
    record_file.write_text(json.dumps(record, indent=1))
    what = SHAPES[shapes].name if not tiny else "tiny" if shapes == DEFAULT_SHAPES else f"tiny {shapes}"
    log(f"{fmt}: wrote {sizes['bytes'] / 1e9:.2f} GB ({layers} layers, {what} shapes) to {path} in "
        f"{time.perf_counter() - t0:.1f} s")
    return Checkpoint(fmt, path, sizes["bytes"], sizes["layer_bytes"])


# ---- safetensors ---------------------------------------------------------------------------------------------
def _tensors(config):
    """(key, shape) in save_pretrained's order and naming (per-expert keys), from a meta model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for name, t in model.state_dict().items():
        leaf = name.rsplit(".", 1)[-1]
        if ".experts." in name and leaf in ("gate_up_proj", "down_proj"):
            prefix = name[: -len(leaf)]
            E, rows, cols = t.shape
            for e in range(E):
                if leaf == "gate_up_proj":
                    yield f"{prefix}{e}.gate_proj.weight", (rows // 2, cols)
                    yield f"{prefix}{e}.up_proj.weight", (rows // 2, cols)
                else:
                    yield f"{prefix}{e}.down_proj.weight", (rows, cols)
        else:
            yield name, tuple(t.shape)


def fp8_quantized(key: str, shape) -> bool:
    """Whether an FP8 release stores ``key`` in FP8: the 2-D projection weights, not embeddings, lm_head, norms or
    the routers (``mlp.gate``)."""
    return (len(shape) == 2 and key.endswith("proj.weight") and "embed" not in key and not key.startswith("lm_head"))


class _Pool:
    """Random values, tiled at random offsets: ``take(n)`` -> a view of (or, past the pool, a copy of) n values."""

    def __init__(self, values: torch.Tensor, seed: int):
        self.values, self.gen = values, torch.Generator().manual_seed(seed)

    def take(self, n: int) -> torch.Tensor:
        size = self.values.numel()
        if n > size // 2:
            return self.values.repeat(-(-n // size))[:n]
        r = int(torch.randint(0, size - n + 1, (1,), generator=self.gen))
        return self.values[r:r + n]


def _entries(config, fp8: bool):
    """(key, safetensors dtype, shape, tensor) of every stored tensor: bf16 values of about the in-memory model's
    deviation, or (fp8) e4m3 codes of deviation ~112 beside block scales that bring them to it."""
    from ktinject.bench.model import weight_std

    tensors = list(_tensors(config))
    gen = torch.Generator().manual_seed(0)
    unit = torch.randn(min(_POOL_ELEMS, 2 * max(math.prod(s) for _, s in tensors)), generator=gen)
    bf16 = _Pool(unit.to(torch.bfloat16), 1)
    codes = _Pool((unit * 112.0).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8), 2)
    del unit
    H = config.hidden_size
    for key, shape in tensors:
        n, std = math.prod(shape), weight_std(key, shape, H)
        if key.endswith("norm.weight"):
            yield key, "BF16", shape, torch.ones(shape, dtype=torch.bfloat16)
        elif fp8 and fp8_quantized(key, shape):
            yield key, "F8_E4M3", shape, codes.take(n).view(shape)
            scales = (math.ceil(shape[0] / FP8_BLOCK[0]), math.ceil(shape[1] / FP8_BLOCK[1]))
            yield key + "_scale_inv", "F32", scales, torch.full(scales, std / 112.0)
        else:
            t = bf16.take(n).view(shape)
            yield key, "BF16", shape, t if std == 1.0 else t * std


def _write_shard(path: Path, tensors: list) -> None:
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, t in tensors:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for *_, t in tensors:
            f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))
        os.fsync(f.fileno())


def write_safetensors(d: Path, config, fp8: bool = False, shard_bytes: int = 1 << 30) -> dict:
    """The bf16 or FP8 checkpoint of ``config`` in ``d``: shards, index, config.json; returns {"bytes": tensor
    bytes, "layer_bytes": the largest layer's}."""
    d.mkdir(parents=True, exist_ok=True)
    for old in (*d.glob("*.safetensors"), *d.glob("shard-*.tmp")):  # (a checkpoint of other shapes before)
        old.unlink()
    if fp8:
        config.quantization_config = {
            "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(FP8_BLOCK),
            "modules_to_not_convert": ["lm_head"] + [f"model.layers.{i}.mlp.gate"
                                                     for i in range(config.num_hidden_layers)]}
    config.save_pretrained(d)
    if fp8:
        del config.quantization_config
    shards, cur, cur_bytes = [], [], 0
    for entry in _entries(config, fp8):
        cur.append(entry)
        cur_bytes += entry[3].numel() * entry[3].element_size()
        if cur_bytes >= shard_bytes:  # (written at once: a shard's copies are freed before the next)
            shards.append(_flush(d, cur, len(shards)))
            cur, cur_bytes = [], 0
    if cur:
        shards.append(_flush(d, cur, len(shards)))
    count = len(shards)
    weight_map, total, layers = {}, 0, {}
    for i, (tmp, sizes) in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        tmp.rename(d / fname)
        for key, n in sizes:
            weight_map[key] = fname
            total += n
            if key.startswith("model.layers."):
                layer = key.split(".")[2]
                layers[layer] = layers.get(layer, 0) + n
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return {"bytes": total, "layer_bytes": max(layers.values(), default=0)}


def _flush(d: Path, tensors: list, i: int) -> tuple[Path, list[tuple[str, int]]]:
    tmp = d / f"shard-{i:05d}.tmp"
    _write_shard(tmp, tensors)
    return tmp, [(key, t.numel() * t.element_size()) for key, _, _, t in tensors]
