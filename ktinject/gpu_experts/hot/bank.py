"""GPU-resident ("hot") routed experts of one HybridMoE: a weight bank on the block's device and a graph-capturable
compute for the (token, slot) pairs routed to it. ``placement`` decides which experts live here.

Bank of C slots, allocated once (addresses fixed for its life, so captured graphs stay valid while contents change):
    gate_up [C, 2I, H] (gate rows, then up rows)   down [C, H, I]   dtype D (the model's: bf16 -> 2 B/weight)
    gpt-oss only: gate_up_bias [C, 2I], down_bias [C, H]
    slot_of [E] int64: each expert's slot, -1 = not resident (the CPU computes it)
    resident [E] uint8: slot_of >= 0 (the native skip mask; HybridMoE copies it to its pinned ``skip`` each step
                 when re-placement is on, so the CPU and the GPU always agree on who computes what in a step)
    hits [] int64: (token, slot) pairs served from the bank (h = hits / routed pairs)

Compute, for x [T, H], ids [T, k], weights [T, k] (static shapes, no host sync: captured with the decode step):
the T*k pairs are keyed by their slot (non-resident pairs get key C), sorted, and run as a grouped GEMM (torch
grouped_mm, group g = the rows of slot g, end offsets by searchsorted): only slots that received rows are read, so
a decode token costs the bytes of the resident experts it uses. Rows of non-resident pairs lie past the last
offset: the kernel leaves them unwritten and they are masked out. Rejected alternatives: a loop over the resident
slots with a mask reads every resident expert every step (a bank of many GiB: milliseconds a token even at HBM
speed) and launches 3C GEMMs per layer; a gather of each pair's weights (bank[slot] then bmm) copies k experts per
token and reads them twice. That gather is the fallback where grouped_mm is unusable (non-bf16 on CUDA, GPUs before Hopper,
old CPU builds): fine for tests and small models, chunked for long prompts.

Weights come from the native (CPU) copy, which stays as it is (the skip mask leaves resident experts out there):
bf16 experts land in the bank bit-exact; int8 experts are dequantized into it (the GPU then runs the dequantized
weights with bf16 activations instead of W8A8).

Runtime re-placement (``rebalance.Rebalancer``) swaps bank contents and the two tables in place between decode
steps; for it, a dynamic bank keeps ``packed``, the layer's packed native copy page-locked once (on CUDA), from which
a move copies the bytes as stored and unpacks them on the device (``upload``).
Legend: T tokens, k experts per token, S = T*k pairs, E experts, C bank slots, H hidden, I intermediate.
"""
from __future__ import annotations

import logging
from typing import NamedTuple, Sequence

import torch

from ktinject.gpu_experts.hot.upload import GPU_QUANTS, PackedRegion

log = logging.getLogger(__name__)

_GATHER_CHUNK = 256  # pairs per gathered bmm in the fallback path (bounds the [chunk, 2I, H] copy)
_grouped_ok_cache: dict[tuple, bool] = {}


