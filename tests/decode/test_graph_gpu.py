"""CUDA graph decode and stream-signalled experts on a GPU (skipped without CUDA).

Graph decode must give exactly the eager decode's tokens (same kernels, same native experts), and Hugging Face's
greedy choices on the un-injected model: checked teacher-forced in float32 (expert weights of the reference
rounded to bf16 as native stores them), each generated token must be HF's argmax or within a small logit margin
of it (native rounds activations for its bf16 kernels). In bf16 a routing near-tie can flip an expert and move
logits by ~1, so there only graph == eager is asserted and agreement with HF is printed.
"""
from __future__ import annotations

import pytest
import torch

import ktinject
from ktinject.decode.generate import get_runner
from ktinject.tiny_models import tiny_prompts

from tests.references import greedy_margins, pair

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# qwen2_moe: q/k/v biases and a gated shared expert through the fused attention; gpt_oss: sliding-window masks and
# an MLP returning (hidden, scores) through the decoder-layer decode forward, with HF's attention (sinks)
FAMILIES = ("qwen3_moe", "deepseek_v3", "mixtral", "qwen2_moe", "gpt_oss")
N = 32
MARGIN = 0.15  # logits (std ~2): bf16 rounding differences between native and torch experts stay well below


@pytest.fixture(scope="module", params=FAMILIES)
def models(request):
    ref, inj = pair(request.param, torch.bfloat16)
    yield request.param, ref, inj
    get_runner(inj).close()


@pytest.fixture(scope="module")
def models_f32(models):
    ref, inj = pair(models[0], torch.float32)
    yield models[0], ref, inj
    get_runner(inj).close()


def _prompts(batch: int, length: int, seed: int):
    ids = tiny_prompts(batch, length, seed=seed).cuda()
    mask = torch.ones_like(ids)
    if batch > 1:  # left padding on the second row
        ids[1, :3] = 0
        mask[1, :3] = 0
    return ids, mask


def _assert_hf_greedy(ref, seq, mask, prompt_len):
    """Each generated token is HF's greedy choice given the tokens before it (up to MARGIN in the logits)."""
    margin = greedy_margins(ref, seq, mask, prompt_len)
    assert float(margin.max()) <= MARGIN, f"token off HF's argmax by {float(margin.max()):.3f} logits"
    return bool((margin == 0).all())


def _generate(inj, ids, mask, graphs: bool, **kw):
    runner = get_runner(inj, use_graphs=graphs)
    out = ktinject.generate(inj, ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                            pad_token_id=0, eos_token_id=None, **kw)
    return out, runner


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("batch", [1, 2])
def test_graph_equals_eager_and_hf(models, models_f32, batch, dtype):
    family, ref, inj = models if dtype == "bf16" else models_f32
    ids, mask = _prompts(batch, 9, seed=batch)
    eager, _ = _generate(inj, ids, mask, graphs=False)
    graph, runner = _generate(inj, ids, mask, graphs=True)
    assert not runner.stats.capture_failures, runner.stats.capture_failures
    assert runner.stats.captures == 1 and runner.stats.replays == N - 1 and runner.stats.eager_decode == 0
    assert torch.equal(graph, eager)
    hf = ref.generate(ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                      pad_token_id=0, eos_token_id=None)
    if dtype == "f32":
        exact = _assert_hf_greedy(ref, graph, mask, ids.shape[1])
    else:
        try:
            exact = _assert_hf_greedy(ref, graph, mask, ids.shape[1])
        except AssertionError as e:
            exact = f"no: {e}"
    print(f"{family} {dtype} batch {batch}: graph == eager; HF tokens identical: {torch.equal(graph, hf)} "
          f"(all HF's argmax: {exact})")


def test_graph_equals_eager_with_the_gemv_kernels(monkeypatch):
    """KTINJECT_GEMV=triton: every one-row projection and the LM head by the Triton GEMV (a tiny model's weights are
    under fused_dense.MEASURE_FROM, so the timing would leave them to cuBLAS): graph decode equals eager decode at
    batch 1, its own model (the module's fixtures keep their graphs)."""
    monkeypatch.setenv("KTINJECT_GEMV", "triton")
    ref, inj = pair("qwen3_moe", torch.bfloat16)
    try:
        ids, mask = _prompts(1, 9, seed=7)
        eager, _ = _generate(inj, ids, mask, graphs=False)
        graph, runner = _generate(inj, ids, mask, graphs=True)
        assert not runner.stats.capture_failures and runner.stats.replays == N - 1
        assert torch.equal(graph, eager)
    finally:
        get_runner(inj).close()


