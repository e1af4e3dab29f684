"""Expert deferral in decode steps (KTransformers' third technique): part of each MoE layer's routed experts runs one
layer late, so that the CPU computes them while the GPU runs the next layer's attention.

What ``defer`` computes (tests/operators/test_deferral.py checks the eager path against a plain torch rendering of this):
- Only forwards of one token per row (decode, S == 1) defer; prefill (S > 1) never does, and defer = 0 is the path
  without deferral, bit for bit. The MoE blocks b_0 .. b_{n-1} of the model, in forward order, form a chain.
- Block b_i routes its input x_i as always: ids [T,k], weights w [T,k] (HF's weights, never renormalized over
  either part). Per token, the k slots are ranked by weight: a slot's rank r is the number of the token's slots with
  a larger weight, or an equal weight and a lower slot index (r = 0: the top slot). Which slots are deferred:
  - by count, ``defer=d`` (an int, 0 <= d < k): the d of rank >= k - d; the other k - d are immediate;
  - by weight mass, ``defer=m`` (a float, 0 < m < 1): a slot of rank r is deferred iff r > 0 and
    cum(r) = (sum of w over the token's slots of rank >= r) / (sum of its k weights) <= m, i.e. the lowest-weighted
    slots whose cumulative share of the token's routing weight stays <= m, never the top one (0..k-1 slots a
    token; a step may defer none: the deferred task then adds zeros). Sums in float64 in slot order (the native
    code: double), m rounded to float32 (the native argument); a token whose total is not finite or <= 0 defers
    nothing. A mass setting defers more slots where the weight is spread, fewer where one expert dominates.
  Ints and floats are told apart by type: 1.0 is a float, out of range; a bool is neither.
- out_i = imm_i + shared_i(x_i) + def_{i-1}, summed in that order in the model's dtype (def_{-1} = 0), where
  imm_i = sum of w * expert(x_i) over the immediate slots and the deferred slots whose expert is GPU-resident, and
  def_i = the same sum over the other deferred slots. The last block b_{n-1} defers nothing.
Where the deferred output lands: in the next MoE block's output, so in the residual stream after that block's MoE:
layer L+1's attention and router see the hidden state without def_L, layer L+2 sees it. That is KTransformers'
choice (kt-kernel, ``BaseMoEWrapper.submit_forward``: layer L's deferred task writes into the output buffer of
layer L+1, whose immediate task then accumulates into it, "incremental"), and it keeps the CPU busy: it runs imm_L,
def_L, imm_{L+1} back to back, def_L while the GPU runs L+1's attention, and nothing on the GPU waits for def_L
before L+1's experts are due anyway. (Adding def_L before L+1's MoE input norm would hold L+1's router, and so the
go of imm_{L+1}, until def_L is back on the GPU: the CPU would idle for that round trip at every layer.)
GPU-resident (hot) experts among the deferred slots run at once, on the GPU with the immediate ones: they cost no
CPU time, so deferring them would add GPU work (a second bank call per layer) with nothing to hide behind it. Which
experts are hot therefore decides which products are deferred, never which are computed.
With B rows each token splits its own slots, so an expert may be immediate for one row and deferred for another.
(KTransformers keeps an expert immediate for the whole batch when any row ranks it high, which reads its weights
once; the per-token rule makes a row's result independent of the other rows.)

Mechanics: the native task selects its slots itself (``Task.select``: "top" the immediate slots, "rest" the
deferred ones; no GPU kernels, no extra copies); ``link`` gives every HybridMoE its place in the chain at
injection; within a forward a deferring block ``put``s its deferred work and the next block ``take``s it. Eagerly
the deferred task is submitted right after the immediate one and waited for by the next block; in a captured decode
step the immediate task's end raises the deferred task's go flag (``ktinject.operators.handshake``), and the next block's
collect of its own output takes the deferred output in the same kernel, inside the decoder layer's residual add +
norm (``LazyCollect``: one launch instead of two collects, an add and the add + norm). A forward cut short
leaves work in flight: the next forward's first block drains it. ``set_defer`` changes the setting on an injected
model (the graph runner captures again: its key holds the chain's setting).
Legend: T tokens, k experts per token, H hidden, d deferred slots per token (count), m deferred weight share (mass).
"""
from __future__ import annotations

import logging

import torch

from ktinject import native
from ktinject.operators import handshake as stream_experts
from ktinject.operators.base import OperatorError
from ktinject.operators.families import shared_output

log = logging.getLogger(__name__)

#: where ``link`` keeps a model's chain (``chain_of``)
CHAIN_ATTR = "_ktinject_defer_chain"


def check_defer(value, k: int | None, where: str) -> int | float:
    """``value`` as a deferral setting, unchanged: an int d, 0 <= d < k (k unknown: >= 0), or a float m, 0 < m < 1.
    Else OperatorError naming ``where`` (e.g. the module), both accepted forms and how the value is set."""
    if not native.valid_defer(value, k):
        bound = f" < k = {k} (the experts each token is routed to)" if k is not None else ""
        raise OperatorError(f"moe: defer={value!r} for {where}: expected an int with 0 <= defer{bound} (slots "
                            f"deferred per token) or a float with 0 < defer < 1 (share of each token's routing "
                            f"weight deferred); it is set by the moe rule's kwargs (defer: d) or by inject / "
                            f"from_pretrained / set_defer (defer=d)")
    return value


