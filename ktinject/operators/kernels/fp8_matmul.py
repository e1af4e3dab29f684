"""y = x @ W^T for W kept as an FP8 release stores it: float8 e4m3 values [N, K] and a float32 scale per block of
BN_W x BK_W (``weight_scale_inv``, 128 x 128 in the releases): a Triton W8A16 kernel.

Per program a [BM, BN] tile of y; the K loop steps one scale block (BK_W inputs) at a time: the weight tile's e4m3
values become bf16 in registers (exactly: e4m3's 3 mantissa bits and its exponents fit bf16), ``tl.dot`` with the
activations in bf16 accumulates that block's products in float32, and the block's partial sums are multiplied by
their scales (a vector over the tile's rows: a tile may span several scale rows) before they join the accumulator.
So a weight is read once as one byte (half a bf16 weight's bytes: what decode's memory-bound matmuls are paid by)
and the scales are applied in float32, never rounded into the weights. Activations in float32 are rounded to bf16
for the dot (as a bf16 model's are); the result is written in x's dtype.

``matmul`` runs the kernel on CUDA and the same arithmetic in torch ops elsewhere (dequantized weights, float32
matmul): the reference the GPU tests compare the kernel with. Triton is imported at the first call.
Legend: M rows of x, N outputs, K inputs.
"""
from __future__ import annotations

import functools

import torch

from ktinject.operators.kernels import common as fused


def _build(triton, tl):
    @triton.jit
    def fp8_matmul_k(x, w, s, y, M, N, K, sx, sw, ss, sy, BN_W: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_m = tl.program_id(1)
        pid_n = tl.program_id(0)
        m = pid_m * BM + tl.arange(0, BM)
        n = pid_n * BN + tl.arange(0, BN)
        k = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BK)):
            kk = kb * BK + k
            a = tl.load(x + m[:, None] * sx + kk[None, :], mask=(m[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w + n[:, None] * sw + kk[None, :], mask=(n[:, None] < N) & (kk[None, :] < K), other=0)
            b = b.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            part = tl.dot(a.to(tl.bfloat16), tl.trans(b), out_dtype=tl.float32)
            scale = tl.load(s + (n // BN_W) * ss + kb, mask=n < N, other=0.0)
            acc += part * scale[None, :]
        tl.store(y + m[:, None] * sy + n[None, :], acc.to(y.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))

    return fp8_matmul_k


@functools.cache
def _kernel():
    return fused.define(_build)


def _tiles(M: int) -> tuple[int, int, int]:
    """(BM, BN, warps): few rows (decode) take narrow column tiles, so that enough programs stream the weight."""
    if M <= 16:
        return 16, 32, 4
    if M <= 64:
        return 64, 64, 4
    return 128, 128, 8


def usable(x: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether the kernel runs for ``x``: CUDA, Triton, a scale block of 16+ rows by exactly the kernel's K step (128;
    other widths run the torch path), no autograd to record."""
    return (x.is_cuda and block[1] == 128 and block[0] % 16 == 0 and not (torch.is_grad_enabled() and x.requires_grad)
            and fused.available(x) and _kernel() is not None)


def reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The same product in torch ops: weights dequantized in float32 (e4m3 * block scale), x rounded to bf16 as the
    kernel rounds it, float32 matmul, the result in x's dtype."""
    N, K = weight.shape
    s = scale.float().repeat_interleave(block[0], 0)[:N].repeat_interleave(block[1], 1)[:, :K]
    w = weight.view(torch.float8_e4m3fn).float() * s
    return (x.to(torch.bfloat16).float() @ w.t()).to(x.dtype)


def matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N]; weight uint8 or float8_e4m3fn [N, K], scale float32 [ceil(N/bn), ceil(K/bk)]."""
    N, K = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if not usable(x2, block):
        return reference(x2, weight, scale, block).view(*lead, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight.view(torch.uint8)
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    BM, BN, warps = _tiles(M)
    grid = (-(-N // BN), -(-M // BM))
    with fused.on_device(x2):
        _kernel()[grid](x2, w, scale, y, M, N, K, x2.stride(0), w.stride(0), scale.stride(0), y.stride(0),
                        BN_W=block[0], BM=BM, BN=BN, BK=128, num_warps=warps)
    return y.view(*lead, N)
