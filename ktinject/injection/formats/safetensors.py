"""The safetensors reader: sharded (``model.safetensors.index.json``) or single-file (``model.safetensors``)
checkpoints, as Hugging Face writes them. Headers only at open: names, dtypes, shapes, byte offsets, checked
against the index and the file sizes; the bytes are read by ``Reader.stream``.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from ktinject.injection.formats.base import LoadError, Reader, TensorRef

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"

#: safetensors dtype names torch can hold; anything else (F8_*, packed 4-bit ...) is refused with a clear error
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


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
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            info["shape"] = [int(x) for x in info["shape"]]
            if not isinstance(info["dtype"], str):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"header entry of tensor {key!r} is malformed: {info!r}") from None
        if not 0 <= begin <= end <= data_len:
            raise ValueError(f"tensor {key!r} spans bytes {begin}..{end} of the data but the file holds only "
                             f"{data_len} data bytes (truncated?)")
        spans.append((begin, end, key))
    # as the safetensors library insists: the tensors tile the data, so no two share (or overlap) bytes
    spans.sort()
    at, prev = 0, None
    for begin, end, key in spans:
        if begin != at:
            what = f"overlaps tensor {prev!r} (which ends at {at})" if begin < at else \
                f"leaves bytes {at}..{begin} unused after {prev or 'the header'}"
            raise ValueError(f"tensor {key!r} starts at data byte {begin} and {what}: offsets corrupted")
        at, prev = end, key
    return header, data_start


def _shard_names(weight_map: Any, index: Path) -> list[str]:
    """The shard files an index's ``weight_map`` ({tensor: file}) lists, checked: relative paths inside the
    checkpoint directory (an absolute path or '..' would read outside it)."""
    if not isinstance(weight_map, dict):
        raise LoadError(f"{index}: \"weight_map\" is a {type(weight_map).__name__}, expected an object "
                        f"{{tensor name: shard file}}")
    names = set()
    for key, fname in weight_map.items():
        parts = Path(fname).parts if isinstance(fname, str) else ()
        if not parts or Path(fname).is_absolute() or ".." in parts:
            raise LoadError(f"{index}: tensor {key!r} is mapped to {fname!r}, expected the path of a shard file "
                            "inside the checkpoint directory (relative, no '..')")
        names.add(Path(fname).as_posix())  # ("./a" and "a": one file)
    return sorted(names)


class SafetensorsReader(Reader):
    """The shards of a safetensors checkpoint and every tensor's place in them (headers only)."""

    expects = f"{_INDEX} or {_SINGLE}"

    @classmethod
    def detect(cls, path: Path) -> bool:
        path = Path(path)
        return (path.is_file() and path.suffix == ".safetensors") or (path / _INDEX).is_file() or \
            (path / _SINGLE).is_file()

    def torch_dtype(self, ref: TensorRef) -> torch.dtype | None:
        return ST_DTYPES.get(ref.dtype)

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
            files = [path / f for f in _shard_names(weight_map, index)]
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
            keys = [k for k, v in (weight_map or {}).items() if self.dir / v == f]
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
        found = {r.key: r.file for r in self.refs}
        for key, fname in weight_map.items():
            if found.get(key) != self.dir / fname:
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
