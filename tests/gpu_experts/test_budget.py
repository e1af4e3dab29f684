"""The GPU budget of the hot experts (``auto``, a share, a cap) on the CPU: the arithmetic as a table, the options and
their errors, the measured inputs against what the run really allocates, and ``auto`` on a CPU-only run.

Shapes: ``QWEN3_30B`` is Qwen3-30B-A3B's (48 MoE layers x 128 experts, H 2048, I 768, 4 KV heads of 128, bf16 banks,
an int4 prefill ring of about 2 GiB); ``TINY`` a model far smaller than any card.
"""
from __future__ import annotations

import logging

import pytest
import torch

import ktinject
from ktinject.gpu_experts.hot import budget as gpu
from ktinject.gpu_experts.hot import settings
from ktinject.injection import gpu_budget
from ktinject.tiny_models import FAMILIES, MORE_FAMILIES, build_tiny_model, missing_reason, tiny_prompts

GiB = 2**30
QWEN3_30B = gpu.ModelShape(dense=3 * GiB, kv_per_token=48 * 2 * 4 * 128 * 2, expert=3 * 2048 * 768 * 2,
                           experts=48 * 128, layers=48, table=128 * 17 + 8, ring=2 * GiB,
                           activation_per_token=8 * (8 * 2048 + 16 * 768) + 64 * 2048)
TINY = gpu.ModelShape(dense=400 << 10, kv_per_token=384, expert=12288, experts=16, layers=2, table=144,
                      ring=425984, activation_per_token=6144)


# ---------------------------------------------------------------------------------------------- the arithmetic


@pytest.mark.parametrize("free, cap, context, rows, budget, placed", [
    # the whole card: every expert fits (54 GiB of banks), the budget is exactly their bytes, no ring reserved
    (139 * GiB, None, 4096, 8, QWEN3_30B.all_experts(), 6144),
    (70 * GiB, None, 4096, 8, QWEN3_30B.all_experts(), 6144),
    # capped at 24 GiB: 24 - dense 3 - KV 3 - workspace 1.1875 - margin 0.72 - ring 2 = 14.0925 GiB: 33 a layer
    (139 * GiB, 24 * GiB, 4096, 8, 15131706655, 33 * 48),
    (139 * GiB, 24 * GiB, 4096, 1, 17950278943, 39 * 48),  # one row: 2.625 GiB less KV cache
    (139 * GiB, 12 * GiB, 4096, 8, 2483027968, 5 * 48),  # margin at its floor (512 MiB)
    (20 * GiB, 24 * GiB, 4096, 8, 10965588378, 24 * 48),  # the cap above what is free: the free bytes count
    # a long context for 32 rows takes 120 GiB of cache; what is left holds 20 experts a layer
    (139 * GiB, None, 40960, 32, 9279813714, 20 * 48),
    # the cache alone is more than the cap: nothing placed (check_cap makes it an error for a given cap)
    (139 * GiB, 24 * GiB, 32768, 8, 0, 0),
    (2 * GiB, None, 4096, 8, 0, 0),  # the dense part alone does not fit what is free
    (GiB + (64 << 20), None, 256, 8, TINY.all_experts(), 16),  # a tiny model: whole, once the fixed parts fit
])
def test_fit_table(free, cap, context, rows, budget, placed):
    shape = TINY if budget == TINY.all_experts() else QWEN3_30B
    got = gpu.fit(shape, free, cap=cap, rows=rows, context=context)
    assert (got.budget, got.placed) == (budget, placed), "\n".join(got.lines())
    assert got.kv == rows * context * shape.kv_per_token
    assert got.everything == (placed == shape.experts)
    if placed == shape.experts:
        assert got.ring == 0 and got.budget == shape.all_experts()
    elif placed:
        assert got.ring == shape.ring
        parts = got.dense + got.kv + got.workspace + got.margin + got.ring + got.budget
        assert parts <= got.usable < parts + 1  # the budget is what is left, to the byte (floored)
        assert gpu.room_for(shape, got.budget) == placed
        per = placed // shape.layers
        assert shape.layers * (per * shape.expert + shape.table) <= got.budget  # one more a layer does not fit
        assert shape.layers * ((per + 1) * shape.expert + shape.table) > got.budget
    else:
        assert got.reason.startswith("the run needs ") and "is usable" in got.reason


