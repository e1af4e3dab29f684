"""Row groups of ``bench decode`` beside its main flow, and the table they print into.

``compare_rows`` (``--compare``: graph decode with one speed-up undone at a time), ``coordination_rows`` (the
stream <-> pool handshake alone, by mode, pool, host wait and watch spin; on CUDA) and ``peer_rows`` (``--peer``:
llama.cpp's llama-bench on GGUFs, each quant against its GGUF type). Every row is a tuple (what, tok/s, ms/token,
note), printed as it is made (``add_row``) and once more in the closing table (``print_table``).
"""
from __future__ import annotations

from ktinject.bench import llamacpp as peer
from ktinject.bench.model import real_layers
from ktinject.bench.timing import graph_replay, ktinject_decode


def add_row(rows: list, row: tuple) -> None:
    """Keep a table row and print it at once (a run cut short still shows what it measured)."""
    rows.append(row)
    print("# " + " | ".join(x for x in row if x), flush=True)


def fmt_rate(tok_per_s):
    return "n/a" if tok_per_s is None else f"{tok_per_s:,.1f}"


def fmt_ms(s):
    return "n/a" if s is None else f"{s * 1e3:.2f}"


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
            add_row(rows, (f"compare: graph with {what}", fmt_rate(B / res["s_per_token"]),
                           fmt_ms(res["s_per_token"]), f"ktinject.generate; bare replay {fmt_ms(bare)} ms"))
        except Exception as e:  # noqa: BLE001 - a comparison failing must not hide the rest
            add_row(rows, (f"compare: graph with {what}", "failed", "", f"{type(e).__name__}: {e}"))
        finally:
            undo()
    get_runner(model, use_graphs=True, prefill_chunk=2048)  # back to the defaults (graphs captured again on use)


def coordination_rows(L: int, rows: list) -> None:
    """The decode step's stream <-> pool handshakes alone (empty tasks, ``bench.handshake``), per handshake x ``L``
    layers: memops or host functions, the expert pool or a 1-thread one, the host blocking or spinning, the pool's
    watch spin as it is or off. CUDA only."""
    from ktinject import native
    from ktinject.native import cuda_driver
    from ktinject.bench import handshake

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
            add_row(rows, (what, "", fmt_ms(hc["per_handshake_us"] * L / 1e6),
                           f"{hc['per_handshake_us']:.1f} us/handshake x {L} layers (empty tasks)"))
        except Exception as e:  # noqa: BLE001
            add_row(rows, (what, "failed", "", f"{type(e).__name__}: {e}"))
        finally:
            expert_pool.watch_spin_us = saved_spin
    cuda_driver.set_host_wait_mode("block")
    one.close()


def print_table(rows, args) -> None:
    w = max(len(r[0]) for r in rows)
    print(f"\n| {'what'.ljust(w)} | {'tok/s':>9} | {'ms/token':>9} | note")
    print(f"|{'-' * (w + 2)}|{'-' * 11}|{'-' * 11}|------")
    for what, rate, ms, note in rows:
        print(f"| {what.ljust(w)} | {rate:>9} | {ms:>9} | {note}")
    ckpt = getattr(args, "checkpoint", None)
    quant = args.quant or ("the release's" if ckpt else "bf16")
    print(f"\n(batch {args.batch}, prompt {args.prompt}, {args.tokens} decode tokens, threads "
          f"{args.threads or 'default'}, layers {'tiny' if args.tiny else args.layers}, quant {quant}"
          f"{', checkpoint ' + ckpt if ckpt else ''}{', noise ' + args.noise if args.noise else ''})", flush=True)


def peer_rows(args, ours: dict) -> list[tuple[str, str, str, str]]:
    """llama-bench's decode of --tokens tokens for each --peer-model, after ktinject's rows (the same call), and each
    quant's tok/s against its GGUF type's (``peer.PAIRS``), or against the GGUF ktinject loaded itself
    (``peer.same_file``, unscaled): a ratio only for the whole model (or x L / its layers) at batch 1."""
    print(f"# peer: {args.peer} on {args.peer_model}, decode {args.tokens} tokens (this takes a while)", flush=True)
    results, errors = peer.run_all(args, gen=args.tokens)
    rows: list = []
    for e in errors:
        add_row(rows, ("peer failed", "n/a", "", e))
    for r in results:
        if r.n_gen:
            add_row(rows, (f"{r.label} decode {r.n_gen}", f"{r.tok_s:,.1f}", fmt_ms(1 / r.tok_s),
                           peer.note(r, args) + ", batch 1"))
    same = peer.same_file(args)  # --checkpoint is the peer's GGUF: the same model, whatever its type
    real = real_layers(args)
    scale = 1 if same else args.layers / real
    for quant, (row, rate) in ours.items():
        gap = None if same else peer.missing(quant, results)
        if gap:
            add_row(rows, (f"{quant} / llama.cpp", "n/a", "", gap))
        theirs = [r for r in (results if same else peer.paired(quant, results)) if r.n_gen]
        if not theirs:
            continue
        what = f"{quant} / {theirs[0].label}"
        if args.tiny or args.batch != 1:
            add_row(rows, (what, "n/a", "", "--tiny: not the peer's model" if args.tiny else
                           f"batch {args.batch}: llama-bench decodes one sequence"))
            continue
        ratio = rate * scale / theirs[0].tok_s
        add_row(rows, (what, f"{ratio:.2f}x", "",
                       f"ktinject {quant} ({row!r}{'' if scale == 1 else f' x {args.layers}/{real} layers'}) "
                       f"{rate * scale:,.1f} tok/s vs {theirs[0].tok_s:,.1f} ({theirs[0].model}"
                       f"{', the file ktinject loaded' if same else ''})"))
    return rows
