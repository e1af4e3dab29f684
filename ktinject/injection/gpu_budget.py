"""The GPU budget of an injection, measured: the inputs of ``gpu_experts.hot.budget.fit`` read off the model, the
plan and the card, the ``gpu_memory`` cap checked and enforced, ``auto`` turned into bytes.

    before the load  ``prepare(model, plan, workload)``: the cap checked against the card and against the dense part
                     plus the KV cache (an error naming the sizes), then enforced for the process
                     (``torch.cuda.set_per_process_memory_fraction``: the caching allocator refuses to reserve more)
    after the load   ``resolve(model, plan, settings, workload, prefill)``: the dense part on the device, the routed
                     experts built: free memory measured, the budget fitted (``budget.fit``), the report logged;
                     the settings with their budget in bytes (None: nothing to place), and the ``Budget``

Free memory counts what this model already holds on the device (its dense part, loaded by then) as free: ``fit``
takes the card as it was before the load and subtracts the dense part itself. What the process held before (another
model) stays taken, under the cap too. The cap bounds torch's caching allocator; the CUDA context (a few hundred MiB
outside it) is not counted.

KV cache per token and row (``kv_token_bytes``): K and V of each attention layer from the config
(``num_key_value_heads`` x ``head_dim``), MLA latents where the attention caches them (``kv_lora_rank`` +
``qk_rope_head_dim``), the lightning indexer's keys where the model has one; linear-attention layers hold a fixed
state per row instead (``decode.linear_attention_state``: conv windows in the model's dtype, recurrent matrices in
float32). K / V in the element size of the model's dtype.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from ktinject.decode import linear_attention_state as linear_state
from ktinject.gpu_experts.hot import budget as gpu
from ktinject.gpu_experts.hot.bank import HotExperts
from ktinject.gpu_experts.hot.settings import HotExpertSettings, human_bytes
from ktinject.gpu_experts.hot.stats import hybrid_blocks
from ktinject.gpu_experts.hot.upload import GPU_QUANTS, expert_layout

log = logging.getLogger(__name__)

#: the context the KV cache is reserved for when none is given (the server's default --max-context)
DEFAULT_CONTEXT = 4096
#: attribute of an injected model holding its ``Budget``
BUDGET_ATTR = "_ktinject_budget"


def _text_config(model: nn.Module):
    return linear_state.text_config(model.config)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's activations and caches (its embeddings')."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    w = getattr(emb, "weight", None)
    return w.dtype if isinstance(w, torch.Tensor) and w.is_floating_point() else torch.bfloat16


def default_context(model: nn.Module) -> int:
    """DEFAULT_CONTEXT, or the model's max_position_embeddings when that is less."""
    limit = getattr(_text_config(model), "max_position_embeddings", None)
    return min(DEFAULT_CONTEXT, int(limit)) if limit else DEFAULT_CONTEXT


def _caches_latents(model: nn.Module) -> bool:
    """Whether the attention caches MLA latents (transformers' DeepSeek attention expands them after the cache)."""
    return any(callable(getattr(m, "expand_kv", None)) for m in model.modules())


def kv_token_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of one token of one row, fixed bytes of one row) of the model's KV cache, every layer."""
    cfg = _text_config(model)
    elem = torch.empty(0, dtype=model_dtype(model)).element_size()
    layers = int(cfg.num_hidden_layers)
    linear = linear_state.layout_of(cfg)
    attention_layers = layers - (len(linear.layers) if linear is not None else 0)
    heads = int(getattr(cfg, "num_attention_heads", 1))
    if getattr(cfg, "kv_lora_rank", None) and _caches_latents(model):
        per_layer = int(cfg.kv_lora_rank) + int(cfg.qk_rope_head_dim)
    elif getattr(cfg, "kv_lora_rank", None):  # MLA with full K / V cached
        per_layer = heads * (int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim) + int(cfg.v_head_dim))
    else:
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads)
        per_layer = 2 * kv_heads * head_dim
    if getattr(cfg, "index_head_dim", None) and any(type(m).__name__.endswith("Indexer") for m in model.modules()):
        per_layer += int(cfg.index_head_dim)
    row = 0
    if linear is not None:
        conv = linear.conv_dim * linear.kernel
        recurrent = linear.v_heads * linear.k_dim * linear.v_dim  # float32: the gated delta rule's state
        row = len(linear.layers) * (conv * elem + recurrent * 4)
    return attention_layers * per_layer * elem, row


