"""The decoder layers' decode forward (decode/layer.py) against the unmodified HF layers.

On the CPU (no Triton) it runs HF's own ops in HF's order, with the next layer's input norm computed by the
residual add that precedes it and handed over on the sum (``norm.attach_prenormed``): logits must be bitwise
HF's for every tiny family, through static and dynamic caches, in float32 and bf16. Hooks, in-place changes of a
layer's output, inference mode and training keep HF's results. On CUDA (GPU machine) the kernels run: bf16 logits
no further from the float32 model's than HF bf16's are."""
from __future__ import annotations

import copy

import pytest
import torch

import ktinject
from ktinject.operators import norm as N
from ktinject.decode import attention as DA
from ktinject.decode import layer as DL
from ktinject.tiny_models import FAMILIES, build_tiny_model, tiny_prompts

from tests.decode.test_decode_attention import _attention_modules, _left_padded, _logits


def _pair(family, dtype=torch.float32, device="cpu", attention=True):
    ref = build_tiny_model(family, dtype=dtype).to(device)
    fast = copy.deepcopy(ref)
    if attention:
        for m in (ref, fast):  # the attention decode forward in both: this compares the layer forward alone
            for a in _attention_modules(m):
                DA.install(a)
    assert DL.install_all(fast) == fast.config.num_hidden_layers
    return ref, fast


@pytest.fixture
def taken(monkeypatch):
    """How often a norm took the prenormed result handed over by the layer before (layers and final norm)."""
    hits = {"n": 0}
    orig = N.take_prenormed

    def counted(x, norm):
        y = orig(x, norm)
        hits["n"] += y is not None
        return y
    monkeypatch.setattr(N, "take_prenormed", counted)
    monkeypatch.setattr(DL, "take_prenormed", counted)
    return hits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitwise_hf_on_cpu(family, dtype, taken):
    ref, fast = _pair(family, dtype)
    ids, mask, keep = _left_padded()
    for kind in ("static", "dynamic"):
        assert torch.equal(_logits(fast, ids, mask, kind)[keep], _logits(ref, ids, mask, kind)[keep])
    layers = fast.config.num_hidden_layers
    assert taken["n"] == 2 * 5 * (layers - 1)  # every decode step, every layer but the first; HF final norm
    st = fastpaths_of(fast)
    assert st is None or st["decode_layer"]["fast_calls"] == 2 * 5 * layers


def fastpaths_of(model):
    report = model.__dict__.get("_ktinject_fast_paths")
    return None if report is None else report.as_dict()


def test_injected_model_final_norm_takes_it(taken):
    """After inject the norms are FusedRMSNorm: the last layer hands the final norm its result too; the report
    shows the path; uninstall gives HF's forward back."""
    ref = build_tiny_model("qwen3_moe")
    inj = copy.deepcopy(ref)
    ktinject.inject(inj, gpu="cpu")
    layers = [m for m in inj.modules() if DL.installed(m)]
    assert len(layers) == inj.config.num_hidden_layers
    ids = tiny_prompts(1, 6, seed=4)
    out = inj.generate(ids, max_new_tokens=4, do_sample=False)
    assert taken["n"] == 3 * inj.config.num_hidden_layers  # decode steps x (layers - 1 + the final norm)
    paths = ktinject.info(inj)["fast_paths"]
    assert paths["decode_layer"]["active"] is True and paths["decode_layer"]["fast_calls"] == 3 * len(layers)
    for m in layers:
        DL.uninstall(m)
    assert not any(DL.installed(m) for m in inj.modules())
    assert torch.equal(inj.generate(ids, max_new_tokens=4, do_sample=False), out)


