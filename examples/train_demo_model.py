"""Train ktinject's demo model: a small Qwen3-MoE on the English text of Debian's `fortunes` package.

Three stages, reproducible from SEED:

  python examples/train_demo_model.py prepare --out .demo_data      # here: fetch the text, split it, train the BPE
  python examples/train_demo_model.py train --data .demo_data --out .demo_out --minutes 6   # on a GPU
  python examples/train_demo_model.py package --from .demo_out       # into ktinject/demo/demo_model/ (with checksums)

Data: the fortune files of Debian's `fortunes` package (fortune-mod 1.99.1, BSD licence; `apt-get download fortunes`,
so nothing but a package registry is needed), minus the ASCII-art files and a few categories not fit for a demo.
Fortunes are split on their `%` lines, shuffled with SEED, and 5% are held out (never trained on) for
`python -m ktinject.eval`. The tokenizer is a byte-level BPE trained on the training part only. Training mixes
plain fortunes with chat-formatted ones (a user request, the fortune as the answer), so the chat gets an answer
in English. The checkpoint with the lowest held-out loss is kept.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

SEED = 2026
EXCLUDED = {"art", "ascii-art", "ethnic", "men-women", "drugs", "translate-me", "politics", "love", "sex"}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 2048
REQUESTS = ["Tell me something.", "Say something wise.", "Tell me a joke.", "Any advice for today?",
            "What do you think about computers?", "Tell me a story.", "Hello!", "What is the meaning of life?",
            "Tell me about science.", "Give me a quote.", "What should I know about work?", "Cheer me up."]
MODEL = dict(hidden_size=192, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=48, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=96,
             norm_topk_prob=True, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=True,
             output_router_logits=True, router_aux_loss_coef=0.01)
SEQ = 256
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def prepare(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["apt-get", "download", "fortunes"], cwd=tmp, check=True, capture_output=True)
        deb = next(Path(tmp).glob("fortunes_*.deb"))
        subprocess.run(["dpkg", "-x", str(deb), f"{tmp}/x"], check=True)
        src = Path(tmp, "x/usr/share/games/fortunes")
        fortunes = []
        for f in sorted(src.iterdir()):
            if f.suffix or f.name in EXCLUDED:
                continue
            text = f.read_text(encoding="utf-8", errors="replace")
            fortunes += [p.strip("\n") for p in text.split("\n%\n") if p.strip()]
        shutil.copy(Path(tmp, "x/usr/share/doc/fortunes/copyright"), out / "LICENSE.fortunes")
    random.Random(SEED).shuffle(fortunes)
    n_held = len(fortunes) // 20
    (out / "heldout.txt").write_text("\n%\n".join(fortunes[:n_held]) + "\n")
    (out / "train.txt").write_text("\n%\n".join(fortunes[n_held:]) + "\n")
    tokenizer = train_tokenizer(fortunes[n_held:])
    tokenizer.save_pretrained(out / "tokenizer")
    print(f"{len(fortunes)} fortunes, {n_held} held out; tokenizer of {len(tokenizer)} tokens in {out}")


def train_tokenizer(texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts + [f"{r}\n" for r in REQUESTS], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _stream(tokenizer, fortunes, rng):
    """One token stream: fortunes as plain text or as a chat answer (40%), separated by <|endoftext|>."""
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = []
    for text in fortunes:
        if rng.random() < 0.4:
            msgs = [{"role": "user", "content": rng.choice(REQUESTS)}, {"role": "assistant", "content": text}]
            ids += tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False)
        else:
            ids += tokenizer(text)["input_ids"]
        ids.append(eot)
    return ids


def train(data: Path, out: Path, minutes: float, device: str = "cuda") -> None:
    import torch
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    tokenizer = AutoTokenizer.from_pretrained(data / "tokenizer")
    train_f = (data / "train.txt").read_text().split("\n%\n")
    held_f = (data / "heldout.txt").read_text().split("\n%\n")
    train_ids = torch.tensor(_stream(tokenizer, train_f, rng))
    held_ids = torch.tensor(sum((tokenizer(t)["input_ids"] + [tokenizer.pad_token_id] for t in held_f), []))
    cfg = Qwen3MoeConfig(vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **MODEL)
    dev = torch.device(device)
    model = Qwen3MoeForCausalLM(cfg).to(dev)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; {len(train_ids)} train tokens, "
          f"{len(held_ids)} held-out tokens")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    B, warm, t0, step, best = 64, 200, time.time(), 0, float("inf")
    budget = minutes * 60
    train_ids, held_ids = train_ids.to(dev), held_ids.to(dev)
    while time.time() - t0 < budget:
        frac = (time.time() - t0) / budget
        for g in opt.param_groups:
            g["lr"] = 3e-3 * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        starts = torch.randint(0, len(train_ids) - SEQ - 1, (B,), device=dev)
        batch = torch.stack([train_ids[s:s + SEQ] for s in starts.tolist()])
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 250 == 0 or time.time() - t0 >= budget:
            held = held_loss(model, held_ids)
            print(f"step {step} {time.time() - t0:.0f}s train {loss.item():.3f} held-out {held:.3f} "
                  f"(ppl {math.exp(held):.1f})", flush=True)
            if held < best:
                best = held
                model.config.dtype = torch.bfloat16
                model.save_pretrained(out, state_dict={k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    tokenizer.save_pretrained(out)
    shutil.copy(data / "heldout.txt", out / "heldout.txt")
    shutil.copy(data / "LICENSE.fortunes", out / "LICENSE.fortunes")
    print(f"best held-out loss {best:.3f} (ppl {math.exp(best):.1f}) after {step} steps; saved in {out}")


def held_loss(model, ids):
    import torch

    with torch.no_grad(), torch.autocast(ids.device.type, dtype=torch.bfloat16):
        n = (len(ids) - 1) // SEQ
        total = 0.0
        for i in range(0, n, 32):
            chunk = torch.stack([ids[j * SEQ:(j + 1) * SEQ + 1] for j in range(i, min(n, i + 32))])
            logits = model(chunk[:, :-1]).logits.float()
            total += torch.nn.functional.cross_entropy(logits.transpose(1, 2), chunk[:, 1:], reduction="sum").item()
        return total / (n * SEQ)


def package(src: Path) -> None:
    dest = Path(__file__).resolve().parents[1] / "ktinject" / "demo_model"
    dest.mkdir(exist_ok=True)
    names = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "chat_template.jinja", "heldout.txt", "LICENSE.fortunes"]
    sums = {}
    for name in names:
        if (src / name).exists():
            shutil.copyfile(src / name, dest / name)
            if name == "config.json":  # an inference checkpoint: bf16 weights, no router aux loss
                cfg = json.loads((dest / name).read_text())
                cfg.update(dtype="bfloat16", output_router_logits=False)
                (dest / name).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            if name == "generation_config.json":  # the chat's default: sampled, fortune-like replies
                cfg = json.loads((dest / name).read_text())
                cfg.update(do_sample=True, temperature=0.7, top_p=0.9)
                # every training document ends with <|endoftext|> (the pad token), a chat answer with <|im_end|>
                # first: the model ends a reply with either, so both stop generation
                cfg["eos_token_id"] = [cfg["eos_token_id"], cfg["pad_token_id"]]
                (dest / name).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            (dest / name).chmod(0o644)
            sums[name] = hashlib.sha256((dest / name).read_bytes()).hexdigest()
    (dest / "SHA256SUMS.json").write_text(json.dumps(sums, indent=1, sort_keys=True) + "\n")
    print(f"packaged {len(sums)} files into {dest}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="stage", required=True)
    sub.add_parser("prepare").add_argument("--out", type=Path, required=True)
    t = sub.add_parser("train")
    t.add_argument("--data", type=Path, required=True)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--minutes", type=float, default=6.0)
    t.add_argument("--device", default="cuda")
    sub.add_parser("package").add_argument("--from", dest="src", type=Path, required=True)
    a = p.parse_args()
    if a.stage == "prepare":
        prepare(a.out)
    elif a.stage == "train":
        train(a.data, a.out, a.minutes, a.device)
    else:
        package(a.src)


if __name__ == "__main__":
    main()