def test_fit_share_margin_and_reasons():
    whole = gpu.fit(QWEN3_30B, 139 * GiB)
    half = gpu.fit(QWEN3_30B, 139 * GiB, fraction=0.5)
    assert half.placed == QWEN3_30B.experts  # half of what is left still holds every expert
    capped = gpu.fit(QWEN3_30B, 139 * GiB, cap=24 * GiB)
    capped_half = gpu.fit(QWEN3_30B, 139 * GiB, cap=24 * GiB, fraction=0.5)
    assert capped_half.budget == capped.budget // 2 and capped_half.request == "0.5 of what is left"
    assert whole.margin == int(0.03 * 139 * GiB) and gpu.fit(QWEN3_30B, 12 * GiB).margin == gpu.MARGIN_MIN
    assert gpu.fit(QWEN3_30B, 139 * GiB, cap=24 * GiB, margin=0).budget == capped.budget + capped.margin
    reserved = gpu.fit(QWEN3_30B, 139 * GiB, cap=24 * GiB, reserve=4 * GiB)
    assert reserved.budget == capped.budget - 4 * GiB
    assert any(line.strip().startswith("reserved") for line in reserved.lines())
    short = gpu.fit(QWEN3_30B, 2 * GiB)
    assert short.budget == 0 and "dense 3.0 GiB" in short.reason and "2.0 GiB is usable" in short.reason
    no_experts = gpu.fit(QWEN3_30B._replace(experts=0, layers=0), 139 * GiB)
    assert no_experts.budget == 0 and "no routed experts" in no_experts.reason
    with pytest.raises(ValueError, match="0 < fraction <= 1"):
        gpu.fit(QWEN3_30B, GiB, fraction=1.5)


def test_report_lines_name_every_part():
    lines = gpu.fit(QWEN3_30B, 139 * GiB, cap=24 * GiB).lines()
    assert lines[0] == "GPU budget (auto): 14.1 GiB for hot experts, room for 1584 of 6144 experts"
    for part in ("usable", "dense", "KV cache", "ring", "workspace", "margin", "experts"):
        assert any(line.split()[0] == part.split()[0] for line in lines[1:]), (part, lines)
    assert "  usable      24.0 GiB (free 139.0 GiB, gpu_memory 24.0 GiB)" in lines
    assert "  KV cache    3.0 GiB (8 rows x 4096 tokens)" in lines
    assert "  experts     1584 of 6144, 13.9 GiB (9.0 MiB each)" in lines
    whole = gpu.fit(QWEN3_30B, 139 * GiB).lines()
    assert whole[0].endswith("room for 6144 of 6144 experts (the whole model)")
    assert "  ring        0 B (nothing streamed: no prefill ring)" in whole


def test_check_cap_errors_name_the_sizes():
    gpu.check_cap(24 * GiB, 140 * GiB, 3 * GiB, 3 * GiB)  # fits: no error
    with pytest.raises(ValueError, match=r"gpu_memory 200.0 GiB is more than cuda:0 has \(140.0 GiB\)"):
        gpu.check_cap(200 * GiB, 140 * GiB, 3 * GiB, 3 * GiB, "cuda:0")
    with pytest.raises(ValueError, match=r"gpu_memory 4.0 GiB cannot hold the dense weights \(3.0 GiB\) and the KV "
                                         r"cache \(3.0 GiB for 8 rows x 4096 tokens\): 6.0 GiB at least"):
        gpu.check_cap(4 * GiB, 140 * GiB, 3 * GiB, 3 * GiB, rows=8, context=4096)


# ---------------------------------------------------------------------------------------------- the options


@pytest.mark.parametrize("value, budget, fraction", [
    ("auto", 0, 1.0), ("AUTO", 0, 1.0), ("0.5", 0, 0.5), (0.25, 0, 0.25), ("1.0", 0, 1.0), ("0", 0, None),
    (0, 0, None), ("12GiB", 12 * GiB, None), (4096, 4096, None), ("1.5GB", 1_500_000_000, None),
])
def test_budget_forms(value, budget, fraction):
    s = settings.HotExpertSettings.make(value)
    assert (s.budget, s.fraction) == (budget, fraction)
    if fraction is not None:
        assert s.resolved(123).budget == 123 and s.resolved(123).fraction is None


