"""The "attention" operator: keep a Hugging Face attention module, place it on the device, ask for a fast kernel.

transformers 5.x attention modules dispatch through ``config._attn_implementation``, one setting for the whole
model; so ``build`` only moves the module, and ``inject`` applies the implementation the rules ask for once, with
``model.set_attn_implementation`` (see ``wanted_implementation``). Rule keyword arguments:

``implementation``: ``sdpa`` (default: SDPA unless the model already uses something at least as good, i.e. a
flash or flex kernel), ``eager``, ``flash_attention_2``, ``flash_attention_3``, ``flex_attention``, or ``keep``
(leave the model's setting alone). Models that do not support SDPA (gpt-oss: attention sinks) keep their setting
when ``sdpa`` is asked for, with an info message.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch import nn

from ktinject.operators import register
from ktinject.operators.base import Operator, OperatorError, tensor_bytes

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention", "keep")
# implementations at least as good as SDPA: "sdpa" leaves these in place
_AT_LEAST_SDPA = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def _implementation(kwargs: Mapping[str, Any], name: str) -> str:
    impl = kwargs.get("implementation") or "sdpa"
    if impl not in IMPLEMENTATIONS:
        raise OperatorError(f"attention: implementation {impl!r} for {name!r} is not supported; use one of "
                            f"{', '.join(IMPLEMENTATIONS)}")
    return impl


@register("attention")
class AttentionOperator(Operator):
    """Place an attention module on ``device``; the model-wide kernel choice is made by inject."""

    kwargs_allowed = frozenset({"implementation"})

    @classmethod
    def check(cls, module: nn.Module, name: str, kwargs: Mapping[str, Any]) -> None:
        cname = type(module).__name__
        if "Attention" not in cname or not hasattr(module, "layer_idx"):
            raise OperatorError(
                f"attention: module {name!r} ({cname}) is not a transformers attention module (expected a class "
                f"named *Attention with a layer_idx, e.g. Qwen3MoeAttention); match the self_attn modules")
        _implementation(kwargs, name)

    @classmethod
    def placement(cls, module: nn.Module, kwargs: Mapping[str, Any], device: torch.device) -> dict[str, int]:
        return {str(torch.device(device)): tensor_bytes(module)}

    @classmethod
    def build(cls, module: nn.Module, name: str, kwargs: Mapping[str, Any], device: torch.device) -> nn.Module:
        return module.to(device)


def wanted_implementation(kwargs_list: list[Mapping[str, Any]]) -> str:
    """The one implementation asked for by all attention entries ("keep" when there are none)."""
    asked = {_implementation(kw, "<rules>") for kw in kwargs_list} - {"keep"}
    if len(asked) > 1:
        raise OperatorError(f"attention: rules ask for different implementations {sorted(asked)}; transformers "
                            f"uses one per model: make them agree")
    return asked.pop() if asked else "keep"


def apply_implementation(model: nn.Module, wanted: str) -> str:
    """Set the model's attention implementation per ``wanted``; returns the one in force afterwards."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if wanted == "keep" or current == wanted or config is None:
        return current
    if wanted == "sdpa" and current in _AT_LEAST_SDPA:
        return current
    if wanted == "sdpa" and not getattr(model, "_supports_sdpa", False):
        log.info("attention: %s does not support SDPA; keeping %r", type(model).__name__, current)
        return current
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        raise OperatorError(f"attention: {type(model).__name__} cannot change its attention implementation "
                            f"(no set_attn_implementation); use implementation: keep")
    setter(wanted)
    log.info("attention: implementation %r -> %r", current, model.config._attn_implementation)
    return model.config._attn_implementation
