"""A decode-step forward for the standard grouped-query attention modules: fewer, cheaper GPU kernels per layer.

With the routed experts on the CPU, each layer's GPU work before the experts' "go" signal lies on the decode
step's critical path (the expert threads wait for it), so every kernel there costs time per token. For one query
token (S == 1) this forward computes what the HF module computes, with:

- q, k and v projected by one matrix multiplication: at the first decode step their weights (and biases) are
  moved into one buffer and the three Linear modules' parameters become views of it (no second copy; state-dict
  keys unchanged; an in-place load writes into the buffer; a parameter replaced by a new tensor is noticed and
  joined again - graphs captured before then still read the old one, as with any replaced parameter);
- per-head q/k RMSNorms as one unweighted ``torch.rms_norm`` over both and one multiplication by their stacked
  weights (HF: weight * normalized.to(dtype), the same order);
- rotary embedding of q and k together in three kernels: ``rotate_half(x) * sin == roll(x, D/2) * (sign * sin)``
  with sign = (-1 for the first half, +1 for the second), so ``x * cos + roll(x) * (sign * sin)`` (an addcmul);
- attention over the static cache without a K/V copy: the query heads of a KV head are that head's rows, scores
  in float32 (``bmm`` with ``out_dtype`` on CUDA), masked, softmax in float32, probabilities in the value dtype
  (what SDPA's flash kernels do; on the CPU, which has no float32-output ``bmm``, float32 copies of K and V).

On CUDA with Triton (``fused.available``) the same steps are three kernels (``operators/kernels/attention.py``):
with a ktinject KVCache, q/k norms, rotary, the k and v writes into the cache at each row's length and attention
over the cache in one (``rope_attention``: splits over the keys a row holds, combined by the last program, which
also advances the row lengths; other caches: norms and rotary in one kernel, their ``update``, attention in one);
and the projections, the two others, go through ``fused_dense.linear`` (cuBLAS or a Triton GEMV, whichever
measured faster for the shape; o_proj's GEMV takes the decoder layer's residual add and post-attention norm as its
epilogue, see ``forward_with_residual``).

Everything else runs the module's own forward: prefill (S > 1), output_attentions, training, autograd through the
projections, hooks on or replaced q/k/v projections or norms, partial rotary, a sliding window without a mask,
masks that are not [B, 1, 1, L] tensors. Installed per module by the attention operator
(``fast_decode``, default true) for the classes in ``SUPPORTED``, whose HF forward is exactly q/k/v projection,
optional per-head q/k norm, full rotary embedding, cache update, attention, o_proj.
Legend: B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, D head dim, L cache length.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ktinject import compat
from ktinject.operators import fast_path_report as fastpaths
from ktinject.decode import kv_cache
from ktinject.operators.kernels import common as fused
from ktinject.operators.kernels import attention as fused_attn
from ktinject.operators.kernels import dense as fused_dense
from ktinject.operators.norm import FusedRMSNorm, fuse_problem

log = logging.getLogger(__name__)

#: attention classes whose HF forward this one reproduces (checked in tests against the HF module)
SUPPORTED = frozenset({"Qwen3MoeAttention", "Qwen2MoeAttention", "MixtralAttention", "Glm4MoeAttention"})
_HF_FORWARD = "_ktinject_hf_forward"
_STATE = "_ktinject_decode_state"


def problem(module: nn.Module) -> str | None:
    """Why ``module`` cannot take the decode forward, or None."""
    why = fastpaths.layout_problem(module, SUPPORTED, dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"),
                                                                    nn.Linear))
    if why:
        return why
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
    if not getattr(module, "use_qk_norm", True) or not hasattr(module, "q_norm"):
        return None
    qn, kn = module.q_norm, getattr(module, "k_norm", None)
    for n in (qn, kn):
        if n is None or not (isinstance(n, FusedRMSNorm) or fuse_problem(n) is None):
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
    fastpaths.swap_forward(module, decode_forward, _HF_FORWARD)
    return True


def installed(module: nn.Module) -> bool:
    return _HF_FORWARD in module.__dict__


_PROJ = ("q_proj", "k_proj", "v_proj")


def _views_of(buf: torch.Tensor | None, tensors) -> bool:
    """True when ``tensors`` lie back to back at the start of ``buf`` (the joined q/k/v weights or biases)."""
    if buf is None:
        return False
    offset = 0
    for t in tensors:
        if t.device != buf.device or t.dtype != buf.dtype or t.data_ptr() != buf.data_ptr() + offset * buf.element_size():
            return False
        offset += t.numel()
    return offset == buf.numel()


def _join(projs, attr: str) -> torch.Tensor:
    """Move the projections' ``attr`` tensors into one buffer; the parameters become views of it."""
    params = [getattr(p, attr) for p in projs]
    with torch.no_grad():
        buf = torch.cat([t.detach() for t in params])
    offset = 0
    for p, t in zip(projs, params):
        view = buf[offset: offset + t.shape[0]]
        setattr(p, attr, nn.Parameter(view, requires_grad=t.requires_grad))
        offset += t.shape[0]
    return buf


