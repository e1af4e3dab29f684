"""Routed experts packed while a checkpoint streams: the read bytes of one tensor (or one expert's slice of it),
decoded where they are quantized, go into the native experts on a few packer threads.

``TensorBytes`` holds the bytes and how they decode (plain dtype or the ref's codec); ``pack_expert`` stores one
expert's matrices (values the experts' format holds exactly are stored as released, others are quantized again and
the error sampled); ``Packer`` runs those jobs with a bounded number in flight.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from ktinject import envs, native
from ktinject.injection.formats.base import LoadError, Reader
from ktinject.injection.formats.hf_keys import Piece, expert_matrices
from ktinject.injection.requant import RequantError
from ktinject.operators.families import set_bias


class Packer:
    """Runs packing jobs on a few threads (native set() releases the GIL and is thread-safe for different
    (expert, matrix)); at most 2 jobs per thread in flight, so the memory they hold stays small."""

    def __init__(self):
        workers = envs.get("KTINJECT_PACK_THREADS") or max(1, min(16, native.physical_cores()))
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="ktinject-pack") if workers > 1 else None
        self.pending: deque = deque()
        self.limit = 2 * workers

    def submit(self, fn, *args) -> None:
        if self.pool is None:
            fn(*args)
            return
        while len(self.pending) >= self.limit:
            self.pending.popleft().result()
        self.pending.append(self.pool.submit(fn, *args))

    def drain(self) -> None:
        while self.pending:
            self.pending.popleft().result()

    def close(self) -> None:
        if self.pool is not None:
            for f in self.pending:
                f.cancel()
            self.pool.shutdown(wait=True)
            self.pending.clear()


class TensorBytes:
    """The bytes of one read tensor (or one expert's slice of it) and how they decode."""

    def __init__(self, ckpt: Reader, ref, buf: torch.Tensor, shape: tuple[int, ...]):
        self.ckpt, self.ref, self.buf, self.shape = ckpt, ref, buf, tuple(shape)

    def values(self) -> torch.Tensor:
        """As the checkpoint's dtype (plain) or decoded to float32 (quantized)."""
        if self.ref.codec is None:
            return self.buf.view(self.ckpt.torch_dtype(self.ref)).view(self.shape)
        try:
            return self.ref.codec.decode(self.buf, self.shape)
        except (RuntimeError, ValueError) as e:
            raise LoadError(f"tensor {self.ref.key!r} in {self.ref.file}: its {self.ref.codec.name} bytes do not "
                            f"decode to {list(self.shape)}: {e}") from None

    def quantized(self, quant: str, group: int | None):
        codec = self.ref.codec
        return None if codec is None else codec.quantized(self.buf, self.shape, quant, group)


def pack_expert(unit, piece: Piece, expert: int, data: TensorBytes, dtype: torch.dtype, buffers,
          requant: RequantError) -> None:
    """Pack one expert's slice of ``piece`` into the unit's native experts (its biases also into the unit's
    float32 copies; nothing into experts the cache will fill); then give the read buffer back. Quantized values
    that are exactly the experts' format are stored as they are; others are decoded and quantized (a quantized
    checkpoint's error then sampled into ``requant``)."""
    spec, stream = unit.stream.spec, unit.stream
    which = "?"
    try:
        exact = data.quantized(stream.quant, stream.group_size)
        if exact is not None:
            q, scale = exact
            for (which, qw), (_, sw) in zip(expert_matrices(spec, piece, q), expert_matrices(spec, piece, scale)):
                unit.experts.set_quantized(expert, which, qw, sw)
        else:
            x = data.values()
            x = x.to(dtype) if data.ref.codec is None else x  # decoded values are quantized from float32
            for which, w in expert_matrices(spec, piece, x):
                if which.endswith("_bias"):
                    set_bias(unit.biases, spec, expert, which, w)
                    if not unit.from_cache:
                        unit.experts.set_bias(expert, which[:-5], w)
                else:
                    unit.experts.set(expert, which, w)
                    if data.ref.codec is not None:
                        requant.sample(unit.entry.name, data.ref.codec.name, stream.quant, unit.experts, expert,
                                       which, w)
    except LoadError:
        raise
    except Exception as e:
        raise LoadError(f"tensor {piece.ref.key!r} in {piece.ref.file}: packing expert {expert} ({which}) "
                        f"of {piece.unit!r} failed: {e}") from e
    buffers.put(data.buf)  # set() copied what it needed
