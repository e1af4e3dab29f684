"""The linear-attention layers' decode state in ktinject's KVCache: the gated-DeltaNet layers of Qwen3-Next and
Qwen3.5-MoE (``config.layer_types`` "linear_attention"), per layer and row, at fixed addresses.

Per linear-attention layer: ``conv`` [N, C, K], the causal convolution's window (the last K inputs of its C channels,
in the model's dtype; C = 2 * Hk * Dk + Hv * Dv, K = ``linear_conv_kernel_dim``), and ``recurrent`` [N, Hv, Dk, Dv],
the delta rule's matrix per value head (float32, as Hugging Face's rule keeps it). A layer's two buffers are
allocated once, on its first write, for every row of the cache (dtype and device from the written tensors, the
shapes checked against the config); every later write is an in-place copy into them, so a captured decode step
reads and writes the same addresses and binds no new tensor to the cache.

A row that holds no tokens holds zero state, and zero state is what Hugging Face's module starts a prompt from (a
zero-padded convolution, no initial recurrent matrix): so once a layer's buffers exist its cache layer always "has
previous state", and a forward of rows at any mix of positions, fresh rows among them, takes one branch of HF's
forward: prefill chunks concatenate the row's window before the new inputs (``write_conv``), decode steps update
the window in place (HF's ``causal_conv1d_update``) and the matrix through ``write_recurrent``.

``LinearLayer`` is the cache layer at a linear-attention index (a subclass of HF's ``LinearAttentionCacheLayerMixin``,
defined on first use): what HF's module reads, in both supported releases (5.17: ``layers[i].conv_states[0]``,
``.recurrent_states[0]``, ``.record_past`` and ``Cache.has_previous_state``; 5.24: ``Cache.get_conv_state`` /
``get_recurrent_state`` / ``is_recording_past``, which read the same attributes; both: ``update_conv_state`` and
``update_recurrent_state``). It holds no K/V and no length: positions are the full-attention layers' business.

Row operations are free functions of (state, rows), queued on the device without a host sync where the rows are
an int or a slice: ``reset_rows`` (a new request's row starts from zero), ``copy_rows`` (compaction: the scheduler
moves rows), ``save_rows`` / ``restore_rows`` (a capture's warm-up steps put the state back).
Legend: N rows (slots), C conv channels, K conv kernel, Hk / Hv key / value heads, Dk / Dv their head dims,
B rows of a forward, S new tokens per row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LINEAR = "linear_attention"
_FIELDS = ("linear_conv_kernel_dim", "linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads",
           "linear_value_head_dim")


@dataclass(frozen=True)
class LinearLayout:
    """Which layers are linear attention and the shapes of their state (from the text config)."""
    layers: tuple[int, ...]  # indices of the linear-attention layers
    kernel: int  # K
    conv_dim: int  # C
    v_heads: int  # Hv
    k_dim: int  # Dk
    v_dim: int  # Dv

    def conv_shape(self, rows: int) -> tuple[int, ...]:
        return (rows, self.conv_dim, self.kernel)

    def recurrent_shape(self, rows: int) -> tuple[int, ...]:
        return (rows, self.v_heads, self.k_dim, self.v_dim)


def text_config(config):
    """The decoder's config (an image-text wrapper's text_config)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def layout_of(config) -> LinearLayout | None:
    """The linear-attention layout of a model of ``config``, or None when no layer is linear attention."""
    text = text_config(config)
    types = list(getattr(text, "layer_types", None) or ())
    layers = tuple(i for i, t in enumerate(types) if t == LINEAR)
    if not layers:
        return None
    missing = [f for f in _FIELDS if getattr(text, f, None) is None]
    if missing:
        raise ValueError(f"{type(text).__name__} names linear_attention layers but has no {', '.join(missing)}: "
                         f"the KVCache cannot size their conv and recurrent states")
    kernel, hk, dk, hv, dv = (int(getattr(text, f)) for f in _FIELDS)
    return LinearLayout(layers, kernel, 2 * hk * dk + hv * dv, hv, dk, dv)


