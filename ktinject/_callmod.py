"""Modules that share their name with the function they export (``ktinject.plan``, ``ktinject.inject``,
``ktinject.generate``) are made callable as that function.

The package exports the functions lazily under the modules' names; but any ``import ktinject.plan`` makes Python
set the package attribute ``plan`` to the module. Making the module callable keeps ``ktinject.plan(model)``
working whichever happened first."""
from __future__ import annotations

import sys
import types


class _CallableModule(types.ModuleType):
    _ktinject_function: str = ""

    def __call__(self, *args, **kwargs):
        return getattr(self, self._ktinject_function)(*args, **kwargs)


def callable_module(module_name: str, function_name: str) -> None:
    """Make ``sys.modules[module_name]`` callable as its attribute ``function_name``."""
    module = sys.modules[module_name]
    module.__class__ = type(f"Callable_{function_name}", (_CallableModule,), {"_ktinject_function": function_name})
