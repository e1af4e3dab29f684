"""``Experts``: the routed experts of one MoE layer, packed once for the native kernels, and their forward.

Its arguments are checked in expert_args.py; zero-copy views of its packed storage are in packed_views.py. A forward runs on
a pool (pool.py); ``Task`` (task.py) binds one to run asynchronously. Users import these names from ktinject.native.

Legend: T tokens, k experts per token, E experts, H hidden, I expert intermediate.

    ex = Experts.from_hf(gate_up, down)              # gate_up [E, 2I, H], down [E, H, I] (any float dtype/strides)
    y = ex(hidden, ids, weights)                     # hidden [T, H], ids [T, k] int64, weights [T, k] -> [T, H]
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ktinject.native.library import (ACTIVATIONS, DTYPES, ERR_DTYPE, ERR_RANGE, ERR_SHAPE, MXFP4_GROUP, QUANTS,
                                     NativeError, check_rc, checked_int, checked_tensor, ffi_lib, isa,
                                     physical_cores, pointer)
from ktinject.native.expert_args import checked_block_rows, checked_group_size, matrix_index
from ktinject.native.pool import Pool, default_pool

_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PRECISIONS = {"float": 0, "bf16": 1}  # project's products: KTK_PRECISION_FLOAT / _BF16 ("auto": bf16 on amx)
_FP8_DTYPES = (torch.uint8, torch.float8_e4m3fn)  # set_fp8: e4m3 bits, or the tensor of the release itself
_MXFP4_DTYPES = (torch.uint8, torch.float4_e2m1fn_x2)  # set_mxfp4's blocks: e2m1 pairs
_E8M0_DTYPES = (torch.uint8, torch.float8_e8m0fnu)  # set_mxfp4's scales: e8m0 exponents
_GROUPED = ("int4", "fp8", "mxfp4")  # quants whose config carries a group size
_OUT_DTYPES = (torch.float32, torch.bfloat16)
_PARALLEL_SET_ELEMENTS = 1 << 24  # from_hf/from_gpt_oss pack in threads above this many weight elements


class Experts:
    """The routed experts of one MoE layer, packed once for the native kernels (see ktk_experts_* in the header).

    quant: "bf16" (weights rounded to bf16), "int8" (W8A8: int8 per output channel, activations per token) or
    "int4" (W4A8: int4 per output channel and group of ``group_size`` inputs, 32, 64 or 128, by default
    ``default_group_size(hidden, intermediate)``; activations as int8) or "fp8" (W8A16: float8 e4m3 weights with a
    float scale per block of ``block_rows`` outputs x ``group_size`` inputs, multiples of 16, both 128 by default as
    in the FP8 releases; ``set_fp8`` keeps a release's bits, ``set`` quantizes per block; activations bf16) or
    "mxfp4" (W4A16, 4.25 bits a weight: e2m1 weights with an e8m0 power-of-two scale per output row and 32 inputs,
    the MXFP4 releases' format; group_size 32 only, hidden and intermediate multiples of 32; ``set_mxfp4`` keeps a
    release's bytes, ``set`` quantizes; activations bf16).
    activation: "silu" (silu(g) * u), "gptoss" (clamped, alpha/limit; usually with bias=True) or "swiglu_limit"
    (DeepSeek-V4's clamped SwiGLU: silu(min(g, limit)) * clamp(u, -limit, limit); alpha unused).
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, quant: str = "bf16",
                 activation: str = "silu", alpha: float = 1.702, limit: float = 7.0, bias: bool = False,
                 group_size: int | None = None, block_rows: int | None = None):
        ffi, lib = ffi_lib()
        if activation not in ACTIVATIONS:
            raise NativeError(ERR_DTYPE, f"activation = {activation!r} (expected one of {', '.join(ACTIVATIONS)})")
        self.num_experts = checked_int("num_experts", num_experts)
        self.hidden = checked_int("hidden", hidden)
        self.intermediate = checked_int("intermediate", intermediate)
        self.group_size = checked_group_size(quant, group_size, self.hidden, self.intermediate)
        self.block_rows = checked_block_rows(quant, block_rows)
        self.quant, self.activation, self.bias = quant, activation, bool(bias)
        self.alpha, self.limit = float(alpha), float(limit)
        cfg = ffi.new("ktk_experts_config *", {
            "num_experts": self.num_experts, "hidden": self.hidden, "intermediate": self.intermediate,
            "quant": QUANTS[quant], "activation": ACTIVATIONS[activation], "has_bias": int(self.bias),
            "alpha": self.alpha, "limit": self.limit, "group_size": self.group_size if quant in _GROUPED else 0,
            "block_rows": self.block_rows})
        out = ffi.new("ktk_experts **")
        check_rc(lib.ktk_experts_create(cfg, out))
        self._p = ffi.gc(out[0], lib.ktk_experts_destroy)

    @staticmethod
    def checked_group_size(quant: str, group_size: int | None, hidden: int, intermediate: int) -> int:
        """The group size these arguments give (None: ``default_group_size``), or NativeError naming the bad one."""
        return checked_group_size(quant, group_size, hidden, intermediate)

    def __repr__(self) -> str:
        group = f", group_size={self.group_size}" if self.quant in _GROUPED else ""
        group += f", block_rows={self.block_rows}" if self.quant == "fp8" else ""
        return (f"Experts(E={self.num_experts}, H={self.hidden}, I={self.intermediate}, quant={self.quant!r}{group}, "
                f"activation={self.activation!r}, bias={self.bias}, nbytes={self.nbytes})")

    def shape(self, which: str) -> tuple[int, int]:
        """[out, in] of one matrix: gate/up [I, H], down [H, I]."""
        w = matrix_index(which)
        return (self.intermediate, self.hidden) if w < 2 else (self.hidden, self.intermediate)

    def _expert(self, expert: Any) -> int:
        return checked_int("expert", expert, 0, self.num_experts - 1, code=ERR_RANGE)

    # ---- weights ----
    def set(self, expert: int, which: str, weight: torch.Tensor) -> None:
        """Pack one matrix [out, in] (any strides; float32/bfloat16/float16); the tensor may be freed afterwards."""
        _, lib = ffi_lib()
        e, w = self._expert(expert), matrix_index(which)
        weight = checked_tensor(f"{which} weight of expert {e}", weight, _WEIGHT_DTYPES, self.shape(which),
                                contiguous=False)
        check_rc(lib.ktk_experts_set(self._p, e, w, pointer(weight), DTYPES[weight.dtype], weight.stride(0),
                                     weight.stride(1)))

    def set_quantized(self, expert: int, which: str, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Store one int8 / int4 matrix from values already quantized, without rounding again: ``q`` int8 [out, in]
        (int8: -127..127, int4: -8..7), ``scale`` float [out, groups] (int8: groups 1; int4: ceil(in / group_size)),
        value = q * scale (e.g. a GGUF Q4_0 or compressed-tensors int4 release)."""
        _, lib = ffi_lib()
        e, w = self._expert(expert), matrix_index(which)
        out, inp = self.shape(which)
        groups = 1 if self.quant == "int8" else -(-inp // self.group_size)
        q = checked_tensor(f"{which} values of expert {e}", q, (torch.int8,), (out, inp), contiguous=False)
        scale = checked_tensor(f"{which} scales of expert {e}", scale.float(), (torch.float32,), (out, groups),
                               contiguous=False)
        check_rc(lib.ktk_experts_set_quantized(self._p, e, w, pointer(q), q.stride(0), q.stride(1), pointer(scale),
                                               scale.stride(0), scale.stride(1)))

    def set_fp8(self, expert: int, which: str, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Store one fp8 matrix as a release ships it, bit for bit: ``q`` [out, in] float8_e4m3fn (or its bits as
        uint8), ``scale`` float32 [ceil(out / block_rows), ceil(in / group_size)] (weight_scale_inv: value = q *
        scale of its block). NativeError(KTK_ERR_RANGE) names a NaN code or a non-finite scale (nothing is stored)."""
        _, lib = ffi_lib()
        e, w = self._expert(expert), matrix_index(which)
        out, inp = self.shape(which)
        if self.quant != "fp8":
            raise NativeError(ERR_DTYPE, f"set_fp8: experts of quant {self.quant!r} (float8 e4m3 values are stored "
                                         f"only in fp8 experts)")
        q = checked_tensor(f"{which} values of expert {e}", q, _FP8_DTYPES, (out, inp), contiguous=False)
        q = q.view(torch.uint8)
        blocks = (-(-out // self.block_rows), -(-inp // self.group_size))
        scale = checked_tensor(f"{which} scales of expert {e}", scale, (torch.float32,), blocks, contiguous=False)
        check_rc(lib.ktk_experts_set_fp8(self._p, e, w, pointer(q, "uint8_t *"), q.stride(0), q.stride(1),
                                         pointer(scale, "float *"), scale.stride(0), scale.stride(1)))

    def set_mxfp4(self, expert: int, which: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """Store one mxfp4 matrix as an MXFP4 release ships it, bit for bit: ``blocks`` uint8 [out, in / 2] (e2m1
        pairs, input 2i in the low nibble of byte i: a release's ``*_blocks`` row [in / 32, 16] flattened; or
        float4_e2m1fn_x2), ``scales`` uint8 [out, in / 32] (e8m0 exponents, value = e2m1 * 2^(e - 127); or
        float8_e8m0fnu). Rows may be strided (e.g. every other row of a fused gate_up), each row's bytes
        consecutive. NativeError(KTK_ERR_RANGE) names a scale byte 255 (e8m0's NaN; nothing is stored)."""
        _, lib = ffi_lib()
        e, w = self._expert(expert), matrix_index(which)
        out, inp = self.shape(which)
        if self.quant != "mxfp4":
            raise NativeError(ERR_DTYPE, f"set_mxfp4: experts of quant {self.quant!r} (e2m1 blocks are stored only "
                                         f"in mxfp4 experts)")
        blocks = checked_tensor(f"{which} blocks of expert {e}", blocks, _MXFP4_DTYPES, (out, inp // 2),
                                contiguous=False).view(torch.uint8)
        scales = checked_tensor(f"{which} scales of expert {e}", scales, _E8M0_DTYPES, (out, inp // MXFP4_GROUP),
                                contiguous=False).view(torch.uint8)
        for name, t in (("blocks", blocks), ("scales", scales)):
            if t.stride(1) != 1 and t.shape[1] > 1:
                raise NativeError(ERR_SHAPE, f"set_mxfp4: {which} {name} of expert {e} have strides {t.stride()}: "
                                             f"each row's bytes must be consecutive (stride 1 along the inputs); "
                                             f"call .contiguous()")
        check_rc(lib.ktk_experts_set_mxfp4(self._p, e, w, pointer(blocks, "uint8_t *"), blocks.stride(0),
                                           pointer(scales, "uint8_t *"), scales.stride(0)))

    def set_bias(self, expert: int, which: str, bias: torch.Tensor) -> None:
        """Bias [out] of one matrix (experts created with bias=True)."""
        _, lib = ffi_lib()
        e, w = self._expert(expert), matrix_index(which)
        bias = checked_tensor(f"{which} bias of expert {e}", bias, _WEIGHT_DTYPES, self.shape(which)[:1],
                              contiguous=False)
        bias = bias.contiguous()
        check_rc(lib.ktk_experts_set_bias(self._p, e, w, pointer(bias), DTYPES[bias.dtype]))

    def get(self, expert: int, which: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """One matrix as stored (bf16-rounded, or int8/int4/fp8-dequantized: q * scale; mxfp4: e2m1 * 2^(e - 127)),
        float32 [out, in]; written into ``out`` (contiguous float32 of that shape, e.g. a pinned buffer) when given,
        with no torch kernel."""
        _, lib = ffi_lib()
        e, w = self._expert(expert), matrix_index(which)
        if out is None:
            dst = torch.empty(self.shape(which), dtype=torch.float32)
        else:
            dst = checked_tensor(f"out ({which} of expert {e})", out, (torch.float32,), self.shape(which))
        check_rc(lib.ktk_experts_get(self._p, e, w, pointer(dst, "float *")))
        return dst

    @property
    def nbytes(self) -> int:
        _, lib = ffi_lib()
        return int(lib.ktk_experts_nbytes(self._p))

    @staticmethod
    def packed_nbytes(num_experts: int, hidden: int, intermediate: int, quant: str = "bf16",
                      bias: bool = False, group_size: int | None = None) -> int:
        """What .nbytes will be, without the library (placement planning): the packed layout of kernels.h pads each
        matrix to 16 output rows x 64 inputs (int4: x max(64, group size)); int8 adds a float scale and an int32 row
        sum per output row; int4 is half a byte per weight plus a float scale per output row and group; fp8 is a byte
        per weight plus a float scale per 16 output rows and group (ceil(padded inputs / group)), rounded up to 64
        bytes (block_rows does not change the size); mxfp4 is half a byte per weight plus an e8m0 byte per (padded)
        output row and 32 inputs, rounded up to 64 bytes; biases are float per (padded) output row; each expert's
        region is a multiple of 64 bytes."""
        G = checked_group_size(quant, group_size, hidden, intermediate)
        E, H, I = num_experts, hidden, intermediate
        up = lambda x, m: -(-x // m) * m  # noqa: E731
        total = 0
        for n, k in ((I, H), (I, H), (H, I)):
            Np, Kp = up(n, 16), up(k, max(64, G) if quant == "int4" else 64)
            if quant == "int4":
                total += Np * Kp // 2 + 4 * Np * (Kp // G)
            elif quant == "fp8":
                total += Np * Kp + up(4 * (Np // 16) * -(-Kp // G), 64)
            elif quant == "mxfp4":
                total += Np * Kp // 2 + up(Np * Kp // MXFP4_GROUP, 64)
            else:
                total += Np * Kp * 2 if quant == "bf16" else Np * Kp + 8 * Np
            total += 4 * Np if bias else 0
        return E * up(total, 64)

    def export(self) -> torch.Tensor:
        """The packed bytes (weights, scales, biases) as a uint8 tensor [nbytes]; load_packed() takes them back."""
        _, lib = ffi_lib()
        buf = torch.empty(self.nbytes, dtype=torch.uint8)
        check_rc(lib.ktk_experts_export(self._p, pointer(buf), buf.numel()))
        return buf

    def load_packed(self, buf: torch.Tensor) -> None:
        """Import bytes made by export() of experts with the same configuration (size must match)."""
        _, lib = ffi_lib()
        buf = checked_tensor("packed buffer", buf, (torch.uint8,), (None,))
        check_rc(lib.ktk_experts_import(self._p, pointer(buf), buf.numel()))

    # ---- constructors from Hugging Face tensors ----
    def _set_all(self, jobs: list[tuple]) -> None:
        """Run set/set_bias jobs (method, expert, which, tensor), in threads when there is a lot to pack."""
        total = sum(j[3].numel() for j in jobs)
        if total < _PARALLEL_SET_ELEMENTS:
            for fn, e, which, t in jobs:
                fn(e, which, t)
            return
        with ThreadPoolExecutor(max_workers=min(8, max(1, physical_cores()))) as ex:
            for f in [ex.submit(fn, e, which, t) for fn, e, which, t in jobs]:
                f.result()

    @classmethod
    def from_hf(cls, gate_up: torch.Tensor, down: torch.Tensor, quant: str = "bf16",
                group_size: int | None = None, block_rows: int | None = None, activation: str = "silu",
                limit: float = 7.0) -> "Experts":
        """transformers 5 fused experts: gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I];
        ``activation`` "silu" or "swiglu_limit" (with ``limit``: DeepSeek-V4's ``swiglu_limit``)."""
        gate_up = checked_tensor("gate_up", gate_up, _WEIGHT_DTYPES, (None, None, None), contiguous=False)
        E, I2, H = gate_up.shape
        if I2 % 2:
            raise NativeError(ERR_SHAPE, f"gate_up: expected shape [E, 2I, H], got {list(gate_up.shape)} (odd 2I)")
        I = I2 // 2
        down = checked_tensor("down", down, _WEIGHT_DTYPES, (E, H, I), contiguous=False)
        ex = cls(E, H, I, quant=quant, group_size=group_size, block_rows=block_rows, activation=activation,
                 limit=limit)
        jobs = []
        for e in range(E):
            jobs += [(ex.set, e, "gate", gate_up[e, :I]), (ex.set, e, "up", gate_up[e, I:]),
                     (ex.set, e, "down", down[e])]
        ex._set_all(jobs)
        return ex

    @classmethod
    def from_gpt_oss(cls, gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                     down_bias: torch.Tensor, alpha: float = 1.702, limit: float = 7.0,
                     quant: str = "bf16", group_size: int | None = None, block_rows: int | None = None) -> "Experts":
        """gpt-oss experts: gate_up_proj [E, H, 2I] interleaved (even = gate, odd = up), gate_up_proj_bias [E, 2I],
        down_proj [E, I, H], down_proj_bias [E, H]."""
        gate_up = checked_tensor("gate_up", gate_up, _WEIGHT_DTYPES, (None, None, None), contiguous=False)
        E, H, I2 = gate_up.shape
        if I2 % 2:
            raise NativeError(ERR_SHAPE, f"gate_up: expected shape [E, H, 2I], got {list(gate_up.shape)} (odd 2I)")
        I = I2 // 2
        gate_up_bias = checked_tensor("gate_up_bias", gate_up_bias, _WEIGHT_DTYPES, (E, I2), contiguous=False)
        down = checked_tensor("down", down, _WEIGHT_DTYPES, (E, I, H), contiguous=False)
        down_bias = checked_tensor("down_bias", down_bias, _WEIGHT_DTYPES, (E, H), contiguous=False)
        ex = cls(E, H, I, quant=quant, activation="gptoss", alpha=alpha, limit=limit, bias=True,
                 group_size=group_size, block_rows=block_rows)
        jobs = []
        for e in range(E):
            jobs += [(ex.set, e, "gate", gate_up[e, :, 0::2].t()), (ex.set, e, "up", gate_up[e, :, 1::2].t()),
                     (ex.set, e, "down", down[e].t()), (ex.set_bias, e, "gate", gate_up_bias[e, 0::2]),
                     (ex.set_bias, e, "up", gate_up_bias[e, 1::2]), (ex.set_bias, e, "down", down_bias[e])]
        ex._set_all(jobs)
        return ex

    # ---- forward ----
    def _forward_args(self, hidden, ids, weights, skip, out) -> tuple:
        """Checked (T, k, hidden, hidden_dtype, ids, weights, weights_dtype, skip, out, out_dtype) + out tensor."""
        ffi, _ = ffi_lib()
        hidden = checked_tensor("hidden", hidden, _WEIGHT_DTYPES, (None, self.hidden))
        T = hidden.shape[0]
        ids = checked_tensor("ids", ids, (torch.int64,), (T, None))
        k = ids.shape[1]
        if k == 0 and T:
            raise NativeError(ERR_SHAPE, f"ids has shape [{T}, 0]: each token needs at least one expert (k >= 1)")
        weights = checked_tensor("weights", weights, _OUT_DTYPES, (T, k))
        if skip is not None:
            skip = checked_tensor("skip", skip, (torch.uint8, torch.bool), (self.num_experts,))
        if out is None:
            dtype = hidden.dtype if hidden.dtype in _OUT_DTYPES else torch.float32
            out = torch.empty(T, self.hidden, dtype=dtype)
        else:
            out = checked_tensor("out", out, _OUT_DTYPES, (T, self.hidden))
        skip_p = ffi.NULL if skip is None else pointer(skip, "uint8_t *")
        args = (T, k, pointer(hidden), DTYPES[hidden.dtype], pointer(ids, "int64_t *"), pointer(weights),
                DTYPES[weights.dtype], skip_p, pointer(out), DTYPES[out.dtype])
        return args, (hidden, ids, weights, skip, out)

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                skip: torch.Tensor | None = None, out: torch.Tensor | None = None,
                pool: Pool | None = None) -> torch.Tensor:
        """out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(hidden[t]) over experts not masked by skip [E].

        hidden [T, H] f32/bf16/f16, ids [T, k] int64, weights [T, k] f32/bf16, all contiguous; out [T, H] f32/bf16
        (default: hidden's dtype if f32/bf16, else f32), written, not accumulated. Runs on pool (default_pool())."""
        _, lib = ffi_lib()
        args, keep = self._forward_args(hidden, ids, weights, skip, out)
        if args[0] == 0:
            return keep[-1]
        pool = default_pool() if pool is None else pool
        check_rc(lib.ktk_forward(pool.ptr, self._p, *args))
        return keep[-1]

    __call__ = forward

    def backward(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, dy: torch.Tensor,
                 skip: torch.Tensor | None = None, dx: bool = True, dweights: bool = True,
                 pool: Pool | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Gradients of ``forward(hidden, ids, weights, skip)`` given dy = d loss / d out [T, H] (f32/bf16,
        contiguous): (dx [T, H] in dy's dtype, dweights [T, k] float32), each None where not asked for; the expert
        weights are constants. Float arithmetic with the stored weights dequantized and hidden, dy as given
        (ktk_backward in the header); gate and up are recomputed."""
        _, lib = ffi_lib()
        if not (dx or dweights):
            raise NativeError(ERR_SHAPE, "backward: neither dx nor dweights asked for (nothing to compute)")
        dy = checked_tensor("dy", dy, _OUT_DTYPES, (None, self.hidden))
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 2 and hidden.shape[0] != dy.shape[0]:
            raise NativeError(ERR_SHAPE, f"dy has {dy.shape[0]} rows, hidden {hidden.shape[0]} (one per token)")
        args, (hidden, ids, weights, skip, _) = self._forward_args(hidden, ids, weights, skip, dy)  # (out: dy)
        T, k = ids.shape
        gx = torch.empty(T, self.hidden, dtype=dy.dtype) if dx else None
        gw = torch.empty(T, k, dtype=torch.float32) if dweights else None
        if T == 0:
            return gx, gw
        null = ffi_lib()[0].NULL
        pool = default_pool() if pool is None else pool
        check_rc(lib.ktk_backward(pool.ptr, self._p, *args[:8], pointer(dy), DTYPES[dy.dtype],
                                  null if gx is None else pointer(gx), DTYPES[dy.dtype],
                                  null if gw is None else pointer(gw, "float *")))
        return gx, gw


    def project(self, which: str, x: torch.Tensor, experts: torch.Tensor, transpose: bool = False,
                out: torch.Tensor | None = None, pool: Pool | None = None, precision: str = "float") -> torch.Tensor:
        """One matrix W [out, in] of each row's expert applied to the rows of x, with the stored weights:
        ``y[r] = W_{experts[r]} x[r]`` (x [R, in] -> y [R, out]), or with ``transpose`` ``y[r] = W^T x[r]`` (x [R, out]
        -> y [R, in]); no bias, no activation. x f32/bf16/f16, experts [R] int64 (any order), both contiguous; out
        f32/bf16 (default f32), written. ``precision`` "float": float arithmetic with the stored weights dequantized
        (the values ``get`` gives) and x as given; "bf16": for the experts with at least 16 rows, x and those values
        rounded to bf16 and the products summed in float (AMX tiles on the amx ISA; about 2^-8 of sum |x w| per
        output); "auto": bf16 where the ISA in use is amx, else float (ktk_experts_project in the header). The base
        products of training's expert LoRA."""
        _, lib = ffi_lib()
        if precision == "auto":
            precision = "bf16" if isa() == "amx" else "float"
        if precision not in PRECISIONS:
            raise NativeError(ERR_DTYPE, f"precision = {precision!r} (expected 'float', 'bf16' or 'auto')")
        w = matrix_index(which)
        n_out, n_in = self.shape(which)
        if transpose:
            n_out, n_in = n_in, n_out
        x = checked_tensor("x", x, _WEIGHT_DTYPES, (None, n_in))
        R = x.shape[0]
        experts = checked_tensor("experts", experts, (torch.int64,), (R,))
        if out is None:
            out = torch.empty(R, n_out, dtype=torch.float32)
        else:
            out = checked_tensor("out", out, _OUT_DTYPES, (R, n_out))
        if R == 0:
            return out
        pool = default_pool() if pool is None else pool
        check_rc(lib.ktk_experts_project(pool.ptr, self._p, w, R, pointer(experts, "int64_t *"), pointer(x),
                                         DTYPES[x.dtype], pointer(out), DTYPES[out.dtype], int(bool(transpose)),
                                         PRECISIONS[precision]))
        return out

    def _lora_args(self, which: str, z, experts, a, b) -> tuple[int, int, int, int]:
        """(matrix index, its outputs, rows, rank) of ``lora``'s arguments, each checked."""
        w = matrix_index(which)
        n_out, n_in = self.shape(which)
        z = checked_tensor("z", z, (torch.float32,), (None, n_in))
        a = checked_tensor("a", a, (torch.float32,), (self.num_experts, None, n_in))
        checked_tensor("b", b, (torch.float32,), (self.num_experts, n_out, a.shape[1]))
        checked_tensor("experts", experts, (torch.int64,), (z.shape[0],))
        return w, n_out, z.shape[0], a.shape[1]

    def lora(self, which: str, z: torch.Tensor, experts: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             y: torch.Tensor, pool: Pool | None = None) -> torch.Tensor:
        """LoRA adapters a [E, rank, in], b [E, out, rank] (float32, b scaled) of matrix ``which`` applied to the
        rows: ``t[r] = a[e_r] z[r]`` [R, rank], returned, and ``y[r] += b[e_r] t[r]`` (y [R, out], in place);
        z [R, in] float32, experts [R] int64 (any order), all contiguous (ktk_experts_lora)."""
        _, lib = ffi_lib()
        w, n_out, R, rank = self._lora_args(which, z, experts, a, b)
        y = checked_tensor("y", y, (torch.float32,), (R, n_out))
        t = torch.empty(R, rank, dtype=torch.float32)
        bt = b.transpose(1, 2).contiguous()  # the library reads B as [E, rank, out]
        pool = default_pool() if pool is None else pool
        check_rc(lib.ktk_experts_lora(pool.ptr, self._p, w, R, rank, pointer(experts, "int64_t *"),
                                      pointer(z, "float *"), pointer(a, "float *"), pointer(bt, "float *"),
                                      pointer(t, "float *"), pointer(y, "float *")))
        return t

    def lora_backward(self, which: str, z: torch.Tensor, t: torch.Tensor, dy: torch.Tensor, experts: torch.Tensor,
                      a: torch.Tensor, b: torch.Tensor, pool: Pool | None = None):
        """The backward of ``lora``: (dz [R, in], dt [R, rank], da [E, rank, in], db [E, out, rank]) for the rows'
        output gradient dy [R, out], with z and t the forward's (ktk_experts_lora_backward)."""
        _, lib = ffi_lib()
        w, n_out, R, rank = self._lora_args(which, z, experts, a, b)
        t = checked_tensor("t", t, (torch.float32,), (R, rank))
        dy = checked_tensor("dy", dy, (torch.float32,), (R, n_out))
        dz = torch.empty(R, z.shape[1], dtype=torch.float32)
        dt, da = torch.empty(R, rank, dtype=torch.float32), torch.empty_like(a)
        bt = b.transpose(1, 2).contiguous()  # B and its gradient as [E, rank, out] in the library
        dbt = torch.empty_like(bt)
        pool = default_pool() if pool is None else pool
        check_rc(lib.ktk_experts_lora_backward(
            pool.ptr, self._p, w, R, rank, pointer(experts, "int64_t *"), pointer(z, "float *"),
            pointer(t, "float *"), pointer(dy, "float *"), pointer(a, "float *"), pointer(bt, "float *"),
            pointer(dt, "float *"), pointer(dz, "float *"), pointer(da, "float *"), pointer(dbt, "float *")))
        return dz, dt, da, dbt.transpose(1, 2).contiguous()


Experts.__module__ = "ktinject.native"  # where users import it from
