"""The causal-LM loss of a training step without the whole logits tensor: the LM head and the cross entropy run
over chunks of positions, each chunk recomputed in the backward (``torch.utils.checkpoint``), so a step holds one
chunk's float32 logits and their gradient instead of [batch, sequence, vocabulary] of each (with a 151,936-token
vocabulary a 512-token sequence's are 0.3 GB each in float32; 4,096 tokens', 2.5 GB).

The same value as transformers' ``model(..., labels=labels).loss``: logits at position t predict the label at t + 1,
float32 cross entropy, the mean over labels that are not IGNORE (-100). Models whose head does more than a linear
layer (logit soft-capping or scaling) or whose loss adds a router term (``output_router_logits``) take transformers'
own loss instead (``causal_lm_loss`` falls back to it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ktinject.train.data import IGNORE
CHUNK_LOGITS = 1 << 24  # logits a chunk holds at most (64 MiB in float32)


def _parts(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(the decoder stack, the LM head) of a causal LM (or of the model inside a PEFT wrapper), or None where the
    chunked loss does not apply."""
    get_base = getattr(model, "get_base_model", None)
    lm = get_base() if callable(get_base) else model
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    body = getattr(lm, getattr(lm, "base_model_prefix", "") or "model", None)
    cfg = getattr(lm, "config", None)
    if head is None or not isinstance(body, nn.Module) or body is lm or cfg is None:
        return None
    for name in ("final_logit_softcapping", "logit_softcapping"):
        if getattr(cfg, name, None):
            return None
    if getattr(cfg, "logits_scaling", 1.0) not in (None, 1, 1.0) or getattr(cfg, "output_router_logits", False):
        return None
    return body, head


def _chunk_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=IGNORE, reduction="sum")


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mean next-token cross entropy of ``labels`` [B, S] (IGNORE: no loss) given ``input_ids`` [B, S]."""
    parts = _parts(model)
    if parts is None:
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False).loss
    body, head = parts
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    y = labels[:, 1:].reshape(-1).to(h.device)
    rows = max(16, CHUNK_LOGITS // max(1, head.weight.shape[0]))
    total = h.new_zeros((), dtype=torch.float32)
    for i in range(0, y.numel(), rows):
        part = (head, h[i:i + rows], y[i:i + rows])
        total = total + (checkpoint(_chunk_loss, *part, use_reentrant=False) if torch.is_grad_enabled()
                         else _chunk_loss(*part))
    return total / (y != IGNORE).sum().clamp_min(1)
