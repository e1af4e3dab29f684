"""The operator protocol shared by plan (which asks) and ktinject.injection.apply (which builds).

Legend for tensor shapes in operators: T tokens, E experts, H hidden, I expert intermediate, k experts per token.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn


class OperatorError(ValueError):
    """An operator cannot take the module a rule matched (the message names module, class and rule)."""


class Operator:
    """Base class of registered operators. Subclasses override the three class methods.

    ``kwargs`` are the rule's keyword arguments (already validated YAML values); ``device`` is the rule's
    resolved device (where the operator's GPU side lives; CPU-side work such as routed experts stays on the CPU).
    """

    op_id: str = ""
    #: keyword arguments the operator accepts (anything else is an error naming the rule)
    kwargs_allowed: frozenset[str] = frozenset()

    @classmethod
    def check(cls, module: nn.Module, name: str, kwargs: Mapping[str, Any]) -> None:
        """Raise OperatorError if this operator cannot take ``module`` (works on meta-device modules)."""

    @classmethod
    def placement(cls, module: nn.Module, kwargs: Mapping[str, Any], device: torch.device) -> dict[str, int]:
        """Bytes each device will hold for this module's whole subtree once built: {str(device): bytes}.

        Pure: reads shapes only, moves nothing, works on meta-device modules."""
        raise NotImplementedError

    @classmethod
    def build(cls, module: nn.Module, name: str, kwargs: Mapping[str, Any], device: torch.device) -> nn.Module:
        """Return the replacement for ``module`` (its weights handed over or moved; originals may be freed)."""
        raise NotImplementedError

    # Operators whose routed experts live in native memory also take them already packed, so that the streaming
    # loader (ktinject.injection.loading) can fill them from the checkpoint without the module's expert tensors ever existing.
    @classmethod
    def expert_stream(cls, module: nn.Module, name: str, kwargs: Mapping[str, Any]) -> Any:
        """What the loader packs for ``module`` (``families.ExpertStream``), or None (the default): the loader then
        materializes the module's tensors and calls ``build``."""
        return None

    @classmethod
    def build_packed(cls, module: nn.Module, name: str, kwargs: Mapping[str, Any], device: torch.device, experts,
                     biases=None) -> nn.Module:
        """The replacement for ``module`` around ``experts`` filled as ``expert_stream`` described (``biases``: the
        experts' biases where the family has them). Only for operators whose ``expert_stream`` is not None."""
        raise NotImplementedError(f"operator {cls.op_id!r} does not take packed experts")


def tensor_bytes(module: nn.Module, recurse: bool = True) -> int:
    """Bytes of a module's parameters and persistent buffers (meta tensors count by shape)."""
    total = sum(p.numel() * p.element_size() for p in module.parameters(recurse=recurse))
    total += sum(b.numel() * b.element_size() for b in module.buffers(recurse=recurse))
    return total


# ---- tensors moved under a model's feet ---------------------------------------------------------------------------
# Code that moves tensors a captured graph reads (hot-expert placement) sits below the code that captures graphs
# (the decode runtime): it announces the move here and the runtime, which registered itself, drops its graphs.
_LAYOUT_LISTENERS = "_ktinject_layout_listeners"


def on_layout_change(model: nn.Module, key: str, callback) -> None:
    """Call ``callback()`` whenever ``layout_changed(model)`` is announced; one callback per ``key`` (a later one
    replaces it)."""
    model.__dict__.setdefault(_LAYOUT_LISTENERS, {})[key] = callback


def layout_changed(model: nn.Module) -> None:
    """Announce that tensors of ``model`` moved (before anything reads them again): every listener runs."""
    for callback in list(model.__dict__.get(_LAYOUT_LISTENERS, {}).values()):
        callback()
