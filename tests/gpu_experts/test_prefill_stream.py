"""Streamed prefill (ktinject.gpu_experts.prefill.streamer) on CPU tensors: the same ring, dequant and grouped math as on the GPU,
with plain copies instead of a copy stream.

- one MoE layer's streamed experts against a float64 reference with the same stored weights (``ktk_experts_get``), for
  both activations (SiLU; gpt-oss with biases, clamp), every quant, awkward shapes (H, I not multiples of 16 or 64,
  one token, experts with no rows, all tokens on the same experts, T not a multiple of 16, k = E), whole layers and
  layers in parts; the native CPU path against the same reference beside it (the bounds of both are stated below);
- a split sends 0 / some / all experts to the "GPU" and gives the same output within those bounds;
- a model: each MoE layer's experts are copied once per forward (the next layer's copy is the one fetched ahead),
  hot experts are never copied, and prefill="gpu" gives the logits and greedy tokens of prefill="cpu";
- the cost model and split policy as pure functions; bad ``prefill=`` values.

Bounds (max |out - ref| / max |ref| over a layer's output): the streamed path, bf16 activations and intermediates with
float32 accumulation: 1.5e-2 for every quant (the int8 / int4 weights are the reference's, dequantized exactly);
the native path: bf16 1.5e-2, int8 / int4 (activations quantized to int8 per token) 4e-2.

Legend: T tokens, k experts per token, E experts, H hidden, I intermediate.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import ktinject
from ktinject.gpu_experts.prefill import feedback as balance
from ktinject.gpu_experts.hot import placement
from ktinject.gpu_experts.prefill import policy
from ktinject.gpu_experts.prefill import streamer as stream
from ktinject.tiny_models import FAMILIES, build_tiny_model, tiny_prompts
from tests.references import experts_reference, random_experts, streamed_vs_cpu, token_errors

STREAM_TOL = 1.5e-2
MARGIN = 0.15  # logits (std ~2), as tests/decode/test_graph_gpu.py
NATIVE_TOL = {"bf16": 1.5e-2, "int8": 4e-2, "int4": 4e-2}
QUANTS = ("bf16", "int8", "int4")


def _block(ex, biases=None):
    """What the streamer reads of a HybridMoE, for one bare native.Experts."""
    return SimpleNamespace(spec=SimpleNamespace(shared=None), native_experts=ex, num_experts=ex.num_experts,
                           hidden_size=ex.hidden, intermediate_size=ex.intermediate, device=torch.device("cpu"),
                           hot=None, prefill=None, top_k=None, expert_biases=biases)


def _routing(kind, T, k, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "same":  # every token on experts 0..k-1: those get every row, the others none
        ids = torch.arange(k).repeat(T, 1)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=g), dim=-1)
    return ids, w


def _err(got, ref):
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12))


SHAPES = [(8, 64, 32, 2, 37), (6, 40, 24, 3, 17), (5, 130, 70, 2, 19), (4, 64, 64, 4, 16), (8, 64, 32, 2, 1)]


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("gptoss", [False, True], ids=["silu", "gptoss"])
@pytest.mark.parametrize("E, H, I, k, T", SHAPES)
@pytest.mark.parametrize("routing", ["random", "same"])
def test_streamed_layer_matches_reference(quant, gptoss, E, H, I, k, T, routing):
    ex, biases = random_experts(E, H, I, quant, gptoss, seed=E * H + I)
    block = _block(ex, biases)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16)
    ids, w = _routing(routing, T, k, E, seed=T)
    ref = experts_reference(ex, biases, x, ids, w)
    streamer = stream.PrefillStreamer([block], "gpu")
    routed, shared = streamer(block, x, ids, w)
    assert shared is None and routed.dtype == x.dtype and routed.shape == (T, H)
    assert _err(routed, ref) < STREAM_TOL
    assert _err(ex(x, ids, w), ref) < NATIVE_TOL[quant]  # the native path, for the record
    used = int((torch.bincount(ids.reshape(-1), minlength=E) > 0).sum())
    mode = streamer.last["mode"]
    assert mode == ("gpu" if policy.prefetch_worthy(T, k, E) else "gpu-used")
    copied = (E if mode == "gpu" else used) * streamer.experts.layouts[0].expert_bytes
    # (the next forward's)
    ahead = lambda s: 0 if s.experts.ring.pending is None else s.experts.ring.pending.nbytes  # noqa: E731
    assert streamer.experts.ring.copied - ahead(streamer) == copied  # idle experts not copied once the routing is known
    parts = stream.PrefillStreamer([block], "gpu", slot_experts=3)  # the layer in parts of 3 experts
    got = parts(block, x, ids, w)[0]
    torch.testing.assert_close(got, routed, rtol=0, atol=0)
    assert parts.experts.ring.copied - ahead(parts) == copied


@pytest.mark.parametrize("quant", QUANTS)
def test_split_fractions_agree(quant, monkeypatch):
    """Split mode with none, some and all of the used experts on the "GPU": one result within the bounds."""
    E, H, I, k, T = 8, 64, 32, 2, 41
    ex, _ = random_experts(E, H, I, quant, False, seed=5)
    block = _block(ex)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ids, w = _routing("random", T, k, E, seed=2)
    ref = experts_reference(ex, None, x, ids, w)
    streamer = stream.PrefillStreamer([block], "auto", costs=policy.Costs(1e9, 1, 1e-6, 1e-6, 1e-6, 1e-9))
    monkeypatch.setattr(streamer, "_decide", lambda *a: "split")
    outs = {}
    for name, take in (("none", lambda used: []), ("some", lambda used: used[::3]), ("all", lambda used: used)):
        monkeypatch.setattr(policy, "choose_split", lambda counts, eligible, costs, take=take:
                            take([int(e) for e in np.flatnonzero(eligible & (counts > 0))]))
        outs[name] = streamer(block, x, ids, w)[0]
        assert streamer.last["mode"] == "split"
    assert streamer.last["gpu_experts"][-1] == int((torch.bincount(ids.reshape(-1)) > 0).sum())
    torch.testing.assert_close(outs["none"], ex(x, ids, w), rtol=0, atol=0)  # the native path exactly
    for name, out in outs.items():
        assert _err(out, ref) < NATIVE_TOL[quant], name
    scale = ref.abs().max().item()
    for a, b in (("none", "some"), ("some", "all"), ("none", "all")):
        assert (outs[a] - outs[b]).abs().max().item() < (NATIVE_TOL[quant] + STREAM_TOL) * scale


def _tiny(family, quant="bf16", prefill="cpu", **kw):
    model = build_tiny_model(family, dtype=torch.float32)
    ktinject.inject(model, gpu="cpu", quant=quant, prefill=prefill, **kw)
    return model


def test_each_layer_copied_once_per_forward():
    """gpu mode on a model: the copy of the next layer's experts is started by the layer before and taken by it (the
    last layer starts the first one's, for the next forward), so a forward copies every MoE layer's experts once
    (3 layers, the first dense: 2 MoE layers)."""
    model = _tiny("qwen3_moe", prefill="gpu")
    s = stream.streamer_of(model)
    ids = tiny_prompts(2, 20)
    with torch.no_grad():
        model(ids)
        assert s.last["mode"] == "gpu" and s.last["gpu_experts"] == [8, 8]
        layer = 8 * s.experts.layouts[0].expert_bytes
        ring = s.experts.ring
        assert ring.copied == 3 * layer and ring.pending.key == (0, 0)  # + the next forward's first layer
        model(ids)
        assert ring.copied == 5 * layer and ring.pending.key == (0, 0)
        s.switch("cpu")  # a forward that streams nothing drops what was fetched ahead
        model(ids)
        assert ring.pending is None and ring.copied == 5 * layer


def test_ahead_mode_copies_its_set_during_the_layer_before(monkeypatch):
    """ahead mode on a model: each layer's fixed GPU set (n = 3 of 8) is the copy fetched ahead by the layer before
    (the last layer fetches the first one's for the next forward), the next forward's sets are the experts with the
    most rows seen, and the logits match the cpu path within the native bound."""
    model = _tiny("qwen3_moe", prefill="cpu")
    ids = tiny_prompts(2, 20)
    with torch.no_grad():
        ref = model(ids).logits
        s = stream.attach(model, "gpu")
        monkeypatch.setattr(s, "_decide", lambda *a: "ahead")
        monkeypatch.setattr(s, "_ahead_n", lambda *a: 3)
        got = model(ids).logits
        assert s.last["mode"] == "ahead" and s.last["gpu_experts"] == [3, 3]
        B = s.experts.layouts[0].expert_bytes
        ring = s.experts.ring
        assert ring.copied == 3 * 3 * B and ring.pending.key == (0, 0)  # 2 layers + the next forward's first
        seen = s._seen[0]
        want = sorted(np.lexsort((np.arange(8), -seen))[:3].tolist())
        assert list(ring.pending.experts) == want
        model(ids)
        assert ring.copied == 5 * 3 * B  # the first layer's copy fetched ahead was taken
    assert _err(got, ref.double()) < NATIVE_TOL["bf16"]


def test_hot_experts_are_not_copied():
    model = _tiny("qwen3_moe", prefill="cpu")
    ids = tiny_prompts(2, 20)
    with torch.no_grad():
        ref = model(ids).logits
        placement.place(model, 2 * 4 * (3 * 64 * 32 * 2), "uniform", dtype=torch.bfloat16)  # ~3 a layer, 2 layers
        hot = [len(b.hot.residents()) for b in stream.blocks_of(model)]
        assert all(0 < h < 8 for h in hot)
        s = stream.attach(model, "gpu")
        got = model(ids).logits
    assert s.last["gpu_experts"] == [8 - h for h in hot]
    ahead = (8 - hot[0]) * s.experts.layouts[0].expert_bytes  # the first layer's, fetched for the next forward
    assert s.experts.ring.copied == (16 - sum(hot)) * s.experts.layouts[0].expert_bytes + ahead
    assert _err(got, ref.double()) < STREAM_TOL


@pytest.mark.parametrize("family, quant", [("qwen3_moe", "bf16"), ("qwen3_moe", "int8"), ("qwen3_moe", "int4"),
                                           ("deepseek_v3", "bf16"), ("gpt_oss", "bf16"), ("mixtral", "int8"),
                                           ("qwen2_moe", "bf16")])
@pytest.mark.parametrize("mode", ["gpu", "split", "ahead"])
def test_model_gpu_prefill_equals_cpu(family, quant, mode, monkeypatch):
    """prefill='gpu' (and every layer split, every other used expert on the "GPU") against prefill='cpu' on the same
    injected model (shared experts, grouped routing, gpt-oss sinks and biases): prompt logits close; every greedy
    token of the run is the cpu path's choice too, or within MARGIN of it in the cpu path's logits (teacher-forced):
    a near-tie, where rounding may pick either."""
    model = _tiny(family, quant=quant, prefill="cpu")
    ids = tiny_prompts(2, 24, seed=3)
    P = ids.shape[1]
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        ref_logits = model(ids).logits
        s = stream.attach(model, "gpu")
        if mode == "ahead":  # every layer: 3 experts fixed before the routing on the "GPU"
            monkeypatch.setattr(s, "_decide", lambda *a: "ahead")
            monkeypatch.setattr(s, "_ahead_n", lambda *a: 3)
        if mode == "split":
            monkeypatch.setattr(s, "_decide", lambda *a: "split")
            monkeypatch.setattr(policy, "choose_split", lambda counts, eligible, costs:
                                [int(e) for e in np.flatnonzero(eligible & (counts > 0))[::2]])
        got_logits = model(ids).logits
        got = ktinject.generate(model, ids, **kw)
        assert s.last["mode"] in ((mode,) if mode != "gpu" else ("gpu", "gpu-used")) and s.experts.ring.copied > 0
        stream.attach(model, "cpu")
        forced = model(got).logits[:, P - 1:-1].float()  # the cpu path's logits at each generated step
    assert _err(got_logits, ref_logits.double()) < NATIVE_TOL[quant]
    chosen = forced.gather(-1, got[:, P:, None]).squeeze(-1)
    assert (forced.max(-1).values - chosen).max().item() < MARGIN


BF16_CASES = [(f, "bf16") for f in FAMILIES] + [(f, q) for f in ("qwen3_moe", "deepseek_v3", "gpt_oss")
                                                  for q in ("int8", "int4")]


@pytest.mark.parametrize("family, quant", BF16_CASES)
def test_bf16_model_streamed_equals_cpu(family, quant):
    """A bf16 model (every family) in gpu mode against its cpu path, as tests/gpu_experts/test_prefill_gpu.py checks it:
    every streamed MoE call within STREAM_TOL of the float64 reference on its own inputs; the prompt logits within
    NATIVE_TOL + STREAM_TOL of the cpu path's at every token whose routing was the same in both runs (a near-tie
    flipped by rounding moves a token's logits by units: ``ktinject.tiny_models.routing_flips``), such tokens rare; the
    median token error against the float32 model no worse than the cpu path's own (bf16 noise, measured)."""
    ids = tiny_prompts(2, 40, seed=1)
    with torch.no_grad():
        f32 = build_tiny_model(family)(ids).logits
    model = build_tiny_model(family, dtype=torch.bfloat16)
    ktinject.inject(model, gpu="cpu", quant=quant, prefill="cpu")
    r = streamed_vs_cpu(model, ids, lambda m: stream.attach(m, "gpu"))
    assert r["last"]["mode"] == "gpu" and len(r["calls"]) == len(stream.blocks_of(model))
    for streamed, native in r["calls"]:
        assert streamed < STREAM_TOL and native < NATIVE_TOL[quant]
    flips, (events, routed) = r["flips"], r["events"]
    assert events <= routed // 20, (events, routed)  # near-ties moved by rounding: rare (routing_flip_events)
    assert r["tokens"][~flips].max() < NATIVE_TOL[quant] + STREAM_TOL
    noise = token_errors(r["cpu"], f32).median()
    assert token_errors(r["streamed"], f32).median() <= 1.5 * noise + 2e-3


# ---- policy --------------------------------------------------------------------------------------------------------
COSTS = policy.Costs(h2d=50e9, expert_bytes=9_437_184, cpu_expert_s=1e-4, cpu_row_s=4e-6, gpu_expert_s=2e-5,
                     gpu_row_s=1e-7)  # Qwen3-30B-A3B-like, bf16


INT4 = policy.Costs(h2d=55e9, expert_bytes=2_660_000, cpu_expert_s=5e-5, cpu_row_s=1.8e-6, gpu_expert_s=5e-6,
                    gpu_row_s=3e-8)  # Qwen3-30B-A3B int4-like (copy 6.2 ms a layer)


@pytest.mark.parametrize("costs, T, cap, want", [
    (COSTS, 1, None, "cpu"), (COSTS, 4, None, "cpu"),  # few rows: nothing to gain
    (COSTS, 512, None, "ahead"), (COSTS, 2048, None, "ahead"),  # both devices, the GPU's copy hidden
    (COSTS, 512, 8, "split"),  # a slot of 8 experts: ahead's GPU share too small to beat a split
    (COSTS, 8192, None, "gpu"),  # ahead within SHARED_MARGIN of gpu mode: gpu
    (INT4, 512, None, "ahead"), (INT4, 2048, None, "ahead"),
    (INT4, 512, 8, "gpu"),  # the split after routing is slower than streaming the whole layer
    (INT4.with_(cpu_row_s=8e-6, cpu_expert_s=1e-4), 16, None, "gpu"),  # slow CPU, sparse routing: no ahead
    (INT4.with_(cpu_row_s=8e-6, cpu_expert_s=1e-4), 2048, None, "gpu"),  # ahead only 4% faster than gpu
])
def test_choose_mode(costs, T, cap, want, monkeypatch):
    monkeypatch.setattr(policy, "AHEAD", True)  # the estimates with ahead mode selectable
    assert policy.choose_mode(T, 8, 128, costs, cap) == want


@pytest.mark.parametrize("costs, T, want", [
    (COSTS, 4, "cpu"), (COSTS, 512, "split"), (COSTS, 2048, "split"), (COSTS, 8192, "gpu"),
    (INT4, 4, "cpu"), (INT4, 512, "gpu"), (INT4, 2048, "gpu"), (INT4, 8192, "gpu"),
])
def test_choose_mode_without_ahead(costs, T, want, monkeypatch):
    """With ahead mode off auto picks cpu, split or gpu: at int4 the after-routing split is not SHARED_MARGIN faster
    than streaming whole layers (it lost, measured)."""
    monkeypatch.setattr(policy, "AHEAD", False)
    assert policy.choose_mode(T, 8, 128, costs) == want


def test_layer_s_moves_work_to_the_copies():
    """A layer's serial time outside the experts (layer_s) lengthens the CPU's side of ahead mode but not the copies
    (they run during it): the balance gives the GPU more experts, and cpu mode looks slower by the same amount."""
    slow = INT4.with_(layer_s=2e-3)
    assert policy.ahead_split(512, 8, 128, slow)[0] > policy.ahead_split(512, 8, 128, INT4)[0]
    fast, slow_est = policy.estimates(512, 8, 128, INT4), policy.estimates(512, 8, 128, slow)
    assert slow_est["cpu"] - fast["cpu"] == pytest.approx(2e-3 - INT4.layer_s)
    assert slow_est["gpu"] == pytest.approx(fast["gpu"])  # hidden under the copy in gpu mode
    scaled = INT4.scaled(2.0, 1e-3)
    assert (scaled.cpu_expert_s, scaled.cpu_row_s, scaled.layer_s) == (2 * INT4.cpu_expert_s, 2 * INT4.cpu_row_s,
                                                                       1e-3)
    assert INT4.scaled().layer_s == INT4.layer_s and INT4.scaled(1.0).cpu_s(3, 10) == INT4.cpu_s(3, 10)


def test_ahead_split():
    n, t = policy.ahead_split(512, 8, 128, INT4)
    times = policy.ahead_times(512, 8, 128, INT4)
    assert times.size == 129 and t == pytest.approx(times.min()) and t == pytest.approx(times[n])
    per = 512 * 8 / 128
    cpu_rest = INT4.layer_s + (INT4.cpu_expert_s + INT4.cpu_row_s * per) * (128 - n)
    assert t == pytest.approx(max(cpu_rest, INT4.copy_s(n)))  # balanced: the CPU's part against the copy
    assert abs(cpu_rest - INT4.copy_s(n)) < INT4.copy_s(1) + INT4.cpu_expert_s + INT4.cpu_row_s * per
    assert policy.ahead_split(512, 8, 128, INT4, cap=40)[0] == 40  # at most a slot
    assert policy.ahead_split(512, 8, 128, INT4.with_(h2d=1e6))[0] == 0  # copying hopeless
    assert policy.ahead_split(0, 8, 128, INT4) == (0, 0.0)


def test_ahead_experts():
    eligible = np.array([True, True, False, True, True, True])
    seen = np.array([5.0, 1.0, 99.0, 5.0, 0.0, 7.0])
    assert policy.ahead_experts(seen, eligible, 3) == [0, 3, 5]  # most rows seen, ties by lower id, 2 resident
    assert policy.ahead_experts(None, eligible, 2) == [0, 1]  # nothing seen yet: the lowest ids
    assert policy.ahead_experts(seen, eligible, 9) == [0, 1, 3, 4, 5]
    assert policy.ahead_experts(seen, eligible, 0) == []
    assert policy.ahead_experts(seen, np.ones(6, dtype=bool), 1) == [2]


def test_split_times_and_best_split():
    c = COSTS.with_(gpu_layer_s=0.0, split_s=0.0)
    cpu, gpu = policy.split_times([10, 5, 1], c)
    assert cpu[0] == pytest.approx(3 * 1e-4 + 16 * 4e-6) and gpu[0] == 0.0
    assert gpu[3] == pytest.approx(3 * (9_437_184 / 50e9 + 2e-5) + 16 * 1e-7) and cpu[3] == 0.0
    n, t = policy.best_split([10, 5, 1], c)
    assert t == pytest.approx(min(max(a, b) for a, b in zip(cpu, gpu))) and 0 <= n <= 3
    assert policy.best_split([], c) == (0, 0.0)
    slow_gpu = c.with_(h2d=1e3)  # copying is hopeless: the CPU keeps everything
    assert policy.best_split([100, 100], slow_gpu)[0] == 0


def test_choose_split_takes_the_busiest_eligible_experts():
    counts = np.array([0, 50, 3, 50, 7, 900])
    eligible = np.array([True, True, True, True, True, False])  # expert 5 is hot
    costs = COSTS.with_(cpu_row_s=1e-3)  # rows are dear on the CPU: the GPU takes the two busiest
    got = policy.choose_split(counts, eligible, costs)
    assert 5 not in got and 0 not in got
    assert got[:2] == [1, 3] or set(got) >= {1, 3}
    assert policy.choose_split(counts, np.zeros(6, dtype=bool), costs) == []


def test_estimates_and_helpers():
    rows = policy.uniform_rows(512, 8, 128)
    assert rows.size == 128 and rows.sum() == pytest.approx(4096)
    assert policy.uniform_rows(1, 8, 128).size == 8
    assert not policy.prefetch_worthy(16, 8, 128) and policy.prefetch_worthy(64, 8, 128)
    est = policy.estimates(8192, 8, 128, COSTS)
    assert est["gpu"] < est["split"] < est["cpu"] and est["ahead"] < est["split"]
    sparse = policy.estimates(16, 8, 128, COSTS)  # most experts idle: no fixed set ahead
    assert sparse["ahead"] == sparse["cpu"]
    assert policy.fit_cpu((8, 64), (8 * 128 * 1e-5 + 128 * 1e-4, 64 * 128 * 1e-5 + 128 * 1e-4), 128) == \
        pytest.approx((1e-4, 1e-5))
    with pytest.raises(ValueError):
        policy.fit_cpu((8, 8), (1.0, 2.0), 4)


def test_bad_prefill_values(tmp_path):
    with pytest.raises(ValueError, match=r"prefill: expected one of 'auto', 'cpu', 'gpu'.*got 'fast'"):
        _tiny("qwen3_moe", prefill="fast")
    rules = tmp_path / "rules.yaml"
    rules.write_text("- match: {class: Qwen3MoeSparseMoeBlock}\n  replace: moe\n  device: gpu\n"
                     "  kwargs: {prefill: GPU}\n- include: common.yaml\n")
    with pytest.raises(ValueError, match=r"rules.yaml.*prefill: expected one of .*got 'GPU'"):
        ktinject.inject(build_tiny_model("qwen3_moe"), str(rules), gpu="cpu")
    model = build_tiny_model("qwen3_moe")
    ktinject.inject(model, str(rules), gpu="cpu", prefill="gpu")  # the keyword wins over the rules
    assert stream.streamer_of(model).mode == "gpu"
    with pytest.raises(ValueError, match="slot_experts"):
        stream.PrefillStreamer([object()], "gpu", slot_experts=0)
    with pytest.raises(ValueError, match="at least one HybridMoE"):
        stream.PrefillStreamer([], "gpu")
    with pytest.raises(ValueError, match="prefill: expected"):
        stream.PrefillStreamer([object()], "fast")


def test_attach_modes():
    model = _tiny("qwen3_moe", prefill="cpu")
    assert stream.streamer_of(model) is None
    assert stream.attach(model, "auto") is None  # no GPU to stream to
    s = stream.attach(model, "gpu")
    assert stream.streamer_of(model) is s and s.chunk_tokens() == stream.MAX_CHUNK
    with torch.no_grad():
        model(tiny_prompts(1, 30))
        assert s.last["mode"] == "gpu" and s.experts.ready
        s.switch("cpu")  # declines, keeps its set-up
        model(tiny_prompts(1, 30))
        assert s.last["mode"] == "cpu" and s.experts.ready
        assert stream.attach(model, "gpu") is s and s.mode == "gpu"  # the same streamer, switched
    stream.attach(model, "cpu")
    assert stream.streamer_of(model) is None and all(b.prefill is None for b in stream.blocks_of(model))


def test_auto_decides_per_forward():
    """auto: forwards of fewer than AUTO_MIN_TOKENS tokens stay on the CPU path without any set-up; longer ones take
    the cost model's mode (here costs under which the CPU is slow per row: a split, then everything on the GPU)."""
    model = _tiny("qwen3_moe", prefill="cpu")
    short, long = tiny_prompts(1, 40), tiny_prompts(2, 64, seed=1)
    with torch.no_grad():
        ref = model(long).logits
        s = stream.PrefillStreamer(stream.blocks_of(model), "auto", costs=COSTS.with_(cpu_row_s=1e-4))
        model(short)
        assert s.last["mode"] == "cpu" and not s.experts.ready
        got = model(long).logits
        assert s.last["mode"] in ("split", "gpu") and s.experts.ready
    assert _err(got, ref.double()) < NATIVE_TOL["bf16"]


def test_costs_are_measured_once():
    """Without costs given, auto measures them at its first long forward (CPU: two native forwards; off CUDA the
    GPU's numbers are defaults) and keeps them."""
    from ktinject.gpu_experts.prefill import measure

    model = _tiny("qwen3_moe", prefill="cpu")
    s = stream.PrefillStreamer(stream.blocks_of(model), "auto")
    b = s.blocks[0]
    c = s.costs_for(b)
    assert c.cpu_expert_s >= 0 and c.cpu_row_s > 0 and c.expert_bytes == s.experts.layouts[0].expert_bytes
    assert c.gpu_row_s == policy.gpu_default_costs(64, 32, "bf16")["gpu_row_s"]
    assert s.costs_for(b) == c and len(s._costs) == 1
    per_expert, per_row = measure.cpu_costs(b.native_experts)
    assert per_row > 0
    s.setup()
    got = measure.gpu_costs(s.experts, 0, b)  # the same measurement on the CPU device's buffers
    assert got["gpu_expert_s"] > 0 and got["gpu_row_s"] > 0


def test_split_forwards_measure_layer_s_and_the_cpu(monkeypatch):
    """A split forward's host clock feeds the model: layer_s of its T (from the third layer on: the time from one
    layer's CPU task done to the next one's submit) and the CPU's correction (its tasks' times against the model's);
    costs_for(block, T) uses them, and the next forward decides again."""
    model = build_tiny_model("qwen3_moe", dtype=torch.float32, num_hidden_layers=4)
    ktinject.inject(model, gpu="cpu", prefill="cpu")
    ids = tiny_prompts(1, 40, seed=5)
    s = stream.attach(model, "gpu")
    s.switch("auto")
    b = s.blocks[0]
    base = s.costs_for(b)
    monkeypatch.setattr(s, "_decide", lambda *a: "split")
    monkeypatch.setattr(policy, "choose_split", lambda counts, eligible, costs: [int(np.argmax(counts))])
    monkeypatch.setattr(balance, "WAITED_S", 0.0)  # the tiny model's tasks may end within 0.1 ms
    s._decisions[("marker",)] = "cpu"
    with torch.no_grad():
        model(ids)
    T = ids.shape[1]
    m = s.feedback.measured
    assert set(m.layer) == {T} and 0 < m.layer_s(T) < 5.0
    scale = m.cpu_scale(s._costs_key(b))
    assert 0 < scale and 3 <= len(m.cpu[s._costs_key(b)]) <= 4  # a sample a layer (one may be an outlier)
    assert 1 <= len(m.layer[T]) <= 2  # from the third layer on (the first ones allocate, compile)
    c = s.costs_for(b, T)
    assert c.layer_s == m.layer_s(T) and c.cpu_expert_s == pytest.approx(base.cpu_expert_s * scale)
    assert s.costs_for(b, 4 * T).layer_s == m.layer_s(T)  # another length: the nearest measured stands in
    assert s.costs_for(b).layer_s == base.layer_s  # no length: the model's (it raised TypeError once measured)
    with torch.no_grad():
        model(ids)
    assert ("marker",) not in s._decisions  # re-decided with what the last forward measured
    stream.attach(model, "cpu")


def test_ahead_balance_steers_n_to_where_copy_and_cpu_meet():
    """balance.AheadBalance: n unchanged until a copy and a CPU task were measured; then (layer_s + p m) / (c + p),
    at most STEP a layer, within [1, min(cap, m)]; kept per T for the next forward."""
    from ktinject.gpu_experts.prefill.feedback import STEP, AheadBalance

    b = AheadBalance()
    assert b.start(512, 40) == 40 and b.steer(512, 40, 128, 0.0, 128) == 40  # nothing measured
    b.copied(512, 40 * 1e-4, 40)  # 0.1 ms an expert copied
    assert b.steer(512, 40, 128, 0.0, 128) == 40
    b.computed(512, 88 * 1e-4, 88)  # 0.1 ms an expert on the CPU
    assert b.steer(512, 60, 128, 0.0, 128) == 64  # equal rates, no host part: half
    assert b.steer(512, 40, 128, 0.0, 128) == 40 + STEP  # at most STEP a layer
    assert b.steer(512, 64, 128, 2e-3, 128) == 64 + STEP  # the host's 2 ms on the CPU's side: the GPU takes 10 more
    assert b.steer(512, 74, 128, 2e-3, 128) == 74 and b.start(512, 1) == 74  # kept for the next forward of 512
    assert b.steer(512, 74, 128, 2e-3, 70) == 70 and b.steer(512, 2, 3, 1.0, 128) == 3  # cap, m
    assert b.start(2048, 17) == b.n[512] == 3  # another length: the nearest length steered (last: 3)
    assert AheadBalance().start(512, 0) == 1  # never none: with nothing copied no rate would ever be measured
    b.copied(512, 0.0, 0)
    b.computed(512, 1.0, 0)  # empty samples ignored
    assert b.copy_s.median(512) == pytest.approx(1e-4) and b.cpu_s.median(512) == pytest.approx(1e-4)


def test_measured_medians_shrug_off_one_slow_layer():
    """balance.Measured: medians of the last samples (a kernel compiled inside one layer's gap must not make auto
    think every layer is slow), the nearest measured length standing in for another, defaults where nothing is."""
    from ktinject.gpu_experts.prefill.feedback import WINDOW, Measured

    m = Measured()
    assert m.layer_s(512) is None and m.cpu_scale("k") == 1.0 and m.h2d_shared() is None
    for v in (2e-3, 1.5, 2.2e-3, 1.9e-3):  # 1.5 s: a JIT compile
        m.layer.add(512, v)
    assert m.layer_s(512) == pytest.approx(2.1e-3)
    m.layer.add(512, 0.5)  # over OUTLIER x the median of those kept: dropped
    assert len(m.layer[512]) == 4 and m.layer_s(512) == pytest.approx(2.1e-3)
    m.layer.add(8192, 9e-3)
    assert m.layer_s(1024) == pytest.approx(2.1e-3) and m.layer_s(4096) == 9e-3 and m.layer_s(64) == m.layer_s(512)
    assert m.layer_s(None) is None  # no length given: nothing stands in
    for _ in range(WINDOW):
        m.layer.add(512, 3e-3)
    assert m.layer_s(512) == 3e-3  # only the last WINDOW count
    from ktinject.gpu_experts.prefill.feedback import DROPS

    for _ in range(DROPS):
        m.layer.add(512, 0.1)  # dropped: over OUTLIER x the median
    assert m.layer_s(512) == 3e-3
    m.layer.add(512, 0.1)  # one more in a row: the level has moved, the samples restart from it
    assert m.layer_s(512) == 0.1 and len(m.layer[512]) == 1
    m.cpu.add("k", 1.4)
    m.copy.add(0, 44e9)
    assert m.cpu_scale("k") == 1.4 and m.h2d_shared() == 44e9
    slow = INT4.with_(h2d_shared=INT4.h2d / 2)  # copies at half speed beside the CPU: ahead gives the GPU less
    assert policy.ahead_split(512, 8, 128, slow)[0] < policy.ahead_split(512, 8, 128, INT4)[0]


def test_ahead_estimate_from_measured_rates():
    """AheadBalance.estimate: ahead's layer time at the balanced n from the measured per-expert rates (the nearest
    measured T for another), which auto's choice uses in place of the model's once ahead has run."""
    from ktinject.gpu_experts.prefill.feedback import AheadBalance

    b = AheadBalance()
    assert b.estimate(512, 128, 2e-3, 128) is None
    b.copied(512, 50e-6 * 64, 64)  # 50 us an expert copied
    b.computed(512, 100e-6 * 64, 64)  # 100 us an expert on the CPU
    n = (2e-3 + 100e-6 * 128) / 150e-6
    assert b.estimate(512, 128, 2e-3, 128) == pytest.approx(50e-6 * n)
    assert b.estimate(2048, 128, 2e-3, 128) == b.estimate(512, 128, 2e-3, 128)  # nearest measured T
    assert b.estimate(512, 128, 2e-3, 40) == pytest.approx(2e-3 + 100e-6 * 88)  # a slot of 40: the CPU's side
    costs = INT4.with_(layer_s=2e-3)
    assert policy.choose_mode(512, 8, 128, costs, None, ahead_s=1.0) == "gpu"  # measured ahead too slow
    assert policy.choose_mode(512, 8, 128, costs, None, ahead_s=1e-3) == "ahead"


def test_trials_check_a_shared_mode_against_the_pure_modes():
    """balance.Trials: a split / ahead choice runs as proposed for TRIALS forwards of its length's bucket, then gpu
    mode for TRIALS, then cpu mode for TRIALS, then whichever ran a layer fastest; gpu and cpu choices are taken as
    they are."""
    from ktinject.gpu_experts.prefill.feedback import TRIALS, Trials

    assert TRIALS == 2
    t = Trials()
    assert t.pick(512, "gpu", "gpu", "cpu") == "gpu" and t.pick(512, "cpu", "gpu", "cpu") == "cpu"
    assert t.pick(512, "ahead", "gpu", "cpu") == "ahead"  # nothing measured yet
    t.add(512, "ahead", 30e-3)  # a first forward: one-time costs
    assert t.pick(600, "ahead", "gpu", "cpu") == "ahead"
    t.add(700, "ahead", 8e-3)
    assert t.pick(600, "ahead", "gpu", "cpu") == "gpu"  # same bucket (512..1023): the first alternative's turn
    t.add(512, "gpu", 9e-3)
    assert t.pick(512, "ahead", "gpu", "cpu") == "gpu"
    t.add(512, "gpu", 9.5e-3)
    assert t.pick(512, "ahead", "gpu", "cpu") == "cpu"  # then the second's
    assert t.pick(512, "ahead", "gpu") == "ahead"  # (with gpu alone: ahead's best, 8 ms, beats gpu's, 9)
    t.add(512, "cpu", 12e-3)
    t.add(512, "cpu", 11e-3)
    assert t.pick(512, "ahead", "gpu", "cpu") == "ahead"  # ahead's best (8 ms) beats gpu's (9) and cpu's (11)
    t.add(512, "cpu", 7e-3)
    assert t.pick(512, "ahead", "gpu", "cpu") == "cpu"  # now cpu's best is
    t.add(512, "gpu", 6e-3)
    assert t.pick(1000, "ahead", "gpu", "cpu") == "gpu"  # and now gpu's
    assert t.pick(2048, "ahead", "gpu", "cpu") == "ahead" and Trials.bucket(2047) == 1024 and Trials.bucket(1) == 1


def test_auto_times_its_forwards_into_trials(monkeypatch):
    """A streamer in auto mode records each forward's time a layer under its mode (host clock off CUDA) when the
    next forward starts; _decide's split choice runs twice, then gpu mode twice, then cpu mode twice, then the
    fastest."""
    model = _tiny("qwen3_moe", prefill="cpu")
    ids = tiny_prompts(1, stream.AUTO_MIN_TOKENS + 16, seed=5)
    s = stream.attach(model, "gpu")
    s.switch("auto")
    monkeypatch.setattr(stream, "CPU_TRIAL_RATIO", 1e9)  # cpu's turn whatever the tiny model's costs say
    with torch.no_grad():
        monkeypatch.setattr(policy, "choose_mode", lambda *a, **kw: "split")
        for _ in range(2):
            model(ids)
            assert s.last["mode"] == "split"
        for _ in range(2):
            model(ids)
            assert s.last["mode"] in ("gpu", "gpu-used")  # the alternative's turn
        alternative = s.last["mode"]
        for _ in range(2):
            model(ids)
            assert s.last["mode"] == "cpu"  # then cpu mode's (the streamer declines; its span still timed)
        model(ids)  # by now all three were timed: the fastest
        assert {m for (_, m) in s.feedback.trials.seconds} == {"split", alternative, "cpu"}
        assert s.last["mode"] in ("split", alternative, "cpu")
        # where the cost model puts cpu far behind the shared mode, its turn is skipped (a long prompt's cpu forward
        # takes seconds)
        monkeypatch.setattr(stream, "CPU_TRIAL_RATIO", 0.0)
        s.switch("auto")
        s.feedback.trials.seconds.clear()
        s.feedback._span = None  # the last forward's span too: it would join the trials at the next start (as the
        # fastest mode, whichever that was on this host: split here made the sequence below split, gpu, ...)
        for want in ("split", "split", alternative, alternative):
            model(ids)
            assert s.last["mode"] == want
        model(ids)
        assert s.last["mode"] in ("split", alternative)
    stream.attach(model, "cpu")


def test_ahead_layer_takes_the_set_fetched_for_it_when_n_moves(monkeypatch):
    """The balance moves n after a layer's GPU work is queued (balance.Feedback.steer, CUDA), i.e. after that work
    fetched the next layer's set: the next layer still takes that set (n applies from the next fetch), so its copy
    is neither dropped nor made again after the routing, where nothing hides it. Here n moves after every layer."""
    model = _tiny("qwen3_moe", prefill="cpu")
    ids = tiny_prompts(2, 20)
    s = stream.attach(model, "gpu")
    monkeypatch.setattr(s, "_decide", lambda *a: "ahead")
    monkeypatch.setattr(s, "_ahead_n", lambda *a: 3)
    layer_stream = s.experts.stream

    def steered(*a, **kw):  # as on CUDA: n steered once the layer's GPU work (and the next layer's fetch) is queued
        out = layer_stream(*a, **kw)
        s._n_ahead += 1
        return out

    monkeypatch.setattr(s.experts, "stream", steered)
    with torch.no_grad():
        model(ids)
    B = s.experts.layouts[0].expert_bytes
    assert s.last["gpu_experts"] == [3, 3]  # layer 1 took the 3 fetched during layer 0
    ring = s.experts.ring
    assert ring.copied == (3 + 3 + 4) * B and len(ring.pending.experts) == 4  # + the next forward's first, n=4
    stream.attach(model, "cpu")


class _Event:
    """A CUDA event's stand-in: ``passed`` says whether the device has passed it; times in ms."""

    def __init__(self, ms: float, passed: bool = True):
        self.ms, self.passed = ms, passed

    def query(self) -> bool:
        return self.passed

    def elapsed_time(self, end) -> float:
        return end.ms - self.ms


def test_trials_keep_a_forward_the_device_has_not_passed_yet():
    """A forward queued without a host sync (gpu mode; the next chunk of a long prompt starts at once) has not ended
    on the device when the next one starts: its time goes into the trials at a later start, not lost (lost, the
    alternative never reached TRIALS samples and auto explored it for good)."""
    f = balance.Feedback(cuda=True, layers=2)
    first_end = _Event(10.0, passed=False)
    clocks = iter([_Event(0.0), first_end, _Event(20.0), _Event(26.0)])
    f._clock = lambda: next(clocks)
    for _ in range(2):
        f.start_forward()
        f.forward_mode(512, "gpu")
        f.last_block()
    assert (512, "gpu") not in f.trials.seconds  # the first still running on the device, the second just ended
    first_end.passed = True  # the device got past the first forward's end
    f.start_forward()
    assert sorted(f.trials.seconds[(512, "gpu")]) == pytest.approx([3e-3, 5e-3])  # 6 ms and 10 ms over 2 layers
    f.start_forward()
    assert len(f.trials.seconds[(512, "gpu")]) == 2  # each taken once


def test_prepare_does_the_first_prompts_one_time_work():
    """PrefillStreamer.prepare (a server's warm-up calls it on CUDA): the set-up and, in auto mode, the cost model's
    measurements, once; a later forward finds them done."""
    model = _tiny("qwen3_moe", prefill="cpu")
    s = stream.PrefillStreamer(stream.blocks_of(model), "auto")
    assert not s.experts.ready and not s._costs
    assert s.prepare() >= 0.0
    assert s.experts.ready and len(s._costs) == 1
    costs = dict(s._costs)
    s.prepare()
    assert s._costs == costs  # measured once
    g = stream.PrefillStreamer(stream.blocks_of(model), "gpu")
    g.prepare()
    assert g.experts.ready and not g._costs  # gpu mode needs no cost model
    s.close()
    g.close()


def test_gated_spin_window_is_restored_unless_changed_meanwhile():
    """SplitLayers._quiet: the pool's watch spin window goes to GATED_WATCH_SPIN_US (0) while gated layers run and
    back afterwards, but a window the user set meanwhile stays (theirs, not undone)."""
    from ktinject.gpu_experts.prefill.split import GATED_WATCH_SPIN_US, SplitLayers

    pool = SimpleNamespace(watch_spin_us=1000)
    s = SplitLayers(None, None)  # (the spin window needs neither the streamer nor its device part)
    s._quiet(pool)
    assert pool.watch_spin_us == GATED_WATCH_SPIN_US == 0
    s._quiet(pool)  # a second gated layer: the first saved window is kept
    s._quiet(None)
    assert pool.watch_spin_us == 1000 and s._spin_saved is None
    s._quiet(pool)
    pool.watch_spin_us = 250  # changed while the gates run
    s._quiet(None)
    assert pool.watch_spin_us == 250
    s._quiet(None)  # nothing saved: nothing to do
    assert pool.watch_spin_us == 250


def test_a_gated_layer_feeds_back_the_ungated_layer_before(monkeypatch):
    """A forward whose layer i - 1 ran ungated with its CPU task left running (overlap) and whose layer i is gated:
    the gated layer settles that task and its times reach the feedback (they were dropped), as ``layer`` does."""
    from ktinject.gpu_experts.prefill import split

    calls = []
    streamer = SimpleNamespace(observe=lambda *a: calls.append(("observe",) + a))
    s = split.SplitLayers(streamer, None)
    s._pending = ("layer 0's task",)
    monkeypatch.setattr(s, "settle", lambda i=-1, T=None, closing=False: calls.append(("settle", i, T)) or
                        (i - 1, T, "counts", "times", True, True, 3, 1.0))
    monkeypatch.setattr(split.hostio, "usable", lambda device, o: True)
    monkeypatch.setattr(split, "staging", lambda pin: SimpleNamespace(get=lambda *a: None))

    class Stop(Exception):
        pass

    def gate(E):  # the gated layer's own work: not this test's
        raise Stop

    monkeypatch.setattr(split, "_Gate", gate)
    block = SimpleNamespace(num_experts=4)
    with pytest.raises(Stop):
        s._gated(1, block, torch.zeros(5, 8), None, None)
    assert calls == [("settle", 1, 5), ("observe", 0, 5, "counts", "times", True, True, 3, 1.0)]


def test_settle_waits_for_the_gpu_part_before_timing_it(monkeypatch):
    """SplitLayers.settle reads the GPU part's time (CUDA events) of the layer it settles only once that part has
    ended: a gated layer settles an ungated one with no sync before it (elapsed_time on a pending event raises)."""
    from ktinject.gpu_experts.prefill.split import SplitLayers

    class Event:
        done = False

        def synchronize(self):
            self.done = True

        def elapsed_time(self, end):
            assert end.done, "timed before the GPU part ended"
            return 1000.0  # ms: the GPU part ends after the CPU task

    s = SplitLayers(None, None)  # (settling a task needs neither the streamer nor its device part)
    task = SimpleNamespace(wait=lambda: None, times=lambda: (10.0, 10.001))
    monkeypatch.setattr(s, "_task", lambda: task)
    s._pending = (0, 5, "counts", (9.0, 9.5, 9.6), Event(), Event(), True, 3)
    got = s.settle(1, 5)
    assert got == (0, 5, "counts", (9.0, 9.5, 9.6, 9.6, 10.5), True, True, 3, 10.001) and s._pending is None
