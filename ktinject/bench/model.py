"""The benchmark model: a real model's dimensions with random weights, built in memory (bench decode, prefill, hot):
Qwen3-30B-A3B's by default, or another's of ``SHAPES`` (``--shapes``).

Built on the meta device, then materialized with the routed experts on the CPU (filled from a small random pool at
random offsets: fast) and everything else on ``device``; nothing is written to disk.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

QWEN3_30B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
    decoder_sparse_step=1, mlp_only_layers=[],
)


@dataclass(frozen=True)
class Shapes:
    """A real model's dimensions: ``config`` (a transformers config class) with ``options``; ``layers``: its decoder
    layers (a bench with fewer scales its figures to these); ``layer_multiple``: the --layers it takes are multiples
    of this (a hybrid model's pattern of layer kinds)."""

    name: str
    config: str
    layers: int
    options: dict = field(default_factory=dict)
    layer_multiple: int = 1


#: --shapes: the models the benches build (the targets and llama.cpp's random GGUF are Qwen3-30B-A3B's)
SHAPES = {
    "qwen3_moe": Shapes("Qwen3-30B-A3B", "Qwen3MoeConfig", 48, QWEN3_30B),
    # transformers' defaults are Qwen3.5-35B-A3B's: 256 experts top-8 of 512, a shared expert, 3 gated-DeltaNet
    # layers to one gated full-attention layer
    "qwen3_5_moe": Shapes("Qwen3.5-35B-A3B", "Qwen3_5MoeTextConfig", 40, layer_multiple=4),
    # transformers' defaults are DeepSeek-V3.2's (61 layers, hidden 7168, 256 experts top-8 of 2048, MLA, the
    # lightning indexer's top 2,048); every built layer is an MoE one (the real model's first 3 are dense), so the
    # figures scaled to 61 layers are a little low
    "deepseek_v32": Shapes("DeepSeek-V3.2", "DeepseekV32Config", 61, {"first_k_dense_replace": 0}),
}
DEFAULT_SHAPES = "qwen3_moe"
_POOL = 32 << 20  # random values per pool (experts are tiled from it at random offsets)


# ---- model ---------------------------------------------------------------------------------------------------
def weight_std(name: str, shape, hidden: int) -> float:
    if "embed_tokens" in name:
        return 1.0
    if name.startswith("lm_head"):
        return 2.0 / math.sqrt(shape[-1])
    if name.endswith("mlp.gate.weight"):
        return 1.5 / math.sqrt(hidden)
    return 1.0 / math.sqrt(shape[-1])


def _fill_tiled(t: torch.Tensor, pool: torch.Tensor, gen: torch.Generator) -> None:
    """Fill t with windows of pool (2 x _POOL values) at random offsets (parallel copies: ~memory speed)."""
    flat, n, off = t.view(-1), t.numel(), 0
    while off < n:
        m = min(_POOL, n - off)
        r = int(torch.randint(0, _POOL, (1,), generator=gen))
        flat[off:off + m].copy_(pool[r:r + m])
        off += m


@torch.no_grad()
def add_shapes_option(p) -> None:
    """--shapes and --layers of the benches that build the model."""
    p.add_argument("--shapes", default=DEFAULT_SHAPES, choices=sorted(SHAPES),
                   help="whose dimensions the random model has: " + ", ".join(
                       f"{k} ({v.name}, {v.layers} layers)" for k, v in SHAPES.items()) + f" (default {DEFAULT_SHAPES})")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: the real model's; fewer: the figures are scaled to it)")


def shapes_of(args) -> Shapes:
    """The ``Shapes`` a bench's ``args`` build (benches without --shapes: the default)."""
    return SHAPES[getattr(args, "shapes", DEFAULT_SHAPES)]


def resolve_layers(args) -> int:
    """--layers as given, or the real model's; an error naming the fix where the shapes cannot take it."""
    shapes = shapes_of(args)
    if args.layers is None:
        args.layers = shapes.layers
    if args.layers < 1 or args.layers % shapes.layer_multiple:
        raise SystemExit(f"--layers {args.layers}: {shapes.name} shapes take a positive multiple of "
                         f"{shapes.layer_multiple} (its pattern of layer kinds)")
    return shapes.layers


def real_layers(args) -> int:
    """The decoder layers of the real model whose shapes ``args`` builds (what fewer layers' figures scale to)."""
    return shapes_of(args).layers


def shapes_name(args) -> str:
    return "tiny qwen3_moe" if args.tiny else f"{shapes_of(args).name} shapes"


def build_model(layers: int, device: torch.device, seed: int = 0, shapes: str = DEFAULT_SHAPES) -> nn.Module:
    """``shapes``' dimensions (``SHAPES``) with ``layers`` layers: routed experts on the CPU, the rest on
    ``device``, bf16."""
    import transformers
    from transformers import AutoModelForCausalLM

    spec = SHAPES[shapes]
    cfg = getattr(transformers, spec.config)(num_hidden_layers=layers, **spec.options)
    cfg.dtype = torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    base = torch.randn(_POOL, generator=gen)
    pools = {  # [2 * _POOL] so any window of _POOL values fits
        "gate_up_proj": (base / math.sqrt(H)).to(torch.bfloat16).repeat(2),
        "down_proj": (base / math.sqrt(I)).to(torch.bfloat16).repeat(2),
    }
    del base
    dgen = torch.Generator(device=device).manual_seed(seed) if device.type == "cuda" else gen
    for mod_name, mod in model.named_modules():
        for key, p in list(mod._parameters.items()):
            if p is None:
                continue
            name = f"{mod_name}.{key}" if mod_name else key
            if mod_name.endswith(".experts"):
                t = torch.empty(p.shape, dtype=torch.bfloat16)
                _fill_tiled(t, pools[key], gen)
            elif "norm" in key or "norm" in mod_name.rsplit(".", 1)[-1]:
                t = torch.ones(p.shape, dtype=torch.bfloat16, device=device)
            else:
                t = torch.empty(p.shape, dtype=torch.bfloat16, device=device)
                t.normal_(0.0, weight_std(name, p.shape, H), generator=dgen)
            mod._parameters[key] = nn.Parameter(t, requires_grad=False)
    for mod_name, mod in list(model.named_modules()):  # rotary tables: computed, not stored
        if hasattr(mod, "inv_freq") and hasattr(mod, "config"):
            parent_name, _, leaf = mod_name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, leaf, type(mod)(mod.config).to(device))
    for mod in model.modules():  # other buffers (DeepSeek's routers' e_score_correction_bias): zeros, the neutral
        for key, b in list(mod._buffers.items()):
            if b is not None and b.device.type == "meta" and b.is_floating_point():
                mod._buffers[key] = torch.zeros(b.shape, dtype=b.dtype, device=device)
    leftover = [n for n, b in model.named_buffers() if b.device.type == "meta"]
    if leftover:
        raise RuntimeError(f"buffers left on the meta device: {leftover[:5]}")
    model.eval()
    return model