def test_hooks_inplace_changes_and_inference_mode(taken):
    """A hook on a norm runs (the norm is called as a module); a hook that changes a layer's output in place
    invalidates the handed-over norm; inference tensors keep no versions, so nothing is handed over."""
    ref, fast = _pair("qwen2_moe")
    ids, mask, keep = _left_padded()
    calls = []
    for m in (ref, fast):
        layers = m.model.layers
        layers[1].post_attention_layernorm.register_forward_hook(lambda mod, a, out: calls.append(1) or out * 1.5)
        layers[0].register_forward_hook(lambda mod, a, out: out.mul_(0.75))
    want = _logits(ref, ids, mask)
    n_ref = len(calls)
    got = _logits(fast, ids, mask)
    assert torch.equal(got[keep], want[keep]) and len(calls) == 2 * n_ref
    assert taken["n"] == 5 * (fast.config.num_hidden_layers - 2)  # not after layer 0: its output was changed
    taken["n"] = 0
    with torch.inference_mode():
        assert torch.equal(_logits(fast, ids, mask)[keep], _logits(ref, ids, mask)[keep])
    assert taken["n"] == 0


def test_without_decode_attention_and_in_training():
    ref, fast = _pair("mixtral", attention=False)  # HF attention modules: called as modules
    ids, mask, keep = _left_padded()
    assert torch.equal(_logits(fast, ids, mask)[keep], _logits(ref, ids, mask)[keep])
    fast.train()
    x = torch.randn(1, 1, fast.config.hidden_size)
    layer, ref_layer = fast.model.layers[0], ref.model.layers[0]
    ref_layer.train()
    cos_sin = fast.model.rotary_emb(x, torch.zeros(1, 1, dtype=torch.long))
    torch.manual_seed(0)
    a = layer(x, position_embeddings=cos_sin, attention_mask=None)
    torch.manual_seed(0)
    b = ref_layer(x, position_embeddings=cos_sin, attention_mask=None)
    assert torch.equal(a, b)
    assert fastpaths_of(fast) is None or fastpaths_of(fast)["decode_layer"]["fallback_calls"] >= 1


def test_problems_are_named():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    assert "Qwen3MoeRMSNorm" in DL.problem(Qwen3MoeRMSNorm(8)) and "Qwen3MoeDecoderLayer" in DL.problem(
        Qwen3MoeRMSNorm(8))
    assert DL.problem(build_tiny_model("deepseek_v3").model.layers[0]) is None


def test_the_lm_head_takes_the_decode_forward_where_it_is_a_linear():
    """install_all gives the LM head the decode forward (the layers took theirs); off CUDA, for prefill shapes, with
    a hook or autograd it is nn.Linear's own forward; uninstall_head gives that back; a head that is not a plain
    nn.Linear keeps its forward."""
    ref, fast = _pair("qwen3_moe")
    head = fast.get_output_embeddings()
    assert DL._HEAD_FORWARD in head.__dict__ and DL._HEAD_FORWARD not in ref.get_output_embeddings().__dict__
    ids, mask, keep = _left_padded()
    assert torch.equal(_logits(fast, ids, mask)[keep], _logits(ref, ids, mask)[keep])
    x = torch.randn(3, 1, fast.config.hidden_size)
    assert torch.equal(head(x), torch.nn.functional.linear(x, head.weight, head.bias))
    x.requires_grad_(True)
    head(x).sum().backward()  # autograd: nn.Linear's forward, which records it
    assert x.grad is not None
    DL.uninstall_head(fast)
    assert DL._HEAD_FORWARD not in head.__dict__ and "forward" not in head.__dict__
    assert DL.install_head(fast) and DL.install_head(fast)  # a second install keeps the first's original
    DL.uninstall_head(fast)
    assert "forward" not in head.__dict__

    hooked = torch.nn.Linear(4, 4)
    hooked.forward = lambda x: x  # an instance forward (accelerate's offload hook): left alone, kept
    fast.lm_head = hooked
    assert not DL.install_head(fast)
    DL.uninstall_head(fast)
    assert "forward" in hooked.__dict__

    class Scaled(torch.nn.Linear):
        pass
    fast.lm_head = Scaled(4, 4)
    assert not DL.install_head(fast)
    assert not DL.install_head(torch.nn.Linear(4, 4))  # no output embeddings to ask for


