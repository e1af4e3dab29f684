"""Moving packed routed experts from their native (CPU) copy onto the device, with (almost) no CPU work: one expert
into a hot-expert bank slot (re-placement), or n experts at once into the dequantized scratch of streamed prefill
(``stream``).

Runtime re-placement (``rebalance``) moves experts while decode runs; the 16 native expert threads
own the CPU then, so a move must not compute on it. The native packed storage of a layer (one mapping per
``native.Experts``, ``ktk_experts_region``) is page-locked once when its bank is made for re-placement
(``PackedRegion``), and a move is, on a side stream:

    H2D copy of the expert's packed region (``ktk_experts_raw``: its three matrices as stored, bf16, int8 + scales,
    int4 + group scales, e4m3 + block scales or e2m1 + e8m0 exponents, and gpt-oss biases; in chunks) into a device
    staging buffer
    unpack on the device (torch ops into preallocated buffers): the block layout of native/src/kernels/kernels.h
    [Np/16][Kp/2][16][2] (bf16), [Np/16][Kp/4][16][4] (int8), nibbles [Np/16][Kp/8][16][4] (int4, mxfp4) or
    [Np/16][Kp][16] (fp8) is permuted into a work buffer [Np, Kp], then its [N, K] corner goes into the slot: a copy
    (bf16) or q * scale in float32 (int8: per row; int4: per row and group of G inputs; fp8: per 16 rows and group;
    mxfp4: e2m1 * 2^(e - 127) per row and 32 inputs, through float32 temporaries of a few rows at a time), rounded
    once to the bank's dtype.

That is half (bf16), about a quarter (int8) or an eighth (int4) of the bytes of the float32 host path
(``HotExperts.host_weights``, ``ktk_experts_get`` on a CPU thread), and bit-identical to it converted to the bank
dtype (both are one float32 product per quantized weight, rounded once). If the region cannot be page-locked,
``StagingPool``: a few pinned host buffers that a worker thread fills with a plain memcpy of the packed bytes (no
conversion), copied the same way.

Legend: N output rows, K input columns, Np = round_up(N, 16), Kp = round_up(K, 64) (int4: round_up(K, max(64, G)),
G the group), I intermediate, H hidden.
"""
from __future__ import annotations

import ctypes
import logging
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from ktinject import native
from ktinject.native import cuda_driver

log = logging.getLogger(__name__)

GPU_QUANTS = ("bf16", "int8", "int4", "fp8", "mxfp4")  # quants with a raw view that unpack_matrix knows
_MXFP4_ROWS = 1 << 22  # mxfp4 unpack: weights per float32 temporary (rows of a matrix at a time)
_tables: dict = {}  # device -> (e2m1 values [16], e8m0 powers of two [256]) as float32
MATRICES = ("gate", "up", "down")


class MatLayout(NamedTuple):
    """One matrix inside an expert's packed region: byte offsets from the region's start (-1: absent)."""

    N: int
    K: int
    Np: int
    Kp: int
    data_off: int
    data_bytes: int
    scale_off: int
    bias_off: int

    def work_bytes(self, quant: str) -> int:
        """Bytes of the work buffer unpacking this matrix needs: the block layout permuted to [Np, Kp] (int4: as
        int8, one byte per weight)."""
        return self.Np * self.Kp if quant in ("int4", "fp8", "mxfp4") else self.data_bytes


class ExpertLayout(NamedTuple):
    """Where gate, up and down lie in every expert's packed region of one native.Experts (the same for each)."""

    quant: str
    expert_bytes: int
    mats: tuple  # (gate, up, down) MatLayout
    group: int = 0  # int4, fp8: inputs per scale (G); 0 for the other quants

    @property
    def work_bytes(self) -> int:
        """Bytes of the work buffer unpack_matrix needs for one expert: the largest matrix's."""
        return max(m.work_bytes(self.quant) for m in self.mats)


