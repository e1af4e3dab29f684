"""Plans of tiny meta-device models of every family, and the walk semantics on hand-built module trees."""
from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from ktinject import operators
from ktinject.operators.base import Operator, OperatorError, tensor_bytes
from ktinject.injection.plan import Plan, human_bytes, plan
from ktinject.injection.rules import RuleError, parse_rules

_COMMON = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               vocab_size=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_MLA = dict(kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
            first_k_dense_replace=1)
# family -> (tiny config keywords, MoE block class, dense mlp class or None)
FAMILIES: dict[str, tuple[dict[str, Any], str, str | None]] = {
    "qwen3_moe": (dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0]),
                  "Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP"),
    "qwen2_moe": (dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0],
                       shared_expert_intermediate_size=32), "Qwen2MoeSparseMoeBlock", "Qwen2MoeMLP"),
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2), "MixtralSparseMoeBlock", None),
    "olmoe": (dict(num_experts=8, num_experts_per_tok=2), "OlmoeSparseMoeBlock", None),
    "deepseek_v2": (dict(_MLA, q_lora_rank=None), "DeepseekV2Moe", "DeepseekV2MLP"),
    "deepseek_v3": (dict(_MLA, q_lora_rank=16), "DeepseekV3MoE", "DeepseekV3MLP"),
    "glm4_moe": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                      first_k_dense_replace=1, n_group=1, topk_group=1), "Glm4MoeMoE", "Glm4MoeMLP"),
    "gpt_oss": (dict(num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention",
                                                                             "sliding_attention"]),
                "GptOssMLP", None),
}


class _FakeMoE(Operator):
    """Stands in for the real "moe" operator if it is not importable: experts on the CPU, the rest on device."""

    kwargs_allowed = frozenset({"quant"})

    @classmethod
    def check(cls, module, name, kwargs):
        if not hasattr(module, "experts"):
            raise OperatorError("no .experts")

    @classmethod
    def placement(cls, module, kwargs, device):
        experts = tensor_bytes(module.experts)
        return {"cpu": experts, str(device): tensor_bytes(module) - experts}


class _FakeAttention(Operator):
    @classmethod
    def placement(cls, module, kwargs, device):
        return {str(device): tensor_bytes(module)}


class _Owner(Operator):
    """A test operator that takes any module."""

    kwargs_allowed = frozenset({"size"})

    @classmethod
    def placement(cls, module, kwargs, device):
        return {"cpu": 7}


def _ensure(op_id: str, cls: type) -> None:
    try:
        operators.get(op_id)
    except (ImportError, KeyError):  # not registered (or a built-in operator module is broken): a stand-in
        operators.register(op_id)(cls)


@pytest.fixture(scope="module", autouse=True)
def _operators():
    _ensure("moe", _FakeMoE)
    _ensure("attention", _FakeAttention)
    _ensure("test-owner", _Owner)


def tiny_model(family: str, layers: int = 3) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs, _, _ = FAMILIES[family]
    if family == "gpt_oss":
        kwargs = dict(kwargs, layer_types=(["sliding_attention", "full_attention"] * layers)[:layers])
    config = AutoConfig.for_model(family, num_hidden_layers=layers, **_COMMON, **kwargs)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    return {family: tiny_model(family) for family in FAMILIES}


