"""ktinject's decode KV cache: a fixed number of rows (slots) x a maximum length, with a position per row.

HF's ``StaticCache`` keeps one position counter per layer, so every row of a batch sits at the same position, and
its sliding-window layers keep a Python int (no CUDA graph can replay them). ``KVCache`` keeps, per layer, K and V
of shape [slots, heads, L, D] (allocated once, on the first write, from the written tensors' shapes: MLA latents of
DeepSeek in transformers 5.24 and full K/V alike) and one int64 length per row, on the device. A forward of B rows
writes its S new tokens of row b at ``lengths[b] .. lengths[b] + S - 1`` and advances ``lengths[b]`` by S, all in
device ops: the lengths are graph inputs (static tensors), so one captured decode step serves rows at different
positions. Sliding-window layers keep the whole history and get their window from the mask, so gpt-oss decodes as a
graph too. ``attention_masks`` builds the masks a step needs from the lengths (and an optional 2D padding mask),
inside the graph; models take a 4D mask (or a dict of them per layer type) as is.

It is an HF ``Cache`` (its layers subclass ``StaticLayer``), so HF's own code paths (``generate``'s prefill, masks
built by HF for a batch whose rows share one position) work on it unchanged. ``rows(a, b)`` is a view of rows
[a, b) that shares storage: ``generate`` of B rows uses ``rows(0, B)``, a server prefills a request into its slot
through ``rows(s, s + 1)``. Rows can be reset, copied, exported and imported (``reset_rows``, ``copy_row``,
``export_row``, ``import_row``). The cache outlives ``generate()`` when the caller keeps it.

Hybrid models (Qwen3-Next, Qwen3.5-MoE: ``config.layer_types`` naming "linear_attention" layers) hold their
linear-attention layers' conv and recurrent states in a ``linear_attention_state.LinearAttentionState`` member
(``cache.linear``, shared by every view), allocated once for all rows: those layers are ``LinearLayer``s, which take
no K/V memory and hold no length (``lengths`` has a row per K/V layer only); row resets, copies and the capture's
save / restore cover their state too. Their masks: the 2D padding mask of a forward's own tokens for
"linear_attention" layers (None for one-token steps), beside the full-attention layers' 4D masks.
Legend: N slots, B rows of a forward, H heads, L max length, D head dim, S new tokens per row.
"""
from __future__ import annotations

import weakref

import torch

from ktinject import compat
from ktinject.decode import linear_attention_state as linear_state

MASK_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def _static_layer_class():
    from transformers.cache_utils import StaticLayer

    return StaticLayer


def _cache_class():
    from transformers.cache_utils import Cache

    return Cache


def _classes():
    """(KVLayer, KVCache), defined on first use against the installed transformers (nothing at import)."""
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _define(_static_layer_class(), _cache_class())
    return _CLASSES


_CLASSES = None


