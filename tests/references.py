"""References the tests hold the library to: one layer of native experts and its float64 reference, a model's
streamed prefill against its cpu path with routing flips told apart, expert deferral's slot selection and a plain
torch model with deferral, and the GPU tests' greedy helpers. Test-only: the tiny models themselves are
``ktinject.tiny_models``.

Legend: T tokens, H hidden, I expert intermediate, E experts, k experts per token.
"""
from __future__ import annotations

import torch
from torch import nn

import ktinject
from ktinject.tiny_models import build_tiny_model

# ---- one layer of native experts and its float64 reference (streamed prefill tests, CPU and GPU) ------------------
def random_experts(E: int, H: int, I: int, quant: str, gptoss: bool = False, seed: int = 0):
    """(native.Experts of random weights scaled to keep outputs O(1), biases or None): gpt-oss experts (clamped
    activation) carry biases, returned as HybridMoE keeps them: (gate_up [E, 2I] gate then up, down [E, H])."""
    from ktinject import native

    g = torch.Generator().manual_seed(seed)
    if not gptoss:
        return native.Experts.from_hf(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5,
                                      torch.randn(E, H, I, generator=g) / I ** 0.5, quant=quant), None
    gub, db = torch.randn(E, 2 * I, generator=g) * 0.1, torch.randn(E, H, generator=g) * 0.1
    ex = native.Experts.from_gpt_oss(torch.randn(E, H, 2 * I, generator=g) / H ** 0.5, gub,
                                     torch.randn(E, I, H, generator=g) / I ** 0.5, db, quant=quant)
    return ex, (torch.cat([gub[:, 0::2], gub[:, 1::2]], dim=1), db)


def experts_reference(ex, biases, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float64 [T, H]: sum over each token's k experts of weight * expert(x), the experts as stored (weights from
    ``ktk_experts_get``: bf16-rounded or dequantized), exact arithmetic otherwise. x [T, H], ids / weights [T, k]."""
    T, H = x.shape
    I = ex.intermediate
    out = torch.zeros(T, H, dtype=torch.float64)
    x64, ids, weights = x.double().cpu(), ids.cpu(), weights.cpu()
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        g = x64[t] @ ex.get(e, "gate").double().T
        u = x64[t] @ ex.get(e, "up").double().T
        if biases is not None:
            g, u = g + biases[0][e, :I].double(), u + biases[0][e, I:].double()
        if ex.activation == "silu":
            a = torch.nn.functional.silu(g) * u
        else:
            g, u = g.clamp(max=ex.limit), u.clamp(-ex.limit, ex.limit)
            a = g * torch.sigmoid(ex.alpha * g) * (u + 1)
        y = a @ ex.get(e, "down").double().T
        if biases is not None:
            y = y + biases[1][e].double()
        out.index_add_(0, t, y * weights[t, j].double().unsqueeze(1))
    return out


# ---- a model's streamed prefill against its cpu path, routing flips told apart (CPU and GPU prefill tests) ---------
# In a bf16 model, outputs that differ by rounding (the streamed and the native experts: ~0.5% of a layer's max) may
# flip a later layer's top-k at a near-tie; that token's logits (and, through attention, its sequence's later ones)
# then differ by whole units however right both paths are (tiny gpt_oss: 2 of 80 tokens, 60% of the max logit). So
# the model-level check compares each MoE call's streamed output with the float64 reference on the call's own
# inputs, and the logits only at tokens whose routing was the same in both runs.
class MoeTrace:
    """``with MoeTrace(model) as tr: model(ids)``: every HybridMoE call of the forwards, in order, as tr.calls
    entries (block, x [T, H], ids [T, k], weights [T, k], routed [T, H] from the block's prefill hook or None: the
    native path ran), cloned on the device (no host sync, so the streamed work is ordered as without the trace)."""

    def __init__(self, model):
        from ktinject.gpu_experts.prefill.streamer import blocks_of

        self.blocks = blocks_of(model)
        self.calls: list[tuple] = []

    def _hook(self, hook):
        def call(block, x, ids, weights):
            out = None if hook is None else hook(block, x, ids, weights)
            routed = None if out is None else out[0].detach().clone()
            self.calls.append((block, x.detach().clone(), ids.clone(), weights.detach().clone(), routed))
            return out
        return call

    def __enter__(self):
        self.saved = [b.prefill for b in self.blocks]
        for b, hook in zip(self.blocks, self.saved):
            b.prefill = self._hook(hook)
        return self

    def __exit__(self, *exc):
        for b, hook in zip(self.blocks, self.saved):
            b.prefill = hook


def streamed_call_errors(trace: MoeTrace) -> list[tuple[float, float]]:
    """(streamed, native) error of each traced call that the hook computed: max |out - ref| / max |ref| against
    ``experts_reference`` on the call's own inputs (hot experts included: they hold the same stored weights)."""
    out = []
    for block, x, ids, w, routed in trace.calls:
        if routed is None:
            continue
        ex = block.native_experts
        ref = experts_reference(ex, block.expert_biases if ex.bias else None, x, ids, w)
        scale = ref.abs().max().clamp(min=1e-12)
        native = ex(x.cpu(), ids.cpu(), w.cpu())
        out.append((float((routed.double().cpu() - ref).abs().max() / scale),
                    float((native.double() - ref).abs().max() / scale)))
    return out


