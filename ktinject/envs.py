"""Every ``KTINJECT_*`` environment variable, in one table: name, type, default, meaning, audience, who reads it.

Python code reads them only through this module (``get``, ``raw``, ``is_set``; ``overridden`` sets one for a
block), so a malformed value fails with an error naming the variable and what to write, and a name the table does
not hold fails loudly (KeyError). The native core reads its own with ``getenv`` (native/src; ``read_by`` says
"native"), the build reads ``KTINJECT_CFLAGS`` before this package can be imported ("build"), and the tests read a
few of their own ("tests"); the table lists those too. ``tests/test_envs.py`` fails when code reads a variable the
table does not name, when an entry is read nowhere, or when docs/internals/environment.md is not what
``markdown()`` writes (``python -m ktinject.envs --markdown > docs/internals/environment.md``).

Audiences: "user" variables are the supported settings; "developer" ones exist for tests and measurements, each
with ``why``: the question it keeps open or the reference path it keeps reachable. ``RETIRED`` names the
variables that are gone (an A/B question settled) and what was decided, so a stale one in a shell can be
explained (``python -m ktinject.envs``).

Nothing runs at import beyond building the table (the model: vLLM's ``envs.py``, one place for every variable).
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterator

TYPES = ("int", "float", "str", "bool", "path", "choice")
AUDIENCES = ("user", "developer")
READERS = ("python", "native", "build", "tests")


@dataclass(frozen=True)
class Var:
    """One variable. ``default``: the value ``get`` returns when it is unset or empty (None: decided elsewhere,
    ``shown_default`` says how); ``choices``: the accepted values of a "choice" (compared in lower case);
    ``minimum``: the smallest accepted int / float; ``read_by``: where it is read (any of READERS); ``why``: for
    developer-only variables, why it exists."""

    name: str
    type: str
    default: Any
    meaning: str
    audience: str = "user"
    read_by: tuple[str, ...] = ("python",)
    why: str = ""
    choices: tuple[str, ...] = ()
    minimum: int | float | None = None
    shown_default: str = ""

    def __post_init__(self):
        if not self.name.startswith("KTINJECT_") or self.type not in TYPES or self.audience not in AUDIENCES:
            raise ValueError(f"{self.name}: name must start with KTINJECT_, type be one of {TYPES}, audience one "
                             f"of {AUDIENCES}")
        if not self.read_by or not set(self.read_by) <= set(READERS):
            raise ValueError(f"{self.name}: read_by must be some of {READERS}, got {self.read_by}")
        if (self.audience == "developer") != bool(self.why):
            raise ValueError(f"{self.name}: a developer-only variable says why it exists (why=...); a user one not")
        if (self.type == "choice") != bool(self.choices):
            raise ValueError(f"{self.name}: choices go with type 'choice' (and only with it)")

    def default_text(self) -> str:
        return self.shown_default or ("unset" if self.default is None else
                                      ("1" if self.default else "0") if self.type == "bool" else str(self.default))

    def values_text(self) -> str:
        if self.type == "choice":
            return " | ".join(self.choices)
        if self.type == "bool":
            return "0 | 1"
        if self.minimum is not None:
            return f"{self.type} >= {self.minimum}"
        return self.type

    def parse(self, raw: str) -> Any:
        """``raw`` (stripped, non-empty) as this variable's type; ValueError naming the variable and what to write."""
        unset = f"unset it for the default, {self.default_text()}"
        if self.type in ("int", "float"):
            kind = int if self.type == "int" else float
            try:
                value = kind(raw)
            except ValueError:
                article = "an" if self.type == "int" else "a"
                raise ValueError(f"{self.name}={raw!r} is not {article} {'integer' if kind is int else 'number'} "
                                 f"({unset})") from None
            if self.minimum is not None and value < self.minimum:
                raise ValueError(f"{self.name}={value} is below {self.minimum} ({unset})")
            return value
        if self.type == "bool":
            if raw in ("0", "1"):  # (only these: the native code's switches take no other spelling)
                return raw == "1"
            raise ValueError(f"{self.name}={raw!r} is not 0 or 1 ({unset})")
        if self.type == "choice":
            low = raw.lower()
            if low not in self.choices:
                raise ValueError(f"{self.name}={raw!r} (expected one of {', '.join(self.choices)}; {unset})")
            return low
        if self.type == "path":
            return os.path.expanduser(raw)
        return raw


