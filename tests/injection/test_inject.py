"""inject(): placement mechanics, tied weights, the returned plan, errors, generate() afterwards; GPU checks."""
from __future__ import annotations

import copy

import pytest
import torch

from ktinject.tiny_models import build_tiny_model, tiny_prompts

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rules(tmp_path, text: str):
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    return str(path)


def test_returns_plan_and_marks_model():
    from ktinject import inject
    from ktinject.injection.plan import Plan

    model = build_tiny_model("qwen3_moe", dtype=torch.bfloat16)
    plan = inject(model, gpu="cpu")
    assert isinstance(plan, Plan)
    assert model._ktinject_plan is plan
    assert {e.operator for e in plan.operator_entries()} == {"moe", "attention", "rmsnorm"}
    assert "moe" in str(plan)
    assert model.generation_config.disable_compile  # HF's auto torch.compile cannot trace native calls


def test_second_inject_is_an_error():
    from ktinject import inject
    from ktinject.injection.inject import InjectError

    model = build_tiny_model("mixtral", dtype=torch.bfloat16)
    inject(model, gpu="cpu")
    with pytest.raises(InjectError, match="already injected"):
        inject(model, gpu="cpu")


def test_top_k_above_the_expert_count_is_named():
    """A config routing each token to more experts than the block has fails at inject, naming the keys, not at the
    first forward inside torch.topk."""
    from ktinject import inject
    from ktinject.operators.base import OperatorError

    from ktinject.tiny_models import tiny_config

    model = build_tiny_model("qwen3_moe", dtype=torch.bfloat16,
                             num_experts_per_tok=tiny_config("qwen3_moe").num_experts + 3)
    with pytest.raises(OperatorError, match=r"routes each token to top_k = \d+ experts but has \d+; check the "
                                            r"config's num_experts_per_tok"):
        inject(model, gpu="cpu")


def test_tensor_devices_honored(tmp_path):
    """Every tensor outside operators ends on the plan's device (meta stands in for a second device)."""
    from ktinject import inject

    model = build_tiny_model("qwen3_moe", dtype=torch.bfloat16)
    rules = _rules(tmp_path, "- match: {name: lm_head}\n  device: meta\n- include: qwen3_moe.yaml\n")
    plan = inject(model, rules, gpu="cpu")
    assert plan.tensor_devices["lm_head.weight"].type == "meta"
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, device in plan.tensor_devices.items():
        assert state[name].device == device, name
    assert model.lm_head.weight.device.type == "meta"
    assert model.model.embed_tokens.weight.device.type == "cpu"
    assert isinstance(model.lm_head.weight, torch.nn.Parameter)


def test_tied_embeddings_stay_tied(tmp_path):
    from ktinject import inject

    model = build_tiny_model("qwen3_moe", dtype=torch.bfloat16, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    rules = _rules(tmp_path, "- match: {name: 'model\\.embed_tokens'}\n  device: meta\n- include: qwen3_moe.yaml\n")
    inject(model, rules, gpu="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.device.type == "meta"


def test_place_tensors_moves_each_tensor_once():
    from ktinject.injection.inject import place_tensors
    from ktinject.injection.plan import plan

    model = build_tiny_model("olmoe")
    p = plan(model, gpu="cpu")
    assert place_tensors(model, p.tensor_devices) == 0  # already there: nothing copied
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    expected = sum(state[n].numel() * state[n].element_size() for n in p.tensor_devices)
    meta = {name: torch.device("meta") for name in p.tensor_devices}
    assert place_tensors(model, meta) == expected
    assert place_tensors(model, meta) == 0


@torch.no_grad()
def test_generate_after_inject_matches_forward():
    """generate() works after inject and its greedy tokens are the argmax of the injected model's own logits."""
    from ktinject import inject

    model = build_tiny_model("deepseek_v3", dtype=torch.bfloat16)
    inject(model, gpu="cpu")
    prompt = tiny_prompts(1, 6, seed=5)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, min_new_tokens=6,
                         do_sample=False, pad_token_id=0)
    assert out.shape == (1, 12)
    again = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, min_new_tokens=6,
                           do_sample=False, pad_token_id=0)
    assert torch.equal(out, again)
    first = model(prompt).logits[0, -1].argmax().item()
    assert out[0, 6].item() == first


