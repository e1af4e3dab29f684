"""The transformers interfaces that moved between the releases ktinject supports, in one place.

Supported: transformers 5.17 to 5.24 (``pyproject.toml``; CI tests both ends). Each entry names the releases on
either side of the move. Every answer is decided from the installed version on first use (nothing at import), so
call sites never guess with ``try``/``except``. Checked against each release's source (``modeling_qwen3_moe``,
``generation/utils.py``, ``masking_utils``, ``cache_utils``, ``integrations/moe.py``, ``core_model_loading``):

- The KV cache argument. 5.17-5.23: ``past_key_values``. 5.24 renamed it ``cache`` in the models' and attention
  modules' forwards, in generate's ``model_kwargs``, in ``create_masks_for_generate`` / ``create_causal_mask`` and
  in the model outputs; the old name still works there with a FutureWarning (removal announced for 5.40).
  ``cache_kwarg()``, ``cache_from(kwargs)``, ``CACHE_NAMES``.
- ``Cache.update``: 5.24 passes the attention's kwargs (``kwargs=``) along; both ends accept ``update(k, v,
  layer_idx)``, which is what ktinject calls. No entry needed.
- ``CacheLayerMixin.dtype``: removed in 5.24 (the keys tensor's dtype is the one to read). ktinject reads neither.
- ``StaticLayer`` (the base of ``ktinject.decode.kv_cache``'s layers: ``__init__(max_cache_len)``, ``lazy_initialization``,
  ``get_mask_sizes``, ``cumulative_length`` read by HF as the cache length): unchanged from 5.17 to 5.24 in what
  ktinject relies on; ``Cache(layers=[...])`` likewise.
- The gated-DeltaNet layers' cache calls (Qwen3-Next, Qwen3.5). 5.17: ``cache_params.has_previous_state(i,
  state_idx=0)``, then ``cache_params.layers[i].record_past`` / ``.conv_states[0]`` / ``.recurrent_states[0]``;
  5.24: ``cache.get_conv_state(i)`` / ``get_recurrent_state(i)`` / ``is_recording_past(i)``, HF's ``Cache`` methods
  that read the same layer attributes; both: ``update_conv_state(x, i, conv_kernel_size=K)`` and
  ``update_recurrent_state(s, i)``, and ``LinearAttentionCacheLayerMixin`` as the layer's base. ktinject's
  ``LinearLayer`` (``decode/linear_attention_state.py``) has those attributes, so both releases' calls reach the
  same buffers: no entry needed.
- ``create_masks_for_generate`` (masking_utils) passes ``block_sequence_ids`` to every layer type's mask function;
  5.17's ``create_chunked_causal_mask`` does not take it, so on a static cache Llama 4's masks raise a TypeError
  there (fixed by 5.24). ``chunked_masks_for_generate_work()``; ktinject builds those masks itself where not.
- DeepSeek Sparse Attention's layer type: ``deepseek_sparse_attention`` in 5.17, ``indexed_attention`` in 5.24
  (``DSA_LAYER_TYPES``); both layers take the full causal mask.
- ``DeferredStopCheck`` (generation/utils): same signature 5.17-5.24; looked up by name with ``getattr``.
- Rotary ``__init__(config, device=None)``: ``device`` deprecated in 5.18, removed in 5.24; ktinject passes
  ``config`` alone.
- The experts interface (``integrations/moe.py``) and the conversion mapping (``get_model_conversion_mapping``,
  ``rename_source_key``) kept their signatures across the range.
"""
from __future__ import annotations

import functools
import re

#: every name the KV cache argument has had in the supported releases, newest first
CACHE_NAMES = ("cache", "past_key_values")
#: the ``layer_types`` name of DeepSeek Sparse Attention layers (DeepSeek-V3.2, GLM-5), newest first
DSA_LAYER_TYPES = ("indexed_attention", "deepseek_sparse_attention")
#: the oldest and newest releases CI tests (pyproject's range is >= LOWEST, < the next minor after NEWEST)
LOWEST, NEWEST = (5, 17), (5, 24)


@functools.cache
def transformers_version() -> tuple[int, int]:
    """(major, minor) of the installed transformers (a dev or rc build counts as its release)."""
    import transformers

    m = re.match(r"(\d+)\.(\d+)", transformers.__version__)
    if m is None:
        raise RuntimeError(f"cannot read the transformers version {transformers.__version__!r}")
    return int(m.group(1)), int(m.group(2))


@functools.cache
def cache_kwarg() -> str:
    """The name under which this transformers passes the KV cache: ``cache`` from 5.24, else ``past_key_values``."""
    return "cache" if transformers_version() >= (5, 24) else "past_key_values"


@functools.cache
def chunked_masks_for_generate_work() -> bool:
    """Whether ``masking_utils.create_masks_for_generate`` can build a "chunked_attention" layer's mask: it passes
    ``block_sequence_ids``, which ``create_chunked_causal_mask`` takes only in some releases (not 5.17)."""
    import inspect

    from transformers import masking_utils

    return "block_sequence_ids" in inspect.signature(masking_utils.create_chunked_causal_mask).parameters


def cache_from(kwargs) -> object | None:
    """The KV cache in a call's keyword arguments: under this release's name, else under the deprecated one (5.24
    still accepts ``past_key_values`` from callers, with a FutureWarning)."""
    cache = kwargs.get(cache_kwarg())
    if cache is None:
        for name in CACHE_NAMES:
            if kwargs.get(name) is not None:
                return kwargs[name]
    return cache


def stray_cache(kwargs) -> str | None:
    """When a call holds no cache under a known name but something cache-like under another (a rename this module
    does not know yet): why the fast path cannot use it. Else None."""
    names = [k for k, v in kwargs.items() if hasattr(v, "update") and hasattr(v, "get_seq_length")]
    if not names:
        return None
    v = ".".join(map(str, transformers_version()))
    return (f"the KV cache came as {names[0]!r}, which ktinject.compat does not expect from transformers {v} "
            f"(it reads {cache_kwarg()!r})")


def supported_range() -> str:
    return f"{LOWEST[0]}.{LOWEST[1]} to {NEWEST[0]}.{NEWEST[1]}"


def untested_release() -> str | None:
    """A sentence when the installed transformers lies outside the tested range, else None."""
    v = transformers_version()
    if LOWEST <= v <= NEWEST:
        return None
    return (f"transformers {v[0]}.{v[1]} is outside the range ktinject is tested with ({supported_range()}); "
            f"fast paths may fall back to Hugging Face's code (ktinject.info(model) says which)")


def cache_arg(cache) -> dict:
    """``{name: cache}`` for a model or mask-function call: ``model(ids, **cache_arg(cache))``."""
    return {cache_kwarg(): cache}
