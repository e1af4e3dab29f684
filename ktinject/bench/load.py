"""Loading benchmark: ``python -m ktinject.bench load [--dir DIR] [--layers N] [--keep]``.

Writes a random bf16 checkpoint with Qwen3-30B-A3B layer shapes (hidden 2048, 32 heads / 4 KV heads of 128, 128
experts of intermediate 768, vocab 151936; N layers, default 3: ~4.9 GB) in ~1 GB shards, in the per-expert key
layout ``save_pretrained`` writes, then loads it in fresh subprocesses and prints, per way of loading: seconds,
GB read, GB/s, peak RSS growth (VmHWM after loading minus before) against the final resident size.

  stream        ktinject.from_pretrained, no packed-expert cache
  cold+cache    ktinject.from_pretrained, cache empty: packs the experts and writes the cache
  cached        ktinject.from_pretrained, cache warm: packed experts read back, no repacking
  hf+inject     transformers' from_pretrained, then ktinject.inject (the baseline: holds the experts twice)

Before each run the checkpoint's (and cache's) pages are dropped from the page cache (posix_fadvise DONTNEED),
so reads come from the disk unless ``--warm``. Devices: gpu=cuda when CUDA is available, else cpu.
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

from ktinject.bench.model import QWEN3_30B

PHASES = ("stream", "cold+cache", "cached", "hf+inject")
_POOL_ELEMS = 64 << 20  # random bf16 values reused for every tensor (content does not matter for loading)


def _checkpoint_tensors(config):
    """(key, shape) in save_pretrained's order and naming (per-expert keys), from a meta model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for name, t in model.state_dict().items():
        leaf = name.rsplit(".", 1)[-1]
        if ".experts." in name and leaf in ("gate_up_proj", "down_proj"):
            prefix = name[: -len(leaf)]
            E, rows, cols = t.shape
            for e in range(E):
                if leaf == "gate_up_proj":
                    yield f"{prefix}{e}.gate_proj.weight", (rows // 2, cols)
                    yield f"{prefix}{e}.up_proj.weight", (rows // 2, cols)
                else:
                    yield f"{prefix}{e}.down_proj.weight", (rows, cols)
        else:
            yield name, tuple(t.shape)


def _write_shard(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> None:
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors:
        n = t.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for _, t in tensors:
            f.write(memoryview(t.view(torch.uint8).numpy()))
        os.fsync(f.fileno())


def write_checkpoint(d: Path, layers: int, shard_bytes: int = 1 << 30) -> int:
    """Write the random checkpoint; returns its tensor bytes."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(num_hidden_layers=layers, **QWEN3_30B)
    config.dtype = torch.bfloat16
    d.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(d)
    pool = (torch.randn(_POOL_ELEMS, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    shards, cur, cur_bytes, pos = [], [], 0, 0
    for key, shape in _checkpoint_tensors(config):
        n = 1
        for s in shape:
            n *= s
        if n > _POOL_ELEMS:
            t = pool.repeat(-(-n // _POOL_ELEMS))[:n].view(shape)
        else:
            pos = 0 if pos + n > _POOL_ELEMS else pos
            t = pool[pos:pos + n].view(shape)
            pos += n
        if key.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        cur.append((key, t))
        cur_bytes += n * 2
        if cur_bytes >= shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        shards.append(cur)
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(d / fname, tensors)
        for key, t in tensors:
            weight_map[key] = fname
            total += t.numel() * 2
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


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


def child(phase: str, d: Path, cache: Path, quant: str) -> dict:
    """One load in this (fresh) process; returns its figures."""
    import transformers.conversion_mapping  # noqa: F401 - one-time import costs before the baseline
    from transformers import AutoConfig, AutoModelForCausalLM

    import ktinject
    from ktinject import native
    from ktinject.injection import plan  # noqa: F401

    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d))  # imports the modeling code
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":  # the CUDA context's host memory is not the loader's
        torch.ones(1, device=dev).matmul(torch.ones(1, 1, device=dev))
    base = _hwm()
    t0 = time.perf_counter()
    if phase == "hf+inject":
        from ktinject.injection.inject import inject

        model = AutoModelForCausalLM.from_pretrained(d)
        inject(model, gpu=dev, quant=quant)
        host = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
                   if t.device.type == "cpu")
        host += sum(m.native_experts.nbytes for m in model.modules() if hasattr(m, "native_experts"))
        stats = {"bytes_read": sum(p.stat().st_size for p in d.glob("*.safetensors")), "cache": "-"}
    else:
        model = ktinject.from_pretrained(d, quant=quant, gpu=dev, cache_dir=False if phase == "stream" else cache,
                                         progress=False)
        stats = model._ktinject_load_stats
        host = stats["resident"].get("cpu", 0)
    seconds = time.perf_counter() - t0
    return {"phase": phase, "seconds": seconds, "bytes_read": stats["bytes_read"], "cache": stats["cache"],
            "peak_growth": _hwm() - base, "host": host, "device": dev}


def _run_child(phase: str, d: Path, cache: Path, warm: bool, quant: str) -> dict:
    if not warm:
        _drop_page_cache([*d.iterdir(), *(cache.rglob("*") if cache.exists() else [])])
    out = subprocess.run([sys.executable, "-m", "ktinject.bench.load", "--child", phase, "--dir", str(d),
                          "--cache", str(cache), "--quant", quant], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{phase} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ktinject.bench load", description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, help="where to write the checkpoint (default: a temporary directory)")
    ap.add_argument("--layers", type=int, default=3, help="decoder layers (1.25 GB each, plus 1.24 GB embed/head)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint (and cache) afterwards")
    ap.add_argument("--warm", action="store_true", help="do not drop the files from the page cache between runs")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    ap.add_argument("--quant", default="bf16", choices=("bf16", "int8", "int4"), help="expert quantization (default bf16)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.cache, args.quant)))
        return 0
    base = args.dir or Path(tempfile.mkdtemp(prefix="ktinject-bench-load-"))
    d, cache = base / "checkpoint", base / "cache"
    base.mkdir(parents=True, exist_ok=True)
    try:
        if not (d / "model.safetensors.index.json").is_file():
            need = args.layers * 1.26e9 + 1.25e9
            free = shutil.disk_usage(base).free
            if free < 2.2 * need:
                raise SystemExit(f"{base}: {free / 1e9:.1f} GB free, the checkpoint and cache need "
                                 f"{2.2 * need / 1e9:.1f} GB")
            t0 = time.perf_counter()
            total = write_checkpoint(d, args.layers)
            print(f"wrote {total / 1e9:.2f} GB checkpoint ({args.layers} layers, Qwen3-30B-A3B shapes) to {d} in "
                  f"{time.perf_counter() - t0:.1f} s")
        shutil.rmtree(cache, ignore_errors=True)
        print(f"quant {args.quant}; peak = VmHWM growth while loading; host = bytes resident in host memory after "
              f"loading (experts + tensors placed on the CPU)")
        for phase in args.phases.split(","):
            r = _run_child(phase, d, cache, args.warm, args.quant)
            print(f"{phase:11s} {r['seconds']:7.2f} s  {r['bytes_read'] / 1e9:6.2f} GB read  "
                  f"{r['bytes_read'] / 1e9 / r['seconds']:5.2f} GB/s  peak {r['peak_growth'] / 1e9:6.2f} GB  "
                  f"host {r['host'] / 1e9:6.2f} GB  peak - host {(r['peak_growth'] - r['host']) / 1e6:+7.0f} MB  "
                  f"cache {r['cache']:7s} [{r['device']}]", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base if args.dir is None else d, ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
