"""Decoder-layer parts whose decode state ktinject's KVCache does not hold, and what that means for decode steps.

``KVCache`` (``kv_cache.py``) holds K and V (or MLA latents) per layer and row, at fixed addresses a CUDA graph can
replay, and the gated-DeltaNet layers' conv windows and recurrent matrices of Qwen3-Next and Qwen3.5
(``linear_attention_state.py``): those families decode through ktinject's path like the others (graphs on CUDA).
The lightning indexer of DeepSeek-V3.2 and GLM-5 keeps its own key cache (``update_indexer``): the KVCache holds it
per layer and row beside K/V (graph decode), and the prefix cache's blocks carry it beside their K/V. Some families
keep other state between steps, written through Hugging Face cache methods the KVCache does not have
(DeepSeek-V4's). Layer types whose masks the KVCache's ``attention_masks`` does not build are another such case (it
builds full, sliding-window and Llama 4's chunked-attention masks). A model with
such a part decodes through Hugging Face's ``generate`` and its own cache, one eager forward per step: no graph, no
fast decode attention. ``eager_decode_reason`` names the part, so the plan, the inject line and the fast-path
report (``graph_decode``) say why, never a silent slow path.

State the KVCache holds that a prefix cache cannot rebuild from K/V blocks (the linear-attention states: a recurrent
matrix is not cut at a token) is stored as a checkpoint at block boundaries (``needs_state_checkpoints``: the prefix
cache keeps a row's state beside the block it ends, and a hit ends at a block that has one);
``prefix_uncached_reason`` names what a prefix cache cannot take at all (the eager-decode parts).
"""
from __future__ import annotations

from torch import nn

from ktinject import compat

#: class name -> the state it keeps outside ktinject's KVCache
UNHELD_STATE = {
    # DeepSeek-V4: a shared K=V sliding window, and in compressed layers the compressors' window buffers, compressed
    # entries and overlap (CSA: its indexer's too), all in HF's own cache layers
    "DeepseekV4Attention": "a K=V sliding window and compressed-attention states in DeepSeek-V4's cache layers",
}
#: class name -> the state it keeps in ktinject's KVCache that cannot be restored from K/V blocks (a prefix cache
#: checkpoints it at block boundaries)
UNBLOCKED_STATE = {
    "Qwen3NextGatedDeltaNet": "linear-attention conv and recurrent states",
    "Qwen3_5MoeGatedDeltaNet": "linear-attention conv and recurrent states",
}
_REASON_ATTR = "_ktinject_eager_decode_reason"
_PREFIX_ATTR = "_ktinject_prefix_state_checkpoints"


def _found(model: nn.Module, classes: dict) -> tuple[str, str, str] | None:
    """(module name, class, " and N more") of the first module of one of ``classes``, or None."""
    found = [(name, type(m).__name__) for name, m in model.named_modules() if type(m).__name__ in classes]
    if not found:
        return None
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    return found[0][0], found[0][1], more


def eager_decode_reason(model: nn.Module) -> str | None:
    """Why ``model``'s decode steps run eagerly in Hugging Face's cache (the first such part, its class and how many
    there are), or None when every layer's state fits the KVCache. Reads classes only: works on meta-device models."""
    found = _found(model, UNHELD_STATE)
    if found is None:
        return _unmasked_layer_types(model)
    name, cls, more = found
    return (f"{name} ({cls}){more} keep {UNHELD_STATE[cls]}, which ktinject's KVCache does not hold: decode steps "
            f"run eagerly through Hugging Face's generate and cache (no CUDA graph)")


def remember(model: nn.Module) -> str | None:
    """``eager_decode_reason`` computed once and kept on the model (injected models do not change class)."""
    if _REASON_ATTR not in model.__dict__:
        model.__dict__[_REASON_ATTR] = eager_decode_reason(model)
    return model.__dict__[_REASON_ATTR]


def prefix_uncached_reason(model: nn.Module) -> str | None:
    """Why a prefix cache cannot restore ``model``'s rows at all (its ``eager_decode_reason``: state outside the
    KVCache), or None: everything the KVCache holds, its blocks and state checkpoints carry."""
    return remember(model)


def needs_state_checkpoints(model: nn.Module) -> bool:
    """Whether ``model``'s rows hold state besides positions (``UNBLOCKED_STATE``), which a prefix cache restores
    from a checkpoint taken at a block boundary; computed once and kept on the model."""
    if _PREFIX_ATTR not in model.__dict__:
        model.__dict__[_PREFIX_ATTR] = _found(model, UNBLOCKED_STATE) is not None
    return model.__dict__[_PREFIX_ATTR]


#: layer types whose masks are the full causal mask (their other state is the parts above)
_FULL_MASK_TYPES = ("linear_attention",) + compat.DSA_LAYER_TYPES


def _unmasked_layer_types(model: nn.Module) -> str | None:
    """Why the config's ``layer_types`` name layers whose masks ``kv_cache.attention_masks`` does not build, or
    None."""
    from ktinject.decode.kv_cache import MASK_TYPES

    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = list(getattr(text, "layer_types", None) or ())
    other = sorted({t for t in types if t not in MASK_TYPES + _FULL_MASK_TYPES})
    if not other:
        return None
    n = sum(t in other for t in types)
    return (f"{n} of its {len(types)} layers are {', '.join(other)} (layer_types), whose masks ktinject's KVCache "
            f"does not build: decode steps run eagerly through Hugging Face's generate and cache (no CUDA graph)")
