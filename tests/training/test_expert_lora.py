"""LoRA on the routed experts (CPU): PEFT's adapters on the ``experts.E.expert_{gate,up,down}_proj`` stand-ins of an
injected model train, save, load and apply at inference.

The gradients of the expert adapters, the block's input and its router match float64 autograd of the HF block
with the same stored expert values (bf16-rounded or int4-dequantized: ``Experts.get``) and W + scaling * B A added
to its fused experts: the torch path computes in float32, so the two agree to float32 rounding for every format (a
missing term or a wrong derivative is off by order 1). Shapes: one token, experts with no tokens, every token on
one expert.

Legend: T tokens, E experts, H hidden, I expert intermediate, r rank.
"""
from __future__ import annotations

import copy

import pytest
import torch

from ktinject import inject
from ktinject.injection import lora as lora_merge
from ktinject.operators import expert_lora
from ktinject.operators.base import OperatorError
from ktinject.operators.moe import HybridMoE
from ktinject.tiny_models import build_tiny_model, tiny_prompts
from tests.training.test_injected_training import models

peft = pytest.importorskip("peft")

EXPERTS = list(expert_lora.PROJECTIONS)
BATCH = tiny_prompts(2, 12, seed=7)  # [B, S]


def _lora(model, targets, seed=0, dropout=0.0):
    torch.manual_seed(seed)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                       target_modules=targets, init_lora_weights="gaussian"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # lora_B nonzero, so that every adapter has a gradient and a delta at once
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1, generator=gen)
    return model


def _blocks(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, HybridMoE)]


def _reference(hf_block, block, x, scale):
    """The HF block (float64) with W + scaling * B A per expert, the adapters as float64 leaves; (out, leaves)."""
    ref = copy.deepcopy(hf_block).double()
    ref.experts.config = copy.copy(ref.experts.config)
    ref.experts.config._experts_implementation = "eager"  # (the grouped kernel takes no float64)
    I = block.intermediate_size
    leaves = {}
    for e, slot in enumerate(block.experts):
        for p in EXPERTS:
            m = slot._modules[p]
            leaves[(e, p)] = (m.lora_A["default"].weight.detach().double().requires_grad_(),
                              m.lora_B["default"].weight.detach().double().requires_grad_())
    gu, down = ref.experts.gate_up_proj, ref.experts.down_proj  # [E, 2I, H], [E, H, I]
    delta = lambda e, p: scale * leaves[(e, p)][1] @ leaves[(e, p)][0]  # noqa: E731
    new_gu = torch.stack([gu[e] + torch.cat([delta(e, EXPERTS[0]), delta(e, EXPERTS[1])]) for e in range(len(gu))])
    new_down = torch.stack([down[e] + delta(e, EXPERTS[2]) for e in range(len(down))])
    assert new_gu.shape[1] == 2 * I
    out = torch.func.functional_call(ref, {"experts.gate_up_proj": new_gu, "experts.down_proj": new_down}, (x,),
                                     strict=False)
    return (out[0] if isinstance(out, tuple) else out), leaves, ref


