"""transformers' ``Trainer`` trains PEFT's LoRA on an injected model as it stands (CPU): a few steps on one fixed
batch lower the loss, only the adapters change, the packed experts' bytes stay what they were. (Nothing in ktinject
is made for the Trainer: this checks that what it injects is a model the Trainer can drive.)"""
from __future__ import annotations

import pytest
import torch

from ktinject import inject
from ktinject.operators.moe import HybridMoE
from ktinject.tiny_models import build_tiny_model, tiny_prompts

peft = pytest.importorskip("peft")


def test_trainer_trains_lora_on_an_injected_model(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = build_tiny_model("qwen3_moe", seed=0)
    inject(model, gpu="cpu")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                       target_modules=["q_proj", "v_proj"]))
    blocks = [m for m in model.modules() if isinstance(m, HybridMoE)]
    packed = [b.native_experts.export() for b in blocks]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows = tiny_prompts(4, 16, seed=5)  # one batch, every step
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=5, learning_rate=1e-2,
                             lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 5 and all(b < a for a, b in zip(losses, losses[1:])), losses
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert all(torch.equal(b.native_experts.export(), p) for b, p in zip(blocks, packed))
