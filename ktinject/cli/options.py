"""What the command-line programs share (``ktinject chat``, ``ktinject serve``, ...): the options that load a model,
their checks before anything heavy loads, the one-line error, and ``--version``.

``add_prefix_cache_options(parser)`` adds --prefix-cache and its budgets (chat and serve), ``make_prefix_cache(args,
device)`` makes the store. ``add_model_options(parser)`` adds --model, --rules, --quant, --defer, --prefill,
--threads, --gpu-experts-budget, --gpu-memory, --placement, --expert-stats, --rebalance-every and --gpu;
``resolve(args, demo_line)`` checks the model directory and the rules (the demo model, and ``demo_line`` printed,
without --model); ``hot_options(args)`` checks the hot-expert options with the code inject and from_pretrained use,
and adds the GPU budget's (``gpu_budget_options``: the cap, the KV cache, the prefix cache's GPU tier;
``check_gpu_memory`` checks the cap against the device); ``device(args)`` picks the GPU device (a missing CUDA is an
error, not a slow surprise) and sets the threads; ``load(args, demo_line, setup)`` does all of it and loads through
ktinject, a failure being one line (with -v the traceback). A user error is a ``CliError``: ``run(prog, main)``
prints it as ``PROG: error: ...`` on stderr and gives exit code 2.

torch and transformers are imported inside the functions that need them, so --help and these checks answer at once.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ktinject.gpu_experts.hot.settings import DEFAULT_REBALANCE_EVERY, STRATEGIES, HotExpertSettings


class CliError(Exception):
    """A user error: printed as one line on stderr, exit code 2."""


def version() -> str:
    """The installed distribution's version (importlib.metadata), else the package's ``__version__``."""
    from importlib import metadata

    try:
        return metadata.version("ktinject")
    except metadata.PackageNotFoundError:
        from ktinject import __version__

        return __version__


def add_version(p: argparse.ArgumentParser) -> None:
    """--version: prints ``ktinject VERSION`` and exits."""
    p.add_argument("--version", action="version", version=f"ktinject {version()}",
                   help="print the version and exit")


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


_DEFER_FORMS = ("an int D >= 0 (experts deferred per token) or a float 0 < M < 1 (the share of each token's routing "
                "weight deferred), e.g. 2 or 0.3")


def defer_setting(text: str) -> int | float:
    """An expert-deferral setting (``ktinject.operators.deferral``) as typed: "2" the int 2 (slots per token), "0.3"
    the float 0.3 (a share of each token's routing weight); argparse type (the bound D < k is checked at injection,
    when k is known)."""
    try:
        value = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {_DEFER_FORMS}") from None
    if value < 0 if isinstance(value, int) else not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: expected {_DEFER_FORMS}")
    return value


def defer_list(text: str) -> list[int | float]:
    """Comma-separated deferral settings (--defer of eval and bench decode); ArgumentTypeError naming the bad one."""
    return [defer_setting(x.strip()) for x in text.split(",") if x.strip()]


def defer_settings(values) -> list[int | float]:
    """Deferral settings to score or time in turn, with 0 (the baseline): distinct, 0 and the counts first, then the
    shares, each ascending."""
    return sorted({0, *values}, key=lambda v: (isinstance(v, float), v))


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The options that say which model to load and how (the options tables of docs/chat.md and docs/serving.md list
    them for each program)."""
    p.add_argument("--model", help="Hugging Face checkpoint directory (default: the built-in demo model)")
    p.add_argument("--rules", help="rules YAML file or packaged name (default: the model family's file)")
    # quant, defer and prefill default to None: the rules' own kwargs then hold (an option given overrides them)
    p.add_argument("--quant", choices=["bf16", "int8", "int4", "fp8", "mxfp4"],
                   help="expert weight format (default: a quantized checkpoint's own format, e.g. mxfp4 for an MXFP4 "
                        "release, else the rules' quant, else bf16)")
    p.add_argument("--defer", metavar="D|M", type=defer_setting,
                   help="expert deferral: the D lowest-weighted of each token's experts (an int), or its "
                        "lowest-weighted experts up to a share M of its routing weight (a float, 0 < M < 1), run one "
                        "MoE layer late in decode steps (default: the rules' defer, else 0: off)")
    p.add_argument("--prefill", choices=["auto", "cpu", "gpu"],
                   help="where a prompt's routed experts run: auto (split between the CPU and the GPU, experts "
                        "streamed over PCIe), cpu, or gpu (default: the rules' prefill, else auto)")
    p.add_argument("--dense-fp8", choices=["none", "attention", "mlp", "all"],
                   help="an FP8 checkpoint's attention / MLP projections kept in FP8 on the GPU (half the memory and "
                        "bytes a decode step reads; default none: dequantized to the model dtype)")
    p.add_argument("--threads", type=positive,
                   help="CPU threads for the experts and for torch (default: experts one per physical core, less one "
                        "from 8 cores up; torch one on the CPU path)")
    p.add_argument("--gpu-experts-budget", metavar="SIZE",
                   help="GPU bytes for hot routed experts: auto (what the GPU has left after the dense part, the KV "
                        "cache, the prefill ring, workspace and a margin), 0 (every expert on the CPU), a size like "
                        "12GiB, or a share of what is left like 0.5 (default: the rules' kwarg, else auto)")
    p.add_argument("--gpu-memory", metavar="SIZE", type=_byte_size,
                   help="at most this much of the GPU for the whole run (weights, KV cache, prefill ring, hot "
                        "experts), e.g. 24GiB (default: the whole card)")
    p.add_argument("--placement", choices=STRATEGIES,
                   help="how hot experts are chosen (default: frequency with --expert-stats, else dynamic)")
    p.add_argument("--expert-stats", metavar="FILE", help="expert statistics from python -m ktinject.calibrate")
    p.add_argument("--rebalance-every", metavar="N", type=positive,
                   help=f"dynamic placement: tokens between re-rankings (default {DEFAULT_REBALANCE_EVERY})")
    p.add_argument("--gpu", help='device for the dense part (default "cuda" if available, else "cpu")')


