"""LoRA fine-tuning tokens/s: ktinject against HF + PEFT with the experts offloaded by accelerate, and on the GPU.

    python -m ktinject.bench finetune [--rows ktinject,hf-offload,hf-gpu] [--quant bf16,int8,int4] [--layers N]
                                      [--seq 512] [--batch 1] [--steps 5] [--warmup 1] [--gpu-cap 24]
                                      [--lora-experts on|off] [--hf-checkpointing on|off] [--kernels on|off] [--tiny]

The bench model (Qwen3-30B-A3B shapes, random weights, ``ktinject.bench.model``; ``--tiny``: the tiny qwen3_moe
test model) trains a LoRA adapter (rank ``--rank`` 8) on one batch of ``--batch`` x ``--seq`` random tokens, the
same batch every step (the loss falls as the adapters fit it), ``--warmup`` untimed steps then ``--steps`` timed
ones, in the loop of ``ktinject finetune``. Rows (``ktinject.bench.finetune_rows``, ``finetune_offload``):

  ktinject QUANT  ``ktinject.inject`` with the experts in QUANT, every one on the CPU; PEFT on q/k/v/o_proj and the
                  routed experts' ``expert_gate/up/down_proj`` (``--lora-experts off``: the attention only)
  hf-offload      the same weights in the HF model, the experts beyond ``--gpu-cap`` (GiB, for the 48-layer model:
                  its share applies to --layers) offloaded to the CPU by accelerate; the baseline of the ratio
  hf-gpu          the whole HF model on the GPU: the reference

Per row: tokens/s (B x S x steps / the steps' time: forward, backward and optimizer step), ms a step, peak GPU
memory (``torch.cuda.max_memory_allocated`` over the row), the loss of the first and the last step. Then the ratio
of each ktinject row to hf-offload (target >= 3x); the ktinject rows' peak against their bound, all measured in the
same run: the inference peak (a no-grad forward of the batch) + the GPU adapters, their gradients and AdamW state +
one layer's activations (the most any decoder layer saved for the backward); and the experts' backward kernels
(``ktinject.bench.backward``, as ``bench kernels --backward`` runs them) against the memory read bound
(``ktinject.bench.memory``). With ``--layers`` below 48 every figure is of that many layers (labelled scaled). The
rows run one after another on copies of one build when the RAM holds two, else each on its own build of the same
seeded weights, freed before the next (the output says which).
"""
from __future__ import annotations

import argparse
import copy
import math
import os

import torch

from ktinject.bench import finetune_offload, finetune_rows
from ktinject.bench.model import build_model, build_tiny
from ktinject.gpu_experts.hot.settings import human_bytes

ROWS = ("ktinject", "hf-offload", "hf-gpu")
QUANTS = ("bf16", "int8", "int4")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ktinject.bench finetune", description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of rows: {', '.join(ROWS)} (default: all)")
    p.add_argument("--quant", default="bf16", help=f"the ktinject rows' expert formats, a comma list of "
                                                   f"{', '.join(QUANTS)} (one row each; default bf16)")
    p.add_argument("--layers", type=int, default=48, help="decoder layers (48 = the real model; fewer: scaled)")
    p.add_argument("--tiny", action="store_true", help="the tiny qwen3_moe test model (runs on a CPU)")
    p.add_argument("--seq", type=int, default=512, help="tokens a sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences a step")
    p.add_argument("--steps", type=int, default=5, help="timed steps a row")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them (at least 1)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha 2 x rank, no dropout)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--lora-experts", choices=("on", "off"), default="on",
                   help="LoRA on the routed experts too (default on); off: the attention projections only")
    p.add_argument("--gpu-cap", type=float, default=24.0, metavar="GIB",
                   help="GPU memory cap in GiB for hf-offload's weights (the 48-layer model's; default 24)")
    p.add_argument("--hf-checkpointing", choices=("on", "off"), default="on",
                   help="gradient checkpointing in hf-offload (default on: else the backward keeps every streamed "
                        "expert on the GPU)")
    p.add_argument("--kernels", choices=("on", "off"), default="on",
                   help="time the experts' backward kernels against the read bound (default on)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (native pool and torch); default: cores")
    return p


