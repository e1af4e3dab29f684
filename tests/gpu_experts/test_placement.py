"""Hot-expert placement on the CPU: statistics, choosing within a byte budget, and the injected model with GPU-resident
experts (gpu="cpu": the "GPU bank" lives on the CPU device and runs the same code) against the reference.

Legend: L MoE layers, E experts, B batch, S sequence, V vocabulary.
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from ktinject import inject
from ktinject.gpu_experts.hot import placement
from ktinject.gpu_experts.hot import settings
from ktinject.gpu_experts.hot import stats as expert_stats
from ktinject.tiny_models import FAMILIES, build_tiny_model, tiny_prompts

PROMPTS = tiny_prompts(4, 32, seed=3)  # [4, 32]
SLACK = 1.5  # injected-with-placement logits error vs float32 <= 1.5 x HF bf16's (as test_families)


# ---------------------------------------------------------------------------------------------- pure functions


@pytest.mark.parametrize("text, expected", [
    ("12GiB", 12 * 2**30), ("512 MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("0", 0), (4096, 4096),
    ("2kib", 2048), ("100", 100), (1e9, 10**9),
])
def test_parse_bytes(text, expected):
    assert settings.parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["12 parsecs", "-1GiB", "", "GiB", True, float("nan")])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError, match="byte size"):
        settings.parse_bytes(bad)


def test_frequency_picks_global_top():
    counts = torch.tensor([[50, 1, 30, 0], [40, 45, 2, 3], [5, 4, 3, 2]])
    chosen = placement.choose(counts, budget=4 * 100, expert_bytes=100, strategy="frequency")
    assert chosen == [[0, 2], [0, 1], []]  # 50, 45, 40, 30
    # each used layer's tables cost 10: 50 (110), 45 (220), 40 (320), 30 (420) fits 420 exactly, not 419
    chosen = placement.choose(counts, budget=420, expert_bytes=100, strategy="frequency", layer_bytes=10)
    assert chosen == [[0, 2], [0, 1], []] and placement.chosen_nbytes(chosen, 100, 10) == 420
    chosen = placement.choose(counts, budget=419, expert_bytes=100, strategy="frequency", layer_bytes=10)
    assert chosen == [[0], [0, 1], []]  # and nothing smaller fits in the 99 bytes left


def test_uniform_same_count_per_layer():
    counts = torch.tensor([[50, 1, 30, 0], [40, 45, 2, 3], [5, 4, 3, 2]])
    chosen = placement.choose(counts, budget=7 * 100, expert_bytes=100, strategy="uniform")
    assert chosen == [[0, 2], [0, 1], [0, 1]]  # n = 2 (3 x 2 = 6 <= 7 < 9), each layer's top 2
    assert placement.choose(counts, 7 * 100, 100, "none") == [[], [], []]
    assert placement.choose(counts, 0, 100, "frequency") == [[], [], []]
    assert placement.choose(counts, 10**9, 100, "uniform") == [[0, 1, 2, 3]] * 3


def test_layer_without_support_gets_nothing():
    counts = torch.tensor([[9, 9], [1, 1]])
    assert placement.choose(counts, 1000, [None, 10], "frequency") == [[], [0, 1]]
    assert placement.choose(counts, 1000, [None, 10], "uniform") == [[], [0, 1]]


def test_budget_never_exceeded_random():
    rng = random.Random(0)
    for _ in range(300):
        L, E = rng.randint(1, 6), rng.randint(1, 12)
        counts = torch.randint(0, 100, (L, E), generator=torch.Generator().manual_seed(rng.randint(0, 10**6)))
        eb = [rng.choice([None, rng.randint(1, 50)]) for _ in range(L)]
        lb = [rng.randint(0, 20) for _ in range(L)]
        budget = rng.randint(0, 600)
        for strategy in ("frequency", "uniform", "none"):
            chosen = placement.choose(counts, budget, eb, strategy, lb)
            assert placement.chosen_nbytes(chosen, eb, lb) <= budget
            assert all(not x for i, x in enumerate(chosen) if eb[i] is None)
            assert all(x == sorted(set(x)) for x in chosen)
            if strategy == "uniform":
                assert len({len(x) for i, x in enumerate(chosen) if eb[i] is not None}) <= 1
        # frequency with equal sizes and no table bytes: exactly the top ranks (no better choice exists)
        chosen = placement.choose(counts, budget, 10, "frequency")
        n = min(budget // 10, L * E)
        picked = sorted(int(counts[i, e]) for i, x in enumerate(chosen) for e in x)
        assert picked == sorted(counts.flatten().tolist())[L * E - n:]


def test_hit_share():
    counts = torch.tensor([[3, 1], [0, 4]])
    assert expert_stats.hit_share(counts, [[0], [1]]) == pytest.approx(7 / 8)
    assert expert_stats.hit_share(torch.zeros(2, 2), [[0], []]) == 0.0


@pytest.mark.parametrize("suffix", [".safetensors", ".json", ""])
def test_stats_round_trip(tmp_path, suffix):
    stats = expert_stats.ExpertStats(("model.layers.1.mlp", "model.layers.2.mlp"),
                                  torch.tensor([[1, 2**40, 0], [7, 8, 9]]))
    path = expert_stats.save_stats(stats, tmp_path / f"stats{suffix}")
    back = expert_stats.load_stats(path)
    assert back.layers == stats.layers and torch.equal(back.counts, stats.counts)
    assert back.counts.dtype == torch.int64


def test_load_stats_rejects_other_files(tmp_path):
    (tmp_path / "x.json").write_text('{"format": "something"}')
    with pytest.raises(ValueError, match="not a ktinject expert stats"):
        expert_stats.load_stats(tmp_path / "x.json")
    from safetensors.torch import save_file

    save_file({"counts": torch.zeros(2, 2)}, str(tmp_path / "y.safetensors"))
    with pytest.raises(ValueError, match="not a ktinject expert stats"):
        expert_stats.load_stats(tmp_path / "y.safetensors")
    with pytest.raises(FileNotFoundError):
        expert_stats.load_stats(tmp_path / "missing")


# ---------------------------------------------------------------------------------------------- with models


def _injected(family: str, dtype=torch.bfloat16, **kw):
    model = build_tiny_model(family, seed=0, dtype=dtype)
    inject(model, gpu="cpu", **kw)
    return model


@torch.no_grad()
def _logits(model, ids=PROMPTS) -> torch.Tensor:
    return model(input_ids=ids).logits.float()


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@torch.no_grad()
def test_counts_match_router_ids():
    model = _injected("qwen3_moe")
    blocks = expert_stats.hybrid_blocks(model)
    seen = {name: torch.zeros(b.num_experts, dtype=torch.int64) for name, b in blocks}

    def hook(name):
        def fn(module, args, out):
            seen[name] += torch.bincount(out[2].reshape(-1), minlength=module.weight.shape[0])
        return fn

    handles = [b.gate.register_forward_hook(hook(name)) for name, b in blocks]
    _logits(model)
    for h in handles:
        h.remove()
    stats = expert_stats.read_stats(model)
    assert stats.layers == tuple(seen)
    assert torch.equal(stats.counts, torch.stack(list(seen.values())))
    k = model.config.num_experts_per_tok
    assert stats.total == len(blocks) * PROMPTS.numel() * k
    expert_stats.reset_stats(model)
    assert expert_stats.read_stats(model).total == 0
    expert_stats.set_collection(model, False)
    _logits(model)
    assert expert_stats.read_stats(model).total == 0


@pytest.fixture(scope="module")
def references():
    """family -> (float32 truth logits, HF bf16 logits, injected-without-placement logits)."""
    out = {}
    for family in FAMILIES:
        truth = _logits(build_tiny_model(family, seed=0, dtype=torch.float32))
        yard = _logits(build_tiny_model(family, seed=0, dtype=torch.bfloat16))
        out[family] = (truth, yard, _logits(_injected(family)))
    return out


def _random_stats(model, seed: int) -> expert_stats.ExpertStats:
    blocks = expert_stats.hybrid_blocks(model)
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 1000, (len(blocks), blocks[0][1].num_experts), generator=g)
    return expert_stats.ExpertStats(tuple(n for n, _ in blocks), counts)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("how", ["none", "all", "random", "random-gather"])
def test_logits_with_placement(references, family, how):
    truth, yard, plain = references[family]
    model = _injected(family)
    blocks = expert_stats.hybrid_blocks(model)
    if how == "none":
        p = placement.place(model, "1GiB", "none")
        assert p.resident == 0 and all(b.hot is None for _, b in blocks)
    elif how == "all":
        p = placement.place(model, "1GiB", "uniform")
        assert all(b.hot is not None and b.hot.residents() == list(range(b.num_experts)) for _, b in blocks)
        assert all(bool(b.skip.all()) for _, b in blocks)
        for _, b in blocks:  # every expert resident: the routed experts never reach the native pool
            b._bound_task = None
    else:
        stats = _random_stats(model, seed=len(family))
        E = blocks[0][1].num_experts
        from ktinject.gpu_experts.hot.bank import HotExperts

        eb = HotExperts.expert_nbytes(blocks[0][1].spec, torch.bfloat16)
        budget = eb * (len(blocks) * E // 2) + len(blocks) * HotExperts.table_nbytes(E)
        p = placement.place(model, budget, "frequency", stats)
        assert 0 < p.resident < len(blocks) * E
        assert p.nbytes <= budget
        for (_, b), experts in zip(blocks, p.experts):
            assert torch.equal(b.skip.bool(), torch.isin(torch.arange(E), torch.tensor(experts, dtype=torch.long)))
            if how == "random-gather" and b.hot is not None:
                b.hot.grouped = False
    placement.reset_served(model)
    got = _logits(model)
    hits, pairs = placement.served_share(model)
    assert pairs > 0 and (hits == 0) == (how == "none")
    if how == "all":
        assert hits == pairs
    e_got, e_yard = _rel(got, truth), _rel(yard, truth)
    assert e_got <= SLACK * e_yard, f"{family} {how}: error {e_got:.3e} vs HF bf16 {e_yard:.3e}"
    assert _rel(got, plain) <= SLACK * e_yard, f"{family} {how}: moved {_rel(got, plain):.3e} from no placement"


def test_budget_respected_by_place():
    model = _injected("deepseek_v3")
    blocks = expert_stats.hybrid_blocks(model)
    stats = _random_stats(model, 1)
    for budget in (0, 1, 50_000, 123_456, 400_000, 10**9):
        for strategy in ("frequency", "uniform", "dynamic"):
            p = placement.place(model, budget, strategy, stats)
            actual = sum(b.hot.nbytes for _, b in blocks if b.hot is not None)
            assert actual == p.nbytes <= budget
    placement.place(model, 0, "none")
    assert placement.rebalancer(model) is None


def test_hot_expert_settings_defaults_and_errors(tmp_path):
    """One validated set of options for inject, from_pretrained, the chat and the rules (issue 22): the same
    defaults everywhere, and errors that name the option and what to write."""
    from ktinject.operators.moe import MoEOperator

    make = settings.HotExpertSettings.make
    assert set(settings.OPTIONS) == MoEOperator.kwargs_allowed - {"quant", "group_size", "defer", "prefill"}
    assert make("12GiB") == settings.HotExpertSettings(12 * 2**30, "dynamic", None, 64)
    stats = expert_stats.save_stats(expert_stats.ExpertStats(("a",), torch.ones(1, 4)), tmp_path / "s.json")
    assert make("1GiB", stats=str(stats)).strategy == "frequency"
    assert make(None, "uniform", rebalance_every=8) == settings.HotExpertSettings(0, "uniform", None, 8)
    for kwargs, message in [
        (dict(gpu_experts_budget="lots"), r"gpu_experts_budget: expected 'auto', bytes or a size like '12GiB', or a "
                                          r"share like 0.5, got 'lots'"),
        (dict(placement="hottest"), r"placement: expected one of frequency, uniform, dynamic, none, got 'hottest'"),
        (dict(rebalance_every=0), r"rebalance_every: expected a positive number of tokens, got 0"),
        (dict(stats=str(tmp_path / "missing.json")), r"stats: expert statistics file not found"),
        (dict(stats=3), r"stats: expected a statistics file .* got int"),
    ]:
        with pytest.raises(ValueError, match=message):
            make(**kwargs)

    def plan_with(*kwargs):
        rule = lambda i: type("Rule", (), {"where": f"rules.yaml rule {i}"})()  # noqa: E731
        entries = [type("Entry", (), {"kwargs": k, "rule": rule(i)})() for i, k in enumerate(kwargs)]
        return type("Plan", (), {"operator_entries": lambda self: entries})()

    from_plan = settings.HotExpertSettings.from_plan
    auto = from_plan(plan_with({"quant": "int8"}))  # nothing asked: auto, measured where the model is injected
    assert auto == settings.HotExpertSettings(0, "dynamic", None, 64, 1.0) and auto.request == "auto"
    assert from_plan(plan_with({"gpu_experts_budget": 0})) is None  # 0: nothing placed
    assert from_plan(plan_with({}), placement="none") is None
    got = from_plan(plan_with({"gpu_experts_budget": "1KiB"}, {"gpu_experts_budget": "1KiB"}), rebalance_every=5)
    assert got == settings.HotExpertSettings(1024, "dynamic", None, 5)
    assert from_plan(plan_with({"gpu_experts_budget": "1KiB"}), gpu_experts_budget=2048).budget == 2048
    with pytest.raises(ValueError, match=r"moe rules disagree on placement: 'uniform' \(rules.yaml rule 0\)"):
        from_plan(plan_with({"placement": "uniform"}, {"placement": "frequency"}))
    with pytest.raises(ValueError, match=r"rules.yaml rule 1: gpu_experts_budget: expected .auto., bytes"):
        from_plan(plan_with({}, {"gpu_experts_budget": "lots"}))
    with pytest.raises(TypeError, match="unknown hot-expert option"):
        from_plan(plan_with({}), budget="1GiB")


def test_inject_kwargs_and_rules(tmp_path):
    model = _injected("qwen3_moe", gpu_experts_budget="64KiB", placement="uniform")
    blocks = expert_stats.hybrid_blocks(model)
    assert all(b.hot is not None for _, b in blocks)
    assert len({b.hot.C for _, b in blocks}) == 1
    assert model._ktinject_placement.nbytes <= 64 * 1024

    stats = _random_stats(model, 2)
    path = expert_stats.save_stats(stats, tmp_path / "s.safetensors")
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"""
- match: {{class: Qwen3MoeSparseMoeBlock}}
  replace: moe
  kwargs: {{gpu_experts_budget: 100KiB, placement: frequency, stats: '{path}'}}