_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("gemv", [pytest.param(g, marks=_CUDA) for g in ("triton", "auto")])
def test_lm_head_kernel_on_cuda(gemv, monkeypatch):
    """The LM head's decode forward against F.linear in bf16 (the same product in another summation order, an odd
    vocabulary): by the GEMV (KTINJECT_GEMV=triton) or as measured (auto: cuBLAS or a config, a weight above
    MEASURE_FROM), for a prompt's last position (a strided view of one row); a batch: nn.Linear's."""
    from ktinject.operators.kernels import dense as fused_dense

    monkeypatch.setenv("KTINJECT_GEMV", gemv)
    H, V = 200, 5001 + (fused_dense.MEASURE_FROM // 200 if gemv == "auto" else 0)
    head = torch.nn.Linear(H, V, bias=False).to("cuda", torch.bfloat16)
    DL.fastpaths.swap_forward(head, DL.head_forward, DL._HEAD_FORWARD)
    prompt = torch.randn(1, 7, H, device="cuda", dtype=torch.bfloat16)
    for x in (prompt[:, -1:, :], torch.randn(3, 1, H, device="cuda", dtype=torch.bfloat16)):
        with torch.no_grad():
            got, want = head(x), torch.nn.functional.linear(x, head.weight)
        assert got.shape == want.shape == (x.shape[0], 1, V)
        diff = (got.float() - want.float()).abs()
        assert float(diff.max()) <= float(want.float().abs().max()) * 2 ** -7
        if x.shape[0] > 1:
            assert torch.equal(got, want)  # nn.Linear's own
    assert not [k for k in fused_dense._CHOICE if k[:3] == (3, V, H)]  # the batch never reached the choice
    key = [k for k in fused_dense._CHOICE if k[:3] == (1, V, H)]
    assert gemv == "triton" or key  # measured once: cuBLAS or a config
    assert gemv == "auto" or fused_dense.choose(prompt[0, :1], head.weight, None, None) is not None


@pytest.mark.parametrize("family", [pytest.param(f, marks=_CUDA) for f in ("qwen3_moe", "qwen2_moe", "gpt_oss")])
def test_bf16_no_worse_than_hf_on_cuda(family):
    """The Triton path (fused adds and norms, GEMVs, attention kernel): bf16 logits, fed the float32 model's greedy
    tokens, within HF bf16's error of the float32 model (median over positions)."""
    ref16, fast16 = _pair(family, torch.bfloat16, "cuda")
    truth = copy.deepcopy(ref16).float()
    ids, mask, keep = _left_padded(seed=5)
    t = _logits(truth, ids, mask)
    forced = t[:, -6:-1].argmax(-1)
    err_hf = (_logits(ref16, ids, mask, forced=forced) - t)[keep].abs()
    err_fast = (_logits(fast16, ids, mask, forced=forced) - t)[keep].abs()
    med_fast, med_hf = float(err_fast.mean(-1).median()), float(err_hf.mean(-1).median())
    assert med_fast <= 1.2 * med_hf + 1e-3, (med_fast, med_hf)


def test_a_pending_collect_is_flushed_where_it_cannot_join_the_add():
    """The MoE operator's lazy collect (graph decode, one token: stream_experts' finish(lazy=True)) is queued before
    the residual add wherever the add + norm cannot take it (here: no kernels on the CPU), so the output is written
    before it is read; the add's result is then HF's."""
    _, fast = _pair("qwen3_moe")
    layer = fast.model.layers[0]

    class Lazy:
        def __init__(self, out):
            self.out, self.calls = out, []

        def flush(self):
            self.calls.append("flush")
            self.out.fill_(2.0)  # what the collect writes
            return self.out

        def collect_add_rms_norm(self, *a):
            self.calls.append("fused")
            raise AssertionError("no kernels here")

    h = torch.randn(1, 1, fast.config.hidden_size)
    m = torch.zeros_like(h)
    lazy = Lazy(m)
    s = DL._add_and_next_norm(layer, m, h, False, lazy)
    assert lazy.calls == ["flush"] and torch.equal(s, h + 2.0)
