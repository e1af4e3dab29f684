"""``python -m ktinject.info``: what ktinject sees on this machine (CPU, ISA, cores, native library, versions, GPUs);
``ktinject.info(model)``: the same facts as a dict, and for an injected model which fast paths are active."""
from __future__ import annotations

import os
import platform

import torch

from ktinject import __version__, compat, envs, native
from ktinject.operators import fast_path_report as fastpaths
from ktinject.decode import attention as decode_attention


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def lines() -> list[str]:
    """The report, one line per fact."""
    out = [f"ktinject        {__version__}", f"cpu             {cpu_model()} ({os.cpu_count()} logical CPUs)"]
    try:
        out.append(f"native library  {native.library_path()} (version {native.version()})")
        out.append(f"cpu features    {' '.join(native.cpu_features()) or '(none beyond SSE)'}")
        try:
            isa = native.isa()
        except native.NativeError as e:
            isa = f"ERROR: {e.message}"
        out.append(f"isa             {isa} (best {native.best_isa()}; available {', '.join(native.available_isas())})")
        env_threads = (envs.raw("KTINJECT_THREADS") or "").strip()
        out.append(f"physical cores  {native.physical_cores()}; default pool threads "
                   f"{env_threads + ' (KTINJECT_THREADS)' if env_threads else native.default_threads()}")
    except ImportError as e:
        out.append(f"native library  NOT BUILT ({e}); run: pip install -e .")
    out.append(f"python          {platform.python_version()}")
    out.append(f"torch           {torch.__version__} (threads {torch.get_num_threads()})")
    try:
        import transformers  # optional here: the report says when it is missing
        out.append(f"transformers    {transformers.__version__}")
    except ImportError:
        out.append("transformers    not installed")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append(f"cuda:{i}          {p.name}, {p.total_memory / 2**30:.1f} GiB")
    else:
        out.append("cuda            no CUDA device")
    return out


def info(model=None) -> dict:
    """Versions, and for a model injected by ktinject its fast paths: ``{"fast_paths": {path: {"active": True |
    False | None (not run yet), "reason": why it last fell back or cannot run, "fast_calls", "fallback_calls"}}}``
    (see ``ktinject.operators.fast_path_report``), and where the hot-expert budget was ``auto`` (or a share) the
    lines of how it was found (``"gpu_budget"``: ``ktinject.gpu_experts.hot.budget.Budget.lines``)."""
    try:
        import transformers  # optional here: the report says when it is missing
        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    out = {"ktinject": __version__, "torch": torch.__version__, "transformers": tf_version,
           "transformers_tested": compat.supported_range(), "cuda": torch.cuda.is_available()}
    if model is None:
        return out
    report = model.__dict__.get(fastpaths.ATTR)
    if report is None:
        raise ValueError(f"{type(model).__name__} was not injected by ktinject (ktinject.inject or "
                         f"ktinject.from_pretrained): it has no fast paths to report")
    paths = report.as_dict()
    st = paths["decode_attention"]
    if st["active"] is None:
        why = _decode_attention_missing(model)
        if why:
            st.update(active=False, reason=why)
    st = paths.get("graph_decode")
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    device = getattr(getattr(emb, "weight", None), "device", None)
    if st is not None and st["active"] is None and device is not None and device.type != "cuda":
        from ktinject.decode.graph_runner import no_cuda_reason

        st.update(active=False, reason=no_cuda_reason(device))  # known before a run
    out["fast_paths"] = paths
    budget = model.__dict__.get("_ktinject_budget")  # ktinject.injection.gpu_budget: how an auto budget was found
    if budget is not None:
        out["gpu_budget"] = budget.lines()
    return out


def _decode_attention_missing(model) -> str | None:
    """Why no attention module of ``model`` has the decode forward, or None when some have it."""
    attns = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    if any(decode_attention.installed(m) for m in attns):
        return None
    if not attns:
        return "no attention modules found"
    return f"not installed: {decode_attention.problem(attns[0]) or 'the rules turned it off (fast_decode: false)'}"


def main() -> None:
    for line in lines():
        print(line)



if __name__ == "__main__":
    main()
