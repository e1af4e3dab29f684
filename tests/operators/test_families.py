"""Every supported MoE family, end to end: injected bf16 vs HF's own bf16, both vs float32.

The injected models run with gpu="cpu" by default; KTINJECT_TEST_GPU=cuda runs them with gpu="cuda" (the GPU
machine: benchmarks/run_gpu_machine.sh families-cuda); TRUTH and YARDSTICK stay on the CPU either way.

Per family, one tiny random model (ktinject.tiny_models) in three forms with the same weights:
  TRUTH     HF float32 with the same (bf16-rounded) weights;
  YARDSTICK HF bf16 (what a user gets without ktinject);
  INJECTED  HF bf16 + inject(gpu="cpu"): routed experts in native kernels (and int8, int4 variants).
Injected must be no worse than the yardstick (within the stated slack) against the truth.

Legend: B batch, S sequence, T tokens, E experts, H hidden, V vocabulary.
"""
from __future__ import annotations

import logging
import math

import pytest
import torch
import transformers

from ktinject import envs
from ktinject.tiny_models import ALL_FAMILIES, build_tiny_model, missing_reason, tiny_prompts

log = logging.getLogger(__name__)

DEVICE = torch.device(envs.get("KTINJECT_TEST_GPU"))  # the injected models' gpu device
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("KTINJECT_TEST_GPU=cuda but CUDA is not available", allow_module_level=True)

PROMPTS = tiny_prompts(8, 64, seed=1)  # [8, 64]: 512 positions for the block comparisons
ARGMAX_PROMPTS = tiny_prompts(32, 64, seed=1)  # [32, 64]: 2048 teacher-forced positions
GEN_PROMPTS = tiny_prompts(2, 8, seed=2)  # [2, 8]
NEW_TOKENS = 16
BLOCK_SLACK = 1.5  # (a): injected block error <= 1.5 x HF-bf16 block error
# (a), tokens the bf16 router sends to float32's experts: native accumulates in f32 and rounds fewer times than HF
# bf16 (measured 0.73-0.95 x), so 1.2 x leaves room for other kernels (AMX) without hiding a real defect.
SAME_ROUTING_SLACK = 1.2
# (e): mean KL(bf16-injected || int8-injected) over next-token distributions, nats. W8A8 with per-channel weight
# and per-token activation scales rounds to ~2^-8 relative (bf16: 2^-9), so int8 moves the distribution a few
# times more than bf16 itself does; the bound is 0.02 nats (measured on these models: see test output).
INT8_KL_BOUND = 0.02
# (e) int4 (group-wise, G = 64: a float scale per 64 weights, step |m| / 8 with m the group's largest value, ~9x
# int8's per-channel step): KL grows with the square of the logit noise; measured 6e-3 (deepseek_v2) to 0.14
# (gpt_oss) nats, 8-40x int8's on the same model, and the same as HF float32 with fake-quantized int4 expert weights
# (gpt_oss 0.137, qwen3_moe 0.014, deepseek_v3 0.049 nats): the quantization's own error, not the kernels'. A wrong
# scale, group or nibble order gives KL of order 1 nats or more, so the bound is 0.25 nats.
INT4_KL_BOUND = 0.25
# (d): logits are bf16 (one ulp is 1/32 at magnitude 4..8): a batched run may pick the other token of a top-2 pair
# closer than two ulps; anything farther apart must not change.
TIE_MARGIN = 1 / 16
# (d) families whose unmodified HF model gives a left-padded row other logits than the row alone (float32, same
# weights): the DSA indexer's top-k over a padded row's keys selects otherwise once a row holds more keys than
# index_topk; DeepSeek-V4's compressors pool the padding tokens into their windows and entries (no padding mask
# there). The batched-vs-alone comparison would measure HF's behaviour, not ktinject's; test_hf_left_padding_differs
# keeps the claim checked.
HF_LEFT_PADDING_DIFFERS = {"deepseek_v32", "glm_moe_dsa", "deepseek_v4"}
# families whose unmodified HF model does not run in bf16 before a transformers release (the yardstick here):
# DeepSeek-V4's float32 norms return float32 into its bf16 projections up to 5.19 (5.20.2 casts back). Its injected
# model runs there (ktinject's fused norms cast back); tests/operators/test_deepseek_v4.py checks it in float32.
HF_BF16_FROM = {"deepseek_v4": "5.20"}


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of a against ref (both in float32)."""
    a, ref = a.float(), ref.float()
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class Models:
    def __init__(self, family: str):
        from ktinject import inject

        self.family = family
        # the yardstick's own (bf16-rounded) weights in float32: the exact computation both bf16 models approximate
        self.truth = build_tiny_model(family, seed=0, dtype=torch.bfloat16).float()
        self.yard = build_tiny_model(family, seed=0, dtype=torch.bfloat16)
        self.inj = build_tiny_model(family, seed=0, dtype=torch.bfloat16)
        self.hf_experts = {n: m.experts.gate_up_proj for n, m in self.inj.named_modules() if hasattr(m, "experts")}
        self.plan = inject(self.inj, gpu=str(DEVICE), gpu_experts_budget=0)
        self.inj8 = build_tiny_model(family, seed=0, dtype=torch.bfloat16)
        self.plan8 = inject(self.inj8, gpu=str(DEVICE), quant="int8", gpu_experts_budget=0)
        self.inj4 = build_tiny_model(family, seed=0, dtype=torch.bfloat16)
        inject(self.inj4, gpu=str(DEVICE), quant="int4", gpu_experts_budget=0)
        self.moe_names = [e.name for e in self.plan.operator_entries() if e.operator == "moe"]


@pytest.fixture(scope="module", params=ALL_FAMILIES)  # FAMILIES and MORE_FAMILIES (only these tests run the latter)
def models(request) -> Models:
    why = missing_reason(request.param) or _hf_bf16_missing(request.param)
    if why:
        pytest.skip(why)
    return Models(request.param)


def _hf_bf16_missing(family: str) -> str | None:
    from packaging.version import Version

    need = HF_BF16_FROM.get(family)
    if need and Version(transformers.__version__) < Version(need):
        return f"{family}: HF's own bf16 model (the yardstick) needs transformers >= {need}"
    return None


def device_of(model) -> torch.device:
    return model.get_input_embeddings().weight.device


@torch.no_grad()
def logits(model, ids: torch.Tensor, **kw) -> torch.Tensor:
    """[B, S, V] float32 logits on the CPU, inputs moved to the model's device."""
    dev = device_of(model)
    kw = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    return model(input_ids=ids.to(dev), **kw).logits.float().cpu()


