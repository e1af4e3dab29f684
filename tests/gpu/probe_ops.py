"""Per-layer decode-step GPU ops, each timed inside a CUDA graph of 48 copies (a probe for the GPU machine)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, n=48, iters=20) -> float:
    """Microseconds per call of fn, captured n times in one graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (iters * n)


def main() -> None:
    dev = "cuda"
    bf = torch.bfloat16
    for L in (1024, 4096):
        q = torch.randn(1, 4, 8, 128, device=dev, dtype=bf)
        k = torch.randn(1, 4, L, 128, device=dev, dtype=bf)
        v = torch.randn(1, 4, L, 128, device=dev, dtype=bf)
        mask = torch.zeros(1, 1, 1, L, dtype=torch.bool, device=dev)
        mask[..., :100] = True
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                         ("math", SDPBackend.MATH), ("default", None)):
            def f(be=be):
                if be is None:
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                with sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            try:
                print(f"sdpa L={L} {name}: {timed(f):.1f} us")
            except Exception as e:  # noqa: BLE001
                print(f"sdpa L={L} {name}: {type(e).__name__}: {str(e)[:100]}")
        addm = torch.zeros(1, 1, 1, L, dtype=bf, device=dev)
        addm[..., 100:] = float("-inf")

        def manual():
            s = torch.baddbmm(addm.view(1, 1, L).expand(4, 8, L), q.view(4, 8, 128), k.view(4, L, 128).transpose(1, 2),
                              alpha=128 ** -0.5)
            return torch.bmm(torch.softmax(s.float(), -1).to(bf), v.view(4, L, 128))
        print(f"sdpa L={L} manual baddbmm/softmax/bmm: {timed(manual):.1f} us")
    x = torch.randn(1, 1, 32, 128, device=dev, dtype=bf)
    cos = torch.randn(1, 1, 1, 128, device=dev, dtype=bf)
    sin = torch.randn(1, 1, 1, 128, device=dev, dtype=bf)
    ssin = torch.cat([-sin[..., :64], sin[..., 64:]], -1)

    def hf_rope():
        x1, x2 = x[..., :64], x[..., 64:]
        return x * cos + torch.cat((-x2, x1), -1) * sin

    def roll_rope():
        return torch.addcmul(x * cos, x.roll(64, -1), ssin)
    print(f"rope hf: {timed(hf_rope):.1f} us; roll/addcmul: {timed(roll_rope):.1f} us")
    p = torch.randn(1, 128, device=dev).softmax(-1)
    print(f"topk sorted: {timed(lambda: torch.topk(p, 8, -1)):.1f} us; "
          f"unsorted: {timed(lambda: torch.topk(p, 8, -1, sorted=False)):.1f} us")
    h = torch.randn(1, 2048, device=dev, dtype=bf)
    wq = torch.randn(4096, 2048, device=dev, dtype=bf)
    wk = torch.randn(512, 2048, device=dev, dtype=bf)
    wv = torch.randn(512, 2048, device=dev, dtype=bf)
    wqkv = torch.cat([wq, wk, wv])
    print(f"q,k,v proj: {timed(lambda: (F.linear(h, wq), F.linear(h, wk), F.linear(h, wv))):.1f} us; "
          f"fused qkv: {timed(lambda: F.linear(h, wqkv)):.1f} us")
    wr = torch.randn(128, 2048, device=dev)
    print(f"router f32 linear+softmax+topk: "
          f"{timed(lambda: torch.topk(F.linear(h.float(), wr).softmax(-1), 8, -1)):.1f} us")
    nw = torch.randn(2048, device=dev, dtype=bf)
    print(f"rms_norm: {timed(lambda: torch.rms_norm(h, (2048,), nw, 1e-6)):.1f} us; "
          f"empty graph node (fill): {timed(lambda: h.fill_(0)):.1f} us")


if __name__ == "__main__":
    main()
