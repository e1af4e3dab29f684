"""Hugging Face checkpoint keys -> model tensors, and routed-expert slices -> native expert matrices.

``map_checkpoint`` maps each key of a reader's tensors to a model tensor with transformers' own conversion rules
(``get_model_conversion_mapping`` + ``rename_source_key``): per-expert keys (``...experts.7.gate_proj.weight``,
Mixtral ``block_sparse_moe.experts.7.w1``) name the fused experts tensor, an expert and a part (gate/up). It checks,
before a byte of data is read, that the checkpoint covers the model exactly (unexpected / missing keys, shapes,
dtypes). ``expert_matrices`` cuts one expert's slice of a fused tensor into the matrices native experts take.
Format-independent: a reader only says which torch dtype a tensor's bytes hold. Legend: E experts, H hidden,
I expert intermediate.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ktinject.injection.formats.base import LoadError, Reader, TensorRef

log = logging.getLogger(__name__)

# checkpoint keys transformers itself ignores when they have no place in the model (old rotary tables)
_ALWAYS_IGNORED = (re.compile(r"rotary_emb\.inv_freq"),)


@dataclass
class Piece:
    """Where one checkpoint tensor goes: model tensor ``target`` (the fused experts tensor for expert pieces)."""

    ref: TensorRef
    target: str
    meta: torch.Tensor  # the model's (meta) tensor it fills
    unit: str | None = None  # operator entry owning the target
    expert_leaf: str | None = None  # gate_up_proj, ... when it goes to native experts
    expert: int | None = None  # per-expert checkpoint tensor: its expert (None: the tensor holds all experts)
    part: int = 0  # per-expert tensor fused by concatenation: which part (0 gate, 1 up) of how many
    parts: int = 1
    converted: "Converted | None" = None  # a non-expert tensor transformers converts into several targets


@dataclass
class Converted:
    """A non-expert checkpoint tensor that transformers converts (e.g. a fused ``wqkv`` chunked into q / k / v and
    permuted for rope): its converter and the model tensors it fills, by name."""

    converter: object  # a transformers WeightConverter
    pattern: str  # the source pattern it matched
    targets: dict[str, torch.Tensor]  # target name -> the model's (meta) tensor


class _KeyMapper:
    """Checkpoint key -> (model tensor name, converter or None, matched source pattern) as transformers does it."""

    def __init__(self, model: nn.Module, state: dict[str, torch.Tensor]):
        self.state, self.prefix = state, getattr(model, "base_model_prefix", None)
        self.renamings, self.converters, self._rename = [], [], None
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

            transforms = get_model_conversion_mapping(model)
        except Exception as e:  # noqa: BLE001 - private API of transformers: degrade to plain names
            log.warning("transformers' checkpoint conversion rules are unavailable (%s); using keys as they are", e)
            return
        self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._rename = rename_source_key

    def __call__(self, key: str):
        if self._rename is None:
            return key, None, None
        target, pattern = self._rename(key, self.renamings, self.converters, self.prefix, self.state)
        if target not in self.state and key in self.state:
            return key, None, None
        if pattern is None:
            return target, None, None
        conv = next(c for c in self.converters if pattern in c.source_patterns)
        return target, conv, pattern

    def expert_number(self, key: str, pattern: str) -> int | None:
        renamed = key
        for r in self.renamings:
            renamed, _ = r.rename_source_key(renamed)
        # transformers' source patterns are regexes whose "*" stands for the expert number (DeepSeek-V4 writes
        # r"\.experts.*.w2.weight", the others plain names such as "mlp.experts.*.down_proj.weight")
        m = re.search(pattern.replace("*", r"(?P<expert>\d+)", 1).replace("*", r"\d+"), renamed)
        return int(m.group("expert")) if m else None


def map_checkpoint(model: nn.Module, ckpt: Reader, is_expert: Callable[[str], tuple[str, str] | None],
                   unit_of: Callable[[str], str | None]) -> list[Piece]:
    """Every checkpoint tensor as a Piece, in file order, after checking the checkpoint covers the model exactly:
    LoadError for an unexpected key, a shape or dtype mismatch, a duplicate, or a model tensor nobody fills."""
    state = model.state_dict(keep_vars=True)  # includes tied aliases (same tensor under two names)
    mapper = _KeyMapper(model, state)
    ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    ignored += _ALWAYS_IGNORED
    filled: dict[int, str] = {}  # id(tensor) -> checkpoint key (plain tensors)
    coverage: dict[str, set] = {}  # expert target -> {(expert, part, parts)} or {"all"}
    pieces = []
    for ref in ckpt.refs:
        target, conv, pattern = mapper(ref.key)
        if target not in state:
            if any(rx.search(ref.key) for rx in ignored):
                log.debug("checkpoint tensor %s ignored (the model has no place for it)", ref.key)
                continue
            via = f" (transformers maps it to {target!r})" if target != ref.key else ""
            raise LoadError(f"unexpected tensor {ref.key!r} in {ref.file}: {type(model).__name__} has no such "
                            f"parameter or buffer{via}")
        meta = state[target]
        _check_dtype(ref, ckpt.torch_dtype(ref), meta, target)
        ex = is_expert(target)
        piece = Piece(ref, target, meta, unit_of(target), ex[1] if ex else None)
        if conv is not None and ex is None and len(conv.source_patterns) == 1:
            piece.converted = _converted(ref, target, conv, pattern, state)
            for name, t in piece.converted.targets.items():
                filled[id(t)] = ref.key
        elif conv is not None:
            _per_expert(piece, conv, pattern, mapper, coverage)
        elif tuple(ref.shape) != tuple(meta.shape):
            raise _shape_error(ref, target, tuple(meta.shape))
        elif ex is not None:
            _cover(coverage, piece, "all")
        elif id(meta) in filled:
            log.debug("checkpoint tensor %s skipped: %s (tied) already comes from %s", ref.key, target,
                      filled[id(meta)])
            continue
        else:
            filled[id(meta)] = ref.key
        pieces.append(piece)
    _check_missing(state, filled, coverage, is_expert, ckpt)
    return pieces


def _check_dtype(ref: TensorRef, dtype: torch.dtype | None, meta: torch.Tensor, target: str) -> None:
    """``dtype``: what the reader says the bytes of ``ref`` hold (None: a dtype it cannot read)."""
    if dtype is None:
        raise LoadError(f"tensor {ref.key!r} in {ref.file} has dtype {ref.dtype}, which ktinject cannot read: "
                        f"it reads float32 / bf16 / fp16 tensors, FP8 with block scales (weight_scale_inv), "
                        f"compressed-tensors pack-quantized int4 / int8 and MXFP4 (*_blocks + *_scales)")
    if meta.is_floating_point() != dtype.is_floating_point or (not meta.is_floating_point() and dtype != meta.dtype):
        raise LoadError(f"tensor {ref.key!r} in {ref.file} is {ref.dtype} but {target!r} is {meta.dtype} "
                        f"(a quantized tensor without the parts its format needs beside it, e.g. its scales?)")


def _shape_error(ref: TensorRef, target: str, want: tuple) -> LoadError:
    return LoadError(f"tensor {ref.key!r} in {ref.file} has shape {list(ref.shape)}, {target!r} needs "
                     f"{list(want)} (a checkpoint of another configuration?)")


def _converted(ref: TensorRef, target: str, conv, pattern: str, state: dict) -> Converted:
    """The model tensors a one-source conversion of ``ref`` fills: ``target`` (named after the converter's first
    target pattern) with that pattern replaced by each of them; LoadError if one is not in the model."""
    first = conv.target_patterns[0]
    if first not in target:
        raise LoadError(f"tensor {ref.key!r} in {ref.file}: transformers converts it to {target!r}, which does not "
                        f"hold its target pattern {first!r}; this conversion is not supported by streaming loading "
                        f"(load with transformers and inject instead)")
    names = [target.replace(first, t, 1) for t in conv.target_patterns]
    missing = [n for n in names if n not in state]
    if missing:
        raise LoadError(f"tensor {ref.key!r} in {ref.file}: transformers converts it to {', '.join(names)}, but the "
                        f"model has no {', '.join(missing)} (a checkpoint of another model?)")
    return Converted(conv, pattern, {n: state[n] for n in names})


def convert_tensor(piece: Piece, value: torch.Tensor, model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(model meta tensor, its value) for each target of ``piece.converted``, running transformers' own
    conversion operations on the read ``value`` as its loader does (chunks, rope permutations, ...); every value's
    shape checked against its target."""
    conv = piece.converted
    first = next(iter(conv.targets))
    tensors = {conv.pattern: [value]}
    try:
        for op in conv.converter.operations:
            tensors = op.convert(tensors, source_patterns=conv.converter.source_patterns,
                                 target_patterns=conv.converter.target_patterns, full_layer_name=first, model=model,
                                 config=model.config, missing_keys=None)
    except Exception as e:  # noqa: BLE001 - transformers' private conversion API: any failure is a load error
        raise LoadError(f"tensor {piece.ref.key!r} in {piece.ref.file}: transformers' conversion "
                        f"({', '.join(type(op).__name__ for op in conv.converter.operations)}) failed: {e}") from e
    pattern0 = conv.converter.target_patterns[0]
    prefix, _, suffix = first.partition(pattern0)
    out = []
    for pattern, t in tensors.items():
        name = prefix + pattern + suffix
        t = t[0] if isinstance(t, list) else t
        meta = conv.targets.get(name)
        if meta is None:
            raise LoadError(f"tensor {piece.ref.key!r}: transformers' conversion gave {name!r}, which is not "
                            f"one of {', '.join(conv.targets)}")
        if tuple(t.shape) != tuple(meta.shape):
            raise _shape_error(piece.ref, name, tuple(meta.shape))
        out.append((meta, t))
    if len(out) != len(conv.targets):
        raise LoadError(f"tensor {piece.ref.key!r}: transformers' conversion gave {len(out)} tensors, the model "
                        f"needs {len(conv.targets)} ({', '.join(conv.targets)})")
    return out


