"""A decode-step forward for the MoE decoder layers: residual adds fused with the norms that follow them.

HF's decoder layer runs input norm, attention, residual add, post-attention norm, MLP, residual add: with the
routed experts on the CPU every GPU kernel of that chain is on the decode step's critical path. For one query
token per row this forward computes the same (same roundings: sums rounded to the model dtype, each norm as its
module) with fewer kernels on CUDA with Triton (``operators.kernels.dense``):

- attention's residual add is o_proj's epilogue (``decode_attention.forward_with_residual``), and so is the
  post-attention norm where o_proj runs as the Triton GEMV (its last program normalizes the rows), else that norm
  is one kernel;
- the closing residual add and the *next* layer's input norm are one kernel (``add_rms_norm``): the sum carries
  the normalized result (``norm.attach_prenormed``), which the next layer, or the model's final FusedRMSNorm,
  takes instead of normalizing again while it is valid (same norm and weight, neither tensor changed since);
  the first layer normalizes its input itself;
- the LM head (the model's output embeddings, an nn.Linear) of a one-row decode step is ``kernels.dense.linear``:
  cuBLAS or the GEMV, whichever its timing picks; the GEMV starts during the last layer's collect (PDL) and loads
  its first weight tiles while that waits for the CPU (``install_head``).

Without CUDA or Triton the same steps run as torch ops and module calls, which is what HF's forward computes.
Each piece keeps HF's behaviour where it cannot be fused: a norm with hooks or of another class is called as a
module, an attention module without the decode forward or with hooks too, and the MLP is always called as a
module (the MoE operator's own decode path). Prefill (more than one token per row), training and positional
arguments beyond hidden_states run HF's forward. Installed for the classes in ``SUPPORTED`` by ``install_all``
(from ``ktinject.injection.apply``, after the operators are built), which links each layer to the norm after it.
Legend: B batch, H hidden.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from ktinject.operators import fast_path_report as fastpaths
from ktinject.decode import attention as decode_attention
from ktinject.operators.kernels import common as fused
from ktinject.operators.routing import hooked as moe_hooked
from ktinject.operators.kernels.dense import add_rms_norm, linear
from ktinject.operators.norm import FusedRMSNorm, attach_prenormed, fuse_problem, rounds_twice, take_prenormed

log = logging.getLogger(__name__)

#: decoder-layer classes whose HF forward is exactly the chain above (checked in tests against the HF classes);
#: the value: their MLP returns (hidden, router scores) rather than hidden
SUPPORTED = {"Qwen3MoeDecoderLayer": False, "Qwen2MoeDecoderLayer": False, "MixtralDecoderLayer": False,
             "OlmoeDecoderLayer": False, "DeepseekV2DecoderLayer": False, "DeepseekV3DecoderLayer": False,
             "Glm4MoeDecoderLayer": False, "GptOssDecoderLayer": True}
_HF_FORWARD = "_ktinject_layer_hf_forward"
_NEXT = "_ktinject_next_norm"  # (module, attribute): where the norm after this layer is found at call time


def problem(layer: nn.Module) -> str | None:
    """Why ``layer`` cannot take the decode forward, or None."""
    parts = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
    return fastpaths.layout_problem(layer, SUPPORTED, dict.fromkeys(parts, nn.Module))


def install(layer: nn.Module, next_norm: tuple[nn.Module, str] | None = None) -> bool:
    """Give ``layer`` the decode forward; ``next_norm``: (module, attribute name) of the norm that follows the
    layer (the next layer's input norm, the model's final norm). False when the class is not supported."""
    why = problem(layer)
    if why is not None:
        log.debug("decode layer: %s keeps its forward: %s", type(layer).__name__, why)
        return False
    fastpaths.swap_forward(layer, decode_forward, _HF_FORWARD)
    layer.__dict__[_NEXT] = next_norm
    return True


def installed(layer: nn.Module) -> bool:
    return _HF_FORWARD in layer.__dict__


def uninstall(layer: nn.Module) -> None:
    fastpaths.restore_forward(layer, _HF_FORWARD, _NEXT)


def install_all(model: nn.Module) -> int:
    """Install the decode forward on every supported decoder layer of ``model``, each linked to the norm after it
    (the next layer's input norm where that layer takes it too; the final norm where it is a FusedRMSNorm, whose
    forward takes it). Returns how many layers took it."""
    from ktinject.decode.graph_capture import decoder_layers

    layers = decoder_layers(model)
    final = None  # the final norm: ``norm`` of the module holding the layers, where it takes a prenormed input
    for m in model.modules():
        held = getattr(m, "layers", None)
        if isinstance(held, nn.ModuleList) and layers and len(held) and held[0] is layers[0]:
            final = (m, "norm") if isinstance(getattr(m, "norm", None), FusedRMSNorm) else None
            break
    n = 0
    for i, layer in enumerate(layers):
        if i + 1 < len(layers):
            takes = problem(layers[i + 1]) is None or isinstance(layers[i + 1].input_layernorm, FusedRMSNorm)
            link = (layers[i + 1], "input_layernorm") if takes else None
        else:
            link = final
        n += install(layer, link)
    if n:
        install_head(model)
    return n


_HEAD_FORWARD = "_ktinject_head_hf_forward"


def _head(model: nn.Module) -> nn.Module | None:
    """The model's output embeddings (HF's ``get_output_embeddings``), or None."""
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def install_head(model: nn.Module) -> bool:
    """Give the model's LM head (``get_output_embeddings()``, a plain nn.Linear with its class's forward) the decode
    forward below; False where there is none such (a subclass may compute otherwise; an instance forward, e.g.
    accelerate's offload hook, moves weights first, and uninstalling would drop it)."""
    head = _head(model)
    if type(head) is not nn.Linear or ("forward" in head.__dict__ and _HEAD_FORWARD not in head.__dict__):
        return False
    fastpaths.swap_forward(head, head_forward, _HEAD_FORWARD)
    return True


def uninstall_head(model: nn.Module) -> None:
    head = _head(model)
    if head is not None:
        fastpaths.restore_forward(head, _HEAD_FORWARD)


def head_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The LM head's logits of x [1, 1, H] (a one-row decode step, or a prompt's last position) by
    ``kernels.dense.linear`` (the same product: one rounding of a float32 sum, in its own order); anything else (a
    batch: the serving engine's steps of any size would each be timed on first use), a head with hooks, weights on
    another device, autograd to record: nn.Linear's forward."""
    hf = self.__dict__[_HEAD_FORWARD]
    w = self.weight
    if (x.shape[:-1] != (1, 1) or x.dtype != w.dtype or x.device != w.device or self._forward_hooks
            or self._forward_pre_hooks or not fused.available(x)
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return hf(x)
    # a prompt's last position is a view with its row stride: contiguous, one row
    return linear(x.reshape(1, -1).contiguous(), w, self.bias)[0].view(1, 1, -1)


def _fusable_norm(norm: nn.Module, x: torch.Tensor) -> bool:
    """A norm ``add_rms_norm`` computes as the module would: plain (no hooks, no own forward), a FusedRMSNorm or a
    known HF RMSNorm of x's dtype (HF's classes return float32 for other weight dtypes), no autograd to record."""
    if norm._forward_hooks or norm._forward_pre_hooks or "forward" in norm.__dict__:
        return False
    if not isinstance(norm, FusedRMSNorm) and (fuse_problem(norm) is not None or (
            rounds_twice(norm) and norm.weight.dtype != x.dtype)):
        return False
    return norm.weight.shape == (x.shape[-1],) and not (torch.is_grad_enabled() and norm.weight.requires_grad)


def _norm(norm: nn.Module, x: torch.Tensor, fast: bool) -> torch.Tensor:
    """norm(x): taken from the residual add that made x, by the kernel, or by the module."""
    pre = take_prenormed(x, norm)
    if pre is not None:
        return pre
    if fast and _fusable_norm(norm, x):
        return add_rms_norm(x, None, norm.weight, norm.variance_epsilon, rounds_twice(norm))[1]
    return norm(x)


def _add_and_next_norm(self, m: torch.Tensor, h: torch.Tensor, fast: bool, lazy=None) -> torch.Tensor:
    """h + m, and where the norm after this layer is known and fusable that norm of the sum, recorded on the sum
    for the norm to take: one kernel where Triton runs, else the add and the norm module (HF's ops, in HF's
    order: the same numbers as its forward). ``lazy``: the StreamExperts whose uncollected output m is (the MoE
    block's take_lazy_collect): its collect is this kernel's first step, or is queued first."""
    link = self.__dict__.get(_NEXT)
    nxt = getattr(link[0], link[1], None) if link else None
    fusable = nxt is not None and _fusable_norm(nxt, h) and m.shape == h.shape and m.dtype == h.dtype
    if lazy is not None and fast and fusable and h.is_contiguous():  # (lazy: one token, m.shape == h.shape)
        s, y = lazy.collect_add_rms_norm(h, nxt.weight, nxt.variance_epsilon, rounds_twice(nxt))
        s = s.view(h.shape)
        attach_prenormed(s, nxt, y.view(h.shape))
        return s
    if lazy is not None:
        lazy.flush()
    if not fusable:
        return h + m
    if fast:
        s, y = add_rms_norm(m, h, nxt.weight, nxt.variance_epsilon, rounds_twice(nxt))
    else:
        s = h + m
        y = nxt(s)
    attach_prenormed(s, nxt, y)
    return s


def decode_forward(self, hidden_states: torch.Tensor, *args, **kwargs):
    """The layer's forward for one query token per row (see the module docstring); anything else: HF's forward."""
    hf = self.__dict__[_HF_FORWARD]
    if args or hidden_states.dim() != 3 or hidden_states.shape[1] != 1:  # prefill: HF's forward, not a fallback
        return hf(hidden_states, *args, **kwargs)
    report = fastpaths.report_for(self)
    if self.training:
        report.fell_back("decode_layer", f"{type(self).__name__}: training", True)
        return hf(hidden_states, **kwargs)
    report.ran("decode_layer")
    fast = fused.available(hidden_states)
    normed = _norm(self.input_layernorm, hidden_states, fast)
    attn_kwargs = dict(kwargs)
    pos_emb, mask = attn_kwargs.pop("position_embeddings", None), attn_kwargs.pop("attention_mask", None)
    post = self.post_attention_layernorm
    fuse_post = (post.weight, post.variance_epsilon, rounds_twice(post)) if fast and _fusable_norm(
        post, hidden_states) else None  # o_proj's kernel may normalize its output too
    h, normed2 = decode_attention.forward_with_residual(self.self_attn, normed, hidden_states,
                                                        position_embeddings=pos_emb, attention_mask=mask,
                                                        norm=fuse_post, **attn_kwargs)
    if normed2 is not None:
        attach_prenormed(h, post, normed2)
    mlp = self.mlp
    # the MoE operator, unhooked (a hook or an instance forward would read its output before it is written): its
    # collect can join the add + norm below
    takes = fast and hasattr(mlp, "take_lazy_collect") and not moe_hooked(mlp)
    if takes:
        mlp.caller_collects = True
    try:
        m = mlp(_norm(post, h, fast))
    finally:
        if takes:
            mlp.caller_collects = False
    lazy = mlp.take_lazy_collect() if takes else None
    if SUPPORTED[type(self).__name__]:  # gpt-oss: (hidden, router scores)
        m = m[0]
    return _add_and_next_norm(self, m, h, fast, lazy)
