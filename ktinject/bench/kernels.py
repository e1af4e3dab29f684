"""Expert kernels: decode GB/s and prefill TFLOPS of one MoE layer, next to torch and the machine's limits.

``python -m ktinject.bench kernels [--threads N] [--quick | --full] [--isa NAME,...|all] [--quant bf16,int8,...]
[--sweep ROWS,...|off] [--backward]``

Layers (legend: T tokens, k experts per token, E experts, H hidden, I expert intermediate):
  Qwen3-30B-A3B  H 2048, I 768,  E 128, k 8
  DeepSeek-V3    H 7168, I 2048, E 256, k 8
Random bf16 weights, built in memory for E' <= E experts (a DeepSeek-V3 layer is 22.5 GB in bf16):
  decode   1 token routed to k of the E' experts; successive tokens rotate over E'/k disjoint expert sets, so the
           weights read per token (k x gate+up+down in the stored format) are never cache-resident.
           Figure: effective GB/s = stored bytes of the k experts / time of one forward.
  prefill  T' = 4096 * E'/E tokens with random top-k routing over E' experts: the same rows per expert (4096 k / E)
           as 4096 tokens over the real E. Figure: 2 * T' * k * 3 * H * I / time, in TFLOPS.
  sweep    rows per expert 1..64 on the Qwen3 layer, every built expert getting exactly that many rows, ISA avx512
           (few-token path) against amx (many-token path) where the CPU has AMX: the measured crossover next to the
           dispatcher's thresholds (see ktinject.bench.crossover).
  accuracy each quant against a float64 torch reference from the bf16 weights, decode (1 token) and prefill (32).
backward (--backward: instead of the tables above) the experts' backward beside their forward at 1, 16 and 256
           tokens, every quant and ISA asked for (ktinject.bench.backward).
Baseline: the same work in torch on the CPU, the transformers "eager" experts loop (bf16 weights, F.linear per
expert). Limits: memory read bandwidth over a buffer of >= 32x the LLC, one pinned thread per core, the best of
several native read-loop variants and a torch int64 sum, each the median of its passes (ktinject.bench.memory), for
decode; a dense bf16 torch GEMM (oneDNN; AMX where the CPU has it) for prefill, a practical reference rather than a
bound. Times: time.perf_counter, warm-up, median. Decode's "of limit" divides by the best native variant timed in
alternation with the decode calls (median of as many passes): on a shared host the load from elsewhere drifts over
the minutes of a run, and a limit taken at the start compares a calm moment with a busy one.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ktinject.bench import crossover
from ktinject.bench.memory import ReadLoop, measure_read_bandwidth
from ktinject.cli.info import cpu_model


@dataclass(frozen=True)
class Layer:
    name: str
    hidden: int        # H
    intermediate: int  # I
    experts: int       # E
    top_k: int         # k
    built_full: int    # E' experts built by a full run
    built_quick: int   # E' experts built by a quick run


LAYERS = (Layer("Qwen3-30B-A3B", 2048, 768, 128, 8, built_full=128, built_quick=32),
          Layer("DeepSeek-V3", 7168, 2048, 256, 8, built_full=32, built_quick=16))
PREFILL_TOKENS = 4096
ACCURACY_TOKENS = (1, 32)  # decode, prefill (32 rows per expert: the amx ISA's tile path)


# ---- machine ----
def _mem_total_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def dense_gemm_tflops(n: int, repeats: int) -> float:
    """A dense bf16 torch matmul [n, n] x [n, n]: the practical compute limit (oneDNN; AMX where available)."""
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    t = _median_time(lambda: torch.matmul(a, b), repeats)
    return 2.0 * n ** 3 / t / 1e12


# ---- the torch baseline: transformers' eager experts loop ----
def torch_experts(hidden, ids, weights, gate_up, down):
    """hidden [T, H] bf16, ids [T, k], weights [T, k] f32, gate_up [E', 2I, H], down [E', H, I] -> [T, H]."""
    out = torch.zeros_like(hidden)
    mask = F.one_hot(ids, num_classes=gate_up.shape[0]).permute(2, 1, 0)  # [E', k, T]
    for e in (mask.sum(dim=(-1, -2)) > 0).nonzero().flatten().tolist():
        slot, tok = torch.where(mask[e])
        g, u = F.linear(hidden[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[e]) * weights[tok, slot, None].to(hidden.dtype)
        out.index_add_(0, tok, y)
    return out


# ---- workloads ----
@dataclass
class Work:
    decode_x: torch.Tensor       # [1, H] bf16
    decode_ids: list             # per expert set: [1, k] int64
    decode_w: torch.Tensor       # [1, k] f32
    prefill_x: torch.Tensor      # [T', H] bf16
    prefill_ids: torch.Tensor    # [T', k] int64
    prefill_w: torch.Tensor      # [T', k] f32
    decode_loops: int            # passes over the sets per timed call (>= ~50 ms of work)


def make_work(layer: Layer, built: int, seed: int = 0) -> Work:
    g = torch.Generator().manual_seed(seed)
    H, k = layer.hidden, layer.top_k
    sets = built // k
    t_pre = PREFILL_TOKENS * built // layer.experts
    ids_pre = torch.rand(t_pre, built, generator=g).topk(k, dim=-1).indices
    w_pre = torch.softmax(torch.randn(t_pre, k, generator=g), dim=-1)
    return Work(decode_x=torch.randn(1, H, generator=g).to(torch.bfloat16),
                decode_ids=[torch.arange(s * k, (s + 1) * k, dtype=torch.int64).view(1, k) for s in range(sets)],
                decode_w=torch.softmax(torch.randn(1, k, generator=g), dim=-1),
                prefill_x=torch.randn(t_pre, H, generator=g).to(torch.bfloat16), prefill_ids=ids_pre,
                prefill_w=w_pre, decode_loops=1)


def forward_overhead(native, pool, quant: str, repeats: int) -> float:
    """Seconds of a one-token forward of a tiny layer (E 8, H = I = 64, k 8): the fixed cost of a forward outside
    the weight streaming (pool wake-ups, phases, barriers), which bounds decode for small layers."""
    g = torch.Generator().manual_seed(2)
    ex = native.Experts.from_hf(torch.randn(8, 128, 64, generator=g).to(torch.bfloat16),
                                torch.randn(8, 64, 64, generator=g).to(torch.bfloat16), quant=quant)
    x = torch.randn(1, 64, generator=g).to(torch.bfloat16)
    ids, w = torch.arange(8).view(1, 8), torch.full((1, 8), 0.125)
    out = torch.empty(1, 64, dtype=torch.bfloat16)

    def run():
        for _ in range(200):
            ex.forward(x, ids, w, out=out, pool=pool)
    return _median_time(run, repeats) / 200


def time_decode(forward, work: Work, repeats: int, loop: ReadLoop | None = None) -> tuple[float, float | None]:
    """(seconds per one-token forward, GB/s of `loop` alongside or None); each timed call runs every expert set
    `decode_loops` times. With a read loop, timed calls alternate with passes of it (after one warm-up each): both
    medians come from the same stretch of time, so load from elsewhere on a shared host weighs on both alike."""
    def run():
        for _ in range(work.decode_loops):
            for ids in work.decode_ids:
                forward(work.decode_x, ids, work.decode_w)
    calls = work.decode_loops * len(work.decode_ids)
    if loop is None:
        return _median_time(run, repeats) / calls, None
    run()
    loop.seconds()
    ours, limit = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        ours.append(time.perf_counter() - t0)
        limit.append(loop.gbs())
    return statistics.median(ours) / calls, statistics.median(limit)


def time_prefill(forward, work: Work, repeats: int) -> float:
    return _median_time(lambda: forward(work.prefill_x, work.prefill_ids, work.prefill_w), repeats)


# ---- accuracy ----
def reference(hidden, ids, weights, gate_up, down) -> torch.Tensor:
    """float64 experts from the original weights: hidden [T, H], ids/weights [T, k], gate_up [E, 2I, H], down [E, H,
    I] (converted one expert at a time) -> [T, H] float64."""
    x = hidden.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        g, u = (x[tok] @ gate_up[e].double().t()).chunk(2, dim=-1)
        out.index_add_(0, tok, (F.silu(g) * u) @ down[e].double().t() * weights[tok, slot, None].double())
    return out


def accuracy(native, quants, isas, pool, hidden: int = 2048, intermediate: int = 768, experts: int = 8,
             seed: int = 3) -> list[tuple]:
    """Relative errors of our forward (float32 output) against reference(): E experts, every token routed to all of
    them, T in ACCURACY_TOKENS; int4 with its default group size. -> rows (quant label, isa, [(max |y - ref| /
    max |ref|, rms(y - ref) / rms(ref)) per T])."""
    g = torch.Generator().manual_seed(seed)
    E, H, I = experts, hidden, intermediate
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.02).to(torch.bfloat16)
    down = (torch.randn(E, H, I, generator=g) * 0.02).to(torch.bfloat16)
    cases = []
    for t in ACCURACY_TOKENS:
        x = torch.randn(t, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g) for _ in range(t)])
        w = torch.softmax(torch.randn(t, E, generator=g), dim=-1)
        cases.append((x, ids, w, reference(x, ids, w, gate_up, down)))
    rows, isa0 = [], native.isa()
    try:
        for quant in quants:
            ex = native.Experts.from_hf(gate_up, down, quant=quant)
            for isa in isas:
                native.set_isa(isa)
                errs = []
                for x, ids, w, ref in cases:
                    y = ex.forward(x, ids, w, out=torch.empty(x.shape, dtype=torch.float32), pool=pool).double()
                    d = y - ref
                    errs.append((float(d.abs().max() / ref.abs().max()), float(d.norm() / ref.norm())))
                rows.append((quant if quant in ("bf16", "int8") else f"{quant} g{ex.group_size}", isa, errs))
    finally:
        native.set_isa(isa0)
    return rows


def accuracy_lines(rows, experts: int = 8, hidden: int = 2048, intermediate: int = 768) -> list[str]:
    head = ("quant", "isa") + tuple(f"{'decode' if t == 1 else 'prefill'} T {t}: max, rms" for t in ACCURACY_TOKENS)
    body = [(q, i) + tuple(f"{m:.1e}  {r:.1e}" for m, r in errs) for q, i, errs in rows]
    widths = [max(len(str(r[c])) for r in body + [head]) for c in range(len(head))]
    return ([f"accuracy against a float64 torch reference from the bf16 weights (E {experts}, H {hidden}, "
             f"I {intermediate}, every token to all {experts} experts, float32 output): max |y - ref| / max |ref|, "
             f"rms(y - ref) / rms(ref)", _fmt_row(head, widths), _fmt_row(["-" * w for w in widths], widths)]
            + [_fmt_row(r, widths) for r in body])


# ---- report ----
def _fmt_row(cols, widths) -> str:
    return "  ".join(str(c).ljust(w) for c, w in zip(cols, widths)).rstrip()


def _parse_list(text: str, allowed, what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad:
        raise SystemExit(f"--{what}: unknown {', '.join(bad)} (expected {', '.join(allowed)})")
    return items


def _parser():
    ap = argparse.ArgumentParser(prog="python -m ktinject.bench kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="threads for ours and torch (default: native.default_threads())")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="quick", action="store_true", default=None,
                      help="fewer experts built, smaller limit measurements (default when RAM < 64 GB or < 8 CPUs)")
    mode.add_argument("--full", dest="quick", action="store_false", help="full sizes (~6 GB of weights at most)")
    ap.add_argument("--isa", default=None, help="our ISA(s): a name, a comma list or 'all' (default: the current one)")
    ap.add_argument("--quant", default=None, help="comma list of quants (default: all the native module has)")
    ap.add_argument("--layers", default=",".join(l.name for l in LAYERS), help="comma list of layer names")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per figure (median; default 5, quick 3)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch baseline")
    rows_full, rows_quick = (",".join(map(str, r)) for r in (crossover.ROWS_FULL, crossover.ROWS_QUICK))
    ap.add_argument("--sweep", default=None, help="rows per expert of the crossover sweep, a comma list, or 'off' "
                                                  f"(default: {rows_full}; quick: {rows_quick})")
    ap.add_argument("--backward", action="store_true",
                    help="time the experts' backward beside their forward (1, 16, 256 tokens) instead of the tables")
    return ap


def _print_table(head, rows) -> None:
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    print()
    print(_fmt_row(head, widths))
    print(_fmt_row(["-" * w for w in widths], widths))
    for r in rows:
        print(_fmt_row(r, widths))


def _measure_layer(native, layer, built, quants, isas, threads, repeats, bw, loop, sweep_rows, sweep_isas,
                   no_torch):
    """One layer: ({(quant, isa): (GB/s, decode s, TFLOPS, prefill s, limit GB/s alongside or None)}, torch (decode
    s, prefill s) or Nones, work, sweep points). loop: the read loop timed alongside decode (or None)."""
    H, I, k = layer.hidden, layer.intermediate, layer.top_k
    work = make_work(layer, built)
    t_pre = work.prefill_x.shape[0]
    flops = 2.0 * t_pre * k * 3 * H * I
    bf16_bytes = k * 3 * H * I * 2
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(built, 2 * I, H, generator=g) * 0.02).to(torch.bfloat16)
    down = (torch.randn(built, H, I, generator=g) * 0.02).to(torch.bfloat16)
    # decode: enough loops over the sets for >= ~50 ms per timed call at the bandwidth limit
    work.decode_loops = max(1, int(0.05 * bw * 1e9 / (bf16_bytes * len(work.decode_ids))))
    ours, points, isa0 = {}, [], native.isa()
    pool = native.Pool(threads)
    try:
        for quant in quants:
            ex = native.Experts.from_hf(gate_up, down, quant=quant)
            per_token = ex.nbytes / built * k
            out_d = torch.empty(1, H, dtype=torch.bfloat16)
            out_p = torch.empty(t_pre, H, dtype=torch.bfloat16)
            for isa in isas:
                native.set_isa(isa)
                td, lim = time_decode(lambda x, i, w: ex.forward(x, i, w, out=out_d, pool=pool), work, repeats, loop)
                tp = time_prefill(lambda x, i, w: ex.forward(x, i, w, out=out_p, pool=pool), work, repeats)
                ours[(quant, isa)] = (per_token / td / 1e9, td, flops / tp / 1e12, tp, lim)
            if sweep_rows:
                points += crossover.sweep(native, ex, quant, sweep_rows, sweep_isas, k, pool, repeats)
            ex = None  # free the packed weights before the next quant
            gc.collect()
    finally:
        native.set_isa(isa0)
        pool.close()
    tdec = tpre = None
    if not no_torch:
        time.sleep(0.2)
        with torch.inference_mode():
            tdec = time_decode(lambda x, i, w: torch_experts(x, i, w, gate_up, down), work, repeats)[0]
            tpre = time_prefill(lambda x, i, w: torch_experts(x, i, w, gate_up, down), work, repeats)
    return ours, (tdec, tpre), work, points


def _layer_rows(layer, built, work, ours, torch_s, bw, peak) -> tuple[list[tuple], str]:
    """Table rows of one layer (decode and prefill per quant x ISA) and its note."""
    H, I, k = layer.hidden, layer.intermediate, layer.top_k
    tdec, tpre = torch_s
    t_pre = work.prefill_x.shape[0]
    flops = 2.0 * t_pre * k * 3 * H * I
    bf16_bytes = k * 3 * H * I * 2
    note = (f"{layer.name}: built {built} of {layer.experts} experts; decode rotates {len(work.decode_ids)} sets of "
            f"{k} ({bf16_bytes * len(work.decode_ids) / 1e9:.2f} GB of bf16 weights); prefill {t_pre} tokens x "
            f"top-{k} of {built} = {t_pre * k // built} rows per expert (as {PREFILL_TOKENS} tokens over "
            f"{layer.experts})")
    rows = []
    for (quant, isa), (gbs, td, tfl, tp, lim) in ours.items():
        torch_d = f"{bf16_bytes / tdec / 1e9:.1f} GB/s {tdec * 1e3:.2f} ms" if tdec else "-"
        torch_p = f"{flops / tpre / 1e12:.2f} TFLOPS {tpre * 1e3:.0f} ms" if tpre else "-"
        limit = lim or bw
        rows.append((layer.name, "decode", quant, isa, f"{gbs:.1f} GB/s {td * 1e3:.2f} ms", torch_d,
                     f"{limit:.1f} GB/s" + (f" (best {bw:.1f})" if lim else ""),
                     f"{100 * gbs / limit:.0f}%" + (f" ({100 * gbs / bw:.0f}%)" if lim else "")))
        rows.append((layer.name, "prefill", quant, isa, f"{tfl:.2f} TFLOPS {tp * 1e3:.0f} ms", torch_p,
                     f"{peak:.2f} TFLOPS", f"{100 * tfl / peak:.0f}%"))
    return rows, note


def _sweep_rows(text: str | None, quick: bool) -> tuple[int, ...]:
    if text is None:
        return crossover.ROWS_QUICK if quick else crossover.ROWS_FULL
    if text.strip().lower() in ("", "off", "none", "0"):
        return ()
    try:
        rows = tuple(int(r) for r in text.split(",") if r.strip())
    except ValueError:
        rows = (0,)
    if min(rows, default=0) < 1:
        raise SystemExit(f"--sweep: expected a comma list of rows per expert >= 1 or 'off', got {text!r}")
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from ktinject import native

    quick = args.quick if args.quick is not None else (_mem_total_gb() < 64 or (os.cpu_count() or 1) < 8)
    repeats = args.repeats or (3 if quick else 5)
    threads = args.threads or native.default_threads()
    quants = _parse_list(args.quant or ",".join(native.QUANTS), tuple(native.QUANTS), "quant")
    layers = [LAYERS[[l.name for l in LAYERS].index(n)] for n in
              _parse_list(args.layers, [l.name for l in LAYERS], "layers")]
    isa0, available = native.isa(), native.available_isas()
    if args.isa in (None, ""):
        isas = [isa0]
    elif args.isa == "all":
        isas = [i for i in available if i != "generic"] or ["generic"]
    else:
        isas = _parse_list(args.isa, available, "isa")
    sweep_rows = _sweep_rows(args.sweep, quick)
    sweep_isas = crossover.sweep_isas(available, isas)
    sweep_layer = next((l for l in layers if l.name == "Qwen3-30B-A3B"), layers[0])
    torch.set_num_threads(threads)
    if args.backward:
        from ktinject.bench import backward
        built = 32 if quick else 128
        print(f"ktinject kernels bench --backward  CPU: {cpu_model()}  threads: {threads}  ISA(s): {', '.join(isas)}")
        rows = backward.measure(native, quants, isas, threads, built, repeats)
        fwd_isa = next((i for i in isas if i != "generic"), isas[0])
        print("\n".join(backward.report(rows, threads, built, repeats, fwd_isa)))
        return 0

    print(f"ktinject kernels bench  CPU: {cpu_model()}  ({native.physical_cores()} physical cores, "
          f"{_mem_total_gb():.0f} GB RAM)")
    print(f"threads: {threads} (ours and torch)   ISA(s): {', '.join(isas)}   features: "
          f"{' '.join(native.cpu_features())}")
    print(f"mode: {'quick' if quick else 'full'}, median of {repeats}   torch {torch.__version__}")
    mem = measure_read_bandwidth(1.0 if quick else 4.0, threads, max(repeats, 5))
    bw = mem.best_gbs
    gemm_n = 2048 if quick else 4096
    peak = dense_gemm_tflops(gemm_n, repeats)
    print(f"limits: {mem.summary()}")
    print(f"        dense bf16 GEMM {peak:.2f} TFLOPS (torch matmul {gemm_n}^3)")

    pool = native.Pool(threads)
    try:
        over = {q: forward_overhead(native, pool, q, repeats) for q in quants}
        acc = accuracy(native, quants, isas, pool)
    finally:
        pool.close()
    print("fixed cost of a forward (one token, tiny layer E 8, H = I = 64, k 8, current ISA): "
          + ", ".join(f"{q} {t * 1e6:.0f} us" for q, t in over.items()))

    rows, notes, points = [], [], []
    loop = ReadLoop(mem.nbytes, threads, mem.best_variant) if mem.best_variant else None
    try:
        for layer in layers:
            built = layer.built_quick if quick else layer.built_full
            ours, torch_s, work, pts = _measure_layer(
                native, layer, built, quants, isas, threads, repeats, bw, loop,
                sweep_rows if layer is sweep_layer else (), sweep_isas, args.no_torch)
            gc.collect()
            points += pts
            r, note = _layer_rows(layer, built, work, ours, torch_s, bw, peak)
            rows += r
            notes.append(note)
    finally:
        if loop is not None:
            loop.close()

    rows.sort(key=lambda r: (r[0], r[1], r[2], r[3]))
    _print_table(("layer", "phase", "quant", "isa", "ktinject", "torch (bf16, eager loop)", "limit", "of limit"), rows)
    print()
    print("decode: GB/s = weights read per token in the stored format (k experts x gate+up+down, int incl. scales;")
    print("        torch: the same experts in bf16) / time of a one-token forward; limit = memory read bandwidth:")
    variant = mem.best_variant.name if mem.best_variant else "-"
    print(f"        the median of {repeats} passes of the best native read loop ({variant}) alternating with the")
    print("        timed decode calls (same stretch of time, same host load); in brackets the best of the limits above")
    print("prefill: TFLOPS = 2 T k 3 H I / time; limit = a dense bf16 GEMM in torch (oneDNN): a reference, not a bound")
    for n in notes:
        print(n)
    if points:
        built = sweep_layer.built_quick if quick else sweep_layer.built_full
        describe = (f"{sweep_layer.name} layer (H {sweep_layer.hidden}, I {sweep_layer.intermediate}), {built} experts "
                    f"built, each getting exactly `rows/expert` rows (tokens = rows x {built} / {sweep_layer.top_k}, "
                    f"top-{sweep_layer.top_k}); per cell TFLOPS (TOPS), GB/s of stored weights, ms per forward")
        print()
        print("\n".join(crossover.report(points, describe, "amx" in available)))
    print()
    print("\n".join(accuracy_lines(acc)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
