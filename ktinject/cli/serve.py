"""``python -m ktinject.serve --model DIR``: an OpenAI-compatible server with continuous batching.

Loads the model as the chat does (same options; without --model, the built-in demo model), starts the engine
(``engine.py``: KV cache of --max-batch rows x --max-context tokens, CUDA graphs captured for every batch bucket
before the first request), then serves ``api.py``'s app with uvicorn on --host:--port (127.0.0.1 unless told
otherwise; --port 0 picks a free port). The port is bound before the model loads, so a port in use fails at once.
Needs the serve extra: ``pip install -e ".[serve]"``.
"""
from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
from pathlib import Path

from ktinject import envs
from ktinject.cli import lora_option
from ktinject.cli import options as cli
from ktinject.cli.options import CliError, positive

PROG = "ktinject.serve"
log = logging.getLogger("ktinject.serve")


def build_parser() -> argparse.ArgumentParser:
    """The server's options; docs/serving.md's options table lists each of them (tests/cli/test_serve_cli.py checks
    it)."""
    p = argparse.ArgumentParser(prog=f"python -m {PROG}",
                                description="Serve a MoE model through ktinject with an OpenAI-compatible API.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (default: $KTINJECT_API_KEY if set, else no key)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model id clients send (default: the model directory's name)")
    p.add_argument("--max-batch", type=positive, default=8,
                   help="requests decoding together = KV-cache rows (default 8); graphs for 1, 2, 4, ... up to it")
    p.add_argument("--max-context", type=positive,
                   help="tokens per request, prompt + completion (default: 4096, or less if the model has less)")
    p.add_argument("--max-queue", type=int, default=128,
                   help="requests waiting for a row before new ones get 429 (default 128)")
    p.add_argument("--prefill-chunk", type=positive, default=512,
                   help="prompt tokens prefilled per step while other requests decode (default 512)")
    p.add_argument("--prefill-pad", type=positive, metavar="N",
                   help="a prefill forward's width rounded up to a power of two up to N, a multiple of N beyond "
                        "(default 16 on a GPU: a bounded set of shapes keeps host memory flat; 1 on the CPU: none)")
    p.add_argument("--max-request-mb", type=positive, default=8,
                   help="largest request body in MiB; longer ones get 413 before they are read whole (default 8)")
    p.add_argument("--tool-call-parser", metavar="NAME", default="auto",
                   help="how tool calls are read from replies: qwen3, deepseek_v3, glm45, kimi_k2, minimax_m2, "
                        "llama4_pythonic, harmony (gpt-oss), none (text), or auto (by the model's type; the default)")
    p.add_argument("--reasoning-parser", metavar="NAME", default="auto", choices=("auto", "think", "harmony", "none"),
                   help="split reasoning into reasoning_content: think (<think> blocks), harmony (gpt-oss's analysis "
                        "channel), none, or auto (by the model's type; the default)")
    cli.add_prefix_cache_options(p)
    cli.add_model_options(p)
    lora_option.add_lora_option(p)
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly, without CUDA graphs (for comparison)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logs, the injection plan and tracebacks")
    return p


def _setup(args: argparse.Namespace) -> str:
    """Logs (ktinject.serve at INFO: a line per request; -v: DEBUG everywhere), threads, the GPU device."""
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("ktinject.serve").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    if not args.verbose:
        cli.quiet_transformers()
    return cli.device(args)


def _check_extra() -> None:
    missing = [m for m in ("fastapi", "uvicorn") if _missing(m)]
    if missing:
        raise CliError(f"{' and '.join(missing)} not installed: pip install -e \".[serve]\" (or pip install fastapi "
                       "uvicorn)")


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads (a port in use fails in a second, not after the load)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CliError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise CliError(f"cannot listen on {host}:{port}: {e.strerror} (another server there? pick --port)") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _max_context(args, model) -> int:
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(cfg, "max_position_embeddings", None) or 1 << 30
    if args.max_context is None:
        return min(4096, limit)
    if args.max_context > limit:
        raise CliError(f"--max-context {args.max_context} exceeds the model's max_position_embeddings {limit}")
    return args.max_context


