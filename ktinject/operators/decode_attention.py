"""A decode-step forward for the standard grouped-query attention modules: fewer, cheaper GPU kernels per layer.

With the routed experts on the CPU, each layer's GPU work before the experts' "go" signal lies on the decode
step's critical path (the expert threads wait for it), so every kernel there costs time per token. For one query
token (S == 1) this forward computes what the HF module computes, with:

- q, k and v projected by one matrix multiplication (their weights concatenated once; the Linear modules keep
  theirs, so state-dict keys, hooks and loading are unchanged; a changed weight is noticed and re-concatenated);
- per-head q/k RMSNorms as one unweighted ``torch.rms_norm`` over both and one multiplication by their stacked
  weights (HF: weight * normalized.to(dtype), the same order);
- rotary embedding of q and k together in three kernels: ``rotate_half(x) * sin == roll(x, D/2) * (sign * sin)``
  with sign = (-1 for the first half, +1 for the second), so ``x * cos + roll(x) * (sign * sin)`` (an addcmul);
- attention over the static cache without a K/V copy: the query heads of a KV head are that head's rows, scores
  in float32 (``bmm`` with ``out_dtype`` on CUDA), masked, softmax in float32, probabilities in the value dtype
  (what SDPA's flash kernels do). cuDNN's SDPA took 30 us per layer at a 1024-token cache and 86 us at 4096 on
  the H100 machine, this 20 us at both (tests/gpu/probe_ops.py).

Everything else (prefill, S > 1, output_attentions, training, partial rotary, a sliding window, masks that are not
[B, 1, 1, L] tensors) runs the module's own forward. Installed per module by the attention operator
(``fast_decode``, default true) for the classes in ``SUPPORTED``, whose HF forward is exactly q/k/v projection,
optional per-head q/k norm, full rotary embedding, cache update, attention, o_proj.
Legend: B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, D head dim, L cache length.
"""
from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

#: attention classes whose HF forward this one reproduces (checked in tests against the HF module)
SUPPORTED = frozenset({"Qwen3MoeAttention", "Qwen2MoeAttention", "MixtralAttention", "Glm4MoeAttention"})
_HF_FORWARD = "_ktinject_hf_forward"
_STATE = "_ktinject_decode_state"


