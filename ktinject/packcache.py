"""Checkpoint reading for streaming loads (no mmap, a bounded read-ahead thread) and the packed-experts cache.

Reading: ``Checkpoint(dir)`` finds the shards (``model.safetensors.index.json`` or one ``model.safetensors``), parses
every header (names, dtypes, shapes, byte offsets; no data) and checks them: a missing shard, a key the index lists
but the shard lacks, a truncated or corrupted file are a LoadError naming the file and tensor. ``stream(jobs)``
reads byte ranges with positional reads from a reader thread that stays at most a window of bytes ahead of the
consumer. No mmap: mapped pages of a shard would count as our resident memory while the file is open; the page
cache does not.

Cache: packing (and quantizing) routed experts into the native layout costs CPU time on every start. After a cold
load, each MoE block's packed bytes (``native.Experts.export``) are written to ``<root>/<key>/<block>.safetensors``
(one uint8 tensor ``packed``) plus a ``manifest.json``; a later start with the same key reads them back with
``Experts.load_packed`` instead of the checkpoint's expert tensors. The key hashes everything the packed bytes
depend on: the checkpoint files (name, size, mtime), the rules' content, the per-block sizes and quantization, the
native library's version and this file format, so any change misses (and the stale entry for the same checkpoint
is removed when the new one is written). A cache directory is written under a temporary name and renamed into
place when complete (atomic): a crash leaves no half cache behind. The root is ``cache_dir`` if given, else
``$KTINJECT_CACHE``, else ``<checkpoint>/.ktinject-cache`` when the checkpoint directory is writable; ``False`` or
``KTINJECT_CACHE=off`` disables it. By default (``cache_dir=None``, no ``$KTINJECT_CACHE``) it is used only for
quantized packings (int8): a bf16 cache holds as many bytes as the checkpoint's experts, so reading it is no
faster than streaming them, and writing it costs a second copy (H100 machine, 16 cores, 3.7 GB checkpoint:
bf16 stream 2.9 s, cold + cache write 6.6 s, cached 3.6 s; int8 2.8 s, 4.9 s, 2.4 s).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import struct
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

log = logging.getLogger(__name__)

FORMAT = 1
_MANIFEST = "manifest.json"
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_MAX_IO = 1 << 30  # bytes per pread call (Linux caps one call at ~2 GiB)

#: safetensors dtype names torch can hold; anything else (F8_*, packed 4-bit ...) is refused with a clear error
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class LoadError(ValueError):
    """A checkpoint cannot be loaded into the model; the message names the tensor and the file."""


class CacheError(RuntimeError):
    """A cache file is unreadable or does not fit the experts it should fill."""


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


def read_tensor(path: Path, name: str, buffers: BufferPool | None = None) -> torch.Tensor:
    """The raw bytes of tensor ``name`` in a safetensors file, as a uint8 tensor (no mmap; from ``buffers`` if
    given)."""
    header, start = read_header(path)
    if name not in header:
        raise ValueError(f"no tensor {name!r}")
    begin, end = header[name]["data_offsets"]
    out = buffers.get(end - begin) if buffers is not None else torch.empty(end - begin, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        pread_into(fd, start + begin, out)
    finally:
        os.close(fd)
    return out


def write_tensor(path: Path, name: str, data: torch.Tensor, metadata: dict[str, str]) -> None:
    """Write one uint8 tensor as a safetensors file (header, then the bytes straight from ``data``), fsynced."""
    nbytes = data.numel()
    header = {"__metadata__": metadata, name: {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.write(memoryview(data.numpy()))
        fh.flush()
        os.fsync(fh.fileno())


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


# ---------------------------------------------------------------------------------------------- cache


def cache_root(cache_dir: Any, checkpoint_dir: Path, worth_it: bool) -> Path | None:
    """Where the cache lives, or None when it is off (see the module docstring). ``cache_dir``: False (off), a
    path (on, there), True (on, default place) or None: on at the default place when ``worth_it`` (the packing
    quantizes) or when ``$KTINJECT_CACHE`` names a directory."""
    if cache_dir is False:
        return None
    env = os.environ.get("KTINJECT_CACHE")
    if cache_dir is None or cache_dir is True:
        if env is not None and env.strip().lower() in ("", "0", "off", "false", "no"):
            return None
        if env is not None:
            return Path(env).expanduser()
        if cache_dir is None and not worth_it:
            return None
    else:
        return Path(cache_dir).expanduser()
    if os.access(checkpoint_dir, os.W_OK):
        return checkpoint_dir / ".ktinject-cache"
    log.info("packed-expert cache off: %s is not writable (pass cache_dir=... or set KTINJECT_CACHE)",
             checkpoint_dir)
    return None


def file_signature(paths: Iterable[Path]) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of each file: what identifies a checkpoint's content cheaply."""
    out = []
    for p in sorted(paths):
        st = p.stat()
        out.append((p.name, st.st_size, st.st_mtime_ns))
    return out


