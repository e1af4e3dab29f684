"""Hot experts: decode tok/s with GPU-resident experts by budget and strategy, next to the bound 1/(1-h).

``python -m ktinject.bench hot [--layers N] [--budgets 0,8,16] [--strategies none,uniform,frequency,dynamic] ...``

The decode benchmark's model (Qwen3-30B-A3B shapes, random bf16 weights built in memory, ``bench/decode.py``) is
built and injected once; its routers are then skewed so that expert popularity follows a Zipf law: in layer l the
r-th most popular expert is picked by a share min(1, c / r^s_l) of the tokens (c such that the shares sum to k; the
head is capped at 1 because a token picks k distinct experts), s_l spread evenly around --zipf (1.0) by
+-(--zipf-spread), popularity order shuffled per layer. The skew is a per-expert logit offset added before the
softmax (a wrapper around the HF router), solved by simulation for logits ~ N(0, 1.5^2) (router weights of std
1.5/sqrt(H) on unit-RMS hidden states); the output states it and the exponent measured from the counts.

Then, per configuration (placement changed in place: banks dropped and rebuilt, graphs re-captured; nothing else):
  budget 0 (everything routed on the CPU: the baseline), then for each budget > 0 each strategy:
    uniform    the same number of experts in every layer, each layer's most counted ones
    frequency  one ranking across layers by count
    dynamic    no statistics: starts with arbitrary experts (uniform counts) and re-places every --every tokens
               from recent counts while decoding, at most --moves-per-step moves started per token (Rebalancer);
               two rows: "dynamic start-up", the tokens decoded from the arbitrary start until a 4-period chunk
               starts at most 2% of the slots' worth of moves with none left under way (or --dynamic-warmup
               tokens), then "dynamic", the timed tokens after it (moves may go on: counted); both rows split the
               time per token by whether moves were under way (queued, loading or copying) during that step
  statistics for uniform/frequency come from a calibration run (--calib-tokens sampled tokens, another prompt);
  dynamic learns from the timed prompt's own earlier continuations (other sampling seeds) during its start-up.
Decode is sampled (temperature 1, fixed seeds) so that tokens, hence routing, vary as in real use. Time per token
comes from a timestamp per generated token (a stopping criterion), prefill excluded.
Columns: tok/s, speed-up over budget 0, h = share of routed (token, slot) pairs served by the GPU banks during the
measured tokens (counted on the device), and the bound 1/(1-h) (the speed-up if CPU expert time fell with the CPU's
share of the work and nothing else cost anything). ``--tiny`` runs the flow on the tiny test model (CPU too).
Legend: L layers, E experts, k experts per token, h GPU share of routed pairs.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

import ktinject
from ktinject import native
from ktinject.bench.model import build_model, build_tiny, set_generation_defaults
from ktinject.decode.generate import get_runner
from ktinject.gpu_experts.hot import placement
from ktinject.gpu_experts.hot import stats as expert_stats
from ktinject.gpu_experts.hot.bank import HotExperts
from ktinject.gpu_experts.hot.settings import parse_bytes
from ktinject.gpu_experts.hot.settings import human_bytes


# ---- skewed routing -----------------------------------------------------------------------------------------
class SkewedRouter(nn.Module):
    """Qwen3's top-k router with a per-expert logit offset ``bias`` [E] (float32) added before the softmax."""

    def __init__(self, inner: nn.Module, bias: torch.Tensor):
        super().__init__()
        self.inner = inner
        self.register_buffer("bias", bias.float().to(inner.weight.device))
        self.top_k = inner.top_k
        self.norm_topk_prob = getattr(inner, "norm_topk_prob", True)

    def forward(self, x: torch.Tensor):
        x = x.reshape(-1, self.inner.weight.shape[1])  # [T, H]
        logits = F.linear(x, self.inner.weight)  # [T, E]
        probs = torch.softmax(logits.float() + self.bias, dim=-1)
        w, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return logits, w.to(logits.dtype), ids


