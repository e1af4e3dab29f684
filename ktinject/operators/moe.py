"""The "moe" operator: routed experts in native CPU kernels, router and shared experts on the device.

A matched MoE block (Qwen3MoeSparseMoeBlock, DeepseekV3MoE, GptOssMLP, ... see ``families.py``) is replaced by a
``HybridMoE`` that keeps Hugging Face's own router and shared-expert modules (moved to the device, under the same
attribute names, so state-dict keys and router-logit recorders still work), hands the routed experts to
``native.Experts`` and frees the HF copy. One forward, for T = B*S tokens:

    device: router -> ids [T,k], weights [T,k]; copy hidden, ids, weights -> pinned host buffers (async)
    device: shared experts (queued before the host blocks, so they overlap the CPU work)
    host:   wait for the copies; native task submit ... wait (releases the GIL)
    device: copy the routed output back (async), add the shared output
    (on CUDA, every block but the model's last: the host does not wait; the device waits for the task's signal
    word before the copy back, and the next MoE forward waits for the task first: ``cpu_overlap``)

The router's fast path (softmax -> top-k routers in fewer kernels) and the host buffers are in ``routing.py``.

Rule keyword arguments: ``quant``: ``bf16`` (default), ``int8`` (W8A8: int8 weights with per-output-channel
scales, activations quantized per token on the fly) or ``int4`` (W4A8: int4 weights with a scale per group of 128
inputs where the block's sizes are multiples of 128, else 64: ~4.25 / ~4.5 bits a weight; int8 activations;
dequantized to bf16 for AMX when an expert has many rows) or ``fp8`` (W8A16: float8 e4m3 weights with a scale
per block of 16 outputs x 128 inputs, bf16 activations; what an FP8 release's experts load as, bit for bit) or
``mxfp4`` (W4A16, 4.25 bits a weight: e2m1 weights with an e8m0 power-of-two scale per output row and 32 inputs,
bf16 activations; what an MXFP4 release's experts (gpt-oss) load as, bit for bit; hidden and expert intermediate
sizes must be multiples of 32); ``group_size`` (with int4 or fp8: 32, 64 or 128 inputs a scale instead of that
default, which it overrides, as it does KTINJECT_INT4_GROUP for int4; smaller groups follow the weights more closely
and read more bytes; mxfp4 takes 32 only);
``defer``: d (an int, default 0) of each token's k experts, the lowest-weighted, or (a float m, 0 < m < 1) its
lowest-weighted experts up to a share m of its routing weight, deferred in decode steps to the next MoE block, which
adds their output to its own while the CPU has computed them during that block's attention
(``ktinject.operators.deferral``: semantics and why). The hot-expert options (``HOT_KWARGS``) are accepted too:
model-wide, applied once every block is built (``ktinject.gpu_experts``).

Each forward also counts the routed (token, slot) pairs per expert into ``counts`` [E] on the device (statistics),
and GPU-resident experts (``hot``, a ``ktinject.gpu_experts.hot.bank.HotExperts``, set by placement) run on the device
between the host submit and wait, while the native experts skip them through ``skip``. Where a gradient is wanted
(training), the routed experts go through ``moe_backward`` instead: all of them on the CPU, under autograd. A block
whose ``experts`` stand-ins carry LoRA adapters (PEFT's, or an inference adapter: ``expert_lora``) computes its
routed experts on the CPU with the adapters instead (``expert_lora_path``: native base products, the adapters'
terms in torch), in training and inference.

Legend: B batch, S sequence, T tokens (B*S), E experts, H hidden, I expert intermediate, k experts per token.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch import nn

from ktinject import native
from ktinject.operators import fast_path_report as fastpaths
from ktinject.operators import handshake as stream_experts
from ktinject.operators import (
    cpu_overlap, deferral, expert_lora, expert_lora_path, input_weighted, moe_backward, register,
)
from ktinject.operators.kernels import common as fused
from ktinject.operators.base import Operator, OperatorError, tensor_bytes
from ktinject.operators.families import (
    GROUPED_QUANTS, QUANTS, SHARED_ATTRS, BlockSpec, ExpertStream, experts_nbytes, free_experts, gpt_oss_biases,
    inspect_block, pack_experts, packed_nbytes, shared_output,
)
from ktinject.operators.routing import (
    fast_routing, fused_router_fits, hooked, router_f32_extra, softmax_topk_router, staging, token_ids,
)

log = logging.getLogger(__name__)


def _quant(kwargs: Mapping[str, Any], name: str) -> str:
    quant = kwargs.get("quant") or "bf16"
    if quant not in QUANTS:
        raise OperatorError(f"moe: quant {quant!r} for {name!r} is not supported; use one of {', '.join(QUANTS)}")
    return quant


def _group(kwargs: Mapping[str, Any], name: str) -> int | None:
    """The ``group_size`` kwarg (int4 and fp8 only: inputs per scale), checked; None: the quant's default (int4:
    ``native.default_group_size``, fp8: 128)."""
    group = kwargs.get("group_size")
    if group is None:
        return None
    quant = _quant(kwargs, name)
    if quant not in GROUPED_QUANTS:
        raise OperatorError(f"moe: group_size {group!r} for {name!r} applies to quant int4, fp8 or mxfp4 only (the "
                            f"quant in effect is {quant}: the rule's, else bf16, unless quant= / --quant given to the "
                            f"call overrides it); drop it or set quant: int4")
    if quant == "mxfp4" and group != native.MXFP4_GROUP:
        raise OperatorError(f"moe: group_size {group!r} for {name!r}: mxfp4 has a scale per 32 inputs, no other "
                            f"group; drop group_size or set it to 32")
    if isinstance(group, bool) or group not in native.GROUP_SIZES:
        raise OperatorError(f"moe: group_size {group!r} for {name!r} is not supported; use one of "
                            f"{', '.join(map(str, native.GROUP_SIZES))} ({quant} inputs per scale)")
    return int(group)


class HybridMoE(nn.Module):
    """An MoE block whose routed experts run in native CPU kernels; returns what the HF block returned."""

    def __init__(self, block: nn.Module, spec: BlockSpec, experts, device: torch.device, quant: str):
        super().__init__()
        self.spec = spec
        self.quant = quant
        self.device = torch.device(device)
        self.native_experts = experts  # native.Experts: E x (gate, up, down), packed on the host
        self.num_experts, self.hidden_size, self.intermediate_size = spec.num_experts, spec.hidden, spec.intermediate
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)  # Mixtral, training only
        # uint8 [E]: nonzero = expert computed elsewhere (hot experts on the device); a plain attribute so that
        # model.to(...) leaves it on the host where native reads it. Pinned on CUDA: re-placement copies the
        # device's residency table into it inside each (captured) step.
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        self.skip = torch.zeros(spec.num_experts, dtype=torch.uint8, pin_memory=pin)
        self.counts = torch.zeros(spec.num_experts, dtype=torch.int64, device=self.device)  # [E] routed pairs
        self.collect_stats = True
        self.hot = None  # HotExperts: GPU-resident experts (ktinject.gpu_experts.hot.placement.place)
        self.expert_biases = None  # gpt-oss: (gate_up_bias [E, 2I], down_bias [E, H]) f32 host copies, for hot
        # prefill hook (ktinject.gpu_experts.prefill.streamer, set by apply): called as prefill(block, x, ids, weights) for an
        # eager forward; returns (routed, shared) when it took the forward (experts streamed to the GPU, maybe split
        # with the CPU), None to leave it to the path below, which then calls prefill.native_done(block), where the
        # hook has it, once the native task is done (its timing). A plain attribute: not a submodule, no state-dict
        # keys.
        self.prefill = None
        self._ones: dict[tuple, torch.Tensor] = {}
        self.class_name = type(block).__name__
        self._task = None  # native.Task, made on first forward
        self._copied = None  # torch.cuda.Event: host copies done (CUDA only)
        # set by the decode layer's forward around its call (decode_layer): it takes a one-token runner's collect
        # into its residual add + norm; the runner left to it (take_lazy_collect)
        self.caller_collects = False
        self._lazy_runner = None
        # expert deferral (ktinject.operators.deferral): the setting in decode steps (slots per token, or a share of
        # each token's routing weight), the chain of the model's MoE blocks (set by deferral.link at injection;
        # None: this block defers nothing) and its place
        router = getattr(block, spec.router)
        self.top_k = router.top_k if isinstance(getattr(router, "top_k", None), int) else None  # k, where known
        self.defer = 0
        self.defer_chain, self.chain_pos, self.defer_tasks = None, 0, None
        for attr in (spec.router, *SHARED_ATTRS[spec.shared]):  # same names as HF: state-dict keys unchanged
            setattr(self, attr, getattr(block, attr).to(self.device))
        for attr in spec.router_args:  # tensors the router's forward takes (MiniMax-M2's bias): same names too
            t = getattr(block, attr)
            if isinstance(t, nn.Parameter):
                self.register_parameter(attr, nn.Parameter(t.detach().to(self.device), t.requires_grad))
            else:
                self.register_buffer(attr, t.to(self.device), attr not in block._non_persistent_buffers_set)
        # The router runs in float32 for every family (HF does so for DeepSeek/GLM only): with bf16 logits, near-
        # ties between experts round into flips against the float32 model, and one flipped expert moves a token's
        # output a lot; in float32 the injected model routes as the float32 reference does more often than HF bf16
        # (E x H weights: negligible memory and time). Weights come back float32 for every family.
        self._modules[spec.router].float()
        # stand-ins of the routed experts' projections for PEFT to adapt (no storage, no state-dict keys); an
        # inference adapter is kept in ``expert_lora`` (``ktinject.operators.expert_lora``)
        self.experts = expert_lora.slots(spec)
        self.expert_lora = None

    def routing(self, x: torch.Tensor, runner=None, input_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's router, in float32, on x [T, H]: (weights [T, k] float32, ids [T, k] int64); ``input_ids`` (the T
        token ids, any shape) for a router that chooses by token (``spec.token_routed``: DeepSeek-V4's hash layers).
        For the softmax -> top-k -> renormalize routers, the same weights by ``fast_routing`` (ids in its order),
        unless the router is hooked, replaced or recorded by autograd (HF's own forward, bitwise, for hooks and
        training). ``runner``: the StreamExperts this decode step will start: where the one-kernel router runs, it
        also counts the routed pairs, writes x, ids and weights into the runner's pinned buffers
        (``runner.staged_ids``: no copies) and raises the runner's go (``runner.raised_ids``: no stream
        operation)."""
        router = self._modules[self.spec.router]  # "gate" or "router" (gpt-oss); checked per call: may be replaced
        if self.spec.weights_input:  # Llama 4's router returns (scores, logits)
            return input_weighted.llama4_routing(router, x)[:2]
        report = fastpaths.report_for(self)
        if not softmax_topk_router(router):
            report.unavailable("fast_router", f"{type(router).__name__} is not a softmax -> top-k router")
        elif hooked(router):
            report.fell_back("fast_router", f"{type(router).__name__} has hooks or its own forward", True)
        elif torch.is_grad_enabled() and (router.weight.requires_grad or x.requires_grad):
            report.fell_back("fast_router", "autograd through the router", True)
        else:
            report.ran("fast_router")
            if runner is not None and fused_router_fits(router, x):
                # the kernel raises the CPU's go too, unless this step's skip mask is still to be mirrored (a
                # dynamic hot bank: _mirror_skip runs after the routing)
                go = None if self.hot is not None and self.hot.dynamic else runner.go_word()
                w, ids = fused.router_topk(x, router.weight, router.top_k,
                                           counts=self.counts if self.collect_stats else None,
                                           stage=(runner.h, runner.ids, runner.w), go=go)
                runner.staged_ids = ids
                runner.raised_ids = ids if go is not None else None
                return w, ids
            return fast_routing(router, x)
        if self.spec.token_routed:  # the frozen token -> experts table chooses; the router's scores weight them
            _, weights, ids = router(x.float(), token_ids(input_ids, x.shape[0], self.device, self.class_name))
            return weights, ids
        _, weights, ids = router(x.float(), *(getattr(self, a) for a in self.spec.router_args))  # float32
        return weights, ids

    def extra_repr(self) -> str:
        s = self.spec
        return (f"{self.class_name}: E={s.num_experts}, H={s.hidden}, I={s.intermediate}, quant={self.quant}, "
                f"layout={s.layout}, shared={s.shared}, device={self.device}, "
                f"host={self.native_experts.nbytes / 2**20:.1f} MiB"
                + ("" if self.hot is None else f", hot={len(self.hot.residents())}/{self.hot.C} slots"))

    def _count(self, ids: torch.Tensor) -> None:
        """counts[e] += pairs routed to e (on the device, no sync: works inside graph capture)."""
        flat = ids.reshape(-1)
        key = (flat.numel(), flat.device)
        ones = self._ones.get(key)
        if ones is None:
            ones = self._ones[key] = torch.ones(flat.numel(), dtype=torch.int64, device=flat.device)
        self.counts.index_add_(0, flat.to(self.counts.device), ones.to(self.counts.device))

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None):
        """hidden_states [B, S, H] -> what the HF block returns; ``input_ids`` [B, S]: the token ids, which
        DeepSeek-V4's decoder layer passes to its block (read by token-routed layers only)."""
        lora = expert_lora.factors(self)  # expert adapters (None: none); an error for a block that cannot take them
        if self.spec.weights_input:  # Llama 4 (input_weighted.py)
            return input_weighted.forward(self, hidden_states)
        B, S, H = hidden_states.shape  # [B, S, H]
        if self.training and self.jitter_noise > 0:  # Mixtral's router jitter (HF applies it in training only)
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        x = hidden_states.reshape(-1, H)  # [T, H]
        runner = None if lora is not None else self._decode_runner(x, S)
        weights, ids = self.routing(x, runner, input_ids)  # [T, k], [T, k]
        if self.collect_stats and ids.numel() and (runner is None or runner.staged_ids is not ids):
            self._count(ids)  # (else counted by the routing kernel)
        pending = None if self.defer_chain is None else self.defer_chain.take(self)  # the previous block's
        d = 0 if lora is not None or moe_backward.wanted(x, weights) else self._defer_now(S, x.shape[0], ids.shape[1])
        if d:
            on_cuda = x.device.type == "cuda"
            cpu_overlap.settle()  # (a task a prompt's forward left running)
            self._mirror_skip(on_cuda)
            routed, extra, shared, prev = deferral.experts_deferred(self, x, ids, weights, d, pending,
                                                                     staging(pin=on_cuda), self.caller_collects)
            routed = _combine(routed, extra)
        else:
            self._lazy_runner = None  # (take_lazy_collect took the last one)
            routed, shared = self._experts(x, ids, weights, lazy=self.caller_collects and deferral.lazy_ok(pending),
                                           lora=lora)
            prev = None
            if self._lazy_runner is not None:  # the previous block's deferred output joins the caller's collect
                self._lazy_runner = deferral.lazy_with(self._lazy_runner, pending)
            elif pending is not None:
                prev = pending.collect()
        out = routed if shared is None else routed + shared
        if prev is not None:  # the previous MoE block's deferred experts
            out = out + prev
        out = out.view(B, S, H)
        return (out, weights) if self.spec.returns_scores else out

    def _decode_runner(self, x: torch.Tensor, S: int):
        """The StreamExperts this forward's experts will start (graph warm-up and capture: ``_experts`` and
        ``deferral.experts_deferred`` ask runner_for for the same key), or None."""
        T, H = x.shape
        if x.device.type != "cuda" or not stream_experts.active() or not T or not self.top_k or self._gpu_only():
            return None
        d = self._defer_now(S, T, self.top_k)
        return stream_experts.runner_for(self.native_experts, T, self.top_k, H, x.device, dtype=x.dtype,
                                         weights_dtype=torch.float32, skip=self.skip, defer=d)

    def _defer_now(self, S: int, T: int, k: int) -> int | float:
        """The deferral setting of this forward: ``defer`` in a decode step (one token per row) of a chained block
        that is not the model's last MoE block, else 0."""
        chain = self.defer_chain
        if not self.defer or self._gpu_only() or S != 1 or T == 0 or chain is None or chain.is_last(self):
            return 0
        return deferral.check_defer(self.defer, k, repr(self.class_name))

    def take_lazy_collect(self):
        """The StreamExperts whose output this block's last forward returned uncollected (``out`` not yet written:
        the caller launches its collect, ``caller_collects``), else None; cleared by the call."""
        r, self._lazy_runner = self._lazy_runner, None
        return r

    def _experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, lazy: bool = False, lora=None):
        """(routed [T, H] on x's device, shared [T, H] or None), the two computed concurrently. ``lazy``: in graph
        decode, where routed would be the runner's output alone, return it uncollected (take_lazy_collect);
        ``lora``: the block's expert adapters (``expert_lora.factors``): every expert on the CPU (expert_lora_path)."""
        T, H = x.shape
        k = ids.shape[1]
        on_cuda = x.device.type == "cuda"
        if T == 0:
            return x.new_zeros((0, H)), shared_output(self, self.spec.shared, x)
        cpu_overlap.settle()  # the block before's task, left running (or an earlier forward's): its error raised
        if lora is not None:
            return expert_lora_path.routed(self, lora, x, ids, weights), shared_output(self, self.spec.shared, x)
        if moe_backward.wanted(x, weights):  # training: autograd through every expert, on the CPU
            return moe_backward.routed(self.native_experts, x, ids, weights), shared_output(self, self.spec.shared, x)
        if self._gpu_only():  # every expert resident: no CPU task, no handshake with the pool
            shared = shared_output(self, self.spec.shared, x)
            return self.hot(x, ids, weights).to(x.dtype), shared
        if self.prefill is not None and not (on_cuda and stream_experts.active()):  # never inside graph capture
            taken = self.prefill(self, x, ids, weights)
            if taken is not None:
                return taken
        if on_cuda and stream_experts.active():  # graph warm-up/capture: the stream itself signals the host
            runner = stream_experts.runner_for(self.native_experts, T, k, H, x.device, dtype=x.dtype,
                                               weights_dtype=weights.dtype, skip=self.skip)
            self._mirror_skip(True)
            runner.start(x, ids, weights)
            shared = shared_output(self, self.spec.shared, x)
            extra = None if self.hot is None else self.hot(x, ids, weights)  # GPU-resident experts, meanwhile
            lazy = lazy and shared is None and extra is None
            routed = runner.finish(lazy=lazy)  # static [T, H]
            if lazy and runner.pending:  # deferred by this finish: the caller collects it
                self._lazy_runner = runner
            return _combine(routed, extra), shared
        st = staging(pin=on_cuda)
        h, i, w = st.inputs("", x, ids, weights, non_blocking=on_cuda)  # device -> pinned host, async on CUDA
        o = st.get("out", T, H, stream_experts.host_dtype(x.dtype))
        self._mirror_skip(on_cuda)
        shared = extra = None
        if on_cuda:
            if self._copied is None:
                self._copied = torch.cuda.Event()
            copied = self._copied
            copied.record()  # after the three copies, on the current stream
            shared = shared_output(self, self.spec.shared, x)  # queued on the GPU: overlaps the CPU experts
            extra = None if self.hot is None else self.hot(x, ids, weights)  # GPU-resident experts, likewise
            copied.synchronize()
        task = self._bound_task(h, i, w, o)
        if on_cuda and cpu_overlap.usable(self, x, o):  # the host goes on while the CPU works (cpu_overlap.py)
            done = cpu_overlap.word(task)
            task.submit()
            try:
                fused.wait_word(done, x.device)
                routed = torch.empty((T, H), dtype=x.dtype, device=x.device)
                routed.copy_(o, non_blocking=True)  # after the wait; stream order protects `o` until then
            except BaseException:
                task.wait()
                raise
            cpu_overlap.leave(task, self)
            return _combine(routed, extra), shared
        task.submit()
        try:
            if not on_cuda:
                shared = shared_output(self, self.spec.shared, x)
        finally:
            task.wait()  # always: the pool must be done with the buffers before anyone reuses them
        done = getattr(self.prefill, "native_done", None)  # (a hook may be a plain function: MoeTrace's)
        if done is not None:
            done(self)
        if not on_cuda and self.hot is not None:  # the "GPU" bank is on the CPU: after the pool, not against it
            extra = self.hot(x, ids, weights)
        routed = torch.empty((T, H), dtype=x.dtype, device=x.device)
        routed.copy_(o, non_blocking=on_cuda)  # pinned host -> device; stream order protects `o` until done
        return _combine(routed, extra), shared

    def _gpu_only(self) -> bool:
        """The hot bank holds every expert for good (``HotExperts.holds_all``): the routed experts are its alone."""
        return self.hot is not None and self.hot.holds_all()

    def _mirror_skip(self, non_blocking: bool) -> None:
        """Re-placement on: this step's native skip mask is the device residency table (stream order keeps the
        two sides consistent within the step)."""
        if self.hot is not None and self.hot.dynamic:
            self.skip.copy_(self.hot.resident, non_blocking=non_blocking)

    def _bound_task(self, h, i, w, o):
        if self._task is None:
            self._task = native.Task()
        self._task.bind(self.native_experts, h, i, w, skip=self.skip, out=o)
        return self._task


