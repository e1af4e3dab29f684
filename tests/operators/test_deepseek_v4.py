"""DeepSeek-V4 injected, in float32, against the unmodified HF model with the same weights.

The tiny model (ktinject.tiny_models) has both kinds of MoE layer: two hash-routed ones (experts from the frozen
``tid2eid[input_ids]`` table, the router's sqrtsoftplus scores weighting them) then two top-k ones (scores plus a
correction bias choose), routed and shared experts with a clamped SwiGLU whose limit some activations pass, sizes
that are not multiples of 16 (hidden 72, expert intermediate 40), sliding and compressed attention layers.
tests/operators/test_families.py runs the family in bf16 beside the others; here the reference is HF float32 with
the routed experts' weights rounded to bf16, which is what native bf16 experts hold, so what is left between the
two is the native experts' bf16 activations (2^-9 relative) and float summation order. Those move a position past a
near-tie of a discrete choice now and then (a top-k router's experts, the CSA indexer's top entries), so the
unmodified HF model is compared at the median and 95% of positions; HF's experts rounding their input and gated
activation to bf16 as the native ones do (``_rounding_as_native``) leave summation order only, compared everywhere.
The injected model's dense part runs on KTINJECT_TEST_GPU (cpu by default; cuda on the GPU machine).

Legend: B batch, S sequence, T tokens, E experts, H hidden, V vocabulary.
"""
from __future__ import annotations

import pytest
import torch

from ktinject import envs
from ktinject.operators.base import OperatorError
from ktinject.tiny_models import build_tiny_model, missing_reason, tiny_prompts

FAMILY = "deepseek_v4"
if missing_reason(FAMILY):
    pytest.skip(missing_reason(FAMILY), allow_module_level=True)
DEVICE = torch.device(envs.get("KTINJECT_TEST_GPU"))  # the injected model's gpu device
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("KTINJECT_TEST_GPU=cuda but CUDA is not available", allow_module_level=True)
CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# per-position relative logits error, injected vs HF float32 on the same weights: the native experts' bf16
# activations move logits by ~2e-3; a wrong clamp, expert, weight or token id moves them by tenths (checked below)
LOGITS_BOUND = 1e-2
# the same against HF's experts with the native roundings: summation order only (float32: ~1e-6) at the median; at
# worst an activation whose float32 value sits at a bf16 rounding tie rounds the other way (~1e-3), and the
# compressed entries and hyper-connections carry that to later positions
ROUNDED_MEDIAN, ROUNDED_MAX = 1e-5, 2e-3
NEW_TOKENS = 12
TIE_MARGIN = 1e-2  # generation may part at a step whose top two logits are this close (float32 logits)


