"""``python -m ktinject.eval``: perplexity and next-token agreement of injected configurations on a text.

Every configuration loads the same checkpoint. The reference is the plain Hugging Face model in float32; each row
gives its perplexity on the text and how often its next-token argmax equals the reference's (agreement):

  hf-bf16   plain HF in bfloat16 (what a user gets without ktinject)
  bf16      injected, routed experts in bf16 on the CPU (native kernels)
  int8      injected, int8 experts (W8A8)
  int4      injected, group-wise int4 experts (W4A8)

The text is tokenized once and cut into windows of ``--window`` tokens; in each window every token after the first
is predicted from the ones before it. ``--defer 1,2,0.3`` adds, per injected configuration, rows scored token by
token (one decode step per token, a batch of windows at a time, as generation runs) with expert deferral of 0 (the
baseline in this mode), 1 and 2 slots per token and 30% of each token's routing weight (an int: slots, a float:
a share; ``ktinject.operators.deferral``): deferral acts in decode steps only. Beside the rows: a unigram model fit
on the text itself (the best any unigram model can do on it, so a lower bound of its perplexity). Without
``--text`` the trained demo model's held-out fortunes are used, and without ``--model`` the demo model.
Legend: W window, V vocabulary, N predicted positions.
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from dataclasses import dataclass

import torch

from ktinject.cli.options import defer_list, defer_settings, experts_format

log = logging.getLogger(__name__)

CONFIGS = ("hf-bf16", "bf16", "int8", "int4")


@dataclass
class Scores:
    """Summed over the predicted positions: negative log-likelihood (nats), argmax agreement, count."""
    nll: float = 0.0
    agree: int = 0
    n: int = 0

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.n) if self.n else float("nan")

    @property
    def agreement(self) -> float:
        return self.agree / self.n if self.n else float("nan")


def windows(ids: torch.Tensor, window: int) -> list[torch.Tensor]:
    """Consecutive windows of ``window`` tokens of ids [T] (a last shorter one kept when it has 2+ tokens)."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) >= 2]


@torch.no_grad()
def score(model, chunks: list[torch.Tensor], reference: list[torch.Tensor] | None = None, device=None):
    """(Scores, argmax per window [W-1] each) of ``model`` on ``chunks``; ``reference``: the reference's argmaxes
    to count agreement against (None: agreement with itself)."""
    s = Scores()
    argmaxes = []
    dev = device or next(p.device for p in model.parameters() if p.device.type != "meta")
    for i, chunk in enumerate(chunks):
        ids = chunk.to(dev)[None]  # [1, W]
        logits = model(ids).logits[0, :-1].float()  # [W-1, V]
        target = ids[0, 1:]
        s.nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        top = logits.argmax(-1).cpu()
        argmaxes.append(top)
        s.agree += int((top == (reference[i] if reference is not None else top)).sum())
        s.n += target.numel()
    return s, argmaxes


@torch.no_grad()
def score_decode(model, chunks: list[torch.Tensor], reference: list[torch.Tensor] | None = None, device=None,
                 batch: int = 32):
    """``score``, token by token: each window's tokens fed one decode step at a time (a KV cache; windows of one
    length ``batch`` at a time), so that what acts in decode steps only (expert deferral) acts."""
    from transformers import DynamicCache

    from ktinject import compat

    s = Scores()
    dev = device or next(p.device for p in model.parameters() if p.device.type != "meta")
    tops: dict[int, torch.Tensor] = {}
    by_len: dict[int, list[int]] = {}
    for i, c in enumerate(chunks):
        by_len.setdefault(len(c), []).append(i)
    for idx in by_len.values():
        for g in range(0, len(idx), batch):
            rows = idx[g:g + batch]
            ids = torch.stack([chunks[i] for i in rows]).to(dev)  # [B, W]
            cache = DynamicCache(config=model.config)
            steps = [model(ids[:, t:t + 1], **compat.cache_arg(cache), use_cache=True).logits[:, -1].float()
                     for t in range(ids.shape[1] - 1)]
            logits = torch.stack(steps, 1)  # [B, W-1, V]
            target = ids[:, 1:]
            s.nll += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum"))
            s.n += target.numel()
            for j, i in enumerate(rows):
                tops[i] = logits[j].argmax(-1).cpu()
                s.agree += int((tops[i] == (reference[i] if reference is not None else tops[i])).sum())
    return s, [tops[i] for i in range(len(chunks))]


