"""Expert deferral inside the captured decode graph (skipped without CUDA).

Graph decode with deferral must give exactly the eager decode's tokens with deferral (greedy, 32 tokens, batch 1
and 2): the same native tasks and slot selection, the same sums in the same order; only the handshake differs (the
stream's go / done flags, the deferred task raised by the immediate one's end, against host submit / wait). Also:
int4 experts with GPU-resident hot experts, the host-callback fallback, a change of d captures a new graph (and d = 0
still gives the tokens of a model injected without the option), and the tokens really change with deferral (so the
graph does defer). Deferral by weight mass (defer=0.3) likewise, where a step's deferred task may have no rows.
"""
from __future__ import annotations

import pytest
import torch

import ktinject
from ktinject.decode.generate import get_runner
from ktinject.operators import deferral
from ktinject.tiny_models import build_tiny_model, tiny_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# family -> (config overrides: 3 MoE blocks, d)
FAMILIES = {"qwen3_moe": (dict(num_hidden_layers=4), 1), "deepseek_v3": (dict(num_hidden_layers=4), 2),
            "mixtral": (dict(num_hidden_layers=3), 1)}
N = 32


def _model(family: str, **kw):
    overrides, d = FAMILIES[family]
    m = build_tiny_model(family, dtype=torch.bfloat16, **overrides)
    ktinject.inject(m, gpu="cuda", **{"defer": d, "gpu_experts_budget": 0, **kw})
    return m


def _prompts(batch: int, seed: int = 1, length: int = 9):
    """(ids [batch, length] on CUDA, attention mask): the rows after the first left-padded by 3 tokens."""
    ids = tiny_prompts(batch, length, seed=seed).cuda()
    pad = torch.zeros_like(ids, dtype=torch.bool)
    pad[1:, :3] = True
    return ids.masked_fill(pad, 0), (~pad).long()


def _generate(m, ids, mask, graphs: bool):
    runner = get_runner(m, use_graphs=graphs)
    out = ktinject.generate(m, ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                            pad_token_id=0, eos_token_id=None)
    return out, runner


def _graph_equals_eager(m, batch: int, seed: int) -> torch.Tensor:
    """Greedy tokens of the decode graph, checked equal to the eager decode's; one capture, every step replayed."""
    ids, mask = _prompts(batch, seed=seed)
    eager, _ = _generate(m, ids, mask, graphs=False)
    graph, runner = _generate(m, ids, mask, graphs=True)
    assert not runner.stats.capture_failures, runner.stats.capture_failures
    assert runner.stats.captures == 1 and runner.stats.replays == N - 1 and runner.stats.eager_decode == 0
    assert torch.equal(graph, eager)
    return graph


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request):
    m = _model(request.param)
    yield request.param, m
    get_runner(m).close()


@pytest.mark.parametrize("batch", [1, 2])
def test_graph_equals_eager_with_deferral(model, batch):
    family, m = model
    graph = _graph_equals_eager(m, batch, seed=batch)
    ids, mask = _prompts(batch, seed=batch)
    deferral.set_defer(m, 0)
    try:
        plain, _ = _generate(m, ids, mask, graphs=True)
    finally:
        deferral.set_defer(m, FAMILIES[family][1])
    changed = int((plain != graph).sum())
    print(f"{family} batch {batch}: graph == eager with defer={FAMILIES[family][1]}; {changed} of "
          f"{graph[:, ids.shape[1]:].numel()} tokens differ from defer=0")


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_graph_equals_eager_with_mass_deferral(family, batch):
    """defer=0.3: each token defers 0..k-1 slots (k = 2: its second slot only where that holds <= 30% of the
    weight), so some steps' deferred tasks run with no rows and must still raise their done word."""
    m = _model(family, defer=0.3)
    try:
        deferral.slots_run(m, reset=True)
        graph = _graph_equals_eager(m, batch, seed=20 + batch)
        imm, dfr = deferral.slots_run(m)  # eager and graph decode together
        assert dfr > 0
        ids, mask = _prompts(batch, seed=20 + batch)
        deferral.set_defer(m, 0)
        plain, _ = _generate(m, ids, mask, graphs=True)
    finally:
        get_runner(m).close()
    changed = int((plain != graph).sum())
    print(f"{family} batch {batch}: graph == eager with defer=0.3 ({100 * dfr / (imm + dfr):.1f}% of slots "
          f"deferred); {changed} of {graph[:, ids.shape[1]:].numel()} tokens differ from defer=0")


def test_new_setting_captures_anew_and_zero_is_the_plain_path():
    m = _model("deepseek_v3")
    ref = build_tiny_model("deepseek_v3", dtype=torch.bfloat16, **FAMILIES["deepseek_v3"][0])
    ktinject.inject(ref, gpu="cuda", gpu_experts_budget=0)
    ids, mask = _prompts(2, seed=5)
    try:
        deferred, runner = _generate(m, ids, mask, graphs=True)
        deferral.set_defer(m, 0)
        plain = ktinject.generate(m, ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)
        assert runner.stats.captures == 2  # the same runner: a second graph for the second setting
        base, _ = _generate(ref, ids, mask, graphs=True)
        assert torch.equal(plain, base)
        assert not torch.equal(plain, deferred)
    finally:
        get_runner(m).close()
        get_runner(ref).close()


def test_int4_and_hot_experts_with_deferral():
    m = _model("deepseek_v3", quant="int4", gpu_experts_budget="64KiB", placement="uniform")
    blocks = deferral.chain_of(m).blocks
    assert all(b.hot is not None and b.hot.residents() for b in blocks)
    try:
        for batch in (1, 2):
            _graph_equals_eager(m, batch, seed=7 + batch)
    finally:
        get_runner(m).close()


def test_host_callback_fallback_with_deferral(monkeypatch):
    monkeypatch.setenv("KTINJECT_STREAM_SYNC", "hostfn")
    m = _model("qwen3_moe")
    try:
        _graph_equals_eager(m, 2, seed=11)
    finally:
        get_runner(m).close()
