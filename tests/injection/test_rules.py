"""Rule files: matching as a table, every error message, includes, packaged family files."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from ktinject.injection.rules import (
    FAMILIES, Rule, RuleError, RuleSet, load_rules, packaged_files, parse_rules, rules_for_model,
    supported_families,
)

QWEN3 = "transformers.models.qwen3_moe.modeling_qwen3_moe"
LINEAR = "torch.nn.modules.linear.Linear"

TABLE_RULES = rf"""
- match: {{name: 'model\.layers\.\d+\.mlp', class: Qwen3MoeSparseMoeBlock}}    # 0
  replace: moe
- match: {{class: {QWEN3}.Qwen3MoeAttention}}                                   # 1: dotted path
  device: gpu
- match: {{name: lm_head}}                                                      # 2
  device: cpu
  recursive: false
- match: {{name: 'model\.layers\.\d+\.mlp'}}                                     # 3
  device: cpu
- match: {{name: mlp}}                                                          # 4: only a top-level "mlp"
  device: 'cuda:0'
- match: {{class: Linear}}                                                      # 5: bare class name
  device: gpu
"""


@pytest.fixture(scope="module")
def table_rules() -> RuleSet:
    return parse_rules(TABLE_RULES, source="table.yaml")


@pytest.mark.parametrize("name, cls, expected", [
    ("model.layers.3.mlp", f"{QWEN3}.Qwen3MoeSparseMoeBlock", 0),          # name and class
    ("model.layers.3.mlp", "Qwen3MoeSparseMoeBlock", 0),                    # bare class name given
    ("model.layers.3.mlp", f"{QWEN3}.Qwen3MoeMLP", 3),                      # dense layer: class differs, name rule
    ("model.layers.3.mlp.experts", f"{QWEN3}.Qwen3MoeExperts", None),       # fullmatch: no prefix match
    ("xmodel.layers.3.mlp", f"{QWEN3}.Qwen3MoeMLP", None),                  # fullmatch: anchored at the start
    ("model.layers.0.self_attn", f"{QWEN3}.Qwen3MoeAttention", 1),          # dotted path
    ("model.layers.0.self_attn", "other.pkg.Qwen3MoeAttention", None),      # same name, other module
    ("model.layers.0.self_attn", "Qwen3MoeAttention", None),                # dotted rule needs the dotted path
    ("lm_head", LINEAR, 2),                                                 # first match wins over rule 5
    ("mlp", "x.Anything", 4),
    ("a.mlp", "x.Anything", None),
    ("model.layers.0.self_attn.q_proj", LINEAR, 5),                         # class by bare name
    ("model.layers.0.self_attn.q_proj", "my.pkg.SubLinear", None),          # subclasses do not match
    ("", "transformers.Qwen3MoeForCausalLM", None),                         # root: name is ""
])
def test_match_table(table_rules, name, cls, expected):
    assert table_rules.first_match(name, cls) == expected
    rule = table_rules.match(name, cls)
    assert (rule is None) if expected is None else (rule is table_rules.rules[expected])


def test_parsed_fields(table_rules):
    r = table_rules.rules
    assert [x.index for x in r] == list(range(6))
    assert r[0].replace == "moe" and r[0].device is None and r[0].recursive
    assert r[2].recursive is False and r[2].device == "cpu"
    assert r[4].device == "cuda:0"
    assert r[0].line == 2 and r[0].where == "table.yaml: rule[0] (line 2)" and r[0].label == "table.yaml:0"


def test_root_rule_and_code_rules():
    root = Rule(match_name="", device="gpu")
    assert root.matches("", "a.Model") and not root.matches("model", "a.Model")
    assert Rule(match_class="a.b.C", device="cpu").matches("x", "a.b.C")
    with pytest.raises(RuleError, match="needs match.name and/or match.class"):
        Rule(device="cpu")


# ---------------------------------------------------------------------------------------------- errors


ERROR_CASES = [
    ("- match: {name: a}\n  device: gpu\n- match: [\n", "bad.yaml: line 4: YAML syntax error"),
    ("- match: {name: a}\n  devcie: gpu\n", "bad.yaml: rule[0] (line 2): key 'devcie': unknown key",
     "allowed keys: match, replace, kwargs, device, recursive"),
    ("- device: gpu\n", "rule[0] (line 1):", "missing key 'match'"),
    ("- match: {name: a}\n  device: gpu\n- match: {name: 'model.(layers'}\n  device: gpu\n",
     "rule[1] (line 3): key 'match'", "'model.(layers' is not a valid regular expression", "missing )"),
    ("- match: {name: 3}\n  device: gpu\n", "match.name must be a string"),
    ("- match: {nam: a}\n  device: gpu\n", "unknown key 'nam' in match; allowed: name, class"),
    ("- match: {}\n  device: gpu\n", "key 'match': expected a mapping"),
    ("- match: mlp\n  device: gpu\n", "key 'match': expected a mapping"),
    ("- match: {class: 'Foo Bar'}\n  device: gpu\n", "match.class must be a class name or dotted path"),
    ("- match: {name: a}\n  replace: [moe]\n", "key 'replace': expected an operator id"),
    ("- match: {name: a}\n  replace: moe\n  kwargs: [1]\n", "key 'kwargs': expected a mapping"),
    ("- match: {name: a}\n  device: gpu\n  kwargs: {quant: int8}\n", "key 'kwargs': kwargs go to an operator"),
    ("- match: {name: a}\n  device: 'cuda 0'\n", "key 'device': expected a device variable"),
    ("- match: {name: a}\n  device: gpu\n  recursive: 'no'\n", "key 'recursive': expected true or false"),
    ("- match: {name: a}\n", "a rule needs 'replace: OPERATOR' or 'device: DEVICE'"),
    ("- match: {name: a}\n  device: gpu\n  device: cpu\n", "key 'device' (line 3) appears twice"),
    ("- just a string\n", "rule[0] (line 1): expected a mapping"),
    ("", "bad.yaml: the file is empty"),
    ("match: {name: a}\n", "bad.yaml: line 1: expected a YAML list of rules", "got a dict"),
    ("- include: common.yaml\n  device: gpu\n", "'include' must stand alone"),
    ("- include: no_such_file.yaml\n", "rule[0] (line 1): rule file 'no_such_file.yaml' not found",
     "packaged rule files: "),
]


@pytest.mark.parametrize("text, fragments", [(case[0], case[1:]) for case in ERROR_CASES])
def test_error_messages(text, fragments):
    with pytest.raises(RuleError) as err:
        parse_rules(text, source="bad.yaml")
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


def test_error_names_the_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("- match: {name: a}\n  bogus: 1\n")
    with pytest.raises(RuleError, match=r"mine\.yaml: rule\[0\] \(line 2\): key 'bogus'"):
        load_rules(str(path))


def test_load_not_found_lists_packaged():
    with pytest.raises(RuleError, match=r"rule file 'nope\.yaml' not found .*packaged rule files: .*qwen3_moe\.yaml"):
        load_rules("nope.yaml")


# ---------------------------------------------------------------------------------------------- includes


def test_include_spliced_in_place(tmp_path):
    (tmp_path / "a.yaml").write_text("- match: {name: a1}\n  device: gpu\n- include: sub/b.yaml\n"
                                     "- match: {name: a2}\n  device: cpu\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("- match: {name: b1}\n  device: gpu\n- include: c.yaml\n")
    (tmp_path / "sub" / "c.yaml").write_text("- match: {name: c1}\n  device: gpu\n")  # relative to b.yaml
    rs = load_rules(tmp_path / "a.yaml")
    assert [r.match_name for r in rs] == ["a1", "b1", "c1", "a2"]
    assert [r.label for r in rs] == ["a.yaml:0", "b.yaml:0", "c.yaml:0", "a.yaml:2"]
    assert len(rs.sources) == 3


def test_include_falls_back_to_packaged(tmp_path):
    (tmp_path / "mine.yaml").write_text("- match: {name: extra}\n  device: cpu\n- include: qwen3_moe.yaml\n")
    rs = load_rules(str(tmp_path / "mine.yaml"))
    assert rs.rules[0].match_name == "extra"
    assert rs.rules[1].match_class == "Qwen3MoeSparseMoeBlock"
    assert rs.rules[-1].file == "common.yaml"


def test_include_cycle(tmp_path):
    (tmp_path / "a.yaml").write_text("- include: b.yaml\n")
    (tmp_path / "b.yaml").write_text("- match: {name: x}\n  device: gpu\n- include: a.yaml\n")
    with pytest.raises(RuleError, match=r"include cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_rules(tmp_path / "a.yaml")


def test_self_include(tmp_path):
    (tmp_path / "a.yaml").write_text("- include: a.yaml\n")
    with pytest.raises(RuleError, match="include cycle"):
        load_rules(tmp_path / "a.yaml")


# ---------------------------------------------------------------------------------------------- packaged files


@pytest.mark.parametrize("name", sorted(set(FAMILIES.values())) + ["common.yaml"])
def test_packaged_files_load(name):
    rs = load_rules(name)
    assert len(rs) >= 3
    assert rs.rules[-1].match_name == "" and rs.rules[-1].device == "gpu"  # common.yaml's catch-all comes last
    assert all(r.replace in (None, "moe", "attention", "rmsnorm") for r in rs)
    if name != "common.yaml":
        assert rs.rules[0].replace == "moe" and rs.rules[0].match_class


def test_load_forms():
    by_stem, by_name, by_path = load_rules("mixtral"), load_rules("mixtral.yaml"), load_rules("rules/mixtral.yaml")
    assert [r.match_class for r in by_stem] == [r.match_class for r in by_name] == [r.match_class for r in by_path]
    assert load_rules(by_stem) is by_stem
    both = load_rules(["olmoe", by_stem])
    assert len(both) == len(by_stem) * 2 and both.rules[0].match_class == "OlmoeSparseMoeBlock"
    assert set(packaged_files()) >= set(FAMILIES.values()) | {"common.yaml"}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_rules_for_model(model_type):
    config = SimpleNamespace(model_type=model_type)
    rs = rules_for_model(SimpleNamespace(config=config))  # a model
    assert [r.label for r in rs] == [r.label for r in rules_for_model(config)]  # or its config
    assert rs.rules[0].file == FAMILIES[model_type]


def test_kimi_maps_to_deepseek_v3():
    assert rules_for_model(SimpleNamespace(model_type="kimi_k2")).rules[0].match_class == "DeepseekV3MoE"


def test_unknown_family():
    with pytest.raises(RuleError) as err:
        rules_for_model(SimpleNamespace(model_type="llama"))
    msg = str(err.value)
    assert "model_type 'llama'" in msg and "supported families: " in msg
    assert all(f in msg for f in supported_families())