def _grouped_fn():
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM runs here without host syncs: bf16 on Hopper/Blackwell, or on the CPU; checked
    once per (device, dtype) against a plain matmul (call outside graph capture)."""
    key = (str(device), dtype)
    if key in _grouped_ok_cache:
        return _grouped_ok_cache[key]
    ok = False
    fn = _grouped_fn()
    if fn is not None and (device.type == "cpu" or (device.type == "cuda" and dtype == torch.bfloat16
                                                    and torch.cuda.get_device_capability(device)[0] in (9, 10))):
        try:
            g = torch.Generator().manual_seed(0)
            a = torch.randn(5, 32, generator=g).to(device, dtype)
            b = torch.randn(3, 16, 32, generator=g).to(device, dtype)  # [G, N, K]
            offs = torch.tensor([2, 2, 4], dtype=torch.int32, device=device)
            y = fn(a, b.transpose(1, 2), offs=offs)
            ref = torch.cat([a[:2] @ b[0].T, a[2:4] @ b[2].T])
            ok = bool(torch.allclose(y[:4].float(), ref.float(), rtol=2e-2, atol=2e-2))
        except Exception as e:  # noqa: BLE001 - any failure means: use the gather path
            log.info("hot experts: grouped_mm unusable on %s/%s (%s: %s); using the gather path", device, dtype,
                     type(e).__name__, e)
    _grouped_ok_cache[key] = ok
    return ok


class Activation(NamedTuple):
    """The experts' gated activation: [S, 2I] (gate, up) -> [S, I] in float32. ``kind``: "silu" (silu(g) * u),
    "gptoss" (clamped: g * sigmoid(alpha * g) * (u + 1)) or "swiglu_limit" (clamped: silu(g) * u)."""

    kind: str
    I: int
    alpha: float = 1.702
    limit: float = 7.0

    @classmethod
    def of(cls, experts) -> Activation:
        """The activation of a native.Experts."""
        return cls(experts.activation, experts.intermediate, experts.alpha, experts.limit)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        g, u = h[:, :self.I].float(), h[:, self.I:].float()
        if self.kind == "silu":
            return torch.nn.functional.silu(g) * u
        g = g.clamp(max=self.limit)
        u = u.clamp(-self.limit, self.limit)
        if self.kind == "swiglu_limit":  # DeepSeek-V4
            return torch.nn.functional.silu(g) * u
        return g * torch.sigmoid(self.alpha * g) * (u + 1)


def grouped_ffn(xs: torch.Tensor, offs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Activation,
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                group: torch.Tensor | None = None) -> torch.Tensor:
    """y [S, H] (weights' dtype, or float32 with biases) of rows xs [S, H] sorted by expert through G experts
    gate_up [G, 2I, H], down [G, H, I]: expert g takes rows offs[g-1]..offs[g] (offs int32 [G] end offsets; rows
    past offs[-1] come out unwritten). Biases ([G, 2I], [G, H]) need ``group`` [S], each row's expert. Two grouped
    GEMMs: only experts that have rows are read."""
    fn = _grouped_fn()
    h = fn(xs, gate_up.transpose(1, 2), offs=offs)  # [S, 2I]
    if gate_up_bias is not None:
        h = h + gate_up_bias[group]
    a = act(h).to(xs.dtype)  # [S, I]
    y = fn(a, down.transpose(1, 2), offs=offs)  # [S, H]
    if down_bias is not None:
        y = y + down_bias[group]
    return y


def looped_ffn(xs: torch.Tensor, ends, gate_up: torch.Tensor, down: torch.Tensor, act: Activation,
               gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """grouped_ffn one expert at a time (float32 [S, H]; ``ends``: end rows on the host), for devices or shapes
    without a usable grouped GEMM (a fallback: a Python loop over the experts)."""
    y = torch.empty(xs.shape[0], down.shape[1], dtype=torch.float32, device=xs.device)
    lo = 0
    for g, hi in enumerate(int(e) for e in ends):
        if hi > lo:
            h = (xs[lo:hi] @ gate_up[g].T).float()
            if gate_up_bias is not None:
                h = h + gate_up_bias[g]
            out = (act(h).to(xs.dtype) @ down[g].T).float()
            y[lo:hi] = out if down_bias is None else out + down_bias[g]
        lo = hi
    return y


class HotExperts:
    """The bank of one HybridMoE (``block``) with ``capacity`` slots on ``device`` in ``dtype``; empty at first.

    ``biases``: (gate_up_bias [E, 2I] gate then up, down_bias [E, H]) for gpt-oss blocks (``block.expert_biases``).
    ``dynamic``: re-placement is on (HybridMoE then mirrors ``resident`` into its skip mask every step)."""

    def __init__(self, block, capacity: int, device=None, dtype: torch.dtype = torch.bfloat16,
                 dynamic: bool = False):
        spec = block.spec
        self.experts = block.native_experts  # native.Experts: source of the weights (kept: CPU copies stay)
        self.E, self.H, self.I = spec.num_experts, spec.hidden, spec.intermediate
        self.C = int(capacity)
        if not 1 <= self.C <= self.E:
            raise ValueError(f"hot experts: capacity {self.C} must be in 1..{self.E}")
        self.device = torch.device(device if device is not None else block.device)
        self.dtype = dtype
        self.dynamic = bool(dynamic)
        self.act = Activation.of(self.experts)
        self.host_biases = getattr(block, "expert_biases", None) if self.experts.bias else None
        if self.experts.bias and self.host_biases is None:
            raise ValueError("hot experts: this block's experts have biases (gpt-oss) but the HybridMoE holds no "
                             "expert_biases; build it with the moe operator (inject or from_pretrained), which keeps "
                             "them; without them it cannot have GPU-resident experts")
        dev, C, E, H, I = self.device, self.C, self.E, self.H, self.I
        self.gate_up = torch.zeros((C, 2 * I, H), dtype=dtype, device=dev)  # [C, 2I, H]
        self.down = torch.zeros((C, H, I), dtype=dtype, device=dev)  # [C, H, I]
        self.gate_up_bias = self.down_bias = None
        if self.host_biases is not None:
            self.gate_up_bias = torch.zeros((C, 2 * I), dtype=dtype, device=dev)  # [C, 2I]
            self.down_bias = torch.zeros((C, H), dtype=dtype, device=dev)  # [C, H]
        self.slot_of = torch.full((E,), -1, dtype=torch.int64, device=dev)  # [E]
        self.resident = torch.zeros(E, dtype=torch.uint8, device=dev)  # [E]
        self.hits = torch.zeros((), dtype=torch.int64, device=dev)
        self.slot_expert: list[int] = [-1] * C  # host view of the bank: expert in each slot (-1 empty)
        self._filled = 0  # slots of slot_expert that hold an expert (admit / retire keep it)
        self.grouped = grouped_mm_usable(dev, dtype)
        self._bounds = torch.arange(1, C + 1, dtype=torch.int64, device=dev)  # [C] searchsorted bounds
        self.packed = None  # upload.PackedRegion: source of re-placement moves (page-locked on CUDA); close() frees
        if self.dynamic and self.experts.quant in GPU_QUANTS:
            self.packed = PackedRegion(self.experts, pin=dev.type == "cuda")

    def close(self) -> None:
        """Unpin the packed native copy (no move may be in flight: Rebalancer.close first). The bank stays usable."""
        if self.packed is not None:
            self.packed.close()

    # ---- sizes -------------------------------------------------------------------------------------------------
    @staticmethod
    def expert_nbytes(spec, dtype: torch.dtype) -> int:
        """Bank bytes of one resident expert of a block with BlockSpec ``spec`` (weights + biases) in ``dtype``."""
        elem = torch.empty(0, dtype=dtype).element_size()
        n = 3 * spec.hidden * spec.intermediate
        if spec.has_bias:
            n += 2 * spec.intermediate + spec.hidden
        return n * elem

    @staticmethod
    def table_nbytes(num_experts: int) -> int:
        """Bytes of one bank's tables (slot_of, resident, hits, searchsorted bounds: at most E of them)."""
        return num_experts * (8 + 1 + 8) + 8

    @property
    def nbytes(self) -> int:
        ts = [self.gate_up, self.down, self.gate_up_bias, self.down_bias, self.slot_of, self.resident, self.hits,
              self._bounds]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def residents(self) -> list[int]:
        return sorted(e for e in self.slot_expert if e >= 0)

    def holds_all(self) -> bool:
        """Every expert of the block is resident and stays so (no re-placement): the CPU has nothing to compute."""
        return not self.dynamic and self.C == self.E and self._filled == self.C

    # ---- weights -----------------------------------------------------------------------------------------------
    def host_weights(self, expert: int, pin: bool = False) -> dict[str, torch.Tensor]:
        """One expert's bank rows as float32 host tensors written directly by native (no torch CPU kernels: this
        runs in a worker thread next to the native expert threads); pinned if asked (async copies)."""
        I, H = self.I, self.H
        out = {"gate_up": torch.empty((2 * I, H), dtype=torch.float32, pin_memory=pin),  # [2I, H]
               "down": torch.empty((H, I), dtype=torch.float32, pin_memory=pin)}  # [H, I]
        for which, dst in (("gate", out["gate_up"][:I]), ("up", out["gate_up"][I:]), ("down", out["down"])):
            self.experts.get(int(expert), which, out=dst)
        if self.host_biases is not None:  # tiny rows
            out["gate_up_bias"], out["down_bias"] = self.host_biases[0][expert], self.host_biases[1][expert]
        return out

    def write_slot(self, slot: int, weights: dict[str, torch.Tensor], non_blocking: bool = False) -> None:
        """Copy ``host_weights`` output into bank slot ``slot`` on the current stream (float32 over PCIe, converted
        to the bank dtype on the device)."""
        for name, t in weights.items():
            dst = getattr(self, name)[slot]
            if dst.device.type == "cpu":
                dst.copy_(t)
                continue
            staging = torch.empty(t.shape, dtype=t.dtype, device=dst.device)
            staging.copy_(t, non_blocking=non_blocking)
            dst.copy_(staging)

    def admit(self, slot: int, expert: int) -> None:
        """Tables: ``expert`` is served from ``slot`` from the next operation on the current stream on."""
        self.slot_of[expert:expert + 1].fill_(slot)
        self.resident[expert:expert + 1].fill_(1)
        self._filled += self.slot_expert[slot] < 0
        self.slot_expert[slot] = expert

    def retire(self, slot: int) -> int:
        """Tables: the expert in ``slot`` goes back to the CPU (from the next operation on this stream); returns it."""
        expert = self.slot_expert[slot]
        if expert >= 0:
            self.slot_of[expert:expert + 1].fill_(-1)
            self.resident[expert:expert + 1].fill_(0)
            self._filled -= 1
        self.slot_expert[slot] = -1
        return expert

    def assign(self, experts: Sequence[int]) -> None:
        """Load ``experts`` (at most C) into slots 0.. and make them resident; synchronous (outside graph replays)."""
        experts = list(experts)
        if len(experts) > self.C or len(set(experts)) != len(experts):
            raise ValueError(f"hot experts: {len(experts)} experts (distinct?) for {self.C} slots")
        for s in range(self.C):
            self.retire(s)
        for s, e in enumerate(experts):
            self.write_slot(s, self.host_weights(e))
            self.admit(s, e)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- compute -----------------------------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over resident experts of weights * expert(x): [T, H] float32 (zero rows where none is resident)."""
        T, k = ids.shape
        flat = ids.reshape(-1)  # [S]
        slot = self.slot_of[flat]  # [S], -1: not resident
        valid = slot >= 0
        self.hits.add_(valid.sum())
        if self.grouped:
            rows = self._grouped(x, slot, valid, weights.reshape(-1), k)
        else:
            rows = self._gathered(x, slot, valid, weights.reshape(-1), k)
        return rows.view(T, k, self.H).sum(1)  # [T, H] f32

    def _grouped(self, x, slot, valid, w, k) -> torch.Tensor:
        """[S, H] f32 in pair order: weighted expert outputs of resident pairs, 0 elsewhere."""
        key = torch.where(valid, slot, self.C)  # [S]: C sorts last
        key_s, perm = torch.sort(key, stable=True)
        offs = torch.searchsorted(key_s, self._bounds).to(torch.int32)  # [C] end of each slot's rows
        xs = x.to(self.dtype)[perm // k]  # [S, H]
        y = grouped_ffn(xs, offs, self.gate_up, self.down, self.act, self.gate_up_bias, self.down_bias,
                        key_s.clamp(max=self.C - 1))
        ok = (key_s < self.C).unsqueeze(1)  # rows past the last offset were never written
        ys = torch.where(ok, y.float() * w[perm].float().unsqueeze(1), 0.0)  # [S, H] sorted order
        out = torch.empty_like(ys)
        out[perm] = ys  # back to pair order (a permutation: deterministic)
        return out

    def _gathered(self, x, slot, valid, w, k) -> torch.Tensor:
        S = slot.shape[0]
        idx = slot.clamp(min=0)
        T, H = x.shape
        xr = x.to(self.dtype).unsqueeze(1).expand(T, k, H).reshape(T * k, H)  # [S, H] (no sync, unlike
        # repeat_interleave)
        parts = []
        for lo in range(0, S, _GATHER_CHUNK):
            hi = min(S, lo + _GATHER_CHUNK)
            i = idx[lo:hi]
            h = torch.bmm(self.gate_up[i], xr[lo:hi, :, None]).squeeze(2)  # [s, 2I]
            if self.gate_up_bias is not None:
                h = h + self.gate_up_bias[i]
            a = self.act(h).to(self.dtype)
            y = torch.bmm(self.down[i], a[:, :, None]).squeeze(2)  # [s, H]
            if self.down_bias is not None:
                y = y + self.down_bias[i]
            parts.append(y.float())
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        return torch.where(valid.unsqueeze(1), y * w.float().unsqueeze(1), 0.0)