def resolve(args: argparse.Namespace, demo_line: str, out=None) -> tuple[Path, str | None]:
    """(model directory, rules: a file path, a packaged name or None), checked before anything heavy loads. Without
    --model: the demo model, after printing ``demo_line`` (``{path}`` is its directory) to ``out`` (stdout)."""
    if args.model is None:
        from ktinject.demo import demo_model_dir

        model = demo_model_dir()
        print(demo_line.format(path=model), file=out or sys.stdout, flush=True)
    else:
        model = Path(args.model).expanduser()
        gguf = model.suffix == ".gguf" or (model.is_dir() and not (model / "config.json").is_file()
                                           and any(model.glob("*.gguf")))
        if gguf and model.exists():
            pass  # a GGUF model: its config and tokenizer come from the metadata
        elif model.is_file():
            hint = f" (its directory: --model {model.parent})" if (model.parent / "config.json").is_file() else ""
            raise CliError(f"--model {args.model} is a file, not a model directory: pass the checkpoint's "
                           f"directory, the one with config.json, or a .gguf file{hint}")
        elif not model.is_dir():
            hub = args.model.count("/") == 1 and not args.model.startswith((".", "/", "~"))  # "org/name"
            hint = (" (a Hugging Face Hub id? ktinject downloads nothing: fetch it first, e.g. `hf download "
                    f"{args.model} --local-dir DIR`, and pass --model DIR)") if hub else ""
            raise CliError(f"model directory not found: {args.model}{hint}")
        elif not (model / "config.json").is_file():
            raise CliError(f"not a Hugging Face model directory (no config.json) nor a GGUF model: {args.model}")
    if args.rules is None:
        return model, None
    from ktinject.injection.rules import packaged_files

    path = Path(args.rules).expanduser()
    if path.is_file():
        return model, str(path)
    if args.rules in packaged_files() or f"{args.rules}.yaml" in packaged_files():
        return model, args.rules  # a packaged rule file, by name ("qwen3_moe")
    raise CliError(f"rules file not found: {args.rules}")


def hot_options(args: argparse.Namespace) -> dict:
    """from_pretrained's hot-expert options from --gpu-experts-budget / --placement / --expert-stats /
    --rebalance-every, checked before anything loads (the same check inject and from_pretrained make), and those of
    the GPU budget (``gpu_budget_options``)."""
    options = dict(gpu_experts_budget=args.gpu_experts_budget, placement=args.placement, stats=args.expert_stats,
                   rebalance_every=args.rebalance_every)
    try:
        HotExpertSettings.make(**options)
    except ValueError as e:
        raise CliError(f"hot experts: {e}") from e
    return {**options, **gpu_budget_options(args)}


