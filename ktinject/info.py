"""``python -m ktinject.info``: what ktinject sees on this machine (CPU, ISA, cores, native library, versions, GPUs)."""
from __future__ import annotations

import os
import platform


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
    import torch

    from ktinject import __version__, native

    out = [f"ktinject        {__version__}", f"cpu             {cpu_model()} ({os.cpu_count()} logical CPUs)"]
    try:
        out.append(f"native library  {native.library_path()} (version {native.version()})")
        out.append(f"cpu features    {' '.join(native.cpu_features()) or '(none beyond SSE)'}")
        try:
            isa = native.isa()
        except native.NativeError as e:
            isa = f"ERROR: {e.message}"
        out.append(f"isa             {isa} (best {native.best_isa()}; available {', '.join(native.available_isas())})")
        env_threads = os.environ.get("KTINJECT_THREADS")
        out.append(f"physical cores  {native.physical_cores()}; default pool threads "
                   f"{env_threads + ' (KTINJECT_THREADS)' if env_threads else native.default_threads()}")
    except ImportError as e:
        out.append(f"native library  NOT BUILT ({e}); run: pip install -e .")
    out.append(f"python          {platform.python_version()}")
    out.append(f"torch           {torch.__version__} (threads {torch.get_num_threads()})")
    try:
        import transformers
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


def main() -> None:
    for line in lines():
        print(line)


if __name__ == "__main__":
    main()
