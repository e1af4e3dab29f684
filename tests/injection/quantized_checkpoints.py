"""Tiny quantized checkpoints written the way the releases are, from a tiny bf16 one, for the format tests.

Each writer reads a saved bf16 checkpoint (``save_pretrained``), quantizes the tensors a release quantizes, and
writes them in that release's layout and config, together with the float32 values they dequantize to (by this
file's own dequantization, independent of ``ktinject.injection.formats.codecs``), saved as an unquantized
float32 checkpoint: the reference the loaded model must match.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def read_all(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _write(src: Path, dst: Path, tensors: dict, quantization_config: dict | None, shards: int = 3) -> Path:
    """``tensors`` into ``dst`` in ``shards`` files with an index; the other files of ``src`` (config with
    ``quantization_config`` set or removed, generation config) beside them."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    keys = sorted(tensors)
    per = math.ceil(len(keys) / shards)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in keys[i * per:(i + 1) * per]}
        save_file(part, dst / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def _linear_weights(tensors: dict, only_experts: bool = False) -> list[str]:
    """Keys of the 2-D projection weights a release quantizes (not embeddings, lm_head, norms or routers)."""
    out = []
    for k, t in tensors.items():
        if t.dim() != 2 or not k.endswith(".weight") or "embed" in k or "lm_head" in k or "norm" in k:
            continue
        if k.endswith(("mlp.gate.weight", "router.weight")):
            continue
        if only_experts and ".experts." not in k:
            continue
        out.append(k)
    return out


# ---------------------------------------------------------------------------------------------- FP8


def fp8_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scale per block): w ~= value * scale, each block's largest magnitude at 448."""
    N, K = w.shape
    bn, bk = block
    rows, cols = math.ceil(N / bn), math.ceil(K / bk)
    w = w.float()
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            amax = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max()
            scale[i, j] = amax / 448.0 if amax > 0 else 1.0
    full = scale.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return (w / full).to(torch.float8_e4m3fn), scale


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    N, K = q.shape
    out = torch.empty(N, K)
    for i in range(N):
        for j in range(K):
            out[i, j] = q[i, j].float() * scale[i // block[0], j // block[1]]
    return out


def write_fp8(src: Path, dst: Path, ref: Path, block=(32, 32), scale_dtype=torch.float32) -> Path:
    """Block-scaled FP8 (DeepSeek-V3 / Qwen3-FP8 layout): every projection weight (attention, dense MLP, experts)
    as ``weight`` float8_e4m3fn + ``weight_scale_inv``."""
    tensors = read_all(src)
    out, deq = dict(tensors), {k: v.float() for k, v in tensors.items()}
    for k in _linear_weights(tensors):
        q, s = fp8_quantize(tensors[k], block)
        out[k], out[k + "_scale_inv"] = q, s.to(scale_dtype)
        deq[k] = fp8_dequantize(q, s.to(scale_dtype).float(), block)
    _write(src, ref, deq, None)
    return _write(src, dst, out, {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": list(block)})


# ---------------------------------------------------------------------------------------------- compressed-tensors


def int_quantize(w: torch.Tensor, group: int, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group-wise: (int8 q in [-2^(B-1), 2^(B-1) - 1], bf16 scale [N, ceil(K / group)])."""
    N, K = w.shape
    top = (1 << (bits - 1)) - 1
    groups = math.ceil(K / group)
    scale = torch.empty(N, groups)
    q = torch.empty(N, K, dtype=torch.int8)
    for g in range(groups):
        part = w[:, g * group:(g + 1) * group].float()
        s = (part.abs().amax(dim=1) / top).clamp_min(1e-8).to(torch.bfloat16).float()
        scale[:, g] = s
        q[:, g * group:(g + 1) * group] = (part / s[:, None]).round().clamp(-top - 1, top).to(torch.int8)
    return q, scale.to(torch.bfloat16)


def pack_int32(q: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' dense packing: element c of a row at bits B*c of the row's int32 words, as q + 2^(B-1)."""
    N, K = q.shape
    per = 32 // bits
    words = math.ceil(K / per)
    u = torch.zeros(N, words * per, dtype=torch.int64)
    u[:, :K] = q.to(torch.int64) + (1 << (bits - 1))
    packed = torch.zeros(N, words, dtype=torch.int64)
    for i in range(per):
        packed |= u[:, i::per] << (bits * i)
    return (packed - ((packed >> 31) << 32)).to(torch.int32)  # as two's complement int32


def write_compressed_int4(src: Path, dst: Path, ref: Path, group: int = 32) -> Path:
    """Kimi-K2-Thinking's layout: routed experts int4 (pack-quantized, symmetric, group 32, bf16 scales), the
    rest unquantized."""
    tensors = read_all(src)
    out, deq = dict(tensors), {k: v.float() for k, v in tensors.items()}
    for k in _linear_weights(tensors, only_experts=True):
        q, s = int_quantize(tensors[k], group)
        base = k[:-len(".weight")]
        del out[k]
        out[base + ".weight_packed"] = pack_int32(q, 4)
        out[base + ".weight_scale"] = s
        out[base + ".weight_shape"] = torch.tensor(list(q.shape), dtype=torch.int64)
        deq[k] = q.float() * s.float().repeat_interleave(group, 1)[:, :q.shape[1]]
    _write(src, ref, deq, None)
    scheme = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}
    return _write(src, dst, out, {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                  "config_groups": {"group_0": {"weights": scheme, "targets": ["Linear"]}},
                                  "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"]})


# ---------------------------------------------------------------------------------------------- MXFP4


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (uint8 blocks [..., N, K/32, 16] low nibble first, uint8 e8m0 scales [..., N, K/32])."""
    *lead, N, K = w.shape
    x = w.float().reshape(*lead, N, K // 32, 32)
    amax = x.abs().amax(-1, keepdim=True)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    scaled = x / torch.exp2(exp)
    codes = (scaled.unsqueeze(-1) - E2M1[:8].unsqueeze(0) * torch.sign(scaled).unsqueeze(-1)).abs().argmin(-1)
    codes = codes + 8 * (scaled < 0).long() * (codes > 0).long()
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exp.squeeze(-1) + 127).to(torch.uint8)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    *lead, N, nb, _ = blocks.shape
    lo, hi = E2M1[(blocks & 0x0F).long()], E2M1[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], -1).reshape(*lead, N, nb, 32)
    return (vals * torch.exp2(scales.float() - 127).unsqueeze(-1)).reshape(*lead, N, nb * 32)


def write_mxfp4(src: Path, dst: Path, ref: Path) -> Path:
    """gpt-oss's layout: the experts' gate_up_proj / down_proj as ``*_blocks`` + ``*_scales`` of the transposed
    ([E, out, in]) matrices; the rest bf16."""
    tensors = read_all(src)
    out, deq = dict(tensors), {k: v.float() for k, v in tensors.items()}
    for k in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4_quantize(tensors[k].transpose(1, 2))
        del out[k]
        out[k + "_blocks"], out[k + "_scales"] = blocks, scales
        deq[k] = mxfp4_dequantize(blocks, scales).transpose(1, 2).contiguous()
    _write(src, ref, deq, None)
    return _write(src, dst, out, {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                        "model.layers.*.mlp.router",
                                                                                        "model.embed_tokens",
                                                                                        "lm_head"]})
