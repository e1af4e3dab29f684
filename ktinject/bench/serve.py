"""Serving: aggregate decode tok/s and time to first token at 1/4/8/16 concurrent streams, vs the roofline.

Builds the random-weight Qwen3-30B-A3B-shaped model of the decode bench in memory, ``--layers`` of its 48 layers
(default 16, so that bf16 and int4 together run in a few minutes on a GPU machine; every tok/s and roofline is
then for those layers: a whole model's are about layers/48 of them, as the output says) (``--tiny``: the tiny
qwen3_moe test model, on any machine), injects it once per ``--quant``, then drives ``ktinject.serve.engine.Engine`` (the
server's engine, without HTTP: the figures are the engine's, not the network's) with N client threads per row
of the table, each sending ``--rounds`` requests back to back (closed loop): prompts of mixed lengths
(``--prompts``, each stream starting at a different one), ``--tokens`` new tokens each, greedy, EOS ignored.

Per quant and stream count:
  aggregate   completion tokens of all requests / wall time from the first request to the last token
  decode      tokens of decode steps / time in decode steps (prefill chunks excluded); mean batch of those steps
  step ms     time per decode step; engine ms: what of it is not the forward (the forward timed on the device:
              CUDA events around the graph replay; on the CPU its wall time): sampling, the tokens' copy to the
              host, bookkeeping and the host's launch delays that the device waits for, i.e. the engine's overhead
  CPU alone   after the engine stops: the native expert forwards of every layer for one step of the row's mean
              batch (rounded), cache-cold, median of 3: the CPU's part of a step with nothing beside it; step ms
              less it is what the rest of a step costs (the GPU part, handshakes, the engine), where to look next
  overlap     on: the engine queues each decode step before it reads the step before's tokens (its default); off:
              one step at a time (``--overlap on,off`` runs both on the same engine, for comparison)
  TTFT        time to first token, p50 and p99 over the requests (queueing and chunked prefill included)
  roofline    decode limit of the steps that ran: per step of b rows, the bytes of the distinct experts it reads
              (expected distinct experts of b uniformly routed tokens x the stored bytes of one expert x layers) /
              the CPU read bandwidth measured in the run; roofline tok/s = rows of all steps / the sum of those
              times (the mean batch of the steps is below N while streams join, prefill or finish); GB/step is that
              of a step of N rows
  measured    the same limit from the distinct experts the steps' native forwards actually read (the pool's profile:
              active experts of every native forward of <= 16 tokens, i.e. the decode steps' layers): the
              model's routing need not be uniform (a random router spreads a batch's tokens over more experts than
              uniform draws would); "experts/layer" is their mean beside the uniform expectation
  batch 1     ``ktinject.generate`` (HF's loop, graph replay) at batch 1, prompt 32, the reference figure
  grammar     ``--grammar on`` (or ``off,on``: both, on the same engine): every request is held to a JSON schema
              (constrained decoding, ``ktinject.serve.grammar``; the ``structured`` extra) that no reply of
              ``--tokens`` tokens completes, so each still runs ``--tokens`` tokens: the same load with and without
              the per-step masks. The bench model has no tokenizer: the grammar engine gets a synthetic one of the
              model's vocabulary (the 256 bytes, then distinct 2-8 letter words), whose masks cost what a real
              vocabulary's of that size do to within the mix of its words
Under the table on CUDA runs, a verdict line per quant: the serving targets at 8 streams (overlap on), decode >= 80%
of the roofline and >= 1.2x batch 1, and with ``--grammar off,on`` constrained decoding costing <= 5% of decode
tok/s (``verdicts``).
Legend: B batch (streams decoding together), N streams, L layers.
"""
from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import threading
import time

import torch

