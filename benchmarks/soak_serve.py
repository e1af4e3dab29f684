"""Soak test of ktinject.serve (issue 21): N concurrent streams for M minutes, clients disconnecting mid-stream,
memory sampled throughout; pass = no error and no leak.

    python benchmarks/soak_serve.py                      # CUDA, demo model, 16 streams, 10 minutes, 100 disconnects
    python benchmarks/soak_serve.py --gpu cpu --minutes 1.5 --disconnects 20    # a short run on a CPU
    python benchmarks/soak_serve.py --bench-layers 8 --quant int4               # Qwen3-30B-A3B shapes, 8 layers
    python benchmarks/soak_serve.py --gpu cpu --minutes 1 --disconnects 10 --mix  # mixed traffic on a CPU

Each of ``--streams`` client threads sends requests back to back until the time is up: prompts of 1..--prompt-max
tokens, 8..--max-tokens new tokens, greedy or seeded sampling, some with a stop string. ``--disconnects`` of them,
spread over the first 90% of the run, go away mid-stream: after 1..max_tokens/2 tokens the client closes its
connection (HTTP mode: the server must notice and cancel) or cancels its request (engine mode). HTTP mode (the
default where FastAPI, uvicorn and httpx are installed): the OpenAI API served by uvicorn in this process, clients
over httpx (completions, and chat where the tokenizer has a template); engine mode (``--no-http``, or without
those packages, as on the GPU machine): ``Engine.submit`` / ``Request.cancel``, as the API calls them.

``--mix`` (HTTP mode only): each request is drawn from a mix of kinds instead (``soak_mix.py``), all streamed: plain
chat; chat with tools (tool_choice "auto", and "required", whose stream must end in a call whose arguments validate);
response_format json_schema (a reply that finished with "stop" must parse and validate with jsonschema; one cut by
max_tokens may not); Anthropic ``/v1/messages`` (events in order: message_start, content_block_start / delta... /
stop, message_delta, message_stop); chat with n = 4 (four choices, each finished). The grammar kinds need llguidance
and jsonschema: without them one line says so and the mix leaves out json_schema and "required". Disconnects fall
on any kind (a grammar request that ends before its client leaves gives its disconnect to a later request; one of
n = 4 may cancel up to four engine requests). The summary adds requests / errors per kind; pass also needs every
kind run at least once.

Every ``--sample-every`` seconds a row: process RSS, torch.cuda allocated / reserved, the engine's running / waiting
requests, requests done, disconnects, errors, tok/s, threads and open files. After the warm-up (the first
``--warmup`` of the run), RSS and the CUDA figures must stay flat: growth (median of the last 3 samples less the
median of the first 3 after warm-up) and the least-squares trend over the rest of the run, both within the
tolerances. Pass also needs: no request ended in error, every disconnect cancelled its request (the engine's
cancelled count), every row free at the end, the engine alive. Exit code 0 on pass, 1 on fail.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import queue
import random
import socket
import statistics
import sys
import threading
import time

import torch

import soak_mix  # (beside this script: run as a script, its folder is on sys.path)

WORDS = "the small robot wanted to learn to paint by the sea in a quiet town every morning".split()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--streams", type=int, default=16, help="concurrent clients (and the engine's --max-batch)")
    p.add_argument("--disconnects", type=int, default=100, help="clients that go away mid-stream")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between memory samples")
    p.add_argument("--warmup", type=float, default=0.2, help="share of the run before memory must be flat")
    p.add_argument("--gpu", help='device of the dense part (default "cuda" if available, else "cpu")')
    p.add_argument("--model", help="checkpoint directory (default: the demo model)")
    p.add_argument("--bench-layers", type=int, help="instead: Qwen3-30B-A3B shapes with random weights, N layers")
    p.add_argument("--quant", default="bf16", choices=["bf16", "int8", "int4"])
    p.add_argument("--prompt-max", type=int, default=300, help="longest prompt (tokens)")
    p.add_argument("--max-tokens", type=int, default=200, help="longest completion")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--prefill-pad", type=int, help="EngineConfig.prefill_pad (default: 16 on CUDA, 1 on the CPU)")
    p.add_argument("--http", action=argparse.BooleanOptionalAction, default=None,
                   help="through the HTTP API (default: where fastapi, uvicorn and httpx are installed)")
    p.add_argument("--rss-tolerance-mib", type=float, default=64.0)
    p.add_argument("--cuda-tolerance-mib", type=float, default=16.0)
    p.add_argument("--threads", type=int,
                   help="torch and expert threads (default: the library's; on the CPU torch gets 1: its OpenMP "
                        "workers spin-wait for each other, many times slower beside the client threads)")
    p.add_argument("--mix", action="store_true",
                   help="HTTP clients draw each request from a mix: plain chat, chat with tools, JSON schema, "
                        "Anthropic streaming, n = 4 (see soak_mix.py)")
    p.add_argument("--seed", type=int, default=0)
    return p


# ---- the server -------------------------------------------------------------------------------------------------
def _engine(args):
    from ktinject.serve.engine import Engine, EngineConfig

    device = args.gpu or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        from ktinject import native

        native.set_default_threads(args.threads)
        torch.set_num_threads(args.threads)
    elif device == "cpu":
        torch.set_num_threads(1)
    if args.bench_layers:
        import ktinject
        from ktinject.bench.model import build_model, set_generation_defaults

        model, tokenizer, name = build_model(args.bench_layers, torch.device(device)), None, "bench"
        set_generation_defaults(model)
        ktinject.inject(model, gpu=device, quant=args.quant, gpu_experts_budget=0)
    else:
        from ktinject.cli.chat import load_model
        from ktinject.demo import demo_model_dir

        model, tokenizer, _ = load_model(args.model or demo_model_dir(), quant=args.quant, progress=False, gpu=device)
        name = "soak"
    config = EngineConfig(max_batch=args.streams, max_context=args.max_context, max_queue=4 * args.streams,
                          prefill_chunk=args.prefill_chunk, prefill_pad=args.prefill_pad)
    return Engine(model, tokenizer, config, name=name).start(), device


def _http_server(engine):
    import uvicorn

    from ktinject.serve.api import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, engine.name), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def _sweep(engine, args) -> float:
    """Before the clock starts: a prompt of every length 1..--prompt-max, then --streams requests together, so that
    caches keyed by shape (oneDNN's primitive cache on the CPU: one entry per matrix row count, up to 1024; grow-only
    scratch and staging buffers) reach the sizes the run will ask for. Seconds it took."""
    from ktinject.serve.sampling import SamplingParams

    t0 = time.monotonic()
    two = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for n in range(1, args.prompt_max + 1):
        engine.generate([3 + n % 50] * n, two, timeout=300)
    full = SamplingParams(max_tokens=args.streams + 4, temperature=0, ignore_eos=True)
    reqs = [engine.submit([5] * args.prompt_max, full) for _ in range(args.streams)]
    while not all(r.done for r in reqs):
        time.sleep(0.05)
    return time.monotonic() - t0


def _have_http() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "httpx"))


# ---- the clients --------------------------------------------------------------------------------------------------
class Tally:
    """What the clients did (thread-safe)."""

    def __init__(self, disconnects: int, seconds: float):
        self.lock = threading.Lock()
        self.done = self.tokens = self.disconnected = self.errors = 0
        self._pending = 0  # requests that took a disconnect and have not ended yet
        self.first_errors: list[str] = []
        self.kinds: dict[str, list[int]] = {}  # kind -> [requests, errors] (--mix)
        self.extra_cancels = 0  # engine requests beyond one that a disconnect may cancel (n > 1)
        self.target, self.spread = disconnects, 0.9 * seconds
        self.t0 = time.monotonic()

    def take_disconnect(self) -> bool:
        """Whether the request starting now goes away mid-stream (spread evenly over the first 90%)."""
        with self.lock:
            due = min(self.target, int(self.target * (time.monotonic() - self.t0) / self.spread) + 1)
            if self.disconnected + self._pending < due:
                self._pending += 1
                return True
            return False

    def ended(self, tokens: int, disconnected: bool = False, error: str | None = None, kind: str | None = None,
              took: bool | None = None, extra: int = 0) -> None:
        """One request ended; ``took``: it had taken a disconnect (default: ``disconnected``) — one that ended before
        its client could leave gives it back, for a later request to take."""
        with self.lock:
            self.done += 1
            self.tokens += tokens
            if disconnected if took is None else took:
                self._pending -= 1
            if disconnected:
                self.disconnected += 1
                self.extra_cancels += extra
            if kind is not None:
                row = self.kinds.setdefault(kind, [0, 0])
                row[0] += 1
                row[1] += error is not None
            if error is not None:
                self.errors += 1
                if len(self.first_errors) < 5:
                    self.first_errors.append(error)


def _request(rng: random.Random, args, vocab: int, chat_ok: bool) -> dict:
    n = rng.randint(1, args.prompt_max)
    sampled = rng.random() < 0.5
    req = {"prompt": [rng.randrange(3, vocab) for _ in range(n)], "max_tokens": rng.randint(8, args.max_tokens),
           "temperature": 0.8 if sampled else 0.0, "seed": rng.randrange(1 << 30) if sampled else None,
           "stop": [rng.choice(WORDS)] if rng.random() < 0.2 else None, "chat": chat_ok and rng.random() < 0.25}
    return req


def _engine_client(engine, args, tally: Tally, deadline: float, seed: int) -> None:
    from ktinject.serve.sampling import SamplingParams

    rng = random.Random(seed)
    while time.monotonic() < deadline:
        r = _request(rng, args, engine.vocab_size, False)
        drop = tally.take_disconnect()
        stop = tuple(r["stop"] or ()) if engine.tokenizer is not None and not drop else ()  # drop: no early end
        params = SamplingParams(max_tokens=r["max_tokens"], temperature=r["temperature"], seed=r["seed"], stop=stop,
                                ignore_eos=drop)
        after = rng.randint(1, max(1, r["max_tokens"] // 2))
        events: queue.Queue = queue.Queue()
        try:
            req = engine.submit(r["prompt"], params, events.put)
        except Exception as e:  # noqa: BLE001 - counted and reported
            tally.ended(0, drop, f"submit: {type(e).__name__}: {e}")
            continue
        got, out = 0, None
        while True:
            out = events.get(timeout=300)
            got += len(out.token_ids)
            if drop and got >= after and not req.cancelled:
                req.cancel()
            if out.finish_reason is not None:
                break
        bad = out.finish_reason == "error" or (drop and out.finish_reason != "cancelled") or \
            (not drop and out.finish_reason not in ("stop", "length"))
        tally.ended(got, drop, f"finish {out.finish_reason}: {out.error}" if bad else None)


def _http_client(url: str, name: str, args, vocab: int, chat_ok: bool, tally: Tally, deadline: float,
                 seed: int) -> None:
    import httpx

    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=300) as client:
        while time.monotonic() < deadline:
            r = _request(rng, args, vocab, chat_ok)
            drop = tally.take_disconnect()
            after = rng.randint(1, max(1, r["max_tokens"] // 2))
            if args.mix:
                kind = rng.choice(args.mix_kinds)
                text = " ".join(rng.choice(WORDS) for _ in range(len(r["prompt"]) // 4 + 1))
                sampled = {"temperature": r["temperature"], **({"seed": r["seed"]} if r["seed"] is not None else {})}
                path, body = soak_mix.build(kind, rng, name, text, r["max_tokens"], sampled, drop, args.grammar)
                chunks, left, error = soak_mix.stream(client, kind, path, body, drop, after)
                tally.ended(chunks, left, error, kind, took=drop, extra=soak_mix.N - 1 if kind == "n4" else 0)
                continue
            body = {"model": name, "max_tokens": r["max_tokens"], "temperature": r["temperature"], "stream": True,
                    "ignore_eos": drop}
            if r["seed"] is not None:
                body["seed"] = r["seed"]
            if r["stop"] and not drop:  # a client that goes away must still be mid-stream then
                body["stop"] = r["stop"]
            if r["chat"]:
                text = " ".join(rng.choice(WORDS) for _ in range(len(r["prompt"]) // 2 + 1))
                path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
            else:
                path, body["prompt"] = "/v1/completions", r["prompt"]
            tally.ended(*_http_stream(client, path, body, drop, after))


def _http_stream(client, path: str, body: dict, drop: bool, after: int) -> tuple[int, bool, str | None]:
    """One streamed request: (chunks with text, disconnected, error or None); closes mid-stream when ``drop``."""
    chunks, finish = 0, None
    try:
        with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                return 0, drop, f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                chunks += 1
                finish = choice.get("finish_reason") or finish
                if drop and chunks >= after:
                    return chunks, True, None  # leaving the block closes the connection mid-stream
    except Exception as e:  # noqa: BLE001 - counted and reported
        return chunks, drop, f"{type(e).__name__}: {e}"
    if drop:
        return chunks, True, f"the stream ended ({finish}) before the client went away"
    return chunks, False, None if finish in ("stop", "length") else f"finish_reason {finish}"


# ---- sampling and the verdict -------------------------------------------------------------------------------------
COLUMNS = ("t s", "RSS MiB", "heap in use MiB", "cuda alloc MiB", "cuda reserved MiB", "python objects", "running",
           "waiting", "done", "disconnected", "errors", "tok/s", "threads", "fds")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]


def _heap_in_use() -> float:
    """MiB that glibc's malloc has handed out and not got back (uordblks + mmapped blocks): what the process holds,
    against RSS, which also counts freed memory malloc keeps for reuse. NaN without glibc's mallinfo2."""
    try:
        f = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return float("nan")
    f.restype = _MallInfo2
    m = f()
    return (m.uordblks + m.hblkhd) / 2**20