_NATIVE, _BOTH = ("native",), ("native", "python")
_VARS = (
    # ---- for users ----
    Var("KTINJECT_THREADS", "int", None, "the default expert pool's thread count (read when that pool is first "
        "made; `set_default_threads` / `--threads` win)", minimum=1,
        shown_default="one per physical core, less one from 8 cores up"),
    Var("KTINJECT_ISA", "choice", None, "force an ISA for the native kernels, in any case (an unknown or "
        "unavailable one is an error, not a fallback; `native.set_isa` clears it)", read_by=_NATIVE,
        choices=("generic", "avx2", "avx512", "amx"), shown_default="the best available"),
    Var("KTINJECT_PIN", "bool", None, "pin (1) or unpin (0) every pool's threads, one to a core, whatever "
        "`Pool(pin=...)` asked (a pinned thread whose core another process takes cannot move)", read_by=_BOTH,
        shown_default="unpinned (`Pool(pin=False)`)"),
    Var("KTINJECT_WATCH_SPIN_US", "int", 1000, "microseconds a pool's threads keep spinning after a graph-driven "
        "(watched) run before they sleep (0: at once; read when a pool is made, clamped to 0..10000000; "
        "`Pool.watch_spin_us` changes it)", read_by=_NATIVE, minimum=0),
    Var("KTINJECT_INT4_GROUP", "choice", None, "int4's inputs per scale (read at each packing; a rule's or an "
        "explicit `group_size` beats it; part of the pack cache's key)", choices=("32", "64", "128"),
        shown_default="128 where both input sizes are multiples of 128, else 64"),
    Var("KTINJECT_CACHE", "path", None, "the packed-expert cache's directory (`off`, `0`, `false`, `no` or empty: "
        "no cache) and the demo model's cache root", shown_default="`<checkpoint>/.ktinject-cache` when the "
        "packing quantizes; the demo model under `~/.cache/ktinject`"),
    Var("KTINJECT_READAHEAD_MB", "int", 256, "the checkpoint loader's read-ahead window in MiB (peak host memory is "
        "the model's resident size plus this plus the pack workers' buffers)", minimum=1),
    Var("KTINJECT_PACK_THREADS", "int", 0, "threads packing experts while a checkpoint loads (0: one per physical "
        "core, at most 16)", minimum=0),
    Var("KTINJECT_API_KEY", "str", None, "the key `ktinject serve` requires (`Authorization: Bearer KEY`) when "
        "`--api-key` is not given", shown_default="no key"),
    Var("KTINJECT_EXPERT_PRODUCTS", "choice", "float", "the arithmetic of the expert LoRA path's products with the "
        "frozen expert weights (forward and backward): `float` (the stored values, float sums), `bf16` (rows and "
        "weights rounded to bf16, float sums: AMX tiles on the amx ISA; experts with fewer than 16 rows in a call "
        "stay float) or `auto` (bf16 where the ISA in use is amx, else float) (read at each forward)",
        choices=("float", "bf16", "auto")),
    Var("KTINJECT_CFLAGS", "str", "", "extra compiler flags for the native build, split on spaces (e.g. "
        "`-fsanitize=address`, or `-D` overrides of the kernels' constants for A/B builds)", read_by=("build",),
        shown_default="none"),
    # ---- for development: tests and measurements ----
    Var("KTINJECT_SPIN_US", "int", 50, "microseconds an idle pool thread spins before it sleeps on a futex (read "
        "when a pool is made, clamped to 0..1000000)", "developer", _NATIVE, minimum=0,
        why="the pool's idle spin for measurements on other hosts (benchmarks/probe_ahead_gap.py prints it); "
            "never measured against another default"),
    Var("KTINJECT_GEMV", "choice", "auto", "native: `1` runs few-row forwards on the gemv decode path wherever the "
        "kernels have one, `0` never (read at each forward; else the kernel table's default); GPU: `torch` uses "
        "cuBLAS for every one-row projection, `triton` the Triton GEMV's first config, unmeasured",
        "developer", _BOTH, choices=("auto", "0", "1", "torch", "triton"),
        why="tests run the gemv and item paths bit for bit against each other (tests/native/test_native.py, "
            "test_deferral_native.py, test_pool_profile.py) and the Triton GEMV without measuring "
            "(tests/decode/test_graph_gpu.py, test_decode_layer.py); benchmarks/probe_cpu_decode.py --gemv"),
    Var("KTINJECT_PIPE", "bool", True, "`0`: one-token decode forwards run the two-phase path instead of the "
        "one-phase pipeline (read at each forward; only exactly `0` or `1` counts)", "developer", _NATIVE,
        why="the two-phase path still runs wherever the pipeline does not apply; tests compare the pipeline "
            "with it bit for bit (tests/native/test_native.py, test_deferral_native.py)"),
    Var("KTINJECT_DEFER_PHASES", "choice", "cut", "how a split (deferring) task's two parts run on the decode "
        "pipeline: one phase, one phase cut at the parts' boundary, or a phase each (read and checked at each "
        "split forward)", "developer", _BOTH, choices=("one", "cut", "two"),
        why="cut is the default: the fastest layout in graph decode at long contexts (docs/performance.md); "
            "one and two stay because tests check that every layout gives the same bits and the error "
            "(tests/native/test_deferral_native.py, test_native.py) and `bench decode --defer-layouts` times them"),
    Var("KTINJECT_INT4_PATH", "choice", "auto", "force the int4 kernels' path: `direct` (int4 x int8) or "
        "`dequant` (bf16 copies; for many rows) (read and checked at each int4 forward)", "developer", _NATIVE,
        choices=("auto", "direct", "dequant"),
        why="tests run each path on one model (tests/native/test_int4.py, test_native.py, "
            "test_deferral_native.py); the crossover between them is measured with it"),
    Var("KTINJECT_FP8_PATH", "choice", "auto", "force the fp8 kernels' path: `direct` (e4m3 converted in "
        "registers) or `dequant` (bf16 of e4m3 x scale + the bf16 kernels; for many rows) (read at each fp8 "
        "forward; the native mxfp4 format's kernels obey it too)", "developer", _NATIVE,
        choices=("auto", "direct", "dequant"),
        why="tests run each path on one model (tests/native/test_fp8.py); the crossover between them is measured "
            "with it"),
    Var("KTINJECT_TILES", "int", None, "`0`: never hand the kernels x and h in AMX tile order; `N`: from N rows "
        "on, on any kernel table (read at each forward)", "developer", _NATIVE, minimum=0,
        shown_default="the kernel table's tile_rows",
        why="tests run the tile-order copies on CPUs without AMX (tests/native/test_native.py, "
            "test_deferral_native.py); benchmarks/probe_prefill.py --configs"),
    Var("KTINJECT_AVX512_PLAIN", "bool", False, "`1`: the AVX-512 table's plain F/BW kernels even where the CPU has "
        "BF16 / VNNI (read at each kernel-table lookup)", "developer", _NATIVE,
        why="native/tests/test_kernels.c checks the plain variants on CPUs that would never pick them"),
    Var("KTINJECT_TEST_DELAY", "str", None, "`TID:US`: pool thread TID sleeps US microseconds before claims and "
        "while holding chunks (read when a pool is made; only by a test build of the native code, -DKTK_TEST_BUILD: "
        "the installed library ignores it)", "developer", _NATIVE,
        why="test hook: native/tests/stress_pool.c delays one thread to exercise the pool's claiming"),
    Var("KTINJECT_FUSED", "bool", True, "`0`: the decode steps, the streamed prefill's dequantization and host "
        "copies as torch ops instead of the Triton kernels (read at each call; a captured graph keeps its "
        "capture's choice)", "developer",
        why="the torch ops are the kernels' reference and their fallback without Triton; tests compare the two "
            "(tests/gpu_experts/test_dequant_kernel.py)"),
    Var("KTINJECT_PDL", "bool", True, "`0`: the decode kernels launch without programmatic dependent launch (read "
        "at each launch)", "developer",
        why="tests/operators/test_fused_kernels.py checks the same results with and without it"),
    Var("KTINJECT_STREAM_SYNC", "choice", None, "how a CUDA stream hands a layer to the CPU experts: stream memory "
        "operations or host-function nodes (`memops` where unsupported is an error)", "developer",
        choices=("memops", "hostfn"), shown_default="memops where supported, else hostfn",
        why="hostfn is the fallback where memops are missing; tests/operators/test_deferral_gpu.py runs it on "
            "hosts that have memops"),
    Var("KTINJECT_PREFILL_OVERLAP", "bool", True, "`0`: a prompt's MoE layers wait for their CPU task instead of "
        "leaving it running while the host goes on (also turns gated layers off; read at each forward)",
        "developer",
        why="tests/gpu_experts/test_prefill_gpu.py checks that overlapped and waited forwards give the same bits"),
    Var("KTINJECT_PREFILL_GATED", "bool", True, "`0`: streamed prefill's ahead layers start their CPU task from "
        "the host instead of by the GPU's go word (read at each layer)", "developer",
        why="tests/gpu_experts/test_prefill_gpu.py checks gated against ungated ahead layers in one run; "
            "benchmarks/probe_ahead_gap.py --ab times them"),
    Var("KTINJECT_TEST_GPU", "str", "cpu", "the device the family tests' injected models put their dense part on "
        "(`cuda`)", "developer", ("tests",),
        why="tests/operators/test_families.py runs on the GPU with it (benchmarks/run_gpu_machine.sh "
            "families-cuda)"),
)
VARIABLES: dict[str, Var] = {v.name: v for v in _VARS}

