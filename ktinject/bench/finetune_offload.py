"""The ``hf-offload`` row of ``bench finetune``: HF + PEFT with the routed experts offloaded by accelerate.

The device map (``offload_map``): every module but the routed experts on the GPU, then the experts of as many layers
(in order) as the GPU cap holds, the others on the CPU. The cap is for the 48-layer Qwen3-30B-A3B model: the share
of its layers' experts that fits ``cap`` beside its dense modules and one streamed layer's experts (accelerate's
``max_memory`` counts weights only) is the share resident here, whatever ``--layers`` (or ``--tiny``) built.
``accelerate.dispatch_model`` then offloads the CPU experts: their weights are copied to the GPU at each forward
and dropped after it. Gradient checkpointing (non-reentrant, ``--hf-checkpointing``, on by default) recomputes each
layer in the backward: without it the backward keeps every streamed copy alive (the whole model on the GPU). On a
CPU-only machine the same hooks run with the CPU as the execution device (the code path: nothing is streamed).

LoRA: the attention projections and, with ``--lora-experts on``, the fused experts through PEFT's
``target_parameters``; where that fails offloaded (PEFT reads the parameter before accelerate's hook has loaded
it), the row is built again with the attention only and says why.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ktinject.bench import finetune_rows as fr

FULL_LAYERS = 48


def _is_experts(name: str) -> bool:
    return name.endswith(".mlp.experts")


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def full_model_bytes() -> tuple[int, int]:
    """(dense bytes, one layer's expert bytes) of the 48-layer Qwen3-30B-A3B in bf16 (built on the meta device)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from ktinject.bench.model import QWEN3_30B

    cfg = Qwen3MoeConfig(num_hidden_layers=FULL_LAYERS, **QWEN3_30B)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    experts = [_nbytes(m) for n, m in model.named_modules() if _is_experts(n)]
    return _nbytes(model) - sum(experts), experts[0]


def resident_share(cap: int) -> float:
    """The share of the 48-layer model's experts modules that fits the GPU ``cap`` (bytes) with its dense modules and
    one streamed layer's experts."""
    dense, layer = full_model_bytes()
    return min(1.0, max(0.0, (cap - dense - layer) / (FULL_LAYERS * layer)))


def offload_map(model: nn.Module, share: float, gpu) -> dict[str, object]:
    """accelerate's device map: the experts modules of the first floor(share x their count) on ``gpu``, the other
    experts on "cpu", every other module on ``gpu``."""
    experts = [n for n, _ in model.named_modules() if _is_experts(n)]
    if not experts:
        raise ValueError(f"{type(model).__name__}: no routed experts modules (*.mlp.experts) to offload")
    resident = set(experts[:math.floor(share * len(experts) + 1e-9)])
    dmap: dict[str, object] = {}

    def walk(prefix: str, module: nn.Module) -> None:
        inside = [e for e in experts if e == prefix or e.startswith(prefix + ".") or not prefix]
        if not inside:
            dmap[prefix] = gpu
            return
        if prefix in experts:
            dmap[prefix] = gpu if prefix in resident else "cpu"
            return
        if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
            raise ValueError(f"{prefix or 'the model'} holds tensors of its own beside routed experts: no device "
                             f"map splits it")
        for name, child in module.named_children():
            walk(f"{prefix}.{name}" if prefix else name, child)

    walk("", model)
    return dmap


def dispatch(model: nn.Module, dmap: dict, device: torch.device) -> None:
    """accelerate.dispatch_model on a GPU; on the CPU, the same hooks with the CPU executing (offload on)."""
    if device.type == "cuda":
        from accelerate import dispatch_model

        dispatch_model(model, device_map=dmap, main_device=device.index or 0)
        return
    from accelerate.hooks import attach_align_device_hook_on_blocks
    from accelerate.utils import OffloadedWeightsLoader

    cpu = [n for n, d in dmap.items() if d == "cpu" and _is_experts(n)]  # (every other module: "cpu" too)
    state = {f"{n}.{k}": v for n in cpu for k, v in model.get_submodule(n).state_dict().items()}
    execution = {n: device for n in dmap} | {"": device}
    offload = {n: n in cpu for n in dmap} | {"": False}
    attach_align_device_hook_on_blocks(model, execution_device=execution, offload=offload, offload_buffers=False,
                                       weights_map=OffloadedWeightsLoader(state_dict=state), module_name="")


def _build(make, args, device, share: float, experts_lora: bool):
    model = make()
    dmap = offload_map(model, share, (device.index or 0) if device.type == "cuda" else "cpu")
    dispatch(model, dmap, device)
    if args.hf_checkpointing == "on":
        if hasattr(model, "activation_checkpointing_enable"):  # (transformers 5's name; the old one warns)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    parameters = list(fr.FUSED_EXPERTS) if experts_lora else None
    return fr.peft_model(model, args.rank, list(fr.ATTENTION), parameters), dmap


def _attempt(make, args, device, share: float, experts_lora: bool):
    model, dmap = _build(make, args, device, share, experts_lora)
    ids = fr.batch(model.config.vocab_size, args.batch, args.seq, device)
    times, losses = fr.train(model, ids, args.steps, args.warmup, args.lr, device)
    return model, dmap, ids, times, losses


def run_hf_offload(make, args, device, cap: int) -> fr.Row:
    """The hf-offload row (module docstring); ``cap``: GPU bytes for the 48-layer model."""
    share = resident_share(cap)
    other = fr.allocated(device)
    fr.reset_peak(device)
    notes = []
    experts_lora = args.lora_experts == "on"
    failure, result = None, None
    try:
        result = _attempt(make, args, device, share, experts_lora)
    except Exception as e:  # noqa: BLE001  (whatever PEFT raises on offloaded fused experts: said, then without)
        if not experts_lora:
            raise
        failure = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    if result is None:  # (the failed model freed with the exception's frames)
        notes.append(f"PEFT's fused-expert LoRA (target_parameters) fails on accelerate-offloaded experts "
                     f"({failure}): this row adapts the attention only")
        fr.free(device)
        other = fr.allocated(device)
        fr.reset_peak(device)
        experts_lora = False
        result = _attempt(make, args, device, share, experts_lora)
    model, dmap, ids, times, losses = result
    experts = [n for n in dmap if _is_experts(n)]
    streamed = [n for n in experts if dmap[n] == "cpu"]
    targets = list(fr.ATTENTION) + ([f"{p} (target_parameters)" for p in fr.FUSED_EXPERTS] if experts_lora else [])
    where = ("streamed to the GPU each forward" if device.type == "cuda"
             else "offload hooks executing on the CPU: nothing streamed")
    what = (f"HF + PEFT + accelerate: {len(experts) - len(streamed)} of {len(experts)} layers' experts on the GPU, "
            f"{len(streamed)} offloaded to the CPU ({where}); gradient checkpointing {args.hf_checkpointing}; "
            f"LoRA on {', '.join(targets)}")
    row = fr.Row("hf-offload", what, times, losses, ids.numel(), peak=fr.peak_since(device, other), notes=notes)
    del model
    fr.free(device)
    return row
