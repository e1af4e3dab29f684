"""``ktinject.generate``: Hugging Face ``generate()`` with the decode step replayed as a CUDA graph.

HF's own loop runs unchanged (greedy and sampling, logits processors, max_new_tokens, EOS and stopping criteria,
TextStreamer / TextIteratorStreamer, batches with left padding). Three of its hooks are pointed at a ``GraphRunner``
for the duration of the call: ``_valid_auto_compile_criteria`` (true for the runner's static cache),
``get_compiled_call`` (returns the runner instead of a ``torch.compile``'d forward) and, for decode steps on the
runner's caches, ``create_masks_for_generate`` (returns the 2D padding mask as it is: HF would otherwise build the
4D mask on the host every step, ~10 small kernels and their Python; the model builds it inside the graph instead,
from the runner's static copy of the 2D mask). For the runner's caches the stop decision is deferred by one step
(HF's ``DeferredStopCheck``, which HF itself enables only on "mps"): the host queues step t+1 while the device
still runs step t, so neither HF's Python nor the graph launch (~3,000 nodes) leaves the GPU and the expert
threads idle between tokens; a sequence stopped by EOS or a stopping criterion costs one step that is computed
and dropped, and streamers get each token one step late. Not with ``return_dict_in_generate`` (the returned cache
must not hold the dropped step). HF then hands every decode step, and prompt chunks
(``prefill_chunk_size``), to the runner, which replays a graph for a bucketed decode batch and runs everything else
eagerly. The runner (and its static caches and graphs) lives on the model, so a second call with another prompt
length or a known batch size captures nothing.

A ``prefix_cache`` (``ktinject.decode.prefix_cache.PrefixCache``, given to the call or attached to the model by
``attach_prefix_cache`` / ``inject(..., prefix_cache=...)``) is looked up before the prefill: the longest prefix
every row holds is restored into the rows of the runner's cache, and HF's generate, seeing a cache that already
holds those positions, prefills the rest; afterwards the rows' new whole blocks are stored.

``enable(model)`` makes a plain ``model.generate(...)`` go through here (``ktinject.inject`` may call it);
``disable(model)`` undoes it. Without CUDA everything runs eagerly through the same path (static cache), giving
HF's greedy tokens.

Hybrid models (Qwen3-Next, Qwen3.5) are served too: the KVCache holds their linear-attention states.
Calls the runner cannot serve go to HF's generate unchanged: models with layer state the KVCache does not hold
(indexer caches: ``stateful_layers``, reported as ``graph_decode`` unavailable), beam search, assisted decoding, a caller's own
``past_key_values`` or ``cache_implementation``, ``use_cache=False``, ``inputs_embeds``, encoder-decoder models.
A batch size without a bucket is padded up to the next bucket with copies of its first row (when the result is
a plain tensor and nothing else would see the copies: no streamer, logits processor, stopping criterion,
prefix_allowed_tokens_fn or sampling), else decoded eagerly. With ``return_dict_in_generate`` the returned cache is
a DynamicCache copied from the runner's (which the next call reuses): the caller's to keep and continue from, as
HF's is.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import logging

import torch

from ktinject import compat
from ktinject.gpu_experts.prefill.streamer import MIN_CHUNK, streamer_of
from ktinject.operators.base import on_layout_change
from ktinject.decode import kv_cache
from ktinject.decode import linear_attention_state as linear_state
from ktinject.decode import stateful_layers
from ktinject.decode.graph_runner import GraphRunner
from ktinject.operators import fast_path_report as fastpaths

log = logging.getLogger(__name__)

_RUNNER_ATTR = "_ktinject_graph_runner"
_HF_DEFAULT_MAX_LENGTH = 20
_PLAIN_KWARGS = ("past_key_values", "cache", "cache_implementation", "assistant_model", "prompt_lookup_num_tokens",
                 "custom_generate", "inputs_embeds", "assistant_early_exit", "negative_prompt_ids")


def get_runner(model, **runner_kwargs) -> GraphRunner:
    """The model's GraphRunner (made on first use; ``runner_kwargs`` given -> a new one with those settings)."""
    runner = model.__dict__.get(_RUNNER_ATTR)
    if runner is None or runner_kwargs:
        if runner is not None:
            runner.close()
        runner = GraphRunner(model, **runner_kwargs)
        model.__dict__[_RUNNER_ATTR] = runner
        on_layout_change(model, "graph_runner", lambda: invalidate_graphs(model))  # hot-expert placement
    return runner


