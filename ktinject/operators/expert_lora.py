"""LoRA on the routed experts of a ``HybridMoE``: per expert e and projection p (gate, up, down),
p_e(x) + scaling * B_e,p A_e,p x, with the base weights frozen in their packed format on the CPU.

How PEFT finds them. Every HybridMoE has an ``experts`` module: E slots, each with ``expert_gate_proj`` [I <- H],
``expert_up_proj`` [I <- H] and ``expert_down_proj`` [H <- I], tiny ``nn.Linear`` stand-ins (``ExpertProjection``:
no weight storage, no state-dict keys; calling one is an error). ``peft.get_peft_model(model,
LoraConfig(target_modules=[..., "expert_gate_proj", "expert_up_proj", "expert_down_proj"]))`` wraps them in PEFT's
own ``lora.Linear`` as it wraps any linear layer, so the adapters are ordinary PEFT parameters
(``...mlp.experts.3.expert_gate_proj.lora_A.default.weight`` [r, H]): trainable, saved by ``save_pretrained`` in
PEFT's format, loaded back by ``PeftModel.from_pretrained``. The names are not transformers 4.x's ``gate_proj`` /
``up_proj`` / ``down_proj``, which PEFT maps to transformers 5.x's fused ``target_parameters``; an inference adapter
with 4.x's per-expert names (``...experts.3.gate_proj``) loads too. The block never calls the wrappers:
``factors`` reads their A, B, scaling and dropout, and the experts' path below uses them. ``attach`` does the same for an adapter loaded for inference (``inject(...,
lora=DIR)``): it cannot be merged into int4 / int8 / fp8 weights without requantizing them, so it is applied on the
CPU at every forward, as in training.

The path (``expert_lora_path``): with expert adapters present, the block's routed experts run on the CPU with the
base products and the adapters' terms in the native library: ``Experts.project`` computes each routed row's product
with its expert's stored gate / up / down weights (and, in the backward, the transposed products) in float32 on the
stored values, ``Experts.lora`` adds B_e,p A_e,p x to it (one pool job over all rows; its backward gives the
adapters' gradients), and torch does the biases, the activation and dropout: the gate / up deltas must enter before
the activation, and the native forward takes no additive term inside an expert (its int8 / bf16 activations would
also round what the adapters train against). The earlier path ran each expert in torch on its weights dequantized
at every forward. The backward is a ``torch.autograd.Function`` that keeps x, ids, weights, g and u (O(R x I)) and
each adapter's A z (O(R x r)), never a dequantized weight; the adapters, the input and the routing weights get
gradients. Adapters train in float32 or bf16 (the products run in float32). Hot (GPU) experts, deferral and graph
capture do not apply to such a block: every expert runs on the CPU, eagerly.

What cannot take it: blocks whose routing weights scale the experts' input (Llama 4): ``unsupported_reason``.

Legend: T tokens, E experts, H hidden, I expert intermediate, k experts per token, r rank, R routed rows.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from ktinject.operators.base import OperatorError

#: the projections' module names inside each expert slot (not gate_proj / up_proj / down_proj: PEFT rewrites those
#: names into ``target_parameters`` of transformers 5.x's fused experts for the Qwen-MoE and Mixtral families)
PROJECTIONS = ("expert_gate_proj", "expert_up_proj", "expert_down_proj")
NATIVE = {"expert_gate_proj": "gate", "expert_up_proj": "up", "expert_down_proj": "down"}
#: an adapter's expert module names: ours, or transformers 4.x's per-expert linear layers (loaded for inference)
_EXPERT_NAME = re.compile(r"(.*)\.experts\.(\d+)\.(?:expert_)?(gate|up|down)_proj")


class ExpertProjection(nn.Linear):
    """A stand-in ``nn.Linear`` [out <- in] of one routed expert's projection, for PEFT to wrap: no weight storage
    (``weight`` is an empty float32 CPU tensor, a plain attribute, so that PEFT puts the adapters on the CPU in
    float32 and the state dict has no key for it)."""

    def __init__(self, in_features: int, out_features: int, flag: dict):
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.empty(0)  # (plain attribute: not a parameter nor a buffer)
        self.register_parameter("bias", None)
        self._flag = flag

    def forward(self, x):
        raise OperatorError("a routed expert's projection is not called on its own: its block (HybridMoE) computes "
                            "the experts, with their LoRA adapters where PEFT added some")


class ExpertSlot(nn.Module):
    """One expert's three projections; setting one (PEFT's wrapper) marks the block as adapted."""

    def __init__(self, hidden: int, intermediate: int, flag: dict):
        super().__init__()
        object.__setattr__(self, "_flag", flag)
        self.expert_gate_proj = ExpertProjection(hidden, intermediate, flag)
        self.expert_up_proj = ExpertProjection(hidden, intermediate, flag)
        self.expert_down_proj = ExpertProjection(intermediate, hidden, flag)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name in PROJECTIONS and not isinstance(value, ExpertProjection):
            self._flag["wrapped"] = True


class ExpertSlots(nn.ModuleList):
    """The ``experts`` module of a HybridMoE: E ``ExpertSlot``."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        flag = {"wrapped": False}
        super().__init__([ExpertSlot(hidden, intermediate, flag) for _ in range(num_experts)])
        object.__setattr__(self, "flag", flag)