#: variables that are gone: what was settled, where. ``python -m ktinject.envs`` names any still set.
RETIRED: dict[str, str] = {
    "KTINJECT_DEFER_SPLIT": "a deferring layer runs both parts as one native task wherever the sync mode is memops "
                            "(fewer CPU jobs a step than two chained tasks: docs/performance.md)",
    "KTINJECT_PREFILL_WATCH_SPIN_US": "the pool's watch spin window is 0 while gated layers run (faster prefill "
                                      "than graph decode's window: docs/performance.md)",
    "KTINJECT_DOWN_MINC": "the decode path's down phase claims chunks from one column block up (4 was slower, "
                          "in decode and in serving: docs/performance.md)",
    "KTINJECT_PIPE_GROUPS": "a split layer's down units take balanced expert groups (3 + 2)",
    "KTINJECT_CHUNK_YIELD_US": "no yield between a pool thread's chunks (it gained nothing beside busy processes)",
    "KTINJECT_FUSED_ROPE": "folded into KTINJECT_FUSED",
}


def _var(name: str) -> Var:
    var = VARIABLES.get(name)
    if var is None:
        gone = f" (retired: {RETIRED[name]})" if name in RETIRED else ""
        raise KeyError(f"{name} is not a registered KTINJECT_* variable{gone}; ktinject/envs.py lists them")
    return var


