"""Decode benchmarks: ``python -m ktinject.bench decode [--layers N] [--tokens N] ...`` (prefill: ``bench.prefill``).

Builds a random-weight model with Qwen3-30B-A3B dimensions (48 layers, hidden 2048, 32 heads / 4 KV heads of 128,
128 experts top-8 of intermediate 768, vocab 151936; bf16, ~61 GB) directly in memory: built on the meta device,
then materialized with the routed experts on the CPU (filled from a small random pool, fast) and everything else
on the GPU. Nothing is written to disk. ``--shapes qwen3_5_moe`` builds Qwen3.5-35B-A3B's dimensions instead
(``ktinject.bench.model.SHAPES``; the targets are judged for Qwen3-30B-A3B only). Then, in one run, with the limit
and the baseline measured alongside:

  hf        the same model with Hugging Face's own modules, routed experts computed by torch on the CPU
  roofline  bytes of routed expert weights per token / CPU read bandwidth (measured now)
  roofline alongside, graph in turns with the read loop: three graph runs, each after a pass of the read probe's
            three fastest variants: the limit of that stretch of time (printed, judges nothing) and the median
            run (the figure the decode targets take where no --defer rounds ran)
  eager     ktinject.inject (routed experts in native kernels), decode steps run eagerly
  graph     the same, each decode step replayed as one CUDA graph (ktinject.generate)
  split     per token: CPU expert time (native, synchronous), GPU time (graph replay with every routed expert
            muted), waiting (graph step - GPU time), coordination (stream handshakes alone, per layer x layers)

``--quant bf16,int8,int4`` runs the flow once per expert quantization (one model build each; hf rows with the first).
``--noise 1,2,4`` adds the interference mode: decode (graph; eager without CUDA) and CPU experts alone timed quiet and
with N background processes copying 1 GiB buffers (ktinject.bench.noise), ``--noise-runs`` rounds of every level in
turn, with what the scheduler did to the pool's threads meanwhile; then per level the median, its share of the quiet
speed and the spread of the runs.
``--defer 0,1,2,0.3`` times expert deferral instead: graph decode per setting against the bound (CPU + GPU) /
max(CPU, GPU) of this run (``ktinject.bench.defer``).
``--peer PATH --peer-model GGUF[,GGUF]`` times llama.cpp's llama-bench (experts on the CPU) on those GGUFs after
ktinject's rows, in the same run, and compares each quant with its GGUF type (``ktinject.bench.llamacpp``).
Last, per quant, the decode targets that the run measured, each judged met / NOT met in the bench's own output
(``ktinject.bench.targets``, which lists them; whole model at batch 1 only).
``--checkpoint PATH`` takes the model from ``ktinject.from_pretrained(PATH)`` instead (a GGUF file, or an FP8 / bf16
directory, e.g. written by ``bench load --format ... --keep``): the experts as released, ``--quant`` then overriding
that format; no hf rows (the experts load straight into native ones); the header names the checkpoint, its formats
and the experts' format, and a ``--peer-model`` that is the same file is compared with whatever its GGUF type.
``--tiny`` runs the same flow on the tiny qwen3_moe test model (CPU-only machines too: GPU rows say n/a; no roofline
rows: the read-bandwidth probe reads GBs and a roofline of the tiny model means nothing).
The measurements themselves are in ``bench/timing.py``; the rows of --compare, --peer and the coordination, and the
closing table, in ``bench/decode_rows.py``. Legend: B batch, P prompt tokens, N new tokens, L layers.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

from ktinject import envs
from ktinject.bench import llamacpp as peer
from ktinject.bench.decode_rows import (add_row, compare_rows, coordination_rows, fmt_ms, fmt_rate, peer_rows,
                                        print_table)
from ktinject.operators.kernels import dense as fused_dense
from ktinject.bench.memory import measure_read_bandwidth
from ktinject.bench.model import (  # noqa: F401  (re-exported: bench hot and the probe build the same model)
    add_budget_option, add_shapes_option, set_generation_defaults, build_model, build_tiny, checkpoint_model,
    experts_quant, print_budget, quants_of, resolve_layers, shapes_name,
)
from ktinject.bench.targets import ROOF_RUNS as ROOF_ROUNDS, noise_targets, our_rate, target_rows
from ktinject.bench.timing import (  # the measurements (bench serve imports two of them from here too)
    cpu_expert_time, expert_bytes_per_token, gen_time, graph_replay, hf_decode, ktinject_decode,
    loaded_expert_bytes_per_token, muted_replay, routed_experts,
    paired_overhead, profile_line, profile_replay, wrap_cpu_experts,
)
from ktinject.cli.options import experts_format

MUTED_RUNS = 5  # runs of muted replays whose median is the GPU part
ROOF_VARIANTS = 3  # the start-of-run probe's fastest read variants, each timed again every round


# ---- the run -------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ktinject.bench decode", description=__doc__.split("\n")[0])
    add_shapes_option(p)
    p.add_argument("--tokens", type=int, default=64, help="decode tokens timed (ktinject)")
    p.add_argument("--hf-tokens", type=int, default=8, help="decode tokens timed (hf baseline; 0 skips it)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens before decoding")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (native pool and torch); default: cores")
    p.add_argument("--tiny", action="store_true", help="the tiny qwen3_moe test model (runs on a CPU)")
    add_budget_option(p)
    p.add_argument("--profile", action="store_true", help="print the kernels of a muted decode-graph replay")
    p.add_argument("--quant", default=None,
                   help="comma-separated expert quantizations (bf16, int8, int4, fp8, mxfp4; default bf16): the "
                        "whole run once per quant, one model build each; with --checkpoint: the format overriding the "
                        "release's (default: the release's)")
    p.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="load the model with ktinject.from_pretrained(PATH) (a GGUF file or a checkpoint directory, "
                        "e.g. from bench load --keep) instead of building the random one in memory")
    p.add_argument("--noise", default="",
                   help="comma-separated counts of background memory-copy processes (e.g. 1,2,4): time decode quiet "
                        "and with each ('' skips)")
    p.add_argument("--noise-runs", type=int, default=3, help="rounds of the quiet and noisy turns (--noise)")
    p.add_argument("--noise-only", action="store_true",
                   help="with --noise: only its rows after the injection (no roofline, eager, split, coordination)")
    p.add_argument("--defer", default="",
                   help="comma-separated expert-deferral settings (ints: slots per token, floats 0 < M < 1: shares "
                        "of each token's routing weight; e.g. 0,1,2,0.3): graph decode per "
                        "setting against the bound (CPU + GPU) / max(CPU, GPU), instead of the other rows "
                        "(ktinject.bench.defer)")
    p.add_argument("--defer-rounds", type=int, default=3, help="rounds in which every --defer setting is timed")
    p.add_argument("--defer-layouts", default=None,
                   help="with --defer on a GPU: the deferring layers' split layouts to time in turns, of one, cut, "
                        "two (KTINJECT_DEFER_PHASES; default: that variable's, else cut)")
    p.add_argument("--compare", action="store_true",
                   help="also time the graph decode with one speed-up undone at a time: HF's sdpa attention, 4D "
                        "masks built by HF every step, the pool's watch spin off")
    peer.add_arguments(p)
    return p


def _decode_rate(model, prompt, tokens: int) -> float:
    """Seconds per decode token through ktinject.generate with the model's current runner (no new capture)."""
    t1 = min(gen_time(model, prompt, 1) for _ in range(2))
    return (gen_time(model, prompt, tokens + 1) - t1) / tokens