@pytest.mark.parametrize("quant", ["bf16", "int4"])
@pytest.mark.parametrize("tokens", [1, 7, 33, "one_expert"])
def test_expert_adapter_gradients_match_float64_autograd(quant, tokens):
    ref_model, inj = models("qwen3_moe", quant)
    inj = _lora(inj.requires_grad_(False), EXPERTS)
    name, block = _blocks(inj)[1]
    hf_block = dict(ref_model.named_modules())[name.removeprefix("base_model.model.")]
    H = block.hidden_size
    T = 9 if tokens == "one_expert" else tokens
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(1, T, H, generator=gen)
    if tokens == "one_expert":  # every token routed to the same experts: the router's argmax by a big offset
        x = x * 0.01 + 3.0 * hf_block.gate.weight[0].detach()
    block.gate.weight.requires_grad_(True)
    x64 = x.double().requires_grad_()
    out_ref, leaves, ref = _reference(hf_block, block, x64, scale=8 / 4)
    xi = x.clone().requires_grad_()
    out = block(xi)
    out = out[0] if isinstance(out, tuple) else out
    R = torch.randn(out.shape, generator=gen)
    (out_ref * R.double()).sum().backward()
    (out * R).sum().backward()
    torch.testing.assert_close(out.double(), out_ref.detach(), rtol=1e-4, atol=1e-5)
    routed = set(block.routing(x.reshape(-1, H))[1].reshape(-1).tolist())
    if tokens == "one_expert":
        assert len(routed) == block.top_k  # (every token on the same k experts)
    assert len(routed) < block.num_experts or T > 1  # (one token: experts with no tokens)
    for (e, p), (a64, b64) in leaves.items():
        m = block.experts[e]._modules[p]
        ga, gb = m.lora_A["default"].weight.grad, m.lora_B["default"].weight.grad
        if e not in routed:
            assert ga is None or not ga.any(), (e, p)
            continue
        torch.testing.assert_close(ga.double(), a64.grad, rtol=1e-3, atol=1e-5, msg=f"lora_A of {e} {p}")
        torch.testing.assert_close(gb.double(), b64.grad, rtol=1e-3, atol=1e-5, msg=f"lora_B of {e} {p}")
    torch.testing.assert_close(xi.grad.double(), x64.grad, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(block.gate.weight.grad.double(), ref.gate.weight.grad, rtol=1e-3, atol=1e-5)


def test_expert_lora_trains_and_round_trips(tmp_path):
    model = build_tiny_model("qwen3_moe", seed=0)
    inject(model, gpu="cpu", quant="int4")
    packed = [b.native_experts.export() for _, b in _blocks(model)]
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                       target_modules=["q_proj", *EXPERTS]))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(".experts.3.expert_down_proj.lora_B" in n for n in names) and all("lora_" in n for n in names)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = model(input_ids=BATCH, labels=BATCH).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.2, losses
    moved = [n for n, p in model.named_parameters() if "experts" in n and "lora_B" in n and p.abs().sum() > 0]
    assert len(moved) == 3 * 8 * len(packed)  # every expert of every block was routed to and trained
    assert all(torch.equal(b.native_experts.export(), p) for (_, b), p in zip(_blocks(model), packed))
    model.eval()
    with torch.no_grad():
        trained = model(BATCH).logits
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    assert any(".experts.0.expert_gate_proj.lora_A.weight" in k for k in
               load_file(str(tmp_path / lora_merge.WEIGHTS_FILE)))

    fresh = build_tiny_model("qwen3_moe", seed=0)
    inject(fresh, gpu="cpu", quant="int4")
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(BATCH).logits, trained)  # PEFT's own load: identical logits

    plain = build_tiny_model("qwen3_moe", seed=0)
    inject(plain, gpu="cpu", quant="int4", lora=tmp_path)  # inference: q_proj merged, the experts' on the CPU
    assert all(b.expert_lora is not None for _, b in _blocks(plain))
    with torch.no_grad():
        torch.testing.assert_close(plain(BATCH).logits, trained, rtol=1e-4, atol=1e-4)
    with pytest.raises(lora_merge.LoraError, match="routed experts"):
        lora_merge.save_merged(tmp_path, tmp_path, tmp_path / "merged")


def test_transformers4_expert_names_load_for_inference(tmp_path):
    """An adapter with transformers 4.x's per-expert names (experts.E.gate_proj) applies as ours does."""
    from safetensors.torch import load_file, save_file

    inj = build_tiny_model("qwen3_moe", seed=0)
    inject(inj, gpu="cpu")
    inj = _lora(inj, EXPERTS)
    with torch.no_grad():
        want = inj(BATCH).logits
    inj.save_pretrained(tmp_path / "ours")
    tensors = load_file(str(tmp_path / "ours" / "adapter_model.safetensors"))
    (tmp_path / "v4").mkdir()
    save_file({k.replace(".expert_", "."): v for k, v in tensors.items()},
              str(tmp_path / "v4" / lora_merge.WEIGHTS_FILE))
    (tmp_path / "v4" / lora_merge.CONFIG_FILE).write_text((tmp_path / "ours" / lora_merge.CONFIG_FILE).read_text())
    plain = build_tiny_model("qwen3_moe", seed=0)
    inject(plain, gpu="cpu", lora=tmp_path / "v4")
    with torch.no_grad():
        torch.testing.assert_close(plain(BATCH).logits, want, rtol=1e-4, atol=1e-4)


