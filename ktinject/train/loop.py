"""``finetune(FinetuneConfig(...))``: LoRA on an injected model, a plain torch loop (``ktinject finetune``).

    load    from_pretrained(model, gpu=device): the dense part on ``device``, the routed experts on the CPU (every
            one: no hot experts, whose GPU kernels have no backward; prompts' experts on the CPU too)
    data    ``ktinject.train.data``: files -> documents -> packed blocks [N, S]; the last share held out
    adapt   peft.get_peft_model(LoraConfig(r, alpha, dropout, target_modules)): by default every linear projection
            of the attention modules; ``experts`` among the targets: the routed experts' gate, up and down
            projections too (``ktinject.operators.expert_lora``: per-expert adapters computed on the CPU); the
            adapters in float32, everything else frozen
    train   AdamW (constant learning rate, no weight decay) on micro-batches of ``batch`` blocks, ``grad_accum``
            of them per step, the blocks shuffled each epoch with ``seed``; a progress bar with the loss and
            tokens/s; the adapter saved every ``save_every`` steps (``OUT/checkpoint-STEP``) and at the end (``OUT``)
    eval    perplexity of the held-out blocks (their trained tokens) before and after

An adapter directory is PEFT's (``save_pretrained``) plus ``ktinject_base.json`` (the base weights' fingerprint,
``ktinject.injection.lora``) and, at the end, ``finetune.json`` (the figures and the settings). ``save_merged``
writes the base checkpoint with the adapter merged (``ktinject.injection.lora.save_merged``).

Legend: B batch, S sequence length, V vocabulary.
"""
from __future__ import annotations

import json
import logging
import math
import random
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ktinject.injection import lora as lora_merge
from ktinject.operators import expert_lora
from ktinject.operators.base import OperatorError
from ktinject.train import data, optim
from ktinject.train.loss import causal_lm_loss

log = logging.getLogger(__name__)

QUANTS = ("bf16", "int8", "int4", "fp8", "mxfp4")


class FinetuneError(ValueError):
    """Settings that cannot run; the message says what to change."""


