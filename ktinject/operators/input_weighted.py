"""Llama 4's MoE block in the hybrid block: routing weights that scale each expert's input, not its output.

``Llama4TextMoe`` routes each token to its top-k experts by the logits, with weights sigmoid(logit) (its
``Llama4Router`` returns (scores [T, E], zero off the top k; logits [T, E])), and feeds expert e the token's
x * weight: the experts are nonlinear, so that is not the expert's output weighted. The native experts weight
outputs, so each (token, slot) pair becomes a row of its own: x * weight [T*k, H], its one expert, weight 1; the rows'
outputs are summed per token, and the always-on shared expert of the unweighted x is added (the shared kind
"unweighted" keeps ``shared_output`` from computing it of the weighted rows). The rows go through the block's usual
experts path (``HybridMoE._experts``: hot experts, prefill streaming), which sees T*k tokens of one expert each.

Legend: B batch, S sequence, T tokens, E experts, H hidden, k experts per token.
"""
from __future__ import annotations

import torch
from torch import nn


def llama4_routing(router: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Llama 4's router in float32 on x [T, H]: (weights [T, k] float32, ids [T, k] int64, logits [T, E]). HF's own
    forward gives the scores; the ids are its top-k of the logits (the same call on the same numbers), the weights
    those scores."""
    scores, logits = router(x.float())  # [T, E], [T, E]
    ids = torch.topk(logits, router.top_k, dim=1).indices
    return scores.gather(1, ids), ids, logits


def _ones(block: nn.Module, n: int, device: torch.device) -> torch.Tensor:
    """float32 ones [n, 1], cached on the block: the routing weight of every weighted-input row."""
    key = ("input_weighted", n, device)
    ones = block._ones.get(key)
    if ones is None:
        ones = block._ones[key] = torch.ones((n, 1), dtype=torch.float32, device=device)
    return ones


def forward(block: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The hybrid block's forward for Llama 4 (see the module docstring) on hidden_states [B, S, H]: (hidden [T, H],
    router logits [T, E]), what HF's block returns (its decoder layer views the hidden back)."""
    H = hidden_states.shape[-1]
    x = hidden_states.reshape(-1, H)  # [T, H]
    weights, ids, logits = llama4_routing(block._modules[block.spec.router], x)  # [T, k], [T, k], [T, E]
    if block.collect_stats and ids.numel():
        block._count(ids)
    T, k = ids.shape
    rows = (x.float()[:, None, :] * weights[:, :, None]).to(x.dtype).reshape(T * k, H)  # [T*k, H]
    routed, _ = block._experts(rows, ids.reshape(T * k, 1), _ones(block, T * k, weights.device))  # [T*k, H]
    out = block.shared_expert(x) + routed.view(T, k, H).sum(dim=1)
    return out, logits
