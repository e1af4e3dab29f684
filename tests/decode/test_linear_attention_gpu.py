"""Graph decode of the hybrid linear-attention families (Qwen3-Next, Qwen3.5-MoE) on a GPU (skipped without CUDA).

The captured decode step reads and writes the gated-DeltaNet layers' conv windows and recurrent matrices in the
KVCache in place: graph decode must give exactly the eager decode's tokens (same kernels, same native experts), for
one row and for two rows of different prompt lengths, and each token HF's greedy choice on the un-injected float32
model up to a small logit margin; a capture's warm-up steps leave the states as they found them (the first replayed
token is the eager one); rows at different positions replay in one graph.
"""
from __future__ import annotations

import pytest
import torch

import ktinject
from ktinject import compat
from ktinject.decode import kv_cache
from ktinject.decode.generate import get_runner
from ktinject.tiny_models import missing_reason, tiny_prompts

from tests.references import graph_generate, greedy_margins, pair

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HYBRID = ("qwen3_5_moe", "qwen3_next")
N = 24
MARGIN = 0.15  # logits (std ~2): bf16 rounding differences between native and torch experts stay well below


@pytest.fixture(scope="module", params=HYBRID)
def models(request):
    why = missing_reason(request.param)
    if why:
        pytest.skip(why)
    ref, inj = pair(request.param, torch.float32)
    yield ref, inj
    get_runner(inj).close()


def _prompts(batch: int, length: int, seed: int):
    ids = tiny_prompts(batch, length, seed=seed).cuda()
    mask = torch.ones_like(ids)
    if batch > 1:  # left padding on the second row: a shorter prompt
        ids[1, :4] = 0
        mask[1, :4] = 0
    return ids, mask


@pytest.mark.parametrize("batch", [1, 2])
def test_graph_decode_equals_eager_and_hf(models, batch):
    ref, inj = models
    ids, mask = _prompts(batch, 9, seed=batch)
    eager, _ = graph_generate(inj, ids, mask, N, graphs=False)
    graph, runner = graph_generate(inj, ids, mask, N, graphs=True)
    assert not runner.stats.capture_failures, runner.stats.capture_failures
    assert runner.stats.captures == 1 and runner.stats.replays == N - 1 and runner.stats.eager_decode == 0
    assert runner.kv.linear is not None and runner.kv.linear.nbytes() > 0
    assert torch.equal(graph, eager)
    assert float(greedy_margins(ref, graph, mask, ids.shape[1]).max()) <= MARGIN
    again, runner = graph_generate(inj, ids, mask, N, graphs=True)  # the same graph, the rows' states reset in place
    assert runner.stats.captures == 1 and torch.equal(again, graph)


def test_one_token_prompt_graph(models):
    ref, inj = models
    ids, mask = _prompts(1, 1, seed=5)
    eager, _ = graph_generate(inj, ids, mask, N, graphs=False)
    graph, runner = graph_generate(inj, ids, mask, N, graphs=True)
    assert not runner.stats.capture_failures and torch.equal(graph, eager)


def test_rows_at_different_positions_replay_in_one_graph(models):
    """A decode step of a row at position 12 beside a row at position 1 (as a server's rows), replayed: the logits
    of eager steps on the same rows, and the states written where the rows are."""
    _, inj = models
    runner = get_runner(inj, use_graphs=True)
    cache = runner.cache_for(2, 64)
    with torch.no_grad():
        kv_cache.forward(inj, cache.rows(0, 1), tiny_prompts(1, 12, seed=6).cuda())
        kv_cache.forward(inj, cache.rows(1, 2), tiny_prompts(1, 1, seed=7).cuda())
        saved = cache.save_step_state()
        steps = [tiny_prompts(2, 1, seed=10 + i).cuda() for i in range(4)]

        def run(graphs: bool):
            cache.restore_step_state(saved)
            runner.use_graphs = graphs
            logits = []
            for ids in steps:
                pos = cache.row_lengths[:2, None].clone()
                logits.append(runner(input_ids=ids, position_ids=pos, use_cache=True,
                                     **compat.cache_arg(cache)).logits[:, -1].clone())
            return torch.stack(logits), [t.clone() for t in cache.linear.tensors()]

        eager, eager_state = run(False)
        replays = runner.stats.replays
        graph, graph_state = run(True)
    assert runner.stats.replays - replays >= len(steps) - 1 and not runner.stats.capture_failures
    assert torch.equal(graph, eager)
    assert all(torch.equal(a, b) for a, b in zip(graph_state, eager_state))
    assert cache.row_lengths.tolist() == [12 + len(steps), 1 + len(steps)]