#: prompt tokens per prefill forward where nothing says otherwise (the CPU path gains little from longer chunks)
DEFAULT_PREFILL_CHUNK = 2048


def prefill_chunk(model, prompt_len: int | None = None) -> int | None:
    """Prompt tokens per prefill forward of ``model``'s generate: its runner's ``prefill_chunk``; for "auto", what
    the free GPU memory allows where the prompts' routed experts are streamed to the GPU (every chunk streams all of
    them once: the longer the chunk, the fewer passes; ``gpu_experts.prefill.streamer.PrefillStreamer.chunk_tokens``),
    else DEFAULT_PREFILL_CHUNK. A ``prompt_len`` that no chunk size would cut is answered without asking."""
    chunk = get_runner(model).prefill_chunk
    if chunk != "auto":
        return chunk
    if prompt_len is not None and prompt_len <= min(MIN_CHUNK, DEFAULT_PREFILL_CHUNK):
        return None
    streamer = streamer_of(model)
    return streamer.chunk_tokens() if streamer is not None and streamer.mode != "cpu" else DEFAULT_PREFILL_CHUNK


def invalidate_graphs(model) -> None:
    """Drop the model's captured decode graphs (not its caches' contents): the next decode step captures again.
    For code that moves tensors a graph reads (hot-expert placement)."""
    runner = model.__dict__.get(_RUNNER_ATTR)
    if runner is not None:
        runner.reset()


def enable(model, **runner_kwargs):
    """Route ``model.generate(...)`` through ``ktinject.generate`` (settings: GraphRunner's keywords)."""
    get_runner(model, **runner_kwargs)

    @functools.wraps(type(model).generate)
    def _generate(*args, **kwargs):
        return generate(model, *args, **kwargs)

    _generate._ktinject = True
    model.__dict__["generate"] = _generate
    return model


def disable(model):
    """Give ``model.generate`` back to Hugging Face and drop the runner (graphs, caches, stream runners)."""
    model.__dict__.pop("generate", None)
    runner = model.__dict__.pop(_RUNNER_ATTR, None)
    if runner is not None:
        runner.close()
    return model


def _hf_generate(model, *args, **kwargs):
    return type(model).generate(model, *args, **kwargs)


def _generation_config(model, kwargs):
    gc = kwargs.get("generation_config") or model.generation_config
    gc = copy.deepcopy(gc)
    gc.update(**{k: v for k, v in kwargs.items() if k != "generation_config" and hasattr(gc, k)})
    return gc


def _plain_reason(model, input_ids, kwargs, gc) -> str | None:
    """Why this call goes to HF's generate unchanged, or None."""
    if input_ids is None or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return "no 2D input_ids"
    if getattr(model.config, "is_encoder_decoder", False):
        return "encoder-decoder model"
    stateful = stateful_layers.remember(model)
    if stateful is not None:  # linear-attention states, indexer caches: HF's cache holds them
        fastpaths.report_for(model).unavailable("graph_decode", stateful)
        return stateful
    for name in _PLAIN_KWARGS:
        if kwargs.get(name) is not None:
            return f"{name} given"
    if (gc.num_beams or 1) > 1:
        return "beam search"
    if gc.use_cache is False:
        return "use_cache=False"
    if getattr(gc, "cache_implementation", None) is not None:
        return "cache_implementation set"
    return None


def _needed_len(gc, prompt_len: int) -> int:
    if gc.max_new_tokens is not None:
        return prompt_len + int(gc.max_new_tokens)
    return max(int(gc.max_length or _HF_DEFAULT_MAX_LENGTH), prompt_len + 1)


_HOOKS = ("_valid_auto_compile_criteria", "get_compiled_call", "create_masks_for_generate")
_DEFERRED: dict[int, object] = {}  # id(cache) -> cache: the runner caches whose stop check is deferred right now