@torch.no_grad()
def test_hybrid_block_contract():
    """Output type/shape/dtype like HF's block; staging buffers are reused, not reallocated per call."""
    from ktinject import inject
    from ktinject.operators.moe import HybridMoE
    from ktinject.operators.routing import staging

    model = build_tiny_model("gpt_oss", dtype=torch.bfloat16)
    inject(model, gpu="cpu")
    block = model.model.layers[0].mlp
    assert isinstance(block, HybridMoE)
    assert block.skip.dtype == torch.uint8 and block.skip.shape == (block.num_experts,) and not block.skip.any()
    x = torch.randn(2, 5, block.hidden_size, dtype=torch.bfloat16)
    out, scores = block(x)  # gpt-oss: (hidden, router_scores)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert scores.shape == (10, model.config.num_experts_per_tok)
    st = staging(pin=False)
    before = st.nbytes()
    block(x[:, :3])
    assert st.nbytes() == before  # fewer tokens: same buffers
    out2, _ = block(x)
    assert torch.equal(out, out2)


def test_operator_rejects_wrong_module():
    from ktinject.operators.attention import AttentionOperator
    from ktinject.operators.base import OperatorError
    from ktinject.operators.moe import MoEOperator

    model = build_tiny_model("qwen3_moe")
    attn = model.model.layers[1].self_attn
    with pytest.raises(OperatorError, match=r"model\.layers\.1\.self_attn.*Qwen3MoeAttention"):
        MoEOperator.check(attn, "model.layers.1.self_attn", {})
    with pytest.raises(OperatorError, match=r"model\.layers\.0\.mlp.*Qwen3MoeMLP"):
        MoEOperator.check(model.model.layers[0].mlp, "model.layers.0.mlp", {})
    with pytest.raises(OperatorError, match=r"model\.layers\.1\.mlp.*Qwen3MoeSparseMoeBlock"):
        AttentionOperator.check(model.model.layers[1].mlp, "model.layers.1.mlp", {})
    with pytest.raises(OperatorError, match="bf16, int8, int4"):
        MoEOperator.check(model.model.layers[1].mlp, "model.layers.1.mlp", {"quant": "int3"})


def test_rule_on_dense_mlp_names_module_and_class(tmp_path):
    from ktinject import inject
    from ktinject.operators.base import OperatorError

    model = build_tiny_model("deepseek_v2", dtype=torch.bfloat16)
    rules = _rules(tmp_path, "- match: {name: 'model\\.layers\\.\\d+\\.mlp'}\n  replace: moe\n"
                             "- include: common.yaml\n")
    with pytest.raises(OperatorError, match=r"model\.layers\.0\.mlp.*DeepseekV2MLP"):
        inject(model, rules, gpu="cpu")
    assert not hasattr(model, "_ktinject_plan")


