"""Prefill tok/s with the routed experts on the CPU, streamed to the GPU, or split (auto), beside the streaming limit.

    python -m ktinject.bench prefill [--quant bf16,int8,int4] [--prefill 512,2048,8192] [--mode cpu,gpu,auto]
                                     [--layers N] [--threads N] [--reps N] [--chunk N] [--bandwidth-gb G] [--tiny]

Builds the bench model (Qwen3-30B-A3B shapes, ``ktinject.bench.model``) once per quant, injects it, and for each
mode (the model's prefill streamer switched: ``ktinject.gpu_experts.prefill.streamer.attach``) times prefills of each length
through ``ktinject.generate`` (one new token; chunks as generate picks them: from free GPU memory), after a warm-up
prefill per mode that pays the one-time set-up (page-locking the experts, the cost model's measurements). The modes
take turns (``--reps`` rounds, the median shown and every run listed), each timed prefill after an untimed one of
the same mode and length, as a user's second prompt finds it (the first layer's copy fetched ahead). Before the
rounds of a length, auto runs the forwards its trials need to settle (a split or ahead choice checked against gpu
and cpu mode, ``gpu_experts.prefill.feedback.Trials``), printed apart: a user's first prompts of a new length pay
them. Beside each figure:

  limit   the streaming limit: tokens / (packed bytes of all routed experts / H2D bandwidth), the bandwidth measured
          in this run (one 256 MiB copy from the page-locked experts to the GPU). With fewer --layers than the real
          model's (--shapes: 48 for Qwen3-30B-A3B) both the figure and the limit scale with the layers: compare
          percentages; the whole model's equivalent is printed too
  chose   what auto decided for the last forward: its mode and, for split, experts per layer on the GPU (median)

Then per quant the prefill targets as lines: at the longest prompt gpu and auto >= 60% of the limit; at the
shortest, auto >= cpu + 80% of gpu (both devices busy); auto never below the faster pure path. And per length the
host-memory reference (``--bandwidth-gb``): every expert byte is read from host memory once, by the CPU or by a
copy, so tokens / (packed bytes / the cores' read bandwidth measured now) is what a prefill gets at that rate; auto's
share of it, and the 512-token target's. Not a hard bound: the copies' DMA reads come on top of the cores' and the
rate drifts over seconds, so auto may read above it.
``--checkpoint PATH``: the model from ``ktinject.from_pretrained(PATH)`` (a GGUF file or a checkpoint directory, e.g.
from ``bench load --keep``) instead of the in-memory one, its experts as released unless ``--quant`` overrides them;
a ``--peer-model`` that is the same file is compared unscaled, whatever its GGUF type.
``--tiny`` runs the flow on the tiny qwen3_moe test model (a CPU-only machine streams to the CPU: the code path, not
the speed). Legend: L layers, E experts.
"""
from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time

import torch

from ktinject.bench import llamacpp as peer
from ktinject.bench.model import (add_budget_option, add_shapes_option, bench_model, checkpoint_model, experts_quant,
                                  print_budget, quants_of, real_layers, resolve_layers, shapes_name)
from ktinject.bench.timing import routed_experts
from ktinject.gpu_experts.prefill.feedback import TRIALS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ktinject.bench prefill", description=__doc__.split("\n")[0])
    add_shapes_option(p)
    p.add_argument("--quant", default=None, help="comma-separated expert quants, one model build each (default "
                   "bf16,int8,int4; with --checkpoint: overriding the release's format, default the release's)")
    p.add_argument("--checkpoint", default=None, metavar="PATH", help="load the model with "
                   "ktinject.from_pretrained(PATH) (a GGUF file or a checkpoint directory) instead of building it")
    p.add_argument("--prefill", default="512,2048,8192", help="comma-separated prompt lengths")
    p.add_argument("--mode", default="cpu,gpu,auto", help="comma-separated prefill modes: cpu, gpu, auto")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (native pool and torch); default: cores")
    p.add_argument("--reps", type=int, default=3, help="timed prefills per row, modes interleaved (the median is "
                   "shown, every run listed)")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk in tokens (default: from GPU memory)")
    p.add_argument("--bandwidth-gb", type=float, default=2.0, help="the host read-bandwidth probe's buffer, at least "
                   "(bench.memory: >= 32x the LLC), once per quant, for the host-memory row (0: no probe; never with "
                   "--tiny)")
    p.add_argument("--tiny", action="store_true", help="the tiny qwen3_moe test model (runs on a CPU)")
    add_budget_option(p)
    peer.add_arguments(p)
    return p