- include: common.yaml
""")
    model = build_tiny_model("qwen3_moe", dtype=torch.bfloat16)
    inject(model, str(rules), gpu="cpu")
    p = model._ktinject_placement
    assert p.strategy == "frequency" and p.nbytes <= 100 * 1024
    assert p.experts == placement.choose(stats.counts, 100 * 1024, [blocks[0][1].hot.expert_nbytes(
        blocks[0][1].spec, torch.bfloat16)] * len(blocks), "frequency", [blocks[0][1].hot.table_nbytes(8)] * 2)

    bad = tmp_path / "bad.yaml"
    bad.write_text("- match: {class: Qwen3MoeSparseMoeBlock}\n  replace: moe\n  kwargs: {gpu_experts_budget: lots}\n"
                   "- include: common.yaml\n")
    with pytest.raises(ValueError, match="byte size 'lots'"):
        inject(build_tiny_model("qwen3_moe", dtype=torch.bfloat16), str(bad), gpu="cpu")


@torch.no_grad()
@pytest.mark.parametrize("transfer, quant", [("auto", "bf16"), ("packed", "bf16"), ("staged", "bf16"),
                                             ("packed", "int8"), ("staged", "int8")])
def test_dynamic_rebalancing_moves_hot_experts_and_keeps_logits(transfer, quant):
    """auto on a CPU bank = the float32 host path; packed/staged = the device unpack of the packed bytes (here with
    torch CPU ops), straight from the packed region or through staging buffers filled by a worker."""
    family = "qwen3_moe"
    model = _injected(family, quant=quant)
    blocks = expert_stats.hybrid_blocks(model)
    E = blocks[0][1].num_experts
    from ktinject.gpu_experts.hot.bank import HotExperts

    eb = HotExperts.expert_nbytes(blocks[0][1].spec, torch.bfloat16)
    budget = len(blocks) * (2 * eb + HotExperts.table_nbytes(E))
    p = placement.place(model, budget, "dynamic", rebalance_every=4, margin=0.0, transfer=transfer)
    reb = placement.rebalancer(model)
    assert p.rebalancer is reb and all(b.hot.residents() == [0, 1] for _, b in blocks)  # no stats: arbitrary
    assert reb.kinds == [{"auto": "host"}.get(transfer, transfer)] * len(blocks)
    ids = tiny_prompts(1, 8, seed=5)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                   pad_token_id=0, eos_token_id=None)
    assert reb.tokens >= 16 and reb.periods >= 3  # generate called it once per token (the hook)
    reb.drain()
    assert reb.moved > 0 and reb.moved == reb.started and reb.pending() == 0
    truth = _logits(build_tiny_model(family, seed=0, dtype=torch.float32))
    yard = _logits(build_tiny_model(family, seed=0, dtype=torch.bfloat16))
    plain = _logits(_injected(family, quant=quant))
    got = _logits(model)  # (also: each forward mirrors the residency table into the native skip mask)
    # the residents are the top experts by (decayed) recent counts
    for li, (_, b) in enumerate(blocks):
        top = set(torch.argsort(reb.scores[li], descending=True, stable=True)[:2].tolist())
        assert set(b.hot.residents()) == top or reb.scores[li].sort(descending=True).values[1] == \
            reb.scores[li].sort(descending=True).values[2]  # a tie at the boundary may keep either
        assert torch.equal(b.skip, b.hot.resident)
        for s, e in enumerate(b.hot.slot_expert):  # bit-exact bank contents, whichever way they came
            gu = torch.cat([b.native_experts.get(e, "gate"), b.native_experts.get(e, "up")])
            assert torch.equal(b.hot.gate_up[s], gu.to(b.hot.dtype))
            assert torch.equal(b.hot.down[s], b.native_experts.get(e, "down").to(b.hot.dtype))
    assert _rel(got, truth) <= SLACK * max(_rel(yard, truth), _rel(plain, truth))
    placement.place(model, 0, "none")
    assert "_get_stopping_criteria" not in model.__dict__


def test_rebalancer_rate_limit_and_queue():
    """moves_per_step bounds the moves started per token; the queue is re-planned each period; drain finishes it."""
    model = _injected("qwen3_moe")
    blocks = [b for _, b in expert_stats.hybrid_blocks(model)]
    from ktinject.gpu_experts.hot.bank import HotExperts

    eb = HotExperts.expert_nbytes(blocks[0].spec, torch.bfloat16)
    budget = len(blocks) * (2 * eb + HotExperts.table_nbytes(8))
    reb = placement.place(model, budget, "dynamic", rebalance_every=2, margin=0.0, moves_per_step=1,
                          transfer="packed").rebalancer
    blocks[0].counts += torch.tensor([0, 0, 0, 0, 0, 50, 60, 0])
    blocks[1].counts += torch.tensor([0, 0, 0, 30, 40, 0, 0, 0])
    reb.step()
    reb.step()  # a period: four moves planned, one started
    assert (reb.moved, reb.pending()) == (1, 3)
    reb.step()
    assert (reb.moved, reb.pending()) == (2, 2)
    reb.step()  # a period: re-planned (the same two left), one started
    assert (reb.moved, reb.pending()) == (3, 1)
    reb.drain()
    assert reb.moved == 4 and reb.pending() == 0
    assert [b.hot.residents() for b in blocks] == [[5, 6], [3, 4]]
    with pytest.raises(ValueError, match="transfer 'bogus'"):
        from ktinject.gpu_experts.hot.rebalance import Rebalancer

        Rebalancer(blocks, transfer="bogus")
    with pytest.raises(ValueError, match="moves_per_step"):
        Rebalancer(blocks, moves_per_step=0)
    placement.place(model, 0, "none")


def test_calibrate_cli(tmp_path):
    from ktinject.cli import calibrate
    from ktinject.demo import demo_model_dir

    prompts = tmp_path / "p.txt"
    prompts.write_text("# comment\nhello there\n\nhow are you\n")
    out = tmp_path / "stats.json"
    assert calibrate.main(["--model", str(demo_model_dir(tmp_path / "cache")), "--prompts", str(prompts), "--out",
                           str(out), "--max-new-tokens", "4", "--gpu", "cpu"]) == 0
    stats = expert_stats.load_stats(out)
    assert stats.total > 0 and len(stats.layers) >= 1
    per_layer = stats.counts.sum(1)
    assert bool((per_layer == per_layer[0]).all())  # every layer sees every token
    assert calibrate.main(["--model", str(tmp_path), "--prompts", str(prompts), "--out", str(out)]) == 2


@pytest.mark.parametrize("extra", [["--gpu-experts-budget", "64KiB"],
                                   ["--gpu-experts-budget", "1GiB", "--placement", "uniform"]])
def test_chat_gpu_experts_budget(tmp_path, extra):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from ktinject.demo import demo_model_dir

    repo = Path(__file__).resolve().parents[2]
    model = demo_model_dir(tmp_path / "cache")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(repo), os.environ.get("PYTHONPATH")) if p))

    def chat(*args):
        return subprocess.run([sys.executable, "-m", "ktinject.chat", "--model", str(model), "--prompt", "hi",
                               "--max-new-tokens", "4", "--gpu", "cpu", *args], env=env, cwd=repo,
                              capture_output=True, text=True, timeout=300)

    r = chat(*extra)
    assert r.returncode == 0, r.stderr
    strategy = "uniform" if "uniform" in extra else "dynamic"
    assert f"hot experts ({strategy}" in r.stderr and "[prefill" in r.stderr  # one-shot: stdout is the reply alone
    r = chat("--gpu-experts-budget", "lots")
    assert r.returncode == 2 and "byte size 'lots'" in r.stderr


def test_rebalancer_follows_recent_counts_with_margin():
    model = _injected("qwen3_moe")
    blocks = [b for _, b in expert_stats.hybrid_blocks(model)]
    from ktinject.gpu_experts.hot.bank import HotExperts

    eb = HotExperts.expert_nbytes(blocks[0].spec, torch.bfloat16)
    budget = len(blocks) * (2 * eb + HotExperts.table_nbytes(8))
    reb = placement.place(model, budget, "dynamic", rebalance_every=2, margin=0.5, max_moves=3).rebalancer
    assert [b.hot.residents() for b in blocks] == [[0, 1], [0, 1]]
    blocks[0].counts += torch.tensor([1, 1, 0, 0, 0, 50, 60, 0])  # layer 0: experts 5 and 6 are hot now
    blocks[1].counts += torch.tensor([10, 10, 0, 0, 0, 0, 0, 14])  # layer 1: 14 < 10 * 1.5: no churn
    reb.step()
    assert reb.moved == 0  # not a period yet
    reb.step()
    assert [b.hot.residents() for b in blocks] == [[5, 6], [0, 1]] and reb.moved == 2
    blocks[0].counts += torch.tensor([0, 0, 0, 0, 0, 0, 0, 0])
    blocks[1].counts += torch.tensor([0, 0, 90, 80, 70, 0, 0, 0])  # three candidates, two slots
    reb.step()
    reb.step()
    assert blocks[1].hot.residents() == [2, 3] and reb.moved == 4
    for b in blocks:  # the bank slots hold the weights of their experts
        for s, e in enumerate(b.hot.slot_expert):
            gu = torch.cat([b.native_experts.get(e, "gate"), b.native_experts.get(e, "up")])
            assert torch.equal(b.hot.gate_up[s], gu.to(torch.bfloat16))
    with pytest.raises(ValueError, match="dynamic"):
        from ktinject.gpu_experts.hot.rebalance import Rebalancer

        placement.place(model, budget, "uniform")
        Rebalancer(blocks)


@pytest.mark.parametrize("doc, match", [
    ({"layers": ["a", "b"], "counts": [[1, 2], [3]]}, r'"counts" is not a table of integers'),
    ({"counts": [[1, 2]]}, r'"layers" must be a list of MoE layer names, got NoneType'),
    ({"layers": ["a"], "counts": [[1e30, 2]]}, r'"counts" is not a table of integers'),
    ({"layers": ["a"], "counts": [[1.5, 2]]}, r'"counts" is not a table of integers'),
    ({"layers": "ab", "counts": [[1, 2], [3, 4]]}, r'"layers" must be a list.*got str'),
    ({"layers": ["a"], "counts": [[1, 2], [3, 4]]}, r"a row per layer \(1\), got torch.int64 \[2, 2\]"),
    ({"layers": ["a"], "counts": [[-1, 2]]}, r"negative count \(-1\)"),
])
def test_load_stats_checks_what_it_reads(tmp_path, doc, match):
    """A stats file edited by hand (or cut short) gets an error naming the file and the field, never a count that
    is silently truncated, a layer list made of a string's letters, or a raw torch error."""
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"format": expert_stats.STATS_FORMAT, "version": 1, **doc}))
    with pytest.raises(ValueError, match=rf"{path}: .*{match}"):
        expert_stats.load_stats(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"not a ktinject expert stats file \(format 'list'"):
        expert_stats.load_stats(path)
