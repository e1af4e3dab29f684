"""``benchmarks/soak_mix.py`` (the soak's request kinds, and the tool schemas the serve tests share with it), loaded
from its file: the benchmarks folder is not a package."""
from __future__ import annotations

import importlib.util
import os
import sys

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks",
                     "soak_mix.py")


def _load():
    if "soak_mix" in sys.modules:
        return sys.modules["soak_mix"]
    spec = importlib.util.spec_from_file_location("soak_mix", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["soak_mix"] = module
    return module


soak_mix = _load()
