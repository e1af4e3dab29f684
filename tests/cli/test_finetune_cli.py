"""``ktinject finetune`` driven as a user would, on the demo model and its packaged text, on the CPU: a few steps
with a fixed seed lower the held-out perplexity; the adapter (PEFT's format) loads back merged, changes what the
model says, and gives PEFT's merged model's logits; --save-merged writes the same model; chat --lora uses it; bad
data files are one line naming the file and line, exit code 2; a bad --lora of chat and serve fails before the
load."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ktinject import from_pretrained, inject
from ktinject.cli import chat
from ktinject.cli import finetune as cli_finetune
from ktinject.cli import serve
from ktinject.demo import demo_model_dir, finetune_text
from ktinject.train.loop import FinetuneConfig, FinetuneError, finetune

REPO = Path(__file__).resolve().parents[2]
peft = pytest.importorskip("peft")


def run(env, module, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def trained(demo_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("finetune")
    r = run(demo_env, "ktinject.cli.main", "finetune", "--model", "demo", "--text", "demo", "--out",
            str(out / "adapter"), "--steps", "6", "--seq-len", "128", "--lr", "2e-3", "--seed", "0", "--gpu", "cpu",
            "--threads", "1", "--save-every", "3", "--save-merged", str(out / "merged"))
    assert r.returncode == 0, r.stderr
    return out, r


def test_finetune_lowers_the_held_out_perplexity(trained):
    out, r = trained
    adapter = out / "adapter"
    for name in ("adapter_config.json", "adapter_model.safetensors", "ktinject_base.json", "finetune.json"):
        assert (adapter / name).is_file(), name
    assert (adapter / "checkpoint-3" / "adapter_model.safetensors").is_file()
    result = json.loads((adapter / "finetune.json").read_text())["result"]
    assert result["steps"] == 6 and len(result["losses"]) == 6 and result["tokens"] == 6 * 4 * 128
    assert result["eval_ppl_after"] < 0.8 * result["eval_ppl_before"], result
    assert result["losses"][-1] < result["losses"][0]
    assert result["target_modules"][0] == "model.layers.0.self_attn.k_proj" and len(result["target_modules"]) == 16
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and sorted(config["target_modules"]) == [
        "k_proj", "o_proj", "q_proj", "v_proj"]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("12 blocks of 128 tokens to train on, 2 held out; LoRA r=8 alpha=16 on 16 modules")
    assert f"held-out perplexity {result['eval_ppl_before']:.3f} -> {result['eval_ppl_after']:.3f}" in r.stdout
    assert lines[-2:] == [f"adapter saved to {adapter}", f"merged model saved to {out / 'merged'}"]


def test_the_adapter_loads_merged_and_is_peft_s_merged_model(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = trained
    ref = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(demo_model_dir()), out / "adapter")
    ref = ref.merge_and_unload()
    inject(ref, gpu="cpu")
    tuned = from_pretrained(demo_model_dir(), gpu="cpu", progress=False, lora=out / "adapter")
    base = from_pretrained(demo_model_dir(), gpu="cpu", progress=False)
    merged = from_pretrained(out / "merged", gpu="cpu", progress=False)
    tok = AutoTokenizer.from_pretrained(demo_model_dir())
    ids = tok("The keeper of Gull Point", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = {name: m(ids).logits for name, m in (("tuned", tuned), ("ref", ref), ("base", base),
                                                       ("merged", merged))}
    assert torch.equal(logits["tuned"], logits["ref"]) and torch.equal(logits["merged"], logits["ref"])
    assert (logits["tuned"] - logits["base"]).abs().max() > 0.5
    greedy = dict(max_new_tokens=12, do_sample=False)
    assert not torch.equal(tuned.generate(ids, **greedy), base.generate(ids, **greedy))


def test_chat_with_lora(trained, demo_env, capsys):
    out, _ = trained
    common = ("--max-new-tokens", "12", "--temperature", "0", "--gpu", "cpu", "--threads", "1", "--prefix-cache",
              "off")
    replies = []
    for prompt in ("Tell me about the lighthouse.", "Tell me a fortune.", "What does the future hold?"):
        tuned = run(demo_env, "ktinject.chat", "--prompt", prompt, *common, "--lora", str(out / "adapter"))
        base = run(demo_env, "ktinject.chat", "--prompt", prompt, *common)
        assert tuned.returncode == 0 and base.returncode == 0, tuned.stderr + base.stderr
        assert f"LoRA {out / 'adapter'} (16 modules)" in tuned.stderr and "LoRA" not in base.stderr
        replies.append((tuned.stdout, base.stdout))
    # a few steps move the logits (the weights differ: tests/training/test_lora_merge.py), not every greedy reply
    assert all(t.strip() for t, _ in replies) and any(t != b for t, b in replies), replies
    assert chat.main(["--prompt", "hi", *common, "--lora", str(out)]) == 2  # the parent: no adapter_config.json; before the load
    assert f"--lora {out}: {out} is not a LoRA adapter directory" in capsys.readouterr().err
    assert serve.main(["--lora", str(out), "--port", "0"]) == 2  # the server's: before the port, before the load
    assert f"--lora {out}: {out} is not a LoRA adapter directory" in capsys.readouterr().err


def test_bad_data_is_one_line_naming_the_file_and_line(demo_env, tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                    '{"messages": [{"role": "user", "content": "no reply"}]}\n')
    r = run(demo_env, "ktinject.finetune", "--data", str(data), "--out", str(tmp_path / "a"), "--gpu", "cpu")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (f"ktinject finetune: error: {data}:2: the chat has no assistant "
                                                 f"turn, so nothing to learn from (roles: user)")
    with pytest.raises(FinetuneError, match=r"--seq-len 4096 is longer than the model's context \(2048 tokens\)"):
        finetune(FinetuneConfig(demo_model_dir(), tmp_path / "a", text=[finetune_text()], seq_len=4096))
    assert cli_finetune.main(["--text", "demo", "--out", str(tmp_path / "a"), "--steps", "2", "--epochs", "1"]) == 2
    assert "give --steps or --epochs, not both" in capsys.readouterr().err