def build_tiny(device: torch.device) -> nn.Module:
    from ktinject.tiny_models import build_tiny_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return build_tiny_model("qwen3_moe", dtype=dtype).to(device)


def set_generation_defaults(model) -> None:
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.bos_token_id = None, 0, None
    gc.do_sample = False
    gc.temperature = gc.top_p = gc.top_k = None


def experts_quant(model) -> str:
    """The native format of the model's routed experts (bf16, int8, int4, fp8; several joined by "+")."""
    seen = dict.fromkeys(m.native_experts.quant for m in model.modules()
                         if getattr(m, "native_experts", None) is not None)
    return "+".join(seen) or "none"


def checkpoint_model(path, quant: str | None, device: torch.device, **options) -> tuple[nn.Module, str]:
    """(model, a line saying what ran) of a checkpoint (a directory or a GGUF file) through ktinject.from_pretrained
    on ``device`` (bf16 on a GPU, as the in-memory model): experts as released unless ``quant`` overrides it, no
    packed-expert cache (a bench must not write GBs beside the
    checkpoint), greedy defaults.
    ``options``: more of from_pretrained's (e.g. ``prefill``; ``gpu_experts_budget`` 0 unless given)."""
    import ktinject
    from ktinject.cli.options import experts_format

    t0 = time.perf_counter()
    dtype = torch.bfloat16 if device.type == "cuda" else None  # (a GGUF's own default is float32, as HF's)
    options.setdefault("gpu_experts_budget", 0)
    model = ktinject.from_pretrained(path, quant=quant, gpu=str(device), cache_dir=False, progress=False,
                                     dtype=dtype, **options)
    set_generation_defaults(model)
    stats = model._ktinject_load_stats
    how = f"--quant {quant} over the release's" if quant else "the release's"
    return model, (f"checkpoint {path}: {', '.join(stats['formats']) or 'unquantized'}; experts "
                   f"{experts_format(model)} ({how}); loaded in {time.perf_counter() - t0:.1f} s, "
                   f"{stats['bytes_read'] / 1e9:.2f} GB read")


def add_budget_option(p) -> None:
    """--gpu-experts-budget of the benches that time a model: 0 (every routed expert on the CPU: the configuration
    their targets stand for) unless asked; ``auto`` is the library's default (docs/hot-experts.md)."""
    p.add_argument("--gpu-experts-budget", default="0", metavar="SIZE",
                   help="hot experts' GPU budget as inject takes it: 0 (default here: every expert on the CPU), "
                        "auto (the library's default), a size (12GiB) or a fraction")


def print_budget(model) -> None:
    """The injection's GPU budget report (what ``--gpu-experts-budget`` chose and what fills the card), one ``#``
    line each; nothing where no budget was planned (0, or no GPU)."""
    plan = getattr(model, "_ktinject_plan", None)
    budget = None if plan is None else plan.gpu_budget
    if budget is not None:
        print("\n".join(f"# {line}" for line in budget.lines()), flush=True)


def quants_of(args) -> list:
    """The runs' expert formats from ``--quant`` of bench decode / prefill (default bf16; with ``--checkpoint``:
    [None], the release's, unless given); SystemExit naming what does not fit."""
    from ktinject import native

    known = [q for q in ("bf16", "int8", "int4", "fp8", "mxfp4") if q in native.QUANTS]
    if args.checkpoint:
        if args.tiny:
            raise SystemExit("--checkpoint and --tiny: the model comes from one of them; give one")
        if not Path(args.checkpoint).exists():
            raise SystemExit(f"--checkpoint {args.checkpoint}: no such file or directory (bench load --format ... "
                             "--keep --dir DIR writes one)")
        if args.quant is None:
            return [None]
    quants = [q.strip() for q in (args.quant or "bf16").split(",") if q.strip()]
    if not quants or any(q not in known for q in quants):
        raise SystemExit(f"--quant {args.quant!r}: expected a comma-separated list of {', '.join(known)}")
    return quants


def bench_model(tiny: bool, layers: int, threads: int | None = None,
                shapes: str = DEFAULT_SHAPES) -> tuple[nn.Module, torch.device]:
    """(model, device) of a bench run: the native pool's and torch's threads set (when given), the tiny test model or
    the bench model of ``shapes`` with ``layers`` layers, on the GPU where there is one, greedy generation defaults."""
    from ktinject import native

    if threads:
        native.set_default_threads(threads)
        torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_tiny(device) if tiny else build_model(layers, device, shapes=shapes)
    set_generation_defaults(model)
    return model, device