def _kv_bytes(engine) -> int:
    return sum(t.numel() * t.element_size() for layer in engine.kv.layers if layer.is_initialized
               for t in (layer.keys, layer.values))


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def serve(args: argparse.Namespace) -> int:
    _check_extra()
    import uvicorn

    from ktinject.serve.api import create_app
    from ktinject.serve.engine import Engine, EngineConfig

    api_key = args.api_key or envs.get("KTINJECT_API_KEY") or None
    from ktinject.serve.tool_parsers import parser_name

    if args.tool_call_parser not in ("auto", "none"):
        try:
            parser_name(args.tool_call_parser)
        except ValueError as e:
            raise CliError(f"--tool-call-parser: {e}") from None
        if args.reasoning_parser == "harmony" and parser_name(args.tool_call_parser) != "harmony":
            raise CliError(f"--reasoning-parser harmony reads tool calls in harmony's channels: use "
                           f"--tool-call-parser harmony, auto or none (got {args.tool_call_parser})")
    if args.max_queue < 0:
        raise CliError(f"--max-queue must be >= 0, got {args.max_queue}")
    adapter = lora_option.read_adapter(args)
    sock = _bind(args.host, args.port)
    model_dir, model, tokenizer, gpu, seconds = cli.load(
        args, "Serving the ktinject demo model at {path} (a tiny model, for trying the server out).", _setup)
    merged = lora_option.merge(model, adapter, args)
    name = args.served_model_name or ("ktinject-demo" if args.model is None else Path(model_dir).name)
    aliases = (name,) + tuple(a for a in (args.model, str(model_dir)) if a and a != name)
    config = EngineConfig(max_batch=args.max_batch, max_context=_max_context(args, model), max_queue=args.max_queue,
                          prefill_chunk=args.prefill_chunk, graphs=False if args.no_graphs else None,
                          prefill_pad=args.prefill_pad, prefix_cache=cli.make_prefix_cache(args, gpu))
    engine = Engine(model, tokenizer, config, name=name).start()
    graphs = "on" if engine.runner.graphs_enabled() else "off"
    print(f"Loaded {Path(model_dir).name} in {seconds:.1f} s (gpu={gpu}, quant={cli.experts_format(model)}"
          f"{lora_option.load_text(args, merged)}); "
          f"KV cache {config.max_batch} x {config.max_context} tokens = {_kv_bytes(engine) / 2**30:.2f} GiB, "
          f"CUDA graphs {graphs} for batches {', '.join(map(str, config.buckets))}; {_prefix_text(engine)}.",
          flush=True)
    url = _url(sock)
    print(f"Serving {name!r} at {url}/v1 (OpenAI API; {'API key required' if api_key else 'no API key'}); "
          f"Ctrl-C stops.", flush=True)
    app = create_app(engine, aliases, api_key=api_key, max_body=args.max_request_mb << 20,
                     tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    # graceful wait: the requests end at the engine's next step, which may take seconds on a large model's prefill
    server = _stopping_server(uvicorn, engine)(uvicorn.Config(app, log_level="debug" if args.verbose else "info",
                                                              timeout_graceful_shutdown=30))
    # uvicorn stops on SIGINT / SIGTERM, then raises the signal again: a stop asked for is a clean exit
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    try:
        server.run(sockets=[sock])
    except (KeyboardInterrupt, SystemExit):  # the stop asked for (uvicorn raises the signal again after it)
        pass
    finally:
        engine.stop()
        sock.close()
    print(f"{PROG}: stopped", flush=True)
    return 0 if engine.failure is None else 1


def _prefix_text(engine) -> str:
    """The load line's part on the prefix cache: off, why it cannot take the model, or its tiers."""
    store = engine.prefix_cache
    if store is None:
        return "prefix cache off"
    reason = store.why_uncached(engine.model)
    if reason is not None:
        return reason
    tiers = ", ".join(f"{t.name} {t.budget / 2**30:.3g} GiB" for t in store.tiers.all)
    return f"prefix cache {tiers}, blocks of {store.block_size} tokens"


def _stopping_server(uvicorn, engine):
    """uvicorn's Server, whose first Ctrl-C / SIGTERM also ends every request the engine holds, at once and while the
    event loop still runs: waiting and streaming clients get their answer ("the engine stopped": 503, or a stream's
    error event and [DONE]) during uvicorn's graceful wait, instead of being cut off when it gives up (a 500, a
    stream without its end, tracebacks; the engine decoding on through the wait)."""

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            held = engine.counts()
            busy = held["running"] or held["waiting"]
            if self.should_exit and not busy:
                return  # a second Ctrl-C with nothing left to end: no forced exit (its tracebacks), just the first
            first = not self.should_exit
            if first:  # waiting requests end here; those in rows at the engine's next step (its own thread)
                engine.stop(timeout=0)
            super().handle_exit(sig, frame)
            if first and busy:  # a log line, not print(): a signal landing inside a write to stdout must not raise
                log.warning("stopping: ending %d running and %d waiting request(s)", held["running"],
                            held["waiting"])

    return Server


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, serve, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
