"""Llama 4's block (operators/input_weighted.py): routing weights that scale each expert's input, for top-1 (the
released models) and top-2, against the unmodified HF block in float32 with the same (bf16-exact) weights."""
from __future__ import annotations

import pytest
import torch

import ktinject
from ktinject.operators.families import inspect_block
from ktinject.operators.moe import HybridMoE
from ktinject.tiny_models import build_tiny_model, missing_reason


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("top_k", [1, 2])
@torch.no_grad()
def test_block_equals_hf(top_k):
    if missing_reason("llama4"):
        pytest.skip(missing_reason("llama4"))
    ref = build_tiny_model("llama4", dtype=torch.bfloat16, num_experts_per_tok=top_k).float()  # bf16-exact weights
    model = build_tiny_model("llama4", dtype=torch.bfloat16, num_experts_per_tok=top_k).float()
    name = next(n for n, m in ref.named_modules() if type(m).__name__ == "Llama4TextMoe")
    spec = inspect_block(ref.get_submodule(name), name)
    assert spec.layout == "llama4" and spec.weights_input and spec.shared == "unweighted"
    ktinject.inject(model, gpu="cpu")
    block, hf_block = model.get_submodule(name), ref.get_submodule(name)
    assert isinstance(block, HybridMoE)
    x = torch.randn(3, 7, spec.hidden, generator=torch.Generator().manual_seed(0))
    out, logits = block(x)
    want, want_logits = hf_block(x)
    torch.testing.assert_close(logits, want_logits)  # HF's router, in float32
    assert out.shape == want.shape == (21, spec.hidden) and _rel(out, want) < 1e-2  # native bf16 activations
    weights, ids = block.routing(x.reshape(-1, spec.hidden))
    assert ids.shape == (21, top_k) and weights.dtype == torch.float32
    # the output-weighted reading (what every other family computes) is far from HF's: the test can tell them apart
    scores = torch.sigmoid(torch.topk(want_logits, top_k, dim=1).values)
    assert (scores < 0.9).any()


def test_deferral_refused_by_name_streaming_taken():
    if missing_reason("llama4"):
        pytest.skip(missing_reason("llama4"))
    from ktinject.operators.base import OperatorError
    from ktinject.operators.moe import MoEOperator

    model = build_tiny_model("llama4")
    name = next(n for n, m in model.named_modules() if type(m).__name__ == "Llama4TextMoe")
    block = model.get_submodule(name)
    assert MoEOperator.expert_stream(block, name, {}).spec.layout == "llama4"  # the streaming loader reads them
    with pytest.raises(OperatorError, match="deferral"):
        MoEOperator.check(block, name, {"defer": 1})
