"""The Triton kernels of the decode step (operators/fused*.py) against float64 torch and the torch ops they replace.

They run on CUDA (the GPU machine: ``pytest -m gpu``) or, with ``TRITON_INTERPRET=1``, in Triton's interpreter on
CPU tensors (no GPU needed; programs run one after another, so the last-program combine is checked for its
arithmetic there and for its ordering on the GPU). Skipped where neither is possible (CI without Triton). Shapes are
awkward on purpose: head dims 16/20/24, lengths not multiples of the 64-key blocks, one key, rows at different
lengths, batch 3, grouped and plain multi-head attention, masks longer than the keys.

The interpreter (checked with Triton 3.6 and 3.9) rounds float32 -> bf16 by truncation and multiplies bf16 dot
operands as integers; ``dev`` patches both to what the GPU does (round to nearest even; bf16 products in float32).
"""
from __future__ import annotations

import pytest
import torch

from ktinject.decode import attention as DA
from ktinject.gpu_experts.prefill import host_io as hostio
from ktinject.operators.kernels import common as fused
from ktinject.operators.kernels import attention as FA
from ktinject.operators.kernels import dense as FD

pytestmark = pytest.mark.gpu
BF = torch.bfloat16


def _patch_interpreter(monkeypatch) -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as I

    def as_f32(h):
        return torch.from_numpy(np.ascontiguousarray(h.data).view(np.int16)).view(BF).float().numpy()

    cast = I.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(BF).view(torch.int16).numpy().view(np.uint16)
            return I.TensorHandle(bits, tl.bfloat16)
        return cast(self, src, dst_type)

    dot = I.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a, b = I.TensorHandle(as_f32(a), tl.float32), I.TensorHandle(as_f32(b), tl.float32)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(I.InterpreterBuilder, "cast_impl", cast_impl)
    monkeypatch.setattr(I.InterpreterBuilder, "create_dot", create_dot)


def _shuffle_programs(monkeypatch, seed: int) -> None:
    """The interpreter runs a grid's programs one after another in a fixed order; this runs them in a seeded
    random order, so that a kernel whose result depends on which program comes last (the last-program pattern,
    attention's lengths) is checked against more than one order."""
    import itertools
    import random

    from triton.runtime import interpreter as I

    b = I.interpreter_builder
    set_dim, set_idx = b.set_grid_dim, b.set_grid_idx
    order = {}

    def set_grid_dim(x, y, z):
        cells = list(itertools.product(range(x), range(y), range(z)))
        perm = cells[:]
        random.Random(seed + len(cells)).shuffle(perm)
        order.clear()
        order.update(zip(cells, perm))
        return set_dim(x, y, z)

    monkeypatch.setattr(b, "set_grid_dim", set_grid_dim)
    monkeypatch.setattr(b, "set_grid_idx", lambda x, y, z: set_idx(*order[(x, y, z)]))


@pytest.fixture
def dev(monkeypatch):
    if fused.triton_language() is None:
        pytest.skip("Triton is not installed")
    if fused.interpreting():
        _patch_interpreter(monkeypatch)
        return "cpu"
    if not torch.cuda.is_available() or not fused.available(torch.empty(1, device="cuda")):
        pytest.skip("needs CUDA with Triton, or TRITON_INTERPRET=1")
    return "cuda"


def _close_bf16(got, want, equal_share=0.99):
    """bf16 results of the same roundings: none off by more than one ulp of its row's largest, nearly all equal."""
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs().amax(-1, keepdim=True) * 2.0 ** -7).all(), float(diff.max())
    assert (diff == 0).float().mean() >= equal_share


def _norm_module(D, dtype, dev, g):
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter((1 + 0.1 * torch.randn(D, generator=g)).to(dev, dtype))
    return m