@torch.no_grad()
def test_moe_blocks_no_worse_than_hf_bf16(models):
    """(a) Each MoE block, on the inputs the injected model fed it: error vs float32 <= 1.5 x HF-bf16's."""
    captured: dict[str, tuple[torch.Tensor, torch.Tensor, dict]] = {}

    def hook(name):
        def fn(module, args, kwargs, out):  # kwargs: DeepSeek-V4's decoder layer passes its block input_ids
            out = out[0] if isinstance(out, tuple) else out
            kw = {k: v.detach().cpu() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
            captured[name] = (args[0].detach().cpu().clone(), out.detach().cpu().clone(), kw)
        return fn

    handles = [models.inj.get_submodule(n).register_forward_hook(hook(n), with_kwargs=True) for n in models.moe_names]
    try:
        logits(models.inj, PROMPTS)
    finally:
        for h in handles:
            h.remove()
    assert set(captured) == set(models.moe_names)
    for name, (x, out_inj, kw) in captured.items():
        truth_block, yard_block = models.truth.get_submodule(name), models.yard.get_submodule(name)
        first = lambda o: o[0] if isinstance(o, tuple) else o  # gpt-oss returns (hidden, router_scores)
        out_truth = first(truth_block(x.float(), **kw))
        out_yard = first(yard_block(x, **kw))
        assert out_inj.shape == out_truth.shape and out_inj.dtype == x.dtype
        out_inj, out_truth, out_yard = (o.view(x.shape) for o in (out_inj, out_truth, out_yard))  # Llama 4: [T, H]
        e_inj, e_yard = rel_err(out_inj, out_truth), rel_err(out_yard, out_truth)
        same = _same_routing(truth_block, yard_block, models.inj.get_submodule(name), x, kw.get("input_ids"))
        s_inj, s_yard = rel_err(out_inj[same], out_truth[same]), rel_err(out_yard[same], out_truth[same])
        log.info("%s %s: block error injected %.2e, HF bf16 %.2e; on the %d%% of tokens routed as in float32: "
                 "%.2e vs %.2e", models.family, name, e_inj, e_yard, 100 * same.float().mean(), s_inj, s_yard)
        assert e_inj <= BLOCK_SLACK * e_yard, f"{name}: injected {e_inj:.3e} > {BLOCK_SLACK} x HF bf16 {e_yard:.3e}"
        assert s_inj <= SAME_ROUTING_SLACK * s_yard, f"{name}: same routing: {s_inj:.3e} > {s_yard:.3e}"


def _same_routing(truth_block, yard_block, inj_block, x: torch.Tensor, input_ids=None) -> torch.Tensor:
    """[B, S] bool: both bf16 models chose the float32 model's expert set for that token (``input_ids``: the token
    ids, which DeepSeek-V4's hash routers choose by).

    Where a model's router picked other experts than float32 (a near-tie resolved the other way: HF's bf16 router
    and the injected float32 router on bf16-rounded weights each flip a few tokens, not the same ones), its error
    is the routing flip's, not the experts'."""
    spec = inj_block.spec
    x2 = x.reshape(-1, x.shape[-1])  # [T, H]

    def hf_ids(block, h):  # the router's own call: MiniMax-M2's takes the block's e_score_correction_bias too
        router = getattr(block, spec.router)
        if spec.weights_input:  # Llama 4's returns (scores, logits): its experts are the logits' top k
            return torch.topk(router(h)[1], router.top_k, dim=1).indices.sort(-1).values
        if spec.token_routed:  # DeepSeek-V4's hash layers: chosen by token id
            return router(h, input_ids)[2].sort(-1).values
        return router(h, *(getattr(block, a) for a in spec.router_args))[2].sort(-1).values

    ids_truth, ids_yard = hf_ids(truth_block, x2.float()), hf_ids(yard_block, x2)
    dev = device_of_module(inj_block)
    ids_inj = inj_block.routing(x2.to(dev), input_ids=input_ids)[1].cpu().sort(-1).values
    return ((ids_truth == ids_yard).all(-1) & (ids_truth == ids_inj).all(-1)).view(x.shape[:-1])


def device_of_module(module) -> torch.device:
    return next(module.parameters()).device


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(p || q) of next-token distributions [..., V] -> [...] (nats)."""
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


@torch.no_grad()
def test_teacher_forced_argmax(models):
    """(b) Teacher-forced argmax agreement with float32, 2048 positions: no worse than HF-bf16's, within a sign test.

    Both bf16 models disagree with float32 mostly at the same positions (near-ties of the truth's top logits, and
    tokens whose experts flip after bf16 error upstream), plus a few each of their own ("discordant"). Which ones is
    chaotic: over 3 prompt sets x 8 families (2048 positions each, measured 2026-11-22) the injected model (float32
    router, float32-accumulated experts) agreed at more positions than HF bf16 in 19 of 24 cases, as many in 1 and
    at fewer in 4 (by 2 to 14); +94 positions in total. So the criterion is statistical: the injected model's own
    discordant positions may exceed HF's by at most two standard deviations of a fair coin over the discordant
    positions, 2*sqrt(discordant); a real defect (wrong expert, weight or scale) shows as tens of positions and in
    the median KL, which ignores the rare flips and must be no worse than HF bf16's (10% margin)."""
    ref = logits(models.truth, ARGMAX_PROMPTS)
    inj, yard = logits(models.inj, ARGMAX_PROMPTS), logits(models.yard, ARGMAX_PROMPTS)
    wrong_inj, wrong_yard = inj.argmax(-1) != ref.argmax(-1), yard.argmax(-1) != ref.argmax(-1)
    only_inj, only_yard = (wrong_inj & ~wrong_yard).sum().item(), (wrong_yard & ~wrong_inj).sum().item()
    kl_inj, kl_yard = _kl(ref, inj).median().item(), _kl(ref, yard).median().item()
    n = ref.shape[0] * ref.shape[1]
    log.info("%s argmax agreement: injected %d/%d, HF bf16 %d/%d (discordant %d vs %d); median KL %.2e vs %.2e",
             models.family, n - wrong_inj.sum().item(), n, n - wrong_yard.sum().item(), n, only_inj, only_yard,
             kl_inj, kl_yard)
    assert only_inj <= only_yard + 2 * math.sqrt(only_inj + only_yard)
    assert kl_inj <= 1.1 * kl_yard


def _greedy(model, prompts: torch.Tensor) -> torch.Tensor:
    prompts = prompts.to(device_of(model))
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0).cpu()
    assert out.shape == (prompts.shape[0], prompts.shape[1] + NEW_TOKENS)
    return out


