"""The "rmsnorm" operator: Hugging Face RMSNorm modules as one fused ``torch.rms_norm`` call.

HF's RMSNorm is eight elementwise/reduction kernels (cast, pow, mean, add, rsqrt, mul, cast, mul weight); a decode
step of a Qwen3-30B-A3B-shaped model runs four per layer (input, post-attention, q and k norms), 1,500 small
kernels per token. ``torch.rms_norm`` is one kernel on CUDA. The arithmetic is the same normalization in float32;
the fused kernel rounds once at the end where HF rounds the normalized value to the input dtype and then multiplies
by the weight in that dtype (GptOssRMSNorm and DeepseekV4RMSNorm multiply in float32 first, as the fused kernel
does), so in bf16 the two differ by about one bf16 ulp, and the fused result is the closer one to float64
(tests/operators/test_norm.py).

Only the classes in ``KNOWN`` are taken (all ``weight * x * rsqrt(mean(x^2) + eps)``, eps in ``variance_epsilon``;
``EPS_ATTR``: the same with eps under another name),
and the zero-centered ones in ``ZERO_CENTERED`` (Qwen3-Next, Qwen3.5: ``(1 + weight) * x * rsqrt(...)`` in float32,
eps in ``eps``), which become a ``ZeroCenteredRMSNorm`` (one float32 ``torch.rms_norm`` and the scale: HF's
arithmetic, in its order); another class is refused with its name (e.g. Gemma's norm, which rounds otherwise). The
fused modules keep the ``weight`` parameter under the same name, so state-dict keys do not change. Only
``FusedRMSNorm`` feeds the decode layer's fused residual add + norm (``fuse_problem``): the zero-centered scale is
not the weight that kernel multiplies by. The attention operator fuses the
norms inside attention modules too (q/k norms, DeepSeek's MLA norms) with ``fuse_children``.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch import nn

from ktinject.operators import register
from ktinject.operators.base import Operator, OperatorError, tensor_bytes

log = logging.getLogger(__name__)

#: HF RMSNorm classes whose forward is weight * normalize(x), eps in ``variance_epsilon``
KNOWN = frozenset({"Qwen3MoeRMSNorm", "Qwen2MoeRMSNorm", "MixtralRMSNorm", "OlmoeRMSNorm", "DeepseekV2RMSNorm",
                   "DeepseekV3RMSNorm", "Glm4MoeRMSNorm", "GptOssRMSNorm", "MiniMaxM2RMSNorm", "Glm4MoeLiteRMSNorm",
                   "Ernie4_5_MoeRMSNorm", "HunYuanMoEV1RMSNorm", "Dots1RMSNorm", "DeepseekV32RMSNorm",
                   "GlmMoeDsaRMSNorm", "DeepseekV4RMSNorm"})
#: HF RMSNorm classes of the same formula that keep their eps under another name (class -> attribute); the decode
#: paths read ``variance_epsilon`` of HF norms that pass ``fuse_problem``, so these pass only ``replace_problem``
EPS_ATTR = {"Llama4TextRMSNorm": "eps"}
#: HF RMSNorm classes whose forward is ((1 + weight) * normalize(x)) in float32, cast back; eps in ``eps``
ZERO_CENTERED = frozenset({"Qwen3NextRMSNorm", "Qwen3_5MoeRMSNorm"})


class FusedRMSNorm(nn.Module):
    """``torch.rms_norm(x, (H,), weight, eps)``; the HF formula when x and weight dtypes differ (fused needs one)."""

    def __init__(self, weight: nn.Parameter, eps: float, class_name: str):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = float(eps)
        self.class_name = class_name
        self._shape = (int(weight.shape[0]),)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        pre = take_prenormed(hidden_states, self)  # computed with the residual add that made hidden_states
        if pre is not None:
            return pre
        if hidden_states.dtype == self.weight.dtype:
            return torch.rms_norm(hidden_states, self._shape, self.weight, self.variance_epsilon)
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * x).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.class_name}, {self._shape[0]}, eps={self.variance_epsilon:g}, fused"


class ZeroCenteredRMSNorm(nn.Module):
    """``((1 + weight) * rms_norm(x))`` in float32, cast to x's dtype: HF's zero-centered RMSNorm in fewer kernels."""

    def __init__(self, weight: nn.Parameter, eps: float, class_name: str):
        super().__init__()
        self.weight = weight
        self.eps = float(eps)
        self.class_name = class_name
        self._shape = (int(weight.shape[0]),)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = torch.rms_norm(hidden_states.float(), self._shape, None, self.eps)
        return (x * (1.0 + self.weight.float())).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"{self.class_name}, {self._shape[0]}, eps={self.eps:g}, zero-centered, fused"


def _weight_and_eps_problem(module: nn.Module, eps_attr: str) -> str | None:
    """Why ``module`` (a ``ZERO_CENTERED`` or ``EPS_ATTR`` class) has no 1-D weight and numeric eps, or None."""
    w = getattr(module, "weight", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 1:
        return f"its weight is {None if w is None else tuple(w.shape)}, expected a 1-D parameter"
    if not isinstance(getattr(module, eps_attr, None), (int, float)):
        return f"it has no numeric {eps_attr}"
    return None


def fuse_problem(module: nn.Module) -> str | None:
    """Why ``module`` cannot become a FusedRMSNorm, or None when it can."""
    cname = type(module).__name__
    if cname not in KNOWN:
        return (f"its class {cname} is not a known HF RMSNorm (known: "
                f"{', '.join(sorted(KNOWN | ZERO_CENTERED | set(EPS_ATTR)))}); "
                f"other norms would compute something else")
    w = getattr(module, "weight", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 1:
        return f"its weight is {None if w is None else tuple(w.shape)}, expected a 1-D parameter"
    if not isinstance(getattr(module, "variance_epsilon", None), (int, float)):
        return "it has no numeric variance_epsilon"
    return None


def rounds_twice(module: nn.Module) -> bool:
    """Whether ``module`` (a FusedRMSNorm or a ``KNOWN`` class) rounds the normalized value to the input dtype
    before the weight (HF's classes but GptOssRMSNorm and DeepseekV4RMSNorm), rather than once at the end."""
    return not isinstance(module, FusedRMSNorm) and type(module).__name__ not in ("GptOssRMSNorm", "DeepseekV4RMSNorm")


# The decoder layer's decode forward (decode/layer.py) ends with the residual add; the kernel that adds
# can normalize the sum for the next norm too. The sum carries that result, and the norm takes it instead of
# normalizing again when it is still valid: the same norm module, weight and eps, neither tensor changed since.
_PRENORMED = "_ktinject_prenormed"


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter: no way to see a change, so no reuse
        return None


def attach_prenormed(x: torch.Tensor, norm: nn.Module, y: torch.Tensor) -> None:
    """Record on ``x`` that ``norm(x)`` is ``y`` (see above); nothing where versions are not tracked."""
    vx, vw = _version(x), _version(norm.weight)
    if vx is not None and vw is not None:
        x.__dict__[_PRENORMED] = (norm, norm.weight, vw, float(norm.variance_epsilon), vx, y)


def take_prenormed(x: torch.Tensor, norm: nn.Module) -> torch.Tensor | None:
    """``norm(x)`` as ``attach_prenormed`` recorded it, or None when there is none or it no longer holds."""
    pre = x.__dict__.get(_PRENORMED)
    if pre is None:
        return None
    m, w, vw, eps, vx, y = pre
    ok = m is norm and w is norm.weight and vw == _version(w) and eps == norm.variance_epsilon and vx == _version(x)
    return y if ok else None


def replace_problem(module: nn.Module) -> str | None:
    """Why the rmsnorm operator cannot take ``module`` (plain or zero-centered), or None when it can."""
    cname = type(module).__name__
    if cname in ZERO_CENTERED or cname in EPS_ATTR:
        return _weight_and_eps_problem(module, EPS_ATTR.get(cname, "eps"))
    return fuse_problem(module)


def fuse(module: nn.Module) -> nn.Module:
    """A FusedRMSNorm (a ZeroCenteredRMSNorm for the ``ZERO_CENTERED`` classes) sharing ``module``'s weight
    (``module`` must pass ``replace_problem``)."""
    cname = type(module).__name__
    if cname in ZERO_CENTERED:
        return ZeroCenteredRMSNorm(module.weight, module.eps, cname)
    return FusedRMSNorm(module.weight, getattr(module, EPS_ATTR.get(cname, "variance_epsilon")), cname)


def fuse_children(module: nn.Module) -> int:
    """Replace every known RMSNorm below ``module`` by its fused module in place; returns how many."""
    n = 0
    for name, child in list(module.named_modules()):
        if name and replace_problem(child) is None:
            parent, _, attr = name.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, attr, fuse(child))
            n += 1
    return n


@register("rmsnorm")
class RMSNormOperator(Operator):
    """Replace a known HF RMSNorm by one fused kernel call (zero-centered ones: one and the scale) on ``device``."""

    kwargs_allowed = frozenset()

    @classmethod
    def check(cls, module: nn.Module, name: str, kwargs: Mapping[str, Any]) -> None:
        problem = replace_problem(module)
        if problem:
            raise OperatorError(f"rmsnorm: cannot take module {name!r} ({type(module).__name__}): {problem}")

    @classmethod
    def placement(cls, module: nn.Module, kwargs: Mapping[str, Any], device: torch.device) -> dict[str, int]:
        return {str(torch.device(device)): tensor_bytes(module)}

    @classmethod
    def build(cls, module: nn.Module, name: str, kwargs: Mapping[str, Any], device: torch.device) -> nn.Module:
        return fuse(module.to(device))


