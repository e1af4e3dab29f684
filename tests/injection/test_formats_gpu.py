"""Release formats on a GPU (skipped without CUDA): an FP8 checkpoint (experts kept in fp8) and a GGUF Q4_K_M file
loaded by ktinject.from_pretrained onto CUDA, decoded through the captured CUDA graph.

Graph decode must give exactly the eager decode's tokens (the same kernels and native experts), and the loaded
model's logits must match the float32 model on the checkpoint's own dequantized weights within the format's bound
(fp8: bf16 activations only; Q4_K_M: the requantized experts' error, as on the CPU in test_gguf.py).
"""
from __future__ import annotations

import pytest
import torch

import ktinject
from ktinject.decode.generate import get_runner
from ktinject.tiny_models import build_tiny_model, tiny_prompts
from tests.injection import quantized_checkpoints as qc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
N = 16


def _load(path, **kw):
    kw.setdefault("gpu_experts_budget", 0)  # the formats' native kernels, not GPU banks
    return ktinject.from_pretrained(path, gpu="cuda", cache_dir=False, progress=False, dtype=torch.float32, **kw)


def _graph_equals_eager(model):
    ids = tiny_prompts(2, 9, seed=3).cuda()
    mask = torch.ones_like(ids)
    outs = []
    for graphs in (False, True):
        runner = get_runner(model, use_graphs=graphs)
        outs.append(ktinject.generate(model, ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N,
                                      do_sample=False, pad_token_id=0, eos_token_id=None))
    assert not runner.stats.capture_failures, runner.stats.capture_failures
    assert runner.stats.captures == 1 and runner.stats.replays == N - 1 and runner.stats.eager_decode == 0
    assert torch.equal(outs[0], outs[1])
    runner.close()


@torch.no_grad()
def _rel(model, ref) -> float:
    ids = tiny_prompts(2, 9, seed=5)
    got = model(ids.cuda()).logits.float().cpu()
    want = ref(ids).logits
    return float((got - want).abs().max() / want.abs().max())


def _experts(model):
    from ktinject.operators.moe import HybridMoE

    return [m for m in model.modules() if isinstance(m, HybridMoE)]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_fp8_checkpoint_through_graph_decode(tmp_path, family):
    from transformers import AutoModelForCausalLM

    src = tmp_path / "bf16"
    build_tiny_model(family, seed=1, dtype=torch.bfloat16).save_pretrained(src)
    q = qc.write_fp8(src, tmp_path / "q", tmp_path / "ref")
    model = _load(q)
    assert {m.quant for m in _experts(model)} == {"fp8"}
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    assert _rel(model, ref) < 0.03
    _graph_equals_eager(model)


@pytest.mark.parametrize("M, N, K, block", [(1, 4096, 2048, (128, 128)), (5, 100, 300, (128, 128)),
                                             (17, 257, 129, (128, 128)), (300, 640, 1024, (128, 128)),
                                             (64, 96, 256, (32, 128))])
def test_fp8_matmul_kernel_equals_its_reference(M, N, K, block):
    """The Triton W8A16 kernel against its torch reference (float32 accumulation either way): awkward sizes, one
    row, a tile spanning scale rows, blocks of 32 rows."""
    from ktinject.operators.kernels import fp8_matmul

    g = torch.Generator().manual_seed(M + N + K)
    w = (torch.randn(N, K, generator=g) * 30).clamp(-448, 448).to(torch.float8_e4m3fn).cuda()
    s = torch.rand(-(-N // block[0]), -(-K // block[1]), generator=g).cuda() + 0.01
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(M, K, generator=g).to(dtype).cuda()
        assert fp8_matmul.usable(x, block)
        got = fp8_matmul.matmul(x, w, s, block).float()
        want = fp8_matmul.reference(x, w, s, block).float()
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-4  # the bf16 result's rounding, else float32 sum orders
        assert ((got - want).abs().max() / want.abs().max()) < tol


def test_dense_fp8_through_graph_decode(tmp_path):
    """FP8 attention and MLP projections (FP8Linear, the Triton kernel) inside the captured decode step."""
    from ktinject.operators.fp8_linear import FP8Linear

    src = tmp_path / "bf16"
    build_tiny_model("qwen3_moe", seed=1, dtype=torch.bfloat16, hidden_size=256, intermediate_size=256,
                     head_dim=64).save_pretrained(src)
    q = qc.write_fp8(src, tmp_path / "q", tmp_path / "ref", block=(128, 128))
    model = _load(q, dense_fp8="all")
    assert any(isinstance(m, FP8Linear) for m in model.modules())
    _graph_equals_eager(model)


def test_gguf_q4_k_m_through_graph_decode(tmp_path):
    pytest.importorskip("gguf")
    from tests.injection import gguf_checkpoints as gw
    from tests.injection.test_gguf import _K_SIZES, _q4_k_m

    hf = build_tiny_model("qwen3_moe", seed=1, **_K_SIZES).eval()
    weights = gw.write_gguf(hf, tmp_path / "model.gguf", _q4_k_m)
    model = _load(tmp_path / "model.gguf")
    ref = gw.reference_model(hf, weights)
    assert _rel(model, ref) < 0.3  # Q4_K / Q6_K experts requantized to int4 / int8 (W4A8 / W8A8)
    _graph_equals_eager(model)
