"""The checks of ``Experts``' configuration and matrix arguments (quant, group size, fp8 block rows, which matrix),
each a NativeError that names the bad argument and what it may be; and the int4 group size's default
(``default_group_size``)."""
from __future__ import annotations

from typing import Any

from ktinject import envs
from ktinject.native.library import (ERR_DTYPE, ERR_SHAPE, FP8_DEFAULT_BLOCK, FP8_MAX_GROUP, GROUP_SIZES, MATRICES,
                                     MXFP4_GROUP, QUANTS, NativeError)

FP8_MAX_BLOCK_ROWS = 1 << 20


def default_group_size(hidden: int, intermediate: int) -> int:
    """The int4 group size when none is asked for: 128 inputs per scale where both input sizes (hidden for gate/up,
    intermediate for down) are multiples of 128, as in the released MoE models (GPTQ's and AWQ's usual group;
    ~4.25 bits a weight, 5.6% fewer bytes to read per token than 64 at the same measured perplexity on the demo
    model), else 64 (a group of 128 would pad such a matrix by up to 127 zero inputs). KTINJECT_INT4_GROUP=32|64|128
    sets it instead (read at each call: comparisons in one process)."""
    try:
        forced = envs.get("KTINJECT_INT4_GROUP")  # None, or one of GROUP_SIZES as text
    except ValueError as e:  # (names the variable and the sizes)
        raise NativeError(ERR_SHAPE, str(e)) from None
    if forced:
        return int(forced)
    return 128 if hidden % 128 == 0 and intermediate % 128 == 0 else 64


def _multiple_of_16(name: str, value: Any, hi: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value > hi or value % 16:
        raise NativeError(ERR_SHAPE, f"{name} = {value!r} (expected a multiple of 16 from 16 to {hi}: {what})")
    return value


def _mxfp4_args(group_size: Any, hidden: int, intermediate: int) -> int:
    """mxfp4's group (32 or None) and sizes (multiples of 32: a scale per 32 inputs of every row)."""
    if group_size is not None and (isinstance(group_size, bool) or group_size != MXFP4_GROUP):
        raise NativeError(ERR_SHAPE, f"group_size = {group_size!r} for mxfp4 (its e8m0 scales are per 32 inputs: "
                                     f"pass 32 or None)")
    if hidden % MXFP4_GROUP or intermediate % MXFP4_GROUP:
        raise NativeError(ERR_SHAPE, f"hidden = {hidden}, intermediate = {intermediate}: mxfp4 experts need both to "
                                     f"be multiples of 32 (a scale per 32 inputs); use quant fp8, int8, int4 or bf16 "
                                     f"for these sizes")
    return MXFP4_GROUP


def checked_group_size(quant: Any, group_size: Any, hidden: int, intermediate: int) -> int:
    """Check quant and group_size (int4: 32, 64 or 128, validated for every quant but fp8 and mxfp4; None:
    default_group_size; fp8: a multiple of 16 up to 512, None: 128; mxfp4: 32, None: 32, with hidden and
    intermediate multiples of 32); returns the group size."""
    if quant not in QUANTS:
        raise NativeError(ERR_DTYPE, f"quant = {quant!r} (expected one of {', '.join(QUANTS)})")
    if quant == "mxfp4":
        return _mxfp4_args(group_size, hidden, intermediate)
    if quant == "fp8":
        return FP8_DEFAULT_BLOCK if group_size is None else _multiple_of_16(
            "group_size", group_size, FP8_MAX_GROUP, "fp8 inputs per scale")
    if group_size is None:  # (the group means nothing to bf16 / int8: no environment read for them)
        return default_group_size(hidden, intermediate) if quant == "int4" else 64
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise NativeError(ERR_SHAPE, f"group_size = {group_size!r} (expected one of "
                                     f"{', '.join(map(str, GROUP_SIZES))}: int4 inputs per scale)")
    return int(group_size)


def checked_block_rows(quant: str, block_rows: Any) -> int:
    """fp8's output rows per scale (None: 128); 0 for the other quants, which take none."""
    if quant != "fp8":
        if block_rows is not None:
            raise NativeError(ERR_SHAPE, f"block_rows = {block_rows!r}: only fp8 experts have block scales")
        return 0
    if block_rows is None:
        return FP8_DEFAULT_BLOCK
    return _multiple_of_16("block_rows", block_rows, FP8_MAX_BLOCK_ROWS, "fp8 output rows per scale")


def matrix_index(which: Any) -> int:
    if which in MATRICES:
        return MATRICES[which]
    raise NativeError(ERR_SHAPE, f"which = {which!r} is not a matrix (expected 'gate', 'up' or 'down')")