def _csv(text: str, kind=str) -> list:
    return [kind(x.strip()) for x in text.split(",") if x.strip()]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_prefill(model, n: int, device, reps: int = 1) -> float:
    """Seconds of the fastest of ``reps`` prefills of n random tokens through ktinject.generate (one new token)."""
    import ktinject

    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(3, model.config.vocab_size, (1, n), generator=gen).to(device)
    best = float("inf")
    for _ in range(max(1, reps)):
        _sync(device)
        t0 = time.perf_counter()
        ktinject.generate(model, ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _chose(streamer) -> str:
    if streamer is None:
        return "cpu (no streamer)"
    last = streamer.last
    if not last:
        return "nothing streamed"
    n = last.get("gpu_experts") or []
    E = streamer.blocks[0].num_experts
    measured = ""
    T = last.get("T")
    m = streamer.feedback.measured
    if m.layer_s(T) is not None:
        scale = ", ".join(f"{m.cpu_scale(k):.2f}" for k in m.cpu)
        shared = m.h2d_shared()
        measured = (f" (measured: {1e3 * m.layer_s(T):.2f} ms a layer outside the experts, CPU costs x{scale}"
                    + (f", copies beside the CPU {shared / 1e9:.1f} GB/s" if shared else "") + ")")
    if last["mode"] in ("split", "ahead", "gpu", "gpu-used") and n:
        return f"{last['mode']}: {statistics.median(n):g} of {E} experts a layer on the GPU{measured}"
    return last["mode"] + measured


def run(args, quant: str | None, ours: dict | None = None) -> list[tuple[str, str, str]]:
    """Rows (what, tok/s, note) of one model build with experts in ``quant`` (or of ``--checkpoint``, ``quant``
    overriding its format); ``ours`` gets (quant, tokens) -> (mode, tok/s of the whole model (its real layers), or of the
    checkpoint's when the peer runs that file) for the peer's rows: auto where it ran, else the fastest mode."""
    import ktinject
    from ktinject import native
    from ktinject.decode.generate import get_runner, prefill_chunk
    from ktinject.gpu_experts.prefill import streamer as stream

    t0 = time.perf_counter()
    if args.checkpoint:
        if args.threads:
            native.set_default_threads(args.threads)
            torch.set_num_threads(args.threads)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model, what = checkpoint_model(args.checkpoint, quant, device, prefill="cpu",
                                       gpu_experts_budget=args.gpu_experts_budget)
        quant = experts_quant(model)
        args.layers = model.config.num_hidden_layers
    else:
        model, device = bench_model(args.tiny, args.layers, args.threads, shapes=args.shapes)
        ktinject.inject(model, gpu=str(device), quant=quant, prefill="cpu", gpu_experts_budget=args.gpu_experts_budget)
        what = shapes_name(args)
    print_budget(model)
    cfg = model.config
    L, real = cfg.num_hidden_layers, real_layers(args)
    blocks = stream.blocks_of(model)
    expert_bytes = sum(b.native_experts.nbytes for b in blocks)
    probe = stream.attach(model, "gpu")
    probe.setup()
    h2d = probe.experts.h2d
    print(f"# {quant}: {what}, {L} layers, E={routed_experts(cfg)} "
          f"top-{cfg.num_experts_per_tok}, {expert_bytes / 1e9:.2f} GB of packed experts; built and injected in "
          f"{time.perf_counter() - t0:.1f} s; native ISA {native.isa()}, {native.default_pool().threads} threads; "
          f"H2D {h2d / 1e9:.1f} GB/s (pinned, measured now)"
          + ("" if args.layers == real or args.tiny else f"; {L} of {real} layers: tok/s x {L}/{real} = the full model's"),
          flush=True)
    rows: list[tuple[str, str, str]] = []
    rates: dict[tuple[str, int], float] = {}
    lengths, modes = _csv(args.prefill, int), _csv(args.mode)
    get_runner(model, use_graphs=False, prefill_chunk=args.chunk or "auto")

    def use(mode):  # one streamer for all: experts page-locked once, auto's measurements kept
        streamer = None if mode == "cpu" or (mode == "auto" and not probe.cuda) else probe  # as attach(model, mode)
        probe.switch(mode if streamer is not None else "cpu")
        return streamer

    for mode in modes:
        use(mode)
        time_prefill(model, min(lengths), device)  # warm-up: page-locking, calibration, allocator, auto's measures
    for n in lengths:
        runs: dict[str, list[float]] = {m: [] for m in modes}
        chose = ""
        if "auto" in modes and probe.cuda:  # auto's trials (feedback.Trials) run their forwards of a new length
            use("auto")
            settle = [time_prefill(model, n, device) for _ in range(3 * TRIALS)]  # before the timed rounds
            print(f"# {quant} auto prefill {n}, settling (untimed in the table): "
                  + ", ".join(f"{n / t:,.0f}" for t in settle) + f" tok/s; then {_chose(probe)}", flush=True)
        for _ in range(max(1, args.reps)):
            for mode in modes:  # interleaved: the host's speed drifts alike for every mode
                streamer = use(mode)
                time_prefill(model, n, device)  # untimed: as for a user's second prompt (what gpu and ahead fetch
                runs[mode].append(time_prefill(model, n, device))  # ahead for the next forward is kept)
                if mode == "auto":
                    chose = _chose(streamer)
        for mode in modes:
            s = statistics.median(runs[mode])
            rate = rates[mode, n] = n / s
            limit = n * h2d / expert_bytes
            full = "" if args.layers == real or args.tiny else f" ({real} layers: {rate * L / real:,.0f})"
            chunk = prefill_chunk(model, n) or "none (one forward)"
            each = ", ".join(f"{n / t:,.0f}" for t in runs[mode])
            note = (f"median {s:.3f} s{full}; runs {each} tok/s; limit {limit:,.0f} tok/s, {100 * rate / limit:.0f}% "
                    f"of it; chunk {chunk}; {chose if mode == 'auto' else mode}")
            rows.append((f"{quant} {mode} prefill {n}", f"{rate:,.0f}", note))
            print(f"# {rows[-1][0]} | {rows[-1][1]} tok/s | {note}", flush=True)
        if ours is not None:
            pick = "auto" if "auto" in modes else max(modes, key=lambda m: rates[m, n])
            ours[quant, n] = (pick, rates[pick, n] * (1 if args.tiny or peer.same_file(args) else L / real))
    if "gpu" in modes and probe.cuda:
        use("gpu")
        rows.append(_breakdown(model, probe, quant, max(lengths), device))
    rows += _targets(quant, rates, lengths, h2d, expert_bytes)
    rows += _memory_reference(args, quant, rates, lengths, expert_bytes)
    stream.attach(model, "cpu")
    return rows


def _breakdown(model, streamer, quant: str, n: int, device) -> tuple[str, str, str]:
    """One traced gpu-mode prefill of n tokens: per layer (median) the copy, the dequantization, the whole expert
    compute (dequantization + grouped GEMMs + weighting) and the wall time, from CUDA events."""
    from ktinject.gpu_experts.prefill.ring import intervals

    streamer.experts.ring.trace = []
    try:
        s = time_prefill(model, n, device)
        spans = intervals(streamer.experts.ring.trace)
    finally:
        streamer.experts.ring.trace = None
    per = {kind: [b - a for (what, _), a, b in spans if what == kind] for kind in ("copy", "dequant", "compute")}
    layers = max(1, len(per["compute"]))
    med = {k: statistics.median(v) if v else float("nan") for k, v in per.items()}
    row = (f"{quant} gpu prefill {n}, per layer", f"{1e3 * s / layers:.2f} ms",
           f"copy {med['copy']:.2f} ms, dequant {med['dequant']:.2f} ms, expert compute (with dequant) "
           f"{med['compute']:.2f} ms (medians over {layers} layer passes, CUDA events); the copies overlap the "
           f"compute when the wall is near max(copy, compute + the rest of the layer)")
    print(f"# {row[0]} | {row[1]} | {row[2]}", flush=True)
    return row


def _targets(quant: str, rates: dict, lengths: list[int], h2d: float, expert_bytes: int) -> list[tuple]:
    """The prefill targets as rows, for the modes and lengths that were run."""
    out = []
    if not math.isfinite(h2d):
        out.append((f"{quant} targets", "n/a", "no GPU: the streaming path ran on the CPU (the code, not the speed)"))
        print(f"# {out[0][0]} | n/a | {out[0][2]}", flush=True)
        return out
    long, short = max(lengths), min(lengths)
    limit = long * h2d / expert_bytes
    for mode in ("gpu", "auto"):
        if (mode, long) in rates:
            pct = 100 * rates[mode, long] / limit
            out.append((f"{quant} target: {mode} at {long} >= 60% of the limit", f"{pct:.0f}%",
                        "met" if pct >= 60 else "NOT met"))
    if all((m, short) in rates for m in ("cpu", "gpu", "auto")):
        want = rates["cpu", short] + 0.8 * rates["gpu", short]
        out.append((f"{quant} target: auto at {short} >= cpu + 80% of gpu", f"{rates['auto', short]:,.0f}",
                    f"{'met' if rates['auto', short] >= want else 'NOT met'} (cpu + 0.8 gpu = {want:,.0f})"))
    for n in lengths:
        if all((m, n) in rates for m in ("cpu", "gpu", "auto")):
            best = max(rates["cpu", n], rates["gpu", n])
            out.append((f"{quant} target: auto at {n} >= the faster pure path", f"{rates['auto', n]:,.0f}",
                        f"{'met' if rates['auto', n] >= 0.97 * best else 'NOT met'} (faster: {best:,.0f}, "
                        f"3% run-to-run allowance)"))
    for r in out:
        print(f"# {r[0]} | {r[1]} | {r[2]}", flush=True)
    return out


def _memory_reference(args, quant: str, rates: dict, lengths: list[int], expert_bytes: int) -> list[tuple]:
    """Auto and the 512-token target beside the host's memory: at these lengths every expert of a layer is used, and
    each of its bytes is read from host memory once, by the CPU's kernels or by a copy to the GPU, so n tokens take
    expert_bytes / (read bandwidth) seconds at the cores' read rate. That rate is the sustained read of all cores
    measured now (``bench.memory``: the best variant's median pass over >= 32x the LLC). A reference, not a bound:
    the copies' DMA reads add to what the cores get, and the rate drifts between the probe and the prefills (auto
    may read above it)."""
    if args.tiny or args.bandwidth_gb <= 0 or not any(("auto", n) in rates for n in lengths):
        return []
    from ktinject.bench.memory import measure_read_bandwidth

    bw = measure_read_bandwidth(args.bandwidth_gb, args.threads).best_gbs * 1e9
    out = []
    for n in lengths:
        if ("auto", n) not in rates:
            continue
        ref = n * bw / expert_bytes
        note = (f"host read bandwidth {bw / 1e9:.1f} GB/s (all cores, measured now): every expert byte read once, by "
                f"the CPU or a copy, at that rate gives {ref:,.0f} tok/s (the copies' DMA can add to it); auto "
                f"{100 * rates['auto', n] / ref:.0f}% of it")
        if all((m, n) in rates for m in ("cpu", "gpu")):
            want = rates["cpu", n] + 0.8 * rates["gpu", n]
            note += f", cpu + 0.8 gpu {100 * want / ref:.0f}%"
        out.append((f"{quant} auto {n} against host memory", f"{ref:,.0f}", note))
        print(f"# {out[-1][0]} | {out[-1][1]} tok/s | {note}", flush=True)
    return out


def peer_rows(args, ours: dict) -> list[tuple[str, str, str]]:
    """llama-bench's prefill of each --prefill length for each --peer-model, after ktinject's rows (the same call),
    and the peer comparison: int4 and int8 at 2,048 tokens and more at least 2x llama.cpp Q4_0 / Q8_0. ktinject's
    figure is the whole model's estimate from the layers built (x L / the real model's layers, 48 for Qwen3-30B-A3B);
    with fewer layers the first layer's copy, fetched ahead by the untimed prefill before each timed one, is 1/L of
    the copies instead of 1/48 (up to ~6% in favour of gpu / auto at L = 12 where the copies bound them), which the
    note says."""
    lengths = _csv(args.prefill, int)
    print(f"# peer: {args.peer} on {args.peer_model}, prefill {args.prefill} (this takes a while)", flush=True)
    results, errors = peer.run_all(args, prompts=lengths)
    rows = [("peer failed", "n/a", e) for e in errors]
    for r in results:
        if r.n_prompt:
            rows.append((f"{r.label} prefill {r.n_prompt}", f"{r.tok_s:,.0f}", peer.note(r, args)))
    same = peer.same_file(args)  # --checkpoint is the peer's GGUF: the same model, whatever its type
    for quant in sorted({q for q, _ in ours} - {"bf16"}):
        gap = None if same else peer.missing(quant, results)
        if gap:
            rows.append((f"{quant} target: 2x llama.cpp", "n/a", gap))
    L, real = args.layers, real_layers(args)
    for (quant, n), (mode, rate) in sorted(ours.items()):
        theirs = [r for r in (results if same else peer.paired(quant, results)) if r.n_prompt == n]
        if not theirs or quant == "bf16" or n < 2048:
            continue
        what = f"{quant} target: at {n} >= 2x {theirs[0].label}"
        if args.tiny:
            rows.append((what, "n/a", "--tiny: not the peer's model"))
            continue
        ratio = rate / theirs[0].tok_s
        scaled = ("" if L == real else
                  f" (from {L} layers x {L}/{real}; the first layer's copy counts 1/{L}, not 1/{real})")
        layers = f"{L} layers, the file ktinject loaded" if same else f"{real} layers{scaled}"
        rows.append((what, f"{ratio:.2f}x", f"{'met' if ratio >= 2 else 'NOT met'} (ktinject {mode} {rate:,.0f} "
                     f"tok/s for {layers} vs {theirs[0].tok_s:,.0f}, {theirs[0].model})"))
    for r in rows:
        print(f"# {r[0]} | {r[1]} | {r[2]}", flush=True)
    return rows


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.checkpoint is None and args.quant is None:
        args.quant = "bf16,int8,int4"
    quants, modes = quants_of(args), _csv(args.mode)
    if not modes or any(m not in ("cpu", "gpu", "auto") for m in modes):
        raise SystemExit(f"--mode {args.mode!r}: expected a comma-separated list of cpu, gpu, auto")
    if not _csv(args.prefill, int):
        raise SystemExit("--prefill: give at least one prompt length")
    resolve_layers(args)
    peer.check_arguments(args)
    rows, ours = [], {}
    for q in quants:
        rows += run(args, q, ours)  # the model goes with run's frame before the next build
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.peer:
        rows += peer_rows(args, ours)
    w = max(len(r[0]) for r in rows)
    print(f"\n| {'what'.ljust(w)} | {'tok/s':>9} | note")
    print(f"|{'-' * (w + 2)}|{'-' * 11}|------")
    for what, rate, note in rows:
        print(f"| {what.ljust(w)} | {rate:>9} | {note}")
    print(f"\n(layers {'tiny' if args.tiny else args.layers}, threads {args.threads or 'default'}, reps {args.reps}"
          f"{', checkpoint ' + args.checkpoint if args.checkpoint else ''})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
