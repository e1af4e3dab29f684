"""Apply a Plan to a model: build operators, swap them in, move every other tensor once.

``inject(model, rules, gpu="cuda:0")`` is the whole workflow after ``from_pretrained``: the model stays a Hugging
Face model (``model.generate`` works), with each matched module replaced by its operator's module (for MoE blocks
the routed experts go to native CPU kernels and the HF expert tensors are freed) and every tensor outside the
operators moved to the device its rule names. Tensors are moved one by one (never the whole model first: the
experts would not fit on the GPU), tied tensors stay tied.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Mapping

import torch
from torch import nn

from ktinject import compat, fastpaths, operators
from ktinject._callmod import callable_module

if TYPE_CHECKING:
    from ktinject.plan import Plan

log = logging.getLogger(__name__)


class InjectError(RuntimeError):
    """The model cannot be injected (already injected, or a plan entry no longer matches the model)."""


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` at the dotted path ``name`` ("" is the root: not replaceable in place)."""
    if not name:
        raise InjectError("a rule replaces the root module; replace a submodule instead (name it in the rule)")
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)


def _resolve(model: nn.Module, name: str) -> tuple[nn.Module, str, dict]:
    """(owning module, key, store) of the parameter or buffer ``name``."""
    mod_name, _, key = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    for store in (mod._parameters, mod._buffers):
        if key in store:
            return mod, key, store
    raise InjectError(f"plan names tensor {name!r} but the model has no such parameter or buffer; make the plan "
                      f"from this model, right before inject")


