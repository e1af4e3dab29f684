"""Probe: where does streamed prefill on CUDA differ from the float64 reference (issue 19, GPU-only error)?

For tiny bf16 models (qwen3_moe, deepseek_v3, gpt_oss; bf16 / int8 / int4 experts) on CUDA, each MoE layer's inputs
are recorded in a cpu-path forward; each layer is then run through a PrefillStreamer on those same inputs, as
    async    the real thing (copy stream, events, prefetch of the next layer)
    sync     torch.cuda.synchronize() around every dequant and grouped FFN (ordering races disappear)
    looped   bank.looped_ffn instead of torch grouped_mm (grouped_mm offsets/alignment out of the picture)
and each output's max |out - ref| / max |ref| is printed (bound: 1.5e-2), with the native CPU path's error beside.
Then one whole forward: errors of its streamed calls, tokens with a routing flip, the max logit error elsewhere.
Reading it: all columns ~0.005 -> the math and ordering are fine (a large model-level error is routing flips);
async large, sync small -> a cross-stream ordering bug; grouped large, looped small -> grouped_mm.
Usage: python3 tests/gpu/probe_prefill_bug.py
"""
from __future__ import annotations

import torch

import ktinject
from ktinject.gpu_experts import stream
from ktinject.testing import (MoeTrace, build_tiny_model, experts_reference, streamed_vs_cpu, tiny_prompts)


def err(got, ref) -> float:
    return float((got.double().cpu() - ref).abs().max() / ref.abs().max().clamp(min=1e-12))


def synced(fn):
    def call(*a, **k):
        torch.cuda.synchronize()
        out = fn(*a, **k)
        torch.cuda.synchronize()
        return out
    return call


def layers(model, calls, how: str) -> list[float]:
    s = stream.PrefillStreamer(stream.blocks_of(model), "gpu")
    s.setup()
    saved = stream.unpack_experts, stream.grouped_ffn
    if how == "looped":
        s.grouped = False
    if how == "sync":
        stream.unpack_experts, stream.grouped_ffn = synced(saved[0]), synced(saved[1])
    try:
        outs = [s(b, x, i, w)[0] for b, x, i, w, _ in calls]  # queued back to back, as in a forward
        torch.cuda.synchronize()
    finally:
        stream.unpack_experts, stream.grouped_ffn = saved
        s.close()
    return [err(o, ref) for o, ref in zip(outs, refs(calls))]


def refs(calls):
    return [experts_reference(b.native_experts, b.expert_biases if b.native_experts.bias else None, x, i, w)
            for b, x, i, w, _ in calls]


def main() -> None:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__)
    ids = tiny_prompts(2, 40, seed=1).to(dev)
    for family in ("qwen3_moe", "deepseek_v3", "gpt_oss"):
        for quant in ("bf16", "int8", "int4"):
            model = build_tiny_model(family, dtype=torch.bfloat16)
            ktinject.inject(model, gpu="cuda", quant=quant, prefill="cpu")
            with torch.no_grad():
                with MoeTrace(model) as tr:
                    model(ids)
                calls = tr.calls
                native = [err(b.native_experts(x.cpu(), i.cpu(), w.cpu()), ref)
                          for (b, x, i, w, _), ref in zip(calls, refs(calls))]
                row = {how: layers(model, calls, how) for how in ("async", "sync", "looped")}
            r = streamed_vs_cpu(model, ids, lambda m: stream.attach(m, "gpu"))
            f = r["flips"]
            fmt = lambda v: " ".join(f"{e:.4f}" for e in v)  # noqa: E731
            print(f"{family:12s} {quant}: native {fmt(native)} | async {fmt(row['async'])} | sync {fmt(row['sync'])}"
                  f" | looped {fmt(row['looped'])} || forward: calls {fmt(a for a, _ in r['calls'])}, "
                  f"flipped tokens {int(f.sum())}/{f.numel()}, max logit err elsewhere "
                  f"{float(r['tokens'][~f].max()):.4f}, everywhere {float(r['tokens'].max()):.4f}")


if __name__ == "__main__":
    main()