def expert_layout(experts) -> ExpertLayout:
    """The layout of ``experts`` (native.Experts, quant in GPU_QUANTS) from ktk_experts_raw."""
    mats = []
    for which in MATRICES:
        first = native.experts_raw(experts, 0, which)
        last = native.experts_raw(experts, experts.num_experts - 1, which)
        rel = lambda r, p: p - r.expert if p else -1  # noqa: E731
        m = MatLayout(first.N, first.K, first.Np, first.Kp, rel(first, first.data), first.data_bytes,
                      rel(first, first.scale), rel(first, first.bias))
        if m != MatLayout(last.N, last.K, last.Np, last.Kp, rel(last, last.data), last.data_bytes,
                          rel(last, last.scale), rel(last, last.bias)):
            raise RuntimeError(f"packed experts: {which} lies differently in the first and the last expert")
        mats.append(m)
    group = int(experts.group_size) if first.quant in ("int4", "fp8") else 0
    return ExpertLayout(first.quant, first.expert_bytes, tuple(mats), group)


# Unpacking works on n experts at once: ``buf`` is uint8 [n, expert_bytes] (n packed regions, rows any distance
# apart), ``dst`` [n, N, K] (any float dtype, rows of any stride), ``work`` uint8 [>= n * work_bytes]. The views are
# made once per buffer (fixed addresses) where a caller unpacks into the same places again (Uploader).
def _matrix_views(buf: torch.Tensor, m: MatLayout, quant: str, work: torch.Tensor, group: int = 0) -> tuple:
    """(quant, src: packed data permuted to the row-major block order of w, w: work in that shape (row-major
    [n, Np, Kp]; None where not needed: bf16 and int8 without padding go straight into place), corner: w's
    [n, N, K], scale: float32 (int8 [n, N, 1], or [n, Np/16, 16, 1, 1] straight; int4 [n, Np/16, 16, Kp/G, 1];
    mxfp4: the e8m0 bytes [n, Np/16, 16, Kp/32]) or None)."""
    if quant not in GPU_QUANTS:
        raise ValueError(f"unpack: quant {quant!r} has no device unpack (expected one of {GPU_QUANTS})")
    if buf.dim() == 1:
        buf = buf.unsqueeze(0)
    n, Np, Kp, N, K = buf.shape[0], m.Np, m.Kp, m.N, m.K
    data = buf[:, m.data_off:m.data_off + m.data_bytes]  # [n, data_bytes]
    if quant == "fp8":  # byte (n, c, j): output 16n + j, input c; a scale per 16 outputs and group of G inputs
        src = data.view(n, Np // 16, Kp, 16).permute(0, 1, 3, 2)  # [n, Np/16, 16, Kp]
        if work.numel() < n * Np * Kp:
            raise ValueError(f"unpack: a work buffer of {work.numel()} bytes for {n} fp8 matrices [{Np}, {Kp}]")
        w = work[:n * Np * Kp].view(n, Np // 16, 16, Kp)
        ng = -(-Kp // group)
        scale = buf[:, m.scale_off:m.scale_off + 4 * (Np // 16) * ng].view(torch.float32).view(n, Np // 16, 1, ng, 1)
        return quant, src, w, w.view(n, Np, Kp)[:, :N, :K], (scale, group)
    if quant == "mxfp4":  # byte (n, r, j) holds inputs 8r + 2j (low nibble) and 8r + 2j + 1 (high)
        src = data.view(n, Np // 16, Kp // 8, 16, 4).permute(0, 1, 3, 2, 4)  # [n, Np/16, 16, Kp/8, 4]
        if work.numel() < n * Np * Kp:
            raise ValueError(f"unpack: a work buffer of {work.numel()} bytes for {n} mxfp4 matrices [{Np}, {Kp}]")
        w = work[:n * Np * Kp].view(n, Np // 16, 16, Kp // 8, 4, 2)  # one e2m1 code a byte, inputs in order
        exps = buf[:, m.scale_off:m.scale_off + Np * Kp // 32].view(n, Np // 16, Kp // 32, 16).permute(0, 1, 3, 2)
        return quant, src, w, w.view(n, Np, Kp)[:, :N, :K], exps  # (a view: read when unpacking)
    if quant == "int4":  # byte (n, r, j) holds inputs 8r + j (low nibble) and 8r + 4 + j (high)
        src = data.view(n, Np // 16, Kp // 8, 16, 4).permute(0, 1, 3, 2, 4)  # [n, Np/16, 16, Kp/8, 4]
        if work.numel() < n * Np * Kp:
            raise ValueError(f"unpack: a work buffer of {work.numel()} bytes for {n} int4 matrices [{Np}, {Kp}]")
        w = work[:n * Np * Kp].view(torch.int8).view(n, Np // 16, 16, Kp // 8, 2, 4)
        ng = Kp // group
        scale = buf[:, m.scale_off:m.scale_off + 4 * Np * ng].view(torch.float32)
        scale = scale.view(n, Np // 16, ng, 16).permute(0, 1, 3, 2).unsqueeze(-1)  # [n, Np/16, 16, ng, 1]
        return quant, src, w, w.view(n, Np, Kp)[:, :N, :K], scale
    dt, c = (torch.bfloat16, 2) if quant == "bf16" else (torch.int8, 4)
    src = data.view(dt).view(n, Np // 16, Kp // c, 16, c).permute(0, 1, 3, 2, 4)  # [n, Np/16, 16, Kp/c, c]
    if N == Np and K == Kp:  # unpadded: straight into place in one pass, no work buffer
        if quant == "bf16":
            return quant, src, None, None, None
        scale = buf[:, m.scale_off:m.scale_off + 4 * Np].view(torch.float32).view(n, Np // 16, 16, 1, 1)
        return quant, src, None, None, scale
    if work.numel() < n * m.data_bytes:
        raise ValueError(f"unpack: a work buffer of {work.numel()} bytes for {n} matrices of {m.data_bytes} bytes")
    w = work[:n * m.data_bytes].view(dt).view(n, Np // 16, 16, Kp // c, c)
    scale = None if quant == "bf16" else buf[:, m.scale_off:m.scale_off + 4 * Np].view(torch.float32)[:, :N, None]
    return quant, src, w, w.view(n, Np, Kp)[:, :N, :K], scale


def _unpack(views: tuple, dst: torch.Tensor) -> None:
    """dst [n, N, K] = the matrices of ``views`` (float32 product q * scale rounded once to dst's dtype, as
    ktk_experts_get + .to)."""
    quant, src, w, corner, scale = views
    if dst.dim() == 2:
        dst = dst.unsqueeze(0)
    if quant == "bf16":
        if w is None:  # unpadded: straight into place, no pass through the work buffer
            dst.view(src.shape).copy_(src)
            return
        w.copy_(src)  # block layout -> [n, Np, Kp] row-major
        dst.copy_(corner)
        return
    if quant == "int8":
        if w is None:
            torch.mul(src, scale, out=dst.view(src.shape))
            return
        w.copy_(src)
        torch.mul(corner, scale, out=dst)
        return
    if quant == "fp8":
        _unpack_fp8(src, w, corner, scale, dst)
        return
    if quant == "mxfp4":
        _unpack_mxfp4(src, w, corner, scale, dst)
        return
    s8 = src.view(torch.int8)  # arithmetic shifts of the signed bytes give the nibbles sign-extended: q in [-8, 7]
    lo = w[..., 0, :]
    torch.bitwise_left_shift(s8, 4, out=lo)  # low nibble to the top (wraps)...
    lo.bitwise_right_shift_(4)  # ...and back, sign-extended
    torch.bitwise_right_shift(s8, 4, out=w[..., 1, :])  # high nibble, sign-extended
    n, nb, _, kq = w.shape[:4]
    ng = scale.shape[3]
    q = w.view(n, nb, 16, ng, kq * 8 // ng)  # [n, Np/16, 16, ng, G]
    N, K = dst.shape[1:]
    if N == nb * 16 and K == kq * 8:
        torch.mul(q, scale, out=dst.view(q.shape))
    else:  # padded matrix (awkward shapes): through a temporary of the padded size
        dst.copy_(torch.mul(q, scale).view(n, nb * 16, kq * 8)[:, :N, :K])


def _unpack_fp8(src, w, corner, scale, dst) -> None:
    """dst = e4m3 * scale of its block: the bytes permuted into ``w``, converted (exactly) to dst's dtype, then one
    float32 product rounded once, in place where the matrix has no padding and whole groups."""
    scale, G = scale
    w.copy_(src)
    n, nb, _, Kp = w.shape
    ng = scale.shape[3]
    N, K = dst.shape[1:]
    if N == nb * 16 and K == Kp and ng * G == Kp and dst.dtype != torch.float32:
        dst.copy_(corner.view(torch.float8_e4m3fn))
        dst.view(n, nb, 16, ng, G).mul_(scale)
        return
    full = scale.expand(n, nb, 16, ng, G).reshape(n, nb * 16, ng * G)[:, :N, :K]
    dst.copy_(corner.view(torch.float8_e4m3fn).float().mul_(full))


def _unpack_mxfp4(src, w, corner, exps, dst) -> None:
    """dst = e2m1 * 2^(e - 127) (float32, exact), rounded once to dst's dtype: the codes split into ``w`` (a byte
    each), then a few rows at a time through float32 tables of the 16 codes and the 256 exponents."""
    if dst.device not in _tables:  # (2^(e - 127) exactly, 2^-127 a float32 subnormal; e 255 is never stored)
        values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
        _tables[dst.device] = (torch.tensor(values, dtype=torch.float32).to(dst.device),
                               torch.exp2(torch.arange(256, dtype=torch.float64) - 127).float().to(dst.device))
    e2m1, e8m0 = _tables[dst.device]
    torch.bitwise_and(src, 15, out=w[..., 0])
    torch.bitwise_right_shift(src, 4, out=w[..., 1])
    N, K = dst.shape[1:]
    rows, groups = max(1, _MXFP4_ROWS // K), K // 32
    for i in range(dst.shape[0]):
        e = exps[i].reshape(-1, exps.shape[-1])  # [Np, Kp/32]
        for r in range(0, N, rows):
            q = corner[i, r:r + rows]  # [rows, K] codes
            scale = e8m0[e[r:r + rows, :groups].int()].repeat_interleave(32, -1)
            dst[i, r:r + rows] = e2m1[q.int()].mul_(scale)


def unpack_matrix(buf: torch.Tensor, m: MatLayout, quant: str, dst: torch.Tensor, work: torch.Tensor,
                  group: int = 0) -> None:
    """dst [N, K] (any float dtype, buf's device) = the matrix ``m`` of the packed region ``buf`` (uint8
    [expert_bytes]), exactly as ktk_experts_get returns it, converted to dst's dtype; or n of them at once: buf
    [n, expert_bytes], dst [n, N, K]. ``work``: uint8 [>= n * m.work_bytes(quant)], scratch; ``group``: int4's G.
    Queued on the current stream; allocates nothing (but for int4 matrices padded to Np, Kp)."""
    _unpack(_matrix_views(buf, m, quant, work, group), dst)


def bias_views(buf: torch.Tensor, layout: ExpertLayout) -> tuple:
    """float32 views of the (gate, up, down) biases in ``buf``: [N] for one region [expert_bytes], [n, N] for n."""
    if any(m.bias_off < 0 for m in layout.mats):
        raise ValueError("unpack: the bank has biases but the packed experts have none")
    return tuple(buf[..., m.bias_off:m.bias_off + 4 * m.Np].view(torch.float32)[..., :m.N] for m in layout.mats)


def _slot_views(hot, slot: int) -> tuple:
    """(gate [I, H], up [I, H], down [H, I]) of bank slot ``slot``, and the same for biases (or None)."""
    I = hot.I
    weights = (hot.gate_up[slot, :I], hot.gate_up[slot, I:], hot.down[slot])
    if hot.gate_up_bias is None:
        return weights, None
    return weights, (hot.gate_up_bias[slot, :I], hot.gate_up_bias[slot, I:], hot.down_bias[slot])


def unpack_expert(buf: torch.Tensor, layout: ExpertLayout, hot, slot: int, work: torch.Tensor) -> None:
    """Bank slot ``slot`` of ``hot`` (HotExperts) = the expert whose packed region is ``buf`` (on the bank's device):
    gate_up [2I, H] (gate rows, then up rows), down [H, I], and the gpt-oss biases when the bank has them."""
    weights, biases = _slot_views(hot, slot)
    for m, dst in zip(layout.mats, weights):
        unpack_matrix(buf, m, layout.quant, dst, work, layout.group)
    if biases is not None:
        for src, dst in zip(bias_views(buf, layout), biases):
            dst.copy_(src)


def unpack_experts(buf: torch.Tensor, layout: ExpertLayout, gate_up: torch.Tensor, down: torch.Tensor,
                   work: torch.Tensor) -> None:
    """The n experts whose packed regions are the rows of ``buf`` (uint8 [n, expert_bytes]) into gate_up
    [n, 2I, H] (gate rows, then up rows) and down [n, H, I]: three batched unpacks (a few kernels each), no loop
    over experts. ``work``: uint8 [>= n * layout.work_bytes]. Biases stay where they are (``bias_views``).
    On CUDA with Triton (KTINJECT_FUSED not 0): one pass by operators.kernels.dequant's kernel instead (bit-identical,
    ``work`` unused)."""
    from ktinject.operators.kernels import dequant  # Triton only at the first CUDA call

    if layout.quant in dequant.QUANT_CODE and dequant.usable(buf, gate_up, down):  # (mxfp4: no kernel, torch ops)
        dequant.unpack_experts(buf, layout, gate_up, down)
        return
    I = layout.mats[0].N
    for m, dst in zip(layout.mats, (gate_up[:, :I], gate_up[:, I:], down)):
        unpack_matrix(buf, m, layout.quant, dst, work, layout.group)


# ---- page-locking the packed storage ------------------------------------------------------------------------------
_pin_lock = threading.Lock()
_pinned: dict[int, int] = {}  # region address -> PackedRegions that pinned it


def _pin(addr: int, nbytes: int) -> bool:
    with _pin_lock:
        if addr in _pinned:
            _pinned[addr] += 1
            return True
        t0 = time.perf_counter()
        try:
            cuda_driver.host_register(addr, nbytes)
        except (OSError, AttributeError, cuda_driver.CudaDriverError) as e:
            log.warning("hot experts: cannot page-lock %.1f MiB of packed experts (%s); moves go through pinned "
                        "staging buffers (a memcpy on a worker thread)", nbytes / 2**20, e)
            return False
        _pinned[addr] = 1
    log.debug("hot experts: page-locked %.1f MiB of packed experts in %.2f s", nbytes / 2**20,
              time.perf_counter() - t0)
    return True


def _unpin(addr: int, experts) -> None:
    """Release one pin of ``addr``; ``experts`` (unused) keeps the mapping alive until then."""
    with _pin_lock:
        n = _pinned.get(addr, 0) - 1
        if n > 0:
            _pinned[addr] = n
            return
        _pinned.pop(addr, None)
        try:
            cuda_driver.host_unregister(addr)
        except Exception as e:  # noqa: BLE001 - at exit the context may be gone already
            log.debug("hot experts: unregistering packed experts: %s", e)


class PackedRegion:
    """The packed storage of one native.Experts as a uint8 CPU tensor [nbytes] over the native mapping (zero copy),
    page-locked for the current CUDA context when ``pin`` (``pinned`` says whether that worked). ``close()``
    (or garbage collection) unpins; no copy from it may be in flight then."""

    def __init__(self, experts, pin: bool = False):
        self.experts = experts  # keeps the mapping alive while the tensor exists
        self.layout = expert_layout(experts)
        addr, self.tensor = native.experts_region_view(experts)  # uint8 [nbytes]
        nbytes = self.tensor.numel()
        self.pinned = bool(pin) and _pin(addr, nbytes)
        self._finalizer = weakref.finalize(self, _unpin, addr, experts) if self.pinned else None

    def expert(self, e: int) -> torch.Tensor:
        """Expert ``e``'s packed region: uint8 [expert_bytes], a view."""
        n = self.layout.expert_bytes
        return self.tensor[e * n:(e + 1) * n]

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
            self.pinned = False


# ---- device side --------------------------------------------------------------------------------------------------
class Uploader:
    """Device buffers for moves on ``device``: staging (uint8 [expert_bytes]) and work (uint8 [work_bytes]), shared
    by every move: all moves are queued on one stream, so one move's copy and unpack never overlap another's.
    ``chunk_bytes``: the H2D copy of an expert is split so that a small copy of the decode step queued behind it on
    the copy engine waits for one chunk at most."""

    def __init__(self, device, expert_bytes: int, work_bytes: int, chunk_bytes: int = 4 << 20):
        self.device = torch.device(device)
        self.staging = torch.empty(expert_bytes, dtype=torch.uint8, device=self.device)
        self.work = torch.empty(work_bytes, dtype=torch.uint8, device=self.device)
        self.chunk = max(1 << 16, int(chunk_bytes))
        self._views: dict[ExpertLayout, tuple] = {}  # layout -> views of staging/work (made on first use)

    @property
    def nbytes(self) -> int:
        return self.staging.numel() + self.work.numel()

    def upload(self, hot, slot: int, src: torch.Tensor) -> None:
        """On the current stream: slot ``slot`` of ``hot`` = the packed expert region ``src`` (uint8 CPU tensor,
        page-locked for asynchronous copies). The same as unpack_expert, with the buffer views made once per
        layout (a move costs the decode thread a dozen launches)."""
        layout = hot.packed.layout
        n = layout.expert_bytes
        views = self._views.get(layout)
        if views is None:
            if n > self.staging.numel() or layout.work_bytes > self.work.numel():
                raise ValueError(f"Uploader: an expert of {n} bytes does not fit the staging buffers")
            stage = self.staging[:n]
            mats = tuple(_matrix_views(stage, m, layout.quant, self.work, layout.group) for m in layout.mats)
            biases = bias_views(stage, layout) if all(m.bias_off >= 0 for m in layout.mats) else None
            chunks = [(stage[lo:lo + self.chunk], lo) for lo in range(0, n, self.chunk)]
            views = self._views[layout] = (mats, biases, chunks)
        mats, biases, chunks = views
        for dst, lo in chunks:
            dst.copy_(src[lo:lo + dst.numel()], non_blocking=self.device.type == "cuda")
        weights, bias_dsts = _slot_views(hot, slot)
        for v, dst in zip(mats, weights):
            _unpack(v, dst)
        if bias_dsts is not None:
            if biases is None:
                raise ValueError("Uploader: the bank has biases but the packed experts have none")
            for b, dst in zip(biases, bias_dsts):
                dst.copy_(b)


class StagingPool:
    """``count`` host buffers of ``nbytes`` (pinned when ``pin``) filled by one worker thread with a plain memcpy of
    packed bytes (ctypes.memmove: no GIL, no torch threads): the fallback when a region cannot be page-locked."""

    def __init__(self, count: int, nbytes: int, pin: bool):
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(max(1, count))]
        self.free = list(range(len(self.buffers)))
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ktinject-staging")

    def fill(self, src: torch.Tensor) -> tuple[int, Future] | None:
        """(buffer index, Future done when it holds ``src``'s bytes), or None when every buffer is taken."""
        if not self.free:
            return None
        i = self.free.pop()
        dst = self.buffers[i]
        n = src.numel()
        return i, self._worker.submit(ctypes.memmove, dst.data_ptr(), src.data_ptr(), n)

    def view(self, i: int, n: int) -> torch.Tensor:
        return self.buffers[i][:n]

    def release(self, i: int) -> None:
        self.free.append(i)

    def close(self) -> None:
        self._worker.shutdown(wait=True)