def cache_key(**parts: Any) -> str:
    """A short hex digest of ``parts`` (JSON-serialisable values; keys sorted)."""
    blob = json.dumps({"format": FORMAT, **parts}, sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


class PackCache:
    """One cache entry: ``root/key/``. ``hit`` says whether it is complete; ``load`` fills experts from it;
    ``begin`` / ``put`` / ``commit`` / ``abort`` write a new one atomically."""

    def __init__(self, root: Path, key: str, checkpoint: Path):
        self.root, self.key, self.checkpoint = Path(root), key, str(Path(checkpoint).resolve())
        self.dir = self.root / key
        self._tmp: Path | None = None
        self._written: dict[str, tuple[str, int]] = {}
        self._manifest: dict[str, Any] | None = None
        self._buffers = BufferPool()

    @property
    def hit(self) -> bool:
        """A complete entry: manifest of this key and every block file there with at least its bytes."""
        if self._manifest is None:
            try:
                manifest = json.loads((self.dir / _MANIFEST).read_text())
                if manifest.get("key") != self.key or manifest.get("format") != FORMAT:
                    return False
                for name, (fname, nbytes) in manifest["blocks"].items():
                    if (self.dir / fname).stat().st_size < nbytes:
                        log.warning("packed-expert cache %s: %s is truncated; repacking", self.dir, fname)
                        return False
            except (OSError, ValueError, KeyError, TypeError):
                return False
            self._manifest = manifest
        return True

    def has(self, name: str) -> bool:
        return self.hit and name in self._manifest["blocks"]

    def load(self, name: str, experts) -> int:
        """Fill ``experts`` with the packed bytes of block ``name``; returns bytes read."""
        path = self.dir / self._manifest["blocks"][name][0]
        try:
            buf = read_tensor(path, "packed", self._buffers)
        except (OSError, ValueError) as e:
            raise CacheError(f"packed-expert cache file {path} is unreadable ({e}); delete {self.dir}") from e
        try:
            if buf.numel() != experts.nbytes:
                raise CacheError(f"packed-expert cache file {path} holds {buf.numel()} bytes, block {name!r} "
                                 f"needs {experts.nbytes}; delete {self.dir}")
            experts.load_packed(buf)
        finally:
            self._buffers.put(buf)  # the next block (same size) reads into the same memory
        return buf.numel()

    def begin(self, need_bytes: int) -> bool:
        """Start writing a new entry; False (with a log line) when the root cannot take ``need_bytes``."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.root).free
        except OSError as e:
            log.warning("packed-expert cache off: cannot use %s (%s)", self.root, e)
            return False
        if free < need_bytes * 1.05 + (256 << 20):
            log.warning("packed-expert cache not written: %s has %.1f GB free, the cache needs %.1f GB",
                        self.root, free / 1e9, need_bytes / 1e9)
            return False
        self._tmp = self.root / f".{self.key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._tmp.mkdir()
        return True

    @property
    def writing(self) -> bool:
        return self._tmp is not None

    def put(self, name: str, experts) -> int:
        """Write block ``name``'s packed bytes; returns bytes written."""
        fname = f"{name}.safetensors"
        data = experts.export()
        write_tensor(self._tmp / fname, "packed", data, {"block": name, "key": self.key})
        self._written[name] = (fname, data.numel())
        return data.numel()

    def commit(self, meta: dict[str, Any]) -> None:
        """Write the manifest and move the entry into place; drop stale entries of the same checkpoint."""
        manifest = {"format": FORMAT, "key": self.key, "checkpoint": self.checkpoint, "blocks": self._written,
                    **meta}
        (self._tmp / _MANIFEST).write_text(json.dumps(manifest, indent=1, default=repr))
        if self.dir.exists() and not self.hit:  # an incomplete entry (manifest lost): replace it
            shutil.rmtree(self.dir, ignore_errors=True)
        try:
            os.replace(self._tmp, self.dir)
        except OSError:  # another process committed the same key first: theirs is as good
            shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp = None
        self._drop_stale()

    def abort(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def _drop_stale(self) -> None:
        """Remove other entries of the same checkpoint, and temporary directories of dead writers."""
        for other in self.root.iterdir():
            if other.name.startswith(".") and ".tmp-" in other.name:
                pid = other.name.rsplit(".tmp-", 1)[1].split("-")[0]
                if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                    shutil.rmtree(other, ignore_errors=True)
                continue
            if other.name == self.key or other.name.startswith("."):
                continue
            try:
                manifest = json.loads((other / _MANIFEST).read_text())
            except (OSError, ValueError):
                continue
            if manifest.get("checkpoint") == self.checkpoint:
                log.info("removing stale packed-expert cache %s", other)
                shutil.rmtree(other, ignore_errors=True)