def _install_deferred_stop() -> bool:
    """Let HF's ``DeferredStopCheck`` serve the caches in ``_DEFERRED`` too (once per process; every other cache
    gets HF's own decision). False where this transformers has no deferred stop check."""
    from transformers.generation import utils as gen_utils

    base = getattr(gen_utils, "DeferredStopCheck", None)
    if base is None:
        return False
    if getattr(base, "_ktinject", False):
        return True

    def ours(cache) -> bool:
        return cache is not None and _DEFERRED.get(id(cache)) is cache

    class RunnerDeferredStopCheck(base):
        _ktinject = True

        @staticmethod
        def is_supported(device, cache, cache_is_returned, is_assistant):
            if ours(cache) and device.type == "cuda" and not is_assistant:
                return True
            return base.is_supported(device, cache, cache_is_returned, is_assistant)

        def __init__(self, *args, **kwargs):
            # a runner cache is not returned (no return_dict_in_generate): the next generate resets it, so the
            # dropped step's K/V need no crop (a StaticCache cannot crop). Arguments as HF's (bound by name, so a
            # changed signature only loses this adjustment)
            try:
                bound = inspect.signature(base.__init__).bind(self, *args, **kwargs)
            except TypeError:
                bound = None
            if bound is not None and ours(bound.arguments.get("cache")) and "cache_is_returned" in bound.arguments:
                bound.arguments["cache_is_returned"] = False
                args, kwargs = bound.args[1:], bound.kwargs
            super().__init__(*args, **kwargs)

    gen_utils.DeferredStopCheck = RunnerDeferredStopCheck
    log.debug("ktinject.generate: deferred stop checks enabled for graph runner caches")
    return True


def _mask_hook(model, runner: GraphRunner):
    """``create_masks_for_generate`` for the call: a decode step on one of the runner's (graphable) caches keeps its
    2D padding mask (or None), anything else gets HF's masks."""
    from transformers import masking_utils

    # what HF's prepare_inputs_for_generation would call: the model's own (bound) function, else the library's
    hf_masks = getattr(model, "create_masks_for_generate", None) or masking_utils.create_masks_for_generate
    graphable: dict[int, bool] = {}
    # a release whose create_masks_for_generate cannot build chunked-attention masks: ours for our caches
    own_masks = (not compat.chunked_masks_for_generate_work()
                 and "chunked_attention" in (getattr(linear_state.text_config(model.config), "layer_types", None) or ()))

    def create_masks_for_generate(*args, **kwargs):
        embeds, mask, cache = kwargs.get("inputs_embeds"), kwargs.get("attention_mask"), compat.cache_from(kwargs)
        plain = (not args and embeds is not None and embeds.dim() == 3
                 and (mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 2))
                 and kwargs.get("block_sequence_ids") is None and kwargs.get("or_mask_function") is None
                 and kwargs.get("and_mask_function") is None and any(cache is c for c in runner.caches.values()))
        if plain and embeds.shape[1] == 1:
            key = id(cache)
            if key not in graphable:
                graphable[key] = runner.graphable_cache(cache)
            if graphable[key]:
                return mask
        if plain and own_masks:
            B, S = embeds.shape[:2]
            return kv_cache.attention_masks(model.config, cache.row_lengths[:B], S, cache.max_len, mask,
                                            kv_cache.mask_float_dtype(model))
        return hf_masks(*args, **kwargs)

    return create_masks_for_generate


@contextlib.contextmanager
def _hooked(model, runner: GraphRunner, defer_cache=None):
    """Point HF's compile hooks at ``runner`` for the runner's own caches (instance attributes, restored after);
    ``defer_cache``: the call's runner cache, whose stop check is deferred by a step."""
    saved = {n: model.__dict__[n] for n in _HOOKS if n in model.__dict__}
    caches = runner.caches
    if defer_cache is not None and _install_deferred_stop():
        _DEFERRED[id(defer_cache)] = defer_cache

    def criteria(model_kwargs, generation_config):
        cache = compat.cache_from(model_kwargs)
        return cache is not None and any(cache is c for c in caches.values())

    model.__dict__["_valid_auto_compile_criteria"] = criteria
    model.__dict__["get_compiled_call"] = lambda compile_config=None: runner
    if runner.own_masks:
        model.__dict__["create_masks_for_generate"] = _mask_hook(model, runner)
    try:
        yield
    finally:
        if defer_cache is not None:
            _DEFERRED.pop(id(defer_cache), None)
        for n in _HOOKS:
            model.__dict__.pop(n, None)
        model.__dict__.update(saved)


