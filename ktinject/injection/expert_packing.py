"""Routed experts packed while a checkpoint streams: the read bytes of one tensor (or one expert's slice of it),
decoded where they are quantized, go into the native experts on a few packer threads.

``TensorBytes`` holds the bytes and how they decode (plain dtype or the ref's codec); ``pack_expert`` stores one
expert's matrices (values the experts' format holds exactly are stored as released: MXFP4 bytes into mxfp4
experts as they are, others are quantized again and the error sampled; ``fp8_blocks`` fits e4m3 values and group
scales into the native fp8 layout); ``Packer`` runs
those jobs with a bounded number in flight.
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


def _malloc_trim():
    """glibc's malloc_trim, or None elsewhere (another C library: nothing to trim)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


class Packer:
    """Runs packing jobs on a few threads (native set() releases the GIL and is thread-safe for different
    (expert, matrix)); at most 2 jobs per thread in flight, so the memory they hold stays small. After each job the
    C heap's free memory goes back to the OS (glibc's malloc_trim): a job's decoded float32 temporaries (megabytes
    each) would otherwise stay in the packer threads' malloc arenas, and the process's peak grow through the load."""

    def __init__(self):
        workers = envs.get("KTINJECT_PACK_THREADS") or max(1, min(16, native.physical_cores()))
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="ktinject-pack") if workers > 1 else None
        self.pending: deque = deque()
        self.limit = 2 * workers
        self._trim = _malloc_trim()

    def _run(self, fn, *args) -> None:
        try:
            fn(*args)
        finally:
            if self._trim is not None:
                self._trim(0)

    def submit(self, fn, *args) -> None:
        if self.pool is None:
            self._run(fn, *args)
            return
        while len(self.pending) >= self.limit:
            self.pending.popleft().result()
        self.pending.append(self.pool.submit(self._run, fn, *args))

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

    def values(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """As the checkpoint's dtype (plain) or decoded to float32 (quantized); with ``dtype``, quantized values are
        decoded straight to it (``Codec.decode_as``: the same values as decoding and casting)."""
        if self.ref.codec is None:
            return self.buf.view(self.ckpt.torch_dtype(self.ref)).view(self.shape)
        try:
            if dtype is not None:
                return self.ref.codec.decode_as(self.buf, self.shape, dtype)
            return self.ref.codec.decode(self.buf, self.shape)
        except (RuntimeError, ValueError) as e:
            raise LoadError(f"tensor {self.ref.key!r} in {self.ref.file}: its {self.ref.codec.name} bytes do not "
                            f"decode to {list(self.shape)}: {e}") from None

    def quantized(self, quant: str, group: int | None):
        codec = self.ref.codec
        return None if codec is None else codec.quantized(self.buf, self.shape, quant, group)

    def mxfp4_parts(self):
        """``Codec.mxfp4_parts``: the stored e2m1 pairs and e8m0 exponents, or None (not MXFP4)."""
        return None if self.ref.codec is None else self.ref.codec.mxfp4_parts(self.buf, self.shape)

    def fp8_parts(self, group: int | None):
        """``Codec.fp8_parts`` where its groups are the experts' ``group``, else None."""
        parts = None if self.ref.codec is None else self.ref.codec.fp8_parts(self.buf, self.shape)
        return parts if parts is not None and parts[2] == group else None


def fp8_blocks(q: torch.Tensor, scale: torch.Tensor, group: int,
               rows: int = 16) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One matrix for native fp8 experts (``Experts.set_fp8``): (e4m3 bytes uint8 [N, K], float32 scales
    [ceil(N/rows), ceil(K/group)]) holding exactly the values q * scale (q [N, K] as from ``Codec.fp8_parts``, scale
    [N, ceil(K/group)]), or None where no such pair exists (a block's values do not fit e4m3 under one scale).

    Each block of ``rows`` x ``group`` takes the largest scale of its rows (a release's block scale, or the largest
    power of two of MXFP4's), times the power of two that brings its largest value closest to e4m3's 448; where the
    rows' scales are equal and q is already e4m3 bytes, the bytes are kept as they are."""
    N, K = q.shape
    ng = -(-K // group)
    if tuple(scale.shape) != (N, ng):
        raise LoadError(f"fp8: scales of shape {list(scale.shape)} for a [{N}, {K}] matrix in groups of {group}")
    nb = -(-N // rows)
    pad = nb * rows - N
    s_rows = torch.nn.functional.pad(scale.float(), (0, 0, 0, pad)).view(nb, rows, ng)
    block = s_rows.amax(1)  # [nb, ng]
    if q.dtype == torch.uint8:
        full = torch.nn.functional.pad(scale.float(), (0, 0, 0, pad), value=float("nan")).view(nb, rows, ng)
        if bool(((full == block.unsqueeze(1)) | full.isnan()).all()):
            return q, block
        q = q.view(torch.float8_e4m3fn).float()
    ratio = (scale.float() / block.repeat_interleave(rows, 0)[:N]).nan_to_num_(0.0)  # 0 / 0: an all-zero block
    ratio = ratio.repeat_interleave(group, 1)[:, :K]
    v = q.float() * ratio  # exact: ratios of powers of two, or equal scales
    amax = torch.nn.functional.pad(v.abs(), (0, ng * group - K, 0, pad)).view(nb, rows, ng, group).amax((1, 3))
    lift = torch.exp2(torch.floor(torch.log2(448.0 / amax.clamp_min(2.0 ** -120)))).clamp(max=2.0 ** 100)
    v = v * lift.repeat_interleave(rows, 0)[:N].repeat_interleave(group, 1)[:, :K]
    q8 = v.to(torch.float8_e4m3fn)
    if not bool((q8.float() == v).all()):
        return None
    return q8.view(torch.uint8), block / lift


def pack_expert(unit, piece: Piece, expert: int, data: TensorBytes, dtype: torch.dtype, buffers,
          requant: RequantError) -> None:
    """Pack one expert's slice of ``piece`` into the unit's native experts (its biases also into the unit's
    float32 copies; nothing into experts the cache will fill); then give the read buffer back. Quantized values
    that are exactly the experts' format are stored as they are; others are decoded and quantized (a quantized
    checkpoint's error then sampled into ``requant``)."""
    spec, stream = unit.stream.spec, unit.stream
    which = "?"
    try:
        mx = data.mxfp4_parts() if stream.quant == "mxfp4" else None
        if mx is not None:  # the release's bytes, as they are (expert_matrices slices output rows only)
            for (which, bw), (_, sw) in zip(expert_matrices(spec, piece, mx[0]), expert_matrices(spec, piece, mx[1])):
                unit.experts.set_mxfp4(expert, which, bw, sw)
            buffers.put(data.buf)
            return
        fp8 = data.fp8_parts(stream.group_size) if stream.quant == "fp8" else None
        blocks = None
        if fp8 is not None:
            q, scale, group = fp8
            blocks = [(which, fp8_blocks(qw, sw, group)) for (which, qw), (_, sw)
                      in zip(expert_matrices(spec, piece, q), expert_matrices(spec, piece, scale))]
            blocks = None if any(b is None for _, b in blocks) else blocks
        exact = None if fp8 is not None else data.quantized(stream.quant, stream.group_size)
        if blocks is not None:
            for which, (qw, sw) in blocks:
                unit.experts.set_fp8(expert, which, qw, sw)
        elif exact is not None:
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