def _stream_bytes(blocks) -> tuple[int, int]:
    """(ring + scratch of one whole layer, GPU activation bytes of one prompt token) of streamed prefill, as
    ``prefill.device.StreamedExperts`` sizes them (per expert: two ring copies of its packed bytes, bf16 gate_up and
    down, the unpacking work, float32 biases; per token: ``chunk_tokens``' estimate)."""
    ring = token = 0
    for b in blocks:
        ex = b.native_experts
        if ex.quant not in GPU_QUANTS:
            continue
        lay = expert_layout(ex)
        padded = any(m.N != m.Np or m.K != m.Kp for m in lay.mats)
        work = 0 if lay.quant in ("bf16", "int8") and not padded else lay.work_bytes
        H, I = b.hidden_size, b.intermediate_size
        per_expert = 2 * lay.expert_bytes + 2 * 3 * H * I + work + (4 * (2 * I + H) if ex.bias else 0)
        ring = max(ring, b.num_experts * per_expert)
        k = b.top_k if isinstance(getattr(b, "top_k", None), int) else 8
        token = max(token, k * (8 * H + 16 * I) + 64 * H)
    return ring, token


def model_shape(model: nn.Module, plan, prefill: str = "auto") -> gpu.ModelShape:
    """The ``ModelShape`` of an injected ``model`` (its MoE blocks built) under ``plan``; ``prefill``: the prefill
    mode ("cpu": no ring, prefill activations of the dense part only)."""
    device = str(plan.devices["gpu"])
    dense = int(plan.bytes_per_device().get(device, 0))
    per_token, per_row = kv_token_bytes(model)
    blocks = [b for _, b in hybrid_blocks(model)]
    dtype = model_dtype(model)
    eligible = [b for b in blocks if not b.native_experts.bias or b.expert_biases is not None]
    expert = max((HotExperts.expert_nbytes(b.spec, dtype) for b in eligible), default=0)
    table = max((HotExperts.table_nbytes(b.num_experts) for b in eligible), default=0)
    ring, token = _stream_bytes(blocks) if prefill != "cpu" else (0, 0)
    H = int(getattr(_text_config(model), "hidden_size", 0) or 0)
    return gpu.ModelShape(dense=dense, kv_per_token=per_token, expert=expert,
                          experts=sum(b.num_experts for b in eligible), layers=len(eligible), table=table,
                          ring=ring, activation_per_token=token or 64 * H, kv_per_row=per_row)


def prefix_cache_reserve(prefix_cache) -> int:
    """GPU bytes a prefix cache's tiers may take (its CUDA memory tiers' budgets); 0 for None."""
    tiers = getattr(getattr(prefix_cache, "tiers", None), "memory", ())
    return sum(int(t.budget) for t in tiers if getattr(t, "device", torch.device("cpu")).type == "cuda")


def _reserve(model: nn.Module, workload: gpu.Workload) -> int:
    """``gpu_reserve`` plus the GPU tier of a prefix cache attached to the model."""
    from ktinject.decode.generate import PREFIX_CACHE_ATTR

    return workload.reserve + prefix_cache_reserve(model.__dict__.get(PREFIX_CACHE_ATTR))


def _cuda(plan) -> torch.device | None:
    device = plan.devices["gpu"]
    if device.type != "cuda":
        return None
    return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)