def _hf_positional(model, args: tuple, kwargs: dict) -> None:
    """Put ``args`` into ``kwargs`` under the names HF's ``generate`` gives its positional parameters (inputs,
    generation_config, logits_processor, ...), as a call to ``model.generate(*args)`` binds them."""
    names = [p.name for p in inspect.signature(type(model).generate).parameters.values()
             if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.name != "self"]
    if len(args) > len(names):
        raise TypeError(f"generate() takes at most {len(names)} positional arguments after the model "
                        f"({', '.join(names)}), {len(args)} were given")
    for name, value in zip(names, args):
        if name in kwargs:
            raise TypeError(f"generate() got multiple values for argument {name!r}")
        kwargs[name] = value


def _owned_cache(model, cache):
    """A DynamicCache holding what the runner's ``cache`` holds for the rows of this call (their lengths are equal:
    generate's rows start together), for the caller to keep: the runner's cache is reused (overwritten) by the next
    call and cannot grow past its length, where HF's returned cache can."""
    from transformers import DynamicCache

    out = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            continue
        if linear_state.is_linear_layer(layer):  # conv windows [B, C, K], recurrent matrices [B, Hv, Dk, Dv]
            out.update_conv_state(layer.conv_states[0].clone(), i, conv_kernel_size=layer.conv_kernel_size[0])
            out.update_recurrent_state(layer.recurrent_states[0].clone(), i)
            continue
        n = int(layer.row_lengths.max())
        out.update(layer.keys[:, :, :n].clone(), layer.values[:, :, :n].clone(), i)
    return out


def generate(model, *args, **kwargs):
    """``model.generate(input_ids, attention_mask=..., **kwargs)`` with graph-replayed decode steps.

    Same arguments (positional ones too: inputs, generation_config, ...) and results as Hugging Face's ``generate``;
    a cache it returns (``return_dict_in_generate``) is the caller's, as HF's is."""
    _hf_positional(model, args, kwargs)
    attention_mask = kwargs.pop("attention_mask", None)
    input_ids = kwargs.pop("inputs", None)
    if input_ids is None:
        input_ids = kwargs.pop("input_ids", None)
    prefix = kwargs.pop("prefix_cache", None)
    prefix = prefix if prefix is not None else model.__dict__.get(PREFIX_CACHE_ATTR)
    runner = get_runner(model)
    gc = _generation_config(model, kwargs)
    reason = _plain_reason(model, input_ids, kwargs, gc)
    if reason is not None:
        log.debug("ktinject.generate: %s -> Hugging Face generate", reason)
        if prefix is not None:
            _note_uncached(model, prefix, reason)
        return _hf_generate(model, input_ids, attention_mask=attention_mask, **kwargs)

    batch, prompt_len = input_ids.shape
    rows = batch * max(int(gc.num_return_sequences or 1), 1)
    pad = 0
    # padding rows must stay invisible: not in the result, a streamer, per-row callbacks or the sampler's draws
    plain_result = not gc.return_dict_in_generate and kwargs.get("streamer") is None and not gc.do_sample and \
        not any(kwargs.get(k) for k in ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn"))
    if rows == batch and plain_result:
        pad = runner.padded_batch(rows) - rows
    if pad:
        input_ids = torch.cat([input_ids, input_ids[:1].expand(pad, -1)], dim=0)
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask, attention_mask[:1].expand(pad, -1)], dim=0)
        rows += pad

    cache = runner.cache_for(rows, _needed_len(gc, prompt_len))
    kwargs[compat.cache_kwarg()] = cache
    if prefix is not None and prefix.why_uncached(model) is not None:
        _note_uncached(model, prefix, "")
    reused = 0 if prefix is None else _restore_prefix(model, prefix, input_ids, attention_mask, cache)
    if prefix is not None and stateful_layers.needs_state_checkpoints(model):
        _prefill_to_checkpoint(model, prefix, input_ids, attention_mask, cache)
    chunk = prefill_chunk(model, prompt_len)
    if chunk and prompt_len > chunk and gc.prefill_chunk_size is None:
        kwargs["prefill_chunk_size"] = chunk
    defer = cache if runner.defer_stop and runner.graphs_enabled() and not gc.return_dict_in_generate else None
    with _hooked(model, runner, defer):
        out = _hf_generate(model, input_ids, attention_mask=attention_mask, **kwargs)
    field = compat.cache_kwarg()  # the output's field has the keyword's name ("cache" from transformers 5.24)
    if prefix is not None:
        _insert_prefix(model, prefix, out, input_ids, attention_mask, cache, batch)
        log.debug("ktinject.generate: %d prompt tokens a row restored from the prefix cache", reused)
    if gc.return_dict_in_generate and getattr(out, field, None) is cache:
        setattr(out, field, _owned_cache(model, cache))
    return out[:batch] if pad else out


