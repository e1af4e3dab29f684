"""Shared by the GPU test files and probes: the reference/injected model pair and the greedy-margin check against
it; the probes' decode set-up (bench model, prompt, runner) and the host's steal time."""
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


def steal_jiffies() -> int:
    """The host's steal time so far (/proc/stat, jiffies): probes print its growth beside CPU timings."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def decode_setup(quant: str, layers: int, threads: int | None = None, prompt_len: int = 32):
    """The probes' decode set-up: the bench model (Qwen3-30B-A3B shapes, ``layers`` layers) injected with
    ``quant``, a random prompt, its graph runner, and one generate run (captures the decode graph).
    Returns (model, prompt, runner)."""
    from ktinject.bench.model import bench_model
    from ktinject.bench.timing import gen_time
    from ktinject.generate import get_runner

    model, device = bench_model(False, layers, threads)
    ktinject.inject(model, gpu=str(device), quant=quant)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=device)
    runner = get_runner(model, prefill_chunk=2048)
    gen_time(model, prompt, 3)
    return model, prompt, runner
