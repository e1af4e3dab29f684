"""Decode benchmarks: ``python -m ktinject.bench decode [--layers N] [--tokens N] ...`` (prefill: ``bench.prefill``).

Builds a random-weight model with Qwen3-30B-A3B dimensions (48 layers, hidden 2048, 32 heads / 4 KV heads of 128,
128 experts top-8 of intermediate 768, vocab 151936; bf16, ~61 GB) directly in memory: built on the meta device,
then materialized with the routed experts on the CPU (filled from a small random pool, fast) and everything else
on the GPU. Nothing is written to disk. Then, in one run, with the limit and the baseline measured alongside:

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
``--tiny`` runs the same flow on the tiny qwen3_moe test model (CPU-only machines too: GPU rows say n/a; no roofline
rows: the read-bandwidth probe reads GBs and a roofline of the tiny model means nothing).
The measurements themselves are in ``bench/timing.py``. Legend: B batch, P prompt tokens, N new tokens, L layers.
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
from ktinject.operators.kernels import dense as fused_dense
from ktinject.bench.memory import measure_read_bandwidth
from ktinject.bench.model import (  # noqa: F401  (re-exported: bench hot and the probe build the same model)
    set_generation_defaults, build_model, build_tiny,
)
from ktinject.bench.targets import ROOF_RUNS as ROOF_ROUNDS, noise_targets, our_rate, target_rows
from ktinject.bench.timing import (  # the measurements (bench serve imports two of them from here too)
    cpu_expert_time, expert_bytes_per_token, gen_time, graph_replay, hf_decode, ktinject_decode, muted_replay,
    paired_overhead, profile_line, profile_replay, wrap_cpu_experts,
)
from ktinject.cli.options import experts_format

MUTED_RUNS = 5  # runs of muted replays whose median is the GPU part
ROOF_VARIANTS = 3  # the start-of-run probe's fastest read variants, each timed again every round


def _fast_decode(model, on: bool) -> None:
    from ktinject.decode import attention as decode_attention

    for m in model.modules():
        if on and type(m).__name__ in decode_attention.SUPPORTED:
            decode_attention.install(m)
        elif not on:
            decode_attention.uninstall(m)


def compare_rows(model, prompt, new_tokens: int, rows: list) -> None:
    """Graph decode (through generate, and bare replay) with one speed-up undone at a time (each captures anew)."""
    from ktinject import native
    from ktinject.decode.generate import get_runner

    B, P = prompt.shape
    attn = model.config._attn_implementation
    pool = native.default_pool()
    spin = pool.watch_spin_us
    variants = [
        ("HF's sdpa attention (repeat_kv before 5.23)", lambda: model.set_attn_implementation("sdpa"),
         lambda: model.set_attn_implementation(attn), {}),
        ("4D masks built by HF every step", lambda: None, lambda: None, {"own_masks": False}),
        ("HF's stop check every step (host waits for each token)", lambda: None, lambda: None,
         {"defer_stop": False}),
        ("HF's attention forward for decode steps (fast_decode off)", lambda: _fast_decode(model, False),
         lambda: _fast_decode(model, True), {}),
        ("pool watch spin off", lambda: setattr(pool, "watch_spin_us", 0),
         lambda: setattr(pool, "watch_spin_us", spin), {}),
    ]
    for what, do, undo, runner_kwargs in variants:
        try:
            do()
            res = ktinject_decode(model, prompt, new_tokens, graphs=True, **runner_kwargs)
            bare = graph_replay(res["runner"], B, P, new_tokens)
            _add(rows, (f"compare: graph with {what}", _fmt_rate(B / res["s_per_token"]),
                        _fmt_ms(res["s_per_token"]), f"ktinject.generate; bare replay {_fmt_ms(bare)} ms"))
        except Exception as e:  # noqa: BLE001 - a comparison failing must not hide the rest
            _add(rows, (f"compare: graph with {what}", "failed", "", f"{type(e).__name__}: {e}"))
        finally:
            undo()
    get_runner(model, use_graphs=True, prefill_chunk=2048)  # back to the defaults (graphs captured again on use)


# ---- the run -------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ktinject.bench decode", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=48, help="decoder layers (48 = the real model)")
    p.add_argument("--tokens", type=int, default=64, help="decode tokens timed (ktinject)")
    p.add_argument("--hf-tokens", type=int, default=8, help="decode tokens timed (hf baseline; 0 skips it)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens before decoding")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (native pool and torch); default: cores")
    p.add_argument("--tiny", action="store_true", help="the tiny qwen3_moe test model (runs on a CPU)")
    p.add_argument("--profile", action="store_true", help="print the kernels of a muted decode-graph replay")
    p.add_argument("--quant", default="bf16",
                   help="comma-separated expert quantizations (bf16, int8, int4): the whole run once per quant, "
                        "one model build each")
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


def _add(rows: list, row: tuple) -> None:
    """Keep a table row and print it at once (a run cut short still shows what it measured)."""
    rows.append(row)
    print("# " + " | ".join(x for x in row if x), flush=True)


def _fmt_rate(tok_per_s):
    return "n/a" if tok_per_s is None else f"{tok_per_s:,.1f}"


def _fmt_ms(s):
    return "n/a" if s is None else f"{s * 1e3:.2f}"


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
    _add(rows, (f"roofline alongside: {per_tok / 1e9:.2f} GB {quant} experts/token at {bw / 1e9:.1f} GB/s",
                _fmt_rate(bw / per_tok), _fmt_ms(per_tok / bw),
                f"median read of {best} in {ROOF_ROUNDS} rounds, each just before a graph run below (GB/s a pass: "
                f"{passes})"))
    _add(rows, ("ktinject graph, in turns with the read loop", _fmt_rate(rate), _fmt_ms(B / rate),
                f"median of {ROOF_ROUNDS} runs ({runs}); {100 * rate * per_tok / bw:.0f}% of the roofline alongside"))


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
                _add(rows, (f"noise {n}, run {r + 1}: {way} decode", _fmt_rate(B / s), _fmt_ms(s),
                            f"CPU experts alone {_fmt_ms(cpu)} ms; {sched}"))
    quiet = statistics.median(times[0])
    for n in levels:
        med = statistics.median(times[n])
        spread = (max(times[n]) - min(times[n])) / med
        _add(rows, (f"noise {n}: {way} decode, median of {len(times[n])} runs", _fmt_rate(B / med), _fmt_ms(med),
                    f"{100 * quiet / med:.0f}% of the quiet speed; runs " +
                    ", ".join(_fmt_rate(B / t) for t in times[n]) + f" tok/s, spread {100 * spread:.0f}% of the "
                    "median"))
    for row in noise_targets(times, args):
        _add(rows, row)


def run(args, quant: str = "bf16", first: bool = True) -> list[tuple[str, str, str, str]]:
    """The rows of one model build with experts in ``quant`` (hf baselines only when ``first``)."""
    import ktinject
    from ktinject import native

    if args.threads:
        native.set_default_threads(args.threads)
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows: list[tuple[str, str, str, str]] = []  # (what, tok/s, ms/token, note)
    t0 = time.perf_counter()
    model = build_tiny(device) if args.tiny else build_model(args.layers, device)
    cfg = model.config
    set_generation_defaults(model)
    what = "tiny qwen3_moe" if args.tiny else "Qwen3-30B-A3B shapes"
    print(f"# {what}: {cfg.num_hidden_layers} layers, H={cfg.hidden_size}, E={cfg.num_experts} top-"
          f"{cfg.num_experts_per_tok}, I={cfg.moe_intermediate_size}, {next(model.parameters()).dtype}; "
          f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; built in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    B, P = args.batch, args.prompt
    prompt = torch.randint(3, cfg.vocab_size, (B, P), device=device)

    quick = bool(args.noise and args.noise_only) or bool(args.defer)  # the interference or deferral rows alone
    mem = per_tok = None
    if not quick and not args.tiny:  # (--tiny: a roofline of the tiny model means nothing, and the probe reads GBs)
        mem = measure_read_bandwidth(4.0, args.threads)  # >= 4 GB (a Qwen3-30B token: 3.6 GB), >= 32x the LLC
        print(f"# {mem.summary()}", flush=True)
        bw = mem.best_gbs * 1e9
        per_tok = expert_bytes_per_token(cfg, B, quant)
        _add(rows, (f"roofline: {per_tok / 1e9:.2f} GB {quant} experts/token at {bw / 1e9:.1f} GB/s",
                     _fmt_rate(bw / per_tok), _fmt_ms(per_tok / bw),
                     f"CPU read bandwidth measured in this run ({mem.best})"))

    if not args.tiny:
        wrap_cpu_experts(model, True)
    if args.hf_tokens and first and not quick:
        try:
            _, s = hf_decode(model, prompt, args.hf_tokens)
            _add(rows, ("hf: HF modules, experts by torch on the CPU", _fmt_rate(B / s), _fmt_ms(s),
                         f"median of {args.hf_tokens} steps"))
        except Exception as e:  # noqa: BLE001 - a baseline failing must not hide the rest
            _add(rows, ("hf: HF modules, experts by torch on the CPU", "failed", "", f"{type(e).__name__}: {e}"))
    wrap_cpu_experts(model, False)

    t0 = time.perf_counter()
    ktinject.inject(model, gpu=str(device), quant=quant)
    pool = native.default_pool()
    pinned = pool.pin if envs.get("KTINJECT_PIN") is None else envs.get("KTINJECT_PIN")  # (the native override)
    if device.type == "cuda":
        from ktinject.operators.kernels import common as fused

        probe = torch.empty(1, device=device)
        kernels = ("decode kernels: Triton, programmatic dependent launch " + ("on" if fused.pdl(probe) else "off")
                   if fused.available(probe) else "decode kernels: torch ops (no Triton)")
    else:
        kernels = "CPU only"
    print(f"# injected {experts_format(model)} in {time.perf_counter() - t0:.1f} s; native ISA {native.isa()}, "
          f"{pool.threads} threads{'' if pinned else ', not pinned'}; {kernels}", flush=True)
    if args.defer:
        from ktinject.bench import defer

        defer.rows(model, prompt, args, lambda row: _add(rows, row),
                   defer.Timers(cpu_expert_time, graph_replay, muted_replay), quant=quant)
        return rows

    if not quick:
        eager = ktinject_decode(model, prompt, args.tokens, graphs=False)
        _add(rows, ("ktinject eager", _fmt_rate(B / eager["s_per_token"]), _fmt_ms(eager["s_per_token"]),
                     "ktinject.generate, no graph"))
        step = mute = graph = None
        cpu_times = cpu_expert_time(model, B)  # before and after the graph rows: the host's load drifts
        if device.type == "cuda":
            graph = ktinject_decode(model, prompt, args.tokens, graphs=True)
            r = graph["runner"]
            note = f"{r.stats.captures} capture(s), {r.stats.replays} replays"
            if r.stats.capture_failures:
                note += f"; capture FAILED: {r.stats.capture_failures[0][:120]}"
            _add(rows, ("ktinject graph", _fmt_rate(B / graph["s_per_token"]), _fmt_ms(graph["s_per_token"]),
                         "ktinject.generate, " + note))
            try:
                if mem is not None:
                    _alongside_rows(model, prompt, args, quant, mem, per_tok, rows)
            except Exception as e:  # noqa: BLE001 - an extra measurement failing (e.g. its 4 GB) hides nothing else
                _add(rows, ("roofline alongside", "failed", "", f"{type(e).__name__}: {e}"))
            step = graph_replay(r, B, P, args.tokens)
            _add(rows, ("ktinject graph, bare replay", _fmt_rate(None if step is None else B / step),
                         _fmt_ms(step), f"graph.replay() only, no HF loop; host waits: {r.host_wait}"))
            # median of MUTED_RUNS: a single run of replays can move with a hiccup of the host's side of the
            # handshakes, well above what probes of the same tree read
            mutes = sorted(m for m in (muted_replay(model, r, B, P, args.tokens) for _ in range(MUTED_RUNS))
                           if m is not None)
            mute = statistics.median(mutes) if mutes else None
            med, ratios = paired_overhead(model, r, B, P)
            if med is not None:
                _add(rows, ("coordination overhead, paired: bare replay / CPU experts alone - 1", "",
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
                _add(rows, ("ktinject graph, bare replay, host spin-waits", _fmt_rate(B / spin), _fmt_ms(spin),
                             "the waiting host thread takes a core from the expert threads"))
            if args.compare:  # after every row that uses runner r (a new runner closes r's graphs)
                compare_rows(model, prompt, args.tokens, rows)
        else:
            _add(rows, ("ktinject graph", "n/a", "", "no CUDA"))
        cpu_times += cpu_expert_time(model, B)
        cpu_s = statistics.median(cpu_times)
        _add(rows, ("split: CPU experts alone", "", _fmt_ms(cpu_s),
                     "native forward per layer, synchronous; whole passes over the layers, fresh experts each pass "
                     f"(cache-cold), median of {len(cpu_times)} passes (half before, half after the graph rows; "
                     f"range {min(cpu_times) * 1e3:.2f}-{max(cpu_times) * 1e3:.2f} ms)"))
        if graph is not None and cpu_s > 0:
            over = [f"bare replay {100 * (step / cpu_s - 1):+.1f}%"] if step is not None else []
            over.append(f"against the fastest CPU pass {100 * (graph['s_per_token'] / min(cpu_times) - 1):+.1f}%")
            _add(rows, ("coordination overhead: graph decode / CPU experts alone - 1", "",
                        f"{100 * (graph['s_per_token'] / cpu_s - 1):+.1f}%",
                        "through ktinject.generate, against the median CPU pass (target: under 10%); "
                        + "; ".join(over)))
        spread = (f"median of {len(mutes)} runs of {args.tokens} replays ({mutes[0] * 1e3:.2f}-"
                  f"{mutes[-1] * 1e3:.2f}); " if mute is not None and len(mutes) > 1 else "")
        _add(rows, ("split: GPU + handshakes (experts muted)", "", _fmt_ms(mute), "graph replay, all experts skipped; "
                     f"{spread}projections of {B} row(s): {fused_dense.choices_line(B)}"))
        _add(rows, ("split: waiting for the CPU", "", _fmt_ms(None if step is None or mute is None else step - mute),
                     "bare replay - muted replay"))
        if device.type == "cuda":
            from ktinject.native import cuda_driver
            from ktinject.bench import handshake

            L = cfg.num_hidden_layers
            one = native.Pool(1)
            variants = [("memops", None, "block", None), ("memops", None, "block", 0), ("memops", one, "block", None),
                        ("memops", None, "spin", None), ("hostfn", None, "block", None)]
            expert_pool = native.default_pool()
            for mode, pool, wait, spin_us in variants:
                what = f"coordination: {mode}, {'1-thread pool' if pool else 'expert pool'}, host {wait}s"
                if spin_us is not None:
                    what += f", watch spin {spin_us} us"
                saved_spin = expert_pool.watch_spin_us
                try:
                    cuda_driver.set_host_wait_mode(wait)
                    if spin_us is not None:
                        expert_pool.watch_spin_us = spin_us
                    hc = handshake.handshake_cost(n=L, mode=mode, pool=pool)
                    _add(rows, (what, "", _fmt_ms(hc["per_handshake_us"] * L / 1e6),
                                 f"{hc['per_handshake_us']:.1f} us/handshake x {L} layers (empty tasks)"))
                except Exception as e:  # noqa: BLE001
                    _add(rows, (what, "failed", "", f"{type(e).__name__}: {e}"))
                finally:
                    expert_pool.watch_spin_us = saved_spin
            cuda_driver.set_host_wait_mode("block")
            one.close()

    if args.noise:
        _noise_rows(model, prompt, args, rows, graphs=device.type == "cuda")
    return rows


def print_table(rows, args) -> None:
    w = max(len(r[0]) for r in rows)
    print(f"\n| {'what'.ljust(w)} | {'tok/s':>9} | {'ms/token':>9} | note")
    print(f"|{'-' * (w + 2)}|{'-' * 11}|{'-' * 11}|------")
    for what, rate, ms, note in rows:
        print(f"| {what.ljust(w)} | {rate:>9} | {ms:>9} | {note}")
    print(f"\n(batch {args.batch}, prompt {args.prompt}, {args.tokens} decode tokens, threads "
          f"{args.threads or 'default'}, layers {'tiny' if args.tiny else args.layers}, quant {args.quant}"
          f"{', noise ' + args.noise if args.noise else ''})", flush=True)


def peer_rows(args, ours: dict) -> list[tuple[str, str, str, str]]:
    """llama-bench's decode of --tokens tokens for each --peer-model, after ktinject's rows (the same call), and each
    quant's tok/s against its GGUF type's (``peer.PAIRS``): a ratio only for the whole model (or x L/48) at batch 1."""
    print(f"# peer: {args.peer} on {args.peer_model}, decode {args.tokens} tokens (this takes a while)", flush=True)
    results, errors = peer.run_all(args, gen=args.tokens)
    rows: list = []
    for e in errors:
        _add(rows, ("peer failed", "n/a", "", e))
    for r in results:
        if r.n_gen:
            _add(rows, (f"{r.label} decode {r.n_gen}", f"{r.tok_s:,.1f}", _fmt_ms(1 / r.tok_s),
                        peer.note(r, args) + ", batch 1"))
    scale = args.layers / 48
    for quant, (row, rate) in ours.items():
        gap = peer.missing(quant, results)
        if gap:
            _add(rows, (f"{quant} / llama.cpp", "n/a", "", gap))
        theirs = [r for r in peer.paired(quant, results) if r.n_gen]
        if not theirs:
            continue
        what = f"{quant} / {theirs[0].label}"
        if args.tiny or args.batch != 1:
            _add(rows, (what, "n/a", "", "--tiny: not the peer's model" if args.tiny else
                        f"batch {args.batch}: llama-bench decodes one sequence"))
            continue
        ratio = rate * scale / theirs[0].tok_s
        _add(rows, (what, f"{ratio:.2f}x", "",
                    f"ktinject {quant} ({row!r}{'' if scale == 1 else f' x {args.layers}/48 layers'}) "
                    f"{rate * scale:,.1f} tok/s vs {theirs[0].tok_s:,.1f} ({theirs[0].model})"))
    return rows


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quants = [q.strip() for q in args.quant.split(",") if q.strip()]
    bad = [q for q in quants if q not in ("bf16", "int8", "int4")]
    if bad or not quants:
        raise SystemExit(f"--quant {args.quant!r}: expected a comma-separated list of bf16, int8, int4")
    peer.check_arguments(args)
    if args.tokens < 1:
        raise SystemExit(f"--tokens {args.tokens}: at least 1 decode token to time")
    if args.defer:
        from ktinject.bench.defer import layouts
        layouts(args.defer_layouts)  # a bad name (or KTINJECT_DEFER_PHASES) stops here, not after the model's build
    rows, ours = [], {}
    for i, q in enumerate(quants):
        got = run(args, q, first=i == 0)  # the model goes with run's frame before the next build
        for row in target_rows(q, got, args):
            _add(got, row)
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