def _in_truth_top2(truth, seq: torch.Tensor, prompt_len: int) -> int:
    """How many generated tokens of seq [B, S] are in the truth's top-2 at their step (teacher-forced)."""
    top2 = logits(truth, seq).topk(2, dim=-1).indices  # [B, S, 2]
    pred = top2[:, prompt_len - 1:-1]  # predictions for positions prompt_len .. S-1
    gen = seq[:, prompt_len:, None]
    return (pred == gen).any(-1).sum().item()


def test_greedy_generate_in_truth_top2(models):
    """(c) Greedy generation of 16 tokens: tokens in float32's top-2 at least as often as HF-bf16's own."""
    n = GEN_PROMPTS.shape[1]
    hits_inj = _in_truth_top2(models.truth, _greedy(models.inj, GEN_PROMPTS), n)
    hits_yard = _in_truth_top2(models.truth, _greedy(models.yard, GEN_PROMPTS), n)
    log.info("%s greedy tokens in truth top-2: injected %d, HF bf16 %d of %d", models.family, hits_inj, hits_yard,
             GEN_PROMPTS.shape[0] * NEW_TOKENS)
    assert_misses_no_worse(GEN_PROMPTS.shape[0] * NEW_TOKENS, hits_inj, hits_yard)


def assert_misses_no_worse(n: int, hits_inj: int, hits_yard: int) -> None:
    """Generated tokens outside the truth's top-2: the injected model's misses no more than HF bf16's, within two
    standard deviations of a fair coin over all misses (as in (b): a miss needs the truth's 3rd logit near its top
    two, and which bf16 model lands on such a near-tie is chaotic: on the GPU machine deepseek_v3's left-padded batch
    missed 1 of 32 against HF's 0, on CPU both 0). All hits is the measured outcome for every family on the CPU."""
    miss_inj, miss_yard = n - hits_inj, n - hits_yard
    assert miss_inj <= miss_yard + 2 * math.sqrt(miss_inj + miss_yard), (miss_inj, miss_yard)


