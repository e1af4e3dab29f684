"""bench finetune on a CPU: the ktinject and hf-offload rows on the tiny qwen3_moe model (their table rows, finite
losses that fall), the offload device map, the GPU cap's share, the per-layer activation count, the backward
kernels' line against the read bound, and the options' errors.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

from ktinject.bench import BENCHES, finetune, finetune_offload, finetune_rows
from ktinject.bench.model import build_tiny


def _table(out: str) -> dict[str, list[str]]:
    """Row name -> cells of the markdown table in ``out``."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith("| row "):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0]] = cells
    return rows


def test_registered():
    assert BENCHES["finetune"] == "ktinject.bench.finetune"


def test_ktinject_and_hf_offload_rows_on_a_cpu(capsys):
    rc = finetune.main(["--tiny", "--seq", "16", "--steps", "1", "--warmup", "1", "--rows", "ktinject,hf-offload",
                        "--kernels", "off", "--threads", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = _table(out)
    assert list(rows) == ["ktinject bf16", "hf-offload"], out
    for name, cells in rows.items():
        assert float(cells[1].replace(",", "")) > 0
        first, last = (float(x) for x in cells[4].split(" -> "))
        assert math.isfinite(first) and math.isfinite(last) and last < first, (name, cells[4])
        assert cells[3] == "- (no GPU)"
    assert "expert_gate_proj" in rows["ktinject bf16"][5]
    offload = rows["hf-offload"][5]
    assert re.search(r"0 of 2 layers' experts on the GPU, 2 offloaded to the CPU", offload), offload
    assert "gradient checkpointing on" in offload
    # PEFT's fused-expert LoRA cannot run offloaded today: the row says so and adapts the attention; if a later PEFT
    # can, the row names the fused experts instead
    fused = "mlp.experts.gate_up_proj (target_parameters)" in offload
    assert ("this row adapts the attention only" in offload) != fused, offload
    assert re.search(r"ktinject bf16 / hf-offload: \d+\.\d\dx tokens/s \(target >= 3x: (not )?met; CPU-only run\)",
                     out)
    assert "# models: one build, each row on a copy of it" in out


def test_offload_map_keeps_the_cap_share_on_the_gpu():
    model = build_tiny(torch.device("cpu"))
    experts = [n for n, _ in model.named_modules() if n.endswith(".mlp.experts")]
    assert len(experts) == 2  # (the tiny model's first layer is dense)
    for share, on_gpu in ((0.0, 0), (0.5, 1), (0.99, 1), (1.0, 2)):
        dmap = finetune_offload.offload_map(model, share, "GPU")
        assert [dmap[n] for n in experts] == ["GPU"] * on_gpu + ["cpu"] * (2 - on_gpu)
        assert all(d == "GPU" for n, d in dmap.items() if n not in experts)
        for p, _ in model.named_parameters():  # every tensor in exactly one mapped module
            assert sum(p == n or p.startswith(n + ".") for n in dmap) == 1, p


def test_resident_share_of_the_48_layer_model():
    dense, layer = finetune_offload.full_model_bytes()
    assert layer == 128 * 3 * 2048 * 768 * 2
    assert finetune_offload.resident_share(0) == 0.0
    assert finetune_offload.resident_share(dense + 49 * layer) == 1.0
    share = finetune_offload.resident_share(24 << 30)
    assert 0 < share < 1 and math.isclose(share, ((24 << 30) - dense - layer) / (48 * layer))


def test_layer_activations_count_each_layer_without_parameters():
    model = build_tiny(torch.device("cpu"))
    model.model.embed_tokens.weight.requires_grad_(True)  # every layer on the gradient's path
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    acts = finetune_rows.LayerActivations(model, torch.device("cpu"))
    with acts:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    H = model.config.hidden_size
    assert len(acts.per_layer) == model.config.num_hidden_layers
    assert all(n >= 12 * H * 4 for n in acts.per_layer)  # at least one [T, H] float32 tensor a layer
    for n, layer in zip(acts.per_layer, finetune_rows.decoder_layers(model)):  # 12 tokens' activations, fewer
        assert n < sum(p.numel() * p.element_size() for p in layer.parameters())  # bytes than the layer's weights


def test_kernel_lines_against_the_read_bound():
    lines = finetune.kernel_lines(["bf16"], 2, tiny=True)
    assert lines[0].startswith("backward (Qwen3-30B-A3B experts")
    assert any(ln.startswith("read bound (--tiny") for ln in lines)
    shares = [ln for ln in lines if "of the read bound" in ln]
    assert [ln.split()[2] + ln.split()[3] for ln in shares] == ["T1:", "T16:", "T256:"]
    for ln in shares:
        gbs, pct = re.search(r": ([\d.]+) GB/s = (\d+)% of", ln).groups()
        assert float(gbs) > 0 and int(pct) >= 0


@pytest.mark.parametrize("argv,message", [
    (["--rows", "ktinject,foo"], "--rows 'ktinject,foo': expected a comma list of ktinject, hf-offload, hf-gpu"),
    (["--quant", "fp4"], "--quant 'fp4': expected a comma list of bf16, int8, int4"),
    (["--seq", "0"], "--seq must be at least 1, got 0"),
    (["--gpu-cap", "-1"], "--gpu-cap must be a positive number of GiB, got -1.0"),
])
def test_bad_options_say_what_to_fix(argv, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        finetune.main(["--tiny"] + argv)


def test_a_row_that_raises_is_a_failed_row_and_the_others_run(monkeypatch, capsys):
    def out_of_memory(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(finetune_rows, "run_hf_gpu", out_of_memory)
    rc = finetune.main(["--tiny", "--seq", "8", "--steps", "1", "--warmup", "1", "--rows", "hf-gpu,hf-offload",
                        "--kernels", "off", "--threads", "2", "--lora-experts", "off"])
    out = capsys.readouterr().out
    rows = _table(out)
    assert rc == 1 and list(rows) == ["hf-gpu", "hf-offload"], out
    assert rows["hf-gpu"][1:3] == ["n/a", "n/a"]
    assert rows["hf-gpu"][5] == "failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert float(rows["hf-offload"][1].replace(",", "")) > 0 and "LoRA on q_proj, k_proj, v_proj, o_proj" in out
    assert "failed or non-finite loss: hf-gpu" in out
