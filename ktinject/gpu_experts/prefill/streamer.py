"""Prefill with the routed experts streamed to the GPU over PCIe, alone or split with the CPU.

A ``PrefillStreamer`` serves every HybridMoE of one model (``block.prefill``; ``attach`` makes it). An eager forward
of T tokens offers each block's routed experts to it; what it does is decided once per forward (``policy``):

    cpu    declined: the block runs its native CPU path (few tokens; the decision costs no host sync)
    gpu    layer L: wait for its packed experts (copied while layer L-1 computed), start layer L+1's copy, then on
           the compute stream: dequantize into bf16 scratch (``upload.unpack_experts``), one grouped GEMM per
           projection over the pairs sorted by expert (``bank.grouped_ffn``), weights applied, summed per token
    split  per layer, once the routing is on the host (the sync the CPU path makes anyway): the experts with the
           most rows go to the GPU (copied, dequantized, computed as above) while the native kernels compute the
           rest (their skip mask: hot experts + the GPU's); each part's output is added on the device
    ahead  as split, but the GPU's n experts a layer are fixed before the routing (those with the most rows in
           earlier forwards, ``policy.ahead_experts``; n from ``policy.ahead_split``, then steered by what the layers
           show, ``feedback``), so their copy runs while the layer before computes (as in gpu mode); their compute is
           queued once the CPU's task is submitted, as in split

The streamer decides (per forward: the mode; per layer: which experts go to the GPU) and is composed of two parts
that do: ``experts`` (``device.StreamedExperts``: the ring, the copies, dequantization, grouped matmuls, the memory
they take) and ``split`` (``split.SplitLayers``: layers shared with the CPU, their tasks and gates).

Hot experts (GPU-resident, ``bank.HotExperts``) are computed by their bank as usual and never copied; experts with no
rows are not copied where the routing is known first. Packed bytes cross PCIe as stored (bf16, int8 + scales, int4 +
group scales) from the page-locked native mapping (``upload.PackedRegion``) into a ring of two slots (``ring.Ring``);
nothing is expanded on the host. A layer larger than a slot goes in parts.

Memory (CUDA): the ring (2 slots) + dequantized scratch + work, sized to hold a whole layer's experts when that fits
in ``memory_fraction`` of the free GPU memory, else the largest part that does; ``chunk_tokens`` sizes prefill chunks
from what is left (activations of a chunk: about k * (8H + 16I) + 64H bytes a token).

Accuracy: bf16 experts are computed from the stored bf16 weights, int8 / int4 from q * scale rounded once to bf16
(the int4 values the CPU's dequantizing path uses), activations in bf16 (the CPU's int8 path quantizes them per
token instead), float32 accumulation, the weighted sum over a token's k experts in float32.

Legend: T tokens, k experts per token, S = T*k pairs, E experts, H hidden, I intermediate, B packed expert bytes,
n experts streamed in a layer, cap experts per ring slot.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ktinject.gpu_experts.prefill import measure
from ktinject.gpu_experts.prefill import policy
from ktinject.gpu_experts.prefill.device import MAX_CHUNK, MIN_CHUNK, StreamedExperts, resident  # noqa: F401 (MAX_CHUNK, MIN_CHUNK: tests, generate)
from ktinject.gpu_experts.prefill.feedback import Feedback
from ktinject.gpu_experts.prefill.split import SplitLayers, total
from ktinject.operators.families import shared_output
from ktinject.operators.moe import HybridMoE

log = logging.getLogger(__name__)

#: auto leaves forwards of fewer tokens to the CPU without asking the cost model: decode steps (batches of rows) keep
#: the path their captured graphs take, and below this the GPU's share would not pay for its launches anyway
AUTO_MIN_TOKENS = 64
#: auto's trials time cpu mode against a shared mode only where the cost model puts cpu within this factor of it
CPU_TRIAL_RATIO = 1.5


def blocks_of(model) -> list[HybridMoE]:
    return [m for m in model.modules() if isinstance(m, HybridMoE)]


def attach(model, mode: str, **kwargs) -> PrefillStreamer | None:
    """Give ``model``'s HybridMoE blocks a PrefillStreamer for prefill ``mode`` ("auto" | "cpu" | "gpu"); None
    (and no hook) for "cpu", for a model without such blocks, and for "auto" off CUDA (there is no GPU to use)."""
    policy.check_mode(mode)
    blocks = blocks_of(model)
    old = streamer_of(model)
    wanted = not (mode == "cpu" or not blocks or (mode == "auto" and blocks[0].device.type != "cuda"))
    if old is not None and wanted and not kwargs and old.blocks == blocks:
        old.switch(mode)  # keeps what its set-up did (page-locked experts, ring, measured costs)
        return old
    if old is not None:
        old.close()
    return PrefillStreamer(blocks, mode, **kwargs) if wanted else None


def streamer_of(model) -> PrefillStreamer | None:
    return next((b.prefill for b in blocks_of(model) if isinstance(b.prefill, PrefillStreamer)), None)


class PrefillStreamer:
    """Streamed / split prefill for ``blocks`` (a model's HybridMoE blocks in model order), ``mode`` "auto" or "gpu"
    ("cpu": every forward declined; ``switch`` changes it).
    ``costs``: a ``policy.Costs`` used as is, or a dict of its fields replacing the measured ones.
    ``memory_fraction``: of the free GPU memory, what the ring and scratch may take; ``slot_experts``: at most this
    many experts a ring slot (layers in parts; default: what the memory allows, at most a layer).

    Its parts: ``experts`` (the device side, ``StreamedExperts``) and ``split`` (shared layers, ``SplitLayers``);
    it keeps the decisions: costs, modes, ahead mode's sets and the rows they are picked from, the feedback."""

    def __init__(self, blocks, mode: str = "auto", memory_fraction: float = 0.4, costs=None,
                 slot_experts: int | None = None):
        policy.check_mode(mode)
        if not blocks:
            raise ValueError("PrefillStreamer: needs at least one HybridMoE block")
        if slot_experts is not None and (isinstance(slot_experts, bool) or int(slot_experts) < 1):
            raise ValueError(f"PrefillStreamer: slot_experts must be a positive number of experts, "
                             f"got {slot_experts!r}")
        self.blocks, self.mode = list(blocks), mode
        self.device = torch.device(self.blocks[0].device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:  # "cuda" as the plan names it: the device it means now
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.costs_override = costs
        self.experts = StreamedExperts(self.blocks, self.device, float(memory_fraction),
                                       None if slot_experts is None else int(slot_experts), self._next_experts)
        self.split = SplitLayers(self, self.experts)
        self._index = {id(b): i for i, b in enumerate(self.blocks)}
        self._costs: dict[tuple, policy.Costs] = {}
        self._decisions: dict[tuple, str] = {}
        self._cpu_trials: dict[tuple, bool] = {}  # decision key -> whether auto's trials try cpu mode too
        self._forward: tuple[int, str] | None = None  # (T, mode) of the forward in progress
        self._last = -1
        self._n_ahead = 0  # ahead mode: GPU experts a layer in this forward (steered by ``observe``)
        self.feedback = Feedback(self.cuda, len(self.blocks))  # what split / ahead layers show (feedback.py)
        self._seen: dict[int, np.ndarray] = {}  # layer -> rows per expert in earlier split / ahead forwards (decayed)
        self._sets: dict[int, tuple[int, list[int]]] = {}  # layer -> (n, its GPU experts) until the layer uses them
        self.last: dict = {}  # the last forward: T, mode, experts on the GPU per layer
        for b in self.blocks:
            b.prefill = self

    # ---- set-up (first streamed forward) -----------------------------------------------------------------------
    def setup(self) -> None:
        """The one-time set-up (idempotent; ``StreamedExperts.setup``): page-lock the packed experts, allocate the
        ring and the scratch (what ``memory_fraction`` allows), measure the H2D bandwidth."""
        self.experts.setup(self.mode)

    def close(self) -> None:
        """Unhook the blocks, unpin the packed experts, free the device buffers (nothing may be in flight)."""
        for b in self.blocks:
            if b.prefill is self:
                b.prefill = None
        try:
            self.split.close_gates()  # gated layers' tasks, and a split layer's CPU task left running
            self.split.settle(closing=True)  # (an error of them is logged)
        finally:
            self.experts.close()

    def chunk_tokens(self) -> int:
        """Prompt tokens per prefill forward (``StreamedExperts.chunk_tokens``: from the free GPU memory)."""
        return self.experts.chunk_tokens()

    # ---- costs and decisions ------------------------------------------------------------------------------------
    def costs_for(self, block, T: int | None = None) -> policy.Costs:
        """The cost model of ``block``'s shape and quant, measured once (``measure``; off CUDA the GPU's
        numbers are defaults), corrected by what split and ahead forwards measured (the CPU's tasks beside the
        copies, ``layer_s`` of T-token forwards: ``feedback.Feedback.observe``); ``costs`` given to the streamer
        override."""
        if isinstance(self.costs_override, policy.Costs):
            return self.costs_override
        ex = block.native_experts
        key = self._costs_key(block)
        if key not in self._costs:
            self.setup()
            i = self._index[id(block)]
            per_expert, per_row = measure.cpu_costs(ex)
            gpu = policy.gpu_default_costs(ex.hidden, ex.intermediate, ex.quant)
            if self.cuda and self.experts.pinned:
                self.experts.ring.drop()
                gpu = measure.gpu_costs(self.experts, i, block)
            self._costs[key] = policy.Costs(h2d=self.experts.h2d, expert_bytes=self.experts.layouts[i].expert_bytes,
                                            cpu_expert_s=per_expert, cpu_row_s=per_row, **gpu)
            log.info("prefill: costs of %s: %s", key, self._costs[key])
        m = self.feedback.measured
        costs = self._costs[key].scaled(m.cpu_scale(key), m.layer_s(T))
        shared = m.h2d_shared()
        if shared is not None:
            costs = costs.with_(h2d_shared=shared)
        return costs.with_(**self.costs_override) if isinstance(self.costs_override, dict) else costs

    @staticmethod
    def _costs_key(block) -> tuple:
        ex = block.native_experts
        return ex.quant, ex.num_experts, ex.hidden, ex.intermediate, ex.group_size if ex.quant == "int4" else 0

    def prepare(self) -> float:
        """The one-time work of the first streamed prompt done now (the set-up; in auto mode the cost model's
        measurements too), so that no prompt waits for it: a server's first long prompt would hold every running
        stream for it (page-locking the packed experts, a few native forwards). Returns the seconds taken."""
        t0 = time.perf_counter()
        self.setup()
        if self.mode == "auto":
            for block in {self._costs_key(b): b for b in self.blocks}.values():
                self.costs_for(block)
        return time.perf_counter() - t0

    def switch(self, mode: str) -> None:
        """Another mode from the next forward on ("cpu": decline every forward), keeping the set-up and the
        measured costs."""
        self.mode = policy.check_mode(mode)
        self._decisions.clear()
        self._forward = None
        if self.experts.ready:
            self.experts.ring.drop()

    def _decide(self, block, T: int, k: int) -> str:
        if self.mode == "cpu":
            return "cpu"
        E = block.num_experts
        streamable = int(E - resident(block).sum())
        if self.mode == "gpu":
            return "gpu" if policy.prefetch_worthy(T, k, streamable) else "gpu-used"
        if T < AUTO_MIN_TOKENS or T * k < E // 2 or streamable == 0:  # nothing to gain: no set-up, no calibration
            return "cpu"
        key = (T, k, streamable, id(block.native_experts))
        if key not in self._decisions:
            self.setup()
            costs = self.costs_for(block, T)
            cap = self.experts.cap
            ahead_s = self.feedback.balance.estimate(T, streamable, costs.layer_s, cap)  # once ahead ran
            self._decisions[key] = "cpu" if not self.experts.pinned else policy.choose_mode(T, k, streamable, costs,
                                                                                          cap, ahead_s)
            est = policy.estimates(T, k, streamable, costs, cap, ahead_s)
            # cpu mode's trial forwards only where the model does not put it far behind: for long prompts a cpu
            # forward takes many times what the shared mode takes
            self._cpu_trials[key] = est["cpu"] <= CPU_TRIAL_RATIO * min(est["split"], est["ahead"])
        alternative = "gpu" if policy.prefetch_worthy(T, k, streamable) else "gpu-used"
        pure = (alternative, "cpu") if self._cpu_trials.get(key) else (alternative,)
        return self.feedback.trials.pick(T, self._decisions[key], *pure)  # a shared mode checked by the pure ones

    def _ahead_n(self, block, T: int, k: int) -> int:
        """Ahead mode: experts a layer for the GPU in a forward of T tokens (the cost model's, at most a slot)."""
        self.setup()
        streamable = int(block.num_experts - resident(block).sum())
        key = ("ahead", T, k, streamable, id(block.native_experts))
        if key not in self._decisions:
            self._decisions[key] = policy.ahead_split(T, k, streamable, self.costs_for(block, T),
                                                      self.experts.cap)[0]
        return self._decisions[key]

    def _set(self, j: int) -> list[int]:
        """Layer j's GPU experts in ahead mode (ascending ids, none resident): kept from when it was first asked for
        (the copy fetched ahead holds them) until the layer uses them, with the n of then: the balance moves n after
        a layer's GPU work is queued, i.e. after the next layer's set was fetched, and the new n takes effect from
        the next fetch, not by dropping that copy (``_mode_for`` drops sets kept for another run of forwards)."""
        eligible = ~resident(self.blocks[j])
        kept = self._sets.get(j)
        if kept is None:
            n = min(self._n_ahead, self.experts.cap)
            kept = self._sets[j] = (n, policy.ahead_experts(self._seen.get(j), eligible, n))
        return [e for e in kept[1] if eligible[e]]  # an expert made resident since is the hot bank's

    def _next_experts(self, j: int) -> list[int]:
        """Layer j's experts to copy ahead (``StreamedExperts.next_experts``): ahead mode's set, else all of its
        non-resident experts (at most a slot)."""
        if self._forward is not None and self._forward[1] == "ahead":
            return self._set(j)
        return [int(e) for e in np.flatnonzero(~resident(self.blocks[j]))][:self.experts.cap]

    # ---- what shared layers ask and report (``SplitLayers``) -----------------------------------------------------
    def take_set(self, i: int) -> tuple[list[int], object]:
        """Ahead mode's GPU experts of layer i (``_set``) and the ring item of their first part
        (``StreamedExperts.take``; None where the set is empty); the set is dropped: the next ask (the next
        forward's prefetch) picks from the rows seen by then."""
        gpu = self._set(i)
        del self._sets[i]
        return gpu, (self.experts.take(i, gpu) if gpu else None)

    def see(self, i: int, counts: np.ndarray) -> None:
        """Layer i's rows per expert [E] into the decaying history ahead mode picks its sets from (``_seen``)."""
        old = self._seen.get(i)
        self._seen[i] = counts.astype(np.float64) + (0.0 if old is None else 0.5 * old)

    def observe(self, i, T, cpu_counts, times, idle, ahead, m, cpu_end=None) -> None:
        """Layer i's host times into the feedback (``Feedback.observe``; ``cpu_end``: the CPU task's end where it
        is not the layer's) and, in ahead mode, the next layers' n steered from them (m streamable experts)."""
        block = self.blocks[i]
        key = self._costs_key(block)
        self.feedback.observe(i, T, key, self._costs.get(key), cpu_counts, times, idle, cpu_end)
        ring = self.experts.ring
        if ahead and ring.spans is not None:
            self._n_ahead = self.feedback.steer(T, ring.spans, self.experts.layouts[i].expert_bytes, self._n_ahead,
                                                m, self.experts.cap)

    def _mode_for(self, i: int, block, T: int, k: int) -> str:
        """This forward's mode, decided at its first block (a block index not after the last one seen, or another
        T, starts a forward)."""
        if self._forward is None or i <= self._last or self._forward[0] != T:
            self.split.settle_gates()  # a stopped forward's gated tasks (their errors raised here)
            if self.feedback.start_forward():  # the costs moved: decide again
                self._decisions.clear()
            mode = self._decide(block, T, k)
            if mode != "cpu" or (self.mode == "auto" and T >= AUTO_MIN_TOKENS):  # (cpu: trials' lengths only)
                self.feedback.forward_mode(T, mode)
            if mode == "ahead" and self._forward != (T, "ahead"):  # sets kept from another length or long ago
                self._sets.clear()
            self._forward = (T, mode)
            self.last = {"T": T, "mode": mode, "gpu_experts": []}
            if mode == "ahead":
                self._n_ahead = self.feedback.balance.start(T, self._ahead_n(block, T, k))
            if self.experts.ready:
                self.experts.ring.spans = {} if mode == "ahead" and self.cuda else None  # copy times for the balance
            if self.experts.ready and mode not in ("gpu", "ahead"):  # (those may take the first layer's copy
                self.experts.ring.drop()  # fetched ahead)
        self._last = i
        return self._forward[1]

    # ---- the hook ------------------------------------------------------------------------------------------------
    def __call__(self, block, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """(routed [T, H], shared [T, H] or None) of ``block`` for x [T, H], or None: the native path's turn."""
        i = self._index.get(id(block))
        if i is None or x.device.type != self.device.type or (torch.is_grad_enabled() and x.requires_grad):
            return None
        if self.cuda and torch.cuda.is_current_stream_capturing():
            return None
        mode = self._mode_for(i, block, x.shape[0], ids.shape[1])
        if mode == "cpu":
            return None
        self.setup()
        if mode in ("split", "ahead"):
            out = self.split.layer(i, block, x, ids, weights, ahead=mode == "ahead")
        else:
            out = self._gpu(i, block, x, ids, weights, prefetch=mode == "gpu")
        if i == len(self.blocks) - 1:
            self.feedback.last_block()
        return out

    def native_done(self, block) -> None:
        """The block's native path has run this forward's experts (``HybridMoE._experts`` calls it where this
        streamer declined): after the last block of a cpu forward its span ends (for the trials), its experts
        included."""
        if self._forward is not None and self._forward[1] == "cpu" and self._index.get(id(block)) == len(
                self.blocks) - 1:
            self.feedback.last_block()

    def _gpu(self, i, block, x, ids, weights, prefetch: bool):
        """Every non-resident expert on the GPU: all of the layer (copied ahead) or, before the routing is known to
        use nearly all, the used ones (copied now)."""
        shared = shared_output(block, block.spec.shared, x)
        extra = None if block.hot is None else block.hot(x, ids, weights)  # f32 [T, H]
        eligible = ~resident(block)
        counts = None
        if not prefetch:
            counts = torch.bincount(ids.reshape(-1).cpu(), minlength=block.num_experts).numpy()
            eligible &= counts > 0
        experts = [int(e) for e in np.flatnonzero(eligible)]
        self.last["gpu_experts"].append(len(experts))
        streamed = self.experts.stream(i, block, x, ids, weights, experts, counts, prefetch) if experts else None
        return total(x, None, extra, streamed), shared