def test_expert_lora_refused_where_the_block_cannot_take_it(tmp_path):
    model = build_tiny_model("llama4", seed=0)
    inject(model, gpu="cpu")
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=EXPERTS))
    with pytest.raises(OperatorError, match="scale each expert's input"):
        model(BATCH)
    from ktinject.train.loop import FinetuneError, check_expert_adapters

    with pytest.raises(FinetuneError, match="Llama 4"):
        check_expert_adapters(model)
    unadapted = build_tiny_model("qwen3_moe", seed=0)  # not injected: its experts are HF's fused tensors
    adapter = tmp_path / "a"
    inj = build_tiny_model("qwen3_moe", seed=0)
    inject(inj, gpu="cpu")
    _lora(inj, EXPERTS).save_pretrained(adapter)
    with pytest.raises(lora_merge.LoraError, match="not an injected MoE block"):
        lora_merge.merge_adapter(unadapted, adapter)


def test_no_adapter_no_change():
    """Without expert adapters the block takes its native path, state-dict keys as before; a stand-in is not
    callable."""
    ref = build_tiny_model("qwen3_moe", seed=0)
    inj = copy.deepcopy(ref)
    inject(inj, gpu="cpu")
    _, block = _blocks(inj)[0]
    assert expert_lora.factors(block) is None
    assert not any("experts" in k for k in inj.state_dict())
    with pytest.raises(OperatorError, match="not called on its own"):
        block.experts[0].expert_gate_proj(torch.zeros(1, block.hidden_size))
    assert expert_lora.split_name("model.layers.1.mlp.experts.5.gate_proj") == ("model.layers.1.mlp", 5,
                                                                               "expert_gate_proj")
    assert expert_lora.split_name("model.layers.1.mlp.shared_experts.gate_proj") is None


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_the_torch_path_is_the_hf_model_where_the_adapters_add_nothing(monkeypatch, family):
    """Adapters with B = 0 (PEFT's initialization): the experts' torch path (its biases, activation, shared
    experts, routing) gives HF's float32 logits with the same stored expert values, to float32 rounding (its base
    products in float, whatever the default); the native path (bf16 activations) is further off."""
    monkeypatch.setenv("KTINJECT_EXPERT_PRODUCTS", "float")
    ref, inj = models(family, "bf16")
    targets = ["expert_gate_proj", "expert_up_proj", "expert_down_proj"]
    inj = peft.get_peft_model(inj.requires_grad_(False), peft.LoraConfig(r=2, target_modules=targets))
    assert all(expert_lora.factors(b) is not None for _, b in _blocks(inj))
    with torch.no_grad():
        want, got = ref(BATCH).logits, inj(BATCH).logits
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)


def test_finetune_with_expert_adapters_on_the_demo_model(tmp_path, demo_env):
    """``ktinject finetune --target-modules q_proj,experts`` on the demo model: the loss falls, the adapter holds
    every expert's A and B, and from_pretrained(lora=DIR) gives PEFT's own load of it; chat --lora runs with it."""
    import subprocess
    import sys

    from ktinject import from_pretrained
    from ktinject.demo import demo_model_dir, finetune_text
    from ktinject.train.loop import FinetuneConfig, finetune

    out = tmp_path / "adapter"
    result = finetune(FinetuneConfig(demo_model_dir(), out, text=[finetune_text()], seq_len=64, steps=4, batch=2,
                                     lr=3e-3, target_modules=["q_proj", "experts"], eval_fraction=0.0),
                      progress=False, report=lambda line: None)
    assert result.losses[-1] < result.losses[0], result.losses
    experts = [n for n in result.target_modules if ".experts." in n]
    model = from_pretrained(demo_model_dir(), gpu="cpu", progress=False, lora=out)
    blocks = _blocks(model)
    assert blocks and len(experts) == 3 * sum(b.num_experts for _, b in blocks)
    ref = peft.PeftModel.from_pretrained(from_pretrained(demo_model_dir(), gpu="cpu", progress=False), out)
    for m in ref.modules():  # PEFT's merge of the attention adapters (what lora=DIR does to them); experts unmerged
        if isinstance(m, peft.tuners.lora.Linear) and not isinstance(m.base_layer, expert_lora.ExpertProjection):
            m.merge()
    ids = BATCH % model.config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)
    r = subprocess.run([sys.executable, "-m", "ktinject.chat", "--prompt", "The lighthouse", "--max-new-tokens", "6",
                        "--temperature", "0", "--gpu", "cpu", "--threads", "1", "--prefix-cache", "off", "--lora",
                        str(out)], env=demo_env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    with torch.no_grad():
        base = from_pretrained(demo_model_dir(), gpu="cpu", progress=False)(ids).logits
        assert (model(ids).logits - base).abs().max() > 0.1  # (the adapter changes the model)