def problem(module: nn.Module) -> str | None:
    """Why ``module`` cannot take the decode forward, or None."""
    cname = type(module).__name__
    if cname not in SUPPORTED:
        return f"class {cname} is not one of {', '.join(sorted(SUPPORTED))}"
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not isinstance(getattr(module, name, None), nn.Linear):
            return f"{name} is not an nn.Linear"
    if not all(isinstance(getattr(module, n, None), (int, float)) for n in ("head_dim", "scaling", "layer_idx")):
        return "no numeric head_dim, scaling and layer_idx"
    D = module.head_dim
    hq, hk, hv = (getattr(module, n).out_features for n in ("q_proj", "k_proj", "v_proj"))
    if hq % D or hk % D or hv % D or hk != hv or (hq // D) % (hk // D):
        return f"projection sizes {hq}/{hk}/{hv} do not split into heads of {D} with whole groups"
    if len({getattr(module, n).bias is None for n in ("q_proj", "k_proj", "v_proj")}) != 1:
        return "q_proj, k_proj and v_proj differ in having a bias"
    if _qk_norms(module) is False:
        return "its q/k norms are not per-head RMSNorms with one eps"
    return None


def _qk_norms(module: nn.Module):
    """(q_norm, k_norm, eps) when the module normalizes q and k per head; None without norms; False: other norms."""
    from ktinject.operators.norm import FusedRMSNorm, _problem

    if not getattr(module, "use_qk_norm", True) or not hasattr(module, "q_norm"):
        return None
    qn, kn = module.q_norm, getattr(module, "k_norm", None)
    for n in (qn, kn):
        if n is None or not (isinstance(n, FusedRMSNorm) or _problem(n) is None):
            return False
        if n.weight.shape != (module.head_dim,):
            return False
    if qn.variance_epsilon != kn.variance_epsilon:
        return False
    return qn, kn, float(qn.variance_epsilon)


def install(module: nn.Module) -> bool:
    """Give ``module`` the decode forward (its own forward stays for everything else); False if not supported."""
    why = problem(module)
    if why is not None:
        log.debug("decode attention: %s keeps its forward: %s", type(module).__name__, why)
        return False
    if _HF_FORWARD not in module.__dict__:
        module.__dict__[_HF_FORWARD] = module.forward
        module.forward = types.MethodType(decode_forward, module)
    return True


def installed(module: nn.Module) -> bool:
    return _HF_FORWARD in module.__dict__


def _state(module: nn.Module, norms) -> dict:
    """Concatenated q/k/v weight (and bias), stacked q/k norm weights: rebuilt when a source tensor changed."""
    srcs = [module.q_proj.weight, module.k_proj.weight, module.v_proj.weight]
    if module.q_proj.bias is not None:
        srcs += [module.q_proj.bias, module.k_proj.bias, module.v_proj.bias]
    if norms:
        srcs += [norms[0].weight, norms[1].weight]
    key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in srcs)
    st = module.__dict__.get(_STATE)
    if st is not None and st["key"] == key:
        return st
    with torch.no_grad():
        D = module.head_dim
        hq, hk = module.q_proj.out_features // D, module.k_proj.out_features // D
        st = {"key": key, "hq": hq, "hk": hk,
              "w": torch.cat(srcs[:3]).detach(),
              "b": torch.cat(srcs[3:6]).detach() if module.q_proj.bias is not None else None,
              "sign": torch.cat([torch.full((D // 2,), -1.0), torch.ones(D - D // 2)]).to(srcs[0])}
        if norms:
            st["norm_w"] = torch.cat([norms[0].weight.detach().expand(hq, D), norms[1].weight.detach().expand(hk, D)])
    module.__dict__[_STATE] = st
    return st


def _fallback_reason(module, hidden_states, position_embeddings, attention_mask, past_key_values, kwargs):
    if hidden_states.dim() != 3 or hidden_states.shape[1] != 1 or module.training or past_key_values is None:
        return True
    if kwargs.get("output_attentions") or getattr(module, "sliding_window", None) is not None:
        return True
    if position_embeddings is None or position_embeddings[0].shape[-1] != module.head_dim:
        return True  # partial rotary (GLM-4.5) or no rotary
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4
                                       or attention_mask.shape[1] != 1 or attention_mask.shape[2] != 1):
        return True
    return hidden_states.dtype != module.q_proj.weight.dtype


_BMM_OUT_DTYPE: dict[str, bool] = {}  # device type -> torch.bmm(..., out_dtype=float32) works


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """float32 q @ k^T for q [N, G, D], k [N, L, D] (float32 accumulation and result whatever the input dtype)."""
    if q.dtype == torch.float32:
        return torch.bmm(q, k.transpose(1, 2))
    dev = q.device.type
    if _BMM_OUT_DTYPE.get(dev, True):
        try:
            out = torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32)
            _BMM_OUT_DTYPE[dev] = True
            return out
        except (RuntimeError, TypeError, NotImplementedError):
            _BMM_OUT_DTYPE[dev] = False
    return torch.bmm(q.float(), k.float().transpose(1, 2))


def decode_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                   past_key_values=None, **kwargs):
    """The module's forward for one query token (see the module docstring); anything else: HF's forward."""
    hf = self.__dict__[_HF_FORWARD]
    if _fallback_reason(self, hidden_states, position_embeddings, attention_mask, past_key_values, kwargs):
        return hf(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask,
                  past_key_values=past_key_values, **kwargs)
    norms = _qk_norms(self)
    st = _state(self, norms)
    B, D, hq, hk = hidden_states.shape[0], self.head_dim, st["hq"], st["hk"]
    qkv = F.linear(hidden_states, st["w"], st["b"]).view(B, hq + 2 * hk, D)  # [B, Hq + 2 Hkv, D]
    qk = qkv[:, : hq + hk]
    if norms:
        qk = torch.rms_norm(qk, (D,), None, norms[2]) * st["norm_w"]
    cos, sin = position_embeddings  # [B, 1, D]
    cos, sin = cos.to(qk.dtype), sin.to(qk.dtype)
    qk = torch.addcmul(qk * cos, qk.roll(D // 2, -1), sin * st["sign"])  # [B, Hq + Hkv, D]
    k_new = qk[:, hq:].unsqueeze(2)  # [B, Hkv, 1, D]
    v_new = qkv[:, hq + hk:].unsqueeze(2)
    keys, values = past_key_values.update(k_new, v_new, self.layer_idx)  # [B, Hkv, L, D]
    L = keys.shape[2]
    G = hq // hk
    q = qk[:, :hq].reshape(B * hk, G, D)
    s = _scores(q, keys.reshape(B * hk, L, D)).view(B, hk, G, L).mul_(self.scaling)  # float32
    if attention_mask is not None:
        s = torch.where(attention_mask, s, float("-inf")) if attention_mask.dtype == torch.bool else s + attention_mask
    p = torch.softmax(s, dim=-1)
    out = torch.bmm(p.to(values.dtype).view(B * hk, G, L), values.reshape(B * hk, L, D))  # [B Hkv, G, D]
    return self.o_proj(out.view(B, 1, hq * D)), None


def uninstall(module: nn.Module) -> None:
    """Give ``module`` back its own forward (no-op where the decode forward is not installed)."""
    if _HF_FORWARD in module.__dict__:
        del module.__dict__["forward"]
        del module.__dict__[_HF_FORWARD]
        module.__dict__.pop(_STATE, None)