def test_family_without_rules_lists_supported():
    from transformers import AutoConfig, AutoModelForCausalLM

    from ktinject import inject
    from ktinject.injection.rules import RuleError

    llama = AutoModelForCausalLM.from_config(AutoConfig.for_model(  # a dense family: no packaged rules
        "llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(RuleError, match="qwen3_moe.*gpt_oss|gpt_oss.*qwen3_moe"):
        inject(llama, gpu="cpu")


def test_bad_quant_names_choices():
    from ktinject import inject
    from ktinject.operators.base import OperatorError

    model = build_tiny_model("olmoe", dtype=torch.bfloat16)
    with pytest.raises(OperatorError, match="int3.*bf16, int8, int4"):
        inject(model, gpu="cpu", quant="int3")


def test_mxfp4_rule_kwarg(tmp_path):
    """quant: mxfp4 in a rule (or the call's quant=): mxfp4 experts of groups of 32, quantized from the model's
    weights; group_size 32 only; sizes that are not multiples of 32 are refused with a message saying what to use."""
    from ktinject import inject, native
    from ktinject.operators.base import OperatorError

    def rules(kwargs: str):
        path = tmp_path / "rules.yaml"
        path.write_text(f"- match: {{class: GptOssMLP}}\n  replace: moe\n  kwargs: {kwargs}\n"
                        "- include: common.yaml\n")
        return path

    for rule, call in (("{quant: mxfp4}", None), ("{quant: mxfp4, group_size: 32}", None), ("{quant: int8}", "mxfp4")):
        model = build_tiny_model("gpt_oss", intermediate_size=64)
        hf = copy.deepcopy(model)
        gate0 = model.model.layers[0].mlp.experts.gate_up_proj[0, :, 0::2].t().detach().clone()
        inject(model, rules(rule), gpu="cpu", quant=call)
        blocks = [(n, m) for n, m in model.named_modules() if hasattr(m, "native_experts")]
        assert blocks and {(b.quant, b.native_experts.group_size) for _, b in blocks} == {("mxfp4", 32)}
        want = native.Experts(1, gate0.shape[1], gate0.shape[0], quant="mxfp4")
        want.set(0, "gate", gate0)  # quantized by set(), as the header says
        assert torch.equal(blocks[0][1].native_experts.get(0, "gate"), want.get(0, "gate"))
        with torch.no_grad():  # HF float32 on the stored (dequantized) values
            for name, b in blocks:
                ex, nat = hf.get_submodule(name).experts, b.native_experts
                for e in range(nat.num_experts):
                    ex.gate_up_proj[e, :, 0::2] = nat.get(e, "gate").t()
                    ex.gate_up_proj[e, :, 1::2] = nat.get(e, "up").t()
                    ex.down_proj[e] = nat.get(e, "down").t()
            x = tiny_prompts(2, 8, vocab=model.config.vocab_size)
            got, ref = model(x).logits, hf(x).logits
        assert (got - ref).abs().max() / ref.abs().max() < 0.03  # W4A16: bf16 activations only
    with pytest.raises(OperatorError, match=r"group_size 64 .*mxfp4 has a scale per 32 inputs"):
        inject(build_tiny_model("gpt_oss", intermediate_size=64), rules("{quant: mxfp4, group_size: 64}"), gpu="cpu")
    with pytest.raises(native.NativeError, match=r"multiples of 32.*use quant fp8, int8, int4 or bf16"):
        inject(build_tiny_model("qwen3_moe", moe_intermediate_size=40), gpu="cpu", quant="mxfp4")


def test_int4_group_size_rule_kwarg(tmp_path):
    """moe's group_size kwarg: the blocks hold that group and the plan counts its bytes; it needs int4 and one of
    the native group sizes, and says so."""
    import ktinject
    from ktinject import inject, native
    from ktinject.operators.base import OperatorError

    def rules(kwargs: str):
        path = tmp_path / "rules.yaml"
        path.write_text(f"- match: {{class: Qwen3MoeSparseMoeBlock}}\n  replace: moe\n  kwargs: {kwargs}\n"
                        "- include: common.yaml\n")
        return path

    model = build_tiny_model("qwen3_moe", dtype=torch.bfloat16)
    cfg = model.config
    default = ktinject.plan(model, rules("{quant: int4}"), gpu="cpu")
    plan = inject(model, rules("{quant: int4, group_size: 32}"), gpu="cpu")
    blocks = [m for m in model.modules() if hasattr(m, "native_experts")]
    assert blocks and {b.native_experts.group_size for b in blocks} == {32}
    # the plan counts the group's bytes (gpu="cpu": the block's dense tensors are in the same figure)
    packed = {g: native.Experts.packed_nbytes(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, "int4",
                                              group_size=g) for g in (32, None)}
    assert packed[32] > packed[None]
    moe = [(a.nbytes["cpu"], b.nbytes["cpu"]) for a, b in zip(plan.operator_entries(), default.operator_entries())
           if a.operator == "moe"]
    assert moe and all(a - b == packed[32] - packed[None] for a, b in moe)
    assert torch.isfinite(model(tiny_prompts(1, 8, vocab=cfg.vocab_size)).logits).all()
    for kwargs, match in (("{quant: bf16, group_size: 64}", "group_size 64 .* applies to quant int4, fp8 or mxfp4"),
                          ("{group_size: 64}", "applies to quant int4, fp8 or mxfp4 only .* in effect is bf16"),
                          ("{quant: int4, group_size: 48}", "group_size 48 .* use one of 32, 64, 128"),
                          ("{quant: int4, group_size: true}", "group_size True .* use one of 32, 64, 128")):
        with pytest.raises(OperatorError, match=match):
            inject(build_tiny_model("qwen3_moe", dtype=torch.bfloat16), rules(kwargs), gpu="cpu")
    # the call's quant overrides the rule's (and so decides whether group_size applies)
    model = build_tiny_model("qwen3_moe", dtype=torch.bfloat16)
    inject(model, rules("{quant: int8, group_size: 32}"), gpu="cpu", quant="int4")
    assert {m.native_experts.group_size for m in model.modules() if hasattr(m, "native_experts")} == {32}
    with pytest.raises(OperatorError, match="in effect is int8"):
        inject(build_tiny_model("qwen3_moe", dtype=torch.bfloat16), rules("{quant: int4, group_size: 32}"),
               gpu="cpu", quant="int8")


def test_cli_model_options_leave_the_rules_alone():
    """The chat's / server's --quant, --defer and --prefill default to None: the rules' kwargs hold unless given; the
    load line says what the experts are."""
    from ktinject import inject
    from ktinject.cli import options as cli
    from ktinject.cli.chat import build_parser

    args = build_parser().parse_args([])
    assert (args.quant, args.defer, args.prefill) == (None, None, None)
    args = build_parser().parse_args(["--quant", "int4", "--defer", "1", "--prefill", "cpu"])
    assert (args.quant, args.defer, args.prefill) == ("int4", 1, "cpu")
    model = build_tiny_model("qwen3_moe", dtype=torch.bfloat16)
    inject(model, gpu="cpu", quant="int4")
    assert cli.experts_format(model) == "int4 (groups of 64)"
    assert cli.experts_format(torch.nn.Linear(2, 2)) == "no MoE blocks"


# ------------------------------------------------------------------------------------------------------ GPU


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss"])
@torch.no_grad()
def test_cuda_inject(family):
    """gpu="cuda": everything but the routed experts on the GPU; as close to float32 as HF bf16; generate works."""
    from ktinject import inject
    from ktinject.operators.moe import HybridMoE

    truth = build_tiny_model(family)
    yard = build_tiny_model(family, dtype=torch.bfloat16)
    model = build_tiny_model(family, dtype=torch.bfloat16)
    inject(model, gpu="cuda", gpu_experts_budget=0)  # the routed experts stay native
    assert all(t.device.type == "cuda" for t in model.state_dict().values())
    assert any(isinstance(m, HybridMoE) for m in model.modules())
    prompts = tiny_prompts(4, 32, seed=6)
    ref = truth(prompts).logits

    def median_kl(got):  # median over positions of KL(float32 || got): robust to rare bf16 routing flips
        lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got.float().cpu(), -1)
        return (lp.exp() * (lp - lq)).sum(-1).median().item()

    kl_yard = median_kl(yard(prompts).logits)
    kl = median_kl(model(prompts.cuda()).logits)
    assert kl <= 1.5 * kl_yard, f"cuda injected median KL {kl:.3e} vs HF bf16 (CPU) {kl_yard:.3e}"
    out = model.generate(prompts.cuda(), attention_mask=torch.ones_like(prompts).cuda(), max_new_tokens=8,
                         min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (4, 40) and out.device.type == "cuda"
    torch.cuda.synchronize()


@pytest.mark.parametrize("kwargs, match", [
    ({"prefil": "cpu"}, r"unexpected keyword argument prefil='cpu': did you mean prefill=\.\.\.\?"),
    ({"qaunt": "int8"}, r"qaunt='int8': did you mean quant="),
    ({"gpu_expert_budget": "12GiB"}, r"did you mean gpu_experts_budget="),
    ({"accelerator": "cpu"}, r"no rule uses a device 'accelerator' \(the rules use cpu, gpu\)"),
])
def test_misspelled_options_are_not_taken_as_device_variables(kwargs, match):
    """Keywords beyond inject's options are device variables; one that no rule uses is a misspelled option, named
    with the closest option (it was taken silently, or failed as 'not a torch device')."""
    from ktinject import inject

    with pytest.raises(TypeError, match=match):
        inject(build_tiny_model("qwen3_moe"), gpu="cpu", **kwargs)


def test_argument_errors_name_the_argument_and_other_families_are_named():
    from ktinject import inject
    from ktinject.operators.base import OperatorError

    with pytest.raises(OperatorError, match=r"^quant='int3' \(an argument of inject / from_pretrained, or the chat's "
                                            r"and the server's --quant\) does not fit module"):
        inject(build_tiny_model("qwen3_moe"), gpu="cpu", quant="int3")
    from ktinject.injection.rules import RuleError

    with pytest.raises(RuleError, match=r"(?s)no module of MixtralForCausalLM matched a moe rule, so no experts would "
                                        r"move.*did you mean 'MixtralSparseMoeBlock'\?.*these are the qwen3_moe rules, "
                                        r"and the model's config.model_type is 'mixtral'; its packaged rules: rules=None"):
        inject(build_tiny_model("mixtral"), "qwen3_moe", gpu="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_cuda_device_without_cuda_is_named():
    from ktinject import inject
    from ktinject.injection.inject import InjectError

    with pytest.raises(InjectError, match=r"gpu='cuda': CUDA is not available on this machine \(pass gpu='cpu'"):
        inject(build_tiny_model("qwen3_moe"), gpu="cuda")
