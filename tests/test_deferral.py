"""Expert deferral (ktinject.operators.deferral) on the CPU, eager path.

- native slot selection: a task's "top" / "rest" parts equal the full forward with the other slots' weights zeroed,
  bit for bit (ties, awkward T, skipped experts); a watched task chained to another raises its go;
- defer=0 is today's path: the same logits, bit for bit, as a model injected without the option; prefill never
  defers (a defer=2 model's prefill logits equal defer=0's);
- defer=d against two references with the same semantics: (a) the injected model's own parts (router, native
  experts with zeroed weights, shared experts) put together plainly: bit for bit, hot experts, int8 and int4
  included; (b) the HF model in float32, its MoE blocks rewritten in plain torch, against the injected float32
  model: as close as the two are without deferral, while deferral itself moves the logits far more than that;
- bad values of defer name the rule or the argument; set_defer switches an injected model; a forward cut short
  leaves nothing behind.
Legend: B batch, S sequence, T tokens, H hidden, k experts per token, V vocabulary.
"""
from __future__ import annotations

import pytest
import torch

import ktinject
from ktinject import compat, native
from ktinject.operators import deferral
from ktinject.operators.base import OperatorError
from ktinject.operators.families import shared_output
from ktinject.operators.moe import HybridMoE
from ktinject.testing import build_tiny_model, plain_deferral, tiny_prompts

# family -> (config overrides: 3 MoE blocks where the family allows, d)
FAMILIES = {
    "qwen3_moe": (dict(num_hidden_layers=4), 1),  # k = 2; layer 0 dense
    "deepseek_v3": (dict(num_hidden_layers=4), 2),  # k = 4, shared experts; layer 0 dense
    "mixtral": (dict(num_hidden_layers=3), 1),  # k = 2
    "qwen2_moe": (dict(num_hidden_layers=4), 1),  # gated shared expert
}
PROMPT = tiny_prompts(2, 7, seed=4)  # [B=2, 7]
FEED = tiny_prompts(2, 6, seed=5)  # decode inputs, teacher-forced: [B, 6]


