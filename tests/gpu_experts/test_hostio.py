"""The kernels that move a split prefill layer's activations between the device and pinned host memory
(ktinject.gpu_experts.prefill.host_io) against the copies and the sum they replace (split.total): bit for bit, odd sizes
(not multiples of the 2048-element block), one element, bf16 / float32 / float16 outputs, with either or both device
parts; and fused.copy with the decode step's done word. On CUDA (pinned buffers) or with TRITON_INTERPRET=1 on
CPU tensors (tests/operators/test_fused_kernels.py's fixture).
Legend: T tokens, H hidden."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from ktinject.gpu_experts.prefill import host_io as hostio
from ktinject.operators.kernels import common as fused
from ktinject.gpu_experts.prefill.split import total
from tests.operators.test_fused_kernels import dev  # noqa: F401

pytestmark = pytest.mark.gpu  # selected by the GPU machine's `-m "gpu or amx"` runs (the CPU's run them too)

SHAPES = [(3, 700), (1, 1), (5, 2048), (2, 4099)]  # (T, H)


def _host(t: torch.Tensor, dev: str) -> torch.Tensor:
    return t.pin_memory() if dev == "cuda" else t.clone()


@pytest.mark.parametrize("T, H", SHAPES)
@pytest.mark.parametrize("src_dtype, dst_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                  (torch.float32, torch.float32), (torch.int64, torch.int64)])
def test_to_host_equals_copy(dev, T, H, src_dtype, dst_dtype):
    g = torch.Generator().manual_seed(T * H)
    src = (torch.randint(-9, 2**40, (T, H), generator=g) if src_dtype == torch.int64
           else torch.randn(T, H, generator=g)).to(src_dtype).to(dev)
    dst = _host(torch.full((T, H), 7, dtype=dst_dtype), dev)
    hostio.to_host(src, dst)
    if dev == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dst, src.cpu().to(dst_dtype))


@pytest.mark.parametrize("T, H", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("parts", ["streamed", "extra", "both", "none"])
def test_combine_equals_copy_then_total(dev, T, H, dtype, parts):
    """o (the host dtype of x: bf16 for bf16, else float32) read in place plus the float32 parts: the bits of
    routed = o copied into x's dtype on the device, then split.total."""
    g = torch.Generator().manual_seed(T + H)
    host_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    o = _host((torch.randn(T, H, generator=g) * 3).to(host_dtype), dev)
    streamed = torch.randn(T, H, generator=g).to(dev) if parts in ("streamed", "both") else None
    extra = torch.randn(T, H, generator=g).to(dev) if parts in ("extra", "both") else None
    x = torch.empty(T, H, dtype=dtype, device=dev)
    routed = torch.empty(T, H, dtype=dtype, device=dev)
    routed.copy_(o)
    want = total(x, routed, extra, streamed)
    got = hostio.combine(o, streamed, extra, dtype, torch.device(dev))
    assert got.dtype == dtype and got.device.type == want.device.type and torch.equal(got, want)


@pytest.mark.parametrize("T, H", [(3, 700), (2, 4099)])
@pytest.mark.parametrize("parts", ["streamed", "both", "none"])
def test_combine_waits_for_the_done_word(dev, T, H, parts):
    """With ``done`` the kernel reads o only once the word is 1: a thread (the CPU task's stand-in) writes o and then
    raises the word 50 ms after the launch; the result is the final o's sum, never the stale one."""
    g = torch.Generator().manual_seed(T * 3 + H)
    final = (torch.randn(T, H, generator=g) * 3).bfloat16()
    o = _host(torch.full((T, H), float("nan"), dtype=torch.bfloat16), dev)
    done = _host(torch.zeros(1, dtype=torch.int32), dev)
    streamed = torch.randn(T, H, generator=g).to(dev) if parts != "none" else None
    extra = torch.randn(T, H, generator=g).to(dev) if parts == "both" else None
    x = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    routed = final.to(dev)
    want = total(x, routed, extra, streamed)

    def cpu_task():
        time.sleep(0.05)
        o.copy_(final)
        done.fill_(1)

    done.fill_(1)  # compiled first (a first launch may take longer than the worker's sleep)
    hostio.combine(o, streamed, extra, torch.bfloat16, torch.device(dev), done=done)
    if dev == "cuda":
        torch.cuda.synchronize()
    done.fill_(0)
    worker = threading.Thread(target=cpu_task)
    worker.start()
    got = hostio.combine(o, streamed, extra, torch.bfloat16, torch.device(dev), done=done)
    if dev == "cuda":
        torch.cuda.synchronize()
    worker.join()
    assert torch.equal(got, want)
    assert int(done[0]) == 1  # left for its owner to reset
    done.fill_(0)  # with reset: the same sum, and the kernel consumed the word
    worker = threading.Thread(target=cpu_task)
    worker.start()
    got = hostio.combine(o, streamed, extra, torch.bfloat16, torch.device(dev), done=done, reset=True)
    if dev == "cuda":
        torch.cuda.synchronize()
    worker.join()
    assert torch.equal(got, want)
    assert int(done[0]) == 0