def slots(spec) -> ExpertSlots:
    return ExpertSlots(spec.num_experts, spec.hidden, spec.intermediate)


def unsupported_reason(block) -> str | None:
    """Why ``block`` cannot take expert LoRA, or None."""
    if block.spec.weights_input:
        return (f"{block.class_name}'s routing weights scale each expert's input (Llama 4), which the expert LoRA "
                f"path does not implement")
    return None


@dataclass
class Factors:
    """The adapters of one block, per projection (gate_proj, up_proj, down_proj): A [E, r, in] and B [E, out, r]
    (scaling folded in), float32 on the CPU, differentiable where they come from trainable parameters; ``dropout``:
    the probability applied to the projection's input before A (0 in eval mode)."""

    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    dropout: dict[str, float]


def _peft_pairs(module: nn.Module, where: str) -> list[tuple[torch.Tensor, torch.Tensor, float, float]]:
    """(A [r, in], B [out, r], dropout p, scaling) of each active adapter of a PEFT-wrapped projection."""
    if getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
        return []
    out = []
    for name in getattr(module, "active_adapters", ()):
        if name not in module.lora_A:
            continue
        if getattr(module, "use_dora", {}).get(name) or getattr(module, "lora_bias", {}).get(name):
            raise OperatorError(f"{where}: DoRA and LoRA biases are not supported on the routed experts; train "
                                f"without use_dora / lora_bias")
        drop = module.lora_dropout[name]
        p = float(drop.p) if isinstance(drop, nn.Dropout) and drop.training else 0.0
        out.append((module.lora_A[name].weight, module.lora_B[name].weight, p, float(module.scaling[name])))
    return out


def factors(block, name: str = "") -> Factors | None:
    """The expert adapters of ``block`` (PEFT's wrappers on its ``experts`` slots and adapters ``attach``ed for
    inference), or None when it has none; an OperatorError for a block that cannot take them."""
    ex = block.__dict__.get("_modules", {}).get("experts")
    attached = block.__dict__.get("expert_lora")
    wrapped = isinstance(ex, ExpertSlots) and ex.flag["wrapped"]
    if not wrapped and not attached:
        return None
    where = name or block.class_name
    pairs: dict[str, list[list]] = {p: [[] for _ in range(block.num_experts)] for p in PROJECTIONS}
    if wrapped:
        for e, slot in enumerate(ex):
            for p in PROJECTIONS:
                m = slot._modules[p]
                if not isinstance(m, ExpertProjection):
                    pairs[p][e] += _peft_pairs(m, f"{where}.experts.{e}.{p}")
    for p, (a, b) in (attached or {}).items():
        for e in range(block.num_experts):
            pairs[p][e].append((a[e], b[e], 0.0, 1.0))
    if not any(any(per) for per in pairs.values()):
        return None
    why = unsupported_reason(block)
    if why is not None:
        raise OperatorError(f"expert LoRA on {where}: {why}; target the attention / dense modules only")
    out = Factors({}, {}, {})
    for p, per in pairs.items():
        if not any(per):
            continue
        ps = {q for pe in per for (_, _, q, _) in pe}
        if len(ps) > 1:
            raise OperatorError(f"expert LoRA on {where}: the {p} adapters have different dropouts {sorted(ps)}")
        out.a[p], out.b[p] = _stack(per, block, p)
        out.dropout[p] = ps.pop()
    return out


