"""What differs between the MoE blocks of transformers 5.x families, kept as data plus a few small functions.

Every supported block has an ``experts`` module holding fused weights (``gate_up_proj``, ``down_proj``: transformers
5.x's fused experts, ``ktinject.compat``) and a router module (``gate``, or ``router`` for gpt-oss) that returns
``(logits [T,E], top_k_weights [T,k], top_k_index [T,k])``. The rest is a short list of differences:

===============================  =======  =================================  =======  ===========================
block class                      router   shared experts                     layout   returns
===============================  =======  =================================  =======  ===========================
Qwen3MoeSparseMoeBlock           gate     -                                  hf       hidden
OlmoeSparseMoeBlock              gate     -                                  hf       hidden
MixtralSparseMoeBlock            gate     - (router jitter when training)    hf       hidden
Qwen2MoeSparseMoeBlock,          gate     shared_expert * sigmoid(gate(x))   hf       hidden
Qwen3NextSparseMoeBlock,
Qwen3_5MoeSparseMoeBlock
DeepseekV2Moe                    gate     shared_experts(x), always          hf       hidden
DeepseekV3MoE, Glm4MoeMoE,       gate     shared_experts(x), always          hf       hidden
Glm4MoeLiteMoE, Dots1MoE,
DeepseekV32MoE, GlmMoeDsaMoE
Ernie4_5_MoeSparseMoeBlock       gate     shared_experts(x), if configured   hf       hidden
HunYuanMoEV1Moe                  gate (1) shared_mlp(x), always              hf       hidden
MiniMaxM2SparseMoeBlock          gate (2) -                                  hf       hidden
DeepseekV4SparseMoeBlock         gate (4) shared_experts(x), always          hf (5)   hidden
GptOssMLP                        router   -                                  gpt_oss  (hidden, router_scores)
Llama4TextMoe                    router   shared_expert(x), always (3)       llama4   (hidden, router_logits)
===============================  =======  =================================  =======  ===========================

(1) its [E, H] weight is ``gate.wg.weight``; (2) its forward also takes the block's ``e_score_correction_bias``
buffer (sigmoid scores + bias choose the k experts, the scores renormalized weight them), which the hybrid block
keeps under the same name and passes on (``Known.router_args``); (3) Llama 4's router returns (scores [T, E],
logits) and its scores weight each expert's *input* (``BlockSpec.weights_input``: the hybrid block feeds the native
experts x * score per (token, slot) with weight 1, and adds the shared expert of the unweighted x itself);
(4) DeepSeek-V4: a top-k router (score function of the config's ``scoring_func`` plus ``e_score_correction_bias``
choose, the scores renormalized and scaled weight) or, in its ``mlp_layer_types == "hash_moe"`` layers (the block's
``is_hash``), a hash router whose experts are a frozen ``tid2eid[input_ids]`` table: its forward takes the token
ids, which the decoder layer passes to the block (``BlockSpec.token_routed``: the hybrid block passes them on);
(5) with a clamped SwiGLU, silu(min(g, limit)) * clamp(u, -limit, limit), ``limit`` the experts module's
(``swiglu_limit``; the native ``swiglu_limit`` activation, ``BlockSpec.activation``).

Blocks of other classes with the same structure are accepted (found from their attributes) with a warning.
Layouts: ``hf`` is gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I], SiLU; ``gpt_oss`` is gate_up
[E, H, 2I] interleaved (even columns gate, odd up) with biases, down [E, I, H] with bias, clamped SwiGLU;
``llama4`` is ``hf`` transposed: gate_up [E, H, 2I] (gate columns, then up), down [E, I, H], SiLU, no biases.

Legend: T tokens, E experts, H hidden, I expert intermediate, k experts per token.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from ktinject import native
from ktinject.operators.base import OperatorError, tensor_bytes

log = logging.getLogger(__name__)

QUANTS = ("bf16", "int8", "int4", "fp8", "mxfp4")  # int4: group-wise (32, 64 or 128 inputs a scale;
#   native.default_group_size); mxfp4: e2m1 with an e8m0 scale per 32 inputs (the MXFP4 releases' format)
GROUPED_QUANTS = ("int4", "fp8", "mxfp4")  # quants with a group size (fp8: inputs per block scale, 128 unless the
#   release says; mxfp4: always 32)
FP8_GROUP = 128  # fp8 experts' inputs per scale when none is given (the FP8 releases' 128 x 128 blocks)
FP8_BLOCK_ROWS = 16  # fp8 experts' output rows per scale: one per 16-row block holds any release's scales exactly
# gpt-oss's clamped SwiGLU when its experts module does not say (transformers' GptOssExperts defaults)
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


class Known(NamedTuple):
    """What a verified block class is made of (its experts' layout is read from the experts module)."""

    router: str  # attribute holding the router module
    shared: str | None  # shared kind (SHARED_ATTRS); a block whose shared module is None (by config) has none
    returns_scores: bool  # forward returns (hidden, router_scores)
    router_args: tuple[str, ...] = ()  # block attributes the router's forward takes after x, in order
    router_weight: str = "weight"  # the router's [E, H] weight, a path inside the router module
    layout: str | None = None  # the experts' layout where their attributes do not say it (Llama 4's)
    activation: str | None = None  # the experts' native activation where not their layout's ("swiglu_limit")
    token_routed: str | None = None  # block attribute: True where the router takes the token ids (hash routing)


KNOWN_BLOCKS: dict[str, Known] = {
    "Qwen3MoeSparseMoeBlock": Known("gate", None, False),
    "OlmoeSparseMoeBlock": Known("gate", None, False),
    "MixtralSparseMoeBlock": Known("gate", None, False),
    "Qwen2MoeSparseMoeBlock": Known("gate", "gated", False),
    "Qwen3NextSparseMoeBlock": Known("gate", "gated", False),  # Qwen2-MoE's block; hybrid linear attention
    "Qwen3_5MoeSparseMoeBlock": Known("gate", "gated", False),  # likewise (router always renormalizes)
    "DeepseekV2Moe": Known("gate", "always", False),
    "DeepseekV3MoE": Known("gate", "always", False),
    "Glm4MoeMoE": Known("gate", "always", False),
    "Glm4MoeLiteMoE": Known("gate", "always", False),  # GLM-4.7-Flash: DeepSeek-V3's router and block, MLA
    "Dots1MoE": Known("gate", "always", False),  # dots.llm1: DeepSeek-V3's router and block
    "DeepseekV32MoE": Known("gate", "always", False),  # DeepSeek-V3.2: V3's router and block; MLA + indexer
    "GlmMoeDsaMoE": Known("gate", "always", False),  # GLM-5: the same
    "Ernie4_5_MoeSparseMoeBlock": Known("gate", "always", False),  # shared_experts None without shared experts
    "HunYuanMoEV1Moe": Known("gate", "mlp", False, router_weight="wg.weight"),
    "MiniMaxM2SparseMoeBlock": Known("gate", None, False, router_args=("e_score_correction_bias",)),
    "DeepseekV4SparseMoeBlock": Known("gate", "always", False, activation="swiglu_limit", token_routed="is_hash"),
    "GptOssMLP": Known("router", None, True),
    "Llama4TextMoe": Known("router", "unweighted", True, layout="llama4"),  # top-k sigmoid scores weight inputs
}
# attribute names of the shared-expert modules, by shared kind (kept under the same names in the hybrid block)
SHARED_ATTRS: dict[str | None, tuple[str, ...]] = {
    None: (),
    "always": ("shared_experts",),
    "mlp": ("shared_mlp",),  # Hunyuan's always-on shared MLP
    "gated": ("shared_expert", "shared_expert_gate"),
    "unweighted": ("shared_expert",),  # Llama 4's: added by the hybrid block, of the block's unweighted input
}


@dataclass(frozen=True)
class BlockSpec:
    """How to drive one MoE block: names of its parts and the sizes of its routed experts."""

    router: str  # attribute holding the router module
    shared: str | None  # a key of SHARED_ATTRS
    returns_scores: bool  # forward returns (hidden, router_scores) instead of hidden
    layout: str  # "hf" | "gpt_oss"
    num_experts: int  # E
    hidden: int  # H
    intermediate: int  # I
    known: bool  # class is one of KNOWN_BLOCKS (verified against transformers)
    router_args: tuple[str, ...] = ()  # block attributes (tensors) the router's forward takes after x
    activation: str = "silu"  # the native experts' activation: "silu", "gptoss" (gpt_oss layout), "swiglu_limit"
    token_routed: bool = False  # the router's forward takes the token ids [T] after x (DeepSeek-V4's hash layers)

    @property
    def has_bias(self) -> bool:
        return self.layout == "gpt_oss"

    @property
    def weights_input(self) -> bool:
        """The routing weights scale each expert's input, not its output (Llama 4)."""
        return self.layout == "llama4"


#: tensors of an HF experts module that go to native experts (both layouts)
EXPERT_LEAVES = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


@dataclass(frozen=True)
class ExpertStream:
    """What the streaming loader fills for one block: native experts of ``spec`` in ``quant``, from the checkpoint
    tensors of the block's ``experts`` module (fused leaves ``EXPERT_LEAVES``), never materialized in HF layout."""

    spec: BlockSpec
    quant: str
    #: the int4 / fp8 group, decided once here (int4: ``native.default_group_size`` when not given, fp8:
    #: FP8_GROUP; 0 for bf16 / int8), so the plan's bytes, the pack cache's key and the experts built agree whatever
    #: the environment does meanwhile
    group_size: int | None = None

    def __post_init__(self):
        g = self.group_size
        if self.quant not in GROUPED_QUANTS:
            g = 0
        elif self.quant == "mxfp4":  # 32 (checked, with the block's sizes: multiples of 32)
            g = native.Experts.checked_group_size(self.quant, g or None, self.spec.hidden, self.spec.intermediate)
        elif not g:  # None (or a bf16 stream's 0 carried over by dataclasses.replace): decided here
            g = (native.default_group_size(self.spec.hidden, self.spec.intermediate) if self.quant == "int4"
                 else FP8_GROUP)
        else:  # given: checked now, not when the experts are built
            g = native.Experts.checked_group_size(self.quant, g, self.spec.hidden, self.spec.intermediate)
        object.__setattr__(self, "group_size", g)

    def leaf(self, rest: str) -> str | None:
        """The experts leaf named by ``rest`` (a tensor name relative to the block), or None for other tensors."""
        leaf = rest.removeprefix("experts.")
        return leaf if leaf != rest and leaf in EXPERT_LEAVES else None

    @property
    def nbytes(self) -> int:
        return packed_nbytes(self.spec, self.quant, self.group_size or None)

    def new_experts(self, block: nn.Module):
        """Empty native experts for ``block`` (its experts module may be on the meta device)."""
        return new_experts(self.spec, block.experts, self.quant, self.group_size or None)


def _fail(name: str, module: nn.Module, why: str) -> OperatorError:
    return OperatorError(
        f"moe: module {name!r} ({type(module).__name__}) is not a supported MoE block: {why}. The 'moe' operator "
        f"takes a block with an 'experts' module (fused gate_up_proj/down_proj, transformers 5.x) and a router; "
        f"known blocks: {', '.join(sorted(KNOWN_BLOCKS))}. Match the block class, not its experts or router."
    )


def _find_router(module: nn.Module) -> str | None:
    for attr in ("gate", "router"):
        r = getattr(module, attr, None)
        if isinstance(r, nn.Module) and isinstance(getattr(r, "weight", None), torch.Tensor):
            return attr
    return None


def _find_shared(module: nn.Module) -> str | None:
    if isinstance(getattr(module, "shared_experts", None), nn.Module):
        return "always"
    if isinstance(getattr(module, "shared_expert", None), nn.Module):
        if not isinstance(getattr(module, "shared_expert_gate", None), nn.Module):
            return "unsupported"
        return "gated"
    return None


def _expert_layout(name: str, module: nn.Module, experts: nn.Module,
                   layout: str | None = None) -> tuple[str, int, int, int]:
    """(layout, E, H, I) of an experts module, checking shapes and activation; ``layout``: the known block's."""
    gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3):
        raise _fail(name, module, "its 'experts' has no 3-D gate_up_proj/down_proj tensors (per-expert modules "
                    "of transformers 4.x are not supported: use transformers>=5.17)")
    if layout == "llama4":
        E, H, I2 = gu.shape  # [E, H, 2I]: gate columns, then up
        _check_silu(name, module, experts)
        if I2 % 2 or tuple(down.shape) != (E, I2 // 2, H):
            raise _fail(name, module, f"gate_up_proj {tuple(gu.shape)} and down_proj {tuple(down.shape)} disagree "
                        f"(expected down_proj {(E, I2 // 2, H)})")
        return layout, E, H, I2 // 2
    transposed = bool(getattr(experts, "is_transposed", False))
    has_bias = bool(getattr(experts, "has_bias", False)) or isinstance(getattr(experts, "gate_up_proj_bias", None),
                                                                      torch.Tensor)
    if transposed or has_bias:
        if not (transposed and has_bias and getattr(experts, "is_concatenated", False) is False):
            raise _fail(name, module, "its experts mix layouts (only gpt-oss's transposed, interleaved, biased "
                        "layout or the standard fused layout are supported)")
        E, H, I2 = gu.shape  # [E, H, 2I] interleaved
        layout, I = "gpt_oss", I2 // 2
        want_down = (E, I, H)
    else:
        E, I2, H = gu.shape  # [E, 2I, H]
        layout, I = "hf", I2 // 2
        want_down = (E, H, I)
        _check_silu(name, module, experts)
    if I2 % 2 or tuple(down.shape) != want_down:
        raise _fail(name, module, f"gate_up_proj {tuple(gu.shape)} and down_proj {tuple(down.shape)} disagree "
                    f"(expected down_proj {want_down})")
    return layout, E, H, I


def _check_silu(name: str, module: nn.Module, experts: nn.Module) -> None:
    act = getattr(experts, "act_fn", None)
    if act is not None and "silu" not in type(act).__name__.lower():
        raise _fail(name, module, f"its experts use activation {type(act).__name__}; native experts do SiLU")


def inspect_block(module: nn.Module, name: str) -> BlockSpec:
    """The BlockSpec of ``module`` or an OperatorError naming the module, its class and what is missing.

    Reads attributes and shapes only: works on meta-device modules."""
    experts = getattr(module, "experts", None)
    if not isinstance(experts, nn.Module):
        raise _fail(name, module, "it has no 'experts' submodule")
    cls = type(module).__name__
    known = KNOWN_BLOCKS.get(cls)
    layout, E, H, I = _expert_layout(name, module, experts, known.layout if known is not None else None)
    if known is not None:
        router, shared, returns_scores, router_args, weight_path = known[:5]
        if not isinstance(getattr(module, router, None), nn.Module):
            raise _fail(name, module, f"it has no router module '{router}'")
        if shared is not None and getattr(module, SHARED_ATTRS[shared][0], None) is None:
            shared = None  # configured without shared experts (Ernie-4.5 with moe_num_shared_experts: 0)
        for arg in router_args:
            if not isinstance(getattr(module, arg, None), torch.Tensor):
                raise _fail(name, module, f"it has no tensor '{arg}' for its router")
    else:
        router, shared = _find_router(module), _find_shared(module)
        returns_scores, router_args, weight_path = layout == "gpt_oss", (), "weight"
        if router is None:
            raise _fail(name, module, "it has no router ('gate' or 'router' with a weight)")
        if shared == "unsupported":
            raise _fail(name, module, "it has 'shared_expert' without 'shared_expert_gate'")
    owner, _, leaf = weight_path.rpartition(".")
    rw = getattr(getattr(module, router).get_submodule(owner), leaf, None)  # owner "": the router itself
    if not isinstance(rw, torch.Tensor) or tuple(rw.shape) != (E, H):
        shape = tuple(rw.shape) if isinstance(rw, torch.Tensor) else None
        raise _fail(name, module, f"router weight {router}.{weight_path} {shape} does not match {E} experts of "
                    f"hidden {H}")
    activation = _activation_of(name, module, experts, layout, known)
    token_routed = bool(known is not None and known.token_routed and getattr(module, known.token_routed, False))
    return BlockSpec(router, shared, returns_scores, layout, E, H, I, known is not None, router_args, activation,
                     token_routed)


def _activation_of(name: str, module: nn.Module, experts: nn.Module, layout: str, known: Known | None) -> str:
    """The native activation of the block's experts: the layout's, or the known class's (with its ``limit``)."""
    limit = getattr(experts, "limit", None)
    if layout == "gpt_oss":
        return "gptoss"
    if known is not None and known.activation is not None:
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit < float("inf"):
            raise _fail(name, module, f"its experts' clamped activation needs a finite limit > 0 (the config's "
                        f"swiglu_limit), got {limit!r}")
        return known.activation
    if limit is not None:  # a clamp the native experts would silently leave out
        raise _fail(name, module, f"its experts clamp their activation (limit {limit!r}) in a form not verified "
                    f"against native experts")
    return "silu"


def packed_nbytes(spec: BlockSpec, quant: str, group_size: int | None = None) -> int:
    """Bytes the native experts will hold (the packed, padded layout: ``native.Experts.packed_nbytes``).

    About 2 B/weight for bf16, 1 B/weight plus per-row scales for int8, 0.5 B/weight plus a scale per group (32, 64
    or 128) of weights for int4, 0.5 B/weight plus a byte per 32 weights for mxfp4; gpt-oss adds f32 biases. Pure:
    no library load, works for meta-device modules."""
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r}; use one of {', '.join(QUANTS)}")
    return native.Experts.packed_nbytes(spec.num_experts, spec.hidden, spec.intermediate, quant, bias=spec.has_bias,
                                        group_size=group_size)


