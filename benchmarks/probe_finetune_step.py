"""Where one LoRA fine-tuning step's time goes (bench finetune's ktinject row): the native base products of the
routed experts (``Experts.project``, forward and transposed, timed per call), the rest of the experts' autograd
function, and the top operators of one profiled step (torch.profiler, CPU and CUDA).

    python benchmarks/probe_finetune_step.py --layers 4 --quant int4 --seq 512 [--threads N]
"""
from __future__ import annotations

import argparse
import collections
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--quant", default="int4")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--threads", type=int)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()

    import ktinject
    from ktinject.bench import finetune_rows
    from ktinject.bench.model import build_model
    from ktinject.native.experts import Experts
    from ktinject.operators import expert_lora
    from ktinject.train.loss import causal_lm_loss
    from ktinject.train.optim import adamw

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model = build_model(args.layers, device)
    ktinject.inject(model, gpu=str(device), quant=args.quant, prefill="cpu", gpu_experts_budget=0)
    model = finetune_rows.peft_model(model, args.rank, list(finetune_rows.ATTENTION) + list(expert_lora.PROJECTIONS))
    ids = finetune_rows.batch(model.config.vocab_size, 1, args.seq, device)
    opt = adamw(finetune_rows.trainable(model), 1e-4)
    model.train()

    spent = collections.defaultdict(lambda: [0, 0.0])
    real = Experts.project

    def timed(self, which, x, experts, transpose=False, **kw):
        t0 = time.perf_counter()
        out = real(self, which, x, experts, transpose=transpose, **kw)
        s = spent[(which, transpose, x.shape[0])]
        s[0] += 1
        s[1] += time.perf_counter() - t0
        return out

    def step():
        opt.zero_grad(set_to_none=True)
        loss = causal_lm_loss(model, ids, ids)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up
    Experts.project = timed
    for _ in range(2):
        t0 = time.perf_counter()
        step()
        print(f"step {time.perf_counter() - t0:.3f} s")
    Experts.project = real
    total = sum(v[1] for v in spent.values()) / 2
    print(f"# native project: {total * 1e3:.1f} ms a step over {args.layers} layers")
    for (which, tr, rows), (n, s) in sorted(spent.items()):
        print(f"  {which:5s} {'T' if tr else ' '} rows {rows:6d}: {n // 2} calls, {s / n * 1e3:8.2f} ms a call")
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=50))


if __name__ == "__main__":
    main()
