"""Dense projections kept in an FP8 release's own bits on the GPU (``from_pretrained(..., dense_fp8=...)``).

An FP8 checkpoint (DeepSeek-V3, Kimi-K2, GLM-4.5+, MiniMax-M2, Qwen3 FP8) stores most ``nn.Linear`` weights as
float8 e4m3 with a float32 scale per 128 x 128 block. By default the loader dequantizes them to the model dtype;
with ``dense_fp8`` it keeps those of the chosen kinds as they are, in ``FP8Linear`` modules that multiply through
``kernels.fp8_matmul`` (W8A16: half the bytes of bf16 weights to read per decode step, and half the GPU memory).

Kinds (``KINDS``): ``attention`` (the projections under a ``self_attn`` module) and ``mlp`` (every other FP8
linear: dense MLP layers, shared experts). ``dense_fp8``: ``"none"`` (the default), ``"attention"``, ``"mlp"`` or
``"all"``. ktinject's fused decode attention joins q/k/v weights of plain ``nn.Linear`` projections; FP8 attention
projections take the attention module's own forward instead (reported by the fast-path report).
"""
from __future__ import annotations

import torch
from torch import nn

from ktinject.operators.kernels import fp8_matmul

KINDS = ("attention", "mlp")
CHOICES = ("none", "attention", "mlp", "all")


def kinds_of(choice: str | None) -> frozenset[str]:
    """The kinds a ``dense_fp8`` choice keeps in FP8; ValueError naming the choices for anything else."""
    choice = "none" if choice is None else choice
    if choice not in CHOICES:
        raise ValueError(f"dense_fp8={choice!r}: use one of {', '.join(CHOICES)} (which FP8 linear weights stay FP8 "
                         f"on the GPU; 'none' dequantizes them to the model dtype)")
    return frozenset(KINDS if choice == "all" else () if choice == "none" else (choice,))


def kind_of(name: str) -> str:
    """``attention`` for a module under a ``self_attn`` module, else ``mlp``."""
    return "attention" if ".self_attn." in f".{name}." else "mlp"


class FP8Linear(nn.Module):
    """``nn.Linear`` with its weight as an FP8 release stores it: e4m3 [out, in] and float32 block scales."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None = None):
        super().__init__()
        N, K = weight.shape
        want = (-(-N // block[0]), -(-K // block[1]))
        if tuple(scale.shape) != want:
            raise ValueError(f"FP8Linear: scales {list(scale.shape)} for a [{N}, {K}] weight in blocks of "
                             f"{block[0]}x{block[1]} (expected {list(want)})")
        self.in_features, self.out_features, self.block = K, N, tuple(block)
        self.register_buffer("weight", weight.view(torch.float8_e4m3fn))
        self.register_buffer("weight_scale_inv", scale.float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_matmul.matmul(x, self.weight, self.weight_scale_inv, self.block)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, "
                f"{self.block[0]}x{self.block[1]} block scales, bias={self.bias is not None}")


def adopt(model: nn.Module, name: str, weight: torch.Tensor, scale: torch.Tensor,
          block: tuple[int, int]) -> FP8Linear:
    """Put an ``FP8Linear`` of ``weight`` (e4m3 [out, in]) and ``scale`` where ``model`` has the ``nn.Linear``
    ``name``; the new module holds the old one's bias tensor itself (still on the meta device while loading), so
    whoever fills that tensor later fills the new module's."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, leaf)
    if type(old) is not nn.Linear or tuple(old.weight.shape) != tuple(weight.shape):
        raise TypeError(f"dense_fp8: {name} is {type(old).__name__} {list(old.weight.shape)}, not an nn.Linear of "
                        f"the FP8 weight's shape {list(weight.shape)}")
    new = FP8Linear(weight, scale, block)
    new._parameters["bias"] = old.bias
    setattr(parent, leaf, new)
    return new
