"""The one apply path: a Plan made real on a model, whether its weights are loaded (``inject``) or streamed from a
checkpoint (``ktinject.injection.loading``).

    build_operator   one plan entry -> its operator's module, swapped in at the entry's name; from the loaded module
                     (``Operator.build``) or around experts the loader already packed (``Operator.build_packed``)
    TensorOwners     every tensor of the model and every (module, key) holding it: a tensor is replaced in all
                     its owners at once, so tied tensors (embeddings) stay one tensor
    place_tensors    each tensor outside the operators moved once to its plan device (never the whole model first:
                     the experts would not fit on the GPU)
    finish           what follows: attention implementation, generation settings, fast-path reports, the chain of
                     MoE blocks for expert deferral (``ktinject.operators.deferral``), hot experts
                     (``ktinject.gpu_experts``), the CUDA-graph ``generate`` on CUDA, the mark of an injected model
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Mapping

import torch
from torch import nn

from ktinject import compat, operators
from ktinject.operators import fast_path_report as fastpaths
from ktinject.decode.generate import enable as enable_graph_generate
from ktinject.gpu_experts.prefill import streamer as prefill_stream
from ktinject.gpu_experts.hot.placement import apply_settings
from ktinject.gpu_experts.hot.settings import HotExpertSettings
from ktinject.operators import deferral
from ktinject.decode import attention as decode_attention
from ktinject.decode import layer as decode_layer
from ktinject.decode import stateful_layers
from ktinject.operators.attention import apply_implementation, wanted_implementation
from ktinject.operators.moe import HybridMoE

log = logging.getLogger(__name__)


class InjectError(RuntimeError):
    """The model cannot be injected (already injected, or a plan entry no longer matches the model)."""


def check_fresh(model: nn.Module) -> None:
    """InjectError if ``model`` was injected before (operators cannot be applied twice)."""
    if getattr(model, "_ktinject_plan", None) is not None:
        raise InjectError(f"{type(model).__name__} was already injected (model._ktinject_plan is set); inject a "
                          f"freshly loaded model instead")


def check_not_quantized(model: nn.Module) -> None:
    """InjectError when transformers loaded ``model`` with its quantized modules (an FP8, compressed-tensors or
    MXFP4 checkpoint through ``from_pretrained``): ktinject's operators take plain weights; its own loader decodes
    those checkpoints while it streams them."""
    quantizer = getattr(model, "hf_quantizer", None)
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    if quantizer is None and not getattr(model, "is_quantized", False):
        return
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    raise InjectError(f"{type(model).__name__} was loaded by transformers with quantized modules (quant_method "
                      f"{method!r}); load the checkpoint with ktinject.from_pretrained(dir) instead, which decodes "
                      f"FP8, compressed-tensors and MXFP4 tensors as it streams them")


def check_devices(plan) -> None:
    """InjectError naming the variable when the plan puts something on a CUDA device this machine lacks (before
    anything is built: torch would fail deep inside an operator's constructor)."""
    asked = [(f"{name}={str(device)!r}", f"pass {name}='cpu'", device) for name, device in plan.devices.items()]
    asked += [(f"{e.rule.where}: device {str(e.device)!r}", "write device: cpu", e.device) for e in plan.entries
              if e.device not in plan.devices.values()]
    for what, fix, device in asked:
        if device.type != "cuda":
            continue
        if not torch.cuda.is_available():
            raise InjectError(f"{what}: CUDA is not available on this machine ({fix} for a CPU-only run)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InjectError(f"{what}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def swap(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` at the dotted path ``name`` ("" is the root: not replaceable in place)."""
    if not name:
        raise InjectError("a rule replaces the root module; replace a submodule instead (name it in the rule)")
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)


def entry_module(model: nn.Module, entry) -> nn.Module:
    """The module a plan entry names, checked against the class the plan saw."""
    try:
        module = model.get_submodule(entry.name) if entry.name else model
    except AttributeError:
        raise InjectError(f"plan entry {entry.name!r} ({entry.class_name}) is not in the model; make the plan "
                          f"from this model, right before inject") from None
    if type(module).__name__ != entry.class_name:
        raise InjectError(f"plan entry {entry.name!r} expected {entry.class_name}, the model has "
                          f"{type(module).__name__}; make the plan from this model, right before inject")
    return module


def build_operator(model: nn.Module, entry, module: nn.Module, packed: tuple | None = None) -> nn.Module:
    """Build ``entry``'s operator from ``module`` and swap it in; ``packed``: (experts, biases) the loader filled
    for an operator with an ``expert_stream`` (then ``build_packed``). Returns the new module."""
    op = operators.get(entry.operator)
    if packed is None:
        new = op.build(module, entry.name, entry.kwargs, entry.device)
    else:
        new = op.build_packed(module, entry.name, entry.kwargs, entry.device, *packed)
    if new is not module:
        swap(model, entry.name, new)
    return new


def build_operators(model: nn.Module, plan) -> Counter:
    """Build and swap in every operator entry of a loaded model, in plan order; returns counts per operator id."""
    counts: Counter = Counter()
    for entry in plan.operator_entries():
        build_operator(model, entry, entry_module(model, entry))
        counts[entry.operator] += 1
    return counts


class TensorOwners:
    """id(tensor) -> every (module, key, is_parameter) holding it, for the tensors of ``model`` as it is now."""

    def __init__(self, model: nn.Module):
        self.owners: dict[int, list[tuple[nn.Module, str, bool]]] = {}
        self.tensors: dict[int, torch.Tensor] = {}  # keeps each tensor alive: the ids above stay valid
        for mod in model.modules():
            for is_param, store in ((True, mod._parameters), (False, mod._buffers)):
                for key, t in store.items():
                    if t is not None:
                        self.owners.setdefault(id(t), []).append((mod, key, is_param))
                        self.tensors[id(t)] = t

    def replace(self, old: torch.Tensor, value: torch.Tensor, requires_grad: bool | None = None) -> torch.Tensor:
        """Put ``value`` wherever the model holds ``old`` (a Parameter again where ``old`` was one, with ``old``'s
        requires_grad unless given); returns what was put."""
        new = value
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(value, requires_grad=old.requires_grad if requires_grad is None else requires_grad)
        for mod, key, is_param in self.owners[id(old)]:
            (mod._parameters if is_param else mod._buffers)[key] = new
        return new


def tensor_targets(model: nn.Module, tensor_devices: Mapping[str, torch.device]) -> dict[int, torch.device]:
    """id(tensor) -> device for the plan's ``tensor_devices`` (tensor name -> device)."""
    out: dict[int, torch.device] = {}
    for name, device in tensor_devices.items():
        mod_name, _, key = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        store = mod._parameters if key in mod._parameters else mod._buffers if key in mod._buffers else None
        if store is None:
            raise InjectError(f"plan names tensor {name!r} but the model has no such parameter or buffer; make the "
                              f"plan from this model, right before inject")
        if store[key] is not None:
            out[id(store[key])] = torch.device(device)
    return out


@torch.no_grad()
def place_tensors(model: nn.Module, tensor_devices: Mapping[str, torch.device]) -> int:
    """Move each named tensor to its device, in place in its owning modules; returns bytes moved. A tensor
    reachable under several names (tied embeddings) is moved once and every owner gets the same new tensor."""
    owners = TensorOwners(model)
    nbytes = 0
    for tid, device in tensor_targets(model, tensor_devices).items():
        t = owners.tensors[tid]
        if t.device != device:
            owners.replace(t, t.to(device))
            nbytes += t.numel() * t.element_size()
    return nbytes


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


def _attention(model: nn.Module, plan) -> str | None:
    kwargs = [e.kwargs for e in plan.operator_entries() if e.operator == "attention"]
    if not kwargs:
        return getattr(getattr(model, "config", None), "_attn_implementation", None)
    return apply_implementation(model, wanted_implementation(kwargs))


def finish(model: nn.Module, plan, hot: HotExpertSettings | None, prefill: str = "auto") -> str:
    """What follows building and placement, for inject and the streaming loader alike: attention implementation,
    generation settings, hot experts (``hot``: from ``HotExpertSettings.from_plan``), the prefill streamer
    (``prefill``: from ``gpu_experts.prefill.policy.mode_from_plan``), on CUDA the graph-replaying generate(), and the
    mark of an injected model. Returns the attention implementation in use."""
    attn = _attention(model, plan)
    _generation_ready(model)
    untested = compat.untested_release()
    if untested:
        log.warning("inject: %s", untested)
    for entry in plan.operator_entries():  # one-token steps with fewer GPU kernels (decode/attention.py)
        if entry.operator == "attention" and entry.kwargs.get("fast_decode", True):
            decode_attention.install(model.get_submodule(entry.name))
    decode_layer.install_all(model)  # one-token steps: residual adds fused with the norms after them
    report = fastpaths.attach(model)
    stateful = stateful_layers.remember(model)
    if stateful is not None:  # linear attention, indexer caches: HF's generate and cache, eager steps
        report.unavailable("graph_decode", stateful)
        on_gpu = plan.devices["gpu"].type == "cuda"
        log.log(logging.WARNING if on_gpu else logging.INFO, "inject: %s: %s", type(model).__name__, stateful)
    deferral.link(model, [m for m in model.modules() if isinstance(m, HybridMoE)])  # expert deferral's chain
    if hot is not None:
        apply_settings(model, hot)
    prefill_stream.attach(model, prefill)  # after the hot experts: they are never streamed
    if plan.devices["gpu"].type == "cuda":
        enable_graph_generate(model)  # model.generate(...) replays each decode step as one CUDA graph
    model._ktinject_plan = plan
    return attn