@torch.no_grad()
def test_left_padded_batch_matches_single(models):
    """(d) Two prompts of different lengths, left-padded in one batch: greedy generation of the batch keeps its tokens
    in float32's top-2 at least as often as HF-bf16's batch does, and the batch's teacher-forced logits equal each
    row run alone within bf16 tolerance at the median position (a batch runs other GEMM shapes than a single row, so
    on CUDA a near-tied expert can flip at a position or two; the worst position is logged)."""
    a, b = tiny_prompts(1, 7, seed=3)[0], tiny_prompts(1, 12, seed=4)[0]
    P = max(len(a), len(b))
    prompts = torch.zeros(2, P, dtype=torch.long)
    pmask = torch.zeros(2, P, dtype=torch.long)
    for row, s in enumerate((a, b)):
        prompts[row, P - len(s):], pmask[row, P - len(s):] = s, 1

    def padded_greedy(model) -> int:
        dev = device_of(model)
        out = model.generate(prompts.to(dev), attention_mask=pmask.to(dev), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0).cpu()
        return sum(_in_truth_top2(models.truth, torch.cat([s, out[row, P:]])[None], len(s))
                   for row, s in enumerate((a, b)))

    hits_inj, hits_yard = padded_greedy(models.inj), padded_greedy(models.yard)
    log.info("%s left-padded batch, greedy tokens in truth top-2: injected %d, HF bf16 %d of %d", models.family,
             hits_inj, hits_yard, 2 * NEW_TOKENS)
    assert_misses_no_worse(2 * NEW_TOKENS, hits_inj, hits_yard)
    if models.family in HF_LEFT_PADDING_DIFFERS:
        pytest.skip(f"{models.family}: HF's own model gives a left-padded row other logits than the row alone")

    singles = [_greedy(models.inj, p[None])[0] for p in (a, b)]  # full sequences [S_i]
    S = max(len(s) for s in singles)
    ids = torch.zeros(2, S, dtype=torch.long)
    mask = torch.zeros(2, S, dtype=torch.long)
    for row, s in enumerate(singles):
        ids[row, S - len(s):], mask[row, S - len(s):] = s, 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    batch = logits(models.inj, ids, attention_mask=mask, position_ids=pos)
    for row, s in enumerate(singles):
        alone = logits(models.inj, s[None])[0]
        got = batch[row, S - len(s):]
        per_pos = (got - alone).norm(dim=-1) / alone.norm(dim=-1)  # [S_i]
        log.info("%s row %d: batched vs alone logits error, median position %.2e, worst %.2e", models.family, row,
                 per_pos.median(), per_pos.max())
        assert per_pos.median() < 2e-2, f"row {row}: left-padded batch differs from the single run ({per_pos})"
    dev = device_of(models.inj)
    gen = models.inj.generate(ids[:, :S - NEW_TOKENS].to(dev), attention_mask=mask[:, :S - NEW_TOKENS].to(dev),
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0).cpu()
    for row, s in enumerate(singles):  # tokens equal up to a step where the single run's top-2 (nearly) tie
        alone = logits(models.inj, s[None])[0]  # [S_i, V]
        top2 = alone.topk(2, dim=-1).values
        for step in range(NEW_TOKENS):
            if gen[row, S - NEW_TOKENS + step] != s[len(s) - NEW_TOKENS + step]:
                pos = len(s) - NEW_TOKENS + step - 1  # the position that predicted this token
                margin = (top2[pos, 0] - top2[pos, 1]).item()
                log.info("%s row %d: batched generate diverges at step %d (top-2 margin %.3f)", models.family, row,
                         step, margin)
                assert margin <= TIE_MARGIN, f"row {row} step {step}: batched token differs at margin {margin:.3f}"
                break


