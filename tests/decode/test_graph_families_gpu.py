"""Graph decode of the families whose step state or masks the KVCache learned last: Llama 4's chunked-attention
masks and DeepSeek-V3.2 / GLM-5's lightning-indexer keys (``update_indexer``), on a GPU (skipped without CUDA).

The captured step must give exactly the eager step's tokens, for one row and for two left-padded rows, with one
capture and a replay per later token; each token HF's greedy choice on the un-injected float32 model up to a small
logit margin. The indexer families get 16 indexer heads, as in test_indexer_cache.py (no exact-zero score ties).
"""
from __future__ import annotations

import pytest
import torch

import ktinject
from ktinject.decode.generate import get_runner
from ktinject.tiny_models import build_tiny_model, missing_reason, tiny_prompts

from tests.references import graph_generate, greedy_margins

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FAMILIES = {"llama4": {}, "deepseek_v32": {"index_n_heads": 16}, "glm_moe_dsa": {"index_n_heads": 16}}
N = 20
MARGIN = 0.15


@pytest.fixture(scope="module", params=list(FAMILIES))
def models(request):
    why = missing_reason(request.param)
    if why:
        pytest.skip(why)
    over = FAMILIES[request.param]
    ref = build_tiny_model(request.param, **over).cuda()
    with torch.no_grad():  # native experts store bf16: the reference's expert weights rounded alike
        for name, p in ref.named_parameters():
            if ".experts." in name:
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
    inj = build_tiny_model(request.param, **over)
    ktinject.inject(inj, gpu="cuda", gpu_experts_budget=0)
    yield ref, inj
    get_runner(inj).close()


@pytest.mark.parametrize("batch", [1, 2])
def test_graph_decode_equals_eager_and_hf(models, batch):
    ref, inj = models
    ids = tiny_prompts(batch, 11, seed=batch).cuda()  # longer than every tiny indexer's top-k and Llama 4's chunk
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[1, :4], mask[1, :4] = 0, 0
    eager, _ = graph_generate(inj, ids, mask, N, graphs=False)
    graph, runner = graph_generate(inj, ids, mask, N, graphs=True)
    assert not runner.stats.capture_failures, runner.stats.capture_failures
    assert runner.stats.captures == 1 and runner.stats.replays == N - 1 and runner.stats.eager_decode == 0
    assert torch.equal(graph, eager)
    assert float(greedy_margins(ref, graph, mask, ids.shape[1]).max()) <= MARGIN
