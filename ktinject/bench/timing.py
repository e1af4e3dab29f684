"""The decode benchmark's measurements (``python -m ktinject.bench decode`` runs them and prints the table; bench
serve and bench defer reuse some): Hugging Face's own decode, ktinject's generate, bare graph replays, the CPU experts
alone, the graph with every routed expert muted, the paired overhead, a profile of one replay, and the rows that
compare fast paths on and off. Legend: B batch, P prompt tokens, N new tokens, L layers.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch
from torch import nn

from ktinject import compat


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def distinct_experts(num_experts: int, k: int, batch: int) -> float:
    """Expected distinct experts of ``batch`` tokens routed uniformly (k distinct of E each)."""
    return num_experts * (1 - (1 - k / num_experts) ** batch)


def routed_experts(cfg) -> int:
    """The config's routed experts a layer (``num_experts``; DeepSeek's configs: ``n_routed_experts``)."""
    n = getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None)
    if not n:
        raise ValueError(f"{type(cfg).__name__} names no routed experts (num_experts / n_routed_experts)")
    return int(n)


def expert_bytes_per_token(cfg, batch: int = 1, quant: str = "bf16") -> float:
    """Bytes of routed expert weights one decode step reads, in the stored format of ``quant`` (distinct experts:
    batch=1 -> k per layer)."""
    from ktinject.native import Experts

    L, E, k = cfg.num_hidden_layers, routed_experts(cfg), cfg.num_experts_per_tok
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    return L * distinct_experts(E, k, batch) * Experts.packed_nbytes(1, H, I, quant) / batch


def loaded_expert_bytes_per_token(model, batch: int = 1) -> float:
    """Bytes of routed expert weights one decode step reads, from the model's native experts as they are (any
    format, group size, formats per layer): per layer its packed bytes an expert x the distinct experts of a step."""
    cfg = model.config
    per_expert = [m.native_experts.nbytes / m.native_experts.num_experts for m in model.modules()
                  if getattr(m, "native_experts", None) is not None]
    return sum(per_expert) * distinct_experts(routed_experts(cfg), cfg.num_experts_per_tok, batch) / batch


def hf_decode(model, prompt: torch.Tensor, steps: int) -> tuple[float, float]:
    """(prefill seconds, seconds per decode step) with HF's modules and a DynamicCache."""
    from transformers import DynamicCache

    dev = prompt.device
    cache = DynamicCache(config=model.config)
    _sync(dev)
    t0 = time.perf_counter()
    out = model(prompt, **compat.cache_arg(cache), use_cache=True)
    tok = out.logits[:, -1:].argmax(-1)
    _sync(dev)
    t_prefill = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(tok, **compat.cache_arg(cache), use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return t_prefill, statistics.median(times) if times else float("nan")


class _TorchCPUExperts(nn.Module):
    """HF experts module kept on the CPU: inputs go there, the result comes back (accelerate-free baseline)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, hidden, top_k_index, top_k_weights):
        out = self.inner(hidden.cpu(), top_k_index.cpu(), top_k_weights.cpu())
        return out.to(hidden.device)


def wrap_cpu_experts(model, wrap: bool) -> None:
    for mod in model.modules():
        ex = getattr(mod, "experts", None)
        if wrap and isinstance(ex, nn.Module) and not isinstance(ex, _TorchCPUExperts):
            mod.experts = _TorchCPUExperts(ex)
        elif not wrap and isinstance(ex, _TorchCPUExperts):
            mod.experts = ex.inner


def gen_time(model, ids, new_tokens: int) -> float:
    import ktinject

    _sync(ids.device)
    t0 = time.perf_counter()
    ktinject.generate(model, ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    _sync(ids.device)
    return time.perf_counter() - t0


def ktinject_decode(model, prompt, new_tokens: int, graphs: bool, rounds: int = 3, **runner_kwargs) -> dict:
    """Seconds per decode token through ktinject.generate (prefill subtracted), graphs on or off: the median over
    ``rounds`` of a generate of new_tokens + 1 tokens minus one of 1 token, timed in turns (one pair alone could come
    out negative where the prefill's time moves more than the decode's: a busy host, few tokens). No streamer: one
    would copy every step's token to the host, which the graph path's deferred stop checks avoid."""
    from ktinject.decode.generate import get_runner

    runner = get_runner(model, use_graphs=graphs, prefill_chunk=2048, **runner_kwargs)
    gen_time(model, prompt, 3)  # warm-up: caches, pinned buffers, graph capture
    diffs = []
    for _ in range(rounds):
        t1 = gen_time(model, prompt, 1)
        diffs.append(gen_time(model, prompt, new_tokens + 1) - t1)
    s = statistics.median(diffs)
    if s <= 0:
        raise RuntimeError(f"ktinject_decode: {new_tokens} decode tokens took no measurable time over the prefill's "
                           f"noise (differences {', '.join(f'{d * 1e3:.1f}' for d in diffs)} ms): time more tokens")
    return {"s_per_token": s / new_tokens, "runner": runner}


def _decode_graph(runner, batch: int):
    """The runner's captured decode graph for ``batch`` rows, or None."""
    return next((g for k, g in runner.graphs.items() if k[0] == batch and g is not None), None)


def replay_iters(runner, prompt_len: int, iters: int) -> int:
    """The timed replays ``graph_replay`` runs for ``iters`` (as many as the static cache has room for; it runs one
    more untimed first)."""
    return max(1, min(iters, runner.max_cache_len - prompt_len - 1))


def reset_lengths(runner, batch: int, prompt_len: int) -> None:
    """The runner's cache for ``batch`` back to ``prompt_len`` tokens a row in every layer (replays then decode
    from there: each replay advances them)."""
    for layer in runner.caches[batch].layers:
        layer.cumulative_length.fill_(prompt_len)


def graph_replay(runner, batch: int, prompt_len: int, iters: int, entry=None) -> float | None:
    """Seconds per bare replay of the decode graph of ``batch`` (no HF loop; or of ``entry``, one of the runner's
    graphs), or None without one."""
    entry = entry or _decode_graph(runner, batch)
    if entry is None:
        return None
    iters = replay_iters(runner, prompt_len, iters)
    reset_lengths(runner, batch, prompt_len)
    entry.graph.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reset_lengths(runner, batch, prompt_len)
    t0.record()
    for _ in range(iters):
        entry.graph.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / 1e3 / iters


def paired_overhead(model, runner, batch: int, prompt_len: int, pairs: int = 9, replays: int = 4):
    """(median, [ratios]) of bare replay time / CPU experts alone, each ratio from one CPU pass and ``replays``
    replays taken back to back, so that the shared host's drifting load cancels in each pair."""
    entry = _decode_graph(runner, batch)
    if entry is None:
        return None, []
    ratios = []
    for _ in range(pairs):
        cpu = cpu_expert_time(model, batch, passes=1)[0]
        for pool in entry.pools:
            pool.wake()
        ratios.append(graph_replay(runner, batch, prompt_len, replays) / cpu)
    return statistics.median(ratios), ratios


def profile_replay(model, runner, batch, prompt_len, iters: int = 3) -> str:
    """Kernel table of ``iters`` muted graph replays (CUPTI sees the kernels inside the graph)."""
    from torch.profiler import ProfilerActivity, profile

    with muted(model):
        graph_replay(runner, batch, prompt_len, 2)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph_replay(runner, batch, prompt_len, iters)
    avg = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            return avg.table(sort_by=key, row_limit=25, max_name_column_width=70)
        except (AttributeError, KeyError, ValueError):
            continue
    return avg.table(row_limit=25)


def hybrid_blocks(model) -> list:
    from ktinject.operators.moe import HybridMoE

    return [m for m in model.modules() if isinstance(m, HybridMoE)]


def fresh_ids(gen: torch.Generator, num_experts: int, k: int, batch: int, avoid: set) -> torch.Tensor:
    """ids [batch, k]: k distinct random experts per token, none of ``avoid`` while at least k others remain."""
    others = [e for e in range(num_experts) if e not in avoid]
    choice = torch.tensor(others if len(others) >= k else range(num_experts), dtype=torch.int64)
    return torch.stack([choice[torch.randperm(len(choice), generator=gen)[:k]] for _ in range(batch)])


def profile_line(prof: dict) -> str:
    """A native pool's profile (``Pool.profile()``) in one line: a forward's time, its serial part (routing,
    one-item steps, hand-offs) and of it the head before the first phase, where split (expert deferral) when its
    immediate part was done, and each parallel phase's wall time, chunks and how busy the threads were."""
    phases = "; ".join(f"phase {i}: {p['wall_us']:.1f} us, {p['chunks']:.0f} chunks, threads busy "
                       f"{100 * p['use']:.0f}%" for i, p in enumerate(prof["phases"]))
    top = (f", the immediate part done at {prof['top_us']:.1f} us ({prof['top_jobs']} forwards)"
           if prof.get("top_jobs") else "")
    head = f" (head {prof['head_us']:.1f})" if "head_us" in prof else ""
    return (f"{prof['jobs']} forwards, {prof['job_us']:.1f} us each{top}, serial {prof['serial_us']:.1f} us{head}"
            + (f"; {phases}" if phases else ""))


def cpu_expert_time(model, batch: int, passes: int = 5, profile: list | None = None) -> list[float]:
    """Seconds of native routed-expert work per decode step, cache-cold: whole passes over every layer in order,
    each layer with B random tokens routed to fresh experts (none of its previous pass's where possible), one
    synchronous forward per layer; the times of ``passes`` passes after a warm-up pass. ``profile``: a list that
    gets the default pool's profile of the timed passes (``Pool.profile()``; they run on that pool)."""
    import contextlib

    from ktinject.native import default_pool

    gen = torch.Generator().manual_seed(1)
    blocks = hybrid_blocks(model)
    k = model.config.num_experts_per_tok
    xs = [torch.randn(batch, b.native_experts.hidden, generator=gen).to(torch.bfloat16) for b in blocks]
    w = torch.full((batch, k), 1.0 / k)
    prev: list[set] = [set() for _ in blocks]

    def one_pass() -> float:
        nonlocal prev
        ids = [fresh_ids(gen, b.native_experts.num_experts, k, batch, prev[i]) for i, b in enumerate(blocks)]
        prev = [set(i.flatten().tolist()) for i in ids]
        t0 = time.perf_counter()
        for blk, x, i in zip(blocks, xs, ids):
            blk.native_experts.forward(x, i, w, skip=blk.skip)
        return time.perf_counter() - t0

    one_pass()  # warm-up: first-touch of outputs, pool wake-up
    with default_pool().profiling() if profile is not None else contextlib.nullcontext() as prof:
        times = [one_pass() for _ in range(passes)]
    if profile is not None:
        profile.append(prof)
    return times


@contextlib.contextmanager
def muted(model):
    """Every routed expert of ``model`` skipped (the native skip masks all 1) inside, the masks restored after: the
    CPU tasks still run and hand off, computing nothing."""
    blocks = hybrid_blocks(model)
    saved = [b.skip.clone() for b in blocks]
    for b in blocks:
        b.skip.fill_(1)
    try:
        yield
    finally:
        for b, s in zip(blocks, saved):
            b.skip.copy_(s)


def muted_replay(model, runner, batch, prompt_len, iters, entry=None) -> float | None:
    """Graph replay time with every routed expert skipped (GPU work + handshakes, no CPU expert work)."""
    with muted(model):
        return graph_replay(runner, batch, prompt_len, iters, entry)
