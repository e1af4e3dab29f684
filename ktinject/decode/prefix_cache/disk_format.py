"""The block file: ``MAGIC`` (8 bytes), header length (u64 little-endian), a JSON header, then the tensors' raw
bytes back to back. The header names the block's key, each tensor (name, dtype, shape, offset, bytes), the payload
length and its blake2b digest. ``read_block`` checks all of it (magic, lengths, key, digest) and raises
``BlockFileError`` for a damaged, truncated or foreign file; nothing is unpickled.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

MAGIC = b"KTPCBLK1"
SUFFIX = ".ktpc"
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8,
    torch.float8_e4m3fn)}


class BlockFileError(ValueError):
    """A block file that must not be used (damaged, truncated, or another block's)."""


def encode(key: str, tensors: dict[str, torch.Tensor]) -> bytes:
    """The file bytes of block ``key`` holding ``tensors`` (any device; copied to the host)."""
    entries, chunks, offset = [], [], 0
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ValueError(f"prefix cache block {name}: dtype {t.dtype} has no disk form")
        raw = t.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        entries.append({"name": name, "dtype": dtype, "shape": list(t.shape), "offset": offset, "bytes": len(raw)})
        chunks.append(raw)
        offset += len(raw)
    payload = b"".join(chunks)
    header = json.dumps({"key": key, "tensors": entries, "payload_bytes": len(payload),
                         "digest": hashlib.blake2b(payload, digest_size=16).hexdigest()}).encode()
    return MAGIC + struct.pack("<Q", len(header)) + header + payload


def decode(data: bytes, key: str) -> dict[str, torch.Tensor]:
    """The tensors of a block file's bytes, checked to be block ``key``'s; BlockFileError otherwise."""
    if len(data) < len(MAGIC) + 8 or data[:len(MAGIC)] != MAGIC:
        raise BlockFileError("not a prefix cache block (bad magic or shorter than its preamble)")
    (n,) = struct.unpack("<Q", data[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    if start + n > len(data):
        raise BlockFileError(f"truncated: its header runs {start + n} bytes, the file has {len(data)}")
    try:
        header = json.loads(data[start:start + n])
        entries, size, digest = header["tensors"], int(header["payload_bytes"]), header["digest"]
    except (ValueError, KeyError, TypeError) as e:
        raise BlockFileError(f"unreadable header: {e}") from None
    if header.get("key") != key:
        raise BlockFileError(f"foreign block: the file holds key {header.get('key')!r}, not {key}")
    payload = data[start + n:]
    if len(payload) != size:
        raise BlockFileError(f"truncated or padded: {len(payload)} payload bytes, the header says {size}")
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != digest:
        raise BlockFileError("checksum mismatch: the payload is damaged")
    out = {}
    try:
        for e in entries:
            raw = bytearray(payload[e["offset"]:e["offset"] + e["bytes"]])
            t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            out[e["name"]] = t.view(_DTYPES[e["dtype"]]).reshape(e["shape"])
    except (KeyError, RuntimeError, TypeError, ValueError) as e:
        raise BlockFileError(f"a tensor entry does not fit its bytes: {e}") from None
    return out


def write_block(path: Path, key: str, tensors: dict[str, torch.Tensor]) -> int:
    """Write block ``key`` to ``path`` atomically (a temporary file renamed); the bytes written."""
    data = encode(key, tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return len(data)


def read_block(path: Path, key: str) -> dict[str, torch.Tensor]:
    """Block ``key`` from ``path``; BlockFileError where the file is not exactly that block."""
    return decode(Path(path).read_bytes(), key)