@dataclass
class FinetuneConfig:
    model: Path  # a checkpoint directory
    out: Path  # the adapter's directory
    data: list[Path] = field(default_factory=list)  # JSONL files
    text: list[Path] = field(default_factory=list)  # plain text files
    seq_len: int = 256
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    target_modules: list[str] | None = None  # None: the attention projections
    lr: float = 2e-4
    steps: int | None = None  # None: from epochs
    epochs: float | None = None  # None with steps None: 1
    batch: int = 4
    grad_accum: int = 1
    seed: int = 0
    eval_fraction: float = 0.1
    save_every: int | None = None
    save_merged: Path | None = None
    device: str = "cpu"
    quant: str | None = None  # the routed experts' format (None: the checkpoint's)
    gradient_checkpointing: bool = False

    def __post_init__(self):
        self.model, self.out = Path(self.model), Path(self.out)
        self.data, self.text = [Path(p) for p in self.data], [Path(p) for p in self.text]
        if not (self.data or self.text):
            raise FinetuneError("no training data: give --data FILE.jsonl and / or --text FILE.txt")
        for name in ("seq_len", "rank", "batch", "grad_accum"):
            if getattr(self, name) < 1:
                raise FinetuneError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name, value in (("steps", self.steps), ("save_every", self.save_every)):
            if value is not None and value < 1:
                raise FinetuneError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.steps is not None and self.epochs is not None:
            raise FinetuneError("give --steps or --epochs, not both")
        if self.epochs is not None and not self.epochs > 0:
            raise FinetuneError(f"--epochs must be positive, got {self.epochs}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise FinetuneError(f"--lr must be a positive number, got {self.lr}")
        if not 0 <= self.dropout < 1:
            raise FinetuneError(f"--dropout must be in [0, 1), got {self.dropout}")
        if not 0 <= self.eval_fraction < 1:
            raise FinetuneError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        if self.quant is not None and self.quant not in QUANTS:
            raise FinetuneError(f"--quant {self.quant!r}: use one of {', '.join(QUANTS)}")
        if self.save_merged is not None:
            self.save_merged = Path(self.save_merged)


@dataclass
class FinetuneResult:
    adapter: Path
    steps: int
    losses: list[float]  # per optimizer step
    train_blocks: int
    eval_blocks: int
    target_modules: list[str]
    trainable_parameters: int
    eval_ppl_before: float | None
    eval_ppl_after: float | None
    tokens: int  # tokens trained on (positions not padding)
    seconds: float  # of the training steps (not the load nor the evaluations)
    merged: Path | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def attention_projections(model: nn.Module) -> list[str]:
    """The names (last component) of the linear layers directly inside the model's attention modules."""
    names = set()
    for module in model.modules():
        if "attention" in type(module).__name__.lower():
            names.update(n for n, child in module.named_children() if isinstance(child, nn.Linear))
    return sorted(names)


def peft_targets(targets: list[str]) -> list[str]:
    """PEFT's target_modules for ``targets``: the alias ``experts`` becomes the routed experts' projections."""
    if "experts" not in targets:
        return list(targets)
    return [t for t in targets if t != "experts"] + list(expert_lora.PROJECTIONS)


def check_expert_adapters(model: nn.Module) -> int:
    """The number of MoE blocks with routed-expert adapters; a FinetuneError for a block that cannot take them."""
    from ktinject.operators.moe import HybridMoE

    n = 0
    for name, block in model.named_modules():
        if isinstance(block, HybridMoE):
            try:
                n += expert_lora.factors(block, name) is not None
            except OperatorError as e:
                raise FinetuneError(f"--target-modules: {e}") from None
    return n


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    from ktinject.injection.formats.gguf import tokenizer_source

    source = tokenizer_source(model_dir)
    if source is not None:
        return AutoTokenizer.from_pretrained(source[0], gguf_file=source[1])
    return AutoTokenizer.from_pretrained(model_dir)


def _context(model_dir: Path) -> int | None:
    """The model's context (max_position_embeddings) from its config.json, read before the model loads."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None  # (a GGUF model: from_pretrained checks what it loads)


def make_blocks(config: FinetuneConfig, tokenizer, context: int | None) -> data.Blocks:
    """The packed blocks of the config's files (DataError for bad files)."""
    if context is not None and config.seq_len > context:
        raise FinetuneError(f"--seq-len {config.seq_len} is longer than the model's context ({context} tokens)")
    docs = []
    for path in config.data:
        docs += data.read_jsonl(path, tokenizer, config.seq_len)
    docs += [data.read_text(path, tokenizer) for path in config.text]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    return data.pack(docs, config.seq_len, pad)


def perplexity(model: nn.Module, blocks: data.Blocks, batch: int, device) -> float:
    """exp(mean NLL) of the blocks' trained tokens, each predicted from the positions before it."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(blocks), batch):
            part = blocks.take(slice(i, i + batch))
            labels = part.labels.to(device)
            n = int((labels[:, 1:] != data.IGNORE).sum())
            mean = causal_lm_loss(model, part.input_ids.to(device), labels, part.attention_mask.to(device))
            total += float(mean) * n
            count += n
    model.train(was_training)
    return math.exp(total / max(count, 1))


def _batches(n: int, batch: int, seed: int):
    """Row indices of micro-batches: every block once per epoch, a seeded shuffle each epoch, forever."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(n, generator=gen)
        for i in range(0, n, batch):
            yield order[i:i + batch]


def finetune(config: FinetuneConfig, progress: bool = True, report=None) -> FinetuneResult:
    """Train a LoRA adapter (module docstring); ``report(line)`` gets a few lines of what happens (default: the
    log)."""
    import peft
    from tqdm.auto import tqdm

    from ktinject.injection.loading import from_pretrained

    say = report or log.info
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(config.model)
    train, held = data.split(make_blocks(config, tokenizer, _context(config.model)), config.eval_fraction)
    model = from_pretrained(config.model, quant=config.quant, progress=progress, gpu=config.device,
                            gpu_experts_budget=0, prefill="cpu")  # (bad data fails before this)
    targets = peft_targets(config.target_modules or attention_projections(model))
    if not targets:
        raise FinetuneError(f"{type(model).__name__} has no linear layers in its attention modules: name the "
                            f"modules to adapt with --target-modules")
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        with warnings.catch_warnings():  # PEFT reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            model = peft.get_peft_model(model, peft.LoraConfig(r=config.rank, lora_alpha=config.alpha,
                                                               lora_dropout=config.dropout, target_modules=targets,
                                                               task_type="CAUSAL_LM"))
    except ValueError as e:
        raise FinetuneError(f"--target-modules {','.join(targets)}: {e}") from None
    check_expert_adapters(model)
    adapted = sorted(n for n, m in model.base_model.model.named_modules() if hasattr(m, "lora_A"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in trainable)
    say(f"{len(train)} blocks of {config.seq_len} tokens to train on, {len(held) if held else 0} held out; LoRA "
        f"r={config.rank} alpha={config.alpha:g} on {len(adapted)} modules ({', '.join(targets)}): "
        f"{n_params:,} trainable parameters")
    device = torch.device(config.device)
    before = perplexity(model, held, config.batch, device) if held else None
    if before is not None:
        say(f"held-out perplexity before: {before:.3f}")
    per_step = config.batch * config.grad_accum
    steps = config.steps or max(1, math.ceil((config.epochs or 1.0) * len(train) / per_step))
    opt = optim.adamw(trainable, config.lr)
    batches = _batches(len(train), config.batch, config.seed)
    losses, tokens, seconds = [], 0, 0.0
    model.train()
    bar = tqdm(total=steps, desc="finetune", unit="step", disable=not progress)
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for _ in range(config.grad_accum):
            part = train.take(next(batches))
            loss = causal_lm_loss(model, part.input_ids.to(device), part.labels.to(device),
                                  part.attention_mask.to(device)) / config.grad_accum
            loss.backward()
            loss_sum += loss.item()
            tokens += int(part.attention_mask.sum())
        opt.step()
        seconds += time.perf_counter() - t0
        losses.append(loss_sum)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_sum:.4f}", tok_s=f"{tokens / seconds:.0f}")
        if config.save_every and step % config.save_every == 0 and step < steps:
            _save(model, config.out / f"checkpoint-{step}", adapted)
    bar.close()
    after = perplexity(model, held, config.batch, device) if held else None
    result = FinetuneResult(config.out, steps, losses, len(train), len(held) if held else 0, adapted, n_params,
                            before, after, tokens, seconds)
    _save(model, config.out, adapted)
    (config.out / "finetune.json").write_text(json.dumps(
        {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
         "result": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(result).items()}
         | {"tokens_per_s": result.tokens_per_s}}, indent=1, default=str) + "\n")
    say(f"{steps} steps, {tokens} tokens in {seconds:.1f} s ({result.tokens_per_s:.0f} tokens/s); last loss "
        f"{losses[-1]:.4f}" + (f"; held-out perplexity {before:.3f} -> {after:.3f}" if held else ""))
    say(f"adapter saved to {config.out}")
    if config.save_merged is not None:
        result.merged = lora_merge.save_merged(config.model, config.out, config.save_merged)
        say(f"merged model saved to {result.merged}")
    return result


def _save(model, out: Path, adapted: list[str]) -> None:
    """The adapter in PEFT's format and the base weights' fingerprint."""
    model.save_pretrained(out)
    lora_merge.write_base_file(out, model.base_model.model, adapted)