class DeferChain:
    """The MoE blocks of one model in forward order and the deferred work in flight between two of them."""

    def __init__(self, blocks: list):
        self.blocks = list(blocks)
        self._pending = None
        self._from = -1
        self.setting = tuple(b.defer for b in self.blocks)  # in the graph runner's key: a new d captures anew
        for i, b in enumerate(self.blocks):
            b.defer_chain, b.chain_pos = self, i

    def in_flight(self) -> bool:
        """Whether deferred work waits for the next block (between two blocks of a forward, or after one cut short)."""
        return self._pending is not None

    def is_last(self, block) -> bool:
        return block.chain_pos == len(self.blocks) - 1

    def put(self, block, pending) -> None:
        """``block`` deferred ``pending`` (EagerPending or StreamPending) for the next block."""
        if self._pending is not None:
            self._pending.discard()
        self._pending, self._from = pending, block.chain_pos

    def forget(self) -> None:
        """After a failed graph warm-up or capture, whose runners were reset (``StreamExperts.reset``): drop the
        work in flight. A stream task's is dropped without waiting (no done word will come for it); an eager
        task (a forward cut short before the warm-up) is waited for, as ``take`` would."""
        pending, self._pending, self._from = self._pending, None, -1
        if isinstance(pending, EagerPending):
            pending.discard()

    def take(self, block):
        """The pending work of the block just before ``block`` (its deferred slots' output comes with ``block``'s
        output), or None; work of any other block (a forward cut short) is drained and dropped."""
        pending, src = self._pending, self._from
        self._pending, self._from = None, -1
        if pending is None or src == block.chain_pos - 1:
            return pending
        log.debug("deferral: dropping the deferred work of block %d (a forward was cut short)", src)
        pending.discard()
        return None


class EagerPending:
    """A deferred native task submitted eagerly: its output staging [T, H] goes to ``device`` in ``dtype``."""

    def __init__(self, task, out: torch.Tensor, dtype: torch.dtype, device: torch.device):
        self.task, self.out, self.dtype, self.device = task, out, dtype, device

    def collect(self) -> torch.Tensor:
        self.task.wait()
        if self.device.type == "cuda":
            t = torch.empty(self.out.shape, dtype=self.dtype, device=self.device)
            t.copy_(self.out, non_blocking=True)  # pinned host -> device; stream order protects `out` until done
            return t
        return self.out.to(self.dtype, copy=True)  # the staging is reused two blocks later

    def discard(self) -> None:
        try:
            self.task.wait()
        except native.NativeError as e:  # the forward that made it is gone; its error with it
            log.warning("deferral: a dropped deferred task had failed: %s", e)


class StreamPending:
    """The deferred task of a StreamExperts runner (graph warm-up and capture)."""

    def __init__(self, runner):
        self.runner = runner
        self.captured = torch.cuda.is_current_stream_capturing()  # recorded, never run: nothing to drain

    def collect(self) -> torch.Tensor:
        return self.runner.finish_deferred()

    def discard(self) -> None:
        if not self.captured and not torch.cuda.is_current_stream_capturing():
            self.runner.drain_deferred()


class LazyCollect:
    """A block's uncollected output in graph decode (one token; ``HybridMoE.take_lazy_collect``): its runner's
    immediate output and the previous block's deferred output, collected together inside the caller's residual
    add + norm (``StreamExperts.collect_add_rms_norm`` with ``deferred``: one kernel instead of two collects, an add
    and the add + norm), or by ``flush``: the collects and the add the block would have queued."""

    def __init__(self, runner, prev):
        self.runner, self.prev = runner, prev

    def collect_add_rms_norm(self, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                             round_twice: bool = False):
        return self.runner.collect_add_rms_norm(residual, weight, eps, round_twice, deferred=self.prev)

    def flush(self) -> torch.Tensor:
        prev = self.prev.finish_deferred()
        return self.runner.flush().add_(prev)  # in x's dtype, as `routed + prev`


def lazy_ok(pending) -> bool:
    """Whether what the previous block deferred (``pending``, or None) can join the caller's collect kernel."""
    return pending is None or (isinstance(pending, StreamPending) and pending.runner.lazy_deferred_ok())


def lazy_with(runner, pending):
    """What a block hands its caller for a lazy finish of ``runner`` with ``pending`` (lazy_ok) left uncollected."""
    return runner if pending is None else LazyCollect(runner, pending.runner)


def link(model, blocks: list) -> DeferChain | None:
    """Chain ``blocks`` (the model's HybridMoE blocks in forward order) for deferral; kept on the model."""
    if not blocks:
        return None
    chain = DeferChain(blocks)
    model.__dict__[CHAIN_ATTR] = chain
    return chain


def chain_of(model) -> DeferChain | None:
    return model.__dict__.get(CHAIN_ATTR)