def _define(StaticLayer, Cache):  # noqa: C901 - two small classes defined against the installed transformers
    class KVLayer(StaticLayer):
        """One layer: K [N, H, L, Dk], V [N, H, L, Dv] and lengths [N] (int64, device). ``source``: (parent layer,
        first row, end row) for a view of some rows of a parent's storage."""

        def __init__(self, max_len: int, lengths: torch.Tensor, source=None):
            super().__init__(max_cache_len=max_len)
            self.row_lengths = lengths  # [rows] int64 (a slice of the parent's for a view)
            self.cumulative_length = lengths[0]  # HF reads this 0-d tensor as "the" length (row 0's)
            self.source = source
            self._arange = torch.arange(max_len, device=lengths.device)
            self.index_keys = None  # [N, L, D]: DSA's lightning-indexer keys (update_indexer), where the model has one
            self._waiting = []  # views made before this layer held storage: they take their rows when it does
            if source is not None:
                if source[0].is_initialized:
                    self._take_view()
                else:
                    source[0]._waiting.append(weakref.ref(self))

        def _take_view(self) -> None:
            parent, a, b = self.source
            self.keys, self.values = parent.keys[a:b], parent.values[a:b]
            self.device = parent.device
            self.is_initialized = True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            if self.source is not None:
                if not self.source[0].is_initialized:
                    self.source[0].lazy_initialization(key_states, value_states)
                self._take_view()
                return
            N, H, L = self.row_lengths.shape[0], key_states.shape[1], self.max_cache_len
            self.device = key_states.device
            self.keys = torch.zeros((N, H, L, key_states.shape[-1]), dtype=key_states.dtype, device=self.device)
            self.values = torch.zeros((N, H, L, value_states.shape[-1]), dtype=value_states.dtype,
                                      device=self.device)
            self.is_initialized = True
            for ref in self._waiting:  # (a forward through one view initializes this layer, not the other views)
                view = ref()
                if view is not None and not view.is_initialized:
                    view._take_view()
            self._waiting.clear()

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            """Write k/v [B, H, S, D] of rows 0..B-1 at their own positions; (K, V) [B, H, L, D] of those rows."""
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            B, H, S = key_states.shape[:3]
            idx = (self.row_lengths[:B, None] + self._arange[:S]).view(B, 1, S, 1)  # [B, 1, S, 1]
            self.keys[:B].scatter_(2, idx.expand(B, H, S, self.keys.shape[-1]), key_states.to(self.keys.dtype))
            self.values[:B].scatter_(2, idx.expand(B, H, S, self.values.shape[-1]),
                                     value_states.to(self.values.dtype))
            self.row_lengths[:B].add_(S)
            return self.keys[:B], self.values[:B]

        def indexer_buffer(self) -> torch.Tensor | None:
            """The indexer keys [rows, L, D] of this layer (a view's: its rows of the parent's), None before the
            first ``update_indexer``."""
            if self.index_keys is None and self.source is not None:
                parent, a, b = self.source
                if parent.index_keys is not None:
                    self.index_keys = parent.index_keys[a:b]
            return self.index_keys

        def ensure_indexer_buffer(self, like: torch.Tensor) -> torch.Tensor:
            """The indexer keys of this layer, allocated on first use (zeros [rows, L, D] of ``like``'s last size,
            dtype and device, in the parent's storage for a view)."""
            if self.indexer_buffer() is None:
                owner = self.source[0] if self.source is not None else self
                owner.index_keys = torch.zeros((owner.row_lengths.shape[0], self.max_cache_len, like.shape[-1]),
                                               dtype=like.dtype, device=like.device)
                self.indexer_buffer()
            return self.index_keys

        def update_indexer(self, index_states: torch.Tensor) -> torch.Tensor:
            """Write the lightning indexer's keys [B, S, D] of rows 0..B-1 at the positions this layer's ``update``
            has just written (the attention calls it first, so the rows' lengths already count these S tokens);
            the keys [B, L, D] of those rows (positions past a row's length are masked, as K/V's)."""
            self.ensure_indexer_buffer(index_states)
            B, S, D = index_states.shape
            idx = (self.row_lengths[:B, None] - S + self._arange[:S]).view(B, S, 1)  # [B, S, 1]
            self.index_keys[:B].scatter_(1, idx.expand(B, S, D), index_states.to(self.index_keys.dtype))
            return self.index_keys[:B]

        def get_seq_length(self, *args, **kwargs):
            return self.cumulative_length if self.is_initialized else 0

        def reset(self) -> None:
            self.row_lengths.zero_()  # the stored K/V need no zeroing: masks never reach past a row's length

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                raise ValueError("KVCache layers are cropped by a negative count of tokens to remove")
            self.row_lengths.sub_(-tokens_to_remove).clamp_(min=0)

    class KVCache(Cache):
        """The cache (see the module docstring): ``KVCache.new(config, slots, max_len, device)``."""

        def __init__(self, layers, slots: int, max_len: int, lengths: torch.Tensor, parent=None, first: int = 0,
                     linear=None):
            super().__init__(layers=layers)
            self.slots, self.max_len = slots, max_len
            self.lengths = lengths  # [K/V layers, slots] int64: row j is the j-th K/V layer's row_lengths
            self.parent, self.first = parent, first
            self.linear = linear  # LinearAttentionState (hybrid models), else None

        @classmethod
        def new(cls, config, slots: int, max_len: int, device) -> "KVCache":
            n = linear_state.text_config(config).num_hidden_layers
            if slots < 1 or max_len < 1:
                raise ValueError(f"KVCache needs slots >= 1 and max_len >= 1, got {slots} and {max_len}")
            layout = linear_state.layout_of(config)
            linear_layers = set(layout.layers) if layout is not None else set()
            if len(linear_layers) == n:
                raise ValueError("KVCache needs at least one attention layer (every layer is linear attention)")
            lengths = torch.zeros((n - len(linear_layers), slots), dtype=torch.int64, device=device)
            linear = linear_state.LinearAttentionState(layout, slots) if layout is not None else None
            layers, j = [], 0
            for i in range(n):
                if i in linear_layers:
                    layers.append(linear_state.layer_class()(linear, i, 0, slots))
                else:
                    layers.append(KVLayer(max_len, lengths[j]))
                    j += 1
            return cls(layers, slots, max_len, lengths, linear=linear)

        def rows(self, a: int, b: int) -> "KVCache":
            """A view of rows [a, b) sharing this cache's storage (writes land here)."""
            if not 0 <= a < b <= self.slots:
                raise IndexError(f"rows({a}, {b}) of a KVCache with {self.slots} slots")
            base = self.parent or self
            a0, b0 = self.first + a, self.first + b
            layers, j = [], 0
            for i, layer in enumerate(base.layers):
                if linear_state.is_linear_layer(layer):
                    layers.append(linear_state.layer_class()(base.linear, i, a0, b0))
                else:
                    layers.append(KVLayer(self.max_len, base.lengths[j, a0:b0], (layer, a0, b0)))
                    j += 1
            return KVCache(layers, b - a, self.max_len, base.lengths[:, a0:b0], base, a0, base.linear)

        def update_indexer(self, index_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
            """DeepSeek Sparse Attention's indexer keys of layer ``layer_idx`` (``KVLayer.update_indexer``)."""
            return self.layers[layer_idx].update_indexer(index_states)

        def kv_layers(self) -> list:
            """The layers that hold K/V (every layer but the linear-attention ones)."""
            return [layer for layer in self.layers if not linear_state.is_linear_layer(layer)]

        @property
        def row_lengths(self) -> torch.Tensor:
            """[slots] int64: tokens held per row (the first K/V layer's count; all agree after a whole forward)."""
            return self.lengths[0]

        @property
        def initialized(self) -> bool:
            return all(layer.is_initialized for layer in self.layers)

        def reset_rows(self, rows) -> None:
            """Forget rows (an index, a slice, a range, a list or a tensor of row indices): lengths 0,
            linear-attention state zero. An index, a slice or a range of step 1 needs no host-to-device copy."""
            self.lengths[:, linear_state.row_index(rows, self.lengths.device)] = 0
            if self.linear is not None:
                linear_state.reset_rows(self.linear, self._base_rows(rows))

        def _base_rows(self, rows):
            """``rows`` of this view as rows of the base cache's storage."""
            index = linear_state.row_index(rows, self.lengths.device)
            if isinstance(index, slice):
                start, stop, _ = index.indices(self.slots)
                return slice(self.first + start, self.first + stop)
            return index + self.first

        def copy_row(self, src: int, dst: int, length: int | None = None) -> None:
            """Row ``dst`` becomes a copy of row ``src`` (K, V, length and linear-attention state); ``length``: copy
            only that many positions (the row's length read on the host when None: positions past it are never
            read)."""
            n = int(self.lengths[0, src]) if length is None else int(length)
            for layer in self.kv_layers():
                if layer.is_initialized:
                    layer.keys[dst, :, :n].copy_(layer.keys[src, :, :n])
                    layer.values[dst, :, :n].copy_(layer.values[src, :, :n])
                index = layer.indexer_buffer()
                if index is not None:
                    index[dst, :n].copy_(index[src, :n])
            self.lengths[:, dst].copy_(self.lengths[:, src])
            if self.linear is not None:
                linear_state.copy_rows(self.linear, self.first + src, self.first + dst)

        def export_row(self, row: int, start: int = 0, end: int | None = None) -> list:
            """[(K [H, n, Dk], V [H, n, Dv]) per K/V layer] of positions [start, end) of ``row`` (copies). A hybrid
            model's linear-attention state is not positions: ``export_state`` copies it, at the row's length."""
            end = int(self.lengths[0, row]) if end is None else end
            return [(layer.keys[row, :, start:end].clone(), layer.values[row, :, start:end].clone())
                    for layer in self.kv_layers()]

        def export_index_keys(self, row: int, start: int, end: int) -> list:
            """[indexer keys [n, D] (a copy) or None per K/V layer] of positions [start, end) of ``row``: DeepSeek
            Sparse Attention's lightning-indexer keys, which a prefix cache stores beside the block's K/V."""
            out = []
            for layer in self.kv_layers():
                index = layer.indexer_buffer()
                out.append(None if index is None else index[row, start:end].clone())
            return out

        def import_index_keys(self, row: int, keys: list, start: int = 0) -> None:
            """Write ``export_index_keys``' blocks (None: the layer has none) at positions ``start``.. of ``row``."""
            layers = self.kv_layers()
            if len(keys) != len(layers):
                raise ValueError(f"import_index_keys: {len(keys)} layers given, the cache has {len(layers)}")
            for layer, k in zip(layers, keys):
                if k is not None:
                    layer.ensure_indexer_buffer(k)[row, start:start + k.shape[0]].copy_(k)

        def import_row(self, row: int, kv: list, start: int = 0) -> None:
            """Write ``export_row``'s blocks at positions ``start``.. of ``row``; its length becomes their end."""
            layers = self.kv_layers()
            if len(kv) != len(layers):
                raise ValueError(f"import_row: {len(kv)} layers given, the cache has {len(layers)}")
            end = start + kv[0][0].shape[1]
            if end > self.max_len:
                raise ValueError(f"import_row: positions up to {end} do not fit a cache of {self.max_len}")
            for layer, (k, v) in zip(layers, kv):
                if not layer.is_initialized:
                    layer.lazy_initialization(k[None], v[None])
                layer.keys[row, :, start:end].copy_(k)
                layer.values[row, :, start:end].copy_(v)
            self.lengths[:, row] = end

        def export_state(self, row: int) -> dict:
            """A hybrid model's linear-attention state of ``row`` (conv windows and recurrent matrices: what its
            tokens so far left, at the row's length), as named copies; {} for other models."""
            if self.linear is None:
                return {}
            saved = linear_state.save_rows(self.linear, self.first + row, self.first + row + 1)
            return {f"{kind}.{layer}": t[0] for (kind, layer), t in saved.items()}

        def import_state(self, row: int, state: dict) -> None:
            """``export_state``'s tensors back into ``row`` (every allocated buffer must be given)."""
            if self.linear is None:
                return
            saved = {}
            for key in state:
                kind, _, layer = key.partition(".")
                saved[(kind, int(layer))] = state[key][None]
            missing = [k for k in linear_state.buffer_keys(self.linear) if k not in saved]
            if missing:
                raise ValueError(f"import_state: no state given for {missing[:3]}")
            saved = {k: v.to(self.lengths.device) for k, v in saved.items()}
            for (kind, layer), t in saved.items():
                linear_state.ensure_allocated(self.linear, kind, layer, t)
            linear_state.restore_rows(self.linear, self.first + row, self.first + row + 1, saved)

        def save_step_state(self):
            """What a forward of these rows changes besides K/V past their lengths: the lengths and the
            linear-attention state (a capture's warm-up steps put it back with ``restore_step_state``)."""
            linear = None if self.linear is None else linear_state.save_rows(self.linear, self.first,
                                                                              self.first + self.slots)
            return self.lengths.clone(), linear

        def restore_step_state(self, saved) -> None:
            lengths, linear = saved
            self.lengths.copy_(lengths)
            if linear is not None:
                linear_state.restore_rows(self.linear, self.first, self.first + self.slots, linear)

    return KVLayer, KVCache


def new(config, slots: int, max_len: int, device) -> "KVCache":
    """A KVCache of ``slots`` rows x ``max_len`` tokens for a model of ``config`` (K/V allocated on first write)."""
    return _classes()[1].new(config, slots, max_len, torch.device(device))


def is_kv_cache(obj) -> bool:
    return _CLASSES is not None and isinstance(obj, _CLASSES[1])


def decode_slots(cache, layer_idx: int, B: int, like: torch.Tensor):
    """(K [B, H, L, D], V [B, H, L, D], lengths [B] int64) of rows 0..B-1 of a KVCache layer, for a kernel that
    writes a decode step's k/v at each row's length and advances the lengths itself (operators/kernels/attention.py);
    None (use ``cache.update``) for other caches, a layer not allocated yet, or K/V not of ``like``'s dtype and
    device."""
    if not is_kv_cache(cache) or not 0 <= layer_idx < len(cache.layers):
        return None
    layer = cache.layers[layer_idx]
    if linear_state.is_linear_layer(layer) or not layer.is_initialized or layer.keys.dtype != like.dtype or (
            layer.keys.device != like.device or layer.values.dtype != like.dtype or B > layer.keys.shape[0]):
        return None
    return layer.keys[:B], layer.values[:B], layer.row_lengths[:B]


# ---- masks ---------------------------------------------------------------------------------------------------
def mask_layout(config) -> tuple[bool, int | None, int | None]:
    """(the model takes a dict of masks per layer type, its full layers' window, its sliding layers' window).

    Models with ``layer_types`` naming sliding layers (gpt-oss, Qwen2-MoE) take {"full_attention": ...,
    "sliding_attention": ...}, hybrid ones (Qwen3-Next, Qwen3.5) {"full_attention": ..., "linear_attention": ...},
    Llama 4 {"full_attention": ..., "chunked_attention": ...};
    the others one mask, windowed when the config has a sliding window (Mixtral, Qwen3 with use_sliding_window: HF
    then builds its mask with create_sliding_window_causal_mask)."""
    config = linear_state.text_config(config)
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None) or ()
    if "sliding_attention" in types:
        return True, None, window
    return linear_state.LINEAR in types or "chunked_attention" in types, window, window


