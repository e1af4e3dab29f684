"""Shared by the GPU test files: the reference/injected model pair and the greedy-margin check against it.
(The probes' helpers are in benchmarks/helpers.py.)"""
from __future__ import annotations

import torch

import ktinject
from ktinject.testing import build_tiny_model


def pair(family: str, dtype: torch.dtype):
    """(reference on CUDA with its expert weights rounded to bf16 as native stores them, injected model on CUDA)."""
    ref = build_tiny_model(family, dtype=dtype).cuda()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if ".experts." in name:
                p.copy_(p.to(torch.bfloat16).to(dtype))
    inj = build_tiny_model(family, dtype=dtype)
    ktinject.inject(inj, gpu="cuda")
    return ref, inj


def greedy_margins(ref, seq: torch.Tensor, mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[B, N]: how far (in the reference's logits, teacher-forced) each generated token of seq is below the
    reference's argmax at its step; 0 where it is the argmax. mask: the prompt's attention mask [B, prompt_len]."""
    full = torch.cat([mask, torch.ones_like(seq[:, prompt_len:])], dim=1)
    with torch.no_grad():
        logits = ref(seq, attention_mask=full).logits.float()  # [B, S, V]
    pred = logits[:, prompt_len - 1:-1]  # [B, N, V] predicting seq[:, prompt_len:]
    chosen = pred.gather(-1, seq[:, prompt_len:, None]).squeeze(-1)
    return pred.max(-1).values - chosen
