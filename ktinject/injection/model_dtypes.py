"""What a loaded model is built with: its dtype, the dtypes transformers gives some tensors, and the native format a
quantized checkpoint's routed experts keep (``from_pretrained`` and the loader use these)."""
from __future__ import annotations

import re
from collections import Counter

import torch
from torch import nn

from ktinject.injection.formats.base import LoadError, Reader


def _expert_refs(reader: Reader) -> list:
    """The quantized tensors of a checkpoint's routed experts."""
    return [r for r in reader.refs if r.codec is not None
            and (".experts." in r.key or r.key.endswith(("experts.gate_up_proj", "experts.down_proj")))]


def release_format(reader: Reader) -> tuple[str | None, int | None]:
    """(quant, group size) of the native expert format that holds a quantized checkpoint's routed experts best
    (``Codec.native``), or (None, None) for an unquantized one (the rules' choice)."""
    codecs = [r.codec for r in reader.refs if r.codec is not None]
    experts = [r.codec for r in _expert_refs(reader)]
    found = Counter(c.native for c in (experts or codecs))
    if not found:
        return None, None
    quant, group = found.most_common(1)[0][0]
    return (quant, group if quant in ("int4", "fp8") else None) if quant != "bf16" else (None, None)  # (mxfp4: 32)


def release_group(reader: Reader, quant: str) -> int | None:
    """The group size of native ``quant`` experts that holds a quantized checkpoint's routed experts exactly
    (``Codec.exact_group``: an MXFP4 release asked for fp8 takes groups of 32), or None (the quant's default)."""
    groups = Counter(r.codec.exact_group(quant) for r in _expert_refs(reader))
    return groups.most_common(1)[0][0] if groups else None


def model_dtype(config, dtype) -> torch.dtype:
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise LoadError(f"dtype {dtype!r} is not a floating torch dtype")
    return dtype


def target_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """Tensor name -> dtype transformers' from_pretrained gives it where that differs from the meta model's
    (``_keep_in_fp32_modules_strict`` of bf16/fp16 models, e.g. DeepSeek-V3's e_score_correction_bias)."""
    dtype = getattr(getattr(model, "config", None), "dtype", None)
    try:
        dtype_plan = model._get_dtype_plan(dtype) if isinstance(dtype, torch.dtype) else {}
    except Exception:  # noqa: BLE001 - private API of transformers
        dtype_plan = {}
    patterns = [(re.compile(p.replace("*", ".*")), d) for p, d in (dtype_plan or {}).items()]
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        for rx, d in patterns:
            if t.is_floating_point() and rx.search(name):
                out[name] = d
                break
    return out
