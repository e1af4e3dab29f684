"""Reading a safetensors checkpoint for streaming loads: find the shards, check them, map their keys, read bytes.

``Checkpoint(dir)`` finds the shards (``model.safetensors.index.json`` or one ``model.safetensors``), parses every
header (names, dtypes, shapes, byte offsets; no data) and checks them: a missing shard, a key the index lists but
the shard lacks, a truncated or corrupted file are a LoadError naming the file and tensor. ``stream(jobs)`` reads
byte ranges with positional reads from a reader thread that stays at most a window of bytes ahead of the consumer.
No mmap: mapped pages of a shard would count as our resident memory while the file is open; the page cache does
not.

``map_checkpoint`` maps each checkpoint key to a model tensor with transformers' own conversion rules
(``get_model_conversion_mapping`` + ``rename_source_key``) and checks, before a byte of data is read, that the
checkpoint covers the model exactly (unexpected / missing keys, shapes, dtypes); ``check_quantization`` refuses
quantized checkpoints. Legend: E experts, H hidden, I expert intermediate.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

log = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_MAX_IO = 1 << 30  # bytes per pread call (Linux caps one call at ~2 GiB)

#: safetensors dtype names torch can hold; anything else (F8_*, packed 4-bit ...) is refused with a clear error
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}

_FLOATS = ("F64", "F32", "F16", "BF16")
# checkpoint keys transformers itself ignores when they have no place in the model (old rotary tables)
_ALWAYS_IGNORED = (re.compile(r"rotary_emb\.inv_freq"),)


class LoadError(ValueError):
    """A checkpoint cannot be loaded into the model; the message names the tensor and the file."""


def check_quantization(config, path) -> None:
    """LoadError for checkpoints quantized in a format ktinject cannot read yet (FP8, MXFP4, GPTQ, ...)."""
    qc = getattr(config, "quantization_config", None)
    if not qc:
        return
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    raise LoadError(f"{path}: the checkpoint is quantized (config.quantization_config, quant_method "
                    f"{method!r}); ktinject reads bf16/fp16/fp32 safetensors checkpoints only for now: use the "
                    f"unquantized release or dequantize it first")


# ---------------------------------------------------------------------------------------------- safetensors I/O


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header dict without ``__metadata__`` plus it under that key, byte offset where the data starts).

    Raises ValueError with the reason when the file is not a safetensors file or is shorter than its header says."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"file is {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            raise ValueError(f"header length {n} does not fit a {size}-byte file (corrupted or not safetensors)")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    data_start = 8 + n
    data_len = size - data_start
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            info["shape"] = [int(x) for x in info["shape"]]
            str(info["dtype"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"header entry of tensor {key!r} is malformed: {info!r}") from None
        if not 0 <= begin <= end <= data_len:
            raise ValueError(f"tensor {key!r} spans bytes {begin}..{end} of the data but the file holds only "
                             f"{data_len} data bytes (truncated?)")
    return header, data_start


def pread_into(fd: int, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor ``out`` with the bytes at ``offset`` of the open file ``fd``."""
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    done, total = 0, view.nbytes
    while done < total:
        n = os.preadv(fd, [view[done:done + _MAX_IO]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done} ({total - done} bytes missing)")
        done += n


# ---------------------------------------------------------------------------------------------- checkpoint


@dataclass(frozen=True)
class TensorRef:
    """One tensor of a shard: where its bytes are (absolute offset in ``file``)."""

    key: str
    file: Path
    dtype: str  # safetensors dtype name ("BF16", "F8_E4M3", ...)
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ReadJob:
    """A byte range to read and hand to the consumer with ``what`` (the caller's description of it)."""

    what: Any
    file: Path
    offset: int
    nbytes: int
    reuse: bool = False  # read into a BufferPool buffer (the consumer gives it back) instead of a new one


class BufferPool:
    """Free lists of uint8 buffers by size: reusing them spares the page faults of fresh memory (a few GB/s, a
    real share of loading time). Thread-safe; ``put`` a buffer back when its bytes are no longer needed. At most
    ``limit`` bytes are kept (None: no limit); a buffer that would pass it is dropped."""

    def __init__(self, limit: int | None = None):
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._kept, self.limit = 0, limit

    def get(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._kept -= nbytes
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def put(self, buf: torch.Tensor) -> None:
        with self._lock:
            if self.limit is None or self._kept + buf.numel() <= self.limit:
                self._free.setdefault(buf.numel(), []).append(buf)
                self._kept += buf.numel()


class Checkpoint:
    """The shards of a safetensors checkpoint and every tensor's place in them (headers only)."""

    def __init__(self, path: Path):
        path = Path(path)
        if path.is_file():
            self.dir, files, weight_map, index = path.parent, [path], None, None
        elif (path / _INDEX).is_file():
            index = path / _INDEX
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise LoadError(f"{index}: not a readable safetensors index ({e})") from None
            self.dir = path
            files = [path / f for f in dict.fromkeys(sorted(set(weight_map.values())))]
        elif (path / _SINGLE).is_file():
            self.dir, files, weight_map, index = path, [path / _SINGLE], None, None
        else:
            other = sorted(p.name for p in path.glob("*.bin")) if path.is_dir() else []
            hint = f" (found {', '.join(other[:3])}: only safetensors checkpoints are supported)" if other else ""
            raise LoadError(f"{path}: no {_INDEX} or {_SINGLE}{hint}")
        self.files, self.index = files, index
        self.refs: list[TensorRef] = []
        for f in files:
            self.refs.extend(self._read_shard(f, weight_map, index))
        if weight_map is not None:
            self._check_index(weight_map, index)

    def _read_shard(self, f: Path, weight_map, index) -> list[TensorRef]:
        if not f.is_file():
            keys = [k for k, v in (weight_map or {}).items() if v == f.name]
            raise LoadError(f"shard {f} is missing: {index} lists {len(keys)} tensors in it, e.g. "
                            f"{', '.join(keys[:3])}")
        try:
            header, start = read_header(f)
        except (OSError, ValueError) as e:
            raise LoadError(f"shard {f} is not a readable safetensors file: {e}") from None
        refs = []
        for key, info in header.items():
            if key == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            refs.append(TensorRef(key, f, info["dtype"], tuple(info["shape"]), start + begin, end - begin))
            dt = ST_DTYPES.get(info["dtype"])
            numel = 1
            for d in info["shape"]:
                numel *= d
            if dt is not None and numel * dt.itemsize != end - begin:
                raise LoadError(f"tensor {key!r} in {f}: {info['dtype']} {info['shape']} needs "
                                f"{numel * dt.itemsize} bytes, the header gives {end - begin} (corrupted shard)")
        refs.sort(key=lambda r: r.offset)
        return refs

    def _check_index(self, weight_map: dict[str, str], index: Path) -> None:
        found = {r.key: r.file.name for r in self.refs}
        for key, fname in weight_map.items():
            if found.get(key) != fname:
                where = f"it is in {found[key]}" if key in found else "no shard has it"
                raise LoadError(f"tensor {key!r}: {index} puts it in {self.dir / fname}, but {where}")
        seen: dict[str, Path] = {}
        for r in self.refs:
            if r.key in seen:
                raise LoadError(f"tensor {r.key!r} is in two shards: {seen[r.key]} and {r.file}")
            seen[r.key] = r.file

    def signature_files(self) -> list[Path]:
        """The files whose (name, size, mtime) identify this checkpoint's content."""
        extra = [p for p in (self.index, self.dir / "config.json") if p is not None and p.is_file()]
        return list(dict.fromkeys([*self.files, *extra]))

    def stream(self, jobs: list[ReadJob], window: int,
               buffers: BufferPool | None = None) -> Iterator[tuple[ReadJob, torch.Tensor]]:
        """Yield (job, uint8 tensor of its bytes) in order; a reader thread stays at most ``window`` bytes ahead
        (one job larger than the window is read alone). The consumer may keep the tensors (no copy is made);
        jobs marked ``reuse`` are read into ``buffers``, to which the consumer gives them back."""
        q: queue.Queue = queue.Queue()
        cond = threading.Condition()
        state = {"ahead": 0, "stop": False}

        def reader() -> None:
            fd, fd_path = None, None
            try:
                for job in jobs:
                    with cond:
                        cond.wait_for(lambda: state["stop"] or state["ahead"] == 0
                                      or state["ahead"] + job.nbytes <= window)
                        if state["stop"]:
                            return
                        state["ahead"] += job.nbytes
                    if fd_path != job.file:
                        if fd is not None:
                            os.close(fd)
                        fd, fd_path = os.open(job.file, os.O_RDONLY), job.file
                    if job.reuse and buffers is not None:
                        buf = buffers.get(job.nbytes)
                    else:
                        buf = torch.empty(job.nbytes, dtype=torch.uint8)
                    try:
                        pread_into(fd, job.offset, buf)
                    except OSError as e:
                        raise LoadError(f"reading {job.what} from {job.file} failed: {e}") from None
                    q.put((job, buf))
                q.put(None)
            except BaseException as e:  # handed to the consumer
                q.put(e)
            finally:
                if fd is not None:
                    os.close(fd)

        thread = threading.Thread(target=reader, name="ktinject-reader", daemon=True)
        thread.start()
        try:
            while True:
                item = q.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                job, buf = item
                del item
                yield job, buf
                del buf
                with cond:
                    state["ahead"] -= job.nbytes
                    cond.notify_all()
        finally:
            with cond:
                state["stop"] = True
                cond.notify_all()
            thread.join()


# ---------------------------------------------------------------------------------------------- key mapping


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
        m = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), renamed)
        return int(m.group(1)) if m and m.groups() else None


