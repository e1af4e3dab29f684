"""Zero-copy views of packed experts (ktk_experts_raw / ktk_experts_region): where each matrix of an expert lies
inside a ``ktinject.native.Experts``' packed storage, and that storage as a tensor, which GPU re-placement and the
prefix cache copy from."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ktinject.native.library import ERR_RANGE, MATRICES, QUANTS, NativeError, check_rc, checked_int, ffi_lib


class RawMatrix(NamedTuple):
    """One packed matrix of one expert, as ktk_experts_raw describes it: addresses (ints) inside the experts' packed
    storage, valid while the native.Experts lives. Layouts (native/src/kernels/kernels.h): bf16 data = bf16 bits
    [Np/16][Kp/2][16][2]; int8 data = int8 [Np/16][Kp/4][16][4] with value q * scale[n]; int4 data = nibbles
    [Np/16][Kp/8][16][4] (low nibble inputs 8r..8r+3, high 8r+4..8r+7) with scale [Np/16][Kp/G][16]; fp8 data = e4m3
    bytes [Np/16][Kp][16] with scale [Np/16][ceil(Kp/G)] (value e4m3 * scale of the 16-row block); mxfp4 data = e2m1
    nibbles [Np/16][Kp/8][16][4] (byte j of a 4-byte word: inputs 8r+2j (low) and 8r+2j+1 (high)) with ``scale`` the
    address of e8m0 bytes (uint8, not float) [Np/16][Kp/32][16] (value e2m1 * 2^(e - 127)). ``scale``/``bias``
    are 0 when absent (bf16 / no bias); ``expert``, ``expert_bytes``: the expert's whole region (all its matrices)."""

    quant: str
    N: int
    K: int
    Np: int
    Kp: int
    data: int
    data_bytes: int
    scale: int
    bias: int
    expert: int
    expert_bytes: int


def experts_raw(experts: Any, expert: int, which: str) -> RawMatrix:
    """ktk_experts_raw for a ktinject.native.Experts (every quant): NativeError(KTK_ERR_RANGE) for a bad expert or
    matrix."""
    ffi, lib = ffi_lib()
    if which not in MATRICES:
        raise NativeError(ERR_RANGE, f"which = {which!r} is not a matrix (expected 'gate', 'up' or 'down')")
    e = checked_int("expert", expert, 0, int(experts.num_experts) - 1, code=ERR_RANGE)
    out = ffi.new("ktk_raw *")
    check_rc(lib.ktk_experts_raw(experts._p, e, MATRICES[which], out))
    addr = lambda p: int(ffi.cast("uintptr_t", p))  # noqa: E731  (NULL -> 0)
    quant = {v: k for k, v in QUANTS.items()}.get(out.quant, str(out.quant))
    return RawMatrix(quant, out.N, out.K, out.Np, out.Kp, addr(out.data), int(out.data_bytes), addr(out.scale),
                     addr(out.bias), addr(out.expert), int(out.expert_bytes))


def experts_region(experts: Any) -> tuple[int, int]:
    """(address, bytes) of a ktinject.native.Experts' packed storage (ktk_experts_region): one page-aligned mapping
    that lives as long as the Experts object."""
    ffi, lib = ffi_lib()
    base, nbytes = ffi.new("const void **"), ffi.new("int64_t *")
    check_rc(lib.ktk_experts_region(experts._p, base, nbytes))
    return int(ffi.cast("uintptr_t", base[0])), int(nbytes[0])


def experts_region_view(experts: Any) -> tuple[int, torch.Tensor]:
    """(address, uint8 CPU tensor [nbytes]) over a ktinject.native.Experts' packed storage (zero copy): valid while
    the Experts object lives, so keep a reference to it beside the tensor."""
    ffi, _ = ffi_lib()
    addr, nbytes = experts_region(experts)
    return addr, torch.frombuffer(ffi.buffer(ffi.cast("char *", addr), nbytes), dtype=torch.uint8)
