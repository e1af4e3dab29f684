"""Thin 1:1 wrappers of the native core (native/include/ktinject.h): tensor -> pointer, error code -> exception.

Library functions, NativeError and Pool live in ktinject.native.library and are re-exported here. The native module is
loaded on first use, never at import; cffi API-mode calls release the GIL while native code runs.

Legend: T tokens, k experts per token, E experts, H hidden, I expert intermediate.

    ex = Experts.from_hf(gate_up, down)              # gate_up [E, 2I, H], down [E, H, I] (any float dtype/strides)
    y = ex(hidden, ids, weights)                     # hidden [T, H], ids [T, k] int64, weights [T, k] -> [T, H]
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ktinject import envs
from ktinject.native.library import (  # noqa: F401  (re-exported)
    ACTIVATIONS, DTYPES, ERR_DTYPE, ERR_ISA, ERR_NOMEM, ERR_NULL, ERR_RANGE, ERR_SHAPE, ERR_STATE, ERR_THREAD,
    ERROR_NAMES, GROUP_SIZES, ISA_NAMES, MATRICES, OK, QUANTS, NativeError, Pool,
    _check, _cint, _native, _ptr, _tensor, available_isas, best_isa, cpu_features, default_pool, isa, library_path,
    physical_cores, default_threads, set_default_threads, set_isa, usable_cpus, version, RawMatrix, experts_raw,
    experts_region, experts_region_view)

log = logging.getLogger(__name__)

_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.float32, torch.bfloat16)
_PARALLEL_SET_ELEMENTS = 1 << 24  # from_hf/from_gpt_oss pack in threads above this many weight elements


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


def _quant_args(quant: Any, group_size: Any, hidden: int, intermediate: int) -> int:
    """Check quant and group_size (the int4 group size, validated for every quant; None: default_group_size);
    returns the group size."""
    if quant not in QUANTS:
        raise NativeError(ERR_DTYPE, f"quant = {quant!r} (expected one of {', '.join(QUANTS)})")
    if group_size is None:  # (the group means nothing to bf16 / int8: no environment read for them)
        return default_group_size(hidden, intermediate) if quant == "int4" else 64
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise NativeError(ERR_SHAPE, f"group_size = {group_size!r} (expected one of "
                                     f"{', '.join(map(str, GROUP_SIZES))}: int4 inputs per scale)")
    return int(group_size)


def _which(which: Any) -> int:
    if which in MATRICES:
        return MATRICES[which]
    raise NativeError(ERR_SHAPE, f"which = {which!r} is not a matrix (expected 'gate', 'up' or 'down')")


class Experts:
    """The routed experts of one MoE layer, packed once for the native kernels (see ktk_experts_* in the header).

    quant: "bf16" (weights rounded to bf16), "int8" (W8A8: int8 per output channel, activations per token) or
    "int4" (W4A8: int4 per output channel and group of ``group_size`` inputs, 32, 64 or 128, by default
    ``default_group_size(hidden, intermediate)``; activations as int8).
    activation: "silu" (silu(g) * u) or "gptoss" (clamped, alpha/limit; usually with bias=True).
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, quant: str = "bf16",
                 activation: str = "silu", alpha: float = 1.702, limit: float = 7.0, bias: bool = False,
                 group_size: int | None = None):
        ffi, lib = _native()
        if activation not in ACTIVATIONS:
            raise NativeError(ERR_DTYPE, f"activation = {activation!r} (expected one of {', '.join(ACTIVATIONS)})")
        self.num_experts = _cint("num_experts", num_experts)
        self.hidden = _cint("hidden", hidden)
        self.intermediate = _cint("intermediate", intermediate)
        self.group_size = _quant_args(quant, group_size, self.hidden, self.intermediate)
        self.quant, self.activation, self.bias = quant, activation, bool(bias)
        self.alpha, self.limit = float(alpha), float(limit)
        cfg = ffi.new("ktk_experts_config *", {
            "num_experts": self.num_experts, "hidden": self.hidden, "intermediate": self.intermediate,
            "quant": QUANTS[quant], "activation": ACTIVATIONS[activation], "has_bias": int(self.bias),
            "alpha": self.alpha, "limit": self.limit, "group_size": self.group_size if quant == "int4" else 0})
        out = ffi.new("ktk_experts **")
        _check(lib.ktk_experts_create(cfg, out))
        self._p = ffi.gc(out[0], lib.ktk_experts_destroy)

    @staticmethod
    def checked_group_size(quant: str, group_size: int | None, hidden: int, intermediate: int) -> int:
        """The group size these arguments give (None: ``default_group_size``), or NativeError naming the bad one."""
        return _quant_args(quant, group_size, hidden, intermediate)

    def __repr__(self) -> str:
        group = f", group_size={self.group_size}" if self.quant == "int4" else ""
        return (f"Experts(E={self.num_experts}, H={self.hidden}, I={self.intermediate}, quant={self.quant!r}{group}, "
                f"activation={self.activation!r}, bias={self.bias}, nbytes={self.nbytes})")

    def shape(self, which: str) -> tuple[int, int]:
        """[out, in] of one matrix: gate/up [I, H], down [H, I]."""
        w = _which(which)
        return (self.intermediate, self.hidden) if w < 2 else (self.hidden, self.intermediate)

    def _expert(self, expert: Any) -> int:
        return _cint("expert", expert, 0, self.num_experts - 1, code=ERR_RANGE)

    # ---- weights ----
    def set(self, expert: int, which: str, weight: torch.Tensor) -> None:
        """Pack one matrix [out, in] (any strides; float32/bfloat16/float16); the tensor may be freed afterwards."""
        _, lib = _native()
        e, w = self._expert(expert), _which(which)
        weight = _tensor(f"{which} weight of expert {e}", weight, _WEIGHT_DTYPES, self.shape(which), contiguous=False)
        _check(lib.ktk_experts_set(self._p, e, w, _ptr(weight), DTYPES[weight.dtype], weight.stride(0),
                                   weight.stride(1)))

    def set_bias(self, expert: int, which: str, bias: torch.Tensor) -> None:
        """Bias [out] of one matrix (experts created with bias=True)."""
        _, lib = _native()
        e, w = self._expert(expert), _which(which)
        bias = _tensor(f"{which} bias of expert {e}", bias, _WEIGHT_DTYPES, self.shape(which)[:1], contiguous=False)
        bias = bias.contiguous()
        _check(lib.ktk_experts_set_bias(self._p, e, w, _ptr(bias), DTYPES[bias.dtype]))

    def get(self, expert: int, which: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """One matrix as stored (bf16-rounded, or int8/int4-dequantized: q * scale), float32 [out, in]; written into
        ``out`` (contiguous float32 of that shape, e.g. a pinned buffer) when given, with no torch kernel."""
        _, lib = _native()
        e, w = self._expert(expert), _which(which)
        if out is None:
            dst = torch.empty(self.shape(which), dtype=torch.float32)
        else:
            dst = _tensor(f"out ({which} of expert {e})", out, (torch.float32,), self.shape(which))
        _check(lib.ktk_experts_get(self._p, e, w, _ptr(dst, "float *")))
        return dst

    @property
    def nbytes(self) -> int:
        _, lib = _native()
        return int(lib.ktk_experts_nbytes(self._p))

    @staticmethod
    def packed_nbytes(num_experts: int, hidden: int, intermediate: int, quant: str = "bf16",
                      bias: bool = False, group_size: int | None = None) -> int:
        """What .nbytes will be, without the library (placement planning): the packed layout of kernels.h pads each
        matrix to 16 output rows x 64 inputs (int4: x max(64, group size)); int8 adds a float scale and an int32 row
        sum per output row; int4 is half a byte per weight plus a float scale per output row and group; biases are
        float per (padded) output row; each expert's region is a multiple of 64 bytes."""
        G = _quant_args(quant, group_size, hidden, intermediate)
        E, H, I = num_experts, hidden, intermediate
        up = lambda x, m: -(-x // m) * m  # noqa: E731
        total = 0
        for n, k in ((I, H), (I, H), (H, I)):
            Np, Kp = up(n, 16), up(k, max(64, G) if quant == "int4" else 64)
            if quant == "int4":
                total += Np * Kp // 2 + 4 * Np * (Kp // G)
            else:
                total += Np * Kp * 2 if quant == "bf16" else Np * Kp + 8 * Np
            total += 4 * Np if bias else 0
        return E * up(total, 64)

    def export(self) -> torch.Tensor:
        """The packed bytes (weights, scales, biases) as a uint8 tensor [nbytes]; load_packed() takes them back."""
        _, lib = _native()
        buf = torch.empty(self.nbytes, dtype=torch.uint8)
        _check(lib.ktk_experts_export(self._p, _ptr(buf), buf.numel()))
        return buf

    def load_packed(self, buf: torch.Tensor) -> None:
        """Import bytes made by export() of experts with the same configuration (size must match)."""
        _, lib = _native()
        buf = _tensor("packed buffer", buf, (torch.uint8,), (None,))
        _check(lib.ktk_experts_import(self._p, _ptr(buf), buf.numel()))

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
                group_size: int | None = None) -> "Experts":
        """transformers 5 fused experts: gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I]."""
        gate_up = _tensor("gate_up", gate_up, _WEIGHT_DTYPES, (None, None, None), contiguous=False)
        E, I2, H = gate_up.shape
        if I2 % 2:
            raise NativeError(ERR_SHAPE, f"gate_up: expected shape [E, 2I, H], got {list(gate_up.shape)} (odd 2I)")
        I = I2 // 2
        down = _tensor("down", down, _WEIGHT_DTYPES, (E, H, I), contiguous=False)
        ex = cls(E, H, I, quant=quant, group_size=group_size)
        jobs = []
        for e in range(E):
            jobs += [(ex.set, e, "gate", gate_up[e, :I]), (ex.set, e, "up", gate_up[e, I:]),
                     (ex.set, e, "down", down[e])]
        ex._set_all(jobs)
        return ex

    @classmethod
    def from_gpt_oss(cls, gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                     down_bias: torch.Tensor, alpha: float = 1.702, limit: float = 7.0,
                     quant: str = "bf16", group_size: int | None = None) -> "Experts":
        """gpt-oss experts: gate_up_proj [E, H, 2I] interleaved (even = gate, odd = up), gate_up_proj_bias [E, 2I],
        down_proj [E, I, H], down_proj_bias [E, H]."""
        gate_up = _tensor("gate_up", gate_up, _WEIGHT_DTYPES, (None, None, None), contiguous=False)
        E, H, I2 = gate_up.shape
        if I2 % 2:
            raise NativeError(ERR_SHAPE, f"gate_up: expected shape [E, H, 2I], got {list(gate_up.shape)} (odd 2I)")
        I = I2 // 2
        gate_up_bias = _tensor("gate_up_bias", gate_up_bias, _WEIGHT_DTYPES, (E, I2), contiguous=False)
        down = _tensor("down", down, _WEIGHT_DTYPES, (E, I, H), contiguous=False)
        down_bias = _tensor("down_bias", down_bias, _WEIGHT_DTYPES, (E, H), contiguous=False)
        ex = cls(E, H, I, quant=quant, activation="gptoss", alpha=alpha, limit=limit, bias=True,
                 group_size=group_size)
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
        ffi, _ = _native()
        hidden = _tensor("hidden", hidden, _WEIGHT_DTYPES, (None, self.hidden))
        T = hidden.shape[0]
        ids = _tensor("ids", ids, (torch.int64,), (T, None))
        k = ids.shape[1]
        if k == 0 and T:
            raise NativeError(ERR_SHAPE, f"ids has shape [{T}, 0]: each token needs at least one expert (k >= 1)")
        weights = _tensor("weights", weights, _OUT_DTYPES, (T, k))
        if skip is not None:
            skip = _tensor("skip", skip, (torch.uint8, torch.bool), (self.num_experts,))
        if out is None:
            dtype = hidden.dtype if hidden.dtype in _OUT_DTYPES else torch.float32
            out = torch.empty(T, self.hidden, dtype=dtype)
        else:
            out = _tensor("out", out, _OUT_DTYPES, (T, self.hidden))
        skip_p = ffi.NULL if skip is None else _ptr(skip, "uint8_t *")
        args = (T, k, _ptr(hidden), DTYPES[hidden.dtype], _ptr(ids, "int64_t *"), _ptr(weights),
                DTYPES[weights.dtype], skip_p, _ptr(out), DTYPES[out.dtype])
        return args, (hidden, ids, weights, skip, out)

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                skip: torch.Tensor | None = None, out: torch.Tensor | None = None,
                pool: Pool | None = None) -> torch.Tensor:
        """out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(hidden[t]) over experts not masked by skip [E].

        hidden [T, H] f32/bf16/f16, ids [T, k] int64, weights [T, k] f32/bf16, all contiguous; out [T, H] f32/bf16
        (default: hidden's dtype if f32/bf16, else f32), written, not accumulated. Runs on pool (default_pool())."""
        _, lib = _native()
        args, keep = self._forward_args(hidden, ids, weights, skip, out)
        if args[0] == 0:
            return keep[-1]
        pool = default_pool() if pool is None else pool
        _check(lib.ktk_forward(pool.ptr, self._p, *args))
        return keep[-1]

    __call__ = forward