def gpu_budget_options(args: argparse.Namespace) -> dict:
    """What the GPU budget leaves room for, from the program's options: --gpu-memory (the cap), the server's
    --max-batch / --max-context (the KV cache; the chat's: generate's), the GPU tier of the prefix cache the program
    makes after the load (--prefix-cache, --prefix-cache-gpu)."""
    options = {}
    if getattr(args, "gpu_memory", None) is not None:
        options["gpu_memory"] = args.gpu_memory
    for name in ("max_batch", "max_context"):
        if getattr(args, name, None) is not None:
            options[name] = getattr(args, name)
    if getattr(args, "prefix_cache", "off") in ("gpu", "ram", "disk"):
        from ktinject.decode.prefix_cache.store import DEFAULT_BUDGETS

        gpu_tier = getattr(args, "prefix_cache_gpu", None)
        options["gpu_reserve"] = DEFAULT_BUDGETS["gpu"] if gpu_tier is None else gpu_tier
    return options


def check_gpu_memory(args: argparse.Namespace, gpu: str) -> None:
    """--gpu-memory against the device: a CliError for a CPU-only run or a cap larger than the card."""
    cap = getattr(args, "gpu_memory", None)
    if cap is None:
        return
    if not gpu.startswith("cuda"):
        raise CliError(f"--gpu-memory: the dense part runs on {gpu} (no CUDA device), so there is no GPU memory to "
                       f"cap; leave --gpu-memory out")
    import torch

    from ktinject.gpu_experts.hot.settings import human_bytes

    total = torch.cuda.get_device_properties(torch.device(gpu)).total_memory
    if cap > total:
        raise CliError(f"--gpu-memory {human_bytes(cap)} is more than {gpu} has ({human_bytes(total)}): give at "
                       f"most that, or leave --gpu-memory out to use the whole card")