def _sample(engine, tally: Tally, t0: float, last: list) -> tuple:
    now = time.monotonic()
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    cuda = torch.cuda.is_available() and engine.device.type == "cuda"
    alloc = torch.cuda.memory_allocated(engine.device) / 2**20 if cuda else 0.0
    reserved = torch.cuda.memory_reserved(engine.device) / 2**20 if cuda else 0.0
    c = engine.counts()
    with tally.lock:
        done, disc, err, tokens = tally.done, tally.disconnected, tally.errors, tally.tokens
    rate = (tokens - last[1]) / (now - last[0]) if now > last[0] else 0.0
    last[:] = [now, tokens]
    return (round(now - t0, 1), round(rss, 1), round(_heap_in_use(), 1), round(alloc, 1), round(reserved, 1),
            len(gc.get_objects()), c["running"], c["waiting"], done, disc, err, round(rate, 1),
            threading.active_count(), len(os.listdir("/proc/self/fd")))


def _flat(series: list[float], times: list[float], tol: float, what: str) -> tuple[bool, str]:
    """Growth (median of the last 3 less the median of the first 3) and least-squares trend over the run, vs tol."""
    if len(series) < 4:
        return True, f"{what}: too few samples after the warm-up ({len(series)}) to judge"
    growth = statistics.median(series[-3:]) - statistics.median(series[:3])
    mt, ms = statistics.fmean(times), statistics.fmean(series)
    var = sum((t - mt) ** 2 for t in times)
    slope = sum((t - mt) * (s - ms) for t, s in zip(times, series)) / var if var else 0.0  # MiB per second
    trend = slope * (times[-1] - times[0])
    ok = growth <= tol and trend <= tol
    return ok, (f"{what}: {series[0]:.1f} -> {series[-1]:.1f} MiB after the warm-up, growth {growth:+.1f} MiB, "
                f"trend {trend:+.1f} MiB over {times[-1] - times[0]:.0f} s (tolerance {tol:g}): "
                f"{'flat' if ok else 'GROWS'}")


