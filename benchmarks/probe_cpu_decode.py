"""Where a decode step's CPU expert time goes (issues 18 and 21): native forwards of L layers of Qwen3-30B-A3B-shaped
experts, cache-cold (each pass routes every layer to experts its previous pass did not use), timed per pass, at
batch 1, 2, 4, 8, for each quant and thread count; a fit of the time per layer against the bytes read per layer
(time = fixed + bytes / bandwidth) says whether a step is bound by memory bandwidth or by a per-layer fixed cost.
Beside it: the per-forward cost with every expert masked (Python + the pool's hand-off, no weights read) and the
read bandwidth of the run's best read loop (bench.memory).

    python benchmarks/probe_cpu_decode.py [--layers 16] [--quant int4,int8] [--threads 15,8] [--batch 1,2,4,8]

No GPU needed; on the GPU machine it shows that host. Legend: L layers, B batch (tokens of a step), k experts per
token, E experts.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

H, I, E, K = 2048, 768, 128, 8


def build(layers: int, quant: str, e: int):
    """L layers of E experts: one layer quantized from random weights, its packed bytes copied into the others
    (distinct memory, same values: the kernels' speed does not depend on them)."""
    from ktinject.native import Experts

    gen = torch.Generator().manual_seed(0)
    gu = (torch.randn(e, 2 * I, H, generator=gen) * 0.02).to(torch.bfloat16)
    dn = (torch.randn(e, H, I, generator=gen) * 0.02).to(torch.bfloat16)
    first = Experts.from_hf(gu, dn, quant=quant)
    packed = first.export()
    out = [first]
    for _ in range(layers - 1):
        ex = Experts(e, H, I, quant=quant)
        ex.load_packed(packed)
        out.append(ex)
    return out


class Passes:
    """Decode passes over the layers, one timed pass a call; each routes every layer to experts its previous pass
    did not use (bench.timing.fresh_ids: cache-cold), inputs made once. ``hot``: each layer's forward runs twice
    and the second is timed (its experts come from the caches)."""

    def __init__(self, layers, pool, batch: int, e: int, skip=None, seed: int | None = None):
        self.layers, self.pool, self.e, self.skip = layers, pool, e, skip
        self.gen = torch.Generator().manual_seed(batch if seed is None else seed)
        self.xs = [torch.randn(batch, H, generator=self.gen).to(torch.bfloat16) for _ in layers]
        self.w = torch.full((batch, K), 1.0 / K)
        self.outs = [torch.empty(batch, H, dtype=torch.bfloat16) for _ in layers]
        self.prev = [set() for _ in layers]

    def seconds(self, hot: bool = False) -> float:
        from ktinject.bench.timing import fresh_ids

        batch = self.xs[0].shape[0]
        ids = [fresh_ids(self.gen, self.e, K, batch, self.prev[i]) for i in range(len(self.layers))]
        self.prev = [set(i.flatten().tolist()) for i in ids]
        t = 0.0
        for ex, x, i, o in zip(self.layers, self.xs, ids, self.outs):
            if hot:
                ex.forward(x, i, self.w, skip=self.skip, out=o, pool=self.pool)
            t0 = time.perf_counter()
            ex.forward(x, i, self.w, skip=self.skip, out=o, pool=self.pool)
            t += time.perf_counter() - t0
        return t


def passes(layers, pool, batch: int, n: int, e: int, skip=None, hot: bool = False) -> list[float]:
    """n timed passes after an untimed one (Passes)."""
    p = Passes(layers, pool, batch, e, skip)
    return [p.seconds(hot) for _ in range(n + 1)][1:]


def show_profile(prof: dict, label: str) -> None:
    from ktinject.bench.timing import profile_line

    print(f"#     {label} profile: {profile_line(prof)}", flush=True)


def graph_decode(layers: int, quant: str, tokens: int, batch: int) -> None:
    """The pool's profile inside graph decode (generate, CUDA graphs) of an L-layer model: what a layer's CPU job
    costs where no Python runs between jobs. Three ways on the same injected model: bare replays of one input
    (every replay routes to the same experts: partly cache-hot), replays with fresh random token ids written into
    the graph's input before each (cache-cold, as in generate), and the same layers' native forwards driven from
    Python (bench.timing.cpu_expert_time, cache-cold)."""
    import ktinject
    from ktinject.bench.decode import ktinject_decode
    from ktinject.bench.model import build_model, set_generation_defaults
    from ktinject.bench.timing import _decode_graph, cpu_expert_time, graph_replay, muted_replay, reset_lengths
    from ktinject.native import default_pool

    dev = torch.device("cuda")
    model = build_model(layers, dev)
    set_generation_defaults(model)
    ktinject.inject(model, gpu="cuda", quant=quant, gpu_experts_budget=0)
    print(f"# graph {quant} {layers} layers batch {batch}: {_huge()}", flush=True)
    prompt = torch.randint(3, model.config.vocab_size, (batch, 32), device=dev)
    r = ktinject_decode(model, prompt, 8, graphs=True)  # capture, warm-up
    pool = default_pool()
    entry = _decode_graph(r["runner"], batch)
    ids = entry.inputs["input_ids"]
    fresh = torch.randint(3, model.config.vocab_size, (tokens + 1,) + tuple(ids.shape), device=dev)
    for cache_len in (64, 512):
        for _ in range(2):
            with pool.profiling() as prof:
                s = graph_replay(r["runner"], batch, cache_len, tokens)  # decode jobs only (no prefill)
            muted = muted_replay(model, r["runner"], batch, cache_len, tokens)
            print(f"# graph replay {quant}, {layers} layers, batch {batch}, cache {cache_len}: {1e3 * s:.2f} ms a step "
                  f"({1e3 * s / layers:.3f} ms a layer); muted (GPU part + handshakes) {1e3 * muted:.2f} ms",
                  flush=True)
            show_profile(prof, "replay, one input")
            saved = ids.clone()
            reset_lengths(r["runner"], batch, cache_len)
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for p in entry.pools:
                p.wake()
            with pool.profiling() as prof:
                t0.record()
                for i in range(tokens):
                    ids.copy_(fresh[i])  # new routing each step: cache-cold like generate
                    entry.graph.replay()
                t1.record()
                torch.cuda.synchronize()
            ids.copy_(saved)
            print(f"# graph replay, fresh ids each step: {t0.elapsed_time(t1) / tokens:.2f} ms a step", flush=True)
            show_profile(prof, "replay, fresh ids")
            prof_py = []
            ts = cpu_expert_time(model, batch, passes=5, profile=prof_py)
            print(f"# Python-driven forwards of the same layers: {1e3 * statistics.median(ts):.2f} ms a pass", flush=True)
            show_profile(prof_py[0], "python")
    del model


def _huge() -> str:
    """This process's transparent huge pages (the experts' memory asks for them: experts.c, MADV_HUGEPAGE)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().strip()
        with open("/proc/self/smaps_rollup") as f:
            roll = {k: v.strip() for k, v in (ln.split(":", 1) for ln in f if ":" in ln)}
        return f"THP {mode}; AnonHugePages {roll.get('AnonHugePages')} of Rss {roll.get('Rss')}"
    except OSError as e:
        return f"THP unknown ({e})"


def distinct(batch: int, e: int) -> float:
    """bench.timing.distinct_experts, written here: the probe also runs against older builds (ab_stage.sh)."""
    return e * (1 - (1 - K / e) ** batch)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=E)
    ap.add_argument("--quant", default="int4,int8")
    ap.add_argument("--threads", default="15")
    ap.add_argument("--batch", default="1,2,4,8")
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--gemv", default="default", help="comma-separated: default, 0, 1 (KTINJECT_GEMV)")
    ap.add_argument("--env", default="",
                    help="NAME=v1,v2,...: each variant (of each --gemv) with the variable set to each value, in turn")
    ap.add_argument("--graph", type=int, default=0,
                    help="L > 0: only the pool's profile inside graph decode of an L-layer model (CUDA)")
    ap.add_argument("--hot", action="store_true",
                    help="also time each layer's forward right after a forward of the same experts (cache-hot)")
    args = ap.parse_args()
    if args.graph:
        for quant in args.quant.split(","):
            for b in [int(x) for x in args.batch.split(",")]:
                graph_decode(args.graph, quant, 32, b)
        return
    from ktinject.bench.memory import measure_read_bandwidth
    from ktinject.native import Pool

    for quant in args.quant.split(","):
        t0 = time.perf_counter()
        layers = build(args.layers, quant, args.experts)
        per_expert = layers[0].nbytes / args.experts
        print(f"# {quant}: {args.layers} layers x {args.experts} experts, {per_expert / 1e6:.3f} MB an expert, "
              f"built in {time.perf_counter() - t0:.0f} s; {_huge()}", flush=True)
        for nt in [int(t) for t in args.threads.split(",")]:
            pool = Pool(nt)
            mem = measure_read_bandwidth(2.0, nt)
            print(f"# threads {nt}: read bandwidth best {mem.best_gbs:.1f} GB/s", flush=True)
            skip = torch.ones(args.experts, dtype=torch.uint8)
            fixed = statistics.median(passes(layers, pool, 1, args.passes, args.experts, skip)) / args.layers
            print(f"#   every expert masked: {1e6 * fixed:.1f} us a forward (Python + hand-off)", flush=True)
            name, _, values = args.env.partition("=")
            variants = [(g, v) for g in args.gemv.split(",") for v in (values.split(",") if name else [None])]
            for gemv, value in variants:
                if gemv == "default":
                    os.environ.pop("KTINJECT_GEMV", None)
                else:
                    os.environ["KTINJECT_GEMV"] = gemv
                if name:
                    os.environ[name] = value
                    gemv = f"{gemv} {name}={value}"
                pts = []
                profiled = hasattr(pool, "profiling")  # an older build (A/B against a base commit) has none
                for b in [int(x) for x in args.batch.split(",")]:
                    with pool.profiling() if profiled else contextlib.nullcontext() as prof:
                        ts = passes(layers, pool, b, args.passes, args.experts)
                    med = statistics.median(ts) / args.layers
                    nbytes = distinct(b, args.experts) * per_expert
                    pts.append((nbytes, med))
                    print(f"#   gemv={gemv} B={b}: {1e6 * med:.1f} us a layer (runs {min(ts) / args.layers * 1e6:.0f}-"
                          f"{max(ts) / args.layers * 1e6:.0f}), {nbytes / 1e6:.1f} MB -> "
                          f"{nbytes / med / 1e9:.1f} GB/s", flush=True)
                    if profiled:
                        show_profile(prof, "cold")
                if args.hot:
                    for b in [int(x) for x in args.batch.split(",")]:
                        ts = passes(layers, pool, b, args.passes, args.experts, hot=True)
                        med = statistics.median(ts) / args.layers
                        print(f"#   gemv={gemv} B={b} cache-hot: {1e6 * med:.1f} us a layer", flush=True)
                if len(pts) >= 2:  # least squares time = a + bytes / bw
                    n = len(pts)
                    mx = sum(p[0] for p in pts) / n
                    my = sum(p[1] for p in pts) / n
                    sxx = sum((p[0] - mx) ** 2 for p in pts)
                    slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
                    a = my - slope * mx
                    print(f"#   gemv={gemv} fit: fixed {1e6 * a:.1f} us a layer + bytes at {1e-9 / slope:.1f} GB/s",
                          flush=True)
            os.environ.pop("KTINJECT_GEMV", None)
            pool.close()
        del layers


if __name__ == "__main__":
    main()