def _state(module: nn.Module) -> dict:
    """The joined q/k/v weight (and bias), joined again when a projection's parameter was replaced."""
    projs = [getattr(module, n) for n in _PROJ]
    st = module.__dict__.get(_STATE)
    if st is None or not _views_of(st["w"], [p.weight for p in projs]) or (
            st["b"] is not None and not _views_of(st["b"], [p.bias for p in projs])):
        D = module.head_dim
        if st is not None:
            log.info("decode attention: layer %s: q/k/v parameters were replaced; joining them again",
                     module.layer_idx)
        st = {"hq": projs[0].out_features // D, "hk": projs[1].out_features // D,
              "w": _join(projs, "weight"), "b": _join(projs, "bias") if projs[0].bias is not None else None}
        st["sign"] = torch.cat([torch.full((D // 2,), -1.0), torch.ones(D - D // 2)]).to(st["w"])
        module.__dict__[_STATE] = st
    return st


def _plain(mod: nn.Module) -> bool:
    """No hooks and no instance forward: calling the module is calling its class's forward."""
    return not (mod._forward_hooks or mod._forward_pre_hooks or "forward" in mod.__dict__)


def _fallback_reason(module, hidden_states, position_embeddings, attention_mask, cache, kwargs,
                     norms) -> tuple[str, bool] | None:
    """(why this call runs HF's forward, whether that is expected), or None for the decode path.

    Expected: the user's choice (training, no cache, output_attentions, hooks, autograd, other dtypes) or a layout
    this forward does not cover. ``norms``: ``_qk_norms(module)``."""
    if module.training or kwargs.get("output_attentions"):
        return "training or output_attentions", True
    if cache is None:
        stray = compat.stray_cache(kwargs)  # a cache under a name ktinject.compat does not know
        return (stray, False) if stray else ("no KV cache (use_cache=False)", True)
    # the module's own attribute decides where it has one (Qwen2-MoE: None on full-attention layers, whatever
    # config.sliding_window says); 0 / None: no window
    window = (module.sliding_window if hasattr(module, "sliding_window")
              else getattr(getattr(module, "config", None), "sliding_window", None))
    if window and attention_mask is None:
        return "a sliding window with no mask to carry it", False
    if position_embeddings is None or position_embeddings[0].shape[-1] != module.head_dim:
        return "partial or no rotary embedding", True
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4
                                       or attention_mask.shape[1] != 1 or attention_mask.shape[2] != 1):
        return "a mask that is not [B, 1, 1, L]", False
    projs = [getattr(module, n) for n in _PROJ]
    if any(type(p) is not nn.Linear or not _plain(p) for p in projs):
        return "a q/k/v projection that is not a plain nn.Linear (subclass, hook or own forward)", True
    if norms is False or (norms and not all(_plain(n) and n.weight.dtype == hidden_states.dtype for n in norms[:2])):
        return "q/k norms changed, hooked or in another dtype", True
    if torch.is_grad_enabled() and any(p.weight.requires_grad for p in projs):
        return "autograd through the projections", True
    if any(p.weight.dtype != hidden_states.dtype for p in projs):
        return "projection weights in another dtype", True
    return None


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


def _fusable(norms, cos: torch.Tensor, sin: torch.Tensor, B: int, D: int) -> bool:
    """fused.qk_norm_rope takes these: cos/sin of B or 1 rows of D, norm weights no autograd records."""
    if norms and torch.is_grad_enabled() and (norms[0].weight.requires_grad or norms[1].weight.requires_grad):
        return False
    return all(t.shape[0] in (1, B) and t.numel() == t.shape[0] * D for t in (cos, sin))


def qk_norm_rope(qkv: torch.Tensor, hq: int, hk: int, norms, cos: torch.Tensor, sin: torch.Tensor,
                 sign: torch.Tensor) -> torch.Tensor:
    """q and k of qkv [B, Hq + 2 Hkv, D] normed (norms: (q_norm, k_norm, eps) or None) and rotated by cos/sin
    [B, 1, D] in torch ops; sign [D]: -1 for the first half, +1 after. [B, Hq + Hkv, D]."""
    D = qkv.shape[-1]
    qk = qkv[:, : hq + hk]
    if norms:  # HF: weight * normalized.to(dtype); the stacked weights are made per call (always current)
        norm_w = torch.cat([norms[0].weight.expand(hq, D), norms[1].weight.expand(hk, D)])
        qk = torch.rms_norm(qk, (D,), None, norms[2]) * norm_w
    cos, sin = cos.to(qk.dtype), sin.to(qk.dtype)
    return torch.addcmul(qk * cos, qk.roll(D // 2, -1), sin * sign)


def decode_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs):
    """The module's forward for one query token (see the module docstring); anything else: HF's forward.

    The KV cache arrives under the name of the installed transformers (``ktinject.compat``); ``kwargs`` go to
    HF's forward as they came, so a fallback passes the cache under the caller's name."""
    return _step(self, hidden_states, None, position_embeddings, attention_mask, kwargs)[0], None


def forward_with_residual(module: nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor,
                          position_embeddings=None, attention_mask=None, norm: tuple | None = None,
                          **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(``residual + module(hidden_states, ...)[0]``, its RMSNorm or None) for the decoder layer's decode forward
    (decode/layer.py): on the decode path the residual add is o_proj's epilogue, and with ``norm`` =
    (weight, eps, round_twice) the kernel normalizes the sum too where it runs (else None: the caller's norm).
    A module without the decode forward, or with hooks (which this call would bypass), is called as a module."""
    if not installed(module) or _hooked(module):
        out = module(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask, **kwargs)
        return residual + out[0], None
    return _step(module, hidden_states, residual, position_embeddings, attention_mask, kwargs, norm)


def _hooked(module: nn.Module) -> bool:
    glob = torch.nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks or glob._global_forward_hooks
                or glob._global_forward_pre_hooks)


def _step(self, hidden_states, residual, position_embeddings, attention_mask, kwargs, norm=None):
    """(the attention output projected by o_proj, plus ``residual`` when given, [B, 1, H]; its norm or None)."""
    hf = self.__dict__[_HF_FORWARD]

    def by_hf():
        out = hf(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask, **kwargs)[0]
        return (out if residual is None else residual + out), None

    if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:  # prefill: HF's forward, not a fallback
        return by_hf()
    norms = _qk_norms(self)
    cache = compat.cache_from(kwargs)
    why = _fallback_reason(self, hidden_states, position_embeddings, attention_mask, cache, kwargs, norms)
    report = fastpaths.report_for(self)
    if why is not None:
        report.fell_back("decode_attention", f"{type(self).__name__} layer {self.layer_idx}: {why[0]}", why[1])
        return by_hf()
    report.ran("decode_attention")
    st = _state(self)
    B, D, hq, hk = hidden_states.shape[0], self.head_dim, st["hq"], st["hk"]
    qkv = fused_dense.linear(hidden_states.reshape(B, -1), st["w"], st["b"])[0].view(B, hq + 2 * hk, D)
    cos, sin = position_embeddings  # [B, 1, D]
    if fused.available(qkv, D) and _fusable(norms, cos, sin, B, D) and (
            attention_mask is None or attention_mask.stride(-1) == 1):  # Triton: rotary, cache write, attention
        slots = kv_cache.decode_slots(cache, self.layer_idx, B, qkv)  # (K, V, lengths), or None: cache.update
        if slots is not None:  # one kernel: q/k norms, rotary, k and v into the cache, attention
            mask = None if attention_mask is None else attention_mask[..., : slots[0].shape[2]]
            out = fused_attn.rope_attention(qkv, hq, norms, cos, sin, slots, self.scaling, mask)  # [B, Hq D]
        else:
            qk = fused_attn.qk_norm_rope(qkv, hq, hk, norms, cos, sin)
            keys, values = cache.update(qk[:, hq:].unsqueeze(2), qkv[:, hq + hk:].unsqueeze(2), self.layer_idx)
            mask = None if attention_mask is None else attention_mask[..., : keys.shape[2]]
            out = fused_attn.attention(qk[:, :hq], keys, values, self.scaling, mask)  # [B, Hq D]
    else:
        out = _attend_torch(self, qkv, hq, hk, norms, cos, sin, st["sign"], cache, attention_mask)
    y, normed = _o_proj(self, out, residual, norm)
    return y.view(B, 1, -1), None if normed is None else normed.view(B, 1, -1)


def _attend_torch(self, qkv, hq, hk, norms, cos, sin, sign, cache, attention_mask) -> torch.Tensor:
    """Rotary, cache update and attention in torch ops (CPU, no Triton): [B, Hq D]."""
    B, _, D = qkv.shape
    qk = qk_norm_rope(qkv, hq, hk, norms, cos, sin, sign)  # [B, Hq + Hkv, D]
    keys, values = cache.update(qk[:, hq:].unsqueeze(2), qkv[:, hq + hk:].unsqueeze(2), self.layer_idx)
    L = keys.shape[2]  # [B, Hkv, L, D]
    if attention_mask is not None:
        attention_mask = attention_mask[..., :L]  # as HF's sdpa: a mask may be longer than the keys
    G = hq // hk
    q = qk[:, :hq].reshape(B * hk, G, D)
    s = _scores(q, keys.reshape(B * hk, L, D)).view(B, hk, G, L)  # float32
    v = values.reshape(B * hk, L, D)
    s.mul_(self.scaling)
    if attention_mask is not None:
        s = torch.where(attention_mask, s, float("-inf")) if attention_mask.dtype == torch.bool else s + attention_mask
    p = torch.softmax(s, dim=-1)
    if _BMM_OUT_DTYPE.get(q.device.type, False) or values.dtype == torch.float32:  # p in V's dtype, as flash
        out = torch.bmm(p.to(values.dtype).view(B * hk, G, L), v)  # [B Hkv, G, D]
    else:  # no float32-output bmm here (the CPU): float32 throughout, as the CPU's SDPA kernels
        out = torch.bmm(p.view(B * hk, G, L), v.float()).to(values.dtype)
    return out.view(B, hq * D)


def _o_proj(self, out: torch.Tensor, residual: torch.Tensor | None, norm: tuple | None):
    """(o_proj(out) (+ residual) [B, H], its norm or None): a plain Linear by fused_dense.linear (the add and the
    norm in the kernel where it runs), anything else as a module."""
    o = self.o_proj
    B = out.shape[0]
    res = None if residual is None else residual.reshape(B, -1)
    if type(o) is nn.Linear and _plain(o) and o.weight.dtype == out.dtype and not (
            torch.is_grad_enabled() and o.weight.requires_grad):
        return fused_dense.linear(out, o.weight, o.bias, res, norm)
    y = o(out)
    return (y if res is None else res + y), None


def uninstall(module: nn.Module) -> None:
    """Give ``module`` back its own forward (no-op where the decode forward is not installed)."""
    fastpaths.restore_forward(module, _HF_FORWARD, _STATE)
