"""LoRA adapters for inference (``ktinject.injection.lora``): a PEFT adapter merged at load gives PEFT's own merged
model's logits bit for bit (``inject(..., lora=)`` and ``from_pretrained(..., lora=)``), ``save_merged`` writes a
checkpoint that loads to the same; adapters that do not fit the model are refused before a weight changes, with
what to do."""
from __future__ import annotations

import json

import pytest
import torch

from ktinject import from_pretrained, inject
from ktinject.demo import demo_model_dir
from ktinject.injection import lora
from ktinject.injection.lora import LoraError
from ktinject.tiny_models import build_tiny_model

peft = pytest.importorskip("peft")

IDS = torch.tensor([[1, 50, 60, 70, 80, 90, 100, 110, 120, 130]])  # [B, S]


def _hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_model_dir())


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """An adapter on the demo model's q/v/o projections with nonzero B (as after training), in PEFT's format, with
    ktinject's base fingerprint."""
    out = tmp_path_factory.mktemp("adapter")
    torch.manual_seed(0)
    model = peft.get_peft_model(_hf(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                          "o_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out)
    names = sorted(n for n, m in model.base_model.model.named_modules() if hasattr(m, "lora_A"))
    lora.write_base_file(out, model.base_model.model, names)
    return out


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_merged_at_load_is_peft_merged(adapter, tmp_path):
    ref = peft.PeftModel.from_pretrained(_hf(), adapter).merge_and_unload()
    inject(ref, gpu="cpu")
    ours = from_pretrained(demo_model_dir(), gpu="cpu", progress=False, lora=adapter)
    plain = from_pretrained(demo_model_dir(), gpu="cpu", progress=False)
    assert torch.equal(_logits(ours), _logits(ref))
    assert (_logits(ours) - _logits(plain)).abs().max() > 0.1
    injected = _hf()
    inject(injected, gpu="cpu", lora=adapter)
    assert torch.equal(_logits(injected), _logits(ref))
    merged = lora.save_merged(demo_model_dir(), adapter, tmp_path / "merged")
    assert (merged / "config.json").is_file() and (merged / "tokenizer.json").is_file()
    assert not (merged / "SHA256SUMS.json").exists()
    assert torch.equal(_logits(from_pretrained(merged, gpu="cpu", progress=False)), _logits(ref))
    with pytest.raises(LoraError, match="exists and is not empty"):
        lora.save_merged(demo_model_dir(), adapter, tmp_path / "merged")


def test_an_adapter_of_other_weights_is_refused(adapter):
    model = _hf()
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(2.0)
    before = model.model.layers[1].self_attn.v_proj.weight.clone()
    with pytest.raises(LoraError, match=r"was trained on another base model: the weight of "
                                        r"model.layers.0.self_attn.q_proj differs"):
        inject(model, gpu="cpu", lora=adapter)
    assert torch.equal(model.model.layers[1].self_attn.v_proj.weight, before)  # nothing merged, nothing built


def test_an_adapter_of_another_model_is_refused(adapter, tmp_path):
    other = build_tiny_model("qwen3_moe", seed=0)  # other sizes
    with pytest.raises(LoraError, match=r"does not fit model.layers.0.self_attn.o_proj: lora_A \(4, 192\) and "
                                        r"lora_B \(192, 4\) against a weight of \[64, 64\]"):
        inject(other, gpu="cpu", lora=adapter)
    deeper = tmp_path / "deeper"  # a layer the demo model has not, without the fingerprint
    _rewrite(adapter, deeper, lambda k: k.replace("layers.3.", "layers.7."), base=False)
    with pytest.raises(LoraError, match=r"targets model.layers.7.self_attn.o_proj, which Qwen3MoeForCausalLM has "
                                        r"not: the adapter was made for another model"):
        inject(_hf(), gpu="cpu", lora=deeper)


def test_lora_on_routed_experts_and_other_kinds_are_refused(adapter, tmp_path):
    experts = tmp_path / "experts"
    _rewrite(adapter, experts, lambda k: k.replace("self_attn.q_proj", "mlp.experts.3.gate_proj"), base=False)
    # (routed experts take adapters, applied on the CPU: tests/training/test_expert_lora.py; this one's shapes are
    # q_proj's)
    with pytest.raises(LoraError, match=r"the expert_gate_proj adapter of shapes \(4, 192\), \(192, 4\) does not fit"):
        inject(_hf(), gpu="cpu", lora=experts)
    for key, value, message in [("use_dora", True, "DoRA adapters"),
                                ("modules_to_save", ["lm_head"], "modules_to_save"),
                                ("target_parameters", ["mlp.experts.gate_up_proj"], "routed experts' tensors"),
                                ("peft_type", "IA3", "only LORA adapters")]:
        odd = tmp_path / key
        _rewrite(adapter, odd, lambda k: k, config={key: value})
        with pytest.raises(LoraError, match=message):
            lora.read_adapter(odd)
    with pytest.raises(LoraError, match="is not a LoRA adapter directory"):
        from_pretrained(demo_model_dir(), gpu="cpu", lora=tmp_path / "nowhere")


def _rewrite(src, dst, rename, config=None, base=True):
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    tensors = load_file(str(src / lora.WEIGHTS_FILE))
    save_file({rename(k): v for k, v in tensors.items()}, str(dst / lora.WEIGHTS_FILE))
    cfg = json.loads((src / lora.CONFIG_FILE).read_text()) | (config or {})
    (dst / lora.CONFIG_FILE).write_text(json.dumps(cfg))
    if base:
        (dst / lora.BASE_FILE).write_text((src / lora.BASE_FILE).read_text())