def _alongside_rows(model, prompt, args, quant: str, mem, per_tok: float, rows: list) -> None:
    """The roofline of the stretch of time the decode runs in: ROOF_ROUNDS rounds of one pass of each of the
    start-of-run probe's ROOF_VARIANTS fastest read variants, then one graph decode run (the runner as captured);
    the limit is the best variant's median pass, the figure the median run. Beside the start-of-run roofline (the
    best of 27 variants' medians of 5 passes), not instead of it: three passes a variant are few, so the pair says
    how far the host's bandwidth moved during the run, and targets.py judges against the start-of-run figure (with
    the median run). (Over a buffer only a few times the LLC these passes swung with cache hits while decode read
    steadily: bench.memory's docstring.)"""
    from ktinject.bench.memory import ReadLoop

    variants = mem.top(ROOF_VARIANTS)
    if not variants:
        return
    B = prompt.shape[0]
    rates: list[float] = []
    reads: dict[str, list[float]] = {v.name: [] for v in variants}
    with ReadLoop(mem.nbytes, mem.threads, variants[0]) as loop:
        for v in variants:
            loop.seconds(v)  # warm-up
        for _ in range(ROOF_ROUNDS):
            for v in variants:
                reads[v.name].append(loop.gbs(v))
            rates.append(B / _decode_rate(model, prompt, args.tokens))
    med = {name: statistics.median(g) for name, g in reads.items()}
    best = max(med, key=med.get)
    bw = med[best] * 1e9
    rate = statistics.median(rates)
    runs = ", ".join(f"{r:,.1f}" for r in rates)
    passes = "; ".join(f"{name} {', '.join(f'{g:.0f}' for g in reads[name])}" for name in reads)
    add_row(rows, (f"roofline alongside: {per_tok / 1e9:.2f} GB {quant} experts/token at {bw / 1e9:.1f} GB/s",
                   fmt_rate(bw / per_tok), fmt_ms(per_tok / bw),
                   f"median read of {best} in {ROOF_ROUNDS} rounds, each just before a graph run below (GB/s a pass: "
                   f"{passes})"))
    add_row(rows, ("ktinject graph, in turns with the read loop", fmt_rate(rate), fmt_ms(B / rate),
                   f"median of {ROOF_ROUNDS} runs ({runs}); {100 * rate * per_tok / bw:.0f}% of the roofline "
                   "alongside"))


