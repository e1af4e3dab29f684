"""The packed-experts cache of streaming loads (checkpoint reading is ``ktinject.injection.formats``).

Packing (and quantizing) routed experts into the native layout costs CPU time on every start. After a cold
load, each MoE block's packed bytes (``native.Experts.export``) are written to ``<root>/<key>/<block>.safetensors``
(one uint8 tensor ``packed``) plus a ``manifest.json``; a later start with the same key reads them back with
``Experts.load_packed`` instead of the checkpoint's expert tensors. The key hashes everything the packed bytes
depend on: the checkpoint files (name, size, mtime), each block's spec, quantization and int4 group, the native
library's version and this file format, so any change misses (the rest of the rules, devices, hot experts,
prefill, defer, does not change the packed bytes and is not in the key). When a new entry is written, the entries
of the same checkpoint made from other files (the checkpoint changed) or by another native library or format are
removed, and of its other packings (int8 beside int4, another group size) the ``KEEP`` most recently used stay.
Each block's bytes are checked against the SHA-256 digest the manifest records (64 MiB pieces hashed in parallel,
so the check costs little beside the read) before they reach the experts: a corrupted file is repacked,
never computed with. A cache directory is written under a temporary name and renamed into place when complete
(atomic): a crash leaves no half cache behind. The root is ``cache_dir`` if given, else
``$KTINJECT_CACHE``, else ``<checkpoint>/.ktinject-cache`` when the checkpoint directory is writable (for the
built-in demo model, which lies inside the package: ``$XDG_CACHE_HOME/ktinject/packed``, by default under
``~/.cache``); ``False`` or ``KTINJECT_CACHE=off`` disables it. By default (``cache_dir=None``, no ``$KTINJECT_CACHE``) it is used only for
quantized packings (int8, int4, fp8, mxfp4): a bf16 cache holds as many bytes as the checkpoint's experts, so reading
it is no faster than streaming them, and writing it costs a second copy (docs/performance.md, Why the defaults are what
they are).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

import torch

from ktinject import envs
from ktinject.injection.formats.base import BufferPool, pread_into
from ktinject.injection.formats.safetensors import read_header

log = logging.getLogger(__name__)

FORMAT = 4  # 2: int4 in default_group_size's group (128 where the sizes allow; 64 before); 3: each block's layout in
#   the manifest; 4: each block's digest and the checkpoint's files in the manifest
_MANIFEST = "manifest.json"
KEEP = 3  # entries (packings) kept per checkpoint, the most recently used: each is a full copy of the experts


class CacheError(RuntimeError):
    """A cache file is unreadable or does not fit the experts it should fill."""


class CorruptCache(CacheError):
    """A block's file is unreadable, of another size or layout than its experts', or its bytes differ from the digest
    its manifest recorded: the loader packs that block from the checkpoint and drops the entry."""


# ---------------------------------------------------------------------------------------------- safetensors I/O


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




_PIECE = 64 << 20  # bytes a digest piece: hashed in parallel (hashlib lets go of the GIL on large buffers)


def digest(data: torch.Tensor) -> str:
    """SHA-256 over the SHA-256 digests of ``data``'s 64 MiB pieces (a contiguous uint8 CPU tensor), as hex: what
    the manifest records per block. The pieces are hashed by up to 16 threads."""
    view = memoryview(data.numpy()).cast("B")
    starts = range(0, len(view), _PIECE)

    def piece(i: int) -> bytes:
        return hashlib.sha256(view[i:i + _PIECE]).digest()

    workers = max(1, min(16, os.cpu_count() or 1, len(starts)))
    if workers == 1:
        parts = [piece(i) for i in starts]
    else:
        with ThreadPoolExecutor(workers) as pool:
            parts = list(pool.map(piece, starts))
    return hashlib.sha256(b"".join(parts)).hexdigest()


# ---------------------------------------------------------------------------------------------- cache


def _inside_package(path: Path) -> bool:
    """Whether ``path`` lies inside the installed ktinject package (the shipped demo model)."""
    package = Path(__file__).resolve().parents[1]  # ktinject/ (this file: ktinject/injection/)
    try:
        Path(path).resolve().relative_to(package)
    except ValueError:
        return False
    return True


def cache_root(cache_dir: Any, checkpoint_dir: Path, worth_it: bool) -> Path | None:
    """Where the cache lives, or None when it is off (see the module docstring). ``cache_dir``: False (off), a
    path (on, there), True (on, default place) or None: on at the default place when ``worth_it`` (the packing
    quantizes) or when ``$KTINJECT_CACHE`` names a directory."""
    if cache_dir is False:
        return None
    env = envs.raw("KTINJECT_CACHE")  # (set but empty: off, as "off" is)
    if cache_dir is None or cache_dir is True:
        if env is not None and env.strip().lower() in ("", "0", "off", "false", "no"):
            return None
        if env is not None:
            return Path(env).expanduser()
        if cache_dir is None and not worth_it:
            return None
    else:
        return Path(cache_dir).expanduser()
    if _inside_package(checkpoint_dir):
        # the built-in demo model: never write into the installed package (read-only in site-packages, and a
        # checkout would show it as untracked files); the user's cache directory instead
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "ktinject" / "packed"
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


def experts_config(experts) -> str:
    """What the packed bytes of ``experts`` (a native.Experts) are laid out for, as the manifest records it."""
    e = experts
    group = f" group {e.group_size}" if e.quant == "int4" else ""
    return (f"{e.quant}{group}, E={e.num_experts} H={e.hidden} I={e.intermediate}, {e.activation}, "
            f"bias={e.bias}")


def cache_key(**parts: Any) -> str:
    """A short hex digest of ``parts`` (JSON-serialisable values; keys sorted)."""
    blob = json.dumps({"format": FORMAT, **parts}, sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


class PackCache:
    """One cache entry: ``root/key/``. ``hit`` says whether it is complete; ``load`` fills experts from it;
    ``begin`` / ``put`` / ``commit`` / ``abort`` write a new one atomically."""

    def __init__(self, root: Path, key: str, checkpoint: Path, origin: dict[str, Any] | None = None):
        """``origin``: what the entry was made from apart from the packing (the checkpoint's file signature, the
        native library's version), recorded in the manifest: entries of the same checkpoint with another origin are
        stale."""
        self.root, self.key, self.checkpoint = Path(root), key, str(Path(checkpoint).resolve())
        self.origin = json.loads(json.dumps(origin or {}, default=repr))  # as the manifest will read back
        self.dir = self.root / key
        self._tmp: Path | None = None
        self._written: dict[str, tuple[str, int, str, str]] = {}
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
                for name, (fname, nbytes, _config, _digest) in manifest["blocks"].items():
                    if (self.dir / fname).stat().st_size < nbytes:
                        log.warning("packed-expert cache %s: %s is truncated; repacking", self.dir, fname)
                        return False
            except (OSError, ValueError, KeyError, TypeError, AttributeError):  # (a manifest of another shape too)
                return False
            self._manifest = manifest
            try:  # used now: the manifest's mtime orders the entries kept (_drop_stale)
                os.utime(self.dir / _MANIFEST)
            except OSError:
                pass
        return True

    def has(self, name: str) -> bool:
        return self.hit and name in self._manifest["blocks"]

    def load(self, name: str, experts) -> int:
        """Fill ``experts`` with the packed bytes of block ``name``; returns bytes read."""
        fname, _, config, want = self._manifest["blocks"][name]
        path = self.dir / fname
        if config != experts_config(experts):  # same bytes, other layout (int4 groups of 64 and 128 can): never
            raise CorruptCache(f"packed-expert cache file {path} holds experts packed as {config}, block {name!r} "
                               f"is {experts_config(experts)}")
        try:
            buf = read_tensor(path, "packed", self._buffers)
        except (OSError, ValueError) as e:  # (also: removed by another process meanwhile)
            raise CorruptCache(f"packed-expert cache file {path} is unreadable ({e})") from e
        try:
            if buf.numel() != experts.nbytes:
                raise CorruptCache(f"packed-expert cache file {path} holds {buf.numel()} bytes, block {name!r} "
                                   f"needs {experts.nbytes}")
            got = digest(buf)
            if got != want:
                raise CorruptCache(f"packed-expert cache file {path} is corrupted: its bytes' SHA-256 is "
                                   f"{got[:16]}..., the manifest recorded {want[:16]}...")
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
        self._written[name] = (fname, data.numel(), experts_config(experts), digest(data))
        return data.numel()

    def commit(self, meta: dict[str, Any]) -> None:
        """Write the manifest and move the entry into place; drop stale entries of the same checkpoint."""
        manifest = {"format": FORMAT, "key": self.key, "checkpoint": self.checkpoint, "origin": self.origin,
                    "blocks": self._written, **meta}
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

    def drop(self) -> None:
        """Remove this entry (a block failed its check): the load repacks and writes it anew."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self._manifest = None

    def _drop_stale(self) -> None:
        """Remove entries of the same checkpoint with another origin (its files changed, another native library or
        cache format), all but the ``KEEP`` most recently used of its other packings, and temporary directories
        of dead writers."""
        kept: list[tuple[int, Path]] = []
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
            if not isinstance(manifest, dict) or manifest.get("checkpoint") != self.checkpoint:
                continue
            if manifest.get("format") != FORMAT or manifest.get("origin") != self.origin:
                log.info("removing stale packed-expert cache %s", other)
                shutil.rmtree(other, ignore_errors=True)
            else:
                try:
                    kept.append(((other / _MANIFEST).stat().st_mtime_ns, other))
                except OSError:
                    continue
        for _, other in sorted(kept, reverse=True)[KEEP - 1:]:  # (this entry is the newest)
            log.info("removing the least recently used packed-expert cache %s (%d packings are kept)", other, KEEP)
            shutil.rmtree(other, ignore_errors=True)