def prepare(model: nn.Module, plan, workload: gpu.Workload) -> None:
    """Before the load: check ``workload.cap`` against the card and against the dense part + the KV cache
    (ValueError naming the sizes), then enforce it for this process. Nothing without a cap."""
    if workload.cap is None:
        return
    device = _cuda(plan)
    if device is None:
        raise ValueError(f"gpu_memory {human_bytes(workload.cap)}: the dense part runs on {plan.devices['gpu']} "
                         f"(no CUDA device), so there is no GPU memory to cap; leave gpu_memory out")
    total = torch.cuda.get_device_properties(device).total_memory
    per_token, per_row = kv_token_bytes(model)
    context = workload.context or default_context(model)
    kv = workload.rows * (context * per_token + per_row)
    dense = int(plan.bytes_per_device().get(str(plan.devices["gpu"]), 0))
    gpu.check_cap(workload.cap, total, dense, kv, str(device), workload.rows, context)
    torch.cuda.set_per_process_memory_fraction(workload.cap / total, device)
    log.info("gpu_memory: torch may reserve at most %s of %s on %s", human_bytes(workload.cap), human_bytes(total),
             device)


def resolve(model: nn.Module, plan, settings: HotExpertSettings | None, workload: gpu.Workload,
            prefill: str = "auto") -> tuple[HotExpertSettings | None, gpu.Budget | None]:
    """After the load: ``settings`` with an ``auto`` or share budget measured into bytes (None: nothing to place),
    and the Budget it came from (None for a budget given in bytes). The budget is logged and kept on the model
    (``BUDGET_ATTR``)."""
    if settings is None or settings.fraction is None:
        if settings is not None and workload.cap is not None:
            _check_fixed(model, plan, settings, workload, prefill)
        return settings, None
    device = _cuda(plan)
    blocks = hybrid_blocks(model)
    if device is None:
        found = gpu.nothing(settings.request, f"the dense part runs on {plan.devices['gpu']} (no CUDA device): "
                                              f"every routed expert stays on the CPU")
    elif not blocks:
        found = gpu.nothing(settings.request, "the model has no injected MoE blocks")
    else:
        shape = model_shape(model, plan, prefill)
        found = gpu.fit(shape, _free_for_model(device, shape.dense), cap=_cap_for_model(device, workload, shape),
                        rows=workload.rows, context=workload.context or default_context(model),
                        fraction=settings.fraction, reserve=_reserve(model, workload))
    model.__dict__[BUDGET_ATTR] = found
    level = logging.WARNING if found.reason is not None and device is not None and blocks else logging.INFO
    log.log(level, "%s", "\n".join(found.lines()))
    if found.budget <= 0:
        return None, found
    strategy = settings.strategy
    if found.everything and strategy == "dynamic":  # every expert resident: nothing to re-place
        strategy = "uniform"
    return HotExpertSettings.make(found.budget, strategy, settings.stats, settings.rebalance_every), found


def _free_for_model(device: torch.device, dense: int) -> int:
    """Free bytes of ``device`` as before this model's load: free + what torch holds unused + the dense part."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) + dense)


def _cap_for_model(device: torch.device, workload: gpu.Workload, shape: gpu.ModelShape) -> int | None:
    """The cap less what the process held besides this model's dense part."""
    if workload.cap is None:
        return None
    return workload.cap - max(0, torch.cuda.memory_allocated(device) - shape.dense)


def _check_fixed(model, plan, settings: HotExpertSettings, workload: gpu.Workload, prefill: str) -> None:
    """A budget in bytes under a cap: ValueError when the dense part, the KV cache and the budget exceed the cap."""
    device = _cuda(plan)
    if device is None or not hybrid_blocks(model):
        return
    shape = model_shape(model, plan, prefill)
    context = workload.context or default_context(model)
    kv = gpu.kv_bytes(shape, workload.rows, context)
    taken = min(settings.budget, shape.all_experts())
    if shape.dense + kv + _reserve(model, workload) + taken > workload.cap:
        raise ValueError(f"gpu_experts_budget {human_bytes(settings.budget)} does not fit gpu_memory "
                         f"{human_bytes(workload.cap)} with the dense weights ({human_bytes(shape.dense)}) and the "
                         f"KV cache ({human_bytes(kv)}): lower the budget, or give gpu_experts_budget='auto'")