def zipf_shares(E: int, k: int, s: float) -> torch.Tensor:
    """Per-token pick probability of the r-th most popular expert (r = 1..E): min(1, c / r^s), summing to k."""
    r = torch.arange(1, E + 1, dtype=torch.float64)
    lo, hi = 0.0, float(E) ** s * k
    for _ in range(100):
        c = (lo + hi) / 2
        if float((c / r ** s).clamp(max=1).sum()) < k:
            lo = c
        else:
            hi = c
    return (hi / r ** s).clamp(max=1)


def solve_biases(q: torch.Tensor, k: int, sigma: float, device, tokens: int = 16384, iters: int = 80,
                 seed: int = 0) -> torch.Tensor:
    """Logit offsets b [E] such that top-k of (N(0, sigma^2) + b) picks expert e with probability ~q[e]."""
    E = q.numel()
    g = torch.Generator(device=device).manual_seed(seed)
    z = torch.randn(tokens, E, generator=g, device=device) * sigma
    target = q.to(device, torch.float32).clamp(1e-6, 1 - 1e-4)
    b = torch.log(target)
    for _ in range(iters):
        ids = torch.topk(z + b, k, dim=-1).indices
        freq = torch.bincount(ids.flatten(), minlength=E).float() / tokens
        b = b + 0.7 * (torch.log(target) - torch.log(freq.clamp_min(0.5 / tokens)))
        b = b - b.mean()
    return b.cpu()


def skew_routing(model, zipf: float, spread: float, sigma: float = 1.5, seed: int = 0) -> list[float]:
    """Wrap every injected block's router with Zipf logit offsets; returns the exponent of each layer."""
    blocks = expert_stats.hybrid_blocks(model)
    L = len(blocks)
    exps = [zipf + (spread * (2 * i / (L - 1) - 1) if L > 1 else 0.0) for i in range(L)]
    gen = torch.Generator().manual_seed(seed)
    device = blocks[0][1].device
    for (_, b), s in zip(blocks, exps):
        k = b.gate.top_k
        by_rank = solve_biases(zipf_shares(b.num_experts, k, s), k, sigma, device)
        perm = torch.randperm(b.num_experts, generator=gen)  # perm[r] = expert of popularity rank r
        bias = torch.empty_like(by_rank)
        bias[perm] = by_rank
        b.gate = SkewedRouter(b.gate, bias)
    return exps