class Task:
    """One forward's arguments at a fixed address, run asynchronously on a pool (ktk_task_*).

    bind() keeps references to the bound tensors; the native side reads their memory each time the task runs, so
    refill them in place between runs. The task's address and host_fn_addresses() are for cuLaunchHostFunc; watch()
    lets a pool thread run it when a 32-bit go flag (e.g. pinned memory written by a CUDA stream) becomes 1."""

    def __init__(self, pool: Pool | None = None):
        ffi, lib = _native()
        self.pool = default_pool() if pool is None else pool
        out = ffi.new("ktk_task **")
        _check(lib.ktk_task_create(self.pool.ptr, out))
        self._p = ffi.gc(out[0], lib.ktk_task_destroy)
        self._bound: tuple = ()
        self._watch: tuple = ()
        self._signal: torch.Tensor | None = None
        self.pool._tasks.add(self)

    @property
    def ptr(self):
        if self._p is None:
            raise NativeError(ERR_STATE, "Task is closed")
        return self._p

    @property
    def address(self) -> int:
        """The ktk_task* as an int (argument of ktk_submit_fn / ktk_wait_fn)."""
        ffi, _ = _native()
        return int(ffi.cast("uintptr_t", self.ptr))

    @property
    def out(self) -> torch.Tensor | None:
        return self._bound[-1] if self._bound else None

    def bind(self, experts: Experts, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
             skip: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Bind a forward (same arguments as Experts.forward); returns out (allocated when None). T must be >= 1."""
        _, lib = _native()
        if not isinstance(experts, Experts):
            raise NativeError(ERR_NULL, f"experts: expected ktinject.native.Experts, got {type(experts).__name__}")
        args, keep = experts._forward_args(hidden, ids, weights, skip, out)
        if args[0] == 0:
            raise NativeError(ERR_SHAPE, "Task.bind: hidden has no tokens (T = 0); a task runs at least one")
        _check(lib.ktk_task_bind(self.ptr, experts._p, *args))
        self._bound = (experts,) + keep
        return keep[-1]

    def submit(self) -> None:
        _, lib = _native()
        _check(lib.ktk_submit(self.ptr))

    def wait(self) -> None:
        """Wait for the latest run; raises its error (or one kept from a host-function or watched run)."""
        _, lib = _native()
        _check(lib.ktk_wait(self.ptr))

    def signal(self, word: torch.Tensor | None) -> None:
        """Every submitted run stores 1 to ``word`` (one int32 element, page-locked where a GPU reads it) at its end
        (out complete, or the run failed: wait() then raises its error), before the task is idle: a CUDA kernel
        polling the word waits for the run while the host goes on (ktk_task_signal). The waiter resets it to 0
        before the next submit. None: none. Kept across bind(); the task holds a reference to it."""
        ffi, lib = _native()
        if word is not None and (not isinstance(word, torch.Tensor) or word.dtype != torch.int32
                                 or word.numel() != 1 or word.device.type != "cpu"):
            raise NativeError(ERR_SHAPE, f"signal: expected one int32 element in host memory, got "
                              f"{type(word).__name__ if not isinstance(word, torch.Tensor) else word.dtype} x "
                              f"{word.numel() if isinstance(word, torch.Tensor) else '?'}")
        ptr = ffi.NULL if word is None else ffi.cast("volatile uint32_t *", word.data_ptr())
        _check(lib.ktk_task_signal(self.ptr, ptr))
        self._signal = word

    def times(self) -> tuple[float, float]:
        """The latest run's (start, end) in seconds on time.perf_counter's clock (CLOCK_MONOTONIC), (0.0, 0.0)
        before any run; call when the task is not running (after wait(), or once its signal word is 1 and wait()
        returned)."""
        ffi, lib = _native()
        begin, end = ffi.new("int64_t *"), ffi.new("int64_t *")
        _check(lib.ktk_task_times(self.ptr, begin, end))
        return begin[0] / 1e9, end[0] / 1e9

    def select(self, slots: str = "all", defer: int | float = 0) -> None:
        """Which of each token's k slots the bound forward computes (expert deferral): "all", "top" (the token's
        immediate slots) or "rest" (its deferred ones). ``defer``: an int d, the d lowest-weighted slots deferred
        (ktk_task_select), or a float share 0 < m < 1, the lowest-weighted slots whose cumulative share of the
        token's routing weight stays <= m, never the top one (ktk_task_select_share; m is read as a C float).
        Ranking: equal weights, the lower slot first. bind() resets it to "all"."""
        _, lib = _native()
        codes = {"all": lib.KTK_SLOTS_ALL, "top": lib.KTK_SLOTS_TOP, "rest": lib.KTK_SLOTS_REST}
        if slots not in codes:
            raise NativeError(ERR_SHAPE, f"select: slots {slots!r}: expected one of {', '.join(codes)}")
        if isinstance(defer, float):
            _check(lib.ktk_task_select_share(self.ptr, codes[slots], defer))
        else:
            _check(lib.ktk_task_select(self.ptr, codes[slots], _cint("defer", defer, 0, 2**31 - 1)))

    def split(self, defer: int | float, out2: torch.Tensor | None = None, done_top_addr: int | None = None
              ) -> torch.Tensor:
        """Both parts of expert deferral in one run (ktk_task_split): the immediate slots into the bound out, the
        deferred ones (``defer`` as in select) into out2 (allocated like out when None), and 1 stored to the uint32
        word at ``done_top_addr`` (if given; it must stay valid while the task runs) as soon as out is complete.
        Returns out2. bind() undoes it."""
        ffi, lib = _native()
        out = self.out
        if out is None:
            raise NativeError(ERR_STATE, "split: bind a forward first")
        if out2 is None:
            out2 = torch.empty_like(out)
        if out2.shape != out.shape or out2.dtype != out.dtype or not out2.is_contiguous() or out2.device.type != "cpu":
            raise NativeError(ERR_SHAPE, f"split: out2 must be a contiguous CPU tensor like out ({tuple(out.shape)}, "
                                         f"{out.dtype}), got {tuple(out2.shape)}, {out2.dtype}")
        top = ffi.NULL if done_top_addr is None else ffi.cast("volatile uint32_t *", _cint(
            "done_top_addr", done_top_addr, 1, 2**64 - 1, code=ERR_NULL))
        d, share = (0, defer) if isinstance(defer, float) else (_cint("defer", defer, 0, 2**31 - 1), 0.0)
        _check(lib.ktk_task_split(self.ptr, d, share, ffi.cast("void *", out2.data_ptr()), top))
        self._bound = self._bound[:-1] + (out2, self._bound[-1])  # kept alive; out stays last
        return out2

    def slots_rest(self, reset: bool = False) -> int:
        """Of slots_run, the rows of a split task's deferred part (ktk_task_slots_rest)."""
        _, lib = _native()
        return int(lib.ktk_task_slots_rest(self.ptr, int(bool(reset))))

    def slots_run(self, reset: bool = False) -> int:
        """(token, slot) rows computed (selected and not skipped), summed over the runs since the task was made or
        last reset (bind keeps the sum); ``reset``: set it to 0 after reading. Read it while the task is idle."""
        _, lib = _native()
        return int(lib.ktk_task_slots_run(self.ptr, int(bool(reset))))

    def watch(self, go_addr: int, done_addr: int, then_addr: int | None = None) -> None:
        """Run whenever *go == 1 (a pool thread stores 0 to *go, runs, stores 1 to *done, then 1 to *then if
        given: another watched task's go word, so that task runs next). go/done/then: addresses of 4-byte aligned
        uint32 words that stay valid until unwatch()/close()."""
        ffi, lib = _native()
        go, done = (_cint(n, a, 1, 2**64 - 1, code=ERR_NULL) for n, a in (("go_addr", go_addr),
                                                                           ("done_addr", done_addr)))
        then = ffi.NULL if then_addr is None else ffi.cast(
            "uint32_t *", _cint("then_addr", then_addr, 1, 2**64 - 1, code=ERR_NULL))
        _check(lib.ktk_task_watch_then(self.ptr, ffi.cast("uint32_t *", go), ffi.cast("uint32_t *", done), then))
        self._watch = (go, done, then_addr)

    @property
    def watched(self) -> bool:
        """Whether watch() holds (no unwatch() or close() since)."""
        return bool(self._watch)

    def unwatch(self) -> None:
        """Stop watching; raises the first error of a watched run since watch(), if any."""
        _, lib = _native()
        self._watch = ()
        _check(lib.ktk_task_unwatch(self.ptr))

    def close(self) -> None:
        """Unwatch, wait for a running forward, free the task. Idempotent."""
        if self._p is not None:
            ffi, _ = _native()
            p, self._p = self._p, None
            ffi.release(p)
            self._bound = self._watch = ()
            self._signal = None

    def __enter__(self) -> "Task":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def valid_defer(value: Any, k: int | None = None) -> bool:
    """Whether ``value`` is an expert-deferral setting (Task.select's ``defer``) for k slots per token: an int
    0 <= d < k (a bool is not one), or a float 0 < m < 1; k None: d is not checked against it."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 0 and (k is None or value < k)
    return isinstance(value, float) and 0 < value < 1


def host_fn_addresses() -> tuple[int, int]:
    """Addresses of ktk_submit_fn and ktk_wait_fn (void(*)(void *)), for cuLaunchHostFunc with Task.address."""
    ffi, lib = _native()
    return (int(ffi.cast("uintptr_t", ffi.addressof(lib, "ktk_submit_fn"))),
            int(ffi.cast("uintptr_t", ffi.addressof(lib, "ktk_wait_fn"))))


__all__ = ["NativeError", "OK", "ERR_NULL", "ERR_SHAPE", "ERR_RANGE", "ERR_DTYPE", "ERR_ISA", "ERR_NOMEM",
           "ERR_STATE", "ERR_THREAD", "ERROR_NAMES", "ISA_NAMES", "version", "cpu_features", "isa", "best_isa",
           "available_isas", "set_isa", "physical_cores", "usable_cpus", "library_path", "Pool", "default_pool",
           "default_threads", "set_default_threads", "Experts", "Task", "valid_defer", "host_fn_addresses"]
