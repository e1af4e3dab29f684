"""The GGUF reader (llama.cpp's format): one ``.gguf`` file, a split set (``name-00001-of-0000N.gguf``: every split
is read and checked), or a directory holding one GGUF model.

At open: every file's header (metadata and tensor infos) is parsed here, without mmap, and checked: a truncated
file, a tensor whose type and shape need more bytes than it has, an unknown ggml type, a missing or inconsistent
split are each a LoadError naming the file and tensor. The config comes from the metadata (``gguf_config``:
transformers' GGUF mapping, completed and checked against the shapes), the tensors become refs under Hugging Face
checkpoint keys (per expert for the routed experts), decoded by ``gguf_codecs``. ``tokenizer_source`` tells the
CLIs how to build the tokenizer (with the chat template) from the metadata. Needs the ``gguf`` package
(``pip install "ktinject[gguf]"``), imported only when a GGUF is opened.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ktinject.injection.formats import gguf_config as gc
from ktinject.injection.formats.base import LoadError, Reader, Span, TensorRef
from ktinject.injection.formats.gguf_codecs import (BLOCKS, PLAIN, MLAKVB, GGMLCodec, Interleaved, Permuted,
                                                    Transposed, row_bytes)

_MAGIC = b"GGUF"
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _import_gguf():
    try:
        import gguf
    except ImportError:
        raise LoadError('reading GGUF files needs the gguf package: pip install "ktinject[gguf]"') from None
    return gguf


class _Truncated(Exception):
    pass


class _Header:
    """Metadata and tensor infos of one GGUF file: ``tensors`` = [(name, ggml type name, shape in PyTorch order,
    absolute byte offset)]."""

    def __init__(self, path: Path, type_names: dict[int, str]):
        self.path, self.size = path, path.stat().st_size
        with open(path, "rb") as fh:
            try:
                self._parse(fh, type_names)
            except _Truncated:
                raise LoadError(f"{path}: the GGUF header is cut off ({self.size} bytes): a truncated file") from None
            except (UnicodeDecodeError, struct.error, ValueError) as e:
                raise LoadError(f"{path}: the GGUF header is corrupted ({e})") from None

    @staticmethod
    def _read(fh: BinaryIO, n: int) -> bytes:
        b = fh.read(n)
        if len(b) != n:
            raise _Truncated
        return b

    def _scalar(self, fh, t: int):
        if t == 8:
            (n,) = struct.unpack("<Q", self._read(fh, 8))
            if n > self.size:
                raise ValueError(f"a string of {n} bytes")
            return self._read(fh, n).decode("utf-8")
        if t not in _SCALARS:
            raise ValueError(f"metadata value type {t}")
        fmt = _SCALARS[t]
        return struct.unpack(fmt, self._read(fh, struct.calcsize(fmt)))[0]

    def _value(self, fh, t: int):
        if t != 9:
            return self._scalar(fh, t)
        et, n = struct.unpack("<IQ", self._read(fh, 12))
        if et in _SCALARS and et != 7:
            fmt = _SCALARS[et]
            return list(struct.unpack(f"<{n}{fmt[1]}", self._read(fh, n * struct.calcsize(fmt))))
        return [self._value(fh, et) for _ in range(n)]

    def _parse(self, fh, type_names) -> None:
        if self._read(fh, 4) != _MAGIC:
            raise ValueError("no GGUF magic: not a GGUF file")
        version, n_tensors, n_kv = struct.unpack("<IQQ", self._read(fh, 20))
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (2 and 3 are read)")
        self.meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._scalar(fh, 8)
            (t,) = struct.unpack("<I", self._read(fh, 4))
            self.meta[key] = self._value(fh, t)
        infos = []
        for _ in range(n_tensors):
            name = self._scalar(fh, 8)
            (nd,) = struct.unpack("<I", self._read(fh, 4))
            ne = struct.unpack(f"<{nd}Q", self._read(fh, 8 * nd))
            t, off = struct.unpack("<IQ", self._read(fh, 12))
            infos.append((name, type_names.get(t, f"type id {t}"), tuple(reversed(ne)), off))
        align = int(self.meta.get("general.alignment", 32))
        start = -(-fh.tell() // align) * align
        self.tensors = [(name, t, shape, start + off) for name, t, shape, off in infos]


def gguf_files(path: Path) -> list[Path]:
    """The files of the GGUF model at ``path``: the file, every split of a split set (the first named), or the one
    model of a directory (vision projectors ``mmproj*`` aside); LoadError when that is not one model."""
    path = Path(path)
    if path.is_dir():
        found = sorted(p for p in path.glob("*.gguf") if not p.name.startswith("mmproj"))
        models = sorted({(_SPLIT.match(p.name).group("stem") + " (split)") if _SPLIT.match(p.name) else p.name
                         for p in found})
        if len(models) != 1:
            raise LoadError(f"{path}: expected one GGUF model in the directory, found {len(models)}"
                            f"{': ' + ', '.join(models) if models else ''}; pass the .gguf file (the first split)")
        path = next(p for p in found if not _SPLIT.match(p.name) or int(_SPLIT.match(p.name).group("no")) == 1) \
            if any(not _SPLIT.match(p.name) or int(_SPLIT.match(p.name).group("no")) == 1 for p in found) else found[0]
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    no, count = int(m.group("no")), int(m.group("count"))
    if no != 1:
        raise LoadError(f"{path} is split {no} of {count}: pass the first file, "
                        f"{m.group('stem')}-00001-of-{count:05d}.gguf")
    files = [path.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise LoadError(f"{path}: split set of {count} files lacks {', '.join(missing)}")
    return files


@dataclass(frozen=True)
class _Tensor:
    name: str
    file: Path
    qtype: str
    shape: tuple[int, ...]  # PyTorch order
    offset: int
    nbytes: int


class GGUFReader(Reader):
    """The tensors of a GGUF model (headers only) under Hugging Face keys, its config from the metadata."""

    expects = "a .gguf file (or the first of name-00001-of-0000N.gguf)"

    @classmethod
    def detect(cls, path: Path) -> bool:
        path = Path(path)
        return (path.is_file() and path.suffix == ".gguf") or (path.is_dir() and any(path.glob("*.gguf")))

    def __init__(self, path: Path):
        gguf = _import_gguf()
        type_names = {int(t): t.name for t in gguf.GGMLQuantizationType}
        self.files = gguf_files(path)
        self.dir = self.files[0].parent
        headers = [_Header(f, type_names) for f in self.files]
        self._check_splits(headers)
        self.meta = headers[0].meta
        self.tensors = self._tensors(headers)
        shapes = {t.name: t.shape for t in self.tensors.values()}
        self.family = gc.family_of(self.meta, shapes, self.files[0])
        self._config = gc.build_config(self.family, self.meta, shapes, self.files[0])
        layers = self._config.num_hidden_layers
        joined = gc.joins(self.family, self.tensors, self.files[0], layers)
        parts = {name for _, names, _ in joined for name in names}
        refs = [self._joined(key, names, how) for key, names, how in joined]
        refs += [r for t in self.tensors.values() if t.name not in parts for r in self._refs(t, layers)]
        self.refs = sorted(refs, key=lambda r: (self.files.index(r.file), r.offset))
        self.quant_formats = sorted({r.codec.name for r in self.refs if r.codec is not None})

    def config(self):
        return self._config

    def torch_dtype(self, ref: TensorRef) -> torch.dtype | None:
        return ref.codec.dtype if ref.codec is not None else PLAIN.get(ref.dtype)

    def signature_files(self) -> list[Path]:
        return list(self.files)

    def tokenizer_source(self) -> tuple[Path, str]:
        """(directory, first file's name): ``AutoTokenizer.from_pretrained(dir, gguf_file=name)`` builds the
        tokenizer, with the chat template, from the metadata."""
        return self.dir, self.files[0].name

    # -- checks

    def _check_splits(self, headers: list[_Header]) -> None:
        n = len(headers)
        total = sum(len(h.tensors) for h in headers)
        for i, h in enumerate(headers):
            no, count = h.meta.get("split.no", 0 if n == 1 else None), h.meta.get("split.count", 1 if n == 1 else None)
            if (no, count) != (i, n):
                raise LoadError(f"{h.path}: its metadata says split.no {no} of split.count {count}, but it is file "
                                f"{i + 1} of a set of {n}: splits of different models or a renamed file")
        want = headers[0].meta.get("split.tensors.count", total)
        if want != total:
            raise LoadError(f"{headers[0].path}: split.tensors.count is {want} but the {n} files hold {total} "
                            f"tensors: a split is damaged or from another model")
        if "general.architecture" not in headers[0].meta:
            raise LoadError(f"{headers[0].path}: no general.architecture in the GGUF metadata")

    def _tensors(self, headers: list[_Header]) -> dict[str, _Tensor]:
        out: dict[str, _Tensor] = {}
        for h in headers:
            items = []
            for name, qtype, shape, offset in h.tensors:
                if qtype not in BLOCKS:
                    raise LoadError(f"tensor {name!r} in {h.path} has ggml type {qtype}, which ktinject cannot read; "
                                    f"it reads {', '.join(BLOCKS)}")
                try:
                    nbytes = (row_bytes(qtype, shape[-1]) if shape else 0) * _prod(shape[:-1])
                except LoadError as e:
                    raise LoadError(f"tensor {name!r} in {h.path} {list(shape)}: {e}") from None
                if name in out:
                    raise LoadError(f"tensor {name!r} is in {out[name].file} and again in {h.path}")
                items.append(_Tensor(name, h.path, qtype, shape, offset, nbytes))
            items.sort(key=lambda t: t.offset)
            for t, nxt in zip(items, [*items[1:], None]):
                end = nxt.offset if nxt is not None else h.size
                if t.offset + t.nbytes > end:
                    what = (f"tensor {nxt.name!r} starts at byte {nxt.offset}: its type and shape do not match its "
                            f"bytes (a damaged header)") if nxt is not None else \
                        f"the file ends at byte {h.size}: a truncated file"
                    raise LoadError(f"tensor {t.name!r} in {h.path}: {t.qtype} {list(t.shape)} needs {t.nbytes} "
                                    f"bytes from byte {t.offset}, but {what}")
                out[t.name] = t
        return out

    # -- refs

    def _codec(self, t: _Tensor):
        fam, cfg = self.family, self._config
        if fam.permute_qk and re.search(r"\.attn_[qk]\.", t.name):
            heads = cfg.num_attention_heads if ".attn_q." in t.name else cfg.num_key_value_heads
            return Permuted(GGMLCodec(t.qtype), heads)
        return None if t.qtype in PLAIN else GGMLCodec(t.qtype)

    def _joined(self, key: str, names: tuple[str, ...], how: str) -> TensorRef:
        """One model tensor over the GGUF tensors ``names`` (``gc.JOINS``), decoded by a ``gguf_codecs`` part codec."""
        ts = [self.tensors[n] for n in names]
        parts = [(GGMLCodec(t.qtype), t.shape) for t in ts]
        s = ts[0].shape
        if how == "mla_kv_b":  # k_b [heads, rank, nope] + v_b [heads, v, rank] -> [heads * (nope + v), rank]
            v_b = ts[1].shape
            if len(s) != 3 or len(v_b) != 3 or (v_b[0], v_b[2]) != (s[0], s[1]):
                raise LoadError(f"tensors {names[0]!r} {list(s)} and {names[1]!r} {list(v_b)} in {ts[0].file} are "
                                f"not MLA's [heads, kv_lora_rank, qk_nope] and [heads, v_head_dim, kv_lora_rank]")
            codec, shape = MLAKVB(parts, ndim=2), (s[0] * (s[2] + v_b[1]), s[1])
        elif how == "transpose":  # [E, H, I] -> [E, I, H]
            codec, shape = Transposed(parts), (s[0], s[2], s[1])
        else:  # gate + up [E, I, H] -> [E, H, 2I] (interleave_t); biases [E, I] -> [E, 2I]
            if any(t.shape != s for t in ts):
                raise LoadError(f"tensors {names[0]!r} {list(s)} and {names[1]!r} {list(ts[1].shape)} in "
                                f"{ts[0].file} differ in shape; gate and up experts are alike")
            codec = Interleaved(parts, transpose=how == "interleave_t")
            shape = (s[0], s[2], 2 * s[1]) if how == "interleave_t" else (s[0], 2 * s[1])
        spans = tuple(Span(t.file, t.offset, t.nbytes) for t in ts)
        return TensorRef(key, ts[0].file, ts[0].qtype, shape, ts[0].offset, sum(t.nbytes for t in ts), codec, spans)

    def _refs(self, t: _Tensor, layers: int) -> list[TensorRef]:
        key, part = gc.hf_name(self.family, t.name, t.file, layers)
        if key is None:
            return []
        codec = self._codec(t)
        if part is None:
            shape = gc.hf_shape(self.family, t.name, t.shape)
            spans = (Span(t.file, t.offset, t.nbytes),) if codec is not None else ()
            return [TensorRef(key, t.file, t.qtype, shape, t.offset, t.nbytes, codec, spans)]
        if len(t.shape) != 3:
            raise LoadError(f"tensor {t.name!r} in {t.file} has shape {list(t.shape)}; routed experts are stored "
                            f"[experts, out, in]")
        E, per = t.shape[0], t.nbytes // t.shape[0]
        refs = []
        for e in range(E):
            at = t.offset + e * per
            spans = (Span(t.file, at, per),) if codec is not None else ()
            refs.append(TensorRef(key.format(e=e), t.file, t.qtype, t.shape[1:], at, per, codec, spans))
        return refs


def _prod(dims) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def tokenizer_source(path) -> tuple[Path, str] | None:
    """(directory, GGUF file name) for ``AutoTokenizer.from_pretrained(dir, gguf_file=name)`` when ``path`` is a GGUF
    model (a .gguf file or a directory holding one, without config.json), else None."""
    path = Path(path)
    if path.is_dir() and ((path / "config.json").is_file() or not any(path.glob("*.gguf"))):
        return None
    if path.is_file() and path.suffix != ".gguf":
        return None
    if not path.exists():
        return None
    files = gguf_files(path)
    _Header(files[0], {})  # a damaged file: a LoadError naming it (not transformers' struct error)
    return files[0].parent, files[0].name