def _combine(routed: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    """CPU experts' output [T, H] plus the GPU-resident experts' (float32 [T, H] or None), in routed's dtype."""
    return routed if extra is None else (extra + routed).to(routed.dtype)


#: the model-wide hot-expert options a moe rule may carry (``ktinject.gpu_experts.hot.settings.OPTIONS``): the operator
#: only accepts them; ``ktinject.injection.apply`` validates them (naming the rule) and places the experts once every block
#: is built, so this module never depends on the GPU-expert code
HOT_KWARGS = frozenset({"gpu_experts_budget", "placement", "stats", "rebalance_every"})
#: the model-wide prefill option ("auto" | "cpu" | "gpu": where a prompt's routed experts run,
#: ``ktinject.gpu_experts.prefill.policy``): accepted here, validated (naming the rule) and acted on by
#: ``ktinject.injection.apply`` (``gpu_experts.prefill.streamer``)
PREFILL_KWARGS = frozenset({"prefill"})


@register("moe")
class MoEOperator(Operator):
    """Replace an MoE block by a HybridMoE: routed experts on the host (native), the rest on ``device``.

    Two ways in, one way out: ``build`` packs the experts of a loaded block, the streaming loader fills native
    experts from the checkpoint itself (``expert_stream`` says what to fill); both end in ``build_packed``."""

    kwargs_allowed = frozenset({"quant", "group_size", "defer"}) | HOT_KWARGS | PREFILL_KWARGS

    @classmethod
    def check(cls, module: nn.Module, name: str, kwargs: Mapping[str, Any]) -> None:
        spec = inspect_block(module, name)
        _quant(kwargs, name)
        _group(kwargs, name)
        _defer(kwargs, module, spec, name)
        if not spec.known:
            log.warning("moe: %s (%s) is not a verified block class; driving it as one with router %r, shared "
                        "experts %s, %s experts layout", name, type(module).__name__, spec.router, spec.shared,
                        spec.layout)

    @classmethod
    def placement(cls, module: nn.Module, kwargs: Mapping[str, Any], device: torch.device) -> dict[str, int]:
        spec = inspect_block(module, "<placement>")
        host = packed_nbytes(spec, _quant(kwargs, "<placement>"), _group(kwargs, "<placement>"))
        on_device = tensor_bytes(module) - experts_nbytes(module) + router_f32_extra(getattr(module, spec.router))
        out: dict[str, int] = {"cpu": host}
        out[str(torch.device(device))] = out.get(str(torch.device(device)), 0) + on_device
        return out

    @classmethod
    def expert_stream(cls, module: nn.Module, name: str, kwargs: Mapping[str, Any]) -> ExpertStream:
        spec = inspect_block(module, name)
        return ExpertStream(spec, _quant(kwargs, name), _group(kwargs, name))

    @classmethod
    def build(cls, module: nn.Module, name: str, kwargs: Mapping[str, Any], device: torch.device) -> nn.Module:
        spec = inspect_block(module, name)
        quant = _quant(kwargs, name)
        experts = pack_experts(module, spec, quant, name, _group(kwargs, name))
        biases = gpt_oss_biases(module.experts) if spec.has_bias else None
        free_experts(module)
        return _hybrid(module, name, spec, quant, device, experts, biases, _defer(kwargs, module, spec, name))

    @classmethod
    def build_packed(cls, module: nn.Module, name: str, kwargs: Mapping[str, Any], device: torch.device, experts,
                     biases=None) -> nn.Module:
        """The HybridMoE around ``experts`` (a filled native.Experts of ``expert_stream``'s spec); ``biases``:
        gpt-oss's (gate_up [E, 2I], down [E, H]) float32 host copies. The block's experts module (still on the meta
        device when streamed) is left behind."""
        spec = inspect_block(module, name)
        return _hybrid(module, name, spec, _quant(kwargs, name), device, experts, biases,
                       _defer(kwargs, module, spec, name))


def _defer(kwargs: Mapping[str, Any], module: nn.Module, spec: BlockSpec, name: str) -> int | float:
    """The ``defer`` kwarg (slots per token, or a share of each token's routing weight, deferred to the next MoE
    block in decode steps), checked (against k for a count)."""
    k = getattr(getattr(module, spec.router, None), "top_k", None)
    if spec.weights_input and kwargs.get("defer"):
        raise OperatorError(f"moe: defer for {name!r} ({type(module).__name__}): expert deferral does not take "
                            f"blocks whose routing weights scale the experts' input (Llama 4); drop it")
    return deferral.check_defer(kwargs.get("defer", 0), k if isinstance(k, int) else None, repr(name))


def _hybrid(module: nn.Module, name: str, spec: BlockSpec, quant: str, device: torch.device, experts,
            biases, defer: int | float = 0) -> HybridMoE:
    """The one place a HybridMoE is made, whichever way its experts were packed."""
    if spec.has_bias and biases is None:  # GPU-resident gpt-oss experts need them; the native copy cannot give them
        raise OperatorError(f"moe: {name!r} has gpt-oss experts (with biases) but no expert_biases were given")
    k = getattr(getattr(module, spec.router, None), "top_k", None)
    if isinstance(k, int) and not 1 <= k <= experts.num_experts:  # (else torch.topk fails at the first forward)
        raise OperatorError(f"moe: {name!r} routes each token to top_k = {k} experts but has {experts.num_experts}; "
                            "check the config's num_experts_per_tok against its expert count (num_experts, "
                            "num_local_experts or n_routed_experts)")
    hybrid = HybridMoE(module, spec, experts, device, quant)
    hybrid.expert_biases = biases
    hybrid.defer = defer
    hybrid.train(module.training)
    log.debug("moe: %s -> %s", name, hybrid.extra_repr())
    return hybrid