@torch.no_grad()
def decode_logits(model, prompt=PROMPT, feed=FEED) -> torch.Tensor:
    """[B, 1 + steps, V] float32: the prefill's last position, then one decode step per column of ``feed``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(prompt, **compat.cache_arg(cache), use_cache=True)
    rows = [out.logits[:, -1]]
    for t in range(feed.shape[1]):
        out = model(feed[:, t:t + 1], **compat.cache_arg(cache), use_cache=True)
        rows.append(out.logits[:, -1])
    return torch.stack(rows, 1).float()


def injected(family: str, f32: bool = False, **kw):
    """The tiny ``family`` model injected on the CPU; bf16, or (``f32``) float32 with bf16-rounded weights."""
    overrides, _ = FAMILIES[family]
    m = build_tiny_model(family, dtype=torch.bfloat16, **overrides)
    ktinject.inject(m.float() if f32 else m, gpu="cpu", **kw)
    return m


def immediate(weights: torch.Tensor, d: int) -> torch.Tensor:
    """bool [T, k]: the k - d slots of each token with the largest weights (equal weights: the lower slot first)."""
    order = torch.sort(weights.float(), dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1]).expand_as(order).contiguous())
    return rank < weights.shape[1] - d


# ---- native slot selection ------------------------------------------------------------------------------------
def _experts(E=8, H=48, I=40, quant="bf16", seed=0):
    gen = torch.Generator().manual_seed(seed)
    gu = torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5
    dn = torch.randn(E, H, I, generator=gen) / I ** 0.5
    return native.Experts.from_hf(gu, dn, quant=quant)


@pytest.mark.parametrize("quant", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("T,k,d", [(1, 4, 1), (3, 4, 3), (5, 3, 1), (7, 8, 5)])
def test_task_select_equals_zeroed_weights(quant, T, k, d):
    E, H = 8, 48
    ex = _experts(E, H, quant=quant, seed=T)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen)
    w[0, -1] = w[0, 0]  # a tie: the lower slot ranks first
    skip = torch.zeros(E, dtype=torch.uint8)
    skip[int(ids[-1, 0])] = 1
    imm = immediate(w, d)
    assert bool(imm[0, 0]) or not bool(imm[0, -1])
    for part, mask in (("top", imm), ("rest", ~imm)):
        with native.Task() as task:
            out = torch.empty(T, H, dtype=torch.bfloat16)
            task.bind(ex, x, ids, w, skip=skip, out=out)
            task.select(part, d)
            task.submit()
            task.wait()
        assert torch.equal(out, ex.forward(x, ids, w * mask, skip=skip)), part


def test_task_select_errors():
    ex = _experts()
    x, ids, w = torch.zeros(2, 48), torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3)
    with native.Task() as task:
        with pytest.raises(native.NativeError, match="no bound forward"):
            task.select("top", 1)
        task.bind(ex, x, ids, w)
        for d in (0, 3):
            with pytest.raises(native.NativeError, match=rf"d = {d} deferred slots of k = 3 \(expected 1 <= d < k\)"):
                task.select("rest", d)
        with pytest.raises(native.NativeError, match="slots 'some'"):
            task.select("some", 1)
        task.select("all")


def test_watch_then_runs_the_chained_task():
    """The first task's end raises the second's go (after its own done): both ran, in that order."""
    ex = _experts()
    gen = torch.Generator().manual_seed(3)
    x, ids, w = torch.randn(2, 48, generator=gen), torch.randint(0, 8, (2, 4), generator=gen), torch.rand(2, 4)
    flags = torch.zeros(64, dtype=torch.int32)  # go, done, go_d, done_d on their own 64-byte lines
    addr = flags.data_ptr()
    a, b = native.Task(), native.Task()
    oa, ob = torch.empty(2, 48), torch.empty(2, 48)
    a.bind(ex, x, ids, w, out=oa)
    a.select("top", 1)
    b.bind(ex, x, ids, w, out=ob)
    b.select("rest", 1)
    try:
        b.watch(addr + 128, addr + 192)
        a.watch(addr, addr + 64, then_addr=addr + 128)
        for _ in range(3):  # a step, three times: the GPU's role played by the host
            flags[16] = 0
            flags[48] = 0
            flags[0] = 1
            while int(flags[48]) != 1:
                pass
            assert int(flags[16]) == 1 and int(flags[0]) == 0 and int(flags[32]) == 0
        imm = immediate(w, 1)
        assert torch.equal(oa, ex.forward(x, ids, w * imm)) and torch.equal(ob, ex.forward(x, ids, w * ~imm))
    finally:
        a.close()
        b.close()


# ---- d = 0 and prefill --------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_defer_zero_is_todays_path(family):
    base = decode_logits(injected(family))
    assert torch.equal(decode_logits(injected(family, defer=0)), base)
    two = injected(family, defer=FAMILIES[family][1])
    from transformers import DynamicCache

    with torch.no_grad():  # a prefill forward never defers
        pre = two(PROMPT, **compat.cache_arg(DynamicCache(config=two.config)), use_cache=True).logits[:, -1].float()
    assert torch.equal(pre, base[:, 0])


# ---- reference (a): the injected model's own parts, put together plainly ----------------------------------------
class PlainDeferral:
    """Replaces each HybridMoE's forward with the deferral semantics written out: the block's router, its native
    experts once over the immediate slots and once over the deferred ones (other weights zeroed), hot experts on
    every slot, shared experts; the previous block's deferred output added last."""

    def __init__(self, model, d: int):
        self.d, self.pending = d, None
        self.blocks = [m for m in model.modules() if isinstance(m, HybridMoE)]
        for i, b in enumerate(self.blocks):
            b.forward = self._forward(b, i)

    def _forward(self, b, i):
        def forward(hidden):
            B, S, H = hidden.shape
            x = hidden.reshape(-1, H)
            w, ids = b.routing(x)
            defer = S == 1 and i < len(self.blocks) - 1
            imm = immediate(w, self.d) if defer else torch.ones_like(ids, dtype=torch.bool)
            routed = b.native_experts.forward(x, ids, w * imm, skip=b.skip).to(x.dtype)
            if b.hot is not None:
                routed = (b.hot(x, ids, w) + routed).to(x.dtype)
            out = routed + shared_output(b, b.spec.shared, x) if b.spec.shared else routed
            if i > 0 and self.pending is not None:
                out = out + self.pending
            self.pending = b.native_experts.forward(x, ids, w * ~imm, skip=b.skip).to(x.dtype) if defer else None
            return out.view(B, S, H)
        return forward


@pytest.mark.parametrize("family", list(FAMILIES))
def test_eager_equals_plain_rendering_bitwise(family):
    d = FAMILIES[family][1]
    ref = injected(family)
    PlainDeferral(ref, d)
    assert torch.equal(decode_logits(injected(family, defer=d)), decode_logits(ref))


def test_hot_experts_with_deferral_bitwise():
    """GPU-resident experts (here the CPU stands in for the GPU) among the deferred slots run at once."""
    hot = dict(gpu_experts_budget="64KiB", placement="uniform")
    inj = injected("deepseek_v3", defer=3, **hot)
    ref = injected("deepseek_v3", **hot)
    blocks = [m for m in inj.modules() if isinstance(m, HybridMoE)]
    assert all(b.hot is not None and b.hot.residents() for b in blocks)
    PlainDeferral(ref, 3)
    assert torch.equal(decode_logits(inj), decode_logits(ref))


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_equals_plain_rendering_bitwise(quant):
    ref = injected("deepseek_v3", quant=quant)
    PlainDeferral(ref, 1)
    assert torch.equal(decode_logits(injected("deepseek_v3", quant=quant, defer=1)), decode_logits(ref))