def test_raise_word_after_earlier_work_and_wait_word_reset(dev):
    """fused.raise_word stores 1 once the stream reaches it (a watched task's go), its neighbours untouched;
    wait_word with reset stores 0 back once it has seen 1; bad words are refused with what was given."""
    from ktinject.operators.kernels import common as fused

    words = _host(torch.zeros(4, dtype=torch.int32), dev)
    fused.raise_word(words[1:2], torch.device(dev))
    if dev == "cuda":
        torch.cuda.synchronize()
    assert words.tolist() == [0, 1, 0, 0]
    fused.wait_word(words[1:2], torch.device(dev), reset=True)
    if dev == "cuda":
        torch.cuda.synchronize()
    assert words.tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="raise_word.*one pinned int32 word"):
        fused.raise_word(torch.zeros(2, dtype=torch.int32), torch.device(dev))


@pytest.mark.parametrize("T, H", SHAPES)
@pytest.mark.parametrize("src_dtype, dst_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16),
                                                  (torch.float32, torch.float32)])
def test_copy_with_flag_equals_copy_and_resets_the_word(dev, T, H, src_dtype, dst_dtype):
    """fused.copy with a flag (the decode step's collect, stream_experts): the CPU output (pinned host) into the
    device tensor as ``copy_`` would, and the done word back at 0 (its neighbours untouched)."""
    g = torch.Generator().manual_seed(T * 7 + H)
    src = _host((torch.randn(T, H, generator=g) * 5).to(src_dtype), dev)
    dst = torch.full((T, H), 3, dtype=dst_dtype, device=dev)
    flags = _host(torch.ones(64, dtype=torch.int32), dev)
    want = torch.empty(T, H, dtype=dst_dtype, device=dev)
    want.copy_(src)
    for wait in (False, True):  # with wait: the kernel polls the word (already 1) first, every program
        flags.fill_(1)
        dst.fill_(3)
        fused.copy(src, dst, flags[16:17], wait=wait)
        if dev == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(dst, want)
        assert flags[16] == 0 and int(flags.sum()) == 63


@pytest.mark.parametrize("host_dtype, dtype, round2", [(torch.float32, torch.bfloat16, True),
                                                       (torch.bfloat16, torch.bfloat16, False),
                                                       (torch.float32, torch.float32, True),
                                                       (torch.float32, torch.float16, False)])
@pytest.mark.parametrize("H", [2048, 700])
@pytest.mark.parametrize("deferred", [False, True])
def test_collect_add_rms_norm_equals_copy_then_add_rms_norm(dev, host_dtype, dtype, round2, H, deferred):
    """The decode step's collect inside the residual add + next norm (stream_experts' lazy finish): the same x, sum
    and norm as fused.copy then add_rms_norm, bit for bit, and the done word back at 0; deferred: x is the sum of
    two host rows (the previous MoE layer's deferred experts joining, as the block's ``routed + prev``), both
    words back at 0."""
    from ktinject.operators.kernels import dense as fused_dense

    g = torch.Generator().manual_seed(H)
    host = _host((torch.randn(1, H, generator=g) * 4).to(host_dtype), dev)
    host2 = _host((torch.randn(1, H, generator=g) * 2).to(host_dtype), dev)
    res = torch.randn(1, H, generator=g).to(dev, dtype)
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dev, dtype)
    flags = _host(torch.ones(64, dtype=torch.int32), dev)
    want_x = torch.empty(1, H, dtype=dtype, device=dev)
    fused.copy(host, want_x)
    if deferred:
        prev = torch.empty(1, H, dtype=dtype, device=dev)
        fused.copy(host2, prev)
        want_x = want_x + prev
    want_s, want_y = fused_dense.add_rms_norm(want_x, res, w, 1e-6, round2)
    x = torch.full((1, H), 3, dtype=dtype, device=dev)
    s, y = fused_dense.collect_add_rms_norm(host, flags[16:17], x, res, w, 1e-6, round2,
                                            deferred=(host2, flags[48:49]) if deferred else None)
    if dev == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(x, want_x) and torch.equal(s, want_s) and torch.equal(y, want_y)
    assert flags[16] == 0 and (flags[48] == 0) == deferred and int(flags.sum()) == 63 - deferred
    with pytest.raises(ValueError, match="one contiguous row"):
        fused_dense.collect_add_rms_norm(host, flags[16:17], x[:, 1:], res[:, 1:], w, 1e-6)


def test_copy_waits_for_the_word():
    """On CUDA: the collect kernel, launched before the CPU raises done, waits for it (a host thread sets the word
    50 ms later) and then copies what the host wrote before raising it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (the interpreter runs programs one after another on this thread)")
    import threading
    import time

    src = torch.zeros(3, 4099, dtype=torch.float32).pin_memory()
    dst = torch.zeros(3, 4099, dtype=torch.bfloat16, device="cuda")
    flags = torch.zeros(64, dtype=torch.int32).pin_memory()
    fused.copy(src, dst, flags[16:17], wait=True)  # queued; spins

    def cpu():
        time.sleep(0.05)
        src.fill_(2.5)
        flags[16] = 1

    th = threading.Thread(target=cpu)
    th.start()
    torch.cuda.synchronize()
    th.join()
    assert bool((dst == 2.5).all()) and flags[16] == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="wait=True needs"):
        fused.copy(torch.zeros(2), torch.zeros(2), wait=True)
    with pytest.raises(ValueError, match="one shape"):
        hostio.to_host(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="float32"):
        hostio.combine(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bfloat16), None, torch.float32,
                       torch.device("cpu"))
    assert not hostio.usable(torch.device("cpu"), torch.zeros(2))  # not a CUDA device
    with pytest.raises(ValueError, match="one pinned int32 word"):
        hostio.combine(torch.zeros(2, 3), None, None, torch.float32, torch.device("cpu"),
                       done=torch.zeros(2, dtype=torch.int32))
