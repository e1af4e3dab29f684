"""A/B in one process: one-token int4 forwards of L Qwen3-30B-A3B-shaped layers driven from Python, cache-cold,
without deferral (d0) and split d=3 (5 + 3 slots, ktk_task_split), in turns: what a layer's split costs on the CPU
(issue 20). Prints the median us a layer of each (and the host's steal before and after). The run that chose the
down units' balanced groups (pipe.c) compared three groupings through a KTINJECT_PIPE_GROUPS switch, since removed.

    L=16 P=30 python tests/gpu/probe_split_groups.py
"""
import os, statistics, sys, time
import torch
from gpu_helpers import int4_layers, steal_line
from ktinject.native import Task
H, E, K = 2048, 128, 8
L = int(os.environ.get("L", 6)); PASSES = int(os.environ.get("P", 12))
gen = torch.Generator().manual_seed(0)
layers = int4_layers(L, gen, H=H, E=E)
x = torch.randn(1, H).to(torch.bfloat16)
w = torch.softmax(torch.randn(1, K), -1).sort(descending=True).values.float()
out = torch.zeros(1, H, dtype=torch.bfloat16); out2 = torch.zeros_like(out)
word = torch.zeros(16, dtype=torch.int32)
tasks = {}
VARIANTS = ["d0", "d3"]
for mode in ("d0", "d3"):
    ts = []
    for ex in layers:
        t = Task(); ids = torch.zeros(1, K, dtype=torch.int64)
        t.bind(ex, x, ids, w, out=out)
        if mode == "d3": t.split(3, out2, word.data_ptr())
        ts.append((t, ids))
    tasks[mode] = ts
print(steal_line(), flush=True)
times = {v: [] for v in VARIANTS}
for rnd in range(PASSES):
    for m in VARIANTS:
        for t, ids in tasks[m]:  # fresh experts each pass
            ids.copy_(torch.randperm(E, generator=gen)[:K].view(1, K))
        t0 = time.perf_counter()
        for t, ids in tasks[m]:
            t.submit(); t.wait()
        times[m].append((time.perf_counter() - t0) / L * 1e6)
print(steal_line())
for d, v in times.items():
    print(f"{d}: us a layer: median {statistics.median(v[2:]):.1f}, min {min(v):.1f}, "
          f"quartiles {statistics.quantiles(v[2:], n=4)[0]:.1f}-{statistics.quantiles(v[2:], n=4)[2]:.1f}")