def experts_nbytes(module: nn.Module) -> int:
    """Bytes of the HF experts module's tensors (what leaves the device when the block is built)."""
    return tensor_bytes(module.experts)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.device.type == "cpu" else t.detach().to("cpu")


def _activation(spec: BlockSpec, experts_module: nn.Module) -> dict:
    """native.Experts' activation keywords for the block (attributes only: works on meta-device modules)."""
    if spec.activation == "swiglu_limit":  # DeepSeek-V4 (limit checked by inspect_block)
        return {"activation": "swiglu_limit", "limit": float(experts_module.limit)}
    if spec.layout != "gpt_oss":
        return {"activation": "silu"}
    return {"activation": "gptoss", "alpha": float(getattr(experts_module, "alpha", GPT_OSS_ALPHA)),
            "limit": float(getattr(experts_module, "limit", GPT_OSS_LIMIT))}


def new_experts(spec: BlockSpec, experts_module: nn.Module, quant: str, group_size: int | None = None):
    """Empty ``native.Experts`` for the block (filled expert by expert, e.g. by the streaming loader)."""
    extra = {"block_rows": FP8_BLOCK_ROWS, "group_size": group_size or FP8_GROUP} if quant == "fp8" else {}
    return native.Experts(spec.num_experts, spec.hidden, spec.intermediate, quant=quant, bias=spec.has_bias,
                          **({"group_size": group_size} | extra), **_activation(spec, experts_module))