@torch.no_grad()
def place_tensors(model: nn.Module, tensor_devices: Mapping[str, torch.device]) -> int:
    """Move each named tensor to its device, in place in its owning module; returns bytes moved.

    Identity is kept: a tensor reachable under several names (tied embeddings) is moved once and every owner
    gets the same new tensor."""
    targets: dict[int, torch.device] = {}
    for name, device in tensor_devices.items():
        mod, key, store = _resolve(model, name)
        t = store[key]
        if t is not None:
            targets[id(t)] = torch.device(device)
    moved: dict[int, torch.Tensor] = {}
    nbytes = 0
    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            for key, t in list(store.items()):
                if t is None or id(t) not in targets:
                    continue
                if id(t) not in moved:
                    dev = targets[id(t)]
                    if t.device == dev:
                        moved[id(t)] = t
                        continue
                    new = t.to(dev)
                    if isinstance(t, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                    moved[id(t)] = new
                    nbytes += t.numel() * t.element_size()
                store[key] = moved[id(t)]
    return nbytes


def _build_operators(model: nn.Module, the_plan) -> Counter:
    """Build and swap in every operator entry, in plan order; returns counts per operator id."""
    counts: Counter = Counter()
    for entry in the_plan.operator_entries():
        try:
            module = model.get_submodule(entry.name) if entry.name else model
        except AttributeError:
            raise InjectError(f"plan entry {entry.name!r} ({entry.class_name}) is not in the model; make the plan "
                              f"from this model, right before inject") from None
        if type(module).__name__ != entry.class_name:
            raise InjectError(f"plan entry {entry.name!r} expected {entry.class_name}, the model has "
                              f"{type(module).__name__}; make the plan from this model, right before inject")
        op = operators.get(entry.operator)
        new = op.build(module, entry.name, entry.kwargs, entry.device)
        if new is not module:
            _swap(model, entry.name, new)
        counts[entry.operator] += 1
    return counts


def _attention(model: nn.Module, the_plan) -> str | None:
    from ktinject.operators.attention import apply_implementation, wanted_implementation

    kwargs = [e.kwargs for e in the_plan.operator_entries() if e.operator == "attention"]
    if not kwargs:
        return getattr(getattr(model, "config", None), "_attn_implementation", None)
    return apply_implementation(model, wanted_implementation(kwargs))


def _generation_ready(model: nn.Module) -> None:
    """Make generate() see the model as it now is: eval mode, no stale device map, no torch.compile.

    HF's generate compiles the forward on its own when the cache is static (cache_implementation="static");
    dynamo cannot trace the native expert calls, so that is switched off. ktinject.generate replaces that
    compiled call with its CUDA-graph runner through the same hook, which this setting does not affect."""
    if getattr(model, "hf_device_map", None) is not None:
        # from_pretrained(device_map=...) records where it put modules; that no longer holds
        log.info("inject: dropping hf_device_map (placement now follows the plan)")
        del model.hf_device_map
    gen = getattr(model, "generation_config", None)
    if gen is not None and not getattr(gen, "disable_compile", False):
        gen.disable_compile = True
    if model.training:
        log.info("inject: the model was in training mode; native experts do not train, switching to eval()")
        model.eval()


_HOT_KEYS = ("gpu_experts_budget", "placement", "stats", "rebalance_every")


def hot_settings(the_plan, **overrides) -> dict | None:
    """The model-wide hot-expert settings: the moe rules' kwargs (they must agree), overridden by ``overrides``
    (None = not given); None when no budget or placement is set anywhere."""
    found: dict[str, tuple] = {}
    for entry in the_plan.operator_entries():
        if entry.operator != "moe":
            continue
        for key in _HOT_KEYS:
            value = entry.kwargs.get(key)
            if value is None:
                continue
            if key in found and found[key][0] != value:
                raise InjectError(f"moe rules disagree on {key}: {found[key][0]!r} ({found[key][1]}) vs {value!r} "
                                  f"({entry.rule.where}); hot experts are placed model-wide: give one value")
            found.setdefault(key, (value, entry.rule.where))
    settings = {k: v[0] for k, v in found.items()}
    settings.update({k: v for k, v in overrides.items() if v is not None})
    if settings.get("gpu_experts_budget") is None and settings.get("placement") in (None, "none"):
        return None
    return settings


def place_hot_experts(model: nn.Module, the_plan, **overrides):
    """Apply ``hot_settings`` (ktinject.placement.place) once every operator is built; returns the Placement or
    None. ``from_pretrained`` flows call this after loading, as ``inject`` does."""
    settings = hot_settings(the_plan, **overrides)
    if settings is None:
        return None
    from ktinject import placement

    return placement.place(model, settings.get("gpu_experts_budget") or 0, settings.get("placement") or "frequency",
                           settings.get("stats"), rebalance_every=settings.get("rebalance_every"))


def finish(model: nn.Module, the_plan: Plan, **hot) -> str:
    """What follows placement, for inject and the streaming loader alike: attention implementation, generation
    settings, hot experts (``hot``: inject's gpu_experts_budget / placement / stats), on CUDA the graph-replaying
    generate(), and the mark of an injected model. Returns the attention implementation in use."""
    attn = _attention(model, the_plan)
    _generation_ready(model)
    untested = compat.untested_release()
    if untested:
        log.warning("inject: %s", untested)
    fastpaths.attach(model)
    place_hot_experts(model, the_plan, **hot)
    if the_plan.devices["gpu"].type == "cuda":
        # on CUDA, model.generate(...) replays each decode step as one CUDA graph (ktinject/generate.py)
        from ktinject.generate import enable

        enable(model)
    model._ktinject_plan = the_plan
    return attn


def inject(model: nn.Module, rules=None, *, quant: str | None = None, gpu_experts_budget=None,
           placement: str | None = None, stats=None, checkpoint=None, **devices) -> Plan:
    """Plan and apply: swap in operators, move every other tensor to its device. Returns the Plan.

    ``rules``: a rule file path, parsed rules, or None for the packaged file of ``model.config.model_type``.
    ``quant``: expert quantization for every MoE operator (``bf16``, ``int8``, ``int4``); None keeps the rules' choice.
    ``gpu_experts_budget`` (bytes or '12GiB'), ``placement`` (frequency, uniform, dynamic, none), ``stats`` (a
    file from ``python -m ktinject.calibrate``): GPU-resident hot experts (ktinject.placement); None keeps the moe
    rules' kwargs of the same names.
    ``checkpoint``: for a model built on the meta device (``from_config`` under ``torch.device("meta")`` or
    ``from_pretrained(..., device_map="meta")``): a checkpoint directory whose weights are streamed straight into
    the operators and devices (ktinject.loading).
    ``devices``: device variables, e.g. ``gpu="cuda:0"`` or ``gpu="cpu"`` (CPU-only run).
    """
    from ktinject.plan import plan

    previous = getattr(model, "_ktinject_plan", None)
    if previous is not None:
        raise InjectError(f"{type(model).__name__} was already injected (model._ktinject_plan is set); inject a "
                          f"freshly loaded model instead")
    the_plan = plan(model, rules, quant=quant, **devices)
    hot = dict(gpu_experts_budget=gpu_experts_budget, placement=placement, stats=stats)
    if checkpoint is not None:
        from ktinject.loading import load_into

        return load_into(model, the_plan, checkpoint, **hot)
    counts = _build_operators(model, the_plan)
    nbytes = place_tensors(model, the_plan.tensor_devices)
    attn = finish(model, the_plan, **hot)
    ops = ", ".join(f"{n} x {op}" for op, n in sorted(counts.items())) or "no operators"
    log.info("inject: %s: %s; moved %.1f MiB of other tensors; attention %s", type(model).__name__, ops,
             nbytes / 2**20, attn)
    return the_plan


callable_module(__name__, "inject")