def linear_attention_mask(lengths: torch.Tensor, S: int, pad2d: torch.Tensor | None) -> torch.Tensor | None:
    """The linear-attention layers' mask of a forward of S tokens per row after ``lengths`` [B]: [B, S] bool, False
    where ``pad2d`` (as in ``attention_masks``) marks the token at that row's position as padding (HF zeroes those
    tokens' inputs: a left-padded row's state stays zero until its first token). None for one-token steps (a
    generated token is never padding) and without ``pad2d``, as HF's create_recurrent_attention_mask."""
    if pad2d is None or S == 1:
        return None
    dev = lengths.device
    pad = pad2d.to(device=dev, dtype=torch.bool)
    pos = lengths[:, None] + torch.arange(S, device=dev)  # [B, S]: each token's own position
    inside = pos < pad.shape[1]
    return torch.where(inside, pad.gather(1, pos.clamp(max=pad.shape[1] - 1)), True)


def attention_masks(config, lengths: torch.Tensor, S: int, L: int, pad2d: torch.Tensor | None = None,
                    float_dtype: torch.dtype | None = None):
    """The masks of a forward of S tokens per row on rows whose lengths before it are ``lengths`` [B]: [B, 1, S, L],
    True (or 0.0) where query s of row b may see key j: j <= lengths[b] + s, within the window for sliding layers,
    in the query's chunk of ``attention_chunk_size`` positions for chunked layers (Llama 4: chunks counted from the
    row's first real token, as Hugging Face's create_chunked_causal_mask counts them), and ``pad2d`` [B, n <= L] (1 = real token; positions past n count as real) allows j. Bool masks, or additive
    float masks of ``float_dtype`` (eager attention). A dict per layer type where the model takes one (its
    "linear_attention" entry: ``linear_attention_mask``)."""
    takes_dict, full_window, sliding_window = mask_layout(config)
    B, dev = lengths.shape[0], lengths.device
    j = torch.arange(L, device=dev)  # [L]
    q = lengths[:, None] + torch.arange(S, device=dev)  # [B, S]: each query's own position
    causal = j <= q[:, :, None]  # [B, S, L]
    if pad2d is not None:
        pad = pad2d.to(device=dev, dtype=torch.bool)[:, :L]
        if pad.shape[1] < L:
            pad = torch.nn.functional.pad(pad, (0, L - pad.shape[1]), value=True)
        causal = causal & pad[:, None, :]

    def finish(window, within=None):
        m = causal if window is None else causal & (j > q[:, :, None] - window)
        m = m if within is None else m & within
        m = m[:, None]  # [B, 1, S, L]
        if float_dtype is None:
            return m
        return torch.where(m, torch.zeros((), dtype=float_dtype, device=dev),
                           torch.full((), torch.finfo(float_dtype).min, dtype=float_dtype, device=dev))

    if not takes_dict:
        return finish(full_window)
    types = getattr(linear_state.text_config(config), "layer_types", None) or ()
    if linear_state.LINEAR in types:
        return {"full_attention": finish(full_window), linear_state.LINEAR: linear_attention_mask(lengths, S, pad2d)}
    if "chunked_attention" in types:
        return {"full_attention": finish(full_window), "chunked_attention": finish(None, _chunks(
            linear_state.text_config(config), lengths, j, q, pad2d))}
    return {"full_attention": finish(full_window), "sliding_attention": finish(sliding_window)}


