"""The safetensors reader: sharded (``model.safetensors.index.json``) or single-file (``model.safetensors``)
checkpoints, as Hugging Face writes them. Headers only at open: names, dtypes, shapes, byte offsets, checked
against the index and the file sizes; the bytes are read by ``Reader.stream``.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from ktinject.injection.formats.base import LoadError, Reader, TensorRef, pread_into
from ktinject.injection.formats.codecs import FP8Block, MXFP4, PackedInt

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
        return ref.codec.dtype if ref.codec is not None else ST_DTYPES.get(ref.dtype)

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
        self.refs = group_quantized(self.refs, _fp8_block(self.dir))
        self.quant_formats = sorted({r.codec.name for r in self.refs if r.codec is not None})

    def check_config(self, config: Any) -> None:
        """The config's ``quantization_config`` must describe what the tensors hold: FP8 with block scales
        (``quant_method: fp8``, its ``weight_block_size`` the scales' blocks), compressed-tensors pack-quantized, or
        mxfp4; a quantized config with no quantized tensor (or the other way round) is refused."""
        qc = getattr(config, "quantization_config", None)
        if qc is not None and not isinstance(qc, dict):
            qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
        method = (qc or {}).get("quant_method")
        codecs = {type(r.codec) for r in self.refs if r.codec is not None}
        known = {"fp8": FP8Block, "compressed-tensors": PackedInt, "mxfp4": MXFP4}
        if not qc and not codecs:
            return
        if method not in known:
            raise LoadError(f"{self.dir}: config.quantization_config has quant_method {method!r}; ktinject reads "
                            f"{', '.join(sorted(known))} quantized safetensors checkpoints (and GGUF files)")
        if not codecs or codecs != {known[method]}:
            found = ", ".join(self.quant_formats) or "no quantized tensor"
            raise LoadError(f"{self.dir}: config.quantization_config says {method!r} but the tensors hold "
                            f"{found}: config and weights disagree")
        if method == "fp8":
            block = tuple(qc.get("weight_block_size") or ())
            if len(block) != 2 or min(block) <= 0:
                raise LoadError(f"{self.dir}: fp8 quantization_config has weight_block_size {list(block)}; only "
                                f"block-scaled FP8 (weight_block_size [rows, cols], e.g. [128, 128]) is supported")
            for r in self.refs:
                if isinstance(r.codec, FP8Block):
                    r.codec.block = block
                    _check_spans(r)
        if method == "compressed-tensors" and qc.get("format") not in (None, "pack-quantized"):
            raise LoadError(f"{self.dir}: compressed-tensors format {qc.get('format')!r} is not supported "
                            f"(pack-quantized is)")
        if method == "compressed-tensors":
            self._check_schemes(qc)

    def _check_schemes(self, qc: dict) -> None:
        """Every packed tensor's bits and group (read from its shapes) are a scheme the config declares, and the
        schemes are symmetric integer group-wise ones."""
        schemes = set()
        for name, group in (qc.get("config_groups") or {}).items():
            w = (group or {}).get("weights") or {}
            if w.get("type", "int") != "int" or not w.get("symmetric", True) or \
                    w.get("strategy", "group") != "group" or w.get("dynamic"):
                raise LoadError(f"{self.dir}: compressed-tensors scheme {name!r} ({w}) is not supported: symmetric "
                                f"group-wise int weights are (int4 / int8, e.g. Kimi-K2-Thinking's)")
            schemes.add((int(w.get("num_bits", 0)), int(w.get("group_size") or 0)))
        for r in self.refs:
            if isinstance(r.codec, PackedInt) and (r.codec.bits, r.codec.group) not in schemes:
                raise LoadError(f"tensor {r.key!r} in {r.file}: its shapes say int{r.codec.bits} with groups of "
                                f"{r.codec.group}, but config.quantization_config declares "
                                f"{sorted(schemes) or 'no scheme'} (num_bits, group_size): config and weights "
                                f"disagree")

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


def _check_spans(ref: TensorRef) -> None:
    want = ref.codec.nbytes(ref.shape)
    have = [sp.nbytes for sp in ref.spans]
    if want != have:
        raise LoadError(f"tensor {ref.key!r} in {ref.file}: {ref.codec.name} of shape {list(ref.shape)} needs "
                        f"stored parts of {want} bytes, the checkpoint has {have} (scales of another block size, "
                        f"or a corrupted header)")


def _quantized(key: str, codec, parts: list[TensorRef], shape) -> TensorRef:
    first = parts[0]
    q = TensorRef(key, first.file, first.dtype, tuple(shape), first.offset, sum(p.nbytes for p in parts), codec,
                  tuple(p.all_spans()[0] for p in parts))
    _check_spans(q)
    return q


def _read_small(ref: TensorRef) -> torch.Tensor:
    buf = torch.empty(ref.nbytes, dtype=torch.uint8)
    fd = os.open(ref.file, os.O_RDONLY)
    try:
        pread_into(fd, ref.offset, buf)
    finally:
        os.close(fd)
    return buf.view(ST_DTYPES[ref.dtype])


def _fp8_block(d: Path) -> tuple[int, int]:
    """The FP8 scales' block (config.json's quantization_config.weight_block_size; 128 x 128 without one: the
    scale shapes are then checked against it, and check_config checks the config)."""
    try:
        block = json.loads((d / "config.json").read_text())["quantization_config"]["weight_block_size"]
        bn, bk = (int(b) for b in block)
        if bn > 0 and bk > 0:
            return bn, bk
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return 128, 128


def _fp8(r: TensorRef, by_key: dict, block: tuple[int, int]) -> tuple[TensorRef, list[str]]:
    scale = by_key[r.key + "_scale_inv"]
    if scale.dtype not in ("F32", "BF16", "F16") or len(scale.shape) != len(r.shape):
        raise LoadError(f"tensor {scale.key!r} in {scale.file}: {scale.dtype} {list(scale.shape)} is not a block-scale "
                        f"tensor for {r.key!r} {list(r.shape)}")
    return _quantized(r.key, FP8Block(block, ST_DTYPES[scale.dtype]), [r, scale], r.shape), [scale.key]


def _packed(r: TensorRef, by_key: dict, block=None) -> tuple[TensorRef, list[str]]:
    base = r.key[:-len("_packed")]
    scale, shape_ref = by_key.get(base + "_scale"), by_key.get(base + "_shape")
    if base + "_zero_point" in by_key:
        raise LoadError(f"tensor {r.key!r} in {r.file}: asymmetric compressed-tensors weights (a weight_zero_point) "
                        f"are not supported; symmetric int4 / int8 are")
    if scale is None or shape_ref is None or r.dtype != "I32" or shape_ref.dtype not in ("I64", "I32") \
            or len(r.shape) != 2:
        raise LoadError(f"tensor {r.key!r} in {r.file}: a compressed-tensors packed weight needs 2-D int32 words "
                        f"with {base}_scale and {base}_shape beside it")
    shape = tuple(int(v) for v in _read_small(shape_ref).tolist())
    if len(shape) != 2 or shape[0] != r.shape[0] or not shape[1] or (r.shape[1] * 32) % shape[1]:
        raise LoadError(f"tensor {r.key!r} in {r.file}: weight_shape {list(shape)} does not fit packed words "
                        f"{list(r.shape)}")
    groups = scale.shape[-1] if scale.shape else 0
    if len(scale.shape) != 2 or scale.shape[0] != shape[0] or not groups:
        raise LoadError(f"tensor {scale.key!r} in {scale.file}: scales {list(scale.shape)} are not [rows, groups] "
                        f"for a weight of {list(shape)} (only group-wise scales are supported)")
    codec = PackedInt(r.shape[1] * 32 // shape[1], -(-shape[1] // groups), ST_DTYPES.get(scale.dtype, torch.float32))
    return _quantized(base, codec, [r, scale], shape), [scale.key, shape_ref.key]


def _mxfp4(r: TensorRef, by_key: dict, block=None) -> tuple[TensorRef, list[str]]:
    base = r.key[:-len("_blocks")]
    scale = by_key[base + "_scales"]
    if r.dtype != "U8" or scale.dtype != "U8" or len(r.shape) < 3 or tuple(r.shape[:-1]) != tuple(scale.shape) \
            or r.shape[-1] != 16:
        raise LoadError(f"tensor {r.key!r} in {r.file}: mxfp4 blocks {r.dtype} {list(r.shape)} and scales "
                        f"{scale.dtype} {list(scale.shape)} do not match ([..., N, K/32, 16] and [..., N, K/32] "
                        f"uint8)")
    *lead, N, nb, _ = r.shape
    # transformers' own dequantization gives the model [..., K, N] (gpt-oss's experts hold x @ W)
    return _quantized(base, MXFP4(transpose=True), [r, scale], (*lead, nb * 32, N)), [scale.key]


#: a quantized tensor's values ref -> (is it one, its reader); parts are found beside it by key
_GROUPS = (
    (lambda r, by: r.dtype == "F8_E4M3" and r.key + "_scale_inv" in by, _fp8),
    (lambda r, by: r.key.endswith(".weight_packed"), _packed),
    (lambda r, by: r.key.endswith("_blocks") and r.key[:-len("_blocks")] + "_scales" in by, _mxfp4),
)

def group_quantized(refs: list[TensorRef], fp8_block: tuple[int, int] = (128, 128)) -> list[TensorRef]:
    """Refs with each quantized tensor's stored parts merged into one ref of the model's key and shape:
    ``X.weight`` (F8_E4M3) + ``X.weight_scale_inv``; ``X.weight_packed`` + ``X.weight_scale`` + ``X.weight_shape``
    (compressed-tensors); ``X_blocks`` + ``X_scales`` (mxfp4). The merged ref keeps the place of its values."""
    by_key = {r.key: r for r in refs}
    merged, used = {}, set()
    for r in refs:
        for test, make in _GROUPS:
            if test(r, by_key):
                merged[r.key], parts = make(r, by_key, fp8_block)
                used.update(parts)
                break
    out = []
    for r in refs:
        if r.key in merged:
            out.append(merged[r.key])
        elif r.key not in used:  # (a part without its values is left to the key check: unexpected)
            out.append(r)
    return out
