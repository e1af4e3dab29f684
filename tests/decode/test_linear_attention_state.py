"""The gated-DeltaNet layers' state in ktinject's KVCache (Qwen3-Next, Qwen3.5-MoE): the state's row operations as
free functions, the hybrid cache layout, and decode through ktinject's path equal to the unmodified HF model's
generate with the same weights (float32): one row, two rows of different prompt lengths, one-token prompts, chunked
prefill, rows at different positions in one forward, and a moved row."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import ktinject
from ktinject.decode import kv_cache
from ktinject.decode import linear_attention_state as linear_state
from ktinject.decode.generate import disable, get_runner
from ktinject.tiny_models import build_tiny_model, missing_reason, tiny_config, tiny_prompts

from tests.references import greedy_margins

HYBRID = ("qwen3_5_moe", "qwen3_next")
#: float32 logits against those of HF's generate and cache on the same model: the plain model (HF's modules) differs in
#: summation order only; the injected one's native experts round their activations to bf16, so a difference of that
#: order in a layer's input can move one activation by a bf16 step (seen: 3e-3 in the logits), never more
SCORE_TOL = {"plain": 1e-4, "injected": 2e-2}
#: logits against the unmodified float32 model's own forward: the injected model's bf16 activations in the experts
#: against float32 ones (seen: 3e-2, logits of std ~2); a row's state mixed up with another's moves them by ~1
REF_TOL = {"plain": 1e-4, "injected": 0.1}
MARGIN = 0.15  # logits: how far below HF's argmax an injected model's greedy token may be (a near-tie)


def _tiny(family: str, **kw):
    why = missing_reason(family)
    if why:
        pytest.skip(why)
    return build_tiny_model(family, **kw)


def _bf16_experts(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return model


@pytest.fixture(scope="module", params=[(f, kind) for f in HYBRID for kind in SCORE_TOL],
                ids=lambda p: f"{p[0]}-{p[1]}")
def models(request):
    """(HF model, a model with the same float32 weights run by ktinject: "plain" (HF's modules, ktinject's decode
    path and cache) or "injected" (routed experts native, gpu="cpu"; the reference's experts rounded to bf16 as
    native stores them), the logit tolerance against HF's generate of that model)."""
    family, kind = request.param
    ref = _bf16_experts(_tiny(family))
    m = _bf16_experts(_tiny(family))
    if kind == "injected":
        ktinject.inject(m, gpu="cpu")
    yield ref, m, kind
    disable(m)


def _hf(m, ids, **kw):
    return type(m).generate(m, ids, **kw)


def _greedy(models, ids, mask=None, n=12):
    """ktinject's greedy tokens and scores are those of HF's generate and cache on the same model; the plain model's
    tokens are the unmodified HF model's, the injected one's each HF's argmax given the tokens before it up to
    MARGIN (its bf16 activations may turn a near-tie)."""
    ref, m, kind = models
    kw = dict(attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
              output_scores=True, return_dict_in_generate=True)
    same = _hf(m, ids, **kw)
    got = ktinject.generate(m, ids, **kw)
    assert torch.equal(got.sequences, same.sequences)
    for a, b in zip(got.scores, same.scores):
        torch.testing.assert_close(a, b, atol=SCORE_TOL[kind], rtol=0)
    if kind == "plain":
        assert torch.equal(got.sequences, _hf(ref, ids, **kw).sequences)
    else:
        full = torch.ones_like(ids) if mask is None else mask
        assert float(greedy_margins(ref, got.sequences, full, ids.shape[1]).max()) <= MARGIN
    return got.sequences


# ---- the state's row operations ----------------------------------------------------------------------------
def _filled_state(slots=4):
    layout = linear_state.LinearLayout(layers=(0, 2), kernel=4, conv_dim=6, v_heads=2, k_dim=3, v_dim=5)
    state = linear_state.LinearAttentionState(layout, slots)
    gen = torch.Generator().manual_seed(0)
    for layer in layout.layers:
        state.write_conv(layer, 0, torch.randn(slots, 6, 7, generator=gen))
        state.write_recurrent(layer, 0, torch.randn(slots, 2, 3, 5, generator=gen))
    return state


def test_row_operations_touch_only_their_rows():
    state = _filled_state()
    before = {k: t.clone() for k, t in linear_state._buffers(state).items()}
    linear_state.reset_rows(state, 1)
    linear_state.reset_rows(state, [3])
    for key, t in linear_state._buffers(state).items():
        assert t[[1, 3]].eq(0).all() and torch.equal(t[[0, 2]], before[key][[0, 2]]), key
    linear_state.copy_rows(state, 2, 1)  # compaction: row 1 takes row 2
    linear_state.copy_rows(state, slice(0, 2), slice(1, 3))  # overlapping ranges read the old values
    for key, t in linear_state._buffers(state).items():
        assert torch.equal(t[1], before[key][0]) and torch.equal(t[2], before[key][2]), key
        assert torch.equal(t[0], before[key][0]) and t[3].eq(0).all(), key
    saved = linear_state.save_rows(state, 0, 2)
    linear_state.reset_rows(state, slice(0, 4))
    linear_state.restore_rows(state, 0, 2, saved)
    for key, t in linear_state._buffers(state).items():
        assert torch.equal(t[0], before[key][0]) and torch.equal(t[1], before[key][0]), key
        assert t[2:].eq(0).all(), key


def test_conv_window_and_recurrent_writes_keep_their_addresses():
    state = _filled_state(slots=2)
    conv, rec = state.conv[0], state.recurrent[0]
    old = conv[1].clone()
    x = torch.randn(1, 6, 2)
    full = state.write_conv(0, 1, x)  # row 1: [its window, 2 new inputs]
    assert torch.equal(full[0, :, :4], old) and torch.equal(full[0, :, 4:], x[0])
    assert torch.equal(conv[1], torch.cat([old[:, 2:], x[0]], dim=-1))  # the last K inputs
    s = torch.randn(1, 2, 3, 5)
    assert state.write_recurrent(0, 1, s).data_ptr() == rec[1].data_ptr() and torch.equal(rec[1], s[0])
    assert state.conv[0] is conv and state.recurrent[0] is rec
    with pytest.raises(ValueError, match="config says"):
        state.write_recurrent(2, 0, torch.randn(1, 2, 3, 4))
    with pytest.raises(ValueError, match="not a linear-attention layer"):
        state.write_conv(1, 0, x)


@pytest.mark.parametrize("family", HYBRID)
def test_layout_from_the_config(family):
    if missing_reason(family):
        pytest.skip(missing_reason(family))
    cfg = tiny_config(family)
    layout = linear_state.layout_of(cfg)
    assert layout.layers == tuple(i for i, t in enumerate(cfg.layer_types) if t == "linear_attention")
    assert layout.conv_dim == 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
        cfg.linear_num_value_heads * cfg.linear_value_head_dim
    assert linear_state.layout_of(tiny_config("qwen3_moe")) is None
    partial = SimpleNamespace(**{k: getattr(cfg, k) for k in ("layer_types", "linear_conv_kernel_dim",
                                                                "linear_num_key_heads", "linear_num_value_heads")})
    with pytest.raises(ValueError, match="linear_key_head_dim, linear_value_head_dim"):
        linear_state.layout_of(partial)


# ---- the hybrid cache ----------------------------------------------------------------------------------------
def test_hybrid_cache_layout_and_state_after_a_prefill(models):
    ref, inj, _ = models
    cfg = inj.config
    cache = kv_cache.new(cfg, 3, 32, "cpu")
    linear = [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"]
    assert cache.lengths.shape == (cfg.num_hidden_layers - len(linear), 3)
    assert [linear_state.is_linear_layer(layer) for layer in cache.layers] == \
        [t == "linear_attention" for t in cfg.layer_types]
    kv_cache.forward(inj, cache.rows(1, 2), tiny_prompts(1, 6, seed=1))
    assert cache.row_lengths.tolist() == [0, 6, 0]
    for i in linear:
        layer = cache.layers[i]
        assert not hasattr(layer, "keys")  # no K/V memory
        conv, rec = cache.linear.conv[i], cache.linear.recurrent[i]
        assert conv.shape == cache.linear.layout.conv_shape(3) and conv.dtype == torch.float32
        assert rec.shape == cache.linear.layout.recurrent_shape(3) and rec.dtype == torch.float32
        assert conv[[0, 2]].eq(0).all() and rec[[0, 2]].eq(0).all() and rec[1].abs().sum() > 0
    kv_cache.forward(inj, cache.rows(2, 3), tiny_prompts(1, 3, seed=2))
    view = cache.rows(1, 3)
    view.reset_rows(slice(0, 1))  # a view's rows: row 1 of the cache
    assert cache.row_lengths.tolist() == [0, 0, 3]
    assert all(t[:2].eq(0).all() and t[2].abs().sum() > 0 for t in cache.linear.tensors())
    cache.reset_rows([2])
    assert cache.row_lengths.tolist() == [0, 0, 0] and all(t.eq(0).all() for t in cache.linear.tensors())
    kv = cache.export_row(2, 0, 0)  # K/V of the full-attention layers only; the state comes apart
    assert len(kv) == len(cache.kv_layers()) < len(cache.layers)
    kv_cache.forward(inj, cache.rows(2, 3), tiny_prompts(1, 3, seed=2))
    state = cache.export_state(2)
    assert set(state) == {f"{kind}.{i}" for kind in ("conv", "recurrent") for i in linear}
    cache.import_state(0, state)
    assert all(t[0].equal(t[2]) for t in cache.linear.tensors())


def test_greedy_one_row_equals_hf(models):
    _greedy(models, tiny_prompts(1, 7, seed=1), n=16)
    inj = models[1]
    runner = get_runner(inj)
    assert runner.stats.eager_decode == 15 and runner.kv.linear is not None  # every decode step through the runner


def test_two_rows_of_different_prompt_lengths(models):
    """Left padding: the linear layers take the prompt's 2D mask (a padded row's state stays zero until its first
    token), so each row decodes as it would alone."""
    inj = models[1]
    ids = tiny_prompts(2, 9, seed=2)
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    both = _greedy(models, ids, mask)
    alone = ktinject.generate(inj, ids[1:, 4:], max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(both[1, 9:], alone[0, 5:])


def test_one_token_prompts(models):
    _greedy(models, tiny_prompts(1, 1, seed=3))
    _greedy(models, tiny_prompts(2, 1, seed=4))


def test_chunked_prefill(models):
    runner = get_runner(models[1], prefill_chunk=4)
    try:
        _greedy(models, tiny_prompts(1, 11, seed=5), n=8)
        assert runner.stats.eager_other >= 3  # the prompt went through in chunks, carrying the states
    finally:
        get_runner(models[1], prefill_chunk=2048)


def test_rows_at_different_positions_in_one_forward(models):
    """A row at position 0 beside one at position 7 in one forward (as a server's rows): each row's logits are
    HF's for that row alone; then a row moved by copy_row decodes as the original."""
    ref, inj, kind = models
    tol = REF_TOL[kind]
    a, b = tiny_prompts(1, 7, seed=6), tiny_prompts(1, 1, seed=7)
    nxt = tiny_prompts(1, 1, seed=8)
    cache = kv_cache.new(inj.config, 3, 32, "cpu")
    with torch.no_grad():
        kv_cache.forward(inj, cache.rows(0, 1), a)
        out = kv_cache.forward(inj, cache.rows(0, 2), torch.cat([nxt, b]))  # row 0 at 7, row 1 at 0
        want_a = ref(torch.cat([a, nxt], dim=1)).logits[:, -1]
        want_b = ref(b).logits[:, -1]
        torch.testing.assert_close(out.logits[0, -1], want_a[0], atol=tol, rtol=0)
        torch.testing.assert_close(out.logits[1, -1], want_b[0], atol=tol, rtol=0)
        cache.copy_row(0, 2)
        step = tiny_prompts(1, 1, seed=9)
        moved = kv_cache.forward(inj, cache.rows(2, 3), step).logits[0, -1]
        kept = kv_cache.forward(inj, cache.rows(0, 1), step).logits[0, -1]
        want = ref(torch.cat([a, nxt, step], dim=1)).logits[0, -1]
    assert torch.equal(moved, kept)
    torch.testing.assert_close(kept, want, atol=tol, rtol=0)
    assert cache.row_lengths.tolist() == [9, 1, 9]


def test_linear_layers_mask_of_a_forward():
    """The linear layers' [B, S] mask is the 2D padding mask at each row's own positions (past its end: real)."""
    pad2d = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    m = kv_cache.linear_attention_mask(torch.tensor([0, 3]), 3, pad2d)
    assert m.tolist() == [[False, False, True], [True, True, True]]
    assert kv_cache.linear_attention_mask(torch.tensor([1, 4]), 3, pad2d).tolist() == [[False, True, True], [True] * 3]
    assert kv_cache.linear_attention_mask(torch.tensor([0, 3]), 1, pad2d) is None
    masks = kv_cache.attention_masks(tiny_config("qwen3_next"), torch.tensor([0, 3]), 3, 8, pad2d)
    assert set(masks) == {"full_attention", "linear_attention"} and masks["full_attention"].shape == (2, 1, 3, 8)


def test_left_padded_forward_on_the_cache(models):
    """kv_cache.forward with a 2D padding mask (as a server's): the padded row's linear states ignore its padding,
    so its logits are those of its tokens alone."""
    ref, m, kind = models
    ids = tiny_prompts(2, 8, seed=12)
    pad2d = torch.ones_like(ids)
    ids[1, :3], pad2d[1, :3] = 0, 0
    pos = (pad2d.cumsum(1) - 1).clamp(min=0)
    cache = kv_cache.new(m.config, 2, 32, "cpu")
    with torch.no_grad():
        out = kv_cache.forward(m, cache, ids, position_ids=pos, pad2d=pad2d).logits[:, -1]
        alone = ref(ids[1:, 3:]).logits[0, -1]
        first = ref(ids[:1]).logits[0, -1]
    torch.testing.assert_close(out[1], alone, atol=REF_TOL[kind], rtol=0)
    torch.testing.assert_close(out[0], first, atol=REF_TOL[kind], rtol=0)


def test_returned_cache_continues_like_hf(models):
    """return_dict_in_generate hands back a DynamicCache holding the rows' K/V and linear states: HF continues from
    it as from its own."""
    import copy

    from ktinject import compat

    ref, inj, _ = models
    field = compat.cache_kwarg()
    ids = tiny_prompts(1, 6, seed=10)
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    ours = ktinject.generate(inj, ids, **kw)
    theirs = _hf(ref, ids, **kw)
    more = torch.cat([ours.sequences, tiny_prompts(1, 3, seed=11)], dim=1)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    a = _hf(ref, more, **{field: copy.deepcopy(getattr(ours, field))}, **kw)
    b = _hf(ref, more, **{field: copy.deepcopy(getattr(theirs, field))}, **kw)
    assert torch.equal(a, b)


@pytest.mark.parametrize("family", HYBRID)
def test_plan_says_graph_decode_and_the_prefix_cache_checkpoints_state(family):
    from ktinject.decode import stateful_layers
    from ktinject.decode.prefix_cache import uncacheable_reason

    model = _tiny(family)
    assert ktinject.plan(model, gpu="cpu").eager_decode is None
    assert uncacheable_reason(model) is None and stateful_layers.needs_state_checkpoints(model)
