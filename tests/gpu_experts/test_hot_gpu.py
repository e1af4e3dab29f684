"""GPU-resident hot experts on a GPU (skipped without CUDA): inside the captured decode graph, with statistics and
runtime re-placement.

- graph decode with a placement gives exactly the eager decode's tokens (same kernels on both sides);
- with every expert on the GPU, or a random subset, each generated token is the reference's greedy choice within a
  small logit margin (float32 models whose reference experts are rounded to bf16 as native stores them), and the
  banks served the expected share of routed pairs;
- statistics counted inside graph replays equal the eager counts;
- dynamic re-placement moves experts between replays without a new capture and keeps the tokens right;
- the bf16 grouped GEMM path agrees with the gather path, and bank memory is what the placement says.
"""
from __future__ import annotations

import pytest
import torch

import ktinject
from ktinject.gpu_experts.hot import placement
from ktinject.gpu_experts.hot import stats as expert_stats
from ktinject.decode.generate import get_runner
from ktinject.tiny_models import build_tiny_model, tiny_prompts

from tests.references import greedy_margins, pair

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FAMILIES = ("qwen3_moe", "deepseek_v3", "mixtral")
N = 24
MARGIN = 0.15  # logits (std ~2), as tests/decode/test_graph_gpu.py


@pytest.fixture(scope="module", params=FAMILIES)
def models(request):
    ref, inj = pair(request.param, torch.float32)
    yield request.param, ref, inj
    placement.place(inj, 0, "none")
    get_runner(inj).close()


@pytest.fixture(scope="module")
def models_bf16():
    ref, inj = pair("qwen3_moe", torch.bfloat16)
    yield ref, inj
    placement.place(inj, 0, "none")
    get_runner(inj).close()


def _prompt(seed=0, length=9):
    ids = tiny_prompts(1, length, seed=seed).cuda()
    return ids, torch.ones_like(ids)


def _generate(inj, ids, mask, graphs: bool):
    runner = get_runner(inj, use_graphs=graphs)
    out = ktinject.generate(inj, ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                            pad_token_id=0, eos_token_id=None)
    return out, runner


def _again(inj, ids, mask):
    """generate through the model's existing runner (its graphs are reused)."""
    return ktinject.generate(inj, ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                             pad_token_id=0, eos_token_id=None)


def _assert_greedy(ref, seq, mask, prompt_len):
    margin = float(greedy_margins(ref, seq, mask, prompt_len).max())
    assert margin <= MARGIN, f"token off the reference's argmax by {margin:.3f} logits"


def _random_stats(inj, seed):
    blocks = expert_stats.hybrid_blocks(inj)
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 100, (len(blocks), blocks[0][1].num_experts), generator=g)
    return expert_stats.ExpertStats(tuple(n for n, _ in blocks), counts)