@pytest.mark.parametrize("dtype", [torch.float32, BF])
@pytest.mark.parametrize("with_norms", [True, False])
def test_qk_norm_rope_and_cache_write(dev, dtype, with_norms):
    """The kernel against decode_attention's torch ops; with a cache, k and v land at each row's length (none for a
    row whose length is the cache's end) and q alone comes back."""
    g = torch.Generator().manual_seed(0)
    for B, hq, hk, D, cs_batch in ((1, 8, 2, 16, 1), (3, 6, 2, 24, 3), (3, 4, 4, 20, 1)):
        qkv = (torch.randn(B, hq + 2 * hk, D, generator=g) * 3).to(dev, dtype)
        norms = (_norm_module(D, dtype, dev, g), _norm_module(D, dtype, dev, g), 1e-6) if with_norms else None
        ang = torch.rand(cs_batch, 1, D // 2, generator=g) * 100
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(dev, dtype)
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(dev, dtype)
        sign = torch.cat([torch.full((D // 2,), -1.0), torch.ones(D // 2)]).to(dev, dtype)
        want = DA.qk_norm_rope(qkv, hq, hk, norms, cos, sin, sign)  # [B, Hq + Hkv, D]
        got = FA.qk_norm_rope(qkv, hq, hk, norms, cos, sin)
        check = (lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)) if dtype == torch.float32 \
            else _close_bf16
        assert got.shape == want.shape and got.dtype == dtype
        check(got, want)
        L = 37
        K = torch.zeros(B, hk, L, D, dtype=dtype, device=dev)
        V = torch.zeros_like(K)
        lens = torch.tensor([5, L, 0][:B], device=dev)  # row 1 (when there) is full: nothing written
        q = FA.qk_norm_rope(qkv, hq, hk, norms, cos, sin, cache=(K, V, lens))
        assert q.shape == (B, hq, D) and torch.equal(q, got[:, :hq]) and lens.tolist() == [5, L, 0][:B]
        for b in range(B):
            n = int(lens[b])
            written = torch.zeros(L, dtype=torch.bool)
            if n < L:
                written[n] = True
                assert torch.equal(K[b, :, n], got[b, hq:]) and torch.equal(V[b, :, n], qkv[b, hq + hk:])
            assert not K[b][:, ~written].any() and not V[b][:, ~written].any()


@pytest.mark.parametrize("dtype", [torch.float32, BF])
@pytest.mark.parametrize("with_norms", [True, False])
@pytest.mark.parametrize("kps", [None, 16])
def test_rope_attention_equals_the_two_kernels(dev, dtype, with_norms, kps):
    """The one-kernel norm + rotary + cache write + attention against qk_norm_rope (with the cache) then
    attention: the same cache contents (the new k and v at each row's length; none for a full row), lengths
    advanced alike, the same output (one split a KV head, and several: the new key in the last one)."""
    g = torch.Generator().manual_seed(3)
    for B, hq, hk, D, L, lens, cs_batch in ((1, 8, 2, 16, 40, [5], 1), (3, 6, 2, 24, 130, [0, 130, 129], 3),
                                            (2, 4, 4, 20, 300, [299, 17], 1), (1, 32, 4, 128, 200, [150], 1)):
        qkv = (torch.randn(B, hq + 2 * hk, D, generator=g) * 3).to(dev, dtype)
        norms = (_norm_module(D, dtype, dev, g), _norm_module(D, dtype, dev, g), 1e-6) if with_norms else None
        ang = torch.rand(cs_batch, 1, D // 2, generator=g) * 100
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(dev, dtype)
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(dev, dtype)
        K = torch.randn(B, hk, L, D, generator=g).to(dev, dtype)
        V = torch.randn(B, hk, L, D, generator=g).to(dev, dtype)
        mask = (torch.rand(B, 1, 1, L, generator=g) < 0.8).to(dev)
        mask[..., 0] = True
        lengths = torch.tensor(lens, device=dev)
        K2, V2, lengths2 = K.clone(), V.clone(), lengths.clone()
        q = FA.qk_norm_rope(qkv, hq, hk, norms, cos, sin, cache=(K2, V2, lengths2))
        want = FA.attention(q, K2, V2, D ** -0.5, mask, lengths2, keys_per_split=kps)
        got = FA.rope_attention(qkv, hq, norms, cos, sin, (K, V, lengths), D ** -0.5, mask, keys_per_split=kps)
        assert torch.equal(lengths, lengths2) and torch.equal(V, V2)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        # on CUDA the norm's sum of squares over a [G, D] tile may round apart from the one-row kernel's (an ulp of
        # the normed k); elsewhere the cache is untouched
        torch.testing.assert_close(K, K2, **tol)
        new = torch.zeros(B, L, dtype=torch.bool)
        for b, n in enumerate(lens):
            if n < L:
                new[b, n] = True
        assert torch.equal(K.transpose(1, 2)[~new], K2.transpose(1, 2)[~new])
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, **tol)
        if dev == "cpu":  # the interpreter sums the norm's squares in one order for both kernels
            assert torch.equal(got, want) and torch.equal(K, K2)
    with pytest.raises(ValueError, match="Hq \\+ 2 Hkv"):
        FA.rope_attention(qkv[:, 1:], hq, norms, cos, sin, (K, V, lengths), 0.1)


def _attention_case(g, B, hq, hk, D, L, dtype, dev, mask_kind, lens):
    q = torch.randn(B, hq, D, generator=g).to(dev, dtype)
    k = torch.randn(B, hk, L, D, generator=g).to(dev, dtype)
    v = torch.randn(B, hk, L, D, generator=g).to(dev, dtype)
    keep = torch.rand(B, 1, 1, L + 5, generator=g) < 0.7
    keep[..., 0] = True
    keep = keep.to(dev)
    mask = {"none": None, "bool": keep, "float": torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)}[mask_kind]
    if mask is not None:
        mask = mask[..., :L]  # as decode_forward cuts a longer mask: stride(0) > L
    lengths = None if lens is None else torch.tensor(lens, device=dev)
    return q, k, v, mask, lengths


@pytest.mark.parametrize("dtype", [torch.float32, BF])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
@pytest.mark.parametrize("kps, shuffled", [(None, False), (16, False), (16, True)])
def test_attention_matches_float64(dev, dtype, mask_kind, kps, shuffled, monkeypatch):
    """One kernel against float64 attention, with one split a KV head (the default's keys per split at these
    lengths) and with several (16 keys per split, raised to the key block: splits + last-program combine); lengths
    bound the keys read and come back advanced by one; the counters are back at zero. In the interpreter also
    with the programs in a shuffled order (on CUDA the order is the hardware's)."""
    if shuffled:
        if dev != "cpu":
            pytest.skip("program order is shuffled in Triton's interpreter only")
        _shuffle_programs(monkeypatch, seed=7)
    g = torch.Generator().manual_seed(1)
    cases = [(1, 8, 2, 16, 40, [5]), (3, 6, 2, 24, 130, [0, 77, 129]), (2, 4, 4, 20, 70, None),
             (1, 2, 1, 16, 1, [0]), (2, 8, 2, 16, 300, [299, 130]),
             (1, 2, 1, 16, 256, [255]), (1, 2, 1, 16, 300, [299])]  # (16 keys a split, fp32) 8 and 7 of 8 splits
    if dev == "cuda" and dtype == BF and mask_kind == "bool":  # the model's shapes, many splits, long rows
        cases += [(1, 32, 4, 128, 1024, [97]), (8, 32, 4, 128, 4096, [4095, 0, 1, 63, 64, 65, 2000, 3333]),
                  (3, 32, 4, 128, 32768, [30000, 5, 12000])]
    for B, hq, hk, D, L, lens in cases:
        q, k, v, mask, lengths = _attention_case(g, B, hq, hk, D, L, dtype, dev, mask_kind, lens)
        ref_len = None if lengths is None else lengths.clone()
        want = FA.attention_reference(q, k, v, D ** -0.5, mask, ref_len)
        got = FA.attention(q, k, v, D ** -0.5, mask, lengths, keys_per_split=kps)
        assert got.shape == (B, hq * D) and got.dtype == dtype
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"{(B, hq, hk, D, L, lens)}: {m}")
        if lengths is not None:
            assert torch.equal(lengths, ref_len)
        assert not fused.workspace("attn_counters", 1, torch.int32, torch.device(dev)).any()


def test_attention_replays_in_a_cuda_graph(dev):
    """Captured once, replayed at growing lengths: each replay reads one key more and advances the lengths."""
    if dev != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    g = torch.Generator().manual_seed(2)
    q, k, v, mask, lengths = _attention_case(g, 2, 32, 4, 128, 512, BF, dev, "bool", [10, 200])
    start = lengths.clone()
    FA.attention(q, k, v, 0.1, mask, lengths)  # makes the workspaces (outside capture)
    lengths.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = FA.attention(q, k, v, 0.1, mask, lengths)
    lengths.copy_(start)
    for i in range(3):
        ref_len = lengths.clone()
        want = FA.attention_reference(q, k, v, 0.1, mask, ref_len)
        graph.replay()
        torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=1e-2)
        assert torch.equal(lengths, start + i + 1)


@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_add_rms_norm_matches_the_modules(dev, dtype):
    """residual + x and its norm against HF's RMSNorm classes (two roundings), GptOssRMSNorm and FusedRMSNorm (one)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    from ktinject.operators.norm import FusedRMSNorm, fuse

    g = torch.Generator().manual_seed(3)
    for H, R in ((40, 1), (100, 3), (2048, 2)):
        x, r = (torch.randn(R, 1, H, generator=g).to(dev, dtype) * 4 for _ in range(2))
        for cls in (Qwen3MoeRMSNorm, GptOssRMSNorm, FusedRMSNorm):
            m = (Qwen3MoeRMSNorm if cls is FusedRMSNorm else cls)(H, eps=1e-6)
            torch.nn.init.normal_(m.weight, 1.0, 0.1)
            m = fuse(m) if cls is FusedRMSNorm else m
            m = m.to(dev, dtype)
            s, y = FD.add_rms_norm(x, r, m.weight, 1e-6, round_twice=cls is Qwen3MoeRMSNorm)
            with torch.no_grad():
                want_s = r + x
                want_y = m(want_s)
            assert torch.equal(s, want_s)
            if dtype == torch.float32:
                torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
            else:
                _close_bf16(y, want_y, 0.98)
        s, y = FD.add_rms_norm(x, None, m.weight, 1e-6)  # the norm alone
        assert s is x and torch.equal(y, FD.add_rms_norm(x.clone(), torch.zeros_like(x), m.weight, 1e-6)[1])
        assert torch.equal(FD.add_rms_norm(x, r, None, 0.0)[0], r + x)  # the sum alone


@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_linear_matches_float64_and_cublas(dev, dtype):
    """y = x W^T (+ bias) (+ residual) (and its RMSNorm by the last program), every candidate config, one row and
    several, sizes off the tiles."""
    g = torch.Generator().manual_seed(4)
    shapes = [(1, 40, 70, False, True), (3, 33, 100, True, True), (2, 16, 64, False, False), (1, 7, 9, True, False)]
    if dev == "cuda":
        shapes += [(1, 2048, 4096, False, True), (1, 5120, 2048, False, False), (4, 2048, 4096, False, True)]
    for B, N, K, bias, res in shapes:
        x = torch.randn(B, K, generator=g).to(dev, dtype)
        W = (torch.randn(N, K, generator=g) / K ** 0.5).to(dev, dtype)
        b = torch.randn(N, generator=g).to(dev, dtype) if bias else None
        r = torch.randn(B, N, generator=g).to(dev, dtype) if res else None
        want = FD.linear_torch(*(None if t is None else t.double() for t in (x, W, b, r)))
        cublas = FD.linear_torch(x, W, b, r)
        err_torch = (cublas.double() - want).abs().max()
        configs = FD.CONFIGS_1 if B == 1 else FD.CONFIGS_N
        for cfg in configs if N * K >= FD.MEASURE_FROM else configs[:2] if dev == "cuda" else (
                (16, 32, 4), (32, 16, 4), (8, 32, 4, True)):  # (True: RED, tiles summed as they come)
            got, none = FD.linear_triton(x, W, b, r, cfg)
            assert got.shape == (B, N) and got.dtype == dtype and none is None
            err = (got.double() - want).abs().max()
            # float32: the kernel sums K products in its own order (cuBLAS in another): 1e-5 at K=1024, growing as
            # sqrt(K) (a float32 product over K=4096 in one order differed by 1.2e-5); TF32 would be ~1e-3
            tol = 1e-5 * max(1.0, K / 1024) ** 0.5 if dtype == torch.float32 else 2 ** -8 * want.abs().max()
            assert err <= 2 * err_torch + tol, (cfg, err)
            norm = ((1 + 0.1 * torch.randn(N, generator=g)).to(dev, dtype), 1e-6, cfg[0] == 16)
            again, normed = FD.linear_triton(x, W, b, r, cfg, norm)  # + the norm by the last program
            assert torch.equal(again, got)
            want_n = FD.add_rms_norm(got, None, *norm)[1]
            if dtype == torch.float32:
                torch.testing.assert_close(normed, want_n, rtol=1e-5, atol=1e-5)
            else:
                _close_bf16(normed, want_n, 0.98)
        if dev == "cuda" and N * K >= FD.MEASURE_FROM:  # measured once: cuBLAS or the fastest config
            got, _ = FD.linear(x, W, b, r)
            cfg = FD.choose(x, W, b, r)
            assert torch.equal(got, cublas if cfg is None else FD.linear_triton(x, W, b, r, cfg)[0])
    cpu = [None if t is None else t.cpu() for t in (x, W, b, r)]
    assert FD.linear(*cpu, norm=(W.cpu()[0], 1e-6, False))[1] is None  # no kernel on the CPU: the caller's norm
    assert torch.equal(FD.linear(*cpu)[0], FD.linear_torch(*cpu))


def test_router_topk_counts_and_staging(dev):
    """Top-k of the float32 logits, softmax of the k, counts of routed pairs, the host copies and the go word, in
    one kernel."""
    g = torch.Generator().manual_seed(5)
    cases = [(1, 16, 64, 4), (5, 60, 100, 3), (3, 9, 40, 1)]
    if dev == "cuda":
        cases += [(1, 128, 2048, 8), (64, 256, 7168, 8), (4, 1024, 512, 16)]
    for T, E, H, k in cases:
        x = torch.randn(T, H + 3, generator=g).to(dev, BF)[:, :H]  # rows H + 3 apart
        W = (torch.randn(E, H, generator=g) * 0.02).to(dev)
        counts = torch.zeros(E, dtype=torch.int64, device=dev)
        pin = dev == "cuda"
        stage = (torch.zeros(T, H, dtype=BF, pin_memory=pin), torch.zeros(T, k, dtype=torch.int64, pin_memory=pin),
                 torch.zeros(T, k, dtype=torch.float32, pin_memory=pin))
        go = torch.zeros(64, dtype=torch.int32, pin_memory=pin)
        w, ids = fused.router_topk(x, W, k, counts=counts, stage=stage, go=go[3:4])
        if dev == "cuda":
            torch.cuda.synchronize()
        assert go[3] == 1 and int(go.sum()) == 1  # raised once every token's inputs were staged; nothing else
        top, want_ids = torch.topk(torch.nn.functional.linear(x.float(), W), k, dim=-1)
        assert torch.equal(ids, want_ids)  # descending logit order
        torch.testing.assert_close(w, torch.softmax(top, dim=-1), rtol=1e-5, atol=1e-6)
        assert torch.equal(counts.cpu(), torch.bincount(want_ids.flatten().cpu(), minlength=E))
        assert torch.equal(stage[0], x.cpu()) and torch.equal(stage[1], ids.cpu()) and torch.equal(stage[2], w.cpu())
        w2, ids2 = fused.router_topk(x, W, k)  # neither counts nor staging
        assert torch.equal(ids2, ids) and torch.equal(w2, w)


def test_kernels_compile_for_sm90():
    """Where Triton is installed but no GPU is (and not interpreting): every kernel, at the model's shapes and in
    both dtypes, compiles for sm_90 through Triton's bundled ptxas (the interpreter does not check what only the
    compiler rejects), and in bf16 without register spills. On the GPU machine the tests above compile them."""
    if fused.triton_language() is None or fused.interpreting() or torch.cuda.is_available():
        pytest.skip("needs Triton without a GPU and without TRITON_INTERPRET")
    import subprocess
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"

    def check(fn, ptrs, consts, warps=4, spill_free=True):
        """fn compiled with consts (and PDL off and on where fn has it and consts do not say): no spills, and
        griddepcontrol.wait exactly where PDL is on."""
        has_pdl = "PDL" in fn.arg_names
        pdls = (consts["PDL"],) if "PDL" in consts else (False, True) if has_pdl else (False,)
        # constexprs left out take their defaults (PDL aside: both ways)
        defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.name != "PDL" and p.has_default}
        for pdl in pdls:
            c = {**defaults, **consts, "PDL": pdl} if has_pdl else {**defaults, **consts}
            sig = {n: "constexpr" if n in c else ptrs.get(n, "i32") for n in fn.arg_names}
            k = triton.compile(ASTSource(fn, sig, c), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
            waits = k.asm["ptx"].count("griddepcontrol.wait")
            assert (waits > 0) == pdl, f"{fn.__name__} {c}: {waits} griddepcontrol.wait"
            if cuobjdump.exists() and spill_free:
                cubin = Path(__import__("tempfile").mkdtemp()) / "k.cubin"
                cubin.write_bytes(k.asm["cubin"])
                sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True).stdout
                assert "STL" not in sass, f"{fn.__name__} {c} spills registers"

    rope, attn = FA._kernels()
    add_norm, lin, _ = FD._kernels()
    for dt, prec in (("bf16", "tf32"), ("fp32", "ieee")):
        t = {n: f"*{dt}" for n in ("qkv", "out", "wq", "wk", "cos", "sin", "kc", "vc", "q", "x", "w", "bias", "res",
                                   "s_out", "n_out")}
        t.update(lens="*i64", part="*fp32", ml="*fp32", cnt="*i32", eps="fp32", scale="fp32")
        for kv in (False, True):
            check(rope, t, dict(HQ=32, HK=4, D=128, BD=128, NORM=True, KV=kv))
        for mask, mask_dt in ((False, "*u8"), (True, "*u8"), (True, f"*{dt}")):
            check(attn, {**t, "mask": mask_dt}, dict(HK=4, G=8, GP=16, D=128, BD=128, BN=FA.key_block(dt),
                                                    MAXS=FA.MAX_SPLITS, LENS=True, MASK=mask,
                                                    MASK_BOOL=mask_dt == "*u8", PREC=prec))
        check(attn, {**t, "mask": "*u8"}, dict(HK=2, G=3, GP=16, D=24, BD=32, BN=FA.key_block(dt),
                                               MAXS=FA.MAX_SPLITS, LENS=False, MASK=True, MASK_BOOL=True, PREC=prec))
        for norm in (False, True):  # rope_attention: q from qkv, the new k and v written by the last split
            check(attn, {**t, "mask": "*u8"}, dict(HK=4, G=8, GP=16, D=128, BD=128, BN=FA.key_block(dt),
                                                   MAXS=FA.MAX_SPLITS, LENS=True, MASK=True, MASK_BOOL=True,
                                                   PREC=prec, ROPE=True, NORM=norm))
        check(add_norm, t, dict(RES=True, NORM=True, ROUND2=True, BH=2048))
        for defer in (False, True):  # the collect + add + norm, with the previous layer's deferred output or not
            check(FD._kernels()[2], {**t, "host": "*fp32", "flag": "*i32", "host2": "*fp32", "flag2": "*i32"},
                  dict(ROUND2=True, BH=2048, DEF=defer))
        for B, BB, configs in ((1, 1, FD.CONFIGS_1), (4, 16, FD.CONFIGS_N)):
            for BN, BK, warps, *red in configs:  # (float32 products run in registers: spills there cost speed only)
                check(lin, {**t, "nw": f"*{dt}", "n_out": f"*{dt}"}, dict(
                    B=B, BB=BB, BN=BN, BK=BK, BIAS=True, RES=True, NORM=True, ROUND2=False, BH=2048, PREC=prec,
                    RED=bool(red and red[0])), warps, dt == "bf16")
    for go, scope in ((False, "gpu"), (True, "gpu"), (True, "sys")):  # (the token counters' scope: gpu in use)
        check(fused._kernels(), dict(x="*bf16", w="*fp32", logits="*fp32", w_out="*fp32", i_out="*i64", cnt="*i32",
                                     counts="*i64", h_host="*bf16", w_host="*fp32", i_host="*i64", go="*i32"),
              dict(K=8, KP=8, BLOCK=128, BLOCK_E=fused.ROUTER_BLOCK_E, BLOCK_H=fused.ROUTER_BLOCK_H, COUNT=True,
                   STAGE=True, GO=go, SCOPE=scope), fused.ROUTER_WARPS)
    for flag, wait in ((False, False), (True, False), (True, True)):
        check(fused._copy_kernel()[0], dict(src="*fp32", dst="*bf16", flag="*i32", cnt="*i32"),
              dict(BLOCK=fused.COPY_BLOCK, FLAG=flag, WAIT=wait), fused.COPY_WARPS)
    for reset in (False, True):
        check(fused._copy_kernel()[1], dict(word="*i32"), dict(RESET=reset), 1)
    check(fused._copy_kernel()[2], dict(word="*i32"), {}, 1)
    for has_s, has_e in ((True, True), (True, False), (False, False)):  # streamed prefill's sum (hostio)
        check(hostio._kernels(), dict(o="*bf16", s="*fp32", e="*fp32", out="*bf16"),
              dict(HAS_S=has_s, HAS_E=has_e, FRESH=True, BLOCK=hostio.BLOCK), hostio.WARPS)


def test_pdl_launch_keywords(monkeypatch):
    """Programmatic dependent launch only where it can run: a CUDA device of compute capability >= 9.0 with a
    Triton that has grid dependency control, not under the interpreter, not with KTINJECT_PDL=0; elsewhere the
    launches carry no PDL keyword at all (a Triton older than 3.4 rejects launch_pdl)."""
    from ktinject.native import cuda_driver

    assert fused.pdl_kwargs(torch.zeros(1)) == {}  # CPU tensors (the interpreter's)
    if torch.cuda.is_available():
        t = torch.zeros(1, device="cuda")
        want = (torch.cuda.get_device_capability() >= (9, 0) and fused.gdc_functions()[0] is not None
                and cuda_driver.driver_version() >= fused.PDL_MIN_DRIVER)
        assert fused.pdl(t) == (want and not fused.interpreting())
        monkeypatch.setattr(cuda_driver, "driver_version", lambda: 12020)  # graphs would not capture it
        fused._pdl_capable.cache_clear()
        try:
            assert not fused.pdl(t)
        finally:
            monkeypatch.undo()
            fused._pdl_capable.cache_clear()
        monkeypatch.setenv("KTINJECT_PDL", "0")
        assert fused.pdl_kwargs(t) == {}


def test_pdl_chain_keeps_order(dev):
    """Kernels launched with programmatic dependent launch start while the one before them runs: each must still
    see its predecessor's writes (read after write) and must not overwrite what a predecessor still reads (write
    after read). A chain of 64 MiB copies (long enough for the next launch to start early), after a host-to-device
    memcpy (a full dependency), eager and replayed from a CUDA graph with new contents each time."""
    if dev != "cuda" or not fused.pdl(torch.empty(1, device="cuda")):
        pytest.skip("needs a GPU with programmatic dependent launch (compute capability 9.0+)")
    n = 16 << 20  # float32
    host = torch.empty(n, dtype=torch.float32).pin_memory()
    a, b, c, zero = (torch.empty(n, device="cuda") for _ in range(4))
    zero.zero_()

    def chain():
        a.copy_(host, non_blocking=True)
        fused.copy(a, b)  # reads the memcpy's result
        fused.copy(b, c)  # reads its PDL predecessor's result
        fused.copy(zero, b)  # overwrites what its predecessor reads

    for i in range(3):
        host.copy_(torch.arange(n, dtype=torch.float32) * (i + 1))
        chain()
        torch.cuda.synchronize()
        assert torch.equal(c.cpu(), host) and not b.any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for i in range(3):
        host.copy_(torch.arange(n, dtype=torch.float32) - i)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(c.cpu(), host) and not b.any()


@pytest.mark.parametrize("times, credit, want", [
    ({None: 9.0, (4, 2048, 4): 9.2, (8, 512, 4): 9.4}, 0.0, None),           # alone: cuBLAS is faster
    ({None: 9.0, (4, 2048, 4): 9.2, (8, 512, 4): 9.4}, 3.0, (4, 2048, 4)),   # in the PDL chain: the kernel
    ({None: 9.0, (4, 2048, 4): 12.5}, 3.0, None),                            # slower than the credit covers
    ({None: 9.0, (4, 2048, 4): 8.0, (8, 512, 4): 7.5}, 0.0, (8, 512, 4)),    # the fastest kernel
    ({None: 9.0}, 3.0, None),                                                # every config dropped
    ({None: 9.0, (4, 2048, 4): 9.0}, 0.0, (4, 2048, 4)),                     # a tie: the kernel
    ({(4, 2048, 4): 9.5, (8, 512, 4): 9.4}, 0.0, (8, 512, 4)),               # no cuBLAS timing: the fastest kernel
    ({}, 0.0, None),
])
def test_linear_pick_credits_pdl(times, credit, want):
    """fused_dense.pick: cuBLAS unless a kernel config's time, less the PDL credit (one row, PDL on), is at most
    cuBLAS's; then the fastest config."""
    from ktinject.operators.kernels import dense as fused_dense

    assert fused_dense.pick(times, credit) == want


