"""Loading benchmark: ``python -m ktinject.bench load [--format F[,F...]] [--dir DIR] [--layers N] [--keep]``.

Writes a random checkpoint with Qwen3-30B-A3B layer shapes (hidden 2048, 32 heads / 4 KV heads of 128, 128
experts of intermediate 768, vocab 151936; N layers, default 3) in each ``--format`` (``bench.checkpoints``: bf16
and fp8 safetensors with per-expert keys, GGUF Q8_0 / Q4_0 / Q4_K_M / Q6_K in llama.cpp's qwen3moe layout; bf16
3 layers: ~4.9 GB), then loads it in fresh subprocesses and prints, per format and way of loading: seconds, GB read,
GB/s, peak RSS growth (VmHWM after loading minus before) against the final resident size and against the loader's
bound (resident + one layer of the checkpoint: OK / NOT met), and the expert format the loader chose (the
checkpoint's formats, the native quant, what was quantized again and its error). Last, per GGUF format, its load
time per GB read against each safetensors format's (target: within 1.5x).

  stream        ktinject.from_pretrained, no packed-expert cache
  cold+cache    ktinject.from_pretrained, cache empty: packs the experts and writes the cache
  cached        ktinject.from_pretrained, cache warm: packed experts read back, no repacking
  hf+inject     transformers' from_pretrained, then ktinject.inject (the baseline: holds the experts twice; bf16)

Default phases: all four for ``--format bf16`` alone, else ``stream``. ``--quant`` overrides the expert format
(default: the release's, as ``from_pretrained`` picks it). ``--keep`` / ``--dir`` keep the files (``bench decode
--checkpoint``, llama-bench). Before each run the checkpoint's (and cache's) pages are dropped from the page cache
(posix_fadvise DONTNEED), so reads come from the disk unless ``--warm``. Devices: gpu=cuda when CUDA is available,
else cpu; the model bf16 whatever the format (a GGUF's default would be float32). ``--tiny``: tiny shapes
(``checkpoints.TINY``), the code path on any machine, not the speed.

``--write-only --dir DIR`` writes the checkpoints into DIR and keeps them, loading nothing: the GGUF for llama-bench
(``--peer-model``). ``--shapes qwen3_5_moe`` (with ``--write-only``, GGUF formats: ktinject's GGUF reader has no
qwen35moe) writes Qwen3.5-35B-A3B's shapes in llama.cpp's qwen35moe layout (``bench.gguf_qwen35``; ``--layers`` a
multiple of 4, default 4; 40 is the whole model, as the peer compares it), e.g.
``python -m ktinject.bench load --write-only --shapes qwen3_5_moe --layers 40 --format gguf-q4_0 --dir /tmp/peer``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ktinject.bench import checkpoints as ck
from ktinject.bench.model import DEFAULT_SHAPES

PHASES = ("stream", "cold+cache", "cached", "hf+inject")
RATIO_TARGET = 1.5  # GGUF load seconds per GB read / safetensors', at most


def _drop_page_cache(paths) -> None:
    for p in paths:
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
    return 0


def _warm_imports(d: Path) -> None:
    """The one-time imports a load pays (modeling code, the GGUF reader's packages), before the baseline."""
    import transformers.conversion_mapping  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig

    from ktinject import native  # noqa: F401
    from ktinject.injection import plan  # noqa: F401

    if d.is_file():
        import gguf  # noqa: F401
        import transformers.modeling_gguf_pytorch_utils  # noqa: F401
    config = AutoConfig.from_pretrained(d) if d.is_dir() else Qwen3MoeConfig(num_hidden_layers=1)
    if getattr(config, "quantization_config", None) is not None:  # (from_pretrained builds the model plain too)
        del config.quantization_config
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(config)


def child(phase: str, d: Path, cache: Path, quant: str | None) -> dict:
    """One load in this (fresh) process; returns its figures."""
    import ktinject
    from ktinject.cli.options import experts_format

    _warm_imports(d)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":  # the CUDA context's host memory is not the loader's
        torch.ones(1, device=dev).matmul(torch.ones(1, 1, device=dev))
    base = _hwm()
    t0 = time.perf_counter()
    if phase == "hf+inject":
        from transformers import AutoModelForCausalLM

        from ktinject.injection.inject import inject

        model = AutoModelForCausalLM.from_pretrained(d)
        inject(model, gpu=dev, quant=quant, gpu_experts_budget=0)
        host = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
                   if t.device.type == "cpu")
        host += sum(m.native_experts.nbytes for m in model.modules() if hasattr(m, "native_experts"))
        stats = {"bytes_read": sum(p.stat().st_size for p in d.glob("*.safetensors")), "cache": "-", "formats": [],
                 "experts": []}
    else:
        model = ktinject.from_pretrained(d, quant=quant, gpu=dev, cache_dir=False if phase == "stream" else cache,
                                         gpu_experts_budget=0,
                                         progress=False, dtype=torch.bfloat16)
        stats = model._ktinject_load_stats
        host = stats["resident"].get("cpu", 0)
    seconds = time.perf_counter() - t0
    return {"phase": phase, "seconds": seconds, "bytes_read": stats["bytes_read"], "cache": stats["cache"],
            "peak_growth": _hwm() - base, "host": host, "device": dev, "formats": stats["formats"],
            "requant": stats["experts"], "experts": experts_format(model)}