@pytest.mark.parametrize("how", ["all", "random"])
def test_graph_with_hot_experts(models, how):
    family, ref, inj = models
    if how == "all":
        placement.place(inj, "1GiB", "uniform")
    else:
        blocks = expert_stats.hybrid_blocks(inj)
        total = sum(b.num_experts for _, b in blocks)
        from ktinject.gpu_experts.hot.bank import HotExperts

        eb = HotExperts.expert_nbytes(blocks[0][1].spec, torch.float32)
        placement.place(inj, eb * total // 2 + 4096 * len(blocks), "frequency", _random_stats(inj, 7))
    ids, mask = _prompt(1)
    eager, _ = _generate(inj, ids, mask, graphs=False)
    placement.reset_served(inj)
    graph, runner = _generate(inj, ids, mask, graphs=True)
    assert not runner.stats.capture_failures, runner.stats.capture_failures
    assert runner.stats.captures == 1 and runner.stats.replays == N - 1
    assert torch.equal(graph, eager)
    hits, pairs = placement.served_share(inj)
    assert pairs > 0 and (hits == pairs if how == "all" else 0 < hits < pairs)
    _assert_greedy(ref, graph, mask, ids.shape[1])
    print(f"{family} {how}: graph == eager, share served on the GPU {hits / pairs:.2f}")


def test_stats_in_graph_equal_eager(models):
    _, _, inj = models
    placement.place(inj, 0, "none")
    ids, mask = _prompt(2)
    _, runner = _generate(inj, ids, mask, graphs=True)  # captures (its warm-up steps count too)
    expert_stats.reset_stats(inj)
    graph = _again(inj, ids, mask)  # replays only
    assert runner.stats.captures == 1 and runner.stats.replays == 2 * (N - 1)
    in_graph = expert_stats.read_stats(inj).counts
    expert_stats.reset_stats(inj)
    eager, _ = _generate(inj, ids, mask, graphs=False)
    assert torch.equal(graph, eager)
    assert torch.equal(in_graph, expert_stats.read_stats(inj).counts)


def test_dynamic_replacement_during_graph_decode(models):
    family, ref, inj = models
    blocks = expert_stats.hybrid_blocks(inj)
    from ktinject.gpu_experts.hot.bank import HotExperts

    E = blocks[0][1].num_experts
    budget = len(blocks) * (2 * HotExperts.expert_nbytes(blocks[0][1].spec, torch.float32) +
                            HotExperts.table_nbytes(E))
    p = placement.place(inj, budget, "dynamic", rebalance_every=2, margin=0.0)
    reb = p.rebalancer
    assert reb.kinds == ["packed"] * len(blocks) and all(b.hot.packed.pinned for _, b in blocks), \
        "the packed experts were not page-locked (see the log): moves fall back to staging buffers"
    ids, mask = _prompt(3, length=12)
    out, runner = _generate(inj, ids, mask, graphs=True)
    assert get_runner(inj) is runner and runner.stats.captures == 1 and not runner.stats.capture_failures
    assert reb.tokens >= N and reb.periods >= N // 2 - 1
    reb.drain()
    assert reb.moved > 0, "nothing was re-placed"
    with torch.no_grad():
        inj(ids)  # an eager step: mirrors the residency table into the native skip masks
    torch.cuda.synchronize()
    for _, b in blocks:
        assert torch.equal(b.skip, b.hot.resident.cpu())
        assert sorted(torch.nonzero(b.hot.resident).flatten().tolist()) == b.hot.residents()
        for s, e in enumerate(b.hot.slot_expert):
            if e >= 0:  # the bank slot holds that expert's weights
                gu = torch.cat([b.native_experts.get(e, "gate"), b.native_experts.get(e, "up")])
                assert torch.equal(b.hot.gate_up[s].cpu(), gu.to(b.hot.dtype))
    _assert_greedy(ref, out, mask, ids.shape[1])
    moved = reb.moved
    out2 = _again(inj, ids, mask)  # again: same graph, moves keep happening
    reb.drain()
    assert get_runner(inj) is runner and runner.stats.captures == 1 and reb.moved >= moved
    _assert_greedy(ref, out2, mask, ids.shape[1])
    print(f"{family}: {reb.moved} experts moved in {reb.periods} periods, no re-capture")


@pytest.mark.parametrize("quant, transfer", [("bf16", "packed"), ("bf16", "staged"), ("int8", "packed"),
                                             ("int8", "staged")])
def test_dynamic_moves_unpack_packed_bytes_on_cuda(quant, transfer):
    """Moves copy the packed bytes as stored (bf16, or int8 + scales) and unpack them on the GPU, from the page-locked
    region or through staging buffers: bank contents bit-equal to ktk_experts_get in the bank dtype, one capture for
    the whole run, tokens right (bf16: the reference's greedy choice; int8: graph == eager once frozen)."""
    from ktinject.gpu_experts.hot.bank import HotExperts

    if quant == "bf16":  # a float32 model (bank float32) against its reference with bf16-rounded experts
        ref, inj = pair("qwen3_moe", torch.float32)
    else:  # a bf16 model: the bank is bf16, so q * scale is rounded to bf16 on the GPU
        ref, inj = None, build_tiny_model("qwen3_moe", dtype=torch.bfloat16)
        ktinject.inject(inj, gpu="cuda", quant="int8")
    blocks = expert_stats.hybrid_blocks(inj)
    E = blocks[0][1].num_experts
    budget = len(blocks) * (2 * HotExperts.expert_nbytes(blocks[0][1].spec, torch.float32) +
                            HotExperts.table_nbytes(E))
    reb = placement.place(inj, budget, "dynamic", rebalance_every=2, margin=0.0, moves_per_step=2,
                          transfer=transfer).rebalancer
    assert reb.kinds == [transfer] * len(blocks)
    ids, mask = _prompt(5, length=12)
    out, runner = _generate(inj, ids, mask, graphs=True)
    assert runner.stats.captures == 1 and not runner.stats.capture_failures
    assert reb.started > 0, "nothing was re-placed"
    reb.drain()
    assert reb.moved == reb.started and reb.pending() == 0
    torch.cuda.synchronize()
    for _, b in blocks:
        # (b.skip mirrors b.hot.resident at the start of each step, so after drain() it may lag the last admits)
        for s, e in enumerate(b.hot.slot_expert):
            gu = torch.cat([b.native_experts.get(e, "gate"), b.native_experts.get(e, "up")])
            assert torch.equal(b.hot.gate_up[s].cpu(), gu.to(b.hot.dtype))
            assert torch.equal(b.hot.down[s].cpu(), b.native_experts.get(e, "down").to(b.hot.dtype))
    if ref is not None:
        _assert_greedy(ref, out, mask, ids.shape[1])
    reb.every = 10**9  # freeze the placement: graph and eager decode must agree token for token
    graph = _again(inj, ids, mask)
    assert get_runner(inj) is runner and runner.stats.captures == 1, "re-placement re-captured the graph"
    for _, b in blocks:  # frozen: the last step mirrored the final residency into the native skip mask
        assert torch.equal(b.skip, b.hot.resident.cpu())
    eager, _ = _generate(inj, ids, mask, graphs=False)
    assert torch.equal(graph, eager)
    print(f"{quant}/{transfer}: {reb.moved} experts moved in {reb.periods} periods, no re-capture")
    placement.place(inj, 0, "none")
    get_runner(inj).close()


def test_bf16_grouped_path_and_memory(models_bf16):
    ref, inj = models_bf16
    free0 = torch.cuda.memory_allocated()
    p = placement.place(inj, "1GiB", "uniform")
    assert torch.cuda.memory_allocated() - free0 >= p.nbytes * 0.99
    blocks = expert_stats.hybrid_blocks(inj)
    hot = blocks[0][1].hot
    cap = torch.cuda.get_device_capability()
    assert hot.grouped == (cap[0] in (9, 10)), "grouped_mm expected on Hopper/Blackwell"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, hot.H, generator=g).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(hot.E, generator=g)[:2] for _ in range(5)]).cuda()
    w = torch.rand(5, 2, generator=g).cuda()
    first = hot.retire(0)  # one expert back on the CPU: rows for it must be masked out
    a = hot(x, ids, w)
    grouped, hot.grouped = hot.grouped, False
    b = hot(x, ids, w)
    hot.grouped = grouped
    hot.admit(0, first)
    assert not bool(a[(ids == first).any(1)].isnan().any())
    assert torch.allclose(a, b, rtol=2e-2, atol=2e-2)
    ids_, mask = _prompt(4)
    out, runner = _generate(inj, ids_, mask, graphs=True)
    eager, _ = _generate(inj, ids_, mask, graphs=False)
    assert not runner.stats.capture_failures and torch.equal(out, eager)
