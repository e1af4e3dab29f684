"""Checkpoint formats: one reader per format behind the small interface of ``base.Reader``.

    base.py         the interface (Reader, TensorRef, ReadJob), LoadError, the bounded read-ahead stream
    safetensors.py  Hugging Face safetensors checkpoints, sharded or single-file, unquantized or FP8 block-scaled,
                    compressed-tensors pack-quantized, MXFP4 (their parts merged into one ref per tensor)
    codecs.py       how a quantized tensor's stored bytes decode (and when they are a native format exactly)
    gguf.py         GGUF (llama.cpp) files, single or split: config from the metadata (gguf_config.py), ggml
                    quant types decoded by gguf_codecs.py; needs the gguf package (the ``gguf`` extra)
    hf_keys.py      Hugging Face checkpoint keys -> model tensors; expert slices -> native expert matrices

``open_checkpoint(path)`` returns the reader of the first format in ``READERS`` that recognizes ``path``. A new
format adds its reader class there.
"""
from __future__ import annotations

from pathlib import Path

from ktinject.injection.formats.base import LoadError, Reader
from ktinject.injection.formats.gguf import GGUFReader
from ktinject.injection.formats.safetensors import SafetensorsReader

#: the formats ktinject reads, tried in this order
READERS: tuple[type[Reader], ...] = (SafetensorsReader, GGUFReader)


def open_checkpoint(path) -> Reader:
    """The reader of the checkpoint at ``path`` (a directory, or one file); LoadError saying what was looked for."""
    if isinstance(path, Reader):
        return path
    path = Path(path)
    for cls in READERS:
        if cls.detect(path):
            return cls(path)
    other = sorted(p.name for p in path.glob("*.bin")) if path.is_dir() else []
    hint = f" (found {', '.join(other[:3])}: PyTorch .bin checkpoints are not supported)" if other else ""
    where = "" if path.exists() else " (no such file or directory)"
    raise LoadError(f"{path}{where}: no checkpoint ktinject can read: expected "
                    f"{' or '.join(cls.expects for cls in READERS)}{hint}")
