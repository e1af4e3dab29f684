"""llama.cpp's ``llama-bench`` as the peer, timed in the same run as ktinject (``--peer PATH``).

The decode and prefill benches compare with llama.cpp, its routed experts on the CPU (``-ot exps=CPU``), on the
same machine and in the same call: a shared host's CPU speed moves between calls (docs/performance.md), so figures
from another day say little. ``bench decode`` and ``bench prefill`` take

    --peer PATH          a llama-bench binary (built by the user: benchmarks/README.md says how; nothing is
                         downloaded or built here)
    --peer-model GGUF    one or more comma-separated GGUF files of the same model (e.g. Q4_0 and Q8_0)
    --peer-threads N     llama-bench's -t (default: the physical cores this process may use, as llama.cpp's own
                         default)
    --peer-reps N        llama-bench's -r (default 3)
    --peer-args "..."    more llama-bench options, as one string (e.g. "-ub 2048")

and run, per GGUF, ``PATH -m GGUF -ngl 99 -ot exps=CPU -fa 1 -t N -r R -p P... -n G -o json``, reading its JSON
(one object per test: ``n_prompt``, ``n_gen``, ``avg_ts``, ``samples_ts``, ``model_type``). A failure (no binary, a
GGUF that does not load, output that is not llama-bench's) is a ``PeerError`` whose message says what to fix; the
benches print it as a row and keep their own figures.

Which GGUF a ktinject format compares with: int4 (W4A8, 4.25 bits a weight in groups of 128, 4.5 in groups of 64)
with Q4_0 (4.5 bits, the nearest llama.cpp format: at groups of 128 ours reads 5.6% fewer bytes), int8 with Q8_0,
bf16 with BF16 / F16 (``PAIRS``); with ``--checkpoint GGUF`` and that same file as ``--peer-model``, with that file,
whatever its type (``same_file``). Legend: P prompt tokens, G generated tokens.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
from dataclasses import dataclass

#: ktinject's expert format -> the GGUF types it is compared with (first found wins)
PAIRS = {"int4": ("Q4_0",), "int8": ("Q8_0",), "bf16": ("BF16", "F16")}
TIMEOUT_S = 1800  # one llama-bench run (all its tests); a hung peer must not hang the bench


class PeerError(RuntimeError):
    """llama-bench could not be run or its output not read; the message says what to fix."""


@dataclass(frozen=True)
class PeerResult:
    """One llama-bench test: ``n_prompt`` tokens of prefill or ``n_gen`` of decode, ``tok_s`` the mean of its
    repetitions ``samples`` (tokens a second each)."""

    model: str  # the GGUF's file name
    model_type: str  # llama-bench's description, e.g. "qwen3moe 30B.A3B Q4_0"
    n_prompt: int
    n_gen: int
    tok_s: float
    samples: tuple[float, ...]

    @property
    def gguf_type(self) -> str | None:
        """The weights' type named in model_type (Q4_0, Q8_0, BF16, ...), or None."""
        return gguf_type(self.model_type)

    @property
    def label(self) -> str:
        return f"llama.cpp {self.gguf_type or self.model_type} -ot exps=CPU"

    def runs(self) -> str:
        return ", ".join(f"{s:,.1f}" for s in self.samples)


def gguf_type(model_type: str) -> str | None:
    """"qwen3moe 30B.A3B Q4_0" -> "Q4_0"; None when no weight type is named."""
    m = re.search(r"\b(BF16|F16|F32|Q\d_[0-9A-Z_]+|IQ\d_[0-9A-Z_]+|MXFP4(?:_MOE)?)\b", model_type or "")
    return m.group(1) if m else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("peer (llama.cpp's llama-bench, timed in the same run)")
    g.add_argument("--peer", metavar="PATH", default=None, help="a llama-bench binary: llama.cpp with its experts on "
                   "the CPU (-ot exps=CPU) is timed after ktinject, in this run")
    g.add_argument("--peer-model", metavar="GGUF", default=None,
                   help="comma-separated GGUF files for --peer (e.g. a Q4_0 and a Q8_0 of the same model)")
    g.add_argument("--peer-threads", type=int, default=None, help="llama-bench -t (default: the physical cores this "
                   "process may use)")
    g.add_argument("--peer-reps", type=int, default=3, help="llama-bench -r: repetitions of each test")
    g.add_argument("--peer-args", default="", help="more llama-bench options, one string (e.g. \"-ub 2048\")")