WHOLE = 48  # layers of Qwen3-30B-A3B


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ktinject.bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16,
                   help="decoder layers of the 48 (default 16: both quants in ~3 minutes; 48 = the whole model)")
    p.add_argument("--quant", default="bf16,int4", help="comma-separated expert formats, one model build each")
    p.add_argument("--streams", type=_ints, default=[1, 4, 8, 16], help="concurrent streams per row (1,4,8,16)")
    p.add_argument("--prompts", type=_ints, default=[32, 128, 512, 1024],
                   help="prompt lengths the requests cycle through (mixed lengths)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--rounds", type=int, default=2, help="requests per stream, back to back")
    p.add_argument("--prefill-chunk", type=int, default=512, help="the engine's prefill tokens per step")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (native pool and torch); default: cores")
    p.add_argument("--bandwidth-gb", type=float, default=4.0, help="the CPU read-bandwidth probe's buffer, at "
                   "least (GB; bench.memory: >= 32x the LLC)")
    p.add_argument("--tiny", action="store_true", help="the tiny qwen3_moe test model (runs on a CPU)")
    p.add_argument("--no-graphs", action="store_true", help="decode steps eagerly (for comparison)")
    p.add_argument("--overlap", default="on",
                   help="comma-separated: on (queue each decode step ahead, the default), off (one at a time)")
    p.add_argument("--grammar", default="off",
                   help="comma-separated: off (the default), on (every request held to a JSON schema)")
    return p


#: ``--grammar on``: a schema no reply of a bench's length completes (so every request runs --tokens tokens)
BENCH_SCHEMA = {"type": "array", "minItems": 100000, "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["name", "n", "ok"], "additionalProperties": False}}


def synthetic_ll_tokenizer(vocab: int, eos: int):
    """llguidance's tokenizer over ``vocab`` synthetic tokens (see the module docstring); ``eos`` ends a reply."""
    import random

    import llguidance

    rng, words, seen = random.Random(0), [bytes([b]) for b in range(min(vocab, 256))], set()
    while len(words) < vocab:
        w = ("" if rng.random() < 0.5 else " ") + "".join(rng.choice("etaoinshrdlucmfwypvbgkqjxz")
                                                          for _ in range(rng.randint(2, 8)))
        if w not in seen:
            seen.add(w)
            words.append(w.encode())
    words[eos] = b"<eos>"

    class Vocabulary:
        eos_token_id, bos_token_id, tokens, special_token_ids = eos, None, words, [eos]

        def __call__(self, data):
            return list(data.encode() if isinstance(data, str) else data)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()), n_vocab=vocab)


