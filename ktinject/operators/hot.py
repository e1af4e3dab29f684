"""GPU-resident ("hot") routed experts of one HybridMoE: a weight bank on the block's device and a graph-capturable
compute for the (token, slot) pairs routed to it. ``ktinject.placement`` decides which experts live here.

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
slots with a mask reads every resident expert every step (16 GiB of bank -> ~5 ms per token at 3.3 TB/s) and
launches 3C GEMMs per layer; a gather of each pair's weights (bank[slot] then bmm) copies k experts per token and
reads them twice. That gather is the fallback where grouped_mm is unusable (non-bf16 on CUDA, GPUs before Hopper,
old CPU builds): fine for tests and small models, chunked for long prompts.

Weights come from the native (CPU) copy, which stays as it is (the skip mask leaves resident experts out there):
bf16 experts land in the bank bit-exact; int8 experts are dequantized into it (the GPU then runs the dequantized
weights with bf16 activations instead of W8A8).

Runtime re-placement (``Rebalancer``) swaps bank contents and the two tables in place between decode steps: see its
docstring. Legend: T tokens, k experts per token, S = T*k pairs, E experts, C bank slots, H hidden, I intermediate.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

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
        self.activation = self.experts.activation  # "silu" or "gptoss"
        self.alpha, self.limit = self.experts.alpha, self.experts.limit
        self.host_biases = getattr(block, "expert_biases", None) if self.experts.bias else None
        if self.experts.bias and self.host_biases is None:
            raise ValueError("hot experts: this block's experts have biases (gpt-oss) but the HybridMoE kept none "
                             "(built from a packed cache?); it cannot have GPU-resident experts")
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
        self.grouped = grouped_mm_usable(dev, dtype)
        self._bounds = torch.arange(1, C + 1, dtype=torch.int64, device=dev)  # [C] searchsorted bounds

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

    # ---- weights -----------------------------------------------------------------------------------------------
    def host_weights(self, expert: int, pin: bool = False) -> dict[str, torch.Tensor]:
        """One expert's bank rows as float32 host tensors written directly by native (no torch CPU kernels: this
        runs in a worker thread next to the native expert threads); pinned if asked (async copies)."""
        from ktinject._nativelib import MATRICES, _check, _native, _ptr

        _, lib = _native()
        I, H = self.I, self.H
        out = {"gate_up": torch.empty((2 * I, H), dtype=torch.float32, pin_memory=pin),  # [2I, H]
               "down": torch.empty((H, I), dtype=torch.float32, pin_memory=pin)}  # [H, I]
        for which, dst in (("gate", out["gate_up"][:I]), ("up", out["gate_up"][I:]), ("down", out["down"])):
            _check(lib.ktk_experts_get(self.experts._p, int(expert), MATRICES[which], _ptr(dst, "float *")))
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
        self.slot_expert[slot] = expert

    def retire(self, slot: int) -> int:
        """Tables: the expert in ``slot`` goes back to the CPU (from the next operation on this stream); returns it."""
        expert = self.slot_expert[slot]
        if expert >= 0:
            self.slot_of[expert:expert + 1].fill_(-1)
            self.resident[expert:expert + 1].fill_(0)
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

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        """[S, 2I] (gate, up) -> [S, I] in float32."""
        g, u = h[:, :self.I].float(), h[:, self.I:].float()
        if self.activation == "silu":
            return torch.nn.functional.silu(g) * u
        g = g.clamp(max=self.limit)
        u = u.clamp(-self.limit, self.limit)
        return g * torch.sigmoid(self.alpha * g) * (u + 1)

    def _grouped(self, x, slot, valid, w, k) -> torch.Tensor:
        """[S, H] f32 in pair order: weighted expert outputs of resident pairs, 0 elsewhere."""
        key = torch.where(valid, slot, self.C)  # [S]: C sorts last
        key_s, perm = torch.sort(key, stable=True)
        offs = torch.searchsorted(key_s, self._bounds).to(torch.int32)  # [C] end of each slot's rows
        xs = x.to(self.dtype)[perm // k]  # [S, H]
        fn = _grouped_fn()
        h = fn(xs, self.gate_up.transpose(1, 2), offs=offs)  # [S, 2I]
        idx = key_s.clamp(max=self.C - 1)
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[idx]
        a = self._act(h).to(self.dtype)  # [S, I]
        y = fn(a, self.down.transpose(1, 2), offs=offs)  # [S, H]
        if self.down_bias is not None:
            y = y + self.down_bias[idx]
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
            a = self._act(h).to(self.dtype)
            y = torch.bmm(self.down[i], a[:, :, None]).squeeze(2)  # [s, H]
            if self.down_bias is not None:
                y = y + self.down_bias[i]
            parts.append(y.float())
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        return torch.where(valid.unsqueeze(1), y * w.float().unsqueeze(1), 0.0)


def gpt_oss_biases(experts_module) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up_bias [E, 2I] as gate then up, down_bias [E, H]) in float32 on the CPU, from HF gpt-oss experts
    (gate_up_proj_bias interleaved: even = gate, odd = up). Kept by HybridMoE: tiny next to the weights."""
    b = experts_module.gate_up_proj_bias.detach().float().cpu()
    return torch.cat([b[:, 0::2], b[:, 1::2]], dim=1), experts_module.down_proj_bias.detach().float().cpu().clone()