def raw(name: str) -> str | None:
    """The variable's text as set (None when unset), for callers with their own rules for it."""
    _var(name)
    return os.environ.get(name)


def is_set(name: str) -> bool:
    """Whether the variable is set to something other than spaces."""
    return bool((raw(name) or "").strip())


def get(name: str) -> Any:
    """The variable parsed as its type (int, float, str, bool, a path string, a lower-case choice), or its default
    when unset or empty; ValueError naming it and what to write when malformed."""
    var = _var(name)
    text = os.environ.get(name, "").strip()
    return var.default if not text else var.parse(text)


def env_int(name: str, default: int, minimum: int | None = None) -> int:
    """``int($name)`` with the caller's default and minimum (kept for callers not yet moved to ``get``); the name
    must be registered."""
    var = _var(name)
    text = os.environ.get(name, "").strip()
    return default if not text else Var(var.name, "int", default, var.meaning, minimum=minimum).parse(text)


@contextlib.contextmanager
def overridden(name: str, value: str | None) -> Iterator[None]:
    """Within the block the variable is ``value`` (None: unset), for readers that look at each call (the native
    code's); the value before is put back after."""
    _var(name)
    before = os.environ.get(name)
    try:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def unknown() -> dict[str, str]:
    """``KTINJECT_*`` names set in this environment that the table does not hold -> why they are ignored."""
    return {n: RETIRED.get(n, "not a ktinject variable (a typo?)") for n in sorted(os.environ)
            if n.startswith("KTINJECT_") and n not in VARIABLES}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """docs/internals/environment.md: a table per audience and the retired variables."""
    out = ["# Environment variables", "",
           "<!-- generated by `python -m ktinject.envs --markdown > docs/internals/environment.md`; "
           "edit ktinject/envs.py, not this page -->", "",
           "Every `KTINJECT_*` variable ktinject reads, from its registry (`ktinject/envs.py`). Python code reads "
           "them through `ktinject.envs.get`, so a malformed value is an error naming the variable; *read by* says "
           "whether the Python package, the native core (`getenv`, at the time each entry says), the build or the "
           "tests read it. `python -m ktinject.envs` prints the ones set in your shell and names any it ignores.",
           ""]
    for audience, title, extra in (("user", "For users", False),
                                   ("developer", "For development (tests and measurements)", True)):
        out += [f"## {title}", ""]
        head = "| variable | values | default | read by | meaning |" + (" why it exists |" if extra else "")
        out += [head, "|---" * (6 if extra else 5) + "|"]
        for v in _VARS:
            if v.audience != audience:
                continue
            row = [f"`{v.name}`", v.values_text(), v.default_text(), ", ".join(v.read_by), v.meaning]
            out.append("| " + " | ".join(map(_cell, row + ([v.why] if extra else []))) + " |")
        out.append("")
    out += ["## Retired", "", "Set, these do nothing: the question each kept open was settled.", "",
            "| variable | what was settled |", "|---|---|"]
    out += [f"| `{n}` | {_cell(why)} |" for n, why in RETIRED.items()]
    return "\n".join(out) + "\n"


def _report() -> str:
    lines = []
    for v in _VARS:
        text = os.environ.get(v.name)
        if text is not None:
            try:
                value = repr(get(v.name))
            except ValueError as e:
                value = f"ERROR: {e}"
            lines.append(f"{v.name}={text!r} -> {value}  ({v.audience}, read by {', '.join(v.read_by)})")
    lines += [f"{n}: ignored, {why}" for n, why in unknown().items()]
    return "\n".join(lines) or "no KTINJECT_* variable is set"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--markdown"]):
        print("usage: python -m ktinject.envs [--markdown]", file=sys.stderr)
        return 2
    print(markdown() if args else _report(), end="" if args else "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