def _chunks(config, lengths: torch.Tensor, j: torch.Tensor, q: torch.Tensor,
            pad2d: torch.Tensor | None) -> torch.Tensor:
    """[B, S, L]: key j in query q's chunk of the config's ``attention_chunk_size``, chunks counted from each row's
    first real token (its left padding: the leading zeros of ``pad2d``)."""
    size = int(config.attention_chunk_size)
    lead = torch.zeros_like(lengths)
    if pad2d is not None:
        real = pad2d.to(device=lengths.device, dtype=torch.bool)
        lead = (~real).to(torch.int64).cumprod(1).sum(1)  # [B]
    lead = lead[:, None, None]
    return (j - lead).div(size, rounding_mode="floor") == (q[:, :, None] - lead).div(size, rounding_mode="floor")


def mask_float_dtype(model) -> torch.dtype | None:
    """None (bool masks) for SDPA-style attention, the model's dtype for eager attention's additive masks."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == "eager":
        return next(p.dtype for p in model.parameters() if p.is_floating_point())
    return None


def forward(model, cache, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
            pad2d: torch.Tensor | None = None, **kwargs):
    """``model(input_ids, ...)`` on ``cache`` (rows 0..B-1 of it) with this step's masks built from the rows'
    lengths: rows at different positions in one forward. ``position_ids`` default: the rows' lengths onward (no
    padding). Returns the model's output."""
    B, S = input_ids.shape
    lengths = cache.row_lengths[:B]
    if position_ids is None:
        position_ids = lengths[:, None] + torch.arange(S, device=lengths.device)
    masks = attention_masks(model.config, lengths, S, cache.max_len, pad2d, mask_float_dtype(model))
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=masks, use_cache=True,
                 **compat.cache_arg(cache), **kwargs)
