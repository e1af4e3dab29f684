"""GGUF K-quant super-blocks decoded by the native core (``ktk_gguf_dequantize``), for the GGUF loader.

``dequantize_into(blocks, qtype, out)`` writes the float32 values of ``blocks`` (uint8 [n, block bytes]) into
``out`` (float32, n * 256 elements, contiguous): the values of the GGUF loader's torch reference (gguf_kquants), bit
for bit. A call of at least PARALLEL_BLOCKS blocks (an embedding, an output head) is cut into parts decoded on
threads, one a physical core (the native call releases the GIL); smaller ones (expert slices, decoded on the
loader's packing threads) run on the calling thread. ``available()`` says whether the loaded native module has the
entry point (a module built before it existed does not; the loader then keeps to torch).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from ktinject.native.library import ERR_DTYPE, ERR_SHAPE, NativeError, check_rc, checked_tensor, ffi_lib, physical_cores

#: ggml type name -> (ggml type number, bytes of one 256-value block)
QTYPES = {"Q4_K": (12, 144), "Q5_K": (13, 176), "Q6_K": (14, 210)}
PARALLEL_BLOCKS = 1 << 16  # blocks (16 M values) from which a call is decoded on several threads
_PART_BLOCKS = 1 << 14  # blocks of one thread's part at least


def available() -> bool:
    """True when the native module loads and has ``ktk_gguf_dequantize``."""
    try:
        _, lib = ffi_lib()
    except ImportError:
        return False
    return hasattr(lib, "ktk_gguf_dequantize")


def dequantize_into(blocks: torch.Tensor, qtype: str, out: torch.Tensor) -> torch.Tensor:
    """Decode ``blocks`` (uint8 [n, QTYPES[qtype][1]], contiguous) into ``out`` (float32, n * 256 elements,
    contiguous); returns ``out``."""
    if qtype not in QTYPES:
        raise NativeError(ERR_DTYPE, f"qtype = {qtype!r} is not a K-quant (expected one of {', '.join(QTYPES)})")
    code, size = QTYPES[qtype]
    blocks = checked_tensor("blocks", blocks, (torch.uint8,), (None, size))
    out = checked_tensor("out", out, (torch.float32,))
    n = blocks.shape[0]
    if out.numel() != n * 256:
        raise NativeError(ERR_SHAPE, f"out: {out.numel()} elements where {n} {qtype} blocks decode to {n * 256}")
    ffi, lib = ffi_lib()
    src, dst = blocks.data_ptr(), out.data_ptr()

    def run(i0: int, i1: int) -> None:  # blocks [i0, i1): bytes from i0 * size, float32 values from i0 * 256
        check_rc(lib.ktk_gguf_dequantize(code, ffi.cast("uint8_t *", src + i0 * size), i1 - i0,
                                         ffi.cast("float *", dst + i0 * 256 * 4)))

    threads = min(physical_cores(), n // _PART_BLOCKS) if n >= PARALLEL_BLOCKS else 1
    if threads <= 1:
        run(0, n)
        return out
    cuts = [n * t // threads for t in range(threads + 1)]
    with ThreadPoolExecutor(threads, thread_name_prefix="ktinject-gguf") as workers:
        for f in [workers.submit(run, a, b) for a, b in zip(cuts, cuts[1:])]:
            f.result()
    return out