@pytest.mark.parametrize("times, K, want", [
    ({None: 9.0, (4, 2048, 4): 12.5, (8, 2048, 8): 12.0, (16, 1024, 8): 10.0}, 2048, (8, 2048, 8)),  # whole rows
    ({None: 9.0, (4, 2048, 4): 19.0, (2, 2048, 2, True): 17.5}, 2048, (2, 2048, 2, True)),  # within 2x cuBLAS
    ({None: 9.0, (4, 2048, 4): 19.0}, 2048, None),  # past 2x: the credit's rule, which does not cover it
    ({None: 9.0, (4, 2048, 4): 12.5, (2, 4096, 4, True): 11.0}, 2048, (4, 2048, 4)),  # BK past K: lanes masked off
    ({None: 9.0, (4, 2048, 4): 12.5, (16, 1024, 8): 10.0}, 4096, (16, 1024, 8)),  # none whole at 4096: credit
    ({None: 9.0, (4, 2048, 4): 12.5}, 4096, None),  # ... which does not cover 3.5 us
    ({(8, 2048, 8): 12.0, (16, 1024, 8): 10.0}, 2048, (8, 2048, 8)),  # no cuBLAS timing
    ({None: 9.0}, 2048, None),
])
def test_linear_pick_takes_whole_rows_in_the_pdl_chain(times, K, want):
    """fused_dense.pick with first_tile=K (one row, PDL on): the fastest config whose first tile is the whole row
    (BK == K), loaded before its wait, whatever cuBLAS's time up to WHOLE_ROW_SLACK x; where none is, the credit's
    rule (3 us here); decide gives it for weights up to WHOLE_ROW_BYTES (q/k/v), not for an LM head's."""
    from ktinject.operators.kernels import dense as fused_dense

    assert fused_dense.WHOLE_ROW_SLACK == 2.0 and fused_dense.PDL_CREDIT_US == 3.0
    assert fused_dense.pick(times, 3.0, K) == want
    ms = {c: t / 1e3 for c, t in times.items()}  # _measure's unit
    qkv, head = 5120 * K * 2, 151936 * K * 2
    # decide's first tile: the whole row up to FIRST_TILE_K (K = 4096: BK 2048, as o_proj's)
    assert fused_dense.decide(ms, True, K, qkv) == fused_dense.pick(times, 3.0, min(K, fused_dense.FIRST_TILE_K))
    if K <= fused_dense.FIRST_TILE_K:
        assert fused_dense.decide(ms, True, K, qkv) == want
    assert fused_dense.decide(ms, True, K, head) == fused_dense.pick(times, 3.0)  # the credit alone
    assert fused_dense.decide(ms, False, K, qkv) == fused_dense.pick(times)  # no credit, no first-tile rule


