"""Every supported MoE family, end to end on the CPU (gpu="cpu"): injected bf16 vs HF's own bf16, both vs float32.

Per family, one tiny random model (ktinject.testing) in three forms with the same weights:
  TRUTH     HF float32;
  YARDSTICK HF bf16 (what a user gets without ktinject);
  INJECTED  HF bf16 + inject(gpu="cpu"): routed experts in native kernels (and an int8 variant).
Injected must be no worse than the yardstick (within the stated slack) against the truth.

Legend: B batch, S sequence, T tokens, E experts, H hidden, V vocabulary.
"""
from __future__ import annotations

import logging

import pytest
import torch

from ktinject.testing import FAMILIES, build_tiny_model, tiny_prompts

log = logging.getLogger(__name__)

PROMPTS = tiny_prompts(4, 32, seed=1)  # [4, 32]: 128 teacher-forced positions
GEN_PROMPTS = tiny_prompts(2, 8, seed=2)  # [2, 8]
NEW_TOKENS = 16
BLOCK_SLACK = 1.5  # (a): injected block error <= 1.5 x HF-bf16 block error
# (e): mean KL(bf16-injected || int8-injected) over next-token distributions, nats. W8A8 with per-channel weight
# and per-token activation scales rounds to ~2^-8 relative (bf16: 2^-9), so int8 moves the distribution a few
# times more than bf16 itself does; the bound is 0.02 nats (measured on these models: see test output).
INT8_KL_BOUND = 0.02


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of a against ref (both in float32)."""
    a, ref = a.float(), ref.float()
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class Models:
    def __init__(self, family: str):
        from ktinject import inject

        self.family = family
        self.truth = build_tiny_model(family, seed=0, dtype=torch.float32)
        self.yard = build_tiny_model(family, seed=0, dtype=torch.bfloat16)
        self.inj = build_tiny_model(family, seed=0, dtype=torch.bfloat16)
        self.hf_experts = {n: m.experts.gate_up_proj for n, m in self.inj.named_modules() if hasattr(m, "experts")}
        self.plan = inject(self.inj, gpu="cpu")
        self.inj8 = build_tiny_model(family, seed=0, dtype=torch.bfloat16)
        self.plan8 = inject(self.inj8, gpu="cpu", quant="int8")
        self.moe_names = [e.name for e in self.plan.operator_entries() if e.operator == "moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def models(request) -> Models:
    return Models(request.param)


@torch.no_grad()
def logits(model, ids: torch.Tensor, **kw) -> torch.Tensor:
    return model(input_ids=ids, **kw).logits.float()  # [B, S, V]


@torch.no_grad()
def test_moe_blocks_no_worse_than_hf_bf16(models):
    """(a) Each MoE block, on the inputs the injected model fed it: error vs float32 <= 1.5 x HF-bf16's."""
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name):
        def fn(module, args, out):
            out = out[0] if isinstance(out, tuple) else out
            captured[name] = (args[0].detach().clone(), out.detach().clone())
        return fn

    handles = [models.inj.get_submodule(n).register_forward_hook(hook(n)) for n in models.moe_names]
    try:
        logits(models.inj, PROMPTS)
    finally:
        for h in handles:
            h.remove()
    assert set(captured) == set(models.moe_names)
    for name, (x, out_inj) in captured.items():
        first = lambda o: o[0] if isinstance(o, tuple) else o  # gpt-oss returns (hidden, router_scores)
        out_truth = first(models.truth.get_submodule(name)(x.float()))
        out_yard = first(models.yard.get_submodule(name)(x))
        assert out_inj.shape == out_truth.shape and out_inj.dtype == x.dtype
        e_inj, e_yard = rel_err(out_inj, out_truth), rel_err(out_yard, out_truth)
        log.info("%s %s: block error injected %.2e, HF bf16 %.2e", models.family, name, e_inj, e_yard)
        assert e_inj <= BLOCK_SLACK * e_yard, f"{name}: injected {e_inj:.3e} > {BLOCK_SLACK} x HF bf16 {e_yard:.3e}"


@torch.no_grad()
def test_teacher_forced_argmax(models):
    """(b) Teacher-forced argmax agreement with float32: at least HF-bf16's, less one position of 128.

    The slack of one position: where the float32 top-2 logits nearly tie, any bf16 rounding (HF's or ours, which
    differ in accumulation order) can pick either; one such position in 128 is chance, not a defect."""
    ref = logits(models.truth, PROMPTS).argmax(-1)
    agree_inj = (logits(models.inj, PROMPTS).argmax(-1) == ref).sum().item()
    agree_yard = (logits(models.yard, PROMPTS).argmax(-1) == ref).sum().item()
    log.info("%s argmax agreement: injected %d/%d, HF bf16 %d/%d", models.family, agree_inj, ref.numel(),
             agree_yard, ref.numel())
    assert agree_inj >= agree_yard - 1


def _greedy(model, prompts: torch.Tensor) -> torch.Tensor:
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
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
    assert hits_inj >= hits_yard


@torch.no_grad()
def test_left_padded_batch_matches_single(models):
    """(d) Two prompts of different lengths, left-padded in one batch == each run alone (bf16 tolerance)."""
    a, b = tiny_prompts(1, 7, seed=3)[0], tiny_prompts(1, 12, seed=4)[0]
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
        err = rel_err(batch[row, S - len(s):], alone)
        log.info("%s row %d: batched vs alone logits error %.2e", models.family, row, err)
        assert err < 2e-2, f"row {row}: left-padded batch differs from the single run ({err:.3e})"
    gen = models.inj.generate(ids[:, :S - NEW_TOKENS], attention_mask=mask[:, :S - NEW_TOKENS],
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    same = (gen[:, -NEW_TOKENS:] == ids[:, -NEW_TOKENS:]).float().mean().item()
    log.info("%s batched generate: %.0f%% of tokens as generated alone", models.family, 100 * same)
    assert gen[:, S - NEW_TOKENS].tolist() == ids[:, S - NEW_TOKENS].tolist(), "first generated token differs"


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


def test_one_resident_copy(models):
    """(f) After inject: no HF expert tensors left (freed, not just unlinked); native holds the packed size."""
    from ktinject.operators.base import tensor_bytes
    from ktinject.operators.families import packed_nbytes
    from ktinject.operators.moe import HybridMoE

    assert models.moe_names
    for name, old in models.hf_experts.items():
        assert old.numel() == 0, f"{name}: the HF gate_up_proj still holds {old.numel()} elements"
    for model, quant in ((models.inj, "bf16"), (models.inj8, "int8")):
        for name in models.moe_names:
            block = model.get_submodule(name)
            assert isinstance(block, HybridMoE)
            assert not hasattr(block, "experts")
            assert all(t.dim() < 3 for t in block.state_dict().values()), "a 3-D (expert) tensor is left"
            hf_block = models.yard.get_submodule(name)
            assert tensor_bytes(block) == tensor_bytes(hf_block) - tensor_bytes(hf_block.experts)
            assert block.native_experts.nbytes == packed_nbytes(block.spec, quant)
            assert block.quant == quant


def test_state_dict_keys_kept(models):
    """Router and shared experts keep HF's names: the state dict is HF's minus the routed experts."""
    hf = {k for k in models.yard.state_dict() if ".experts." not in k}
    assert set(models.inj.state_dict()) == hf
