"""``finetune`` with the dense part on CUDA and the routed experts on the CPU (the demo model, its packaged text):
a few steps lower the held-out perplexity, and the adapter merged at load on the GPU gives the logits of PEFT's
merged model injected the same way (the float32 product of B and A on another device: within rounding)."""
from __future__ import annotations

import json

import pytest
import torch

from ktinject import from_pretrained, inject
from ktinject.demo import demo_model_dir, finetune_text
from ktinject.train.loop import FinetuneConfig, finetune

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
peft = pytest.importorskip("peft")


def test_finetune_on_cuda(tmp_path):
    from transformers import AutoModelForCausalLM

    result = finetune(FinetuneConfig(demo_model_dir(), tmp_path / "adapter", text=[finetune_text()], seq_len=128,
                                     steps=6, lr=2e-3, device="cuda"), progress=False)
    assert result.eval_ppl_after < 0.8 * result.eval_ppl_before
    saved = json.loads((tmp_path / "adapter" / "finetune.json").read_text())["settings"]
    assert saved["device"] == "cuda"
    tuned = from_pretrained(demo_model_dir(), gpu="cuda", progress=False, lora=tmp_path / "adapter")
    ref = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(demo_model_dir()),
                                         tmp_path / "adapter").merge_and_unload()
    inject(ref, gpu="cuda")
    ids = torch.tensor([[1, 50, 60, 70, 80, 90]], device="cuda")
    with torch.no_grad():
        a, b = tuned(ids).logits.float(), ref(ids).logits.float()
    assert ((a - b).norm() / b.norm()).item() < 1e-2
