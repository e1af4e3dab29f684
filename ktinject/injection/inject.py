"""``inject(model, rules, gpu="cuda:0")``: plan, then apply (``ktinject.injection.apply``), on a loaded Hugging Face model.

The model stays a Hugging Face model (``model.generate`` works), with each matched module replaced by its operator's
module (for MoE blocks the routed experts go to native CPU kernels and the HF expert tensors are freed) and every
tensor outside the operators moved to the device its rule names. A model built on the meta device is filled from a
checkpoint instead (``checkpoint=``, ``ktinject.injection.loading``).
"""
from __future__ import annotations

import logging

from torch import nn

from ktinject.decode.generate import attach_prefix_cache
from ktinject.injection import apply
from ktinject.injection.apply import InjectError, place_tensors  # noqa: F401  (public names of inject since round 1)
from ktinject.gpu_experts.prefill.policy import mode_from_plan
from ktinject.gpu_experts.hot.budget import Workload
from ktinject.gpu_experts.hot.settings import HotExpertSettings
from ktinject.injection import gpu_budget
from ktinject.injection import lora as lora_merge
from ktinject.injection.loading import load_into
from ktinject.injection.plan import Plan, plan

log = logging.getLogger(__name__)


def inject(model: nn.Module, rules=None, *, quant: str | None = None, defer: int | float | None = None,
           gpu_experts_budget=None, placement: str | None = None, stats=None, rebalance_every: int | None = None,
           checkpoint=None, prefill: str | None = None, prefix_cache=None, gpu_memory=None,
           max_batch: int | None = None, max_context: int | None = None, gpu_reserve=None, lora=None,
           **devices) -> Plan:
    """Plan and apply: swap in operators, move every other tensor to its device. Returns the Plan.

    ``rules``: a rule file path, parsed rules, or None for the packaged file of ``model.config.model_type``.
    ``quant``: expert quantization for every MoE operator (``bf16``, ``int8``, ``int4``); None keeps the rules' choice.
    ``defer``: expert deferral, the d lowest-weighted of each token's k experts (an int, 0 <= d < k), or its
    lowest-weighted experts up to a share m of its routing weight (a float, 0 < m < 1), run one MoE block late in
    decode steps (``ktinject.operators.deferral``); None keeps the rules' choice (0 by default).
    ``gpu_experts_budget``, ``placement``, ``stats``, ``rebalance_every``: GPU-resident hot experts, the options of
    ``ktinject.gpu_experts.hot.settings`` (the same for ``from_pretrained`` and the chat); None keeps the moe rules'
    kwargs of the same names; the budget is ``auto`` where neither sets it: the GPU memory the run leaves free
    (``ktinject.injection.gpu_budget``; the plan's report and ``model._ktinject_budget`` say how it was found).
    ``gpu_memory``: at most this many GPU bytes for the whole run (an int or '24GiB'; None: the whole card),
    enforced for the process; ``max_batch``, ``max_context``: the KV cache the budget leaves room for (rows x tokens;
    default 8 rows, as generate's cache, x 4096 tokens or the model's context if shorter); ``gpu_reserve``: GPU
    bytes it leaves for other uses (a prefix cache's GPU tier made later; ``prefix_cache``'s own is counted).
    ``prefill``: where a prompt's routed experts run: ``"auto"`` (default: split between the CPU and the GPU by a
    cost model, experts streamed to the GPU over PCIe), ``"cpu"`` (native kernels only) or ``"gpu"`` (all streamed;
    ``ktinject.gpu_experts.prefill.streamer``); None keeps the moe rules' ``prefill`` kwarg.
    ``checkpoint``: for a model built on the meta device (``from_config`` under ``torch.device("meta")`` or
    ``from_pretrained(..., device_map="meta")``): a checkpoint whose weights are streamed straight into the
    operators and devices (ktinject.injection.loading).
    ``prefix_cache``: a ``ktinject.decode.prefix_cache.PrefixCache`` every ``ktinject.generate`` of the model uses
    (computed prompt prefixes reused; docs/prefix-cache.md).
    ``lora``: a PEFT LoRA adapter directory merged into the adapted modules' weights once the model is built
    (``ktinject.injection.lora``; checked before anything is built).
    ``devices``: device variables, e.g. ``gpu="cuda:0"`` or ``gpu="cpu"`` (CPU-only run).
    """
    apply.check_fresh(model)
    if checkpoint is None:
        apply.check_not_quantized(model)
    the_plan = plan(model, rules, quant=quant, defer=defer, **devices)
    apply.check_devices(the_plan)
    adapter = None if lora is None else lora_merge.read_adapter(lora)
    options = dict(gpu_experts_budget=gpu_experts_budget, placement=placement, stats=stats,
                   rebalance_every=rebalance_every)
    gpu_options = dict(gpu_memory=gpu_memory, max_batch=max_batch, max_context=max_context, gpu_reserve=gpu_reserve)
    if prefix_cache is not None:
        attach_prefix_cache(model, prefix_cache)
    if checkpoint is not None:
        load_into(model, the_plan, checkpoint, prefill=prefill, **gpu_options, **options)
        if adapter is not None:
            lora_merge.merge_adapter(model, adapter)
        return the_plan
    hot = HotExpertSettings.from_plan(the_plan, **options)  # bad options fail before anything is built
    workload = Workload.make(**gpu_options)
    prefill = mode_from_plan(the_plan, prefill)
    gpu_budget.prepare(model, the_plan, workload)
    counts = apply.build_operators(model, the_plan)
    nbytes = apply.place_tensors(model, the_plan.tensor_devices)
    hot, found = gpu_budget.resolve(model, the_plan, hot, workload, prefill)
    the_plan.record_budget(found)
    attn = apply.finish(model, the_plan, hot, prefill)
    if adapter is not None:
        lora_merge.merge_adapter(model, adapter)
    ops = ", ".join(f"{n} x {op}" for op, n in sorted(counts.items())) or "no operators"
    log.info("inject: %s: %s; moved %.1f MiB of other tensors; attention %s", type(model).__name__, ops,
             nbytes / 2**20, attn)
    return the_plan