def routing_flips(a: MoeTrace, b: MoeTrace, shape: tuple[int, int]) -> torch.Tensor:
    """bool [B, S] (``shape``: the forward's batch, sequence): tokens whose logits a routing difference between the
    two traced forwards may have changed: a token routed to other experts by some block, and the later tokens of its
    sequence unless that block is the model's last MoE block (no attention reads it afterwards)."""
    Bn, S = shape
    out = torch.zeros(Bn, S, dtype=torch.bool)
    if len(a.calls) != len(b.calls):
        raise ValueError(f"routing_flips: {len(a.calls)} and {len(b.calls)} MoE calls: not the same forward")
    last = a.blocks[-1] if a.blocks else None
    for ca, cb in zip(a.calls, b.calls):
        differs = (ca[2].sort(-1).values != cb[2].sort(-1).values).any(-1).cpu().view(Bn, S)
        for i, s in differs.nonzero().tolist():
            if ca[0] is last:
                out[i, s] = True
            else:
                out[i, s:] = True
    return out


def routing_flip_events(a: MoeTrace, b: MoeTrace) -> tuple[int, int]:
    """(events, routed): how many (MoE call, token) pairs the two traced forwards routed to other experts, out of
    how many. What a rounding difference between two paths causes directly: a near-tie moved. ``routing_flips``
    also marks the later tokens of a row, which an early event in a row makes most of the row: a bound on those
    depends on where the near-ties fall, which moves with the weights (a router kept in float32 or rounded to bf16
    by the transformers release that builds it), not on the paths' agreement."""
    if len(a.calls) != len(b.calls):
        raise ValueError(f"routing_flip_events: {len(a.calls)} and {len(b.calls)} MoE calls: not the same forward")
    events = routed = 0
    for ca, cb in zip(a.calls, b.calls):
        events += int((ca[2].sort(-1).values != cb[2].sort(-1).values).any(-1).sum())
        routed += ca[2].shape[0]
    return events, routed


def token_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """float [B, S]: max |got - ref| over each token's logits / max |ref| over all of them."""
    got, ref = got.float().cpu(), ref.float().cpu()
    return (got - ref).abs().amax(-1) / ref.abs().max().clamp(min=1e-12)


def streamed_vs_cpu(model, ids: torch.Tensor, attach) -> dict:
    """One forward of ``model`` (injected, prefill "cpu") on ``ids`` [B, S] through its cpu path, then one with the
    streamer ``attach(model)`` sets up (detached afterwards). Returns cpu / streamed logits, ``calls`` (streamed,
    native) errors per streamed MoE call (``streamed_call_errors``), ``flips`` bool [B, S] (``routing_flips``),
    ``events`` (flip events, routed token-calls) (``routing_flip_events``), ``tokens`` float [B, S] (``token_errors`` of streamed against cpu) and the streamer's ``last``."""
    from ktinject.gpu_experts.prefill import streamer as stream

    stream.attach(model, "cpu")
    with torch.no_grad():
        with MoeTrace(model) as cpu_trace:
            cpu = model(ids).logits
        s = attach(model)
        try:
            with MoeTrace(model) as trace:
                got = model(ids).logits
            last = dict(s.last) if s is not None else {"mode": "cpu"}  # attach gave no streamer
        finally:
            stream.attach(model, "cpu")
    return dict(cpu=cpu, streamed=got, calls=streamed_call_errors(trace), last=last,
                flips=routing_flips(cpu_trace, trace, tuple(ids.shape)), events=routing_flip_events(cpu_trace, trace),
                tokens=token_errors(got, cpu))


def slot_ranks(weights: torch.Tensor) -> torch.Tensor:
    """int64 [T, k]: each slot's rank among its token's k slots as the native code ranks them: the number of slots
    with a larger weight, or an equal weight and a lower index (0: the top slot)."""
    w = weights.double()
    k = w.shape[-1]
    lower = torch.arange(k).view(1, k) < torch.arange(k).view(k, 1)  # [k (slot j), k (slot m)]: m < j
    mine, other = w.unsqueeze(-1), w.unsqueeze(-2)  # [T, k, 1] slot j, [T, 1, k] slot m
    return ((other > mine) | ((other == mine) & lower)).sum(-1)


def deferred_slots(weights: torch.Tensor, defer) -> torch.Tensor:
    """bool [T, k]: the slots ``defer`` defers (ktinject.operators.deferral): an int d, each token's d lowest-ranked
    slots; a float m, a slot of rank r > 0 whose cum(r) (weights of the token's slots of rank >= r over all k) is
    <= m, in float64 summed in slot order and m read as a C float, as the native code does (so the masks are equal
    bit for bit); none where a token's total weight is not finite or <= 0."""
    rank = slot_ranks(weights)
    k = rank.shape[-1]
    if not isinstance(defer, float):
        return rank >= k - defer
    w = weights.double()
    total = torch.zeros_like(w[:, 0])  # [T]
    below = torch.zeros_like(w)  # [T, k]: weights of the slots ranked at or below each slot
    for m in range(k):
        total = total + w[:, m]
        below = below + torch.where(rank[:, m:m + 1] >= rank, w[:, m:m + 1], 0.0)
    share = float(torch.tensor(defer, dtype=torch.float32))
    ok = (torch.isfinite(total) & (total > 0)).unsqueeze(-1)
    return (rank > 0) & ok & (below / total.unsqueeze(-1) <= share)


