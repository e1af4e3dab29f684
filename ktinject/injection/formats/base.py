"""The reader interface every checkpoint format implements, and what the formats share.

A ``Reader`` is opened on a checkpoint (a directory, or one file) and lists every tensor it holds as a
``TensorRef`` (key, dtype name, shape, file, byte range) from the headers alone, checking them (a missing shard, a
truncated or corrupted file are a LoadError naming the file and tensor). The streaming loader (``ktinject.injection.loading``)
maps the keys to the model (``hf_keys``), plans ``ReadJob``s (byte ranges) and ``stream``s them: positional reads
from one reader thread that stays at most a window of bytes ahead of the consumer. No mmap: mapped pages of a shard
would count as our resident memory while the file is open; the page cache does not.

A format (``safetensors.py``, ``gguf.py``) implements: ``detect`` (does a path hold this format), ``__init__`` (headers -> refs;
a quantized tensor is one ref whose ``codec``, ``codecs.py``, decodes its stored parts), ``torch_dtype`` (what a
ref's bytes read or decode as; None: not readable), ``signature_files`` (what identifies the content, for caches)
and ``check_config`` (does the model config describe what the tensors hold).
"""
from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

_MAX_IO = 1 << 30  # bytes per pread call (Linux caps one call at ~2 GiB)


class LoadError(ValueError):
    """A checkpoint cannot be loaded into the model; the message names the tensor and the file."""


def pread_into(fd: int, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor ``out`` with the bytes at ``offset`` of the open file ``fd``."""
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    done, total = 0, view.nbytes
    while done < total:
        n = os.preadv(fd, [view[done:done + _MAX_IO]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done} ({total - done} bytes missing)")
        done += n


@dataclass(frozen=True)
class Span:
    """A byte range of one file."""

    file: Path
    offset: int
    nbytes: int


@dataclass(frozen=True)
class TensorRef:
    """One tensor of the checkpoint as the model sees it (its key, shape), and where its bytes are.

    A plain tensor (``codec`` None) is ``nbytes`` bytes of ``dtype`` at ``offset`` of ``file``. A quantized one is
    decoded by its ``codec`` (``formats.codecs``) from the bytes of ``spans`` read one after another (e.g. FP8
    values, then their block scales); ``file``, ``offset`` and ``nbytes`` are then its first span's place and the
    spans' total. A tensor whose first dimension indexes experts is read one expert at a time: every span then
    holds that dimension first too (``expert_spans``)."""

    key: str
    file: Path
    dtype: str  # the stored dtype's name ("BF16", "F8_E4M3", ...; a codec's: what it decodes)
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    codec: Any = None  # formats.codecs.Codec, or None for plain bytes of dtype
    spans: tuple[Span, ...] = ()  # codec tensors: every stored part, in the order the codec reads them

    def all_spans(self) -> tuple[Span, ...]:
        return self.spans or (Span(self.file, self.offset, self.nbytes),)

    def expert_spans(self, expert: int) -> tuple[Span, ...]:
        """The bytes of slice ``expert`` of the first dimension (of every span)."""
        E = self.shape[0]
        return tuple(Span(s.file, s.offset + expert * (s.nbytes // E), s.nbytes // E) for s in self.all_spans())


@dataclass(frozen=True)
class ReadJob:
    """Byte ranges to read (into one buffer, one after another) and hand to the consumer with ``what`` (the
    caller's description of them)."""

    what: Any
    spans: tuple[Span, ...]
    reuse: bool = False  # read into a BufferPool buffer (the consumer gives it back) instead of a new one

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.spans)


class BufferPool:
    """Free lists of uint8 buffers by size: reusing them spares the page faults of fresh memory (slow enough to be
    a real share of loading time). Thread-safe; ``put`` a buffer back when its bytes are no longer needed. At most
    ``limit`` bytes are kept (None: no limit); a buffer that would pass it is dropped."""

    def __init__(self, limit: int | None = None):
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._kept, self.limit = 0, limit

    def get(self, nbytes: int) -> torch.Tensor:
        """A buffer of ``nbytes``: a kept one of that size, else a new one, after the kept buffers of other sizes
        are let go where keeping them beside it would pass ``limit`` (largest first)."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._kept -= nbytes
                return free.pop()
            while self.limit is not None and self._kept and self._kept + nbytes > self.limit:
                size = max(k for k, v in self._free.items() if v)
                self._free[size].pop()
                self._kept -= size
        return torch.empty(nbytes, dtype=torch.uint8)

    def put(self, buf: torch.Tensor) -> None:
        with self._lock:
            if self.limit is None or self._kept + buf.numel() <= self.limit:
                self._free.setdefault(buf.numel(), []).append(buf)
                self._kept += buf.numel()


class Reader:
    """A checkpoint's tensors (headers only) and the reading of their bytes. ``dir``: the checkpoint directory;
    ``refs``: every tensor, sorted by file and offset; ``expects``: what ``detect`` looks for (for errors)."""

    expects: str = ""
    dir: Path
    refs: list[TensorRef]
    config_checked = False  # check_config passed on the config the model is built from

    @classmethod
    def detect(cls, path: Path) -> bool:
        """Whether ``path`` (a directory or a file) holds a checkpoint of this format."""
        raise NotImplementedError

    def torch_dtype(self, ref: TensorRef) -> torch.dtype | None:
        """The torch dtype the bytes of ``ref`` hold, or None when ktinject cannot read that dtype (yet)."""
        raise NotImplementedError

    def signature_files(self) -> list[Path]:
        """The files whose (name, size, mtime) identify this checkpoint's content."""
        raise NotImplementedError

    def config(self) -> Any:
        """The model config the checkpoint carries (a transformers ``PretrainedConfig``: GGUF metadata), or None:
        ``config.json`` beside the tensors (``AutoConfig.from_pretrained(dir)``)."""
        return None

    def check_config(self, config: Any) -> None:
        """LoadError when the model config says the weights are stored in a form this reader cannot read (the
        default: any ``quantization_config``; a reader of FP8 / MXFP4 / GGUF tensors accepts its own)."""
        qc = getattr(config, "quantization_config", None)
        if not qc:
            return
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        raise LoadError(f"{self.dir}: the checkpoint is quantized (config.quantization_config, quant_method "
                        f"{method!r}); this reader takes unquantized tensors only")

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
                    if job.reuse and buffers is not None:
                        buf = buffers.get(job.nbytes)
                    else:
                        buf = torch.empty(job.nbytes, dtype=torch.uint8)
                    at = 0
                    for span in job.spans:
                        if fd_path != span.file:
                            if fd is not None:
                                os.close(fd)
                                fd = None
                            fd, fd_path = os.open(span.file, os.O_RDONLY), span.file
                        try:
                            pread_into(fd, span.offset, buf[at:at + span.nbytes])
                        except OSError as e:
                            raise LoadError(f"reading {job.what} from {span.file} failed: {e}") from None
                        at += span.nbytes
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