def unigram_perplexity(chunks: list[torch.Tensor]) -> float:
    """Perplexity of the unigram model fit on the predicted tokens themselves (maximum likelihood)."""
    targets = torch.cat([c[1:] for c in chunks])
    counts = torch.bincount(targets).double()
    p = counts[targets] / targets.numel()
    return math.exp(float(-p.log().mean()))


def load(model_dir, config: str, gpu: str, **inject_kwargs):
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if config == "hf-float32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    if config in ("hf-float32", "hf-bf16"):
        return model.to(gpu)
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; use {', '.join(CONFIGS)}")
    import ktinject

    ktinject.inject(model, gpu=gpu, quant=config, **inject_kwargs)
    return model


def _label(name: str, model) -> str:
    """The configuration's row name; int4 says its group size (``native.default_group_size`` picks it by shape)."""
    if name.startswith("hf-"):
        return f"HF {name[3:]}"
    return f"ktinject {experts_format(model) if name == 'int4' else name}"


def run(model_dir, text: str, configs, gpu: str = "cpu", window: int = 256, max_tokens: int | None = None,
        defers=(), on_row=None, **inject_kwargs) -> list[tuple[str, Scores]]:
    """[(name, Scores)]: the float32 reference first, then each configuration; with ``defers`` (deferral settings:
    ints, slots per token, and floats, shares of the routing weight), each injected configuration scored token by
    token again with expert deferral 0 and each of those. ``on_row(name, scores, seconds, done, total)`` is called
    as each row is scored (the CLI's progress lines)."""
    settings = defer_settings(defers) if defers else []
    total = 2 + len(configs) + len(settings) * sum(not c.startswith("hf") for c in configs)
    rows: list[tuple[str, Scores]] = []
    t0 = time.perf_counter()

    def add(name: str, scores: Scores) -> None:
        nonlocal t0
        rows.append((name, scores))
        if on_row is not None:
            on_row(name, scores, time.perf_counter() - t0, len(rows), total)
        t0 = time.perf_counter()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor(tok(text)["input_ids"])
    if max_tokens:
        ids = ids[:max_tokens]
    chunks = windows(ids, window)
    ref = load(model_dir, "hf-float32", gpu)
    ref_scores, ref_top = score(ref, chunks)
    del ref
    add("HF float32 (reference)", ref_scores)
    for name in configs:
        model = load(model_dir, name, gpu, **inject_kwargs)
        label = _label(name, model)
        add(label, score(model, chunks, ref_top)[0])
        for d in settings if not name.startswith("hf") else ():
            from ktinject.operators.deferral import set_defer

            set_defer(model, d)
            setting = f"mass {d}" if isinstance(d, float) else f"defer {d}"
            add(f"{label}{_STEPS}{setting}", score_decode(model, chunks, ref_top)[0])
        del model
    add("unigram fit on this text", Scores(nll=math.log(unigram_perplexity(chunks)) * ref_scores.n, n=ref_scores.n))
    return rows


_STEPS = ", decode steps, "  # deferral rows: "<configuration>, decode steps, defer d" (a count) or "... mass m"


