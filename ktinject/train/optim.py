"""The optimizer of ktinject's fine-tuning loop and bench: AdamW, fused where every parameter allows it.

Expert LoRA gives thousands of small adapter tensors on the CPU (an A and a B per expert, projection and layer);
torch's default AdamW steps them one tensor at a time on the CPU (a dozen small operators each), which costs more
than a step's forward on a many-core host, where the fused kernel (``fused=True``: one pass per device and dtype)
does not. Under the HF ``Trainer``, ``TrainingArguments(optim="adamw_torch_fused")`` is the same choice.
"""
from __future__ import annotations

import torch

#: devices torch's fused AdamW runs on
_FUSED_DEVICES = ("cpu", "cuda")


def adamw(params, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW over ``params``: fused when all are floating point on the CPU or a CUDA device, else torch's default."""
    params = list(params)
    fused = bool(params) and all(p.is_floating_point() and p.device.type in _FUSED_DEVICES for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