# ---- reference (b): HF in float32, MoE blocks in plain torch ---------------------------------------------------
def torch_deferral(model, d: int) -> None:
    """Rewrite the HF MoE blocks of ``model`` (float32) in plain torch with deferral: per token the d lowest-weighted
    slots' sum goes to the next MoE block's output; the last block and prefill defer nothing."""
    plain_deferral(model, lambda w: ~immediate(w, d))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_eager_equals_torch_reference(family):
    overrides, d = FAMILIES[family]
    truth = build_tiny_model(family, dtype=torch.bfloat16, **overrides).float()  # bf16-rounded weights
    ref0 = decode_logits(truth)
    torch_deferral(truth, d)
    ref = decode_logits(truth)
    inj, inj0 = decode_logits(injected(family, True, defer=d)), decode_logits(injected(family, True))
    err, err0, moved = _rel(inj, ref), _rel(inj0, ref0), _rel(ref, ref0)
    print(f"{family} d={d}: |inj_d - ref_d| {err:.4f}, |inj_0 - ref_0| {err0:.4f}, |ref_d - ref_0| {moved:.4f}")
    assert err <= 1.25 * err0 + 1e-3  # deferral adds no error of its own (measured: the same to 2 digits) ...
    assert moved >= 10 * err  # ... and the comparison tells deferral from none (measured: 27-185 x)
    assert torch.equal(ref[:, 0], ref0[:, 0])  # the reference's prefill does not defer either


# ---- configuration --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, 2, 1.5, True, "1"])
def test_bad_defer_names_the_rule_and_the_argument(bad, tmp_path):
    m = build_tiny_model("mixtral")  # k = 2
    with pytest.raises(OperatorError, match=r"moe: defer=.* for 'model.layers.0.mlp': expected an int with 0 <= "
                                            r"defer < k = 2 .*inject / from_pretrained / set_defer \(defer=d\)"):
        ktinject.inject(m, gpu="cpu", defer=bad)
    rules = tmp_path / "r.yaml"
    rules.write_text(f"- match: {{class: MixtralSparseMoeBlock}}\n  replace: moe\n  kwargs: {{defer: {bad!r}}}\n")
    with pytest.raises(OperatorError, match=r"r\.yaml: rule\[0\] \(line 1\): .*moe: defer="):
        ktinject.inject(build_tiny_model("mixtral"), rules=str(rules), gpu="cpu")


def test_set_defer_switches_an_injected_model():
    m = injected("deepseek_v3")
    base = decode_logits(m)
    deferral.set_defer(m, 2)
    assert torch.equal(decode_logits(m), decode_logits(injected("deepseek_v3", defer=2)))
    assert deferral.chain_of(m).setting == (2, 2, 2)
    with pytest.raises(OperatorError, match=r"defer=4 .*k = 4"):
        deferral.set_defer(m, 4)
    deferral.set_defer(m, 0)
    assert torch.equal(decode_logits(m), base)


def test_forward_cut_short_leaves_nothing_behind():
    m = injected("deepseek_v3", defer=2)
    blocks = deferral.chain_of(m).blocks

    def boom(module, args):
        raise RuntimeError("cut short")

    from transformers import DynamicCache

    cache = DynamicCache(config=m.config)
    with torch.no_grad():
        m(PROMPT, **compat.cache_arg(cache), use_cache=True)
        h = blocks[-1].register_forward_pre_hook(boom)
        with pytest.raises(RuntimeError, match="cut short"):
            m(FEED[:, :1], **compat.cache_arg(cache), use_cache=True)  # blocks 0 and 1 ran: 1 left its deferred work
        h.remove()
    assert deferral.chain_of(m).in_flight()
    assert torch.equal(decode_logits(m), decode_logits(injected("deepseek_v3", defer=2)))


# ---- python -m ktinject.eval --defer --------------------------------------------------------------------------
def test_eval_decode_scores_equal_the_prefill_scores():
    from ktinject import eval as kt_eval

    model = build_tiny_model("qwen3_moe", dtype=torch.float32)
    chunks = kt_eval.windows(tiny_prompts(1, 41, seed=6)[0], 12)  # lengths 12, 12, 12, 5: two batches
    s, tops = kt_eval.score(model, chunks)
    sd, tops_d = kt_eval.score_decode(model, chunks, tops, batch=2)
    assert sd.n == s.n == 11 * 3 + 4 and sd.perplexity == pytest.approx(s.perplexity, rel=1e-4)
    assert sd.agree == s.n and all(torch.equal(a, b) for a, b in zip(tops, tops_d))