def _reference(**overrides):
    """HF float32 with the routed experts rounded to bf16 (native bf16 experts hold exactly these values)."""
    model = build_tiny_model(FAMILY, seed=0, **overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.copy_(p.bfloat16().float())
    return model


def _rounding_as_native(model):
    """HF's routed experts (their own forward) with their input and gated activation rounded to bf16, as native
    bf16 experts round them; everything else unmodified."""
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts.register_forward_pre_hook(lambda m, args: (args[0].bfloat16().float(), *args[1:]))
        gate = experts._apply_gate  # (the class's clamped SwiGLU, which every experts implementation calls)
        experts._apply_gate = lambda gate_up, gate=gate: gate(gate_up).bfloat16().float()
    return model


@pytest.fixture(scope="module")
def models():
    from ktinject import inject

    ref = _reference()
    inj = build_tiny_model(FAMILY, seed=0)
    plan = inject(inj, gpu=str(DEVICE), gpu_experts_budget=0)
    return ref, inj, plan


def _device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    """[B, S, V] float32 on the CPU."""
    with torch.no_grad():
        return model(input_ids=ids.to(_device(model))).logits.float().cpu()


def _per_position(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (a - ref).norm(dim=-1) / ref.norm(dim=-1)


def test_plan_has_hash_and_top_k_layers(models):
    """Every sparse block is a HybridMoE with the native clamped SwiGLU at the config's limit; the hash_moe layers'
    routers choose by token id, the moe layers' by score; decode is eager and the plan says why."""
    from ktinject.operators.moe import HybridMoE

    _, inj, plan = models
    config = inj.config
    blocks = {e.name: inj.get_submodule(e.name) for e in plan.operator_entries() if e.operator == "moe"}
    assert len(blocks) == config.num_hidden_layers
    for i, kind in enumerate(config.mlp_layer_types):
        block = blocks[f"model.layers.{i}.mlp"]
        assert isinstance(block, HybridMoE)
        assert block.spec.token_routed == (kind == "hash_moe")
        assert type(block.gate).__name__ == ("DeepseekV4HashRouter" if kind == "hash_moe" else "DeepseekV4TopKRouter")
        assert block.native_experts.activation == block.spec.activation == "swiglu_limit"
        assert block.native_experts.limit == pytest.approx(config.swiglu_limit)
    assert {"hash_moe", "moe"} <= set(config.mlp_layer_types)
    assert plan.eager_decode is not None and "DeepseekV4Attention" in plan.eager_decode


@pytest.mark.parametrize("shape", [(3, 37), (4, 1)])
def test_prefill_logits_equal_hf(models, shape):
    """Prefill logits against HF float32 on the same weights: prompts of 37 tokens (past the sliding window and
    several compressed windows) and of one token. Unmodified HF: within the bf16 activations' error at the median
    and at 90% of positions (the rest: a discrete choice parted at a near-tie); HF with the native roundings:
    summation order."""
    ref, inj, _ = models
    ids = tiny_prompts(*shape, seed=shape[1])
    got = _logits(inj, ids)
    err = _per_position(got, _logits(ref, ids))  # [B, S]
    assert err.median() < LOGITS_BOUND / 4 and (err < LOGITS_BOUND).float().mean() >= 0.9, err
    exact = _per_position(got, _logits(_rounding_as_native(_reference()), ids))
    assert exact.median() < ROUNDED_MEDIAN and exact.max() < ROUNDED_MAX, exact


def test_the_bound_sees_the_clamp(models):
    """The clamp matters at these sizes: HF without it (a limit no activation reaches) is far outside the bound."""
    ref, _, _ = models
    unclamped = _reference(swiglu_limit=1e4)
    ids = tiny_prompts(3, 37, seed=37)
    assert _per_position(_logits(unclamped, ids), _logits(ref, ids)).median() > 10 * LOGITS_BOUND


@pytest.mark.parametrize("length", [1, 9])
def test_greedy_generate_equals_hf(models, length):
    """Greedy generation (HF's generate and cache, eager decode steps through the injected blocks) gives HF's
    tokens, from a one-token prompt and a longer one, up to a step where HF's own top two (nearly) tie."""
    ref, inj, _ = models
    prompts = tiny_prompts(2, length, seed=40 + length)
    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    dev = _device(inj)
    with torch.no_grad():
        want = ref.generate(prompts, attention_mask=torch.ones_like(prompts), **kw)
        got = inj.generate(prompts.to(dev), attention_mask=torch.ones_like(prompts).to(dev), **kw).cpu()
    assert got.shape == want.shape == (2, length + NEW_TOKENS)
    for row in range(2):
        differ = (got[row] != want[row]).nonzero()
        if len(differ):
            step = int(differ[0])
            top2 = _logits(ref, want[row:row + 1, :step])[0, -1].topk(2).values
            assert (top2[0] - top2[1]).item() <= TIE_MARGIN, f"row {row} parts from HF at {step}: {got[row]}"


@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid"])  # the config's; HF has no softmax score_fn
def test_blocks_route_as_hf(models, scoring_func):
    """Each injected block's routing on the same input: hash layers pick exactly tid2eid[input_ids] and top-k
    layers HF's experts, both with HF's float32 weights; block outputs equal HF's within bf16 activations."""
    from ktinject import inject

    ref, inj, _ = models
    if scoring_func != ref.config.scoring_func:
        ref, inj = _reference(scoring_func=scoring_func), build_tiny_model(FAMILY, seed=0, scoring_func=scoring_func)
        inject(inj, gpu=str(DEVICE), gpu_experts_budget=0)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 11, inj.config.hidden_size, generator=g)
    ids = tiny_prompts(2, 11, seed=6)
    dev = _device(inj)
    for i, kind in enumerate(inj.config.mlp_layer_types):
        hf, ours = ref.model.layers[i].mlp, inj.model.layers[i].mlp
        assert type(hf.gate.score_fn).__name__ == type(ours.gate.score_fn).__name__
        w, e = (t.cpu() for t in ours.routing(x.reshape(-1, x.shape[-1]).to(dev), input_ids=ids.to(dev)))
        if kind == "hash_moe":
            _, w_hf, e_hf = hf.gate(x, ids)
            assert torch.equal(e, hf.gate.tid2eid[ids.reshape(-1)])
        else:
            _, w_hf, e_hf = hf.gate(x)
        order, order_hf = e.sort(-1), e_hf.sort(-1)
        assert torch.equal(order.values, order_hf.values)
        torch.testing.assert_close(w.gather(1, order.indices), w_hf.gather(1, order_hf.indices), rtol=1e-5,
                                   atol=1e-6)
        with torch.no_grad():
            out, out_hf = ours(x.to(dev), input_ids=ids.to(dev)).cpu(), hf(x, input_ids=ids)
        assert ((out - out_hf).norm() / out_hf.norm()).item() < 5e-3


def test_inputs_embeds_alone_refused_by_name(models):
    """A hash layer needs the token ids: inputs_embeds without input_ids is refused with what to pass (HF's own
    model fails inside its router on None)."""
    _, inj, _ = models
    embeds = inj.get_input_embeddings()(tiny_prompts(1, 4, seed=8).to(_device(inj)))
    with pytest.raises(OperatorError, match=r"routes this layer by token id .*call the model with input_ids"):
        with torch.no_grad():
            inj(inputs_embeds=embeds)


def test_token_ids_checked():
    from ktinject.operators.routing import token_ids

    assert torch.equal(token_ids(torch.arange(6).view(2, 3), 6, torch.device("cpu"), "B"), torch.arange(6))
    with pytest.raises(OperatorError, match=r"got input_ids \(2, 3\) .* for 5 tokens"):
        token_ids(torch.arange(6).view(2, 3), 5, torch.device("cpu"), "B")
    with pytest.raises(OperatorError, match=r"expected one integer token id per token"):
        token_ids(torch.zeros(5), 5, torch.device("cpu"), "B")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_hot_experts_take_the_clamp(device):
    """GPU-resident experts (the hot bank: on the CPU where a CPU-only run places it, and on CUDA) compute the same
    clamped SwiGLU as the native experts: every expert resident vs none, block by block, within bf16 rounding."""
    from ktinject import inject
    from ktinject.gpu_experts.hot import placement

    model = build_tiny_model(FAMILY, seed=0, dtype=torch.bfloat16)
    inject(model, gpu=device, gpu_experts_budget=0)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, 30, model.config.hidden_size, generator=g).bfloat16().to(device)
    ids = tiny_prompts(1, 30, seed=10).to(device)
    blocks = [layer.mlp for layer in model.model.layers]
    with torch.no_grad():
        native_out = [b(x, input_ids=ids).float() for b in blocks]
        placement.place(model, "1GiB", "uniform")
        assert all(b.hot is not None and bool(b.skip.all()) for b in blocks)
        hot_out = [b(x, input_ids=ids).float() for b in blocks]
    for a, b in zip(hot_out, native_out):
        assert ((a - b).norm() / b.norm()).item() < 1e-2