def pack_experts(module: nn.Module, spec: BlockSpec, quant: str, name: str, group_size: int | None = None):
    """Hand the block's routed experts to a new ``native.Experts`` (repacked, maybe quantized)."""
    ex = module.experts
    if ex.gate_up_proj.device.type == "meta":
        raise OperatorError(f"moe: the experts of {name!r} ({type(module).__name__}) are on the meta device; load "
                            f"the weights first (ktinject.from_pretrained streams them from the checkpoint)")
    act = _activation(spec, ex)
    if spec.layout == "gpt_oss":
        return native.Experts.from_gpt_oss(
            _cpu(ex.gate_up_proj), _cpu(ex.gate_up_proj_bias), _cpu(ex.down_proj), _cpu(ex.down_proj_bias),
            alpha=act["alpha"], limit=act["limit"], quant=quant, group_size=group_size,
        )
    gate_up, down = _cpu(ex.gate_up_proj), _cpu(ex.down_proj)
    if spec.layout == "llama4":  # [E, H, 2I], [E, I, H]: their transposes (views) are the hf layout
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return native.Experts.from_hf(gate_up, down, quant=quant, group_size=group_size, **act)


def gpt_oss_biases(experts_module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up_bias [E, 2I] as gate then up, down_bias [E, H]) in float32 on the CPU, from HF gpt-oss experts
    (gate_up_proj_bias interleaved: even = gate, odd = up). HybridMoE keeps them (``expert_biases``, tiny next to
    the weights) because the native copy cannot give them back and GPU-resident experts need them."""
    b = experts_module.gate_up_proj_bias.detach().float().cpu()
    return torch.cat([b[:, 0::2], b[:, 1::2]], dim=1), experts_module.down_proj_bias.detach().float().cpu().clone()


def empty_biases(spec: BlockSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (gate_up_bias [E, 2I], down_bias [E, H]) float32, as gpt_oss_biases gives them, for set_bias."""
    E, H, I = spec.num_experts, spec.hidden, spec.intermediate
    return torch.zeros(E, 2 * I), torch.zeros(E, H)