@torch.no_grad()
@pytest.mark.parametrize("family", sorted(HF_LEFT_PADDING_DIFFERS))
def test_hf_left_padding_differs(family):
    """The reason (d) stops early for these families: HF float32 itself, left-padded, differs from the row alone."""
    if missing_reason(family):
        pytest.skip(missing_reason(family))
    model = build_tiny_model(family, seed=0)
    a, b = tiny_prompts(1, 20, seed=3)[0], tiny_prompts(1, 25, seed=4)[0]
    ids, mask = torch.stack([torch.cat([torch.zeros(5, dtype=torch.long), a]), b]), torch.ones(2, 25, dtype=torch.long)
    mask[0, :5] = 0
    batch = logits(model, ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))[0, 5:]
    alone = logits(model, a[None])[0]
    gap = float(((batch - alone).norm(dim=-1) / alone.norm(dim=-1)).max())
    if gap <= 0.1:
        pytest.skip(f"transformers {transformers.__version__}: a left-padded row matches the row alone here "
                    f"(gap {gap:.2e}); (d) still stops early for {family}")
    assert gap > 0.1


@torch.no_grad()
def test_int8_experts_kl(models):
    """(e) int8 experts: mean KL(bf16-injected || int8-injected) of next-token distributions < INT8_KL_BOUND."""
    lp16 = torch.log_softmax(logits(models.inj, PROMPTS), -1)
    lp8 = torch.log_softmax(logits(models.inj8, PROMPTS), -1)
    kl = (lp16.exp() * (lp16 - lp8)).sum(-1).mean().item()
    lpt = torch.log_softmax(logits(models.truth, PROMPTS), -1)
    lpy = torch.log_softmax(logits(models.yard, PROMPTS), -1)
    kl_bf16 = (lpt.exp() * (lpt - lpy)).sum(-1).mean().item()
    log.info("%s KL(bf16 inj || int8 inj) %.2e nats; for scale KL(f32 || HF bf16) %.2e", models.family, kl, kl_bf16)
    assert kl < INT8_KL_BOUND