def plain_deferral(model: nn.Module, deferred) -> None:
    """Rewrite the HF MoE blocks of ``model`` (float32) in plain torch with expert deferral: in decode steps
    (one token a row) the slots ``deferred(weights [T, k]) -> bool [T, k]`` names go, summed, to the next MoE
    block's output; the last block and prefill defer nothing. The reference the deferral tests hold the injected
    model to (``deferred``: ``deferred_slots`` of the setting), and the probe of the deferral policies."""
    from ktinject.operators.families import KNOWN_BLOCKS

    blocks = [m for m in model.modules() if type(m).__name__ in KNOWN_BLOCKS]
    state = {"pending": None}

    def rewrite(block, i):
        router = getattr(block, KNOWN_BLOCKS[type(block).__name__][0])

        def forward(hidden):
            B, S, H = hidden.shape
            x = hidden.reshape(-1, H)
            _, w, ids = router(x)
            defer = S == 1 and i < len(blocks) - 1
            later = deferred(w) if defer else torch.zeros_like(ids, dtype=torch.bool)
            out = block.experts(x, ids, w * ~later)
            if hasattr(block, "shared_experts"):
                out = out + block.shared_experts(x)
            if hasattr(block, "shared_expert"):
                out = out + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
            if i > 0 and state["pending"] is not None:
                out = out + state["pending"]
            state["pending"] = block.experts(x, ids, w * later) if defer else None
            return out.view(B, S, H)
        return forward

    for i, b in enumerate(blocks):
        b.forward = rewrite(b, i)


# ---- the GPU tests' reference / injected pair and greedy margins --------------------------------------------------

def pair(family: str, dtype: torch.dtype):
    """(reference on CUDA with its expert weights rounded to bf16 as native stores them, injected model on CUDA)."""
    ref = build_tiny_model(family, dtype=dtype).cuda()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if ".experts." in name:
                p.copy_(p.to(torch.bfloat16).to(dtype))
    inj = build_tiny_model(family, dtype=dtype)
    ktinject.inject(inj, gpu="cuda", gpu_experts_budget=0)  # every expert native; tests place them
    return ref, inj


def greedy_margins(ref, seq: torch.Tensor, mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[B, N]: how far (in the reference's logits, teacher-forced) each generated token of seq is below the
    reference's argmax at its step; 0 where it is the argmax. mask: the prompt's attention mask [B, prompt_len]."""
    full = torch.cat([mask, torch.ones_like(seq[:, prompt_len:])], dim=1)
    with torch.no_grad():
        logits = ref(seq, attention_mask=full).logits.float()  # [B, S, V]
    pred = logits[:, prompt_len - 1:-1]  # [B, N, V] predicting seq[:, prompt_len:]
    chosen = pred.gather(-1, seq[:, prompt_len:, None]).squeeze(-1)
    return pred.max(-1).values - chosen


def graph_generate(inj, ids: torch.Tensor, mask: torch.Tensor, n: int, graphs: bool):
    """(ktinject.generate's n greedy tokens with CUDA graphs on or off, the runner that decoded them)."""
    from ktinject.decode.generate import get_runner

    runner = get_runner(inj, use_graphs=graphs)
    out = ktinject.generate(inj, ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            pad_token_id=0, eos_token_id=None)
    return out, runner


# ---- the serving engine's rows: each request alone, then all at once ------------------------------------------------

def engine_alone_and_together(model, prompts: list[list[int]], max_tokens: int, **config) -> tuple[list, list]:
    """Greedy token ids of each prompt through a serving engine on ``model`` (EngineConfig ``config``), first one
    request at a time, then all from threads at once (rows at different positions in one step)."""
    import threading

    from ktinject.serve.engine import Engine, EngineConfig
    from ktinject.serve.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    together = [None] * len(prompts)
    with Engine(model, None, EngineConfig(**config)) as engine:
        alone = [engine.generate(p, greedy, timeout=300).token_ids for p in prompts]

        def one(i):
            together[i] = engine.generate(prompts[i], greedy, timeout=300).token_ids

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return alone, together


def assert_starts_as_hf_generate(model, prompts: list[list[int]], got: list[list[int]], max_tokens: int) -> None:
    """Each of ``got`` (an engine's tokens, ignore_eos) begins with HF's greedy generate of its prompt, which stops at
    an end-of-sequence token where the engine goes on."""
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    for p, tokens in zip(prompts, got):
        ref = type(model).generate(model, torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                                   pad_token_id=0)
        tail = ref[0, len(p):].tolist()
        assert tokens[:len(tail)] == tail and (len(tail) == max_tokens or tail[-1] in eos)
