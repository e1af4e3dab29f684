"""The GPU budget on a GPU (skipped without CUDA): ``auto`` places a model that fits whole, and a run capped by
``gpu_memory`` stays under its cap (torch's peak reserved bytes) through the load, the prefill of its longest context
and decode, with some of its experts resident and the others streamed or on the CPU.

The cap bounds the whole process's caching allocator, so each test frees what earlier tests left cached, caps at
what the process still holds plus the run's share, and lifts the cap again at its end.
"""
from __future__ import annotations

import gc

import pytest
import torch

import ktinject
from ktinject.decode.generate import get_runner
from ktinject.gpu_experts.hot import budget as gpu
from ktinject.gpu_experts.hot.stats import hybrid_blocks
from ktinject.tiny_models import build_tiny_model, tiny_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GiB = 2**30
#: a qwen3_moe far larger than the tiny one: 3 MoE layers x 64 experts of 3 MiB (bf16 banks), 576 MiB in all
LARGER = dict(hidden_size=1024, moe_intermediate_size=512, intermediate_size=1024, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_experts=64, num_experts_per_tok=2,
              max_position_embeddings=2048)


@pytest.fixture
def uncapped():
    gc.collect()
    torch.cuda.empty_cache()
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_auto_places_a_model_that_fits_whole(family, uncapped):
    model = build_tiny_model(family, dtype=torch.bfloat16)
    plan = ktinject.inject(model, gpu="cuda")  # the default: auto
    found = plan.gpu_budget
    blocks = [b for _, b in hybrid_blocks(model)]
    assert found.reason is None and found.everything, "\n".join(found.lines())
    assert all(b.hot is not None and b.hot.device.type == "cuda" and len(b.hot.residents()) == b.num_experts
               for b in blocks)
    placed = model._ktinject_placement
    assert placed.resident == found.experts == sum(b.num_experts for b in blocks)
    assert placed.strategy == "uniform" and placed.rebalancer is None  # nothing left to re-place
    assert placed.nbytes == found.budget
    prompt = tiny_prompts(2, 12, seed=4).cuda()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    assert out.shape == (2, 20)
    get_runner(model).close()


def test_a_capped_run_never_exceeds_its_cap(uncapped):
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_reserved()  # what the process holds already counts under the cap
    # 8 layers (7 with experts, 1.3 GiB of them): after the fixed costs (~1.4 GiB) and a streamed prefill's ring
    # (one layer's experts, 576 MiB), a 2.25 GiB cap leaves room for part of the experts
    cap = held + 9 * GiB // 4
    context = LARGER["max_position_embeddings"]
    model = build_tiny_model("qwen3_moe", dtype=torch.bfloat16, **dict(LARGER, num_hidden_layers=8))
    plan = ktinject.inject(model, gpu="cuda", gpu_memory=cap, max_context=context)
    found = plan.gpu_budget
    assert found.reason is None and 0 < found.placed < found.experts, "\n".join(found.lines())
    assert found.cap <= cap
    placed = model._ktinject_placement
    assert 0 < placed.nbytes <= found.budget
    assert torch.cuda.max_memory_reserved() <= cap
    new = 16
    prompt = tiny_prompts(1, context - new, seed=5).cuda()  # the longest context: the cache's every position
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False)
    torch.cuda.synchronize()
    assert out.shape == (1, context)
    peak = torch.cuda.max_memory_reserved()
    assert peak <= cap, f"peak reserved {peak / GiB:.3f} GiB over the cap {cap / GiB:.3f} GiB"
    get_runner(model).close()


def test_cap_larger_than_the_card_or_below_the_dense_part_is_an_error(uncapped):
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(ValueError, match=r"gpu_memory .* is more than cuda:0 has"):
        ktinject.inject(build_tiny_model("qwen3_moe"), gpu="cuda", gpu_memory=total + GiB)
    with pytest.raises(ValueError, match=r"cannot hold the dense weights .* and the KV cache"):
        ktinject.inject(build_tiny_model("qwen3_moe", **LARGER), gpu="cuda", gpu_memory="1MiB")

    import argparse

    from ktinject.cli import options

    with pytest.raises(options.CliError, match=r"--gpu-memory .* is more than cuda has"):
        options.check_gpu_memory(argparse.Namespace(gpu_memory=total + GiB), "cuda")


def test_budget_zero_keeps_every_expert_on_the_cpu(uncapped):
    model = build_tiny_model("qwen3_moe", dtype=torch.bfloat16)
    plan = ktinject.inject(model, gpu="cuda", gpu_experts_budget=0)
    assert plan.gpu_budget is None and "_ktinject_placement" not in model.__dict__
    assert all(b.hot is None for _, b in hybrid_blocks(model))
    half = build_tiny_model("qwen3_moe", dtype=torch.bfloat16)
    found = ktinject.inject(half, gpu="cuda", gpu_experts_budget="0.5").gpu_budget
    assert found.request == "0.5 of what is left" and found.everything  # half of the card still holds it all
    assert isinstance(found, gpu.Budget)