def fitted_exponent(counts: torch.Tensor, k: int) -> tuple[float, float, float]:
    """(mean, min, max) over layers of the slope of log(count) against log(rank) for ranks k+1..E/2."""
    slopes = []
    E = counts.shape[1]
    r = torch.arange(k + 1, max(k + 3, E // 2) + 1, dtype=torch.float64)
    for row in counts.double():
        c = row.sort(descending=True).values[k:k + r.numel()].clamp_min(0.5)
        x, y = r.log(), c.log()
        slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
        slopes.append(-slope)
    return sum(slopes) / len(slopes), min(slopes), max(slopes)


# ---- measuring ----------------------------------------------------------------------------------------------
def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TokenClock:
    """Stopping criterion (it never stops anything): a timestamp per generated token, and whether re-placement moves
    were under way during that token's step (queued, loading or copying: ``Rebalancer.pending`` before its step for
    this token, which comes after this criterion). Per-token times are host timestamps: one token may shift into
    the next (HF syncs once per token), sums over many tokens are exact."""

    def __init__(self, reb=None):
        self.reb = reb
        self.times: list[float] = []
        self.busy: list[bool] = []

    def __call__(self, input_ids, scores=None, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        self.busy.append(self.reb is not None and self.reb.pending() > 0)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def intervals(self) -> list[tuple[float, bool]]:
        """(seconds, moves under way) of each decode step after the first token (prefill excluded)."""
        return [(b - a, busy) for a, b, busy in zip(self.times, self.times[1:], self.busy[1:])]


def _generate(model, ids, n: int, seed: int, clock: TokenClock | None = None) -> float:
    torch.manual_seed(seed)
    _sync(ids.device)
    t0 = time.perf_counter()
    ktinject.generate(model, ids, max_new_tokens=n, min_new_tokens=n, do_sample=True, temperature=1.0, top_k=0,
                      top_p=1.0, stopping_criteria=None if clock is None else [clock])
    _sync(ids.device)
    return time.perf_counter() - t0


def _summary(steps: list[tuple[float, bool]], h: float, moves: int) -> dict:
    """Seconds per decode token overall, while moves were under way and while settled; counts; h; moves started."""
    def mean(xs):
        return sum(xs) / len(xs) if xs else float("nan")

    busy = [t for t, b in steps if b]
    idle = [t for t, b in steps if not b]
    return {"s": mean([t for t, _ in steps]), "n": len(steps), "s_busy": mean(busy), "n_busy": len(busy),
            "s_idle": mean(idle), "n_idle": len(idle), "h": h, "moves": moves}


def _timed(model, prompt, tokens: int, seeds) -> dict:
    """Decode ``tokens`` tokens per seed, timing each step (prefill excluded); h over them (device counters)."""
    reb = placement.rebalancer(model)
    placement.reset_served(model)
    steps, started = [], reb.started if reb is not None else 0
    for seed in seeds:
        clock = TokenClock(reb)
        _generate(model, prompt, tokens + 1, seed, clock)
        steps += clock.intervals()
    hits, pairs = placement.served_share(model)
    moves = (reb.started - started) if reb is not None else 0
    return _summary(steps, hits / pairs if pairs else 0.0, moves)


def decode_rate(model, prompt, tokens: int, seed: int = 0) -> dict:
    """After a capture run: seconds per decode token over ``tokens`` timed steps, h, moves started meanwhile."""
    _generate(model, prompt, 3, seed)  # capture, buffers
    return _timed(model, prompt, tokens, [seed + 3])


def dynamic_startup(model, prompt, limit: int, seed: int = 0) -> dict:
    """Re-placement from its initial (arbitrary) placement: decode chunks of 4 periods until a chunk starts no more
    than 2% of the slots' worth of moves and none is left under way, or ``limit`` tokens; the same summary as the
    timed run, over all of it (this is the cost of getting there, not steady state)."""
    reb = placement.rebalancer(model)
    slots = sum(b.hot.C for b in reb.blocks)
    steps, started, done = [], reb.started, 0
    placement.reset_served(model)
    while done < limit:
        n = min(4 * reb.every, limit - done)
        before = reb.started
        clock = TokenClock(reb)
        _generate(model, prompt, n, seed + 1 + done, clock)
        steps += clock.intervals()
        done += n
        if reb.started - before <= 0.02 * slots and reb.pending() == 0:
            break
    hits, pairs = placement.served_share(model)
    r = _summary(steps, hits / pairs if pairs else 0.0, reb.started - started)
    r["tokens"] = done
    return r


def _parse_budget(text: str, total: int) -> int:
    text = text.strip()
    if text.endswith("%"):
        return int(total * float(text[:-1]) / 100)
    try:
        return int(float(text) * 2**30)  # plain numbers are GiB
    except ValueError:
        return parse_bytes(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ktinject.bench hot", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=48, help="decoder layers (48 = the real model)")
    p.add_argument("--budgets", default=None, help="GPU expert budgets: GiB numbers, sizes (512MiB) or percent of "
                   "all routed expert bytes (default 0,8,16; --tiny: 0,25%%,50%%)")
    p.add_argument("--strategies", default="none,uniform,frequency,dynamic")
    p.add_argument("--tokens", type=int, default=48, help="decode tokens timed per configuration")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--calib-tokens", type=int, default=128, help="sampled tokens of the calibration run")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of expert popularity (mean over layers)")
    p.add_argument("--zipf-spread", type=float, default=0.2, help="exponents range over zipf +- spread by layer")
    p.add_argument("--every", type=int, default=16, help="dynamic: tokens between re-placements")
    p.add_argument("--moves", type=int, default=256, help="dynamic: moves planned per re-placement at most")
    p.add_argument("--moves-per-step", type=int, default=4, help="dynamic: moves started per generated token at most")
    p.add_argument("--transfer", default="auto", choices=("auto", "packed", "staged", "host"),
                   help="dynamic: how moves get their bytes (Rebalancer transfer)")
    p.add_argument("--dynamic-warmup", type=int, default=384,
                   help="dynamic: at most this many tokens decoded before timing (less once moves settle)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (native pool and torch)")
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly (graphs are on by default on CUDA)")
    p.add_argument("--tiny", action="store_true", help="the tiny qwen3_moe test model (runs on a CPU)")
    return p


def _row(rows: list, row: tuple) -> None:
    rows.append(row)
    print("# " + " | ".join(row), flush=True)


def run(args) -> list[tuple]:

    if args.threads:
        native.set_default_threads(args.threads)
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model = build_tiny(device) if args.tiny else build_model(args.layers, device)
    cfg = model.config
    set_generation_defaults(model)
    ktinject.inject(model, gpu=str(device), gpu_experts_budget=0)  # each row places its own budget
    blocks = expert_stats.hybrid_blocks(model)
    L, E, k = len(blocks), blocks[0][1].num_experts, cfg.num_experts_per_tok
    print(f"# {'tiny qwen3_moe' if args.tiny else 'Qwen3-30B-A3B shapes'}: {cfg.num_hidden_layers} layers ({L} MoE), "
          f"H={cfg.hidden_size}, E={E} top-{k}, I={cfg.moe_intermediate_size}, bf16; device "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; native {native.isa()}, "
          f"{native.default_pool().threads} threads; built + injected in {time.perf_counter() - t0:.1f} s",
          flush=True)
    exps = skew_routing(model, args.zipf, args.zipf_spread)
    print(f"# routing: Zipf expert popularity, exponent s = {args.zipf:g} on average (per layer {min(exps):.2f}.."
          f"{max(exps):.2f}): the r-th most popular expert of a layer is picked by min(1, c/r^s) of the tokens "
          f"(sum k = {k}; top {sum(1 for q in zipf_shares(E, k, args.zipf) if q >= 0.999)} capped at every token), "
          f"popularity order shuffled per layer; logit offsets solved for router logits ~ N(0, 1.5^2)", flush=True)
    get_runner(model, use_graphs=not args.no_graphs, prefill_chunk=2048)

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, cfg.vocab_size, (1, args.prompt), generator=gen).to(device)
    calib_prompt = torch.randint(3, cfg.vocab_size, (1, args.prompt), generator=gen).to(device)
    expert_stats.reset_stats(model)
    t0 = time.perf_counter()
    _generate(model, calib_prompt, args.calib_tokens, seed=100)
    stats = expert_stats.read_stats(model)
    s_mean, s_min, s_max = fitted_exponent(stats.counts, k)
    print(f"# calibration: {args.calib_tokens} sampled tokens, {stats.total} routed pairs in "
          f"{time.perf_counter() - t0:.1f} s; measured popularity exponent (ranks {k + 1}..{E // 2}) "
          f"{s_mean:.2f} (layers {s_min:.2f}..{s_max:.2f})", flush=True)

    eb = HotExperts.expert_nbytes(blocks[0][1].spec, torch.bfloat16)
    all_bytes = L * E * eb
    host = sum(b.native_experts.nbytes for _, b in blocks)
    default = "0,25%,50%" if args.tiny else "0,8,16"
    budgets = [_parse_budget(x, all_bytes) for x in (args.budgets or default).split(",") if x.strip()]
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    print(f"# routed experts: {human_bytes(all_bytes)} in bf16 ({human_bytes(eb)} each); host copies (native): "
          f"{human_bytes(host)}, kept whatever the placement", flush=True)

    rows: list[tuple] = []
    base = None
    for budget in budgets:
        for strategy in (["none"] if budget == 0 else [s for s in strategies if s != "none"]):
            placement.place(model, 0, "none")  # free the previous banks first, so the memory delta is this one's
            mem0 = torch.cuda.memory_allocated() if device.type == "cuda" else 0
            t0 = time.perf_counter()
            extra = {}
            if strategy == "dynamic":
                extra = {"rebalance_every": args.every, "max_moves": args.moves,
                         "moves_per_step": args.moves_per_step, "transfer": args.transfer}
                expert_stats.reset_stats(model)  # it learns from nothing: no calibration, no earlier counts
            p = placement.place(model, budget, strategy, None if strategy == "dynamic" else stats, **extra)
            t_place = time.perf_counter() - t0
            mem = (torch.cuda.memory_allocated() - mem0) if device.type == "cuda" else p.nbytes
            note = (f"{p.resident} experts ({min(map(len, p.experts))}..{max(map(len, p.experts))}/layer), bank "
                    f"{human_bytes(p.nbytes)} (GPU +{human_bytes(mem)}), placed in {t_place:.1f} s")
            if p.expected_share is not None:
                note += f", calibration h {p.expected_share:.2f}"
            reb = p.rebalancer
            if reb is None:
                r = decode_rate(model, prompt, args.tokens)
                base = _result(rows, base, budget, strategy, r, note)
                continue
            _generate(model, prompt, 3, 0)  # capture, buffers (re-placement runs from here on)
            w = dynamic_startup(model, prompt, args.dynamic_warmup)
            kinds = ",".join(sorted(set(reb.kinds)))
            _result(rows, base, budget, "dynamic start-up", w,
                    f"{w['tokens']} tokens from the initial (arbitrary) placement: {w['moves']} moves ({kinds}, at "
                    f"most {reb.moves_per_step}/token), {_split(w)}")
            r = _timed(model, prompt, args.tokens, [3])
            note += (f"; timed {r['n']} tokens after the start-up: {r['moves']} moves started, {_split(r)}; "
                     f"{reb.moved} moves in {reb.periods} periods in all")
            base = _result(rows, base, budget, strategy, r, note)
    placement.place(model, 0, "none")
    get_runner(model).close()
    return rows


def _split(r: dict) -> str:
    ms = lambda x: "n/a" if math.isnan(x) else f"{1e3 * x:.1f} ms"  # noqa: E731
    return (f"per token {ms(r['s_busy'])} with moves under way ({r['n_busy']} tokens), {ms(r['s_idle'])} "
            f"without ({r['n_idle']})")


def _result(rows: list, base: float | None, budget: int, strategy: str, r: dict, note: str) -> float | None:
    """Add a table row for measurement ``r``; returns the baseline rate (budget 0) once known."""
    rate = 1 / r["s"]
    if base is None and budget == 0:
        base = rate
    speedup = rate / base if base else float("nan")
    bound = 1 / (1 - r["h"]) if r["h"] < 1 else math.inf
    _row(rows, (human_bytes(budget), strategy, f"{rate:.1f}", f"{speedup:.2f}x", f"{r['h']:.3f}", f"{bound:.2f}x",
                note))
    return base


def print_table(rows, args) -> None:
    head = ("budget", "strategy", "tok/s", "speed-up", "h", "bound 1/(1-h)", "note")
    w = [max(len(r[i]) for r in rows + [head]) for i in range(6)]
    print("\n| " + " | ".join(h.ljust(w[i]) if i < 6 else h for i, h in enumerate(head)) + " |")
    print("|" + "|".join("-" * (x + 2) for x in w) + "|------|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w[i]) if i < 6 else c for i, c in enumerate(r)) + " |")
    print(f"\n(batch 1, prompt {args.prompt}, {args.tokens} sampled decode tokens timed, graphs "
          f"{'off' if args.no_graphs else 'on where CUDA'}, layers {'tiny' if args.tiny else args.layers}; speed-up "
          f"relative to budget 0; CPU copies of GPU-resident experts are kept; dynamic re-places every {args.every} "
          f"tokens, at most {args.moves_per_step} moves started per token, transfer {args.transfer}: its start-up "
          f"row is the cost of getting there from an arbitrary placement, its other row the timed tokens after)",
          flush=True)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows = run(args)
    print_table(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
