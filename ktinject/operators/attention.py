"""The "attention" operator: keep a Hugging Face attention module, place it on the device, ask for a fast kernel.

transformers 5.x attention modules dispatch through ``config._attn_implementation``, one setting for the whole
model; so ``build`` only moves the module, and ``inject`` applies the implementation the rules ask for once, with
``model.set_attn_implementation`` (see ``wanted_implementation``). Rule keyword arguments:

``implementation``: ``sdpa`` (default: SDPA unless the model already uses something at least as good, i.e. a
flash or flex kernel), ``eager``, ``flash_attention_2``, ``flash_attention_3``, ``flex_attention``, or ``keep``
(leave the model's setting alone); ``fuse_norms`` (default true): the RMSNorms inside the attention module (q/k
norms, MLA norms) become one ``torch.rms_norm`` kernel each (``ktinject.operators.norm``); ``fast_decode`` (default true):
modules of the standard grouped-query classes get a decode-step forward with fewer GPU kernels
(``ktinject.decode.attention``; other steps and classes run HF's forward). Models that do not support SDPA (gpt-oss: attention sinks) keep their setting
when ``sdpa`` is asked for, with an info message.

``sdpa`` installs ``ktinject_sdpa`` (registered with transformers' AttentionInterface and AttentionMaskInterface on
first use): HF's ``sdpa_attention_forward`` except for grouped-query decode steps (one query token, KV heads <
query heads). There HF up to 5.22 repeats K and V across the whole static cache every step (``repeat_kv``: a mask
is given, and SDPA's efficient kernel has no grouped-query mode; ``enable_gqa`` with a mask falls back to the math
kernel, which repeats them too). ``ktinject_sdpa`` folds the query heads of a group into the query length instead:
query [B, Hq, 1, D] -> [B, Hkv, Hq/Hkv, D] against K/V [B, Hkv, L, D] and the mask [B, 1, 1, L], broadcast: the
same numbers, no copy of the cache (HF 5.23 does the same as ``pack_gqa``). Models with an attention class in
``NAMED_IMPLEMENTATION_ONLY`` (DSA indexers) get HF's ``sdpa`` instead. Legend: B batch, Hq query heads, Hkv
KV heads, D head dim, L cache length.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch import nn

from ktinject.operators import register
from ktinject.operators.base import Operator, OperatorError, tensor_bytes

log = logging.getLogger(__name__)

#: the attention function ``sdpa`` installs (registered with transformers on first use)
KTINJECT_SDPA = "ktinject_sdpa"
#: attention classes whose forward compares the implementation's name with "eager" / "sdpa" (DeepSeek-V3.2's and
#: GLM-5's fold the lightning indexer's top-k into the mask only then, and hand any other function the indices for
#: a sparse kernel): ``sdpa`` keeps HF's "sdpa" for a model that has one, since ktinject_sdpa would drop that mask
NAMED_IMPLEMENTATION_ONLY = frozenset({"DeepseekV32Attention", "GlmMoeDsaAttention"})
IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention", "keep")
# implementations at least as good as SDPA: "sdpa" leaves these in place
_AT_LEAST_SDPA = ("sdpa", KTINJECT_SDPA, "flash_attention_2", "flash_attention_3", "flex_attention")


def _implementation(kwargs: Mapping[str, Any], name: str) -> str:
    impl = kwargs.get("implementation") or "sdpa"
    if impl not in IMPLEMENTATIONS:
        raise OperatorError(f"attention: implementation {impl!r} for {name!r} is not supported; use one of "
                            f"{', '.join(IMPLEMENTATIONS)}")
    return impl


@register("attention")
class AttentionOperator(Operator):
    """Place an attention module on ``device``; the model-wide kernel choice is made by inject."""

    kwargs_allowed = frozenset({"implementation", "fuse_norms", "fast_decode"})

    @classmethod
    def check(cls, module: nn.Module, name: str, kwargs: Mapping[str, Any]) -> None:
        cname = type(module).__name__
        if "Attention" not in cname or not hasattr(module, "layer_idx"):
            raise OperatorError(
                f"attention: module {name!r} ({cname}) is not a transformers attention module (expected a class "
                f"named *Attention with a layer_idx, e.g. Qwen3MoeAttention); match the self_attn modules")
        _implementation(kwargs, name)
        for key in ("fuse_norms", "fast_decode"):
            if not isinstance(kwargs.get(key, True), bool):
                raise OperatorError(f"attention: {key} for {name!r} must be true or false, got {kwargs[key]!r}")

    @classmethod
    def placement(cls, module: nn.Module, kwargs: Mapping[str, Any], device: torch.device) -> dict[str, int]:
        return {str(torch.device(device)): tensor_bytes(module)}

    @classmethod
    def build(cls, module: nn.Module, name: str, kwargs: Mapping[str, Any], device: torch.device) -> nn.Module:
        module = module.to(device)
        if kwargs.get("fuse_norms", True):  # q/k norms, MLA norms: one torch.rms_norm each (operators/norm.py)
            from ktinject.operators.norm import fuse_children

            fuse_children(module)
        return module  # fast_decode: the decode runtime's forward for one-token steps, installed by apply.finish


def wanted_implementation(kwargs_list: list[Mapping[str, Any]]) -> str:
    """The one implementation asked for by all attention entries ("keep" when there are none)."""
    asked = {_implementation(kw, "<rules>") for kw in kwargs_list} - {"keep"}
    if len(asked) > 1:
        raise OperatorError(f"attention: rules ask for different implementations {sorted(asked)}; transformers "
                            f"uses one per model: make them agree")
    return asked.pop() if asked else "keep"


def apply_implementation(model: nn.Module, wanted: str) -> str:
    """Set the model's attention implementation per ``wanted``; returns the one in force afterwards.

    ``sdpa`` means ``ktinject_sdpa`` where it can be registered (else HF's ``sdpa``); a model already on a flash or
    flex kernel keeps it."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if wanted == "keep" or config is None:
        return current
    target = wanted
    if wanted == "sdpa":
        if current in _AT_LEAST_SDPA and current != "sdpa":
            return current
        if not getattr(model, "_supports_sdpa", False):
            log.info("attention: %s does not support SDPA; keeping %r", type(model).__name__, current)
            return current
        named = next((type(m).__name__ for m in model.modules() if type(m).__name__ in NAMED_IMPLEMENTATION_ONLY),
                     None)
        if named is not None:
            log.info("attention: %s compares the implementation's name with 'sdpa'; using HF's 'sdpa'", named)
        target = KTINJECT_SDPA if named is None and register_sdpa() else "sdpa"
    if current == target:
        return current
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        raise OperatorError(f"attention: {type(model).__name__} cannot change its attention implementation "
                            f"(no set_attn_implementation); use implementation: keep")
    try:
        setter(target)
    except (ValueError, KeyError, ImportError) as e:
        if target != KTINJECT_SDPA:
            raise
        log.info("attention: %s refused %r (%s); using HF's 'sdpa'", type(model).__name__, target, e)
        if current == "sdpa":
            return current
        setter("sdpa")
    log.info("attention: implementation %r -> %r", current, model.config._attn_implementation)
    return model.config._attn_implementation


# ---- ktinject_sdpa ---------------------------------------------------------------------------------------------
_hf_sdpa = None  # transformers' own "sdpa" function, for every call ktinject_sdpa does not handle itself


def register_sdpa() -> bool:
    """Register ``ktinject_sdpa`` with transformers (attention function and mask function); False if this
    transformers has no such registries (then HF's ``sdpa`` is used)."""
    global _hf_sdpa
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # pragma: no cover - transformers < 4.48
        return False
    if _hf_sdpa is None:
        try:
            _hf_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
            sdpa_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
        except KeyError:
            return False
        AttentionInterface.register(KTINJECT_SDPA, sdpa_attention_forward)
        # the same masks as "sdpa" (an unregistered name would get no mask at all)
        AttentionMaskInterface.register(KTINJECT_SDPA, sdpa_mask)
    return True


def _hf_handles(module, query, key, attention_mask, kwargs) -> bool:
    """True when the call is not a plain grouped-query decode step (HF's function then runs it unchanged)."""
    groups = getattr(module, "num_key_value_groups", 1) or 1
    if groups <= 1 or query.shape[2] != 1 or key.shape[1] * groups != query.shape[1]:
        return True
    if attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[1] != 1
                                       or attention_mask.shape[2] != 1):
        return True  # per-head or per-query masks: keep HF's layout
    if any(kwargs.get(n) is not None for n in ("position_bias", "softcap", "s_aux", "sinks", "cache")):
        return True
    return bool(kwargs.get("output_attentions")) or torch.jit.is_tracing()


def sdpa_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           is_causal: bool | None = None, **kwargs):
    """transformers' attention-function contract (query [B, Hq, S, D], key/value [B, Hkv, L, D], mask [B, 1, S, L]
    or None) -> (output [B, S, Hq, Dv], None). A decode step (S == 1) of a grouped-query layer runs with the query
    heads of each KV head as that head's query rows (no K/V copy); everything else is HF's ``sdpa``."""
    if _hf_sdpa is None:
        register_sdpa()
    if _hf_handles(module, query, key, attention_mask, kwargs):
        return _hf_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)
    B, Hq, _, D = query.shape
    Hkv = key.shape[1]
    q = query.reshape(B, Hkv, Hq // Hkv, D)  # head h = kv * groups + g, as repeat_kv orders them
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                           scale=scaling, is_causal=False)  # [B, Hkv, groups, Dv]
    out = out.reshape(out.shape[0], Hq, 1, value.shape[-1]).transpose(1, 2).contiguous()  # [B, 1, Hq, Dv]
    return out, None
