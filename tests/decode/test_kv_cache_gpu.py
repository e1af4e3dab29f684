"""Graph decode of a batch whose rows sit at different positions (ktinject.decode.kv_cache) equals each row decoded alone,
for every family (gpt-oss, with its sliding-window layers, now replays as a graph too). Float32 models, so batch
size does not move the numbers by more than rounding; greedy, 32 tokens."""
from __future__ import annotations

import pytest
import torch

import ktinject
from ktinject import compat
from ktinject.decode import kv_cache
from ktinject.decode.generate import get_runner
from ktinject.tiny_models import FAMILIES, build_tiny_model, tiny_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LENGTHS = (3, 9, 5, 12)
N = 32


def _decode(model, prompts, graphs=True):
    """Prefill each prompt into its row (eager), then N-1 batched one-token steps through the GraphRunner."""
    runner = get_runner(model, use_graphs=graphs)
    B = len(prompts)
    cache = runner.cache_for(B, max(LENGTHS) + N + 1)
    with torch.no_grad():
        tok = torch.cat([kv_cache.forward(model, cache.rows(b, b + 1), p).logits[:, -1:].argmax(-1)
                         for b, p in enumerate(prompts)])
        out = [tok]
        for _ in range(N - 1):
            pos = cache.row_lengths[:B, None].clone()
            logits = runner(input_ids=tok, position_ids=pos, use_cache=True, **compat.cache_arg(cache)).logits
            tok = logits[:, -1:].argmax(-1)
            out.append(tok)
    return torch.cat(out, dim=1), runner


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_at_different_positions_replay_as_each_row_alone(family):
    overrides = {"sliding_window": 4} if family in ("gpt_oss", "mixtral") else {}
    model = build_tiny_model(family, dtype=torch.float32, **overrides)
    ktinject.inject(model, gpu="cuda")
    prompts = [tiny_prompts(1, n, seed=20 + i).cuda() for i, n in enumerate(LENGTHS)]
    batched, runner = _decode(model, prompts)
    assert runner.stats.replays >= N - 1 and runner.stats.eager_decode == 0, runner.describe()
    assert ktinject.info(model)["fast_paths"]["graph_decode"]["active"] is True
    alone = torch.cat([_decode(model, [p])[0] for p in prompts])
    eager = _decode(model, prompts, graphs=False)[0]
    get_runner(model).close()
    assert torch.equal(batched, eager), "graph replay differs from the eager step"
    same = (batched == alone).float().mean().item()
    assert torch.equal(batched, alone), f"batched rows differ from rows alone ({same:.1%} of tokens equal)"