class LinearAttentionState:
    """The conv and recurrent buffers of every linear-attention layer for ``slots`` rows (see the module docstring);
    ``conv`` / ``recurrent``: layer index -> [N, C, K] / [N, Hv, Dk, Dv], present once the layer was written."""

    def __init__(self, layout: LinearLayout, slots: int):
        self.layout, self.slots = layout, slots
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}

    def allocated(self, layer: int) -> bool:
        return layer in self.conv and layer in self.recurrent

    def tensors(self) -> list[torch.Tensor]:
        return [*self.conv.values(), *self.recurrent.values()]

    def _check(self, layer: int, what: str, got: tuple, want: tuple) -> None:
        if layer not in self.layout.layers:
            raise ValueError(f"layer {layer} is not a linear-attention layer (those are {list(self.layout.layers)})")
        if tuple(got) != tuple(want):
            raise ValueError(f"layer {layer}'s {what} state has shape {tuple(got)}, the config says {tuple(want)} "
                             f"(linear_* fields of the text config)")

    def _allocate_conv(self, layer: int, like: torch.Tensor) -> None:
        """Check a write's conv inputs [B, C, ...] against the layout; allocate the layer's windows on its first."""
        self._check(layer, "conv", like.shape[1:2], (self.layout.conv_dim,))
        if layer not in self.conv:
            self.conv[layer] = torch.zeros(self.layout.conv_shape(self.slots), dtype=like.dtype, device=like.device)

    def _allocate_recurrent(self, layer: int, like: torch.Tensor) -> None:
        self._check(layer, "recurrent", like.shape[1:], self.layout.recurrent_shape(1)[1:])
        if layer not in self.recurrent:
            self.recurrent[layer] = torch.zeros(self.layout.recurrent_shape(self.slots), dtype=like.dtype,
                                                device=like.device)

    def conv_rows(self, layer: int, a: int, b: int) -> torch.Tensor | None:
        """conv [b - a, C, K] of rows a..b-1 (a view), or None before the layer's first write."""
        return self.conv[layer][a:b] if self.allocated(layer) else None

    def recurrent_rows(self, layer: int, a: int, b: int) -> torch.Tensor | None:
        return self.recurrent[layer][a:b] if self.allocated(layer) else None

    def write_conv(self, layer: int, first: int, x: torch.Tensor, kernel: int | None = None) -> torch.Tensor:
        """A prefill chunk's conv inputs x [B, C, S] of rows first..first+B-1: [their windows, x] [B, C, K + S] (what
        HF's causal_conv1d_fn then convolves, keeping the last S outputs); the windows become its last K inputs."""
        if kernel is not None and int(kernel) != self.layout.kernel:
            raise ValueError(f"layer {layer}: a conv kernel of {kernel}, the config says {self.layout.kernel}")
        self._allocate_conv(layer, x)
        window = self.conv[layer][first:first + x.shape[0]]  # [B, C, K]
        full = torch.cat([window.to(x.dtype), x], dim=-1)  # [B, C, K + S]
        window.copy_(full[..., -self.layout.kernel:])
        return full

    def write_recurrent(self, layer: int, first: int, state: torch.Tensor) -> torch.Tensor:
        """The matrices [B, Hv, Dk, Dv] after a forward of rows first..first+B-1, copied in place; their view."""
        self._allocate_recurrent(layer, state)
        rows = self.recurrent[layer][first:first + state.shape[0]]
        rows.copy_(state)
        return rows

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


# ---- row operations --------------------------------------------------------------------------------------------
def row_index(rows, device):
    """An int, a slice or a range of step 1 as a slice (no host sync); anything else as an int64 index tensor on
    ``device``."""
    if isinstance(rows, int):
        return slice(rows, rows + 1)
    if isinstance(rows, slice):
        return rows
    if isinstance(rows, range) and rows.step == 1:
        return slice(rows.start, rows.stop)
    return torch.as_tensor(rows, dtype=torch.int64, device=device)


def reset_rows(state: LinearAttentionState, rows, layers=None) -> None:
    """Zero the conv and recurrent state of ``rows`` (an int, a slice or row indices) in ``layers`` (default: all)."""
    for layer, t in [*state.conv.items(), *state.recurrent.items()]:
        if layers is None or layer in layers:
            t[row_index(rows, t.device)] = 0


def copy_rows(state: LinearAttentionState, src, dst) -> None:
    """Rows ``dst`` take the state of rows ``src`` (ints, slices or index sequences of one length; an overlap reads
    the old values)."""
    for t in state.tensors():
        s, d = row_index(src, t.device), row_index(dst, t.device)
        t[d] = t[s].clone()


def _buffers(state: LinearAttentionState) -> dict:
    """(kind, layer) -> buffer, for every allocated buffer."""
    conv = {("conv", layer): t for layer, t in state.conv.items()}
    return {**conv, **{("recurrent", layer): t for layer, t in state.recurrent.items()}}


def buffer_keys(state: LinearAttentionState) -> list:
    """(kind, layer) of every allocated buffer."""
    return list(_buffers(state))