def test_in_graph_masks_pool_wake_and_attention(models_f32):
    """Decode graphs take the 2D padding mask (the 4D mask is built in the graph) and wake the expert pool before
    each replay: the same tokens as HF-built 4D masks; ktinject_sdpa and HF's sdpa both give HF's greedy tokens."""
    from ktinject.operators.attention import KTINJECT_SDPA

    _, ref, inj = models_f32
    ids, mask = _prompts(2, 9, seed=7)
    graph, runner = _generate(inj, ids, mask, graphs=True)
    live = [(k, g) for k, g in runner.graphs.items() if g is not None]
    assert live and all(("attention_mask", "2d", mask.dtype) in k[1] for k, _ in live)
    assert all(g.pools for _, g in live)
    get_runner(inj, use_graphs=True, own_masks=False)
    try:
        four_d = ktinject.generate(inj, ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N,
                                   do_sample=False, pad_token_id=0, eos_token_id=None)
        # HF's own masks for configs with layer_types are a dict per layer type, which the runner does not hold
        # static (those steps run eagerly, reported by fastpaths): the tokens must still match
        dict_masks = getattr(inj.config, "layer_types", None) is not None
        assert get_runner(inj).stats.replays == (0 if dict_masks else N - 1)
    finally:
        get_runner(inj, use_graphs=True)
    assert torch.equal(graph, four_d)
    _assert_hf_greedy(ref, graph, mask, ids.shape[1])
    if type(inj).__name__.startswith("GptOss"):
        # gpt-oss's attention sinks: HF runs it eagerly (no SDPA kernel takes sinks), and so does the injected model
        assert inj.config._attn_implementation == "eager"
        return
    assert inj.config._attn_implementation == KTINJECT_SDPA
    inj.set_attn_implementation("sdpa")
    try:
        hf_sdpa, _ = _generate(inj, ids, mask, graphs=True)
    finally:
        inj.set_attn_implementation(KTINJECT_SDPA)
        get_runner(inj, use_graphs=True)
    _assert_hf_greedy(ref, hf_sdpa, mask, ids.shape[1])


def test_second_call_reuses_graph(models):
    _, _, inj = models
    ids, mask = _prompts(1, 7, seed=3)
    _, runner = _generate(inj, ids, mask, graphs=True)
    captures = runner.stats.captures
    ids2, mask2 = _prompts(1, 12, seed=4)
    graph = ktinject.generate(inj, ids2, attention_mask=mask2, max_new_tokens=N, do_sample=False, pad_token_id=0,
                              eos_token_id=None, min_new_tokens=N)
    assert get_runner(inj) is runner and runner.stats.captures == captures  # nothing captured again
    eager, _ = _generate(inj, ids2, mask2, graphs=False)
    assert torch.equal(graph, eager)


def test_failed_capture_leaves_no_stale_handshake(models, monkeypatch):
    """A warm-up cut short between a layer's go and its collect (the collect's launch raises once): the capture
    fails, that step runs eagerly, and the runners are reset (StreamExperts.reset), so a later capture's steps do
    not take the abandoned step's done word for their own: graph decode afterwards equals eager decode."""
    from ktinject.operators.kernels import dense as fused_dense

    family, _, inj = models
    ids, mask = _prompts(1, 8, seed=11)
    want, _ = _generate(inj, ids, mask, graphs=False)
    real, calls = fused_dense.collect_add_rms_norm, []

    def once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: the collect's launch failed")
        return real(*args, **kwargs)

    get_runner(inj, use_graphs=True)  # a fresh runner: its first decode step captures
    monkeypatch.setattr(fused_dense, "collect_add_rms_norm", once)
    out, runner = ktinject.generate(inj, ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N,
                                    do_sample=False, pad_token_id=0, eos_token_id=None), get_runner(inj)
    if not calls:
        pytest.skip(f"{family}: the decode step does not collect inside the add + norm here")
    assert runner.stats.capture_failures and torch.equal(out, want)
    monkeypatch.setattr(fused_dense, "collect_add_rms_norm", real)
    runner.reset()  # graphs dropped, runners kept (with what the failed warm-up left in them)
    again = ktinject.generate(inj, ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
    assert runner.stats.captures >= 1 and runner.stats.replays > 0
    assert torch.equal(again, want)


def test_padded_batch_uses_bucket(models_f32):
    _, ref, inj = models_f32
    ids = tiny_prompts(3, 8, seed=5).cuda()
    mask = torch.ones_like(ids)
    graph, runner = _generate(inj, ids, mask, graphs=True)
    assert graph.shape[0] == 3 and 4 in runner.caches and runner.stats.replays == N - 1
    _assert_hf_greedy(ref, graph, mask, ids.shape[1])


def test_sampling_reproducible(models):
    _, _, inj = models
    ids, mask = _prompts(2, 6, seed=6)
    kw = dict(do_sample=True, top_k=20, temperature=1.2, max_new_tokens=N, pad_token_id=0)
    get_runner(inj, use_graphs=True)
    outs = []
    for _ in range(2):
        torch.manual_seed(1234)
        outs.append(ktinject.generate(inj, ids, attention_mask=mask, **kw))
    get_runner(inj, use_graphs=False)
    torch.manual_seed(1234)
    eager = ktinject.generate(inj, ids, attention_mask=mask, **kw)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], eager)


class _Recorder:
    """A streamer that keeps what it is given."""

    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens.append(value.detach().cpu().reshape(-1).clone())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("streamed", [False, True])