def check_arguments(args) -> None:
    """SystemExit naming the option where the peer options do not fit together (before any model is built)."""
    if args.peer is None:
        if args.peer_model:
            raise SystemExit("--peer-model needs --peer PATH (the llama-bench binary that runs it)")
        return
    if not args.peer_model:
        raise SystemExit("--peer needs --peer-model GGUF[,GGUF]: the model file(s) llama-bench times")
    try:
        find_binary(args.peer)
        models(args.peer_model)
        shlex.split(args.peer_args)
    except (PeerError, ValueError) as e:
        raise SystemExit(str(e)) from None
    if args.peer_reps < 1:
        raise SystemExit(f"--peer-reps {args.peer_reps}: expected 1 or more")
    if args.peer_threads is not None and args.peer_threads < 1:
        raise SystemExit(f"--peer-threads {args.peer_threads}: expected 1 or more")


def find_binary(path: str) -> str:
    """``path`` if it is an executable file, else PeerError saying what is wrong with it."""
    if not os.path.exists(path):
        raise PeerError(f"--peer {path}: no such file (build llama-bench first: benchmarks/README.md says how)")
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise PeerError(f"--peer {path}: not an executable file (expected the llama-bench binary)")
    return path


def models(text: str) -> list[str]:
    """The GGUF paths of ``--peer-model`` (comma-separated), each an existing file, else PeerError."""
    paths = [p.strip() for p in (text or "").split(",") if p.strip()]
    if not paths:
        raise PeerError("--peer-model: give at least one GGUF file")
    for p in paths:
        if not os.path.isfile(p):
            raise PeerError(f"--peer-model {p}: no such file")
    return paths


def same_file(args) -> bool:
    """Whether every --peer-model is the file ktinject itself loaded (``--checkpoint``): then both run one model,
    its layers and its types, and they are compared whatever its GGUF type, without scaling by layers."""
    mine = getattr(args, "checkpoint", None)
    if not mine or not getattr(args, "peer_model", None):
        return False
    try:
        paths = models(args.peer_model)
    except PeerError:
        return False
    return all(os.path.realpath(p) == os.path.realpath(mine) for p in paths)


def default_threads() -> int:
    """llama-bench's -t when --peer-threads is not given: the physical cores this process may run on (llama.cpp's
    own default is its physical cores; a cpuset or an affinity mask can allow fewer)."""
    from ktinject import native

    return max(1, min(native.physical_cores(), native.usable_cpus()))


def threads_of(args) -> int:
    return args.peer_threads or default_threads()


def command(binary: str, model: str, prompts=(), gen: int = 0, threads: int | None = None, reps: int = 3,
            extra: str = "") -> list[str]:
    """llama-bench's command line: experts on the CPU, everything else on GPU 0, flash attention, JSON out."""
    cmd = [binary, "-m", model, "-ngl", "99", "-ot", "exps=CPU", "-fa", "1", "-t", str(threads or default_threads()),
           "-r", str(reps), "-p", ",".join(str(int(p)) for p in prompts) if prompts else "0", "-n", str(int(gen)),
           "-o", "json"]
    return cmd + shlex.split(extra)


def _json_list(text: str):
    """The first JSON list in ``text`` that starts a line (llama-bench may print log lines first, and they may hold
    brackets); PeerError where there is none."""
    decoder, err = json.JSONDecoder(), None
    for m in re.finditer(r"^[ \t]*\[", text, flags=re.M):
        try:
            data, _ = decoder.raw_decode(text, m.end() - 1)
        except json.JSONDecodeError as e:
            err = err or e
            continue
        if isinstance(data, list):
            return data
    why = f" ({err.msg} at character {err.pos})" if err is not None else " (no list of tests in it)"
    raise PeerError(f"llama-bench output is not JSON{why}: was it run with -o json?")


