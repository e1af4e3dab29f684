"""GraphRunner bookkeeping, stream-experts switches and the CUDA driver shim, on the CPU (CUDA parts skipped)."""
from __future__ import annotations

import pytest
import torch

from ktinject import compat
from ktinject.native import cuda_driver
from ktinject.operators import handshake as stream_experts
from ktinject.decode.graph_runner import GraphRunner, choose_bucket, round_cache_len
from ktinject.tiny_models import build_tiny_model


@pytest.mark.parametrize("batch, buckets, expected", [
    (1, (1, 2, 4, 8), 1),
    (2, (1, 2, 4, 8), 2),
    (3, (1, 2, 4, 8), 4),
    (5, (1, 2, 4, 8), 8),
    (8, (1, 2, 4, 8), 8),
    (9, (1, 2, 4, 8), None),
    (3, (8, 4), 4),
    (1, (4,), 4),
])
def test_choose_bucket(batch, buckets, expected):
    assert choose_bucket(batch, buckets) == expected


@pytest.mark.parametrize("needed, minimum, limit, expected", [
    (10, 256, None, 256),
    (256, 256, None, 256),
    (257, 256, None, 512),
    (3000, 1024, None, 4096),
    (3000, 1024, 3500, 3500),  # capped at the model's maximum when that still fits
    (5000, 1024, 3500, 8192),  # does not fit the maximum anyway: no cap
])
def test_round_cache_len(needed, minimum, limit, expected):
    assert round_cache_len(needed, minimum, limit) == expected


def test_runner_rejects_bad_buckets():
    with pytest.raises(ValueError):
        GraphRunner(torch.nn.Linear(2, 2), buckets=())
    with pytest.raises(ValueError):
        GraphRunner(torch.nn.Linear(2, 2), buckets=(0, 2))


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model("qwen3_moe")


def test_runner_on_cpu_is_eager(tiny):
    r = GraphRunner(tiny)
    assert not r.graphs_enabled()
    assert r.buckets == (1, 2, 4, 8)
    ids = torch.tensor([[5]])
    assert r._key({"input_ids": ids, compat.cache_kwarg(): None}) is None
    assert r.padded_batch(3) == 3  # padding follows graphs by default
    r.pad_batches = True
    assert [r.padded_batch(b) for b in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, 9]


def test_cache_for_reuses_and_grows(tiny):
    r = GraphRunner(tiny, max_cache_len=None)
    c1 = r.cache_for(2, 40)
    assert r.max_cache_len == 256  # CPU floor
    assert all(layer.max_cache_len == 256 for layer in c1.layers)
    assert r.graphable_cache(c1)
    tiny(torch.tensor([[4, 5, 6], [7, 8, 9]]), **compat.cache_arg(c1), use_cache=True)  # fills 3 positions
    assert int(c1.get_seq_length()) == 3
    keys = c1.layers[0].keys
    c2 = r.cache_for(2, 100)  # fits: same object, reset in place (graph addresses unchanged)
    assert c2 is c1 and c2.layers[0].keys is keys
    assert int(c2.get_seq_length()) == 0
    assert r.cache_for(1, 10) is not c1  # one cache per batch size
    c3 = r.cache_for(2, 300)  # does not fit: everything dropped, length doubled
    assert c3 is not c1 and r.max_cache_len == 512 and 1 not in r.caches


def test_runner_key_logic_without_cuda(tiny, monkeypatch):
    """The decode-step key (which step gets a graph), with graphs forced on but nothing captured."""
    r = GraphRunner(tiny, buckets=(1, 2))
    monkeypatch.setattr(r, "graphs_enabled", lambda: True)
    cache = r.cache_for(2, 16)

    class FakeCuda(torch.Tensor):  # a tensor that claims to be on CUDA, for the key logic only
        @property
        def is_cuda(self):
            return True

    ids = torch.tensor([[3], [4]]).as_subclass(FakeCuda)
    mask = torch.ones(2, 1, 1, r.max_cache_len, dtype=torch.bool)
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=torch.tensor([[5], [5]]), **compat.cache_arg(cache),
              use_cache=True, logits_to_keep=1, return_dict=True)
    key = r._key(kw)
    assert key is not None and key[0] == 2
    assert r._key({**kw, "output_attentions": True}) is None
    assert r._key({**kw, "input_ids": torch.tensor([[3, 4], [4, 5]]).as_subclass(FakeCuda)}) is None  # prefill
    assert r._key({**kw, compat.cache_kwarg(): r.cache_for(1, 16)}) is None  # a cache that is not this batch's
    assert r._key({**kw, "token_type_ids": torch.zeros(2, 1)}) is None  # an unknown tensor argument
    assert r._key({**kw, "logits_to_keep": 2}) != key  # other static arguments: another graph
    # a 2D padding mask (ktinject.generate's decode steps): one graph whatever its length, up to the cache length
    k5 = r._key({**kw, "attention_mask": torch.ones(2, 5, dtype=torch.long)})
    assert k5 is not None and k5 != key
    assert r._key({**kw, "attention_mask": torch.ones(2, 9, dtype=torch.long)}) == k5
    assert r._key({**kw, "attention_mask": torch.ones(2, r.max_cache_len + 1, dtype=torch.long)}) is None
    assert r._key({**kw, "attention_mask": torch.ones(1, 5, dtype=torch.long)}) is None


