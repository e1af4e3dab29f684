"""LoRA fine-tuning of injected models: the routed experts frozen on the CPU (their backward in the native core,
``ktinject.operators.moe_backward``), PEFT's adapters on the attention / dense modules and, where asked, on the
routed experts themselves (``ktinject.operators.expert_lora``: per-expert A / B, computed on the CPU).

``data``: training files (chat JSONL, text JSONL, plain text) to token blocks: the chat template, the assistant-only
loss mask, packing, the held-out split; ``loop``: ``finetune(FinetuneConfig(...))``, the plain torch loop behind
``ktinject finetune`` (``ktinject.cli.finetune``). The adapters it writes load for inference with
``inject(model, lora=DIR)`` / ``from_pretrained(..., lora=DIR)`` (``ktinject.injection.lora``).
"""