def ensure_allocated(state: LinearAttentionState, kind: str, layer: int, like: torch.Tensor) -> None:
    """Allocate ``layer``'s ``kind`` ("conv" or "recurrent") buffer for every row if it is not yet, shaped and typed
    as ``like`` [1, ...] (a saved row): a restore into a cache no forward has written yet."""
    table = state.conv if kind == "conv" else state.recurrent
    if kind not in ("conv", "recurrent"):
        raise ValueError(f"linear-attention state kind {kind!r}: expected conv or recurrent")
    if layer not in table:
        want = state.layout.conv_shape(1) if kind == "conv" else state.layout.recurrent_shape(1)
        state._check(layer, kind, like.shape[1:], want[1:])
        table[layer] = torch.zeros((state.slots, *like.shape[1:]), dtype=like.dtype, device=like.device)


def save_rows(state: LinearAttentionState, a: int, b: int) -> dict:
    """Copies of rows a..b-1 of every buffer, for ``restore_rows``."""
    return {key: t[a:b].clone() for key, t in _buffers(state).items()}


def restore_rows(state: LinearAttentionState, a: int, b: int, saved: dict) -> None:
    """Put rows a..b-1 back as ``save_rows`` found them (a buffer allocated since then: back to zero)."""
    for key, t in _buffers(state).items():
        if key in saved:
            t[a:b].copy_(saved[key])
        else:
            t[a:b].zero_()


# ---- the cache layer HF's module talks to ----------------------------------------------------------------------
_LAYER = None


def layer_class():
    """``LinearLayer``, defined on first use against the installed transformers (nothing at import)."""
    global _LAYER
    if _LAYER is None:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin

        _LAYER = _define(LinearAttentionCacheLayerMixin)
    return _LAYER


def _define(Mixin):  # noqa: C901 - one small class defined against the installed transformers
    class LinearLayer(Mixin):
        """Rows first..end-1 of one linear-attention layer of a ``LinearAttentionState`` (the mixin's per-state dicts
        are views of the state's buffers, so its ``__init__`` is not called)."""

        supports_early_init = False
        is_compileable = True  # fixed addresses, no recording of the past
        is_sliding = False
        record_past = False

        def __init__(self, state: LinearAttentionState, layer_idx: int, first: int, end: int):
            self.state, self.layer_idx, self.first, self.end = state, layer_idx, first, end
            self.number_of_states = 1
            self.conv_kernel_size = {0: state.layout.kernel}
            self.device = self.dtype = None

        def __repr__(self):
            return f"LinearLayer(layer {self.layer_idx}, rows {self.first}..{self.end - 1})"

        @staticmethod
        def _one(state_idx: int) -> None:
            if state_idx != 0:
                raise ValueError(f"a gated-DeltaNet layer keeps one conv and one recurrent state, not {state_idx + 1}")

        @property
        def conv_states(self) -> dict:
            return {0: self.state.conv_rows(self.layer_idx, self.first, self.end)}

        @property
        def recurrent_states(self) -> dict:
            return {0: self.state.recurrent_rows(self.layer_idx, self.first, self.end)}

        @property
        def has_previous_state(self) -> dict:
            return {0: self.state.allocated(self.layer_idx)}

        @property
        def is_initialized(self) -> bool:
            return self.state.allocated(self.layer_idx)

        def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0, **kwargs):
            self._one(state_idx)
            if conv_states is not None:
                self.state._allocate_conv(self.layer_idx, conv_states)
            if recurrent_states is not None:
                self.state._allocate_recurrent(self.layer_idx, recurrent_states)

        def update_conv_state(self, conv_states, state_idx: int = 0, conv_kernel_size=None, **kwargs):
            self._one(state_idx)
            return self.state.write_conv(self.layer_idx, self.first, conv_states, conv_kernel_size)

        def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs):
            self._one(state_idx)
            return self.state.write_recurrent(self.layer_idx, self.first, recurrent_states)

        def reset(self) -> None:
            reset_rows(self.state, slice(self.first, self.end), layers=(self.layer_idx,))

        def reorder_cache(self, beam_idx) -> None:
            raise ValueError("ktinject's KVCache does not reorder rows for beam search (its generate hands beam "
                             "search to Hugging Face's own cache)")

        @property
        def is_croppable(self) -> bool:
            return False

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove:
                raise ValueError("a linear-attention state cannot be cropped: its recurrent matrix holds every "
                                 "position it has seen")

        def activate_past_recording(self) -> None:
            raise ValueError("ktinject's linear-attention state keeps fixed addresses and records no past states")

        def offload(self) -> None:
            pass

        def prefetch(self) -> None:
            pass

        def get_max_length(self) -> int:
            return -1

        def get_seq_length(self) -> int:
            raise ValueError(f"layer {self.layer_idx} is linear attention: it holds no positions (the cache's "
                             f"full-attention layers do)")

    return LinearLayer


def is_linear_layer(layer) -> bool:
    return _LAYER is not None and isinstance(layer, _LAYER)