def _per_expert(piece: Piece, conv, pattern: str, mapper: _KeyMapper, coverage: dict) -> None:
    """Fill expert/part of a per-expert checkpoint tensor that transformers fuses (MergeModulelist [+ Concatenate])."""
    ref, meta = piece.ref, piece.meta
    ops = [type(op).__name__ for op in conv.operations]
    if piece.expert_leaf is None:
        raise LoadError(f"tensor {ref.key!r} in {ref.file}: transformers fuses it into {piece.target!r}, which "
                        f"is not the routed experts of a 'moe' operator; streaming can only fuse those (load with "
                        f"transformers and inject instead)")
    if ops not in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]) or \
            [getattr(op, "dim", None) for op in conv.operations] != [0, 1][:len(ops)]:
        raise LoadError(f"tensor {ref.key!r} in {ref.file}: its conversion ({', '.join(ops)}) is not supported "
                        f"by streaming loading")
    piece.parts = len(conv.source_patterns) if len(ops) == 2 else 1
    piece.part = conv.source_patterns.index(pattern)
    piece.expert = mapper.expert_number(ref.key, pattern)
    E, rows = meta.shape[0], meta.shape[1]
    want = (rows // piece.parts, *meta.shape[2:])
    if rows % piece.parts or tuple(ref.shape) != want:
        raise _shape_error(ref, f"{piece.target} (expert slice)", want)
    if piece.expert is None or not 0 <= piece.expert < E:
        raise LoadError(f"tensor {ref.key!r} in {ref.file}: expert number {piece.expert} is out of range for "
                        f"{piece.target!r} ({E} experts)")
    _cover(coverage, piece, (piece.expert, piece.part, piece.parts))


def _cover(coverage: dict, piece: Piece, what) -> None:
    have = coverage.setdefault(piece.target, set())
    if what in have or "all" in have or (what == "all" and have):
        raise LoadError(f"tensor {piece.ref.key!r} in {piece.ref.file}: {piece.target!r} is given twice")
    have.add(what)


def _check_missing(state, filled, coverage, is_expert, ckpt: Reader) -> None:
    missing, seen = [], set()
    for name, t in state.items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        if is_expert(name) is not None:
            have = coverage.get(name, set())
            parts = {p[2] for p in have if p != "all"}
            if "all" in have or (len(parts) == 1 and len(have) == t.shape[0] * parts.pop()):
                continue
        elif id(t) in filled:
            continue
        missing.append(name)
    if missing:
        raise LoadError(f"checkpoint {ckpt.dir} lacks {len(missing)} tensors the model needs, e.g. "
                        f"{', '.join(missing[:5])} (a checkpoint of another model or configuration?)")


def expert_matrices(spec, piece: Piece, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(which, tensor) for native experts from one expert's slice ``x`` of ``piece``: which is gate/up/down
    ([out, in] views, any strides) or gate_bias/up_bias/down_bias ([out], contiguous)."""
    leaf, I = piece.expert_leaf, spec.intermediate
    if spec.layout == "gpt_oss":  # gate_up [H, 2I] interleaved (even gate, odd up), down [I, H]
        if piece.parts != 1:
            raise LoadError(f"tensor {piece.ref.key!r}: per-part gpt-oss expert tensors are not supported")
        if leaf == "gate_up_proj":
            return [("gate", x[:, 0::2].t()), ("up", x[:, 1::2].t())]
        if leaf == "gate_up_proj_bias":
            return [("gate_bias", x[0::2].contiguous()), ("up_bias", x[1::2].contiguous())]
        if leaf == "down_proj":
            return [("down", x.t())]
        return [("down_bias", x.contiguous())]
    if spec.layout == "llama4":  # gate_up [H, 2I]: gate columns, then up; down [I, H]
        if piece.parts != 1:
            raise LoadError(f"tensor {piece.ref.key!r}: per-part Llama 4 expert tensors are not supported")
        if leaf == "gate_up_proj":
            return [("gate", x[:, :I].t()), ("up", x[:, I:].t())]
        if leaf == "down_proj":
            return [("down", x.t())]
        raise LoadError(f"tensor {piece.ref.key!r}: Llama 4 experts have no {leaf}")
    if leaf == "gate_up_proj":  # [2I, H]: gate rows, then up rows; a part holds one of them
        if piece.parts == 2:
            return [("gate" if piece.part == 0 else "up", x)]
        if piece.parts == 1:
            return [("gate", x[:I]), ("up", x[I:])]
    elif leaf == "down_proj" and piece.parts == 1:  # [H, I]
        return [("down", x)]
    raise LoadError(f"tensor {piece.ref.key!r}: {leaf} in {piece.parts} parts does not fit the native experts")


def check_expert_piece(spec, piece: Piece) -> None:
    """LoadError now (not halfway through loading) if ``piece`` does not give native experts whole matrices."""
    shape = piece.ref.shape[1:] if piece.expert is None else piece.ref.shape
    H, I = spec.hidden, spec.intermediate
    want = {"gate": (I, H), "up": (I, H), "down": (H, I), "gate_bias": (I,), "up_bias": (I,), "down_bias": (H,)}
    for which, w in expert_matrices(spec, piece, torch.empty(shape, device="meta")):
        if tuple(w.shape) != want[which]:
            raise LoadError(f"tensor {piece.ref.key!r} in {piece.ref.file}: its {which} slice is "
                            f"{list(w.shape)}, native experts of {piece.unit!r} need {list(want[which])}")