@torch.no_grad()
def test_int4_experts_kl(models):
    """(e) int4 experts: mean KL(bf16-injected || int4-injected) of next-token distributions < INT4_KL_BOUND."""
    lp16 = torch.log_softmax(logits(models.inj, PROMPTS), -1)
    lp4 = torch.log_softmax(logits(models.inj4, PROMPTS), -1)
    kl = (lp16.exp() * (lp16 - lp4)).sum(-1).mean().item()
    log.info("%s KL(bf16 inj || int4 inj) %.2e nats", models.family, kl)
    assert kl < INT4_KL_BOUND


def test_int4_groups_of_128_kl(models, monkeypatch):
    """(e) at the groups the real models get by default (128; these tiny sizes default to 64, so forced here, padding
    the inputs to 128): the same bound, and the blocks hold that group. The plumbing through every family: at inputs
    of 32-80 one group covers a row either way, so the groups' arithmetic is checked in test_int4 (G = 32, 64, 128 on
    rows of up to 2048 inputs against the reference)."""
    from ktinject import inject

    monkeypatch.setenv("KTINJECT_INT4_GROUP", "128")
    model = build_tiny_model(models.family, seed=0, dtype=torch.bfloat16)
    inject(model, gpu=str(DEVICE), quant="int4", gpu_experts_budget=0)
    assert {model.get_submodule(n).native_experts.group_size for n in models.moe_names} == {128}
    lp16 = torch.log_softmax(logits(models.inj, PROMPTS), -1)
    lp4 = torch.log_softmax(logits(model, PROMPTS), -1)
    kl = (lp16.exp() * (lp16 - lp4)).sum(-1).mean().item()
    log.info("%s KL(bf16 inj || int4 g128 inj) %.2e nats", models.family, kl)
    assert kl < INT4_KL_BOUND


def test_one_resident_copy(models):
    """(f) After inject: no HF expert tensors left (freed, not just unlinked); native holds the packed size."""
    from ktinject.operators.base import tensor_bytes
    from ktinject.operators.expert_lora import ExpertSlots
    from ktinject.operators.families import packed_nbytes
    from ktinject.operators.moe import HybridMoE
    from ktinject.operators.routing import router_f32_extra

    assert models.moe_names
    for name, old in models.hf_experts.items():
        assert old.numel() == 0, f"{name}: the HF gate_up_proj still holds {old.numel()} elements"
    for model, quant in ((models.inj, "bf16"), (models.inj8, "int8"), (models.inj4, "int4")):
        for name in models.moe_names:
            block = model.get_submodule(name)
            assert isinstance(block, HybridMoE)
            assert isinstance(block.experts, ExpertSlots) and not list(block.experts.parameters())  # LoRA stand-ins
            assert all(t.dim() < 3 for t in block.state_dict().values()), "a 3-D (expert) tensor is left"
            hf_block = models.yard.get_submodule(name)
            router_extra = router_f32_extra(getattr(hf_block, block.spec.router))  # the router runs in float32
            assert tensor_bytes(block) == tensor_bytes(hf_block) - tensor_bytes(hf_block.experts) + router_extra
            assert block.native_experts.nbytes == packed_nbytes(block.spec, quant)  # what the plan counted
            weights = 3 * block.num_experts * block.hidden_size * block.intermediate_size
            assert block.native_experts.nbytes >= weights * {"bf16": 2, "int8": 1, "int4": 0.5}[quant]  # padded
            assert block.quant == quant


def test_state_dict_keys_kept(models):
    """Router and shared experts keep HF's names: the state dict is HF's minus the routed experts."""
    hf = {k for k in models.yard.state_dict() if ".experts." not in k}
    assert set(models.inj.state_dict()) == hf


@torch.no_grad()
def test_routing_weights_dtype(models):
    block = models.inj.get_submodule(models.moe_names[0])
    x = torch.randn(5, block.hidden_size, dtype=torch.bfloat16, device=device_of(models.inj))
    token_ids = tiny_prompts(1, 5, seed=7)[0].to(x.device)  # read by token-routed (hash) layers only
    weights, ids = block.routing(x, input_ids=token_ids)
    assert ids.dtype == torch.int64 and ids.shape == weights.shape == (5, block.top_k)
    assert block.top_k == models.inj.config.get_text_config().num_experts_per_tok  # (a wrapper's: its text model's)
    assert weights.dtype == torch.float32  # the injected router runs in float32 for every family (moe.py)