def _noise_rows(model, prompt, args, rows: list, graphs: bool) -> None:
    """Interference mode: rounds of decode + one CPU-experts pass, quiet and with each --noise level in turn."""
    from ktinject.bench.noise import Noise, Sched

    levels = [0] + sorted({int(x) for x in args.noise.split(",") if x.strip() and int(x) > 0})
    B = prompt.shape[0]
    way = "graph" if graphs else "eager"
    ktinject_decode(model, prompt, 2, graphs=graphs)  # the runner this mode reuses (captured once)
    times: dict[int, list[float]] = {n: [] for n in levels}
    with Noise(max(levels)) as bg:
        for r in range(args.noise_runs):
            for n in levels:
                bg.set(n)
                before = Sched.take(p.pid for p in bg.procs)
                s = _decode_rate(model, prompt, args.tokens)
                sched = Sched.take(p.pid for p in bg.procs).since(before)
                cpu = statistics.median(cpu_expert_time(model, B, passes=3))
                bg.set(0)
                times[n].append(s)
                add_row(rows, (f"noise {n}, run {r + 1}: {way} decode", fmt_rate(B / s), fmt_ms(s),
                               f"CPU experts alone {fmt_ms(cpu)} ms; {sched}"))
    quiet = statistics.median(times[0])
    for n in levels:
        med = statistics.median(times[n])
        spread = (max(times[n]) - min(times[n])) / med
        add_row(rows, (f"noise {n}: {way} decode, median of {len(times[n])} runs", fmt_rate(B / med), fmt_ms(med),
                       f"{100 * quiet / med:.0f}% of the quiet speed; runs " +
                       ", ".join(fmt_rate(B / t) for t in times[n]) + f" tok/s, spread {100 * spread:.0f}% of the "
                       "median"))
    for row in noise_targets(times, args):
        add_row(rows, row)