@pytest.mark.parametrize("times, want", [
    # o_proj's timings alone as one process measured them (us): (2, 4096, 4, RED) the fastest, BK 2048 taken
    ({None: 14.0, (8, 2048, 8): 10.4, (4, 2048, 4): 10.6, (2, 4096, 4, True): 9.6, (8, 512, 4): 10.0}, (8, 2048, 8)),
    ({None: 14.0, (16, 1024, 8): 9.0, (2, 4096, 4, True): 9.6}, (16, 1024, 8)),  # no BK 2048: the fastest
    ({None: 9.0, (16, 1024, 8): 11.0}, None),  # ... which gets no credit with an epilogue
    ({None: 9.0, (4, 2048, 4): 19.0, (16, 1024, 8): 10.0}, None),  # BK 2048 past 2x cuBLAS, the rest slower
])
def test_linear_decide_first_tile_of_o_proj(times, want):
    """decide for a one-row projection with K = 4096 and its residual + norm fused (o_proj), PDL on: the fastest
    config whose first tile is FIRST_TILE_K wide (2048; in decode graphs on the H100 those beat both BK = 4096
    and narrower tiles), within WHOLE_ROW_SLACK x cuBLAS's time; else the fastest, without the PDL credit."""
    from ktinject.operators.kernels import dense as fused_dense

    assert fused_dense.FIRST_TILE_K == 2048
    ms = {c: t / 1e3 for c, t in times.items()}
    assert fused_dense.decide(ms, True, 4096, 2048 * 4096 * 2, epilogue=True) == want
    assert fused_dense.decide(ms, False, 4096, 2048 * 4096 * 2, epilogue=True) == fused_dense.pick(ms)