def table(rows) -> str:
    """The rows as a Markdown table: perplexity against the reference (the first row) and, for deferral rows, against
    the same configuration's decode-step row at defer 0."""
    ref = rows[0][1].perplexity
    base = {name.split(_STEPS)[0]: s.perplexity for name, s in rows if name.endswith(f"{_STEPS}defer 0")}
    deferral = bool(base)
    head = "| configuration | perplexity | vs float32 |" + (" vs the same at defer 0 |" if deferral else "")
    out = [head + " next-token agreement with float32 |", "|---|---:|---:|" + ("---:|" if deferral else "") + "---:|"]
    for i, (name, s) in enumerate(rows):
        vs = "" if i == 0 else f"{s.perplexity / ref - 1:+.2%}"
        cells = [name, f"{s.perplexity:.2f}", vs]
        if deferral:
            stem = name.split(_STEPS)[0] if _STEPS in name else None
            zero = name.endswith(f"{_STEPS}defer 0")
            cells.append(f"{s.perplexity / base[stem] - 1:+.2%}" if stem in base and not zero else "")
        cells.append("" if i == 0 or name.startswith("unigram") else f"{s.agreement:.2%}")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + f"\n\n{rows[0][1].n} predicted tokens"


def _not_evaluable(model_dir) -> str | None:
    """Why ``model_dir`` cannot be scored here, or None: the reference is Hugging Face's own float32 model, so the
    checkpoint must be one transformers loads unquantized (a directory of config.json + safetensors)."""
    import json
    from pathlib import Path

    path = Path(model_dir)
    if path.is_file():
        return ("a file (GGUF?): eval compares against Hugging Face's float32 model, which needs a checkpoint "
                "directory with config.json; run the chat or the server on the file (ktinject.from_pretrained "
                "reads it)")
    config = path / "config.json"
    if not config.is_file():
        return "no config.json there: give a Hugging Face checkpoint directory"
    try:
        quant = json.loads(config.read_text(encoding="utf-8")).get("quantization_config")
    except (OSError, ValueError) as e:
        return f"config.json does not read as JSON ({e})"
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        return (f"a quantized release (quantization_config: {method}): eval's reference is the unquantized "
                "Hugging Face model, so it takes bf16 / float32 checkpoints; load this one with "
                "ktinject.from_pretrained (the chat, the server)")
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ktinject.eval", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the trained demo model)")
    p.add_argument("--text", help="a UTF-8 text file (default: the demo model's held-out fortunes)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--gpu", default="cuda" if torch.cuda.is_available() else "cpu", help="device of the dense part")
    p.add_argument("--window", type=int, default=256, help="tokens per window (default 256)")
    p.add_argument("--max-tokens", type=int, help="evaluate only the first N tokens of the text")
    p.add_argument("--gpu-experts-budget", help="hot experts on the GPU for the injected configurations, e.g. 1MiB")
    p.add_argument("--defer", default="", help="comma-separated expert-deferral settings, e.g. 1,2,0.3 (an int: "
                   "slots per token; a float 0 < M < 1: a share of each token's routing weight): the injected "
                   "configurations also scored token by token with deferral 0 and each of these")
    a = p.parse_args(argv)
    from ktinject import demo

    model_dir = a.model or demo.demo_model_dir()
    problem = _not_evaluable(model_dir)
    if problem:
        p.error(f"--model {model_dir}: {problem}")
    try:
        text = open(a.text, encoding="utf-8").read() if a.text else demo.heldout_text()
    except OSError as e:
        p.error(f"--text: {e}")
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        p.error(f"--configs: unknown {', '.join(bad)}; use {', '.join(CONFIGS)}")
    kw = {"gpu_experts_budget": a.gpu_experts_budget} if a.gpu_experts_budget else {}
    try:
        defers = defer_list(a.defer)
    except argparse.ArgumentTypeError as e:
        p.error(f"--defer {a.defer!r}: {e}")
    def progress(name, scores, seconds, done, total):  # stderr: the table on stdout stays clean
        print(f"[{done}/{total}] {name}: perplexity {scores.perplexity:.2f} ({seconds:.1f} s)", file=sys.stderr,
              flush=True)

    rows = run(model_dir, text, configs, a.gpu, a.window, a.max_tokens, defers, on_row=progress, **kw)
    print(f"model {model_dir}, gpu {a.gpu}, window {a.window}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
