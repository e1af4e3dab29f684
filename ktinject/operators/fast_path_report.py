"""Which of ktinject's fast paths a model runs, and why one fell back to Hugging Face's code.

The paths: ``decode_attention`` (one-token attention steps, decode/attention.py), ``decode_layer`` (the
decoder layer's residual adds fused with the norms after them, decode/layer.py), ``graph_decode`` (the
decode step replayed as one CUDA graph, decode/graph_runner.py) and ``fast_router`` (router + top-k in fewer kernels,
operators/moe.py). Each injected model carries one ``FastPaths`` report (``attach``), which the paths update on
every eager call (inside a captured graph nothing runs Python, and nothing needs counting).

A fallback for a reason the user chose or a layout ktinject does not cover (hooks, autograd, training,
``output_attentions``, no CUDA device, a router that is not softmax + top-k) is recorded quietly. Any other reason
(an argument under a name this transformers release uses but ktinject does not know, a cache layout the graph
cannot hold, a failed capture) logs one warning per model and path, saying which path, why, and what it costs:
a fast path never turns itself off in silence. ``ktinject.info(model)`` and the chat's ``/stats`` show the report.
"""
from __future__ import annotations

import logging
import types
from dataclasses import dataclass

log = logging.getLogger("ktinject")

#: path -> what falling back costs (the warning's last sentence)
COST = {
    "decode_attention": "Hugging Face's attention forward runs instead: several more GPU kernels per layer and "
                        "decode step, and no CUDA graph can hold its Python-side cache bookkeeping",
    "decode_layer": "Hugging Face's decoder-layer forward runs instead: residual adds and norms as separate "
                    "kernels, a few more GPU kernels per layer and decode step",
    "graph_decode": "decode steps run eagerly: Python and one kernel launch per operation in every layer, "
                    "typically several times slower per token on a GPU",
    "fast_router": "Hugging Face's router runs instead: a few more small GPU kernels per MoE layer",
}
ATTR = "_ktinject_fast_paths"


@dataclass
class PathState:
    """One path of one model: calls that took it, calls that fell back, the last fallback's reason."""
    fast: int = 0
    fallback: int = 0
    reason: str | None = None
    last_fast: bool | None = None
    warned: bool = False

    @property
    def active(self) -> bool | None:
        """True: the last call took the fast path; False: it fell back; None: not called yet."""
        return self.last_fast


class FastPaths:
    """The per-model report (see the module docstring)."""

    def __init__(self, model_name: str = "model"):
        self.model_name = model_name
        self.paths: dict[str, PathState] = {name: PathState() for name in COST}

    def ran(self, path: str) -> None:
        st = self.paths[path]
        st.fast += 1
        st.last_fast = True

    def fell_back(self, path: str, reason: str, expected: bool = False) -> None:
        """Record a fallback; ``expected``: the user chose it or the layout is not covered (no warning)."""
        st = self.paths[path]
        st.fallback += 1
        st.last_fast = False
        st.reason = reason
        if not expected and not st.warned:
            st.warned = True
            log.warning("ktinject: %s: the %s fast path fell back to Hugging Face's code: %s. Cost: %s.",
                        self.model_name, path, reason, COST[path])

    def unavailable(self, path: str, reason: str) -> None:
        """The path cannot run on this model at all (class, layout, device): reported, not warned about."""
        st = self.paths[path]
        st.last_fast = False
        st.reason = reason

    def as_dict(self) -> dict[str, dict]:
        return {name: {"active": st.active, "reason": st.reason, "fast_calls": st.fast,
                       "fallback_calls": st.fallback} for name, st in self.paths.items()}


_DEFAULT = FastPaths("a module outside an injected model")


def attach(model) -> FastPaths:
    """Give ``model`` and each of its submodules the model's report (once; returns it)."""
    report = model.__dict__.get(ATTR)
    if report is None:
        report = FastPaths(type(model).__name__)
    for module in model.modules():
        module.__dict__[ATTR] = report
    return report


def layout_problem(module, supported, parts: dict) -> str | None:
    """Why ``module`` is not of a class in ``supported`` with a submodule of the given torch.nn type under each name
    of ``parts`` (name -> type), or None."""
    cname = type(module).__name__
    if cname not in supported:
        return f"class {cname} is not one of {', '.join(sorted(supported))}"
    for name, kind in parts.items():
        if not isinstance(getattr(module, name, None), kind):
            return f"{name} is not an nn.{kind.__name__}"
    return None


def swap_forward(module, fn, key: str) -> None:
    """Make ``fn`` (called as ``fn(module, ...)``) the forward of this one ``module``; its own forward is kept under
    ``key`` for what ``fn`` does not take (once: a second call keeps the first)."""
    if key not in module.__dict__:
        module.__dict__[key] = module.forward
        module.forward = types.MethodType(fn, module)


def restore_forward(module, key: str, *extra: str) -> None:
    """Undo ``swap_forward`` (and drop the ``extra`` attributes the fast path kept on the module)."""
    if key in module.__dict__:
        del module.__dict__["forward"]
        del module.__dict__[key]
        for name in extra:
            module.__dict__.pop(name, None)


def report_for(module) -> FastPaths:
    """The report of the model ``module`` belongs to (a process-wide one for modules used on their own)."""
    return module.__dict__.get(ATTR) or _DEFAULT