def _verdict(args, rows: list[tuple], engine, tally: Tally, cancelled: int) -> list[tuple[bool, str]]:
    seconds = args.minutes * 60
    after = [r for r in rows if r[0] >= args.warmup * seconds]
    times = [r[0] for r in after]
    checks = [_flat([r[1] for r in after], times, args.rss_tolerance_mib, "RSS"),
              _flat([r[2] for r in after], times, args.rss_tolerance_mib, "heap in use (malloc)")]
    if engine.device.type == "cuda":
        checks.append(_flat([r[3] for r in after], times, args.cuda_tolerance_mib, "torch.cuda allocated"))
        checks.append(_flat([r[4] for r in after], times, args.cuda_tolerance_mib, "torch.cuda reserved"))
    c = engine.counts()
    checks += [
        (tally.errors == 0, f"errors: {tally.errors}" + (f" (first: {tally.first_errors})" if tally.errors else "")),
        (tally.disconnected >= args.disconnects,
         f"disconnects mid-stream: {tally.disconnected} of {args.disconnects} asked"),
        (tally.disconnected <= cancelled <= tally.disconnected + tally.extra_cancels,
         f"requests the engine cancelled: {cancelled} (= disconnects"
         + (f", up to {tally.extra_cancels} more for n > 1)" if tally.extra_cancels else ")")),
        (c["running"] == 0 and c["waiting"] == 0 and c["free_rows"] == engine.config.max_batch,
         f"rows at the end: {c}"),
        (engine.alive and engine.failure is None, f"engine alive: {engine.alive}, failure: {engine.failure}"),
    ]
    if args.mix:
        missing = [k for k in args.mix_kinds if k not in tally.kinds]
        checks.append((not missing, f"every kind of the mix ran: {'yes' if not missing else 'not ' + str(missing)}"))
    return checks


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    http = _have_http() if args.http is None else args.http
    if args.mix and not http:
        print("# --mix needs the HTTP clients (fastapi, uvicorn and httpx installed, no --no-http)", flush=True)
        return 2
    torch.manual_seed(args.seed)
    t_load = time.monotonic()
    engine, device = _engine(args)
    if engine.tokenizer is None:
        http = False  # no text without a tokenizer: the engine's clients
    server = None
    if http:
        server, server_thread, url = _http_server(engine)
    print(f"# soak: {args.streams} streams, {args.minutes:g} min, {args.disconnects} disconnects, "
          f"{'HTTP' if http else 'engine'} clients, device {device}, model "
          f"{'bench ' + str(args.bench_layers) + ' layers' if args.bench_layers else args.model or 'demo'} "
          f"({args.quant}); ready in {time.monotonic() - t_load:.1f} s: {engine.runner.describe()}", flush=True)
    print(f"# shape sweep (prompts of 1..{args.prompt_max} tokens, then {args.streams} together) in "
          f"{_sweep(engine, args):.1f} s", flush=True)
    seconds = args.minutes * 60
    tally = Tally(args.disconnects, seconds)
    t0 = tally.t0
    deadline = t0 + seconds
    chat_ok = bool(engine.tokenizer is not None and getattr(engine.tokenizer, "chat_template", None))
    if args.mix:
        args.grammar = soak_mix.grammar_ok()
        args.mix_kinds = soak_mix.kinds(args.grammar)
        if not args.grammar:
            print("# --mix: llguidance or jsonschema is not installed: no response_format json_schema and no "
                  "tool_choice \"required\" in the mix", flush=True)
        print(f"# --mix: {', '.join(args.mix_kinds)}", flush=True)
    cancelled0 = engine.metrics.finished["cancelled"]
    clients = [threading.Thread(target=_http_client if http else _engine_client, daemon=True,
                                args=((url, engine.name, args, engine.vocab_size, chat_ok) if http else (engine, args))
                                + (tally, deadline, args.seed * 1000 + i)) for i in range(args.streams)]
    for c in clients:
        c.start()
    rows, last = [], [t0, 0]
    print("| " + " | ".join(COLUMNS) + " |", flush=True)
    k = 0
    while any(c.is_alive() for c in clients):  # after the deadline the clients finish their last requests
        k += 1
        for c in clients:
            c.join(max(0.0, t0 + k * args.sample_every - time.monotonic()))
        rows.append(_sample(engine, tally, t0, last))
        print("| " + " | ".join(map(str, rows[-1])) + " |", flush=True)
    end = time.monotonic() + 30
    while engine.counts()["running"] and time.monotonic() < end:  # the server side of the last disconnects
        time.sleep(0.05)
    time.sleep(0.5)
    checks = _verdict(args, rows, engine, tally, engine.metrics.finished["cancelled"] - cancelled0)
    print(f"\n# {tally.done} requests, {tally.tokens} tokens in {time.monotonic() - t0:.0f} s; "
          f"warm-up: the first {args.warmup * seconds:.0f} s")
    for ok, line in checks:
        print(f"# {'ok  ' if ok else 'FAIL'} {line}")
    if args.mix:
        print("# per kind (requests / errors): " + ", ".join(f"{k} {tally.kinds.get(k, [0, 0])[0]} / "
                                                            f"{tally.kinds.get(k, [0, 0])[1]}" for k in args.mix_kinds))
    passed = all(ok for ok, _ in checks)
    print(f"# soak {'PASSED' if passed else 'FAILED'}", flush=True)
    if server is not None:
        server.should_exit = True
        server_thread.join(10)
    engine.stop()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