def map_checkpoint(model: nn.Module, ckpt: Checkpoint, is_expert: Callable[[str], tuple[str, str] | None],
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
        _check_dtype(ref, meta, target)
        ex = is_expert(target)
        piece = Piece(ref, target, meta, unit_of(target), ex[1] if ex else None)
        if conv is not None:
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


def _check_dtype(ref: TensorRef, meta: torch.Tensor, target: str) -> None:
    if ref.dtype not in ST_DTYPES:
        raise LoadError(f"tensor {ref.key!r} in {ref.file} has dtype {ref.dtype}, which ktinject cannot read yet "
                        f"(FP8 / MXFP4 / other quantized checkpoints are not supported: use a bf16, fp16 or fp32 "
                        f"checkpoint)")
    if meta.is_floating_point() != (ref.dtype in _FLOATS) or (
            not meta.is_floating_point() and ST_DTYPES[ref.dtype] != meta.dtype):
        raise LoadError(f"tensor {ref.key!r} in {ref.file} is {ref.dtype} but {target!r} is {meta.dtype} "
                        f"(a quantized checkpoint? ktinject reads unquantized checkpoints only)")


def _shape_error(ref: TensorRef, target: str, want: tuple) -> LoadError:
    return LoadError(f"tensor {ref.key!r} in {ref.file} has shape {list(ref.shape)}, {target!r} needs "
                     f"{list(want)} (a checkpoint of another configuration?)")


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


def _check_missing(state, filled, coverage, is_expert, ckpt: Checkpoint) -> None:
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
