"""Device dequantization of streamed prefill at Qwen3-30B-A3B's expert shapes (H 2048, I 768), per quant: upload.py's
torch ops (KTINJECT_FUSED=0) against gpu_experts.dequant's one-pass kernel, both on this card, bit-compared, and the
kernel's effective bandwidth (packed bytes read + destination bytes written). A probe for the GPU machine:

    python tests/gpu/probe_dequant.py [experts]

Figures are for ``experts`` experts (default 32) and scaled to a whole 128-expert layer.
"""
from __future__ import annotations

import os
import sys

import torch

from ktinject import native
from ktinject.gpu_experts import dequant
from ktinject.gpu_experts.upload import PackedRegion, expert_layout, unpack_experts

H, I, LAYER = 2048, 768, 128


def _ms(fn, iters=10) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def main(E: int) -> None:
    g = torch.Generator().manual_seed(0)
    gate_up_w, down_w = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    for quant in ("int4", "int8", "bf16"):
        ex = native.Experts.from_hf(gate_up_w, down_w, quant=quant)
        lay = expert_layout(ex)
        buf = PackedRegion(ex).tensor.view(E, lay.expert_bytes).cuda()
        work = torch.empty(E * lay.work_bytes, dtype=torch.uint8, device="cuda")
        out, ms = {}, {}
        for env in ("0", "1"):
            os.environ["KTINJECT_FUSED"] = env
            gate_up = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device="cuda")
            down = torch.empty(E, H, I, dtype=torch.bfloat16, device="cuda")
            ms[env] = _ms(lambda: unpack_experts(buf, lay, gate_up, down, work))  # noqa: B023
            out[env] = (gate_up, down)
        os.environ.pop("KTINJECT_FUSED")
        same = torch.equal(out["0"][0], out["1"][0]) and torch.equal(out["0"][1], out["1"][1])
        moved = buf.numel() + 2 * E * 3 * I * H  # bytes read + written by the kernel
        print(f"{quant}: torch ops {ms['0']:.3f} ms, kernel {ms['1']:.3f} ms for {E} experts "
              f"(a {LAYER}-expert layer: {ms['0'] * LAYER / E:.2f} -> {ms['1'] * LAYER / E:.2f} ms), kernel "
              f"{moved / ms['1'] / 1e6:.0f} GB/s, bit-identical: {same}, kernel used: {dequant.usable(buf, *out['1'])}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 32)