def test_workload_errors():
    assert gpu.Workload.make() == gpu.Workload(None, gpu.GENERATE_ROWS, None, 0)
    assert gpu.Workload.make("24GiB", 4, 8192, "1GiB") == gpu.Workload(24 * GiB, 4, 8192, GiB)
    for kwargs, message in [
        (dict(gpu_memory="lots"), r"gpu_memory: expected the GPU bytes ktinject may take, e.g. '24GiB', got 'lots'"),
        (dict(gpu_memory=0), r"gpu_memory: 0 bytes leaves nothing for the dense part"),
        (dict(max_batch=0), r"max_batch: expected a positive int, got 0"),
        (dict(max_context="4k"), r"max_context: expected a positive int, got '4k'"),
        (dict(gpu_reserve="-1GiB"), r"gpu_reserve: expected GPU bytes to keep free"),
    ]:
        with pytest.raises(ValueError, match=message):
            gpu.Workload.make(**kwargs)


def test_place_refuses_an_unmeasured_budget():
    from ktinject.gpu_experts.hot import placement

    model = build_tiny_model("qwen3_moe", dtype=torch.bfloat16)
    ktinject.inject(model, gpu="cpu", gpu_experts_budget=0)
    with pytest.raises(ValueError, match="measured where the model is injected"):
        placement.place(model, "auto")


# ---------------------------------------------------------------------------------------------- a CPU-only run


def test_auto_on_a_cpu_only_run_places_nothing_and_says_why(caplog):
    model = build_tiny_model("qwen3_moe", dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="ktinject"):
        plan = ktinject.inject(model, gpu="cpu")  # the default budget: auto
    why = "GPU budget (auto): no hot experts: the dense part runs on cpu (no CUDA device): every routed expert " \
          "stays on the CPU"
    said = [r for r in caplog.records if r.name == "ktinject.injection.gpu_budget"]
    assert [r.getMessage() for r in said] == [why] and said[0].levelno == logging.INFO  # one line, not an error
    assert "_ktinject_placement" not in model.__dict__
    assert all(b.hot is None for b in model.modules() if hasattr(b, "native_experts"))
    assert model._ktinject_plan is plan and plan.gpu_budget.reason is not None
    assert str(plan).splitlines()[-1] == why  # the plan's report
    assert ktinject.info(model)["gpu_budget"] == [why]
    out = model.generate(tiny_prompts(1, 8, seed=1), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 11)
    explicit = build_tiny_model("qwen3_moe", dtype=torch.bfloat16)  # bytes on the CPU: banks there, as before
    ktinject.inject(explicit, gpu="cpu", gpu_experts_budget="64KiB", placement="uniform")
    assert explicit._ktinject_placement.resident > 0 and explicit._ktinject_plan.gpu_budget is None


def test_gpu_memory_kwarg_errors_on_the_cpu(tmp_path):
    with pytest.raises(ValueError, match=r"gpu_memory 8.0 GiB: the dense part runs on cpu \(no CUDA device\)"):
        ktinject.inject(build_tiny_model("qwen3_moe"), gpu="cpu", gpu_memory="8GiB")
    with pytest.raises(ValueError, match=r"gpu_memory: expected the GPU bytes ktinject may take"):
        ktinject.inject(build_tiny_model("qwen3_moe"), gpu="cpu", gpu_memory="plenty")
    with pytest.raises(TypeError, match=r"did you mean gpu_memory="):
        ktinject.inject(build_tiny_model("qwen3_moe"), gpu="cpu", gpu_memroy="8GiB")


# ---------------------------------------------------------------------------------------------- measured inputs


#: every family whose decode runs on ktinject's KVCache (the lightning-indexer families and DeepSeek-V4 decode in HF's
#: own cache)
KV_FAMILIES = FAMILIES + tuple(f for f in MORE_FAMILIES if f not in ("deepseek_v32", "glm_moe_dsa", "deepseek_v4"))


