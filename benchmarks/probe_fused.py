"""Pieces of the decode step at Qwen3-30B-A3B shapes (B 1, H 2048, 32 q heads, 4 KV heads, D 128, bf16, a
1024-slot cache), the torch ops against the Triton kernels that replace them (operators/fused*.py), each timed
inside a CUDA graph of 48 copies (helpers.timed: GPU time only, no CPU pool involved; gaps between the kernels
of one piece included, as in the decode graph):

- q/k norm + rotary + the cache write: torch ops (decode_attention.qk_norm_rope, the cache's two scatters and
  the lengths add) against fused_attn.qk_norm_rope with the cache;
- attention over the cache: bmm scores, scale, mask, softmax, cast, bmm (today's torch path) against
  fused_attn.attention (with the lengths: only the keys held are read) at 97 and 1000 keys held;
- residual add + RMSNorm: torch add and torch.rms_norm against fused_dense.add_rms_norm;
- projections: cuBLAS (F.linear, + the residual add and torch.rms_norm for o_proj) against every Triton GEMV config
  (o_proj: residual and norm fused), over 48 different weights (one per copy, as the 48 layers: no copy finds its
  weights in L2);
- the router: HF's Qwen3MoeTopKRouter against fused.router_topk (one kernel) with counts and host staging.

    python benchmarks/probe_fused.py"""
from __future__ import annotations

import itertools

import torch
from helpers import timed

from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from ktinject.decode import attention as DA
from ktinject.operators.kernels import common as fused
from ktinject.operators.kernels import attention as fused_attn
from ktinject.operators.kernels import dense as fused_dense

BF, DEV = torch.bfloat16, "cuda"


def _row(what: str, t_torch: float, t_fused: float) -> None:
    print(f"{what}: torch {t_torch:.1f} us, Triton {t_fused:.1f} us per layer "
          f"({(t_torch - t_fused) * 48 / 1000:+.2f} ms per token of 48 layers)", flush=True)