def test_choices_line_names_each_measured_shape(monkeypatch):
    """fused_dense.choices_line: the measured choice per shape of that many rows, largest weight first, for the
    benchmarks' notes (the GPU part moves with them)."""
    from ktinject.operators.kernels import dense as fused_dense

    monkeypatch.setattr(fused_dense, "_CHOICE", {})
    assert fused_dense.choices_line(1) == "none measured"
    dt = torch.bfloat16
    fused_dense._CHOICE.update({(1, 5120, 2048, dt, False, False, False, "cuda:0"): (4, 2048, 4),
                                (1, 2048, 4096, dt, False, True, True, "cuda:0"): (8, 2048, 8),
                                (1, 151936, 2048, dt, False, False, False, "cuda:0"): None,
                                (2, 5120, 2048, dt, False, False, False, "cuda:0"): (32, 128, 4)})
    assert fused_dense.choices_line(1) == ("151936 x 2048: cuBLAS; 5120 x 2048: (4, 2048, 4); "
                                           "2048 x 4096 + residual + norm: (8, 2048, 8)")
    assert fused_dense.choices_line(2) == "5120 x 2048: (32, 128, 4)"
    fused_dense._CHOICE[(1, 5120, 2048, torch.float32, False, False, False, "cuda:0")] = None  # one shape twice
    assert fused_dense.choices_line(1).count("5120 x 2048: ") == 2