def parse(text: str, model: str = "") -> list[PeerResult]:
    """llama-bench's ``-o json`` output -> PeerResults (PeerError naming what is missing where it is not that)."""
    data = _json_list(text)
    if not data:
        raise PeerError("llama-bench output: an empty list of tests (no -p / -n test ran)")
    out = []
    for i, t in enumerate(data):
        if not isinstance(t, dict):
            raise PeerError(f"llama-bench output: test {i} is not an object")
        try:
            n_prompt, n_gen, avg = int(t["n_prompt"]), int(t["n_gen"]), float(t["avg_ts"])
            samples = tuple(float(s) for s in t.get("samples_ts") or (avg,))
        except KeyError as e:
            raise PeerError(f"llama-bench output: test {i} has no field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise PeerError(f"llama-bench output: test {i} has a field that is not a number ({e})") from None
        if not math.isfinite(avg) or avg <= 0:
            raise PeerError(f"llama-bench output: test {i} has avg_ts {avg}: expected a positive rate")
        name = os.path.basename(str(t.get("model_filename") or model))
        out.append(PeerResult(name, str(t.get("model_type", "")), n_prompt, n_gen, avg, samples))
    return out


def run(binary: str, model: str, prompts=(), gen: int = 0, threads: int | None = None, reps: int = 3,
        extra: str = "", timeout: float = TIMEOUT_S) -> list[PeerResult]:
    """Run llama-bench on ``model`` for prefill tests of ``prompts`` tokens and / or a decode test of ``gen``."""
    cmd = command(find_binary(binary), model, prompts, gen, threads, reps, extra)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise PeerError(f"llama-bench did not finish within {timeout:.0f} s: {shlex.join(cmd)}") from None
    except OSError as e:
        raise PeerError(f"llama-bench could not start ({e}): {shlex.join(cmd)}") from None
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout or "").strip().splitlines()[-6:])
        raise PeerError(f"llama-bench exited with status {done.returncode}: {shlex.join(cmd)}\n{tail}")
    return parse(done.stdout, model)


def run_all(args, prompts=(), gen: int = 0) -> tuple[list[PeerResult], list[str]]:
    """Every ``--peer-model`` through llama-bench with the bench's peer options: (results, errors: one line per
    GGUF that failed)."""
    results, errors = [], []
    try:
        paths = models(args.peer_model)
    except PeerError as e:  # checked before the run; a file may have gone since
        return [], [str(e)]
    for m in paths:
        try:
            results += run(args.peer, m, prompts, gen, threads_of(args), args.peer_reps, args.peer_args)
        except PeerError as e:
            errors.append(f"{os.path.basename(m)}: {e}")
    return results, errors


def note(r: PeerResult, args) -> str:
    """A peer row's note: its runs, the GGUF and how llama-bench ran."""
    return f"runs {r.runs()} tok/s; {r.model} ({r.model_type}), llama-bench -t {threads_of(args)} -r {args.peer_reps}"


def missing(quant: str, results: list[PeerResult]) -> str | None:
    """Where ``quant`` has no paired GGUF among ``results`` (but some GGUF ran): a line saying so, else None."""
    if not results or paired(quant, results):
        return None
    got = sorted({r.gguf_type or r.model_type for r in results})
    return (f"no {' / '.join(PAIRS.get(quant, ('?',)))} GGUF among --peer-model to compare {quant} with (got "
            f"{', '.join(got)})")


def paired(quant: str, results: list[PeerResult]) -> list[PeerResult]:
    """The results of the GGUF type ``quant`` is compared with (``PAIRS``; the first type present; of several GGUFs
    of that type, the first given comes first, and the rows name its file)."""
    for t in PAIRS.get(quant, ()):
        got = [r for r in results if r.gguf_type == t]
        if got:
            return got
    return []