def set_defer(model, d: int | float) -> None:
    """Defer ``d`` in every MoE block of an injected model from the next forward on: an int, slots per token (0: off),
    or a float, a share of each token's routing weight (``check_defer``)."""
    chain = chain_of(model)
    if chain is None:
        raise OperatorError(f"set_defer: {type(model).__name__} has no injected MoE blocks (inject it first)")
    for b in chain.blocks:
        check_defer(d, b.top_k, repr(b.class_name))
    for b in chain.blocks:
        b.defer = d
    chain.setting = tuple(b.defer for b in chain.blocks)


def slots_run(model, reset: bool = False) -> tuple[int, int]:
    """(immediate, deferred) (token, slot) rows the deferring blocks' native tasks computed since the last reset, in
    eager decode steps and captured ones alike (``reset``: then set them to 0). deferred / (immediate + deferred) is
    the share of the CPU's expert work that deferral moved (with a weight-share setting it depends on the tokens)."""
    chain = chain_of(model)
    imm = dfr = 0
    for b in [] if chain is None else chain.blocks[:-1]:  # the last block defers nothing
        pairs = [] if b.defer_tasks is None else [tuple(t.slots_run(reset) for t in b.defer_tasks)]
        for i, d in pairs + [r.slots_run(reset) for r in stream_experts.runners(b.native_experts)]:
            imm, dfr = imm + i, dfr + d
    return imm, dfr


def _tasks(block) -> tuple:
    """The block's (immediate, deferred) native tasks of the eager path, made once."""
    if block.defer_tasks is None:
        block.defer_tasks = (native.Task(), native.Task())
    return block.defer_tasks


def experts_deferred(block, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, d: int | float, pending, st,
                     lazy: bool = False):
    """A deferring block's experts on x [T, H]: (routed [T, H] of the immediate slots, hot [T, H] float32 or None,
    shared [T, H] or None, the previous block's deferred output [T, H] or None); its own deferred slots are handed
    to the chain. ``pending``: what the previous block deferred; ``st``: the thread's staging buffers. ``lazy``
    (the caller collects, graph decode): where nothing else joins routed, routed is returned uncollected and the
    previous block's deferred output left to the same collect (``LazyCollect`` in ``block._lazy_runner``; prev
    None)."""
    T, H = x.shape
    k = ids.shape[1]
    on_cuda = x.device.type == "cuda"
    if on_cuda and stream_experts.active():  # graph warm-up / capture: the stream signals the host
        runner = stream_experts.runner_for(block.native_experts, T, k, H, x.device, dtype=x.dtype,
                                           weights_dtype=weights.dtype, skip=block.skip, defer=d)
        runner.start(x, ids, weights)
        shared = shared_output(block, block.spec.shared, x)
        extra = None if block.hot is None else block.hot(x, ids, weights)  # every slot: hot ones run now
        if lazy and shared is None and extra is None and runner.lazy_ok() and lazy_ok(pending):
            routed, prev = runner.finish(lazy=True), None
            block._lazy_runner = lazy_with(runner, pending)
        else:
            prev = None if pending is None else pending.collect()  # done by now; its copy overlaps imm on the CPU
            routed = runner.finish()
        block.defer_chain.put(block, StreamPending(runner))
        return routed, extra, shared, prev
    # eager: buffers of this block's parity, so that the next block's copies never touch what this block's deferred
    # task still reads (the block after that comes only once it has been collected)
    p = block.chain_pos % 2
    h, i, w = st.inputs(f"defer{p}.", x, ids, weights, non_blocking=on_cuda)  # device -> pinned host, async on CUDA
    hdt = stream_experts.host_dtype(x.dtype)
    o, od = st.get("defer.out", T, H, hdt), st.get(f"defer{p}.out", T, H, hdt)
    shared = extra = None
    if on_cuda:
        copied = torch.cuda.Event()
        copied.record()
        shared = shared_output(block, block.spec.shared, x)  # queued on the GPU: overlaps the CPU experts
        extra = None if block.hot is None else block.hot(x, ids, weights)
        copied.synchronize()
    imm, dfr = _tasks(block)
    imm.bind(block.native_experts, h, i, w, skip=block.skip, out=o)
    imm.select("top", d)
    dfr.bind(block.native_experts, h, i, w, skip=block.skip, out=od)
    dfr.select("rest", d)
    imm.submit()
    dfr.submit()  # after imm: a pool runs its tasks in order
    try:
        if not on_cuda:
            shared = shared_output(block, block.spec.shared, x)
        imm.wait()
    except BaseException:
        for t in (imm, dfr):  # the pool must be done with the buffers before anyone reuses them
            EagerPending(t, od, x.dtype, x.device).discard()
        raise
    if not on_cuda and block.hot is not None:  # the "GPU" bank is on the CPU
        extra = block.hot(x, ids, weights)
    prev = None if pending is None else pending.collect()
    routed = torch.empty((T, H), dtype=x.dtype, device=x.device)
    routed.copy_(o, non_blocking=on_cuda)
    block.defer_chain.put(block, EagerPending(dfr, od, x.dtype, x.device))
    return routed, extra, shared, prev
