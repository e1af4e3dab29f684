"""Thin 1:1 wrappers of the native core (native/include/ktinject.h): tensor -> pointer, error code -> exception.

The package's front: every public name is re-exported here from the module that holds it, one per layer of the
bindings, each importing only those before it:

    library.py   lazy load, NativeError, argument checks, ISA and thread-count functions
    pool.py      Pool, the default pool, closing every pool at exit
    expert_args.py  the checks of Experts' configuration and matrix arguments, the int4 group size's default
    experts.py   Experts (one MoE layer's packed experts: packing, forward, backward, projections)
    packed_views.py  zero-copy views of the packing (experts_raw, experts_region, experts_region_view)
    task.py      Task (a forward run asynchronously, driven by a CUDA stream), valid_defer, host_fn_addresses
    cuda_driver.py  the CUDA driver entry points (imported on its own: ``from ktinject.native import cuda_driver``)

The native module is loaded on first use, never at import; cffi API-mode calls release the GIL while native code
runs. Modules of this package import from the module that holds a name, never from here.

Legend: T tokens, k experts per token, E experts, H hidden, I expert intermediate.

    ex = Experts.from_hf(gate_up, down)              # gate_up [E, 2I, H], down [E, H, I] (any float dtype/strides)
    y = ex(hidden, ids, weights)                     # hidden [T, H], ids [T, k] int64, weights [T, k] -> [T, H]
"""
from __future__ import annotations

from ktinject.native.expert_args import default_group_size  # noqa: F401  (re-exported)
from ktinject.native.experts import Experts  # noqa: F401  (re-exported)
from ktinject.native.packed_views import (  # noqa: F401  (re-exported)
    RawMatrix, experts_raw, experts_region, experts_region_view)
from ktinject.native.library import (  # noqa: F401  (re-exported)
    ACTIVATIONS, DTYPES, ERR_DTYPE, ERR_ISA, ERR_NOMEM, ERR_NULL, ERR_RANGE, ERR_SHAPE, ERR_STATE, ERR_THREAD,
    ERROR_NAMES, GROUP_SIZES, ISA_NAMES, MATRICES, MXFP4_GROUP, OK, QUANTS, NativeError, available_isas, best_isa,
    cpu_features, default_threads, isa, library_path, physical_cores, set_isa, usable_cpus, version)
# the library handle and argument checks under their former names (tests call native._native() and native._ptr)
from ktinject.native.library import (  # noqa: F401  (re-exported)
    check_rc as _check, checked_int as _cint, checked_tensor as _tensor, ffi_lib as _native, pointer as _ptr)
from ktinject.native.pool import Pool, default_pool, set_default_threads  # noqa: F401  (re-exported)
from ktinject.native.task import Task, host_fn_addresses, valid_defer  # noqa: F401  (re-exported)

__all__ = ["NativeError", "OK", "ERR_NULL", "ERR_SHAPE", "ERR_RANGE", "ERR_DTYPE", "ERR_ISA", "ERR_NOMEM",
           "ERR_STATE", "ERR_THREAD", "ERROR_NAMES", "ISA_NAMES", "version", "cpu_features", "isa", "best_isa",
           "available_isas", "set_isa", "physical_cores", "usable_cpus", "library_path", "Pool", "default_pool",
           "default_threads", "set_default_threads", "Experts", "Task", "valid_defer", "host_fn_addresses"]