class Rebalancer:
    """Opt-in runtime re-placement: every ``every`` generated tokens, re-rank each layer's experts by recent routed
    counts (exponentially decayed by ``decay`` per period) and move those whose rank changed into the bank, keeping
    each layer's slot count. Pass it to generate as a stopping criterion (it never stops anything), or call
    ``step()`` once per token yourself.

    Nothing stalls decode and no graph is re-captured (bank and tables keep their addresses):
      1. counts are copied to pinned host memory asynchronously; the next period reads them;
      2. a worker thread unpacks the incoming experts from the native (CPU) copy into pinned buffers;
      3. when ready, between two steps: on the compute stream the slot's old expert is retired (slot_of = -1,
         resident = 0: the CPU computes it from the next step on), then a side stream waits for that and copies
         the new weights into the free slot;
      4. at a later token, once the copy has finished (event query, no wait): on the compute stream the new expert
         is admitted (slot_of, resident).
    The native skip mask is the device ``resident`` table copied to the host inside each step, so a step never sees
    one side's update without the other's. On the CPU (gpu="cpu") the same moves happen synchronously.
    ``max_moves``: experts in flight at most (all layers); ``margin``: an expert replaces a resident one only when
    its score is larger by this fraction (no churn on noise); ``workers``: unpacking threads (they share the CPU
    with the native expert threads)."""

    def __init__(self, blocks: Sequence, every: int = 64, decay: float = 0.5, max_moves: int = 64,
                 margin: float = 0.25, workers: int = 2):
        self.blocks = [b for b in blocks if b.hot is not None]
        if not self.blocks:
            raise ValueError("Rebalancer: no block has hot experts (place some first)")
        if every < 1:
            raise ValueError(f"Rebalancer: every must be >= 1, got {every}")
        self.every, self.decay, self.max_moves, self.margin = int(every), float(decay), int(max_moves), float(margin)
        if not all(b.hot.dynamic for b in self.blocks):
            raise ValueError("Rebalancer: the banks were placed without re-placement (their steps, maybe already "
                             "captured, do not mirror the residency table): use placement.place(..., 'dynamic')")
        self.cuda = self.blocks[0].hot.device.type == "cuda"
        E = self.blocks[0].num_experts
        self.scores = torch.zeros(len(self.blocks), E, dtype=torch.float64)
        self._last = torch.stack([b.counts.detach().to("cpu") for b in self.blocks])  # [L, E]
        self._snap = self._snap_event = None
        self._worker = ThreadPoolExecutor(max_workers=max(1, int(workers)), thread_name_prefix="ktinject-rebalance")
        self._side = torch.cuda.Stream(self.blocks[0].hot.device) if self.cuda else None
        # in flight: (layer, slot, new expert, Future of host weights | None, copy event | None, host weights)
        self._moves: list[list] = []
        self.tokens = self.periods = self.moved = 0

    # HF StoppingCriteria protocol: called once per generated token with the sequences so far
    def __call__(self, input_ids, scores=None, **kwargs) -> torch.Tensor:
        self.step()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def step(self) -> None:
        """One generated token: advance moves in flight; every ``every`` tokens, plan new ones."""
        self.tokens += 1
        self._advance()
        if self.tokens % self.every == 0:
            self.periods += 1
            self._plan()
            self._advance()

    def pending(self) -> int:
        return len(self._moves)

    def drain(self) -> None:
        """Finish every move in flight (waits; for tests and before measuring)."""
        while self._moves:
            for m in self._moves:
                if m[3] is not None:
                    m[3].result()
                if m[4] is not None:
                    m[4].synchronize()
            self._advance()

    def close(self) -> None:
        self.drain()
        self._worker.shutdown(wait=True)

    # ---- internals ---------------------------------------------------------------------------------------------
    def _counts(self) -> torch.Tensor | None:
        """[L, E] cumulative counts as of the previous period (CUDA: async snapshot), or None if not ready yet."""
        if not self.cuda:
            return torch.stack([b.counts.detach().clone() for b in self.blocks])
        ready = None
        if self._snap is not None and self._snap_event.query():
            ready = self._snap.clone()
        if self._snap is None or ready is not None:
            if self._snap is None:
                self._snap = torch.zeros(self.scores.shape, dtype=torch.int64, pin_memory=True)
                self._snap_event = torch.cuda.Event()
            for i, b in enumerate(self.blocks):
                self._snap[i].copy_(b.counts, non_blocking=True)
            self._snap_event.record()
        return ready

    def _plan(self) -> None:
        counts = self._counts()
        if counts is None:
            return
        delta = (counts - self._last).clamp_min(0).double()
        self._last = counts
        self.scores.mul_(self.decay).add_(delta)
        if len(self._moves) >= self.max_moves:  # the previous period's moves are still loading: do not pile up
            return
        busy = {(m[0], m[1]) for m in self._moves}
        busy_experts = {(m[0], m[2]) for m in self._moves}
        cands = []  # (gain, layer, slot, new expert)
        for li, b in enumerate(self.blocks):
            hot, sc = b.hot, self.scores[li].tolist()
            slots = [s for s in range(hot.C) if (li, s) not in busy]
            resident = set(hot.slot_expert)
            order = sorted(range(hot.E), key=lambda e: (-sc[e], e not in resident, e))
            want = [e for e in order[:hot.C] if e not in resident and (li, e) not in busy_experts]
            outs = sorted(slots, key=lambda s: (-1.0 if hot.slot_expert[s] < 0 else sc[hot.slot_expert[s]]))
            top = set(order[:hot.C])
            outs = [s for s in outs if hot.slot_expert[s] not in top]
            for e, s in zip(want, outs):
                old = hot.slot_expert[s]
                old_score = 0.0 if old < 0 else sc[old]
                if old < 0 or sc[e] > old_score * (1 + self.margin):
                    cands.append((sc[e] - old_score, li, s, e))
        cands.sort(key=lambda c: -c[0])
        for _, li, s, e in cands[:self.max_moves - len(self._moves)]:
            hot = self.blocks[li].hot
            if self.cuda:
                fut = self._worker.submit(hot.host_weights, e, True)
            else:  # CPU: synchronous, deterministic
                fut = Future()
                fut.set_result(hot.host_weights(e))
            self._moves.append([li, s, e, fut, None, None])

    def _advance(self) -> None:
        keep = []
        for m in self._moves:
            li, s, e, fut, ev, weights = m
            hot = self.blocks[li].hot
            if fut is not None:
                if not fut.done():
                    keep.append(m)
                    continue
                weights = fut.result()
                hot.retire(s)  # compute stream: from the next step the CPU serves the old expert
                if not self.cuda:
                    hot.write_slot(s, weights)
                    hot.admit(s, e)
                    self.moved += 1
                    continue
                retired = torch.cuda.Event()
                retired.record()
                with torch.cuda.stream(self._side):
                    self._side.wait_event(retired)
                    hot.write_slot(s, weights, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(self._side)
                m[3:] = [None, ev, weights]  # keep the pinned buffers alive until the copy is done
                keep.append(m)
            elif ev is not None and ev.query():
                hot.admit(s, e)  # compute stream, after the copy (already complete: no wait)
                self.moved += 1
            else:
                keep.append(m)
        self._moves = keep

