"""The device side of streamed prefill: the streamed experts' copies, dequantization and grouped matmuls, and the
memory they take. ``PrefillStreamer`` decides which experts go where; a ``StreamedExperts`` it holds does the work
on the device and owns what that needs (the page-locked regions, the ring, the scratch).

    setup / close     page-lock the packed experts, allocate the ring and the scratch, measure the H2D bandwidth;
                      free them
    take / stream     a layer's experts through the ring: fetch (the copy fetched ahead when it holds them), start
                      the next copy (``_ahead``), dequantize into the bf16 scratch, one grouped GEMM per projection
                      over the (token, slot) pairs sorted by expert, the routing weights applied, summed per token
    _plan / chunk_tokens   how many experts a ring slot holds and how many tokens a prefill chunk takes, from the
                      free GPU memory

Legend: T tokens, k experts per token, E experts, H hidden, I intermediate, B packed expert bytes, n experts of a
part, cap experts per ring slot.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np
import torch

from ktinject.gpu_experts.hot.bank import Activation, grouped_ffn, grouped_mm_usable, looped_ffn
from ktinject.gpu_experts.hot.upload import PackedRegion, bias_views, expert_layout, unpack_experts
from ktinject.gpu_experts.prefill.ring import Ring, timed

log = logging.getLogger(__name__)

MIN_CHUNK, MAX_CHUNK = 512, 16384  # prefill chunk bounds (tokens)


def resident(block) -> np.ndarray:
    """bool [E]: experts of ``block`` in its hot bank (as of the work queued so far)."""
    out = np.zeros(block.num_experts, dtype=bool)
    if block.hot is not None:
        out[[e for e in block.hot.slot_expert if e >= 0]] = True
    return out


class StreamedExperts:
    """The streamed experts of ``blocks`` (a model's HybridMoE blocks in model order) on ``device``: ring and scratch
    take at most ``memory_fraction`` of the free GPU memory, a slot at most ``slot_experts`` experts (None: what the
    memory allows, at most a layer). ``next_experts(j)``: the experts of layer j to copy ahead once the layer before
    has queued its last part (the streamer's choice: all non-resident ones, or ahead mode's set).

    After ``setup``: ``regions`` / ``layouts`` (per layer), ``pinned``, ``cap`` (experts a slot), ``ring``, the
    scratch (``gate_up``, ``down``, ``work``, ``bias``), ``grouped`` (grouped GEMMs usable), ``h2d`` (bytes/s)."""

    def __init__(self, blocks, device: torch.device, memory_fraction: float, slot_experts: int | None,
                 next_experts: Callable[[int], list[int]]):
        self.blocks, self.device = blocks, device
        self.cuda = device.type == "cuda"
        self.memory_fraction = memory_fraction
        self.slot_experts = slot_experts
        self.next_experts = next_experts
        self.ready = False
        self.regions = self.layouts = self.pinned = self.cap = self.grouped = None
        self.ring = self.gate_up = self.down = self.work = self.bias = None
        self.h2d = float("inf")
        self._pos_cache: dict[int, tuple] = {}

    # ---- set-up and memory ---------------------------------------------------------------------------------------
    def setup(self, mode: str) -> None:
        """The one-time set-up (idempotent): page-lock the packed experts, allocate the ring and the scratch (what
        ``memory_fraction`` allows), measure the H2D bandwidth. ``mode``: the streamer's, for the log."""
        if self.ready:
            return
        t0 = time.perf_counter()
        self.regions = [PackedRegion(b.native_experts, pin=self.cuda) for b in self.blocks]
        self.pinned = all(r.pinned for r in self.regions) if self.cuda else True
        if not self.pinned:
            log.warning("prefill: the packed experts could not all be page-locked; copies are synchronous%s",
                        " (auto: prefill stays on the CPU)" if mode == "auto" else "")
        self.layouts = [r.layout for r in self.regions]
        cap, B, work, bias = self._plan()
        H = self.blocks[0].hidden_size
        I = max(b.intermediate_size for b in self.blocks)
        E = max(b.num_experts for b in self.blocks)
        self.cap = cap
        dev = self.device
        self.ring = Ring(dev, cap * B)
        self.gate_up = torch.empty(cap * 2 * I * H, dtype=torch.bfloat16, device=dev)
        self.down = torch.empty(cap * H * I, dtype=torch.bfloat16, device=dev)
        self.work = torch.empty(max(1, cap * work), dtype=torch.uint8, device=dev)
        self.bias = (torch.empty(cap * 2 * I, device=dev), torch.empty(cap * H, device=dev)) if bias else None
        self.grouped = grouped_mm_usable(dev, torch.bfloat16) and H % 8 == 0 and I % 8 == 0
        if self.cuda and self.pinned:
            self.h2d = self.ring.measure_h2d(self.regions[0].tensor)
        self.ready = True
        log.info("prefill: %s streaming, %d of %d experts a slot (%.2f GiB ring + %.2f GiB scratch), H2D %.1f GB/s, "
                 "set up in %.1f s", mode, cap, E, self.ring.nbytes / 2**30, self.nbytes_scratch / 2**30,
                 self.h2d / 1e9, time.perf_counter() - t0)

    def close(self) -> None:
        """Unpin the packed experts and free the device buffers (nothing may be in flight)."""
        if self.ready:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            for r in self.regions:
                r.close()
            self.ring = self.gate_up = self.down = self.work = self.bias = None
            self.ready = False

    def _plan(self) -> tuple[int, int, int, bool]:
        """(experts a slot, B, work bytes per expert, biases?): a whole layer when ring + scratch fit in
        ``memory_fraction`` of the free GPU memory, else as many experts as do (at most ``slot_experts``)."""
        layouts = self.layouts or [expert_layout(b.native_experts) for b in self.blocks]
        B = max(lay.expert_bytes for lay in layouts)
        H = self.blocks[0].hidden_size
        I = max(b.intermediate_size for b in self.blocks)
        work = max(_work_bytes(lay) for lay in layouts)
        bias = any(b.native_experts.bias for b in self.blocks)
        per_expert = 2 * B + 2 * 3 * H * I + work + (4 * (2 * I + H) if bias else 0)
        cap = max(b.num_experts for b in self.blocks)
        if self.cuda:
            cap = max(1, min(cap, int(self.memory_fraction * _free_gpu_bytes(self.device) // per_expert)))
        if self.slot_experts is not None:
            cap = min(cap, self.slot_experts)
        return cap, B, work, bias

    @property
    def nbytes_scratch(self) -> int:
        ts = [self.gate_up, self.down, self.work, *(self.bias or ())]
        return sum(t.numel() * t.element_size() for t in ts)

    def chunk_tokens(self) -> int:
        """Prompt tokens per prefill forward: what the free GPU memory holds after the ring and scratch, at about
        k * (8H + 16I) + 64H bytes a token (the streamed experts' sorted rows, intermediates and outputs in float32,
        the dense part), half of it as a margin; between MIN_CHUNK and MAX_CHUNK. MAX_CHUNK off CUDA."""
        if not self.cuda:
            return MAX_CHUNK
        b = self.blocks[0]
        k = b.top_k if isinstance(getattr(b, "top_k", None), int) else 8
        per_token = k * (8 * b.hidden_size + 16 * b.intermediate_size) + 64 * b.hidden_size
        free = _free_gpu_bytes(self.device)
        if not self.ready:  # what the set-up will take (without doing it: a short prompt never needs it)
            cap, B, work, bias = self._plan()
            free -= cap * (2 * B + 2 * 3 * b.hidden_size * b.intermediate_size + work)
        tokens = int(0.5 * max(free, 0) // per_token) // 256 * 256
        return max(MIN_CHUNK, min(MAX_CHUNK, tokens))

    # ---- the streamed experts ------------------------------------------------------------------------------------
    def take(self, i: int, experts: list[int]):
        """The ring item of layer i's first part of ``experts`` (the copy fetched ahead when it holds them). The
        next copy is started by ``stream`` after the CPU's task is submitted: issuing a scattered set (a copy per
        run of consecutive experts) takes enough host time to hold the CPU's task back when done before it."""
        return self.ring.fetch((i, 0), self.regions[i].tensor, self.layouts[i].expert_bytes, experts[:self.cap])

    def stream(self, i, block, x, ids, weights, experts, counts, prefetch: bool, first=None) -> torch.Tensor:
        """f32 [T, H]: sum over each token's slots routed to ``experts`` (ascending ids, none resident) of weight *
        expert(x); ``counts`` [E] (host) rows per expert when known; ``prefetch``: start the next layer's copy;
        ``first``: the first part's item, already taken (``take``)."""
        lay, region = self.layouts[i], self.regions[i].tensor
        B, n_all, cap = lay.expert_bytes, len(experts), self.cap
        T, k = ids.shape
        H, I, E = block.hidden_size, block.intermediate_size, block.num_experts
        act = Activation.of(block.native_experts)
        key = self._positions(i, E, experts)[ids.reshape(-1)]  # [S]: position in experts, n_all: not streamed
        key_s, perm = torch.sort(key, stable=True)
        ends = torch.searchsorted(key_s, torch.arange(1, n_all + 1, device=x.device))  # [n_all] end row of each
        parts = [experts[j:j + cap] for j in range(0, n_all, cap)]
        host_ends = ends.cpu() if not self.grouped or (counts is None and len(parts) > 1) else None  # a sync
        if counts is not None:
            part_ends = np.cumsum([int(counts[p].sum()) for p in parts]).tolist()
        elif host_ends is not None:
            part_ends = [int(host_ends[min(j + cap, n_all) - 1]) for j in range(0, n_all, cap)]
        else:
            part_ends = [None]  # rows unknown on the host: all S pairs, non-streamed ones masked
        rows = part_ends[-1] if part_ends[-1] is not None else key_s.numel()
        masked = part_ends[-1] is None and n_all < E
        perm, key_s = perm[:rows], key_s[:rows]
        xs = x.to(torch.bfloat16)[perm // k]  # [rows, H]
        ws = weights.reshape(-1)[perm].float().unsqueeze(1)  # [rows, 1]
        out = torch.zeros(T * k, H, dtype=torch.float32, device=x.device)  # pair order
        lo = 0
        for p, part in enumerate(parts):
            n = len(part)
            item = first if p == 0 and first is not None else self.ring.fetch((i, p), region, B, part)
            ahead = self._ahead(i, p, parts, prefetch)
            if ahead is not None:
                self.ring.prefetch(*ahead)
            slot = self.ring.acquire(item).view(n, B)
            trace = self.ring.trace if self.cuda else None
            span, deq = timed(trace, ("compute", (i, p))), timed(trace, ("dequant", (i, p)))  # from the copy's end
            gate_up = self.gate_up[:n * 2 * I * H].view(n, 2 * I, H)
            down = self.down[:n * H * I].view(n, H, I)
            unpack_experts(slot, lay, gate_up, down, self.work)
            biases = self._biases(slot, lay, n, I, H) if block.native_experts.bias else (None, None)
            self.ring.release(item)
            deq.close()
            hi = rows if part_ends[p] is None else part_ends[p]
            group = key_s[lo:hi] - p * cap  # [rows of the part]: expert within the part
            if self.grouped:
                offs = (ends[p * cap:p * cap + n] - lo).to(torch.int32)
                y = grouped_ffn(xs[lo:hi], offs, gate_up, down, act, *biases, group.clamp(0, n - 1))
            else:
                y = looped_ffn(xs[lo:hi], host_ends[p * cap:p * cap + n] - lo, gate_up, down, act, *biases)
            y = y.float().mul_(ws[lo:hi])
            if masked:
                y = torch.where((group < n).unsqueeze(1), y, 0.0)
            out[perm[lo:hi]] = y
            span.close()
            lo = hi
        return out.view(T, k, H).sum(1)

    def _ahead(self, i: int, p: int, parts, prefetch: bool):
        """(key, region, B, experts) of the item after (layer i, part p): the layer's next part, or with
        ``prefetch`` the next layer's first (``next_experts``: all its non-resident ones, or ahead mode's set).
        After the last layer: the first layer's, for the next forward (the next chunk of a long prompt, or the next
        prompt): the copy engine is idle then, and a forward that wants other experts drops it."""
        if p + 1 < len(parts):
            return (i, p + 1), self.regions[i].tensor, self.layouts[i].expert_bytes, parts[p + 1]
        if not prefetch:
            return None
        j = (i + 1) % len(self.blocks)
        experts = self.next_experts(j)
        if not experts:
            return None
        return (j, 0), self.regions[j].tensor, self.layouts[j].expert_bytes, experts

    def _biases(self, slot, lay, n, I, H):
        """gpt-oss biases of the n experts in ``slot`` copied to scratch (f32 [n, 2I] gate then up, [n, H]): the
        slot is released before the matmuls that add them."""
        gate, up, down = bias_views(slot, lay)
        gu, d = self.bias[0][:n * 2 * I].view(n, 2 * I), self.bias[1][:n * H].view(n, H)
        gu[:, :I].copy_(gate)
        gu[:, I:].copy_(up)
        d.copy_(down)
        return gu, d

    # ---- small pieces kept across forwards ----------------------------------------------------------------------
    def _positions(self, i: int, E: int, experts: list[int]) -> torch.Tensor:
        """int64 [E] on the device: each expert's position in ``experts``, len(experts) for the others. Kept per
        layer while its experts stay the same (gpu mode: every forward); else copied from pinned memory (a copy
        from pageable memory would first wait for the stream)."""
        key = tuple(experts)
        cache = self._pos_cache
        hit = cache.get(i)
        if hit is not None and hit[0] == key:
            return hit[1]
        host = torch.full((E,), len(experts), dtype=torch.int64, pin_memory=self.cuda)
        host[experts] = torch.arange(len(experts))
        pos = host.to(self.device, non_blocking=True)  # the caching host allocator keeps `host` until it is read
        cache[i] = (key, pos)
        return pos


def _free_gpu_bytes(device) -> int:
    """Free memory of the device plus what torch's caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _work_bytes(lay) -> int:
    """Work bytes per expert that unpacking needs (0: bf16 and int8 unpadded go straight into place)."""
    padded = any(m.N != m.Np or m.K != m.Kp for m in lay.mats)
    return 0 if lay.quant in ("bf16", "int8") and not padded else lay.work_bytes
