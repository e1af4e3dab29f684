"""Operator registry: rule files name operators by id; a YAML file never imports code.

An operator is a class registered under an id with ``@register("id")``. It implements the protocol in
``ktinject.operators.base.Operator``: ``check`` (can it take this module?), ``placement`` (bytes per device, for
the plan) and ``build`` (the replacement module). Operator modules are imported on first lookup, not at import.
"""
from __future__ import annotations

import importlib

_REGISTRY: dict[str, type] = {}
# modules that register the built-in operators; imported once, on the first lookup
_BUILTIN_MODULES = ("ktinject.operators.moe", "ktinject.operators.attention", "ktinject.operators.norm")
_loaded = False


def register(op_id: str):
    """Class decorator: make an operator available to rule files as ``replace: <op_id>``."""

    def deco(cls):
        if op_id in _REGISTRY and _REGISTRY[op_id] is not cls:
            raise ValueError(f"operator id {op_id!r} is already registered by {_REGISTRY[op_id].__qualname__}")
        cls.op_id = op_id
        _REGISTRY[op_id] = cls
        return cls

    return deco


def _load_builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in _BUILTIN_MODULES:
            importlib.import_module(mod)


def known() -> list[str]:
    """Sorted ids of all registered operators."""
    _load_builtins()
    return sorted(_REGISTRY)


def get(op_id: str) -> type:
    """The operator class for ``op_id``; KeyError listing the known ids if there is none."""
    _load_builtins()
    try:
        return _REGISTRY[op_id]
    except KeyError:
        raise KeyError(f"unknown operator {op_id!r}; known operators: {', '.join(known())}") from None