def _stack(per: list[list], block, p: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A [E, r, in], B [E, out, r] (scaled) float32 CPU from each expert's (A, B, dropout, scaling) adapters (ranks
    concatenated; experts without one, or with a smaller rank, padded with zeros: an exact zero delta). One scaling
    for every expert (PEFT's usual case) multiplies the stacked B once, not each expert's."""
    H, I = block.hidden_size, block.intermediate_size
    fan_in, fan_out = (I, H) if p == "expert_down_proj" else (H, I)
    cpu = lambda t: t.to(device="cpu", dtype=torch.float32)  # noqa: E731  (differentiable)
    scales = {s for pe in per for (_, _, _, s) in pe}
    common = scales.pop() if len(scales) == 1 and all(len(pe) <= 1 for pe in per) else None
    rows = []
    for pe in per:
        if not pe:
            rows.append(None)
        elif common is not None:
            rows.append((cpu(pe[0][0]), cpu(pe[0][1])))
        else:
            rows.append((torch.cat([cpu(a) for a, _, _, _ in pe]),
                         torch.cat([cpu(b) * s for _, b, _, s in pe], dim=1)))
    r = max(a.shape[0] for a, _ in filter(None, rows))
    As, Bs = [], []
    for ab in rows:
        a, b = ab if ab is not None else (torch.zeros(0, fan_in), torch.zeros(fan_out, 0))
        if tuple(a.shape[1:]) != (fan_in,) or b.shape[0] != fan_out:
            raise OperatorError(f"expert LoRA on {block.class_name}: the {p} adapter of shapes {tuple(a.shape)}, "
                                f"{tuple(b.shape)} does not fit [{fan_out}, {fan_in}]")
        pad = r - a.shape[0]
        As.append(torch.nn.functional.pad(a, (0, 0, 0, pad)) if pad else a)
        Bs.append(torch.nn.functional.pad(b, (0, pad)) if pad else b)
    B = torch.stack(Bs)
    return torch.stack(As), B if common is None or common == 1.0 else B * common


def split_name(name: str) -> tuple[str, int, str] | None:
    """(block name, expert, projection) of a routed expert projection's module name, else None."""
    m = _EXPERT_NAME.fullmatch(name)
    return None if m is None else (m.group(1), int(m.group(2)), f"expert_{m.group(3)}_proj")


def attach(block, name: str, pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]) -> None:
    """Apply an inference adapter to ``block`` (named ``name``): ``pairs`` (expert, projection) -> (A [r, in],
    B [out, r], scaling), kept frozen (float32, CPU) as ``block.expert_lora`` beside any attached before (their
    ranks concatenated); every check runs before the block changes."""
    why = unsupported_reason(block)
    if why is not None:
        raise OperatorError(f"expert LoRA on {name}: {why}")
    current = dict(block.__dict__.get("expert_lora") or {})
    for p in PROJECTIONS:
        per = [[] for _ in range(block.num_experts)]
        for (e, q), (a, b, s) in pairs.items():
            if q == p:
                if not 0 <= e < block.num_experts:
                    raise OperatorError(f"expert LoRA: {name}.experts.{e}.{p}: the block has {block.num_experts} "
                                        f"experts (an adapter for another model)")
                per[e].append((a.detach(), b.detach() * s, 0.0, 1.0))
        if not any(per):
            continue
        if p in current:
            old_a, old_b = current[p]
            for e in range(block.num_experts):
                per[e].insert(0, (old_a[e], old_b[e], 0.0, 1.0))
        current[p] = _stack(per, block, p)
    block.expert_lora = current