@pytest.mark.parametrize("family", KV_FAMILIES)
def test_kv_estimate_is_what_the_kv_cache_allocates(family):
    """kv_token_bytes against the KVCache a forward really fills: rows x tokens x per token (K / V, MLA latents)
    plus the rows' fixed linear-attention states, to the byte."""
    from ktinject.decode import kv_cache

    if missing_reason(family):
        pytest.skip(missing_reason(family))
    model = build_tiny_model(family, dtype=torch.bfloat16)
    ktinject.inject(model, gpu="cpu", gpu_experts_budget=0)
    per_token, per_row = gpu_budget.kv_token_bytes(model)
    rows, length = 3, 16
    cache = kv_cache.new(model.config, rows, length, "cpu")
    with torch.no_grad():
        kv_cache.forward(model, cache.rows(0, 1), tiny_prompts(1, 4, seed=2))
    kv = [t for layer in cache.layers if getattr(layer, "is_initialized", False) and hasattr(layer, "keys")
          for t in (layer.keys, layer.values)]
    linear = cache.linear.tensors() if getattr(cache, "linear", None) is not None else []
    allocated = sum(t.numel() * t.element_size() for t in (*kv, *linear))
    assert allocated == rows * (length * per_token + per_row)


def test_ring_estimate_is_what_streamed_prefill_allocates():
    """The ring the budget reserves equals the ring + scratch the streamer sets up for a whole layer."""
    from ktinject.gpu_experts.prefill.streamer import PrefillStreamer, blocks_of

    for quant in ("bf16", "int8", "int4"):
        model = build_tiny_model("qwen3_moe", dtype=torch.bfloat16)
        plan = ktinject.inject(model, gpu="cpu", quant=quant, prefill="cpu", gpu_experts_budget=0)
        streamer = PrefillStreamer(blocks_of(model), "gpu")
        streamer.setup()
        assert streamer.experts.cap == blocks_of(model)[0].num_experts  # a whole layer a slot off CUDA
        shape = gpu_budget.model_shape(model, plan, prefill="gpu")
        assert shape.ring == streamer.experts.ring.nbytes + streamer.experts.nbytes_scratch, quant
        assert gpu_budget.model_shape(model, plan, prefill="cpu").ring == 0
        streamer.close()


def test_model_shape_counts_the_plans_dense_bytes_and_the_banks():
    from ktinject.gpu_experts.hot.bank import HotExperts
    from ktinject.gpu_experts.hot.stats import hybrid_blocks

    model = build_tiny_model("qwen3_moe", dtype=torch.bfloat16)
    plan = ktinject.inject(model, gpu="cpu", gpu_experts_budget=0)
    shape = gpu_budget.model_shape(model, plan)
    blocks = [b for _, b in hybrid_blocks(model)]
    assert shape.dense == plan.bytes_per_device()["cpu"]
    assert (shape.experts, shape.layers) == (sum(b.num_experts for b in blocks), len(blocks))
    assert shape.expert == HotExperts.expert_nbytes(blocks[0].spec, torch.bfloat16)
    assert shape.all_experts() == sum(b.num_experts * shape.expert + HotExperts.table_nbytes(b.num_experts)
                                      for b in blocks)
    assert gpu_budget.default_context(model) == min(4096, model.config.max_position_embeddings)


# ---------------------------------------------------------------------------------------------- the command line


def test_cli_gpu_memory_errors_and_options(capsys):
    import argparse

    from ktinject.cli import chat, options
    from ktinject.cli import serve as serve_cli

    with pytest.raises(SystemExit) as e:
        chat.parse_args(["--gpu-memory", "lots"])
    assert e.value.code == 2 and "argument --gpu-memory: byte size 'lots'" in capsys.readouterr().err
    assert chat.main(["--gpu-memory", "8GiB", "--gpu", "cpu", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "ktinject.chat: error: --gpu-memory: the dense part runs on cpu (no CUDA device)" in err
    args = serve_cli.build_parser().parse_args(["--gpu-memory", "24GiB", "--max-batch", "4", "--max-context", "8192",
                                                "--gpu-experts-budget", "0.5", "--prefix-cache-gpu", "1GiB"])
    assert options.hot_options(args) == dict(gpu_experts_budget="0.5", placement=None, stats=None,
                                             rebalance_every=None, gpu_memory=24 * GiB, max_batch=4,
                                             max_context=8192, gpu_reserve=GiB)
    args = chat.parse_args(["--prefix-cache", "off"])  # the chat: generate's cache, the rules' budget or auto
    assert options.gpu_budget_options(args) == {}
    options.check_gpu_memory(argparse.Namespace(gpu_memory=None), "cpu")  # no cap: nothing to check