def rope_and_cache(hq=32, hk=4, D=128, L=1024) -> None:
    qkv = torch.randn(1, hq + 2 * hk, D, device=DEV, dtype=BF)
    qn, kn = torch.nn.Module(), torch.nn.Module()
    qn.weight = torch.nn.Parameter(torch.ones(D, device=DEV, dtype=BF))
    kn.weight = torch.nn.Parameter(torch.ones(D, device=DEV, dtype=BF))
    norms = (qn, kn, 1e-6)
    cos, sin = torch.randn(1, 1, D, device=DEV, dtype=BF), torch.randn(1, 1, D, device=DEV, dtype=BF)
    sign = torch.cat([torch.full((D // 2,), -1.0), torch.ones(D // 2)]).to(DEV, BF)
    K, V = torch.zeros(1, hk, L, D, device=DEV, dtype=BF), torch.zeros(1, hk, L, D, device=DEV, dtype=BF)
    lens = torch.tensor([97], device=DEV)
    idx = torch.zeros(1, 1, 1, 1, dtype=torch.int64, device=DEV)

    def torch_ops():
        qk = DA.qk_norm_rope(qkv, hq, hk, norms, cos, sin, sign)
        i = (lens.view(1, 1, 1, 1) + idx).expand(1, hk, 1, D)
        K.scatter_(2, i, qk[:, hq:].unsqueeze(2))
        V.scatter_(2, i, qkv[:, hq + hk:].unsqueeze(2))
        lens.add_(0)
        return qk

    with torch.no_grad():
        _row("q/k norm + rotary + cache write", timed(torch_ops),
             timed(lambda: fused_attn.qk_norm_rope(qkv, hq, hk, norms, cos, sin, cache=(K, V, lens))))


def attention(hq=32, hk=4, D=128, B=1) -> None:
    """At short and long caches, batch 1 and 8: the torch ops against the kernel at several keys per split."""
    G = hq // hk
    for L, held in ((1024, 97), (1024, 1000), (4096, 4000)):
        q = torch.randn(B, hq, D, device=DEV, dtype=BF)
        K, V = torch.randn(B, hk, L, D, device=DEV, dtype=BF), torch.randn(B, hk, L, D, device=DEV, dtype=BF)
        keep = torch.arange(L, device=DEV).view(1, 1, 1, L) <= held
        lens = torch.full((B,), held, device=DEV)

        def torch_ops():
            s = torch.matmul(q.view(B, hk, G, D), K.transpose(2, 3)).float()  # [B, hk, G, L]
            s.mul_(D ** -0.5)
            p = torch.softmax(torch.where(keep, s, float("-inf")), -1).to(BF)
            return torch.matmul(p, V)

        with torch.no_grad():
            t_fill = timed(lambda: lens.fill_(held))  # (one fill per copy: the kernel advances the lengths)
            t_torch = timed(torch_ops)
            ts = {kps: timed(lambda kps=kps: (lens.fill_(held), fused_attn.attention(
                q, K, V, D ** -0.5, keep, lens, keys_per_split=kps))) - t_fill for kps in (128, 256, 512, 1024)}
            best = min(ts, key=ts.get)
            print(f"attention B={B}, {held + 1} of {L} keys: torch {t_torch:.1f} us; kernel by keys per split "
                  + ", ".join(f"{k}: {t:.1f}" for k, t in ts.items())
                  + f" us (default {fused_attn.KEYS_PER_SPLIT}; best {best}: "
                  f"{(t_torch - ts[best]) * 48 / 1000:+.2f} ms per token of 48 layers against torch)", flush=True)


def norms(H=2048) -> None:
    x, r = torch.randn(1, 1, H, device=DEV, dtype=BF), torch.randn(1, 1, H, device=DEV, dtype=BF)
    w = torch.ones(H, device=DEV, dtype=BF)
    with torch.no_grad():
        _row("residual add + RMSNorm", timed(lambda: torch.rms_norm(r + x, (H,), w, 1e-6)),
             timed(lambda: fused_dense.add_rms_norm(x, r, w, 1e-6)))
        _row("RMSNorm alone", timed(lambda: torch.rms_norm(x, (H,), w, 1e-6)),
             timed(lambda: fused_dense.add_rms_norm(x, None, w, 1e-6)))


def projections() -> None:
    for what, B, N, K, res in (("o_proj + residual + norm", 1, 2048, 4096, True), ("qkv", 1, 5120, 2048, False),
                               ("o_proj + residual + norm, batch 4", 4, 2048, 4096, True)):
        ws = [torch.randn(N, K, device=DEV, dtype=BF) / K ** 0.5 for _ in range(48)]
        x = torch.randn(B, K, device=DEV, dtype=BF)
        r = torch.randn(B, N, device=DEV, dtype=BF) if res else None
        norm = (torch.ones(N, device=DEV, dtype=BF), 1e-6, False) if res else None

        def run(cfg):
            it = itertools.cycle(ws)
            if cfg is not None:
                return timed(lambda: fused_dense.linear_triton(x, next(it), None, r, cfg, norm))

            def cublas():
                y = fused_dense.linear_torch(x, next(it), None, r)
                return y if norm is None else torch.rms_norm(y, (N,), norm[0], norm[1])
            return timed(cublas)

        with torch.no_grad():
            t_cublas = run(None)
            res_t = {cfg: run(cfg) for cfg in (fused_dense.CONFIGS_1 if B == 1 else fused_dense.CONFIGS_N)}
        best = min(res_t, key=res_t.get)
        print(f"{what} [{B}, {K}] x [{N}, {K}]: cuBLAS (+ torch add, rms_norm) {t_cublas:.1f} us; Triton " + ", ".join(
            f"{c}: {t:.1f}" for c, t in res_t.items()) + f" us; best {best} "
              f"({(t_cublas - res_t[best]) * 48 / 1000:+.2f} ms per token of 48 layers)", flush=True)
        del ws


def router(E=128, H=2048, k=8) -> None:
    cfg = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=k, norm_topk_prob=True)
    m = Qwen3MoeTopKRouter(cfg).to(DEV).float()
    torch.nn.init.normal_(m.weight, std=0.02)
    x = torch.randn(1, H, device=DEV, dtype=BF)
    counts = torch.zeros(E, dtype=torch.int64, device=DEV)
    stage = (torch.zeros(1, H, dtype=BF, pin_memory=True), torch.zeros(1, k, dtype=torch.int64, pin_memory=True),
             torch.zeros(1, k, pin_memory=True))
    ones = torch.ones(k, dtype=torch.int64, device=DEV)

    def hf():  # + the statistics and the three copies it replaces
        _, w, ids = m(x.float())
        counts.index_add_(0, ids.view(-1), ones)
        stage[0].copy_(x, non_blocking=True), stage[1].copy_(ids, non_blocking=True)
        stage[2].copy_(w, non_blocking=True)

    with torch.no_grad():
        _row("router + counts + host staging", timed(hf),
             timed(lambda: fused.router_topk(x, m.weight, k, counts=counts, stage=stage)))


def main() -> None:
    """python benchmarks/probe_fused.py [PIECE ...]: all pieces, or the ones named (rope, attention, norms,
    projections, router)."""
    import sys

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    pieces = {"rope": [rope_and_cache], "attention": [attention, lambda: attention(B=8)], "norms": [norms],
              "projections": [projections], "router": [router]}
    for name in sys.argv[1:] or pieces:
        for fn in pieces[name]:
            fn()


if __name__ == "__main__":
    main()
