"""The rows of ``bench finetune``: one LoRA training run each, the same batch, loop and adapter settings.

    ktinject    ``ktinject.inject`` (every routed expert on the CPU, as ``ktinject finetune``), then PEFT on the
                attention projections and the routed experts' stand-ins (``ktinject.operators.expert_lora``)
    hf-offload  the un-injected HF model, the dense modules and as many layers' experts as the GPU cap holds on the
                GPU, the other experts on the CPU, offloaded by accelerate (streamed to the GPU at each forward);
                PEFT on the attention projections and, where PEFT can train them offloaded, the fused experts
                (``target_parameters``)
    hf-gpu      the whole HF model on the GPU (the reference), PEFT on the attention and the fused experts

The loop is ``ktinject finetune``'s (AdamW, no autocast: bf16 weights on a GPU, float32 adapters): per step zero the
gradients, forward with the labels (``ktinject.train.loss``: the LM head and loss over chunks of positions), backward,
step, the loss read (a sync). The first ``warmup`` steps are not timed;
the first of them also counts the bytes each decoder layer saves for the backward on the model's device (its
activations) and, for the ktinject row, a no-grad forward of the same batch before PEFT gives the inference peak.
Memory: ``torch.cuda.max_memory_allocated`` from the row's start, less what other rows left allocated.

Legend: B batch, S sequence length, L layers, E experts.
"""
from __future__ import annotations

import gc
import math
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # PEFT's target_parameters


@dataclass
class Row:
    name: str
    what: str                      # what ran (LoRA targets, placement)
    step_s: list[float]            # timed steps
    losses: list[float]            # every step, warm-up included
    tokens: int                    # per step (B x S)
    peak: int | None = None        # GPU bytes (None on a CPU-only run)
    notes: list[str] = field(default_factory=list)
    bound: dict | None = None      # the ktinject row's memory bound parts

    @property
    def tokens_s(self) -> float:
        return self.tokens * len(self.step_s) / sum(self.step_s) if self.step_s else float("nan")

    @property
    def finite(self) -> bool:  # (every loss; a failed row has none)
        return all(math.isfinite(x) for x in self.losses)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_since(device, other: int) -> int | None:
    return torch.cuda.max_memory_allocated(device) - other if device.type == "cuda" else None


def free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def batch(vocab: int, b: int, s: int, device) -> torch.Tensor:
    """Random token ids [B, S] (seeded: every row trains on the same batch, every step)."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(3, vocab, (b, s), generator=gen).to(device)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (the ModuleList named ``layers``)."""
    for name, mod in model.named_modules():
        if name.endswith("layers") and isinstance(mod, nn.ModuleList):
            return list(mod)
    raise ValueError(f"{type(model).__name__}: no decoder layers (a ModuleList named 'layers') found")


class LayerActivations:
    """Bytes of the tensors on ``device`` each decoder layer saves for the backward (parameters not counted, each
    storage once), while active: ``with LayerActivations(model, device) as acts: forward``; ``acts.per_layer``."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.layers, self.device = decoder_layers(model), device
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters() if p.device == device}
        self.per_layer = [0] * len(self.layers)
        self._seen: list[set] = [set() for _ in self.layers]
        self._current, self._handles, self._saved = None, [], None

    def _pack(self, t):
        i = self._current
        if i is not None and t.device == self.device:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.params and ptr not in self._seen[i]:
                self._seen[i].add(ptr)
                self.per_layer[i] += t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(self, "_current", i)))
            self._handles.append(layer.register_forward_hook(lambda m, a, o: setattr(self, "_current", None)))
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved.__enter__()
        return self

    def __exit__(self, *exc):
        self._saved.__exit__(*exc)
        for h in self._handles:
            h.remove()
        return False


def peft_model(model: nn.Module, rank: int, targets: list[str], parameters: list[str] | None = None):
    """peft.get_peft_model with LoRA r=``rank``, alpha 2r, no dropout (PEFT's fused-expert wrapper takes none)."""
    import peft

    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(targets),
                          target_parameters=list(parameters) if parameters else None, task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # PEFT reads transformers' deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        return peft.get_peft_model(model, cfg)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def train(model, ids: torch.Tensor, steps: int, warmup: int, lr: float, device,
          acts: LayerActivations | None = None) -> tuple[list[float], list[float]]:
    """(timed step seconds, every step's loss) of ``warmup`` + ``steps`` steps on ``ids`` [B, S]; ``acts`` counts
    the first step's saved activations."""
    from ktinject.train.loss import causal_lm_loss
    from ktinject.train.optim import adamw

    opt = adamw(trainable(model), lr)
    model.train()
    times, losses = [], []
    for step in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if acts is not None and step == 0:
            with acts:
                loss = causal_lm_loss(model, ids, ids)
        else:
            loss = causal_lm_loss(model, ids, ids)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        _sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return times, losses


def _gpu_bytes(params, device) -> int:
    return sum(p.numel() * p.element_size() for p in params if p.device == device)


def run_ktinject(make, quant: str, args, device) -> Row:
    """The ktinject row: inject (every expert on the CPU, prefill on the CPU), PEFT, the loop."""
    import ktinject
    from ktinject.operators import expert_lora

    other = allocated(device)
    model = make()
    reset_peak(device)
    ktinject.inject(model, gpu=str(device), quant=quant, prefill="cpu", gpu_experts_budget=0)
    ids = batch(model.config.vocab_size, args.batch, args.seq, device)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    _sync(device)
    inference = peak_since(device, other)
    targets = list(ATTENTION) + (list(expert_lora.PROJECTIONS) if args.lora_experts == "on" else [])
    model = peft_model(model, args.rank, targets)
    acts = LayerActivations(model, device)
    times, losses = train(model, ids, args.steps, args.warmup, args.lr, device, acts)
    row = Row(f"ktinject {quant}", f"LoRA on {', '.join(targets)}; every routed expert on the CPU ({quant})",
              times, losses, ids.numel(), peak=peak_since(device, other))
    adapters = _gpu_bytes(trainable(model), device)
    row.bound = dict(inference=inference, adapters=adapters, optimizer=2 * adapters, grads=adapters,
                     activations=max(acts.per_layer), cpu_adapters=sum(p.numel() * p.element_size()
                                                                       for p in trainable(model)) - adapters)
    del model
    free(device)
    return row


def run_hf_gpu(make, args, device) -> Row:
    """The reference row: the whole HF model on ``device``, PEFT on the attention and the fused experts."""
    other = allocated(device)
    model = make()
    reset_peak(device)
    model.to(device)
    parameters = list(FUSED_EXPERTS) if args.lora_experts == "on" else None
    model = peft_model(model, args.rank, list(ATTENTION), parameters)
    ids = batch(model.config.vocab_size, args.batch, args.seq, device)
    times, losses = train(model, ids, args.steps, args.warmup, args.lr, device)
    targets = list(ATTENTION) + [f"{p} (target_parameters)" for p in parameters or ()]
    row = Row("hf-gpu", f"HF + PEFT, the whole model on {device.type}; LoRA on {', '.join(targets)}", times,
              losses, ids.numel(), peak=peak_since(device, other))
    del model
    free(device)
    return row
