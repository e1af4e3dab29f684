"""Routing and staging for the "moe" operator: the router's fast path and the host buffers that native experts read.

Kept apart from ``moe.py`` (the ``HybridMoE`` block and its experts' paths) because other modules use them without
the operator: the decode layer asks ``hooked``, streamed prefill (``ktinject.gpu_experts.prefill.streamer``) and expert
deferral share the thread's ``staging`` buffers.

- ``staging``: this thread's grow-only host buffers (pinned on CUDA): a forward's x, ids and weights go in, the
  native experts' output comes out; shared by all hybrid blocks of one thread.
- ``softmax_topk_router`` / ``fast_routing``: softmax -> top-k -> renormalize routers computed as the softmax over
  the k largest logits, the same weights in fewer kernels (``fused.router_topk`` for decode-sized T on CUDA;
  ``row_logits``: on the CPU row by row, so a token's logits do not depend on the rows beside it).
- ``token_ids``: the token ids a router that chooses by token reads (DeepSeek-V4's hash layers: a frozen
  ``tid2eid[input_ids]`` table picks the experts, the router's scores weight them), checked.
- ``hooked``: anything that would see or change a module's forward (then HF's own forward runs).
- ``router_f32_extra``: the bytes a router gains when HybridMoE makes it float32 (placement).

Legend: T tokens, E experts, H hidden, k experts per token.
"""
from __future__ import annotations

import threading

import torch
from torch import nn

from ktinject.operators import handshake as stream_experts
from ktinject.operators.base import OperatorError
from ktinject.operators.kernels import common as fused