def test_static_mask_buffer():
    from ktinject.decode.graph_capture import fill_static, static_input

    m = torch.tensor([[0, 1, 1], [1, 1, 1]])
    buf = static_input("attention_mask", m, 8)
    assert buf.shape == (2, 8) and torch.equal(buf[:, :3], m) and bool((buf[:, 3:] == 1).all())
    fill_static(buf, torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]))
    assert buf[0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    ids = torch.tensor([[3], [4]])
    assert torch.equal(static_input("input_ids", ids, 8), ids)


def test_stream_mode_switch():
    assert not stream_experts.active()
    with stream_experts.stream_mode():
        assert stream_experts.active()
        with stream_experts.stream_mode(False):
            assert not stream_experts.active()
        assert stream_experts.active()
    assert not stream_experts.active()


def test_cuda_driver_imports_without_gpu(monkeypatch):
    assert isinstance(cuda_driver.available(), bool)
    monkeypatch.setenv(cuda_driver.SYNC_ENV, "carrier-pigeon")
    with pytest.raises(ValueError, match="memops"):
        cuda_driver.default_sync_mode()
    monkeypatch.setenv(cuda_driver.SYNC_ENV, "hostfn")
    assert cuda_driver.default_sync_mode() == "hostfn"
    if not cuda_driver.stream_memops_supported():
        monkeypatch.setenv(cuda_driver.SYNC_ENV, "memops")
        with pytest.raises(RuntimeError):
            cuda_driver.default_sync_mode()


def test_cuda_driver_error_message():
    e = cuda_driver.CudaDriverError("cuStreamWaitValue32", 801, "CUDA_ERROR_NOT_SUPPORTED")
    assert "cuStreamWaitValue32" in str(e) and "CUDA_ERROR_NOT_SUPPORTED" in str(e) and e.code == 801


@torch.no_grad()
def test_static_mask_buffer_gives_the_same_logits(tiny):
    """What a replay computes: decode steps with the 2D mask in the static [B, L] buffer (ones past the tokens so
    far) give the logits of the [B, n] mask itself (and of HF's 4D mask), left padding included."""
    from transformers.masking_utils import create_masks_for_generate

    from ktinject.decode.graph_capture import static_input

    r = GraphRunner(tiny)
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    caches = [r.cache_for(2, 16)] + [GraphRunner(tiny).cache_for(2, 16) for _ in range(2)]
    L = r.max_cache_len
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    for c in caches:
        out = tiny(ids, attention_mask=mask, position_ids=pos, **compat.cache_arg(c))
    tok = out.logits[:, -1:].argmax(-1)
    for _ in range(4):
        mask = torch.cat([mask, torch.ones_like(tok)], 1)
        step = dict(input_ids=tok, position_ids=(mask.cumsum(-1) - 1)[:, -1:])
        four_d = create_masks_for_generate(config=tiny.config, inputs_embeds=torch.empty(2, 1, 0),
                                           attention_mask=mask, **compat.cache_arg(caches[2]),
                                           position_ids=step["position_ids"])
        a = tiny(**step, attention_mask=static_input("attention_mask", mask, L), **compat.cache_arg(caches[0])).logits
        b = tiny(**step, attention_mask=mask, **compat.cache_arg(caches[1])).logits
        c = tiny(**step, attention_mask=four_d, **compat.cache_arg(caches[2])).logits
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-6)
        tok = a[:, -1:].argmax(-1)


def test_in_graph_mask_building_needs_no_host_sync(tiny):
    """The 4D mask a replay builds from the static 2D buffer and the cache's device counter is data-independent
    (no .item(), no data-dependent shapes): it runs under FakeTensorMode, which raises on any of those."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.masking_utils import create_causal_mask

    from ktinject.decode.graph_capture import static_input

    r = GraphRunner(tiny)
    cache = r.cache_for(2, 16)
    tiny(torch.tensor([[1, 2, 3], [4, 5, 6]]), **compat.cache_arg(cache))  # initialized, counter on the device
    mask = static_input("attention_mask", torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), r.max_cache_len)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = create_causal_mask(config=tiny.config, inputs_embeds=torch.zeros(2, 1, 64), attention_mask=mask,
                                 **compat.cache_arg(cache), position_ids=torch.tensor([[2], [3]]))
    assert tuple(out.shape) == (2, 1, 1, r.max_cache_len)


def test_piece_starts_cut_layers_evenly():
    from ktinject.decode.graph_capture import piece_starts

    assert piece_starts(48, 4) == [12, 24, 36]
    assert piece_starts(48, 1) == []
    assert piece_starts(3, 4) == [1, 2]  # no more pieces than layers
    assert piece_starts(5, 2) == [2] or piece_starts(5, 2) == [3]
    assert piece_starts(1, 4) == []


def test_decoder_layers_found_in_hf_models():
    from ktinject.decode.graph_runner import GraphRunner, decoder_layers
    from ktinject.tiny_models import build_tiny_model

    model = build_tiny_model("qwen3_moe")
    assert decoder_layers(model) == list(model.model.layers)
    assert decoder_layers(torch.nn.Linear(2, 2)) == []
    with pytest.raises(ValueError, match="graph_pieces"):
        GraphRunner(model, graph_pieces=0)
