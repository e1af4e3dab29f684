"""Collect expert activation statistics: ``python -m ktinject.calibrate --model DIR --prompts FILE --out stats``.

Loads the model through ktinject, runs each prompt (its chat template applied when the tokenizer has one, unless
--raw) and generates --max-new-tokens tokens greedily, counting on the device the (token, slot) pairs each layer's
router sends to each expert (prompt and generated tokens alike). Writes them with
``ktinject.gpu_experts.hot.stats.save_stats`` (safetensors; JSON when OUT ends in .json). Use them as the hot-expert
option ``stats``: ``--expert-stats OUT`` (chat), ``inject(model, gpu_experts_budget=..., stats="OUT")`` (also
``from_pretrained``) or the moe rule kwarg ``stats: OUT``; with stats, placement defaults to ``frequency``.

Like the chat, a CLI: torch and the model code are imported inside ``main`` (after the arguments and paths are
checked), so usage errors come back at once.

Prompts FILE: plain text, one prompt per line (blank lines and lines starting with # skipped), or JSON Lines
(``.jsonl``) with a "prompt", "text" or "messages" (chat messages) field per line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ktinject.cli.options import positive

PROG = "ktinject.calibrate"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--prompts", required=True, help="prompts file (text: one per line; or .jsonl)")
    p.add_argument("--out", required=True, help="statistics file to write (safetensors; .json for JSON)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--rules", help="rules YAML file or packaged name (default: the model family's)")
    p.add_argument("--quant", choices=["bf16", "int8", "int4"],
                   help="expert weight format (default: the rules' quant, else bf16)")
    p.add_argument("--gpu", help='device for the dense part (default "cuda" if available, else "cpu")')
    p.add_argument("--threads", type=positive, help="CPU threads for the experts and for torch (as the chat's)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    return p.parse_args(argv)


def read_prompts(path) -> list:
    """Prompts from a file: strings, or lists of chat messages (from .jsonl "messages")."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}")
    out: list = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or (path.suffix != ".jsonl" and line.lstrip().startswith("#")):
            continue
        if path.suffix == ".jsonl":
            item = json.loads(line)
            value = next((item[k] for k in ("messages", "prompt", "text") if k in item), None) \
                if isinstance(item, dict) else item
            if not isinstance(value, (str, list)):
                raise ValueError(f"{path}:{n}: expected a string or an object with prompt/text/messages")
            out.append(value)
        else:
            out.append(line)
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def encode(tokenizer, prompt, raw: bool):
    """Token ids [1, S] of one prompt (chat template unless raw or the tokenizer has none)."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if not raw and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    return tokenizer(text, return_tensors="pt").input_ids


def calibrate(model, tokenizer, prompts, max_new_tokens: int = 64, raw: bool = False):
    """Run ``prompts`` through an injected model from zeroed counts; returns its ExpertStats."""
    import torch

    from ktinject.gpu_experts.hot import stats as expert_stats

    expert_stats.reset_stats(model)
    device = model.get_input_embeddings().weight.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for prompt in prompts:
        ids = encode(tokenizer, prompt, raw).to(device)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                           do_sample=False, pad_token_id=pad)
    return expert_stats.read_stats(model)


def summary(stats) -> str:
    c = stats.counts.double()
    E = c.shape[1]
    top = max(1, E // 8)
    share = float(c.sort(1, descending=True).values[:, :top].sum() / c.sum().clamp_min(1))
    return (f"{stats.total} routed (token, slot) pairs over {len(stats.layers)} MoE layers x {E} experts; the top "
            f"{top} experts of each layer take {100 * share:.1f}%")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        prompts = read_prompts(args.prompts)
        model_dir = Path(args.model)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"not a Hugging Face model directory (no config.json): {args.model}")
    except (OSError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    from ktinject.cli.chat import load_model
    from ktinject.cli.options import CliError, device
    from ktinject.gpu_experts.hot import stats as expert_stats

    try:
        gpu = device(args)  # --threads for torch and the experts; torch on one thread on the CPU path
    except CliError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    model, tokenizer, _ = load_model(model_dir, args.rules, quant=args.quant, progress=sys.stderr.isatty(), gpu=gpu)
    stats = calibrate(model, tokenizer, prompts, args.max_new_tokens, args.raw)
    out = expert_stats.save_stats(stats, args.out)
    print(f"{len(prompts)} prompts, {summary(stats)}; wrote {out} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