class Staging:
    """Grow-only host buffers shared by all hybrid blocks of one thread (layers run one after another).

    Pinned when the device is CUDA so copies can be asynchronous. A buffer is reallocated only when a call needs
    more elements than it has; views of the leading rows are handed out."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, cols] contiguous view of the buffer ``name`` of ``dtype``."""
        key, need = (name, dtype), rows * cols
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < need:
            buf = torch.empty(max(need, 1), dtype=dtype, pin_memory=self.pin)
            self._bufs[key] = buf
        return buf[:need].view(rows, cols)

    def inputs(self, prefix: str, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               non_blocking: bool, to_host=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A native forward's inputs: x [T, H], ids [T, k] and weights [T, k] copied into the buffers ``prefix`` +
        hidden / ids / weights, in the dtypes native reads (``stream_experts.host_dtype``); asynchronous (device ->
        pinned host) when ``non_blocking``; ``to_host(src, dst)`` (contiguous src) moves each instead of a copy
        (streamed prefill's kernel: gpu_experts.prefill.host_io). Returns the three host views."""
        (T, H), k = x.shape, ids.shape[1]
        h = self.get(prefix + "hidden", T, H, stream_experts.host_dtype(x.dtype))
        i = self.get(prefix + "ids", T, k, torch.int64)
        w = self.get(prefix + "weights", T, k, stream_experts.host_dtype(weights.dtype))
        for dst, src in ((h, x), (i, ids), (w, weights)):
            if to_host is None:
                dst.copy_(src.detach(), non_blocking=non_blocking)
            else:
                to_host(src.detach().contiguous(), dst)
        return h, i, w

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


_local = threading.local()


def staging(pin: bool) -> Staging:
    """This thread's staging buffers (pinned or not)."""
    key = "pinned" if pin else "pageable"
    st = getattr(_local, key, None)
    if st is None:
        st = Staging(pin)
        setattr(_local, key, st)
    return st


def router_f32_extra(router: nn.Module) -> int:
    """Bytes the router gains when HybridMoE makes it float32 (its floating tensors narrower than 4 bytes)."""
    tensors = [*router.parameters(), *router.buffers()]
    return sum(t.numel() * (4 - t.element_size()) for t in tensors if t.is_floating_point() and t.element_size() < 4)


# Routers that take the softmax over all experts, its top k and renormalize those (class name -> the attribute that must
# be True for the renormalization, None: always). Their weights equal the softmax over the k largest logits
# (softmax(l)_i / sum_top softmax(l)_j = exp(l_i) / sum_top exp(l_j)): linear, top-k, softmax of k instead of HF's
# linear, softmax of E, sorted top-k (a selection and a sort), sum and division. A decode step on the GPU is a chain of
# small dependent kernels, so every kernel fewer shortens it (docs/history/readme-performance.md, the router's row).
# The k ids come unsorted or in descending order (the native experts sum in expert order whatever the slots; the hot
# experts' sum is order-free up to rounding). The experts are HF's except at near-ties: logits an ulp or so apart,
# which HF's float32 probabilities may round equal and then rank by index, and which the Triton logits kernel (another
# summation order than cuBLAS) may round the other way. Eligibility is by class (and flag):
# tests/operators/test_router.py checks each class against the installed transformers.
_SOFTMAX_TOPK_ROUTERS = {"Qwen3MoeTopKRouter": "norm_topk_prob", "Qwen2MoeTopKRouter": "norm_topk_prob",
                         "OlmoeTopKRouter": "norm_topk_prob", "MixtralTopKRouter": None,
                         "Qwen3NextTopKRouter": "norm_topk_prob", "Qwen3_5MoeTopKRouter": None}


def softmax_topk_router(router: nn.Module) -> bool:
    """Whether ``router`` (an HF router module) is one of the softmax -> top-k -> renormalize routers above."""
    cls = type(router)
    if not cls.__module__.startswith("transformers.models.") or cls.__name__ not in _SOFTMAX_TOPK_ROUTERS:
        return False
    flag = _SOFTMAX_TOPK_ROUTERS[cls.__name__]
    return ((flag is None or getattr(router, flag, None) is True) and getattr(router, "bias", None) is None
            and isinstance(getattr(router, "weight", None), torch.Tensor) and isinstance(router.top_k, int))


def fast_routing(router: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k] int64) of a softmax_topk_router for x [T, H], in float32: on CUDA with
    Triton, for decode-sized T, ``fused.router_topk`` (two kernels; ids in descending logit order), else torch ops
    (ids unsorted). (router_topk's logits kernel is a GEMV: for many tokens cuBLAS is the better choice.)"""
    if fused_router_fits(router, x):
        return fused.router_topk(x, router.weight, router.top_k)
    logits = row_logits(x, router.weight)  # [T, E]
    top, ids = torch.topk(logits, router.top_k, dim=-1, sorted=False)
    return torch.softmax(top, dim=-1), ids


def fused_router_fits(router: nn.Module, x: torch.Tensor) -> bool:
    """fused.router_topk takes this router and x [T, H]: CUDA with Triton, decode-sized T, float32 weights."""
    W = router.weight
    return (x.dim() == 2 and x.shape[0] <= 64 and x.stride(-1) == 1 and W.dtype == torch.float32 and W.is_contiguous()
            and W.shape[0] <= 1024 and router.top_k <= 16 and fused.available(x))


def row_logits(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """float32 x [T, H] @ W [E, H]^T -> [T, E], on the CPU each row as a product of its own (a batch of T one-row
    products): torch's float32 GEMM there (MKL) rounds 1-3 rows otherwise than 4 or more, so with one linear a token's
    logits, and at a near-tie its experts, would depend on how many tokens share its forward (the batch of a serving
    step, the size of a prefill chunk). Every row here takes the one-row path, alone or among others. On CUDA: one
    linear (cuBLAS picks kernels by size anyway)."""
    xf = x.float()
    if xf.device.type != "cpu":
        return torch.nn.functional.linear(xf, W)
    return torch.bmm(xf.unsqueeze(1), W.t().unsqueeze(0).expand(xf.shape[0], -1, -1)).squeeze(1)


def token_ids(input_ids: torch.Tensor | None, T: int, device: torch.device, block: str) -> torch.Tensor:
    """The ids [T] of the T tokens a token-routed router reads (``input_ids`` of any shape holding T integers), on
    ``device``; an OperatorError saying what to pass otherwise (``block``: the block's class, for the message)."""
    if input_ids is None:
        raise OperatorError(f"moe: {block} routes this layer by token id (a hash_moe layer of mlp_layer_types): "
                            f"call the model with input_ids (inputs_embeds alone do not say which tokens they are)")
    if input_ids.numel() != T or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise OperatorError(f"moe: {block} got input_ids {tuple(input_ids.shape)} ({input_ids.dtype}) for {T} "
                            f"tokens: expected one integer token id per token")
    return input_ids.reshape(-1).to(device)


def _idle_capture_hook(fn) -> bool:
    """Whether ``fn`` is transformers' output-capturing hook (installed on every recordable module the first time an
    ``output_*`` flag is used, and never removed) with nothing to collect now. Anything unexpected: False."""
    if getattr(fn, "__name__", "") != "output_capturing_hook" or not str(getattr(fn, "__module__", "")).startswith(
            "transformers."):
        return False
    try:
        from transformers.utils import output_capturing

        collected = output_capturing._active_collector.get()
        key = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))["key"]
    except (ImportError, AttributeError, KeyError, TypeError, ValueError):
        return False
    return collected is None or key not in collected


def hooked(module: nn.Module) -> bool:
    """Anything that would see or change the module's forward: hooks (forward, backward, global; transformers' idle
    output-capturing hooks aside) or an instance-level forward (e.g. accelerate's hooks)."""
    glob = torch.nn.modules.module
    if "forward" in module.__dict__ or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks:
        return True
    if any(not _idle_capture_hook(h) for h in module._forward_hooks.values()):
        return True
    return any(getattr(glob, name, None) for name in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                      "_global_backward_hooks", "_global_backward_pre_hooks"))
