"""ktinject: run Mixture-of-Experts LLMs with routed experts on the CPU and everything dense on the GPU.

Nothing happens at import: no native library load, no threads, no CUDA. The public API is loaded on first use.
"""
from __future__ import annotations

import importlib
import importlib.util

__version__ = "0.1.0"

# public name -> module that defines it (loaded lazily, PEP 562)
_EXPORTS = {
    "plan": "ktinject.injection.plan",
    "Plan": "ktinject.injection.plan",
    "inject": "ktinject.injection.inject",
    "load_rules": "ktinject.injection.rules",
    "RuleError": "ktinject.injection.rules",
    "from_pretrained": "ktinject.injection.loading",
    "generate": "ktinject.decode.generate",
    "info": "ktinject.cli.info",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        # a subpackage or module (ktinject.operators, ktinject.gpu_experts, ...), imported on first use like the names
        # above, as `import ktinject` then `ktinject.operators.known()` suggests
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module 'ktinject' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