def _all_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    seen, out = set(), {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_plan(models, family):
    model = models[family]
    _, moe_class, dense_class = FAMILIES[family]
    p = plan(model, gpu="cpu")
    classes = {name: type(m).__name__ for name, m in model.named_modules()}
    moe_names = {n for n, c in classes.items() if c == moe_class}
    assert moe_names and {e.name for e in p.entries if e.operator == "moe"} == moe_names
    assert all(e.class_name == moe_class and e.rule.file == f"{family}.yaml" for e in p.operator_entries()
               if e.operator == "moe")
    attention = {n for n in classes if n.endswith(".self_attn")}
    assert {e.name for e in p.entries if e.operator == "attention"} == attention
    dense = {n for n, c in classes.items() if c == dense_class and n.endswith(".mlp")}
    assert bool(dense) == (dense_class is not None)
    assert not dense & {e.name for e in p.operator_entries()}
    for name in dense:  # dense mlp layers stay in the plan as tensors on the gpu device
        assert p.tensor_devices[f"{name}.down_proj.weight"] == torch.device("cpu")
    # every tensor outside operator subtrees is placed, once; operator subtrees are the operators' business
    owned = tuple(e.name + "." for e in p.operator_entries())
    outside = {n: t for n, t in _all_tensors(model).items() if not n.startswith(owned)}
    assert set(p.tensor_devices) == set(outside)
    assert "model.rotary_emb.inv_freq" in p.tensor_devices  # non-persistent buffers move too
    # bytes: device entries add up to the tensors outside operators; operators report their own placement
    op_bytes = sum(sum(e.nbytes.values()) for e in p.operator_entries())
    assert sum(p.bytes_per_device().values()) - op_bytes == _nbytes(outside.values())
    assert all(sum(e.nbytes.values()) > 0 for e in p.operator_entries())
    assert p.unmatched_rules == ()
    assert set(p.bytes_per_device()) == {"cpu"}


def test_default_rules_and_str(models):
    p = plan(models["deepseek_v3"], gpu="cpu")
    text = str(p)
    print(text)
    lines = text.splitlines()
    assert "model.layers.{0..2}.self_attn" in text and "model.layers.{1..2}.mlp" in text
    assert "DeepseekV3MoE" in text and "deepseek_v3.yaml:0" in text and "(root)" in text
    assert lines[-2].startswith("bytes per device: cpu ") and lines[-1] == "devices: cpu=cpu, gpu=cpu"


def test_str_collapses_layers():
    short, long = plan(tiny_model("qwen3_moe", 3), gpu="cpu"), plan(tiny_model("qwen3_moe", 24), gpu="cpu")
    assert len(str(long).splitlines()) == len(str(short).splitlines()) <= 12
    assert "model.layers.{1..23}.mlp" in str(long) and "(23 x " in str(long)


def test_gpu_override(models):
    p = plan(models["qwen2_moe"], gpu="cuda", cpu="cpu")
    assert p.devices["gpu"].type == "cuda" and p.devices["cpu"] == torch.device("cpu")
    assert {d.type for d in p.tensor_devices.values()} == {"cuda"}
    moe = [e for e in p.operator_entries() if e.operator == "moe"]
    assert all(e.device.type == "cuda" and e.nbytes.get("cpu", 0) > 0 for e in moe)  # routed experts: CPU
    assert p.bytes_per_device()["cpu"] == sum(e.nbytes["cpu"] for e in moe)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA default")
def test_default_gpu_without_cuda(models, caplog):
    with caplog.at_level(logging.WARNING, logger="ktinject.injection.plan"):
        p = plan(models["olmoe"])
    assert p.devices["gpu"] == torch.device("cpu") and "no CUDA device" in caplog.text


def test_quant_override(models):
    p = plan(models["mixtral"], gpu="cpu", quant="int8")
    assert {e.operator: e.kwargs.get("quant") for e in p.operator_entries()} == {"moe": "int8", "attention": None, "rmsnorm": None}


def test_unmatched_rule_warns(models, caplog):
    extra = parse_rules("- match: {class: NoSuchBlock}\n  device: cpu\n", source="extra.yaml")
    with caplog.at_level(logging.WARNING, logger="ktinject.injection.plan"):
        p = plan(models["glm4_moe"], [extra, "glm4_moe"], gpu="cpu")
    assert p.unmatched_rules == extra.rules
    assert "extra.yaml: rule[0] (line 1) matched no module of Glm4MoeForCausalLM" in caplog.text
    assert "unmatched rule: extra.yaml: rule[0]" in str(p)


@pytest.mark.parametrize("match, hint", [
    ("{class: Glm4MoeMoe}", "(match: class='Glm4MoeMoe'; did you mean 'Glm4MoeMoE'?)"),
    ("{class: transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeMOE}",
     "did you mean 'transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeMoE'?"),
    ("{class: Zzzz}", "(match: class='Zzzz'; no module has that class)"),
    ("{name: 'model\\.nothing', class: Glm4MoeMoE}",
     "(match: name='model\\\\.nothing', class='Glm4MoeMoE'; modules of that class exist, but none has a matching "
     "name)"),
])
def test_unmatched_rule_names_the_closest_class(models, caplog, match, hint):
    from ktinject.injection.plan import unmatched_note

    extra = parse_rules(f"- match: {match}\n  device: cpu\n", source="extra.yaml")
    with caplog.at_level(logging.WARNING, logger="ktinject.injection.plan"):
        p = plan(models["glm4_moe"], [extra, "glm4_moe"], gpu="cpu")
    assert p.unmatched_rules == extra.rules
    note = unmatched_note(extra.rules[0], models["glm4_moe"])
    assert note.startswith("extra.yaml: rule[0] (line 1) matched no module of Glm4MoeForCausalLM (match: ")
    assert hint in note and note in caplog.text


def test_unknown_family():
    model = nn.Linear(2, 2)
    model.config = SimpleNamespace(model_type="llama")
    with pytest.raises(RuleError, match=r"model_type 'llama'; supported families: .*qwen3_moe"):
        plan(model, gpu="cpu")


# ---------------------------------------------------------------------------------------------- walk semantics


def _tree() -> nn.Module:
    root = nn.Module()
    root.a = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    root.b = nn.Module()
    root.b.inner = nn.Linear(2, 2, bias=False)
    root.b.register_buffer("scale", torch.ones(3))
    root.emb = nn.Embedding(5, 4)
    root.head = nn.Linear(4, 5, bias=False)
    root.head.weight = root.emb.weight  # tied
    return root


def test_walk_devices_recursive_and_ties():
    rules = parse_rules(r"""
- match: {name: a}
  device: 'cuda:1'
  recursive: false
- match: {name: 'a\.0'}          # never reached: a stops the walk
  device: cpu
- match: {name: b}
  device: fast
- match: {name: 'b\.inner'}
  device: cpu
""", source="t.yaml")
    p = plan(_tree(), rules, gpu="meta", fast="cuda:2")
    td = p.tensor_devices
    assert td["a.0.weight"] == td["a.1.bias"] == torch.device("cuda:1")
    assert td["b.scale"] == torch.device("cuda:2") and td["b.inner.weight"] == torch.device("cpu")
    assert td["emb.weight"] == torch.device("meta") and "head.weight" not in td  # tied: once, first name
    assert [e.name for e in p.entries] == ["a", "b", "b.inner"]
    assert p.entries[0].nbytes == {"cuda:1": (16 + 4 + 8 + 2) * 4}
    assert p.unmatched_rules == (rules.rules[1],)
    assert p.unclaimed_nbytes == {"meta": 20 * 4}  # emb (head shares it), placed by no rule
    assert sum(p.bytes_per_device().values()) == tensor_bytes(_tree())  # tied weight counted once


def test_operator_owns_subtree():
    rules = parse_rules("""
- match: {name: b}
  replace: test-owner
  kwargs: {size: 1}
- match: {name: 'b\\.inner'}
  device: cpu
""", source="t.yaml")
    p = plan(_tree(), rules, gpu="cpu")
    assert [(e.name, e.operator, dict(e.kwargs), e.nbytes) for e in p.entries] == [("b", "test-owner", {"size": 1},
                                                                                  {"cpu": 7})]
    assert not any(n.startswith("b.") for n in p.tensor_devices)
    assert p.unmatched_rules == (rules.rules[1],)


@pytest.mark.parametrize("text, error, fragments", [
    ("- match: {name: a}\n  replace: nosuchop\n", RuleError,
     ("t.yaml: rule[0] (line 1): key 'replace': unknown operator 'nosuchop'", "known operators: ", "moe")),
    ("- match: {name: a}\n  replace: test-owner\n  kwargs: {bogus: 1}\n", RuleError,
     ("key 'kwargs': operator 'test-owner' does not take bogus; it takes: size",)),
    ("- match: {name: x}\n  device: fast\n", RuleError,
     ("t.yaml: rule[0] (line 1): key 'device': 'fast' is neither a device variable", "plan(..., fast='cuda:1')")),
    ("- match: {name: 'a\\.0'}\n  replace: moe\n", OperatorError,
     ("t.yaml: rule[0] (line 1): operator 'moe' cannot take module 'a.0' (Linear): ",)),
])
def test_plan_errors(text, error, fragments):
    with pytest.raises(error) as err:
        plan(_tree(), parse_rules(text, source="t.yaml"), gpu="cpu")
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


def test_bad_device_override():
    with pytest.raises(RuleError, match=r"plan\(gpu=\.\.\.\): 'gpu0' is not a torch device"):
        plan(_tree(), parse_rules("- match: {name: a}\n  device: gpu\n"), gpu="gpu0")


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 1023, 1536, 3 * 2**30)] == ["0 B", "1023 B", "1.5 KiB", "3.0 GiB"]
    assert isinstance(plan(_tree(), parse_rules("- match: {name: ''}\n  device: gpu\n"), gpu="cpu"), Plan)