def set_bias(biases: tuple[torch.Tensor, torch.Tensor], spec: BlockSpec, expert: int, which: str,
             bias: torch.Tensor) -> None:
    """Store one expert's ``which`` bias (gate_bias [I], up_bias [I], down_bias [H]) in ``biases``."""
    I = spec.intermediate
    rows = {"gate_bias": biases[0][expert, :I], "up_bias": biases[0][expert, I:], "down_bias": biases[1][expert]}
    rows[which].copy_(bias)


@torch.no_grad()
def free_experts(module: nn.Module) -> None:
    """Drop the HF expert tensors (one resident copy): empty every tensor of ``module.experts``, then remove it."""
    ex = module.experts
    for store in (ex._parameters, ex._buffers):
        for key, t in list(store.items()):
            if t is not None:
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    del module.experts


def shared_output(block: nn.Module, kind: str | None, x: torch.Tensor) -> torch.Tensor | None:
    """Shared-expert output for x [T, H] (on x's device), or None when the family has none."""
    if kind is None:
        return None
    if kind == "unweighted":  # Llama 4: x here is the experts' weighted input; the block adds its own
        return None
    if kind == "gated":
        return torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)  # Qwen2-MoE
    return getattr(block, SHARED_ATTRS[kind][0])(x)  # always on: shared_experts, Hunyuan's shared_mlp