def test_eval_defer_rows_on_the_demo_model():
    from ktinject import demo, eval as kt_eval

    rows = dict(kt_eval.run(demo.demo_model_dir(), demo.heldout_text(), ["bf16"], gpu="cpu", window=96,
                            max_tokens=768, defers=(1,)))
    base, d0, d1 = rows["bf16"], rows["bf16, decode steps, defer 0"], rows["bf16, decode steps, defer 1"]
    assert d0.n == d1.n == base.n
    assert d0.perplexity == pytest.approx(base.perplexity, rel=5e-3)  # the same model, token by token
    assert d1.agreement < d0.agreement  # deferral acted ...
    assert d1.perplexity < d0.perplexity * 1.05  # ... and costs little (4096 tokens: -0.14%; defer 2: +3%)
    with pytest.raises(SystemExit):
        kt_eval.main(["--defer", "one"])


def test_from_pretrained_and_chat_take_defer():
    from transformers import AutoModelForCausalLM

    from ktinject import chat, demo

    path = demo.demo_model_dir()
    streamed = ktinject.from_pretrained(path, gpu="cpu", defer=1, cache_dir=False, progress=False)
    assert deferral.chain_of(streamed).setting == (1, 1, 1, 1)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ktinject.inject(loaded, gpu="cpu", defer=1)
    prompt, feed = tiny_prompts(2, 5, seed=8, vocab=2048), tiny_prompts(2, 4, seed=9, vocab=2048)
    assert torch.equal(decode_logits(streamed, prompt, feed), decode_logits(loaded, prompt, feed))
    assert chat.parse_args(["--defer", "2"]).defer == 2 and chat.parse_args([]).defer == 0
    with pytest.raises(SystemExit):
        chat.parse_args(["--defer", "-1"])


def test_bench_decode_defer_rows_on_the_tiny_model(capsys):
    """The code path of ``python -m ktinject.bench decode --defer`` (on a CPU: eager decode, GPU columns n/a)."""
    from ktinject.bench import decode as bench_decode, defer as bench_defer

    assert bench_decode.main(["--tiny", "--defer", "1", "--tokens", "2", "--defer-rounds", "1", "--hf-tokens", "0"]) == 0
    out = capsys.readouterr().out
    for row in ("defer: CPU experts alone", "defer: bound (CPU + GPU) / max(CPU, GPU)", "defer 0: eager decode",
                "defer 1: eager decode"):
        assert f"| {row}" in out, row
    assert bench_defer.parse("3,1", 4) == [0, 1, 3]
    # deferring a share s of the CPU work gives at most 1 + s, when the GPU part is s x the CPU part
    assert bench_defer.share_bound(12.0, 3.0, 0.25) == pytest.approx(1.25)
    assert bench_defer.share_bound(12.0, 3.54, 0.25) == pytest.approx(15.54 / 12.54)  # GPU part over s c
    assert bench_defer.share_bound(12.0, 1.0, 0.25) == pytest.approx(13.0 / 12.0)     # under it: 1 + g / c
    for bad in ("4", "x"):
        with pytest.raises(SystemExit, match="--defer"):
            bench_defer.parse(bad, 4)


def test_forget_drops_stream_work_and_waits_for_eager_work():
    """After a failed graph capture (its runners reset) the chain forgets its work in flight: a stream task's
    without waiting (no done word will come), an eager task's after waiting for it, as ``take`` would."""

    class Task:
        waited = 0

        def wait(self):
            Task.waited += 1

    class Block:
        defer = 1

    chain = deferral.DeferChain([Block(), Block()])
    stream = deferral.StreamPending.__new__(deferral.StreamPending)  # a runner's deferred task (never drained here)
    chain.put(chain.blocks[0], stream)
    chain.forget()
    assert not chain.in_flight() and Task.waited == 0
    chain.put(chain.blocks[0], deferral.EagerPending(Task(), torch.zeros(1, 4), torch.float32, torch.device("cpu")))
    chain.forget()
    assert not chain.in_flight() and Task.waited == 1
    assert chain.take(chain.blocks[1]) is None


def test_each_runs_every_task_before_raising_the_first_error():
    """StreamExperts unwatches (or waits for) every task of a runner before it raises the first error a run kept:
    an error of the immediate task must not leave the deferred one watched."""
    from ktinject.stream_experts import _each

    seen = []

    def op(t):
        seen.append(t)
        if t in ("a", "b"):
            raise RuntimeError(t)

    with pytest.raises(RuntimeError, match="a"):
        _each(["a", "b", "c"], op)
    assert seen == ["a", "b", "c"]
    _each([], op)