def _csv(text: str, known, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items or any(x not in known for x in items):
        raise SystemExit(f"--{what} {text!r}: expected a comma list of {', '.join(known)}")
    return items


def _check(args) -> None:
    for name in ("layers", "seq", "batch", "steps", "warmup", "rank"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise SystemExit(f"--lr must be a positive number, got {args.lr}")
    if not args.gpu_cap > 0:
        raise SystemExit(f"--gpu-cap must be a positive number of GiB, got {args.gpu_cap}")


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cpu_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.parameters() if t.device.type == "cpu")


class Models:
    """The rows' models: copies of one build where the RAM holds a copy and ktinject's packed experts beside it,
    else the build itself for the first row and a fresh build of the same seeded weights for each later one."""

    def __init__(self, args, device):
        self.build = (lambda: build_tiny(device)) if args.tiny else (lambda: build_model(args.layers, device))
        self.base = self.build()
        need = 3 * _cpu_bytes(self.base)   # the base, a copy, the packed experts while ktinject injects the copy
        self.copies = _available_ram() > need
        self.how = ("one build, each row on a copy of it" if self.copies else
                    f"each row on its own build of the same seeded weights, freed before the next (a copy of the "
                    f"{human_bytes(_cpu_bytes(self.base))} of CPU weights and the packed experts need "
                    f"{human_bytes(need)}: more than the {human_bytes(_available_ram())} of RAM available)")

    def __call__(self):
        if self.copies:
            return copy.deepcopy(self.base)
        model, self.base = self.base, None
        return model if model is not None else self.build()


def _fmt_loss(row) -> str:
    return f"{row.losses[0]:.4f} -> {row.losses[-1]:.4f}" if row.losses else "-"


def print_table(rows, scaled: str) -> None:
    head = ("row", f"tokens/s{scaled}", "ms/step", "peak GPU", "loss first -> last", "what")
    body = [(r.name, f"{r.tokens_s:,.1f}" if r.step_s else "n/a",
             f"{1e3 * sum(r.step_s) / len(r.step_s):,.1f}" if r.step_s else "n/a",
             human_bytes(r.peak) if r.peak is not None else "- (no GPU)", _fmt_loss(r),
             r.what + "".join(f"; {n}" for n in r.notes)) for r in rows]
    w = [max(len(x[i]) for x in body + [head]) for i in range(5)]
    line = lambda r: "| " + " | ".join(c.ljust(w[i]) if i < 5 else c for i, c in enumerate(r)) + " |"  # noqa: E731
    print("\n" + line(head))
    print("|" + "|".join("-" * (x + 2) for x in w) + "|------|")
    for r in body:
        print(line(r))


def verdict_lines(rows, args, device) -> list[str]:
    """The ratio to hf-offload and the memory bound of each ktinject row."""
    out = []
    base = next((r for r in rows if r.name == "hf-offload" and r.step_s), None)
    for r in rows:
        if not r.name.startswith("ktinject") or not r.step_s:
            continue
        if base is not None:
            ratio = r.tokens_s / base.tokens_s
            out.append(f"{r.name} / hf-offload: {ratio:.2f}x tokens/s (target >= 3x: "
                       f"{'met' if ratio >= 3 else 'not met'}{'' if device.type == 'cuda' else '; CPU-only run'})")
        b = r.bound
        if b is None or r.peak is None or b["inference"] is None:
            out.append(f"{r.name}: GPU memory bound not measured (no GPU)")
            continue
        bound = b["inference"] + b["adapters"] + b["grads"] + b["optimizer"] + b["activations"]
        out.append(f"{r.name}: peak GPU {human_bytes(r.peak)} against the bound {human_bytes(bound)} = inference "
                   f"peak {human_bytes(b['inference'])} + GPU adapters {human_bytes(b['adapters'])}, their gradients "
                   f"{human_bytes(b['grads'])} and AdamW state {human_bytes(b['optimizer'])} + one layer's "
                   f"activations {human_bytes(b['activations'])}: {'within' if r.peak <= bound else 'over'} "
                   f"({human_bytes(b['cpu_adapters'])} of adapters on the CPU); the cap "
                   f"{args.gpu_cap:g} GiB: {'within' if r.peak <= args.gpu_cap * 2**30 else 'over'}")
    return out


def kernel_lines(quants, threads: int, tiny: bool) -> list[str]:
    """``bench kernels --backward``'s table for ``quants`` (the current ISA) and each call's share of the read
    bound measured beside it."""
    from ktinject import native
    from ktinject.bench import backward
    from ktinject.bench.memory import measure_read_bandwidth

    built, repeats = (8, 1) if tiny else (32, 3)
    isa = native.isa()
    rows = backward.measure(native, quants, [isa], threads, built, repeats)
    # (--tiny: one variant over 1 GB, whatever the LLC: the code path, not the bound)
    mem = (measure_read_bandwidth(1.0, threads, 1, streams=(4,), prefetch=(0,), chunks=(0,), llc_multiple=0)
           if tiny else measure_read_bandwidth(2.0, threads, repeats))
    lines = backward.report(rows, threads, built, repeats, isa)
    what = " (--tiny: one variant, whatever the LLC: not the bound)" if tiny else ""
    lines.append(f"read bound{what}: {mem.summary()}")
    lines += [f"  backward {q} T {T}: {gb:.1f} GB/s = {100 * gb / mem.best_gbs:.0f}% of the read bound "
              f"{mem.best_gbs:.1f} GB/s" for q, T, _, _, _, _, gb in rows]
    return lines


def _run_row(name: str, quant: str | None, models, args, device, cap: int) -> finetune_rows.Row:
    """One row; a row that raises (a GPU out of memory: hf-gpu at 48 layers may not fit) is a failed row."""
    label = f"ktinject {quant}" if quant else name
    failure = None
    try:
        if name == "ktinject":
            return finetune_rows.run_ktinject(models, quant, args, device)
        if name == "hf-offload":
            return finetune_offload.run_hf_offload(models, args, device, cap)
        return finetune_rows.run_hf_gpu(models, args, device)
    except Exception as e:  # noqa: BLE001  (the other rows still run; the table says what failed)
        failure = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    finetune_rows.free(device)  # (the failed row's model went with the exception's frames)
    return finetune_rows.Row(label, failure, [], [], args.batch * args.seq)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _check(args)
    wanted = _csv(args.rows, ROWS, "rows")
    quants = _csv(args.quant, QUANTS, "quant")
    from ktinject import native

    if args.threads:
        native.set_default_threads(args.threads)
        torch.set_num_threads(args.threads)
    threads = args.threads or native.default_threads()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    scaled = "" if args.tiny or args.layers == 48 else f" ({args.layers}/48 layers: scaled)"
    model_name = "tiny qwen3_moe" if args.tiny else f"Qwen3-30B-A3B shapes, {args.layers} of 48 layers"
    cap = int(args.gpu_cap * 2**30)
    models = Models(args, device)
    print(f"# bench finetune: {model_name}, random weights; device {device}; batch {args.batch} x {args.seq} tokens; "
          f"LoRA r={args.rank} (experts {args.lora_experts}); {args.warmup} warm-up + {args.steps} timed steps; "
          f"{threads} CPU threads", flush=True)
    print(f"# models: {models.how}", flush=True)
    print(f"# GPU cap {args.gpu_cap:g} GiB: hf-offload keeps {100 * finetune_offload.resident_share(cap):.0f}% of "
          f"the layers' experts on the GPU (the share that fits the 48-layer model's weights in it); ktinject keeps "
          f"every routed expert on the CPU (training has no hot experts): its peak below", flush=True)
    rows = []
    for name, quant in [(n, q) for n in wanted for q in (quants if n == "ktinject" else [None])]:
        rows.append(_run_row(name, quant, models, args, device, cap))
        r = rows[-1]
        print(f"# {r.name}: " + (f"{r.tokens_s:,.1f} tokens/s" if r.step_s else r.what), flush=True)
    print_table(rows, scaled)
    print()
    for line in verdict_lines(rows, args, device):
        print(line)
    bad = [r.name for r in rows if not r.finite or not r.step_s]
    if bad:
        print(f"failed or non-finite loss: {', '.join(bad)}")
    if args.kernels == "on" and "ktinject" in wanted:
        print()
        print("\n".join(kernel_lines(quants, threads, args.tiny)))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