def test_deferred_stop_on_eos(models, streamed):
    """Stopping on EOS with the stop check deferred a step: the same tokens as the synchronous check and eager
    decode, the dropped step's token neither returned nor streamed, and exactly one replay more."""
    _, _, inj = models
    ids, mask = _prompts(1, 8, seed=11)
    free, _ = _generate(inj, ids, mask, graphs=True)
    eos = int(free[0, ids.shape[1] + 9])  # a token generated at step 10: stop there (or earlier where it repeats)
    results = {}
    for name, kw in {"deferred": dict(use_graphs=True), "sync": dict(use_graphs=True, defer_stop=False),
                     "eager": dict(use_graphs=False)}.items():
        runner = get_runner(inj, **kw)
        rec = _Recorder() if streamed else None
        out = ktinject.generate(inj, ids, attention_mask=mask, max_new_tokens=N, do_sample=False, pad_token_id=0,
                                eos_token_id=eos, streamer=rec)
        results[name] = (out, rec, runner.stats.replays)
    out, rec, replays = results["deferred"]
    steps = out.shape[1] - ids.shape[1]
    assert int(out[0, -1]) == eos and steps <= 10
    assert torch.equal(out, results["sync"][0]) and torch.equal(out, results["eager"][0])
    assert replays == steps and results["sync"][2] == steps - 1  # one step computed and dropped
    if streamed:
        assert rec.ended and torch.equal(torch.cat(rec.tokens), out[0].cpu())
        assert torch.equal(torch.cat(results["sync"][1].tokens), out[0].cpu())
    get_runner(inj, use_graphs=True)


# ---- StreamExperts alone ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def experts():
    from ktinject import native

    gen = torch.Generator().manual_seed(0)
    E, H, I = 8, 64, 32
    return native.Experts.from_hf(torch.randn(E, 2 * I, H, generator=gen) / 8, torch.randn(E, H, I, generator=gen) / 6)


def _inputs(T, k, E, H, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen)
    return x, ids, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["memops", "hostfn"])
def test_stream_experts_equals_native(experts, mode, dtype):
    from ktinject.operators.handshake import StreamExperts

    T, k, E, H = 3, 2, experts.num_experts, experts.hidden
    r = StreamExperts(experts, T, k, H, "cuda", dtype=dtype, mode=mode)
    try:
        x, ids, w = _inputs(T, k, E, H, 0, dtype)
        out = r(x.cuda(), ids.cuda(), w.cuda())
        ref = experts.forward(x, ids, w)
        assert torch.equal(out.cpu(), ref)
        # captured: static inputs, replayed with new values
        sx, sids, sw = x.cuda(), ids.cuda(), w.cuda()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            r(sx, sids, sw)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            y = r(sx * 2, sids, sw) + 1
        for seed in (1, 2, 3):
            x, ids, w = _inputs(T, k, E, H, seed, dtype)
            sx.copy_(x)
            sids.copy_(ids)
            sw.copy_(w)
            g.replay()
            torch.cuda.synchronize()
            want = experts.forward((x.float() * 2).to(dtype), ids, w).cuda() + 1
            assert torch.equal(y, want)
    finally:
        r.close()


@pytest.mark.parametrize("mode", ["memops", "hostfn"])
def test_stream_experts_reset_after_an_abandoned_step(experts, mode):
    """A step cut short after its go (no collect queued) leaves done = 1 behind, and a lazy finish leaves a pending
    collect: reset() (what a failed graph capture calls) clears both, and the next step computes its own output."""
    import time

    from ktinject.operators.handshake import StreamExperts

    k, E, H = 2, experts.num_experts, experts.hidden
    for T in (1, 3):
        r = StreamExperts(experts, T, k, H, "cuda", mode=mode)
        try:
            x, ids, w = _inputs(T, k, E, H, 4)
            r.start(x.cuda(), ids.cuda(), w.cuda())  # go, and no collect: the step ends here
            torch.cuda.synchronize()
            if mode == "memops":
                deadline = time.monotonic() + 10
                while int(r.flags[r.DONE]) != 1 and time.monotonic() < deadline:
                    time.sleep(1e-3)
                assert int(r.flags[r.DONE]) == 1  # what the next step's collect would have taken for its own
            r.reset()
            assert not r.flags.any() and not r.pending
            x, ids, w = _inputs(T, k, E, H, 5)
            r.start(x.cuda(), ids.cuda(), w.cuda())
            out = r.finish(lazy=True)  # at T = 1 (memops, Triton): pending, nothing queued
            if r.pending:
                torch.cuda.synchronize()  # reset's precondition: the device idle (its go is written)
                r.reset()  # dropped: the task ran or never will, its output is never collected
                assert not r.pending and not r.flags.any()
                r.start(x.cuda(), ids.cuda(), w.cuda())
                out = r.finish()
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), experts.forward(x, ids, w))
        finally:
            r.close()


@pytest.mark.parametrize("mode", ["memops", "hostfn"])
def test_handshake_cost(mode):
    from ktinject.bench.handshake import handshake_cost

    hc = handshake_cost(n=16, iters=20, mode=mode)
    print(f"{mode}: {hc['per_handshake_us']:.1f} us per handshake ({hc})")
    assert hc["replay_us"] > 0
