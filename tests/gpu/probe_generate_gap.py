"""Where ``ktinject.generate``'s decode step loses time against bare graph replays (not a test): the decode graph's
replays timed by CUDA events on the stream in three settings, in turns in one process:

- bare: replays back to back (the host launches them all, then waits: its thread sleeps);
- paced: the host as generate drives it, without HF: launch replay i, record an event, wait for replay i-1's event
  (blocking), then ``--busy`` ms of pure Python, then launch i + 1 (the host one step ahead, busy a while a step);
- generate: ``ktinject.generate`` (HF's loop, deferred stop check), the runner's replays wrapped with events.

Per setting: the median GPU time of a replay (event before -> event after: the graph, CPU experts included), the
median gap between replays (HF's own kernels between steps, or the GPU idle), and wall ms a token. A replay slower
under paced / generate than bare says the host thread's work competes with the expert threads for cores; a gap
says the stream waits between steps.

    python tests/gpu/probe_generate_gap.py [--quant int4] [--layers 48] [--tokens 64] [--rounds 3] [--busy 1.0]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpu_helpers import decode_setup, steal_jiffies
from ktinject.bench.timing import _decode_graph, gen_time, reset_lengths


class Timed:
    """Wraps a graph (or _Pieces): every replay between two recorded events."""

    def __init__(self, graph):
        self.graph, self.marks = graph, []

    def replay(self):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        self.graph.replay()
        b.record()
        self.marks.append((a, b))

    def summary(self) -> tuple[float, float]:
        torch.cuda.synchronize()
        runs = [a.elapsed_time(b) for a, b in self.marks]
        gaps = [self.marks[i][1].elapsed_time(self.marks[i + 1][0]) for i in range(len(self.marks) - 1)]
        self.marks = []
        return statistics.median(runs), statistics.median(gaps) if gaps else float("nan")


def bare(timed, runner, P, n):
    reset_lengths(runner, 1, P)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        timed.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def paced(entry, timed, runner, P, n, busy_s):
    reset_lengths(runner, 1, P)
    torch.cuda.synchronize()
    done = []
    t0 = time.perf_counter()
    for i in range(n):
        for pool in entry.pools:
            pool.wake()
        timed.replay()
        ev = torch.cuda.Event(blocking=True)
        ev.record()
        done.append(ev)
        if i:
            done[i - 1].synchronize()
        end = time.perf_counter() + busy_s
        x = 0
        while time.perf_counter() < end:  # HF's Python a step: the interpreter busy, no GPU work
            x += 1
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", type=float, default=1.0, help="ms of host Python a paced step")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    model, prompt, runner = decode_setup(a.quant, a.layers, a.threads)
    P = prompt.shape[1]
    entry = _decode_graph(runner, 1)
    timed = Timed(entry.graph)
    entry.graph = timed
    n = min(a.tokens, runner.max_cache_len - P - 2)
    from ktinject import native

    print(f"# {a.quant}, {a.layers} layers, {native.default_threads()} pool threads, {n} steps a run, "
          f"{torch.cuda.get_device_name()}", flush=True)
    rows: dict[str, list] = {"bare": [], "paced": [], "generate": []}
    for r in range(a.rounds):
        s0 = steal_jiffies()
        wall = bare(timed, runner, P, n)
        rows["bare"].append((wall, *timed.summary()))
        wall = paced(entry, timed, runner, P, n, a.busy / 1e3)
        rows["paced"].append((wall, *timed.summary()))
        t1 = gen_time(model, prompt, 1)
        timed.marks = []
        tn = gen_time(model, prompt, n + 1)
        rows["generate"].append(((tn - t1) / n, *timed.summary()))
        print(f"round {r}: steal +{steal_jiffies() - s0} jiffies; " + "; ".join(
            f"{k} {v[-1][0] * 1e3:.2f} ms/token (replay {v[-1][1]:.2f}, gap {v[-1][2]:.3f})" for k, v in rows.items()),
            flush=True)
    for k, v in rows.items():
        print(f"{k:9s} median: {statistics.median(x[0] for x in v) * 1e3:.2f} ms/token, replay "
              f"{statistics.median(x[1] for x in v):.2f} ms, gap {statistics.median(x[2] for x in v):.3f} ms")


if __name__ == "__main__":
    main()