def quiet_transformers() -> None:
    """transformers' own logs and progress bars off (the programs print what matters)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def device(args: argparse.Namespace) -> str:
    """The device of the dense part (--gpu, else CUDA where there is one); --threads set for torch and the experts.

    Without --threads on the CPU path, torch's own intra-op threads are one: the dense work beside the experts is
    small, and torch's OpenMP team spin-waits for its members at every parallel region, so on a host where another
    process holds a core a team of two stalls for whole time slices at every step (docs/performance.md, "Busy
    hosts"); the experts keep the native pool's threads, which do not wait for one another."""
    import torch

    gpu = args.gpu or ("cuda" if torch.cuda.is_available() else "cpu")
    if gpu.startswith("cuda") and not torch.cuda.is_available():
        raise CliError(f"--gpu {gpu}: CUDA is not available on this machine (use --gpu cpu)")
    if args.threads:
        from ktinject import native

        torch.set_num_threads(args.threads)
        native.set_default_threads(args.threads, source=f"--threads {args.threads}")  # warns above the cores
    elif gpu == "cpu":
        torch.set_num_threads(1)
    return gpu


def experts_format(model) -> str:
    """What the model's routed experts are stored as, for the load line: "int4 (groups of 128)", "bf16", or "no MoE
    blocks"; several formats (rules per layer) joined by " + "."""
    seen = []
    for m in _moe_blocks(model):
        ex = m.native_experts
        what = f"{ex.quant} (groups of {ex.group_size})" if ex.quant in ("int4", "fp8") else ex.quant
        if what not in seen:
            seen.append(what)
    return " + ".join(seen) or "no MoE blocks"


def defer_format(model) -> str:
    """The expert-deferral setting of the model's MoE blocks for the load line ("", "defer=2", "defer=0.28"; several
    joined by " + "): empty when none defers."""
    seen = []
    for m in _moe_blocks(model):
        if m.defer and m.defer not in seen:
            seen.append(m.defer)
    return f"defer={' + '.join(map(str, seen))}" if seen else ""


def _moe_blocks(model):
    """The model's injected MoE blocks (the modules holding native experts)."""
    return (m for m in model.modules() if getattr(m, "native_experts", None) is not None)


def load_tokenizer(model_dir):
    """The tokenizer of a model directory, or of a GGUF model (a .gguf file or a directory holding one): built by
    transformers from the GGUF metadata, chat template included."""
    from transformers import AutoTokenizer

    from ktinject.injection.formats.gguf import tokenizer_source

    source = tokenizer_source(model_dir)
    if source is not None:
        return AutoTokenizer.from_pretrained(source[0], gguf_file=source[1])
    return AutoTokenizer.from_pretrained(model_dir)


def load_model(model_dir, rules=None, quant=None, progress=True, **options):
    """Load a checkpoint through ktinject; returns (model, tokenizer, plan). ``options``: from_pretrained's keywords
    (device variables, hot-expert options)."""
    from ktinject.injection.loading import from_pretrained

    tokenizer = load_tokenizer(model_dir)
    model = from_pretrained(model_dir, rules, quant=quant, progress=progress, **options)
    return model.eval(), tokenizer, model._ktinject_plan


def load(args: argparse.Namespace, demo_line: str, setup, out=None) -> tuple[Path, object, object, str, float]:
    """The model of ``args``: paths and hot-expert options checked (``resolve``, ``hot_options``), then
    ``setup(args)`` (the program's logging; returns the device, see ``device``), then ``load_model``; the plan printed
    with -v; ``out``: where the demo line and the plan go (stdout). (model directory, model, tokenizer, device, seconds
    the load took). A load failure (bad rules, unsupported model, unreadable checkpoint) is a one-line CliError, unless
    -v (the traceback then)."""
    model_dir, rules = resolve(args, demo_line, out)
    hot = hot_options(args)
    gpu = setup(args)
    check_gpu_memory(args, gpu)
    t0 = time.perf_counter()
    try:
        fp8 = {"dense_fp8": args.dense_fp8} if getattr(args, "dense_fp8", None) else {}
        model, tokenizer, plan = load_model(model_dir, rules, quant=args.quant, progress=sys.stderr.isatty(),
                                            gpu=gpu, defer=args.defer, prefill=args.prefill, **fp8, **hot)
    except Exception as e:  # noqa: BLE001 - user errors, one line
        if args.verbose:
            raise
        raise CliError(f"cannot load {model_dir}: {type(e).__name__}: {e} (-v shows the traceback)") from e
    if args.verbose and plan is not None:
        print(plan, file=out or sys.stdout)
    return model_dir, model, tokenizer, gpu, time.perf_counter() - t0


def run(prog: str, main, *args) -> int:
    """``main(*args)``'s exit code, with a CliError printed as one line ``PROG: error: ...`` (exit code 2) and Ctrl-C
    exiting 130."""
    try:
        return main(*args)
    except CliError as e:
        message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def add_prefix_cache_options(p: argparse.ArgumentParser) -> None:
    """--prefix-cache and its budgets (``ktinject.decode.prefix_cache``; docs/prefix-cache.md)."""
    p.add_argument("--prefix-cache", choices=["gpu", "ram", "disk", "off"], default="ram",
                   help="reuse the computed prefix of earlier prompts, so a prompt prefills only what is new: the "
                        "lowest tier kept (gpu: GPU memory; ram: GPU and host RAM; disk: those and a directory that "
                        "survives restarts) or off (default: ram)")
    for tier in ("gpu", "ram", "disk"):
        p.add_argument(f"--prefix-cache-{tier}", metavar="SIZE", type=_byte_size,
                       help=f"bytes of the prefix cache's {tier} tier, e.g. 2GiB "
                            f"(default {_DEFAULT_BUDGET_TEXT[tier]})")
    p.add_argument("--prefix-cache-dir", metavar="DIR",
                   help="the disk tier's directory (default ~/.cache/ktinject/prefix)")
    p.add_argument("--prefix-block", metavar="N", type=positive,
                   help="tokens per prefix cache block (default 256)")


_DEFAULT_BUDGET_TEXT = {"gpu": "4GiB", "ram": "8GiB", "disk": "64GiB"}


def _byte_size(text: str) -> int:
    from ktinject.gpu_experts.hot.settings import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def make_prefix_cache(args: argparse.Namespace, device: str, keep_generated: bool = False):
    """The PrefixCache of ``add_prefix_cache_options``' options (None with --prefix-cache off); ``keep_generated``
    (the chat's): it keeps the replies too, so a follow-up turn prefills only the new message."""
    if getattr(args, "prefix_cache", "off") == "off":
        return None
    from ktinject.decode.prefix_cache import PrefixCache
    from ktinject.decode.prefix_cache.store import DEFAULT_BLOCK_SIZE

    return PrefixCache(tier=args.prefix_cache, block_size=args.prefix_block or DEFAULT_BLOCK_SIZE,
                       gpu_bytes=args.prefix_cache_gpu, ram_bytes=args.prefix_cache_ram,
                       disk_bytes=args.prefix_cache_disk, disk_path=args.prefix_cache_dir,
                       device=device if device.startswith("cuda") else "cpu", keep_generated=keep_generated)
