"""Pieces of the decode step at Qwen3-30B-A3B shapes, each timed inside a CUDA graph of 48 copies
(tests/gpu/probe_ops.timed; GPU time only, no CPU pool involved, so a loaded host does not move it):
- q/k norm + rotary (B 1, 32 q heads, 4 KV heads, D 128, bf16): torch ops (decode_attention.qk_norm_rope) against
  the Triton kernel (fused.qk_norm_rope);
- scores -> probabilities (4 KV heads x 8 query heads, a 1024-key static cache, bool mask): torch ops (mul_,
  where, softmax, cast to bf16) against fused.masked_softmax;
- the router (E 128, H 2048, top 8, float32): HF's Qwen3MoeTopKRouter forward against moe.fast_routing (Triton's
  fused.router_topk, and its torch ops with KTINJECT_FUSED=0).

    PYTHONPATH=$PWD:$PWD/tests/gpu python tests/gpu/probe_fused.py"""
from __future__ import annotations

import os

import torch
from probe_ops import timed

from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from ktinject.operators import decode_attention as DA, fused
from ktinject.operators.moe import fast_routing


def main() -> None:
    B, hq, hk, D = 1, 32, 4, 128
    dt, dev = torch.bfloat16, "cuda"
    qkv = torch.randn(B, hq + 2 * hk, D, device=dev, dtype=dt)
    qn, kn = torch.nn.Module(), torch.nn.Module()
    qn.weight = torch.nn.Parameter(torch.ones(D, device=dev, dtype=dt))
    kn.weight = torch.nn.Parameter(torch.ones(D, device=dev, dtype=dt))
    norms = (qn, kn, 1e-6)
    cos, sin = torch.randn(B, 1, D, device=dev, dtype=dt), torch.randn(B, 1, D, device=dev, dtype=dt)
    sign = torch.cat([torch.full((D // 2,), -1.0), torch.ones(D // 2)]).to(dev, dt)
    with torch.no_grad():
        t_torch = timed(lambda: DA.qk_norm_rope(qkv, hq, hk, norms, cos, sin, sign))
        t_fused = timed(lambda: fused.qk_norm_rope(qkv, hq, hk, norms, cos, sin))
    print(f"q/k norm + rotary per layer: torch ops {t_torch:.1f} us, Triton kernel {t_fused:.1f} us "
          f"({(t_torch - t_fused) * 48 / 1000:.2f} ms per token of 48 layers)")
    sc = torch.randn(B, hk, hq // hk, 1024, device=dev)
    keep = torch.rand(B, 1, 1, 1024, device=dev) < 0.5

    def torch_softmax():
        t = sc.clone().mul_(D ** -0.5)  # (the clone stands for the scores bmm's fresh output)
        return torch.softmax(torch.where(keep, t, float("-inf")), dim=-1).to(dt)

    with torch.no_grad():
        t_clone = timed(lambda: sc.clone())
        t_sm = timed(torch_softmax) - t_clone
        t_fsm = timed(lambda: fused.masked_softmax(sc, D ** -0.5, keep, dt))
    print(f"scores -> probabilities per layer: torch ops {t_sm:.1f} us, Triton kernel {t_fsm:.1f} us "
          f"({(t_sm - t_fsm) * 48 / 1000:.2f} ms per token of 48 layers)")
    cfg = Qwen3MoeConfig(hidden_size=2048, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
    router = Qwen3MoeTopKRouter(cfg).to(dev).float()
    torch.nn.init.normal_(router.weight, std=0.02)
    x = torch.randn(B, 2048, device=dev, dtype=dt)
    with torch.no_grad():
        t_hf = timed(lambda: router(x.float()))
        t_fast = timed(lambda: fast_routing(router, x))
        saved = os.environ.get("KTINJECT_FUSED")
        os.environ["KTINJECT_FUSED"] = "0"
        t_torch_fast = timed(lambda: fast_routing(router, x))
        if saved is None:
            os.environ.pop("KTINJECT_FUSED")
        else:
            os.environ["KTINJECT_FUSED"] = saved
    print(f"router per layer: HF {t_hf:.1f} us, fast routing {t_fast:.1f} us (in torch ops {t_torch_fast:.1f} us) "
          f"({(t_hf - t_fast) * 48 / 1000:.2f} ms per token of 48 layers)")


if __name__ == "__main__":
    main()