def _run_child(phase: str, d: Path, cache: Path, warm: bool, quant: str | None) -> dict:
    if not warm:
        files = [d] if d.is_file() else list(d.iterdir())
        _drop_page_cache([*files, *(cache.rglob("*") if cache.exists() else [])])
    cmd = [sys.executable, "-m", "ktinject.bench.load", "--child", phase, "--dir", str(d), "--cache", str(cache)]
    out = subprocess.run(cmd + (["--quant", quant] if quant else []), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{phase} of {d} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _experts_note(r: dict, quant: str | None) -> str:
    """The expert format the loader chose, from what, and what it cost."""
    chose = "--quant " + quant if quant else "the release's"
    note = f"experts {r['experts']} ({chose}); checkpoint {', '.join(r['formats']) or 'unquantized'}"
    for e in r["requant"]:
        note += (f"; quantized again {e['from']} -> {e['to']}: relative RMS error {e['rel_rms_error']:.2e}, worst "
                 f"{e['max_error_over_rms']:.2f} x RMS")
    return note


def _row(fmt: str, r: dict, layer_bytes: int) -> str:
    line = (f"{fmt:11s} {r['phase']:10s} {r['seconds']:7.2f} s  {r['bytes_read'] / 1e9:6.2f} GB read  "
            f"{r['bytes_read'] / 1e9 / max(r['seconds'], 1e-9):5.2f} GB/s  peak {r['peak_growth'] / 1e9:6.2f} GB  "
            f"host {r['host'] / 1e9:6.2f} GB  peak - host {(r['peak_growth'] - r['host']) / 1e6:+7.0f} MB")
    if r["phase"] != "hf+inject":
        bound = r["host"] + layer_bytes
        line += (f"  bound (host + one layer {layer_bytes / 1e9:.2f} GB) {bound / 1e9:6.2f} GB: "
                 f"{'OK' if r['peak_growth'] <= bound else 'NOT met'}")
    return line + f"  cache {r['cache']} [{r['device']}]"


def ratio_rows(results: dict) -> list[str]:
    """Per GGUF format against each safetensors format (their first phase in common): load seconds per GB read,
    the ratio judged against RATIO_TARGET."""
    out = []
    for g, gr in results.items():
        for s, sr in results.items():
            if g not in ck.GGUF or s not in ck.SAFETENSORS:
                continue
            phase = next((p for p in gr if p in sr and p != "hf+inject"), None)
            if phase is None:
                continue
            a, b = gr[phase], sr[phase]
            per_g, per_s = a["seconds"] / max(a["bytes_read"], 1) * 1e9, b["seconds"] / max(b["bytes_read"], 1) * 1e9
            ratio = per_g / per_s
            out.append(f"{g} / {s} ({phase}): {per_g:.2f} / {per_s:.2f} s per GB read = {ratio:.2f}x  (target: within "
                       f"{RATIO_TARGET:g}x: {'met' if ratio <= RATIO_TARGET else 'NOT met'})")
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ktinject.bench load", description=__doc__.split("\n")[0])
    ap.add_argument("--format", default="bf16", help=f"comma-separated checkpoint formats: {', '.join(ck.FORMATS)} "
                    "(default bf16)")
    ap.add_argument("--dir", type=Path, help="where to write the checkpoints (default: a temporary directory)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 3; qwen3_5_moe: 4; Qwen3-30B-A3B "
                    "bf16 1.25 GB each, plus 1.24 GB embed/head)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, choices=sorted(ck.SHAPES_FORMATS),
                    help=f"whose dimensions (default {DEFAULT_SHAPES}); qwen3_5_moe: Qwen3.5-35B-A3B's as a qwen35moe "
                    "GGUF, with --write-only")
    ap.add_argument("--write-only", action="store_true", help="write the checkpoints into --dir and keep them, load "
                    "nothing (a GGUF for llama-bench)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (the code path on any machine, not the speed)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (and caches) afterwards")
    ap.add_argument("--warm", action="store_true", help="do not drop the files from the page cache between runs")
    ap.add_argument("--phases", default=None, help=f"comma-separated subset of {','.join(PHASES)} (default: all for "
                    "--format bf16 alone, else stream)")
    ap.add_argument("--quant", default=None, choices=("bf16", "int8", "int4", "fp8", "mxfp4"),
                    help="expert format, overriding the release's (default: the release's; bf16 for bf16)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    return ap


def write_only(args, fmts) -> int:
    """--write-only: each format's checkpoint written (or found) in --dir and kept; nothing is loaded."""
    if args.dir is None:
        raise SystemExit("--write-only needs --dir DIR: where the checkpoints are written and kept")
    need = sum(ck.estimate_bytes(f, args.layers, args.tiny, args.shapes) for f in fmts
               if not ck.path_of(args.dir, f).exists())
    args.dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.dir).free
    if free < 1.1 * need:
        raise SystemExit(f"{args.dir}: {free / 1e9:.1f} GB free, the checkpoints need about {1.1 * need / 1e9:.1f} GB")
    for fmt in fmts:
        ck.ensure(args.dir, fmt, args.layers, args.tiny, log=lambda s: print(s, flush=True), shapes=args.shapes)
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.cache, args.quant)))
        return 0
    fmts = ck.parse_formats(args.format)
    if args.layers is None:
        args.layers = 3 if args.shapes == DEFAULT_SHAPES else ck.SHAPES[args.shapes].layer_multiple
    ck.check_shapes(args.shapes, fmts, args.layers)
    if args.write_only:
        return write_only(args, fmts)
    if args.shapes != DEFAULT_SHAPES:
        raise SystemExit(f"--shapes {args.shapes}: ktinject does not load these GGUF files (its reader has no "
                         "qwen35moe); add --write-only --dir DIR to write them for llama-bench")
    phases = [p.strip() for p in (args.phases or (",".join(PHASES) if fmts == ["bf16"] else "stream")).split(",")]
    if not phases or any(p not in PHASES for p in phases):
        raise SystemExit(f"--phases {args.phases!r}: expected a comma-separated subset of {','.join(PHASES)}")
    base = args.dir or Path(tempfile.mkdtemp(prefix="ktinject-bench-load-"))
    base.mkdir(parents=True, exist_ok=True)
    need = sum(ck.estimate_bytes(f, args.layers, args.tiny) for f in fmts if not ck.path_of(base, f).exists())
    if any(p in ("cold+cache", "cached") for p in phases):  # a packed cache is at most its checkpoint's size
        need += sum(ck.estimate_bytes(f, args.layers, args.tiny) for f in fmts)
    free = shutil.disk_usage(base).free
    if free < 1.1 * need:
        raise SystemExit(f"{base}: {free / 1e9:.1f} GB free, the checkpoints (and caches) need about "
                         f"{1.1 * need / 1e9:.1f} GB")
    print("peak = VmHWM growth while loading; host = bytes resident in host memory after loading (experts + tensors "
          "placed on the CPU); bound = host + the checkpoint's largest layer (the loader's)", flush=True)
    results: dict[str, dict[str, dict]] = {}
    lines = []
    try:
        for fmt in fmts:
            c = ck.ensure(base, fmt, args.layers, args.tiny, log=lambda s: print(s, flush=True))
            cache = base / f"cache-{fmt}"
            shutil.rmtree(cache, ignore_errors=True)
            for phase in phases:
                if phase == "hf+inject" and fmt != "bf16":
                    print(f"{fmt:11s} {phase:10s} skipped: the baseline is of bf16 checkpoints (transformers builds "
                          f"its own quantized modules for {fmt}, or dequantizes a GGUF to float)", flush=True)
                    continue
                r = _run_child(phase, c.path, cache, args.warm, args.quant)
                results.setdefault(fmt, {})[phase] = r
                lines += [_row(fmt, r, c.layer_bytes), "    " + _experts_note(r, args.quant)]
                print(lines[-2] + "\n" + lines[-1], flush=True)
        ratios = ratio_rows(results)
        print(f"\n# load, {args.layers} layers, {'tiny' if args.tiny else 'Qwen3-30B-A3B'} shapes, "
              f"{'warm' if args.warm else 'cold'} page cache, checkpoints in {base}\n" + "\n".join(lines + ratios),
              flush=True)
    finally:
        if not args.keep:
            for fmt in fmts:
                p = ck.path_of(base, fmt)
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                shutil.rmtree(base / f"cache-{fmt}", ignore_errors=True)
            if args.dir is None:
                shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