def _build(args, quant: str, device: torch.device):
    import ktinject
    from ktinject.bench.model import build_model, build_tiny, set_generation_defaults
    from ktinject.bench.timing import routed_experts

    t0 = time.perf_counter()
    model = build_tiny(device) if args.tiny else build_model(args.layers, device)
    set_generation_defaults(model)
    ktinject.inject(model, gpu=str(device), quant=quant, gpu_experts_budget=0)
    cfg = model.config
    what = "tiny qwen3_moe" if args.tiny else (
        f"Qwen3-30B-A3B shapes, {cfg.num_hidden_layers} of its {WHOLE} layers"
        + ("" if cfg.num_hidden_layers == WHOLE else
           f" (every tok/s and roofline below is for these {cfg.num_hidden_layers} layers; a whole model's: about "
           f"x{cfg.num_hidden_layers / WHOLE:.2f})"))
    print(f"# {what}, {quant} experts: E={routed_experts(cfg)} top-{cfg.num_experts_per_tok}; built and injected in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    return model


def _batch1(model, device, tokens: int) -> float:
    """tok/s of ktinject.generate at batch 1 (prompt 32; the decode bench's graph row)."""
    from ktinject.bench.decode import ktinject_decode

    prompt = torch.randint(3, model.config.vocab_size, (1, 32), device=device)
    return 1.0 / ktinject_decode(model, prompt, tokens, graphs=device.type == "cuda")["s_per_token"]


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def run_streams(engine, streams: int, args, vocab: int, seed: int = 0, grammar: str | None = None) -> dict:
    """``streams`` closed-loop clients of ``args.rounds`` requests each (``grammar``: held to it); the row's figures,
    with ``step_rows``: the rows of every decode step that ran (for the roofline of those steps)."""
    from ktinject.serve.sampling import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    lengths = args.prompts
    jobs = [[torch.randint(3, vocab, (lengths[(s + r) % len(lengths)],), generator=gen).tolist()
             for r in range(args.rounds)] for s in range(streams)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=grammar is None, grammar=grammar)
    results, errors = [], []
    m = engine.metrics
    steps0, rows0, secs0 = m.decode_steps, m.decode_rows, m.decode_seconds
    step_rows: list[int] = []
    forward = [0.0]
    record = m.decode_step

    def decode_step(rows, seconds, fwd=0.0):  # the engine thread's record of each step, noted here too
        step_rows.append(rows)
        forward[0] += fwd
        record(rows, seconds, fwd)

    def client(prompts):
        for p in prompts:
            r = engine.generate(p, params)
            (errors if r.error else results).append(r)

    threads = [threading.Thread(target=client, args=(j,)) for j in jobs]
    m.decode_step = decode_step
    try:
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        del m.decode_step
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0].error}")
    steps, rows, secs = m.decode_steps - steps0, m.decode_rows - rows0, m.decode_seconds - secs0
    ttft = [r.ttft for r in results]
    return {"streams": streams, "requests": len(results), "tokens": sum(r.completion_tokens for r in results),
            "wall": wall, "aggregate": sum(r.completion_tokens for r in results) / wall,
            "decode": rows / secs if secs else float("nan"), "batch": rows / steps if steps else 0.0,
            "step_ms": 1e3 * secs / steps if steps else float("nan"), "step_rows": step_rows,
            "engine_ms": 1e3 * (secs - forward[0]) / steps if steps else float("nan"),
            "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99)}


def measured_roofline(cfg, quant: str, bandwidth: float, prof: dict) -> tuple[float, float]:
    """(tok/s, mean active experts a layer) of the decode steps' native forwards in ``prof`` (Pool.profile) if each
    took only the read of the experts it used at ``bandwidth``; (nan, nan) without any."""
    from ktinject.native import Experts

    jobs, experts, tokens = prof.get("decode_jobs", 0), prof.get("decode_experts", 0), prof.get("decode_tokens", 0)
    if not jobs:
        return float("nan"), float("nan")
    one = Experts.packed_nbytes(1, cfg.hidden_size, cfg.moe_intermediate_size, quant)  # bytes of an expert
    # the jobs are every layer's forward of each step: tokens / layers rows in experts x one bytes of reads
    return tokens / cfg.num_hidden_layers * bandwidth / (experts * one), experts / jobs


def roofline(cfg, quant: str, bandwidth: float, step_rows: list[int]) -> float:
    """tok/s of ``step_rows`` decode steps if each took only the read of its distinct experts at ``bandwidth``
    (bytes/s): rows / sum of (bytes of the step of b rows / bandwidth)."""
    from ktinject.bench.decode import expert_bytes_per_token

    if not step_rows:
        return float("nan")
    seconds = sum(expert_bytes_per_token(cfg, b, quant) * b / bandwidth for b in step_rows)
    return sum(step_rows) / seconds


def run(args, quant: str) -> list[dict]:
    from ktinject.bench.decode import expert_bytes_per_token
    from ktinject.bench.memory import measure_read_bandwidth
    from ktinject.bench.timing import cpu_expert_time, distinct_experts, profile_line, routed_experts
    from ktinject.native import default_pool
    from ktinject.serve.engine import Engine, EngineConfig

    if args.threads:
        from ktinject import native

        native.set_default_threads(args.threads)
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = _build(args, quant, device)
    cfg = model.config
    mem = measure_read_bandwidth(args.bandwidth_gb, args.threads)
    print(f"# {mem.summary()}", flush=True)
    bw = mem.best_gbs * 1e9
    one = _batch1(model, device, args.tokens)
    print(f"# batch 1, ktinject.generate: {one:.1f} tok/s", flush=True)
    if max(args.prompts) + args.tokens > cfg.max_position_embeddings:
        fit = cfg.max_position_embeddings - args.tokens
        if fit < 1:
            raise SystemExit(f"--tokens {args.tokens}: the model holds {cfg.max_position_embeddings} positions")
        args.prompts = sorted({min(p, fit) for p in args.prompts})
        print(f"# prompts cut to the model's {cfg.max_position_embeddings} positions: {args.prompts}", flush=True)
    max_context = max(args.prompts) + args.tokens
    config = EngineConfig(max_batch=max(args.streams), max_context=max_context, max_queue=max(args.streams),
                          prefill_chunk=args.prefill_chunk, graphs=False if args.no_graphs else None)
    t0 = time.perf_counter()
    engine = Engine(model, None, config, name="bench").start()
    print(f"# engine ready in {time.perf_counter() - t0:.1f} s: {engine.runner.describe()}", flush=True)
    rows = []
    rule = None
    if "on" in args.grammars:
        from ktinject.serve import grammar

        eos = min(engine.eos_ids) if engine.eos_ids else cfg.vocab_size - 1
        engine.grammars.use(synthetic_ll_tokenizer(cfg.vocab_size, eos))
        rule = grammar.json_schema(BENCH_SCHEMA, "--grammar")
        engine.check_grammar(rule, "--grammar")
    try:
        run_streams(engine, 1, argparse.Namespace(**{**vars(args), "rounds": 1, "tokens": 4}), cfg.vocab_size)
        pool = default_pool()  # the engine's native forwards run on it
        for n, overlap, held in [(n, o, g) for n in args.streams for o in args.overlaps for g in args.grammars]:
            engine.config.overlap = overlap == "on"  # read by the engine thread at each step; it is idle now
            with pool.profiling() as prof:
                row = run_streams(engine, n, args, cfg.vocab_size, seed=n, grammar=rule if held == "on" else None)
            row["measured"], row["experts"] = measured_roofline(cfg, quant, bw, prof)
            per_tok = expert_bytes_per_token(cfg, n, quant)  # bytes of distinct experts per step of n / n
            steps = row.pop("step_rows")
            row.update(quant=quant, overlap=overlap, grammar=held, roofline=roofline(cfg, quant, bw, steps),
                       batch1=one, step_gb=per_tok * n / 1e9,
                       uniform=statistics.fmean(distinct_experts(routed_experts(cfg), cfg.num_experts_per_tok, b)
                                               for b in steps) if steps else float("nan"))
            rows.append(row)
            print("# " + _line(row), flush=True)
        stats = engine.runner.stats
        print(f"# graph replays {stats.replays}, eager decode steps {stats.eager_decode}"
              + (f", capture failures: {stats.capture_failures}" if stats.capture_failures else ""), flush=True)
    finally:
        engine.stop()
        engine.runner.close()
    cpu = {}  # the CPU's part of a step alone: native forwards of every layer, the step's rows, nothing else running
    for row in rows:
        b = max(1, int(round(row["batch"])))
        if b not in cpu:
            prof: list[dict] = []
            cpu[b] = statistics.median(cpu_expert_time(model, b, passes=3, profile=prof))
            print(f"# CPU experts alone, batch {b}, a layer: {profile_line(prof[0])}", flush=True)
        row["cpu_ms"] = 1e3 * cpu[b]
    return rows


HEAD = ("| quant | streams | overlap | grammar | aggregate tok/s | decode tok/s | mean batch | step ms | engine ms "
        "| CPU experts alone ms | TTFT p50 ms | TTFT p99 ms | roofline tok/s (GB/step) | decode / roofline | experts/layer measured "
        "(uniform) | measured roofline tok/s | decode / measured | decode / batch 1 |")


def _line(r: dict) -> str:
    return (f"| {r['quant']} | {r['streams']} | {r['overlap']} | {r.get('grammar', 'off')} | {r['aggregate']:.1f} | "
            f"{r['decode']:.1f} | "
            f"{r['batch']:.1f} | {r['step_ms']:.2f} | {r['engine_ms']:.2f} | {r.get('cpu_ms', float('nan')):.2f} | "
            f"{1e3 * r['ttft_p50']:.0f} | "
            f"{1e3 * r['ttft_p99']:.0f} | "
            f"{r['roofline']:.1f} ({r['step_gb']:.2f}) | {100 * r['decode'] / r['roofline']:.0f}% | "
            f"{r.get('experts', float('nan')):.1f} ({r.get('uniform', float('nan')):.1f}) | "
            f"{r.get('measured', float('nan')):.1f} | {100 * r['decode'] / r.get('measured', float('nan')):.0f}% | "
            f"{r['decode'] / r['batch1']:.2f}x |")


#: the serving targets at 8 streams: decode >= this share of the roofline of the steps that ran, and >= this many
#: times the batch-1 figure (judged on CUDA runs of the Qwen3-30B-A3B shapes, printed under the table)
TARGET_STREAMS, TARGET_ROOF, TARGET_BATCH1 = 8, 0.80, 1.2
#: constrained decoding's target: decode tok/s with a JSON schema on every row >= this share of the same load's without
TARGET_GRAMMAR = 0.95


def verdicts(rows: list[dict]) -> list[str]:
    """One line per quant with a TARGET_STREAMS row (overlap on): the serving targets met or not, with the figures.
    Constrained decoding is judged once per quant on the mean of its rows with and without the schema (``--grammar
    off,on,off,on``: interleaved runs on one engine), each run's figure beside it."""
    out = []
    judged = [r for r in rows if r["streams"] == TARGET_STREAMS and r["overlap"] == "on"]
    runs: dict[tuple[str, str], list[float]] = {}
    for r in judged:
        runs.setdefault((r["quant"], r.get("grammar", "off")), []).append(r["decode"])
    for r in judged:
        if r.get("grammar") == "on":
            plain, held = runs.get((r["quant"], "off")), runs.pop((r["quant"], "on"), None)
            if plain and held:
                share = statistics.fmean(held) / statistics.fmean(plain)
                each = lambda v: ", ".join(f"{x:.1f}" for x in v)  # noqa: E731
                out.append(f"target: {r['quant']} at {TARGET_STREAMS} streams, a JSON schema on every row >= "
                           f"{TARGET_GRAMMAR:.0%} of decode tok/s without: "
                           f"{'met' if share >= TARGET_GRAMMAR else 'NOT met'} ({statistics.fmean(held):.1f} "
                           f"({each(held)}) vs {statistics.fmean(plain):.1f} ({each(plain)}) tok/s, "
                           f"{100 * share:.1f}%)")
            continue
        share, ratio = r["decode"] / r["roofline"], r["decode"] / r["batch1"]
        ok = share >= TARGET_ROOF and ratio >= TARGET_BATCH1
        m = r.get("measured", float("nan"))
        measured = f"; {100 * r['decode'] / m:.1f}% of the measured roofline" if math.isfinite(m) and m > 0 else ""
        out.append(f"target: {r['quant']} at {TARGET_STREAMS} streams >= {TARGET_ROOF:.0%} of the roofline and >= "
                   f"{TARGET_BATCH1}x batch 1: {'met' if ok else 'NOT met'} ({100 * share:.1f}% of "
                   f"{r['roofline']:.1f} tok/s, {ratio:.3f}x of {r['batch1']:.1f}{measured})")
    if not out:
        out.append(f"target: not judged (no run of {TARGET_STREAMS} streams with overlap on)")
    return out


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    quants = [q.strip() for q in args.quant.split(",") if q.strip()]
    if not quants or any(q not in ("bf16", "int8", "int4", "mxfp4") for q in quants):
        raise SystemExit(f"--quant {args.quant!r}: expected a comma-separated list of bf16, int8, int4, mxfp4")
    args.overlaps = [o.strip() for o in args.overlap.split(",") if o.strip()]
    if not args.overlaps or any(o not in ("on", "off") for o in args.overlaps):
        raise SystemExit(f"--overlap {args.overlap!r}: expected on, off or on,off")
    args.grammars = [g.strip() for g in args.grammar.split(",") if g.strip()]
    if not args.grammars or any(g not in ("on", "off") for g in args.grammars):
        raise SystemExit(f"--grammar {args.grammar!r}: expected off, on, or a comma-separated mix (off,on,off,on)")
    if "on" in args.grammars:
        from ktinject.serve import grammar

        if not grammar.available():
            raise SystemExit(f"--grammar on needs the grammar engine: {grammar.EXTRA}")
    rows, t0 = [], time.perf_counter()
    for q in quants:
        rows += run(args, q)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print("\n" + HEAD)
    print("|" + "---|" * HEAD.count(" | ") + "---|")
    for r in rows:
        print(_line(r))
    if torch.cuda.is_available() and not args.tiny:
        for line in verdicts(rows):
            print(line)
    layers = "tiny model" if args.tiny else f"{args.layers} of {WHOLE} layers" + (
        "" if args.layers == WHOLE else f" (tok/s and rooflines of those layers; a whole model's: x{args.layers / WHOLE:.2f})")
    print(f"\n({args.rounds} requests per stream back to back, prompts {','.join(map(str, args.prompts))} tokens "
          f"cycled, {args.tokens} new tokens each, greedy, prefill chunk {args.prefill_chunk}, threads "
          f"{args.threads or 'default'}, {layers}; roofline: the decode steps that ran, each reading the expected "
          f"distinct experts of its rows routed uniformly, at the bandwidth measured in the run; GB/step: a step of "
          f"N rows; engine ms: step ms less the forward's time on the device, the engine's overhead per step; CPU "
          f"experts alone: the native expert forwards of every layer for a step of the row's mean batch (rounded), "
          f"cache-cold, median of 3, nothing else running: step ms less this is what the rest of a step costs; TTFT "
          f"includes queueing and chunked prefill; {time.perf_counter() - t0:.0f} s in all)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