def run(args, quant: str | None = "bf16", first: bool = True) -> tuple[str, list[tuple[str, str, str, str]]]:
    """(the experts' format, the rows) of one model build with experts in ``quant`` (hf baselines only when
    ``first``), or of ``--checkpoint`` loaded with ``quant`` overriding its format (None: the release's)."""
    import ktinject
    from ktinject import native

    if args.threads:
        native.set_default_threads(args.threads)
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows: list[tuple[str, str, str, str]] = []  # (what, tok/s, ms/token, note)
    t0 = time.perf_counter()
    if args.checkpoint:
        model, what = checkpoint_model(args.checkpoint, quant, device, gpu_experts_budget=args.gpu_experts_budget)
        quant = experts_quant(model)
        args.layers = model.config.num_hidden_layers  # (the targets, the table and the peer's scale read it)
    else:
        model = build_tiny(device) if args.tiny else build_model(args.layers, device, shapes=args.shapes)
        set_generation_defaults(model)
        what = shapes_name(args)
    cfg = model.config
    print(f"# {what}: {cfg.num_hidden_layers} layers, H={cfg.hidden_size}, E={routed_experts(cfg)} top-"
          f"{cfg.num_experts_per_tok}, I={cfg.moe_intermediate_size}, {next(model.parameters()).dtype}; "
          f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; built in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    B, P = args.batch, args.prompt
    prompt = torch.randint(3, cfg.vocab_size, (B, P), device=device)

    quick = bool(args.noise and args.noise_only) or bool(args.defer)  # the interference or deferral rows alone
    mem = per_tok = None
    # no roofline for the tiny model or a checkpoint of tiny shapes: it means nothing there, and the probe reads GBs
    small = args.tiny or (args.checkpoint and loaded_expert_bytes_per_token(model, B) * routed_experts(cfg) < 1e9)
    if not quick and not small:
        mem = measure_read_bandwidth(4.0, args.threads)  # >= 4 GB (a Qwen3-30B token: 3.6 GB), >= 32x the LLC
        print(f"# {mem.summary()}", flush=True)
        bw = mem.best_gbs * 1e9
        per_tok = (loaded_expert_bytes_per_token(model, B) if args.checkpoint else
                   expert_bytes_per_token(cfg, B, quant))
        add_row(rows, (f"roofline: {per_tok / 1e9:.2f} GB {quant} experts/token at {bw / 1e9:.1f} GB/s",
                       fmt_rate(bw / per_tok), fmt_ms(per_tok / bw),
                       f"CPU read bandwidth measured in this run ({mem.best})"))

    hf = not args.tiny and not args.checkpoint  # (a loaded model's experts are native already)
    if hf:
        wrap_cpu_experts(model, True)
    if args.hf_tokens and first and not quick and not args.checkpoint:
        try:
            _, s = hf_decode(model, prompt, args.hf_tokens)
            add_row(rows, ("hf: HF modules, experts by torch on the CPU", fmt_rate(B / s), fmt_ms(s),
                           f"median of {args.hf_tokens} steps"))
        except Exception as e:  # noqa: BLE001 - a baseline failing must not hide the rest
            add_row(rows, ("hf: HF modules, experts by torch on the CPU", "failed", "", f"{type(e).__name__}: {e}"))
    wrap_cpu_experts(model, False)

    t0 = time.perf_counter()
    if not args.checkpoint:
        ktinject.inject(model, gpu=str(device), quant=quant, gpu_experts_budget=args.gpu_experts_budget)
    print_budget(model)
    pool = native.default_pool()
    pinned = pool.pin if envs.get("KTINJECT_PIN") is None else envs.get("KTINJECT_PIN")  # (the native override)
    if device.type == "cuda":
        from ktinject.operators.kernels import common as fused

        probe = torch.empty(1, device=device)
        kernels = ("decode kernels: Triton, programmatic dependent launch " + ("on" if fused.pdl(probe) else "off")
                   if fused.available(probe) else "decode kernels: torch ops (no Triton)")
    else:
        kernels = "CPU only"
    done = (f"experts {experts_format(model)}, loaded" if args.checkpoint else
            f"injected {experts_format(model)} in {time.perf_counter() - t0:.1f} s")
    print(f"# {done}; native ISA {native.isa()}, "
          f"{pool.threads} threads{'' if pinned else ', not pinned'}; {kernels}", flush=True)
    if args.defer:
        from ktinject.bench import defer

        defer.rows(model, prompt, args, lambda row: add_row(rows, row),
                   defer.Timers(cpu_expert_time, graph_replay, muted_replay), quant=quant)
        return quant, rows

    if not quick:
        try:  # (the eager row is a reference: a measurement lost in the host's noise does not stop the run)
            eager = ktinject_decode(model, prompt, args.tokens, graphs=False)
            add_row(rows, ("ktinject eager", fmt_rate(B / eager["s_per_token"]), fmt_ms(eager["s_per_token"]),
                           "ktinject.generate, no graph"))
        except RuntimeError as e:
            add_row(rows, ("ktinject eager", "failed", "", str(e)))
        step = mute = graph = None
        cpu_times = cpu_expert_time(model, B)  # before and after the graph rows: the host's load drifts
        if device.type == "cuda":
            graph = ktinject_decode(model, prompt, args.tokens, graphs=True)
            r = graph["runner"]
            note = f"{r.stats.captures} capture(s), {r.stats.replays} replays"
            if r.stats.capture_failures:
                note += f"; capture FAILED: {r.stats.capture_failures[0][:120]}"
            add_row(rows, ("ktinject graph", fmt_rate(B / graph["s_per_token"]), fmt_ms(graph["s_per_token"]),
                           "ktinject.generate, " + note))
            try:
                if mem is not None:
                    _alongside_rows(model, prompt, args, quant, mem, per_tok, rows)
            except Exception as e:  # noqa: BLE001 - an extra measurement failing (e.g. its 4 GB) hides nothing else
                add_row(rows, ("roofline alongside", "failed", "", f"{type(e).__name__}: {e}"))
            step = graph_replay(r, B, P, args.tokens)
            add_row(rows, ("ktinject graph, bare replay", fmt_rate(None if step is None else B / step),
                           fmt_ms(step), f"graph.replay() only, no HF loop; host waits: {r.host_wait}"))
            # median of MUTED_RUNS: a single run of replays can move with a hiccup of the host's side of the
            # handshakes, well above what probes of the same tree read
            mutes = sorted(m for m in (muted_replay(model, r, B, P, args.tokens) for _ in range(MUTED_RUNS))
                           if m is not None)
            mute = statistics.median(mutes) if mutes else None
            med, ratios = paired_overhead(model, r, B, P)
            if med is not None:
                add_row(rows, ("coordination overhead, paired: bare replay / CPU experts alone - 1", "",
                               f"{100 * (med - 1):+.1f}%", f"median of {len(ratios)} pairs (one CPU pass, then 4 "
                               f"replays; range {100 * (min(ratios) - 1):+.1f}% to {100 * (max(ratios) - 1):+.1f}%); "
                               f"generate / bare replay in this run: {graph['s_per_token'] / step:.3f}"))
            if args.profile:
                print(f"# kernels of 3 muted decode-graph replays ({cfg.num_hidden_layers} layers):\n"
                      + profile_replay(model, r, B, P), flush=True)
                # the CPU's side of the same step: the pool's jobs inside bare replays (go seen -> done raised)
                # against the same forwards driven from Python (cpu_expert_time), to tell hand-off from work
                with pool.profiling() as gprof:
                    graph_replay(r, B, P, args.tokens)
                print(f"# native pool inside bare replays, a layer: {profile_line(gprof)}", flush=True)
                alone: list = []
                cpu_expert_time(model, B, passes=3, profile=alone)
                print(f"# native pool, CPU experts alone, a layer: {profile_line(alone[0])}", flush=True)
            if r.host_wait != "spin" and step is not None:
                from ktinject.native import cuda_driver

                cuda_driver.set_host_wait_mode("spin")
                spin = graph_replay(r, B, P, args.tokens)
                cuda_driver.set_host_wait_mode(r.host_wait or "auto")
                add_row(rows, ("ktinject graph, bare replay, host spin-waits", fmt_rate(B / spin), fmt_ms(spin),
                               "the waiting host thread takes a core from the expert threads"))
            if args.compare:  # after every row that uses runner r (a new runner closes r's graphs)
                compare_rows(model, prompt, args.tokens, rows)
        else:
            add_row(rows, ("ktinject graph", "n/a", "", "no CUDA"))
        cpu_times += cpu_expert_time(model, B)
        cpu_s = statistics.median(cpu_times)
        add_row(rows, ("split: CPU experts alone", "", fmt_ms(cpu_s),
                       "native forward per layer, synchronous; whole passes over the layers, fresh experts each pass "
                       f"(cache-cold), median of {len(cpu_times)} passes (half before, half after the graph rows; "
                       f"range {min(cpu_times) * 1e3:.2f}-{max(cpu_times) * 1e3:.2f} ms)"))
        if graph is not None and cpu_s > 0:
            over = [f"bare replay {100 * (step / cpu_s - 1):+.1f}%"] if step is not None else []
            over.append(f"against the fastest CPU pass {100 * (graph['s_per_token'] / min(cpu_times) - 1):+.1f}%")
            add_row(rows, ("coordination overhead: graph decode / CPU experts alone - 1", "",
                           f"{100 * (graph['s_per_token'] / cpu_s - 1):+.1f}%",
                           "through ktinject.generate, against the median CPU pass (target: under 10%); "
                           + "; ".join(over)))
        spread = (f"median of {len(mutes)} runs of {args.tokens} replays ({mutes[0] * 1e3:.2f}-"
                  f"{mutes[-1] * 1e3:.2f}); " if mute is not None and len(mutes) > 1 else "")
        add_row(rows, ("split: GPU + handshakes (experts muted)", "", fmt_ms(mute),
                       f"graph replay, all experts skipped; {spread}projections of {B} row(s): "
                       f"{fused_dense.choices_line(B)}"))
        add_row(rows, ("split: waiting for the CPU", "", fmt_ms(None if step is None or mute is None else step - mute),
                       "bare replay - muted replay"))
        if device.type == "cuda":
            coordination_rows(cfg.num_hidden_layers, rows)

    if args.noise:
        _noise_rows(model, prompt, args, rows, graphs=device.type == "cuda")
    return quant, rows


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quants = quants_of(args)
    resolve_layers(args)
    peer.check_arguments(args)
    if args.tokens < 1:
        raise SystemExit(f"--tokens {args.tokens}: at least 1 decode token to time")
    if args.defer:
        from ktinject.bench.defer import layouts
        layouts(args.defer_layouts)  # a bad name (or KTINJECT_DEFER_PHASES) stops here, not after the model's build
    rows, ours = [], {}
    for i, q in enumerate(quants):
        q, got = run(args, q, first=i == 0)  # the model goes with run's frame before the next build
        for row in target_rows(q, got, args):
            add_row(got, row)
        mine = our_rate(got)
        if mine is not None:
            ours[q] = mine
        rows += [(f"{q}: {r[0]}", *r[1:]) for r in got] if len(quants) > 1 else got
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.peer:
        rows += peer_rows(args, ours)
    print_table(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