#: where ``inject(..., prefix_cache=...)`` keeps the model's PrefixCache (used when generate is given none)
PREFIX_CACHE_ATTR = "_ktinject_prefix_cache"


def attach_prefix_cache(model, prefix_cache) -> None:
    """Make ``prefix_cache`` (a ``ktinject.decode.prefix_cache.PrefixCache``, or None to detach) the one every
    ``ktinject.generate`` of ``model`` uses when it is passed none, and route a plain ``model.generate(...)``
    through ``ktinject.generate`` (``enable``; on the CPU too, where the runner's static cache gives HF's tokens);
    a model whose layout cannot be cached says so once, in the log."""
    if prefix_cache is None:
        model.__dict__.pop(PREFIX_CACHE_ATTR, None)
        return
    model.__dict__[PREFIX_CACHE_ATTR] = prefix_cache
    if not getattr(model.__dict__.get("generate"), "_ktinject", False):
        enable(model)
    reason = prefix_cache.why_uncached(model)
    if reason is not None:
        log.warning("ktinject: %s", reason)


def _note_uncached(model, prefix, reason: str) -> None:
    why = prefix.why_uncached(model) or f"prefix cache not used: {reason}; the prompt is prefilled whole"
    if model.__dict__.get("_ktinject_prefix_note") != why:
        model.__dict__["_ktinject_prefix_note"] = why
        log.info("ktinject.generate: %s", why)


def _unpadded(attention_mask) -> bool:
    return attention_mask is None or bool(torch.all(attention_mask != 0))


def _restore_prefix(model, prefix, input_ids, attention_mask, cache) -> int:
    """Restore the longest prefix every row has cached (rows of one forward share a position) into the rows of
    ``cache``; the tokens restored a row (0: none, or the rows are padded)."""
    if not _unpadded(attention_mask):
        return 0
    if input_ids.shape[0] > 1 and stateful_layers.needs_state_checkpoints(model):
        return 0  # (rows cut to a common length would need a state checkpoint there: one row at a time)
    hits = [prefix.lookup(model, row) for row in input_ids]
    tokens = min(h.tokens for h in hits)
    if tokens == 0:
        return 0
    done = min(prefix.restore(dataclasses.replace(h, tokens=tokens, keys=h.keys[:tokens // h.block_size]), cache, r)
               for r, h in enumerate(hits))
    if done < tokens:  # a block failed its check in some row: every row restarts from the shortest restore
        cache.lengths[:] = torch.clamp(cache.lengths, max=done)
    return done


@torch.no_grad()
def _prefill_to_checkpoint(model, prefix, input_ids, attention_mask, cache) -> None:
    """A model with state that a prefix cache checkpoints (linear attention): prefill one row's prompt up to its last
    whole block before the last token (in chunks, from what was restored) and store those blocks with the state at
    their end, so a later prompt that starts the same resumes there; HF's generate then prefills the rest. Rows of a
    batch, or padded ones, are left to HF's prefill (and get no checkpoint)."""
    if input_ids.shape[0] != 1 or not _unpadded(attention_mask):
        return
    block = prefix.block_size
    start, end = int(cache.lengths[0, 0]), (input_ids.shape[1] - 1) // block * block
    if end <= start:
        return
    chunk = prefill_chunk(model, end - start) or (end - start)
    row = cache.rows(0, 1)
    for a in range(start, end, chunk):
        b = min(a + chunk, end)
        kv_cache.forward(model, row, input_ids[:, a:b], logits_to_keep=1)
    prefix.insert(model, input_ids[0, :end], cache, 0, end)


def _insert_prefix(model, prefix, out, input_ids, attention_mask, cache, batch: int) -> None:
    """Store the whole blocks of each real row: its prompt, and with ``prefix.keep_generated`` what was generated
    too (the positions the cache holds)."""
    if not _unpadded(attention_mask):
        return
    sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
    if sequences is None:
        return
    length = None if prefix.keep_generated else input_ids.shape[1]
    for r in range(min(batch, sequences.shape[0])):
        prefix.insert(model, sequences[r], cache, r, length)


