"""Issue 20: how soon a split layer's immediate part is done, the part the GPU waits for. CPU only (run it on the
GPU machine's host: its 15 pool threads and its memory are what the decode step sees). One-token int4 forwards of
L Qwen3-30B-A3B-shaped layers driven from Python, cache-cold (fresh experts each pass), in turns: no deferral
(d0), and each deferral setting in each layout of its two parts (KTINJECT_DEFER_PHASES=one / cut / two, read by
the native code at each forward: one phase; one phase whose chunks stop at the parts' boundary; a phase a part). Per variant, medians over the passes of the pool's profile: a layer's job (go seen
-> everything done) and its immediate part (-> the done word the GPU waits for, ``top_us``), and what a decode
step would take a layer with G_US of GPU work between a layer's done word and the next layer's go (the muted
replay a layer: ~105 us at a 16K context on the H200 host, ~40 at 32 tokens):
d0 job + G, a split max(top + G, job), and its speed-up over d0.

    L=16 P=20 G_US=105 DEFERS=3,0.3 python tests/gpu/probe_defer_top.py
"""
import os
import statistics

import torch

os.environ.update(KTINJECT_GEMV="1", KTINJECT_PIPE="1")  # the decode pipeline, whose layouts these are (where a
# kernel table has no gemv default, as on CPUs without AMX, the layouts would all run the two-phase path)

from gpu_helpers import int4_layers, steal_line
from ktinject.native import Task, default_pool

H, E, K = 2048, 128, 8
L, PASSES, G_US = int(os.environ.get("L", 6)), int(os.environ.get("P", 12)), float(os.environ.get("G_US", 105))
DEFERS = [float(d) if "." in d else int(d) for d in os.environ.get("DEFERS", "3,0.3").split(",")]

gen = torch.Generator().manual_seed(0)
layers = int4_layers(L, gen, H=H, E=E)
x = torch.randn(1, H).to(torch.bfloat16)
w = torch.softmax(torch.randn(1, K, generator=gen), -1)
word = torch.zeros(16, dtype=torch.int32)
variants = {"d0": (0, "one")}
for d in DEFERS:
    for layout in ("one", "cut", "two"):
        variants[f"d{d}/{layout}"] = (d, layout)
tasks = {}
for name, (d, _) in variants.items():
    ts = []
    for ex in layers:
        t, ids = Task(), torch.zeros(1, K, dtype=torch.int64)
        t.bind(ex, x, ids, w, out=torch.zeros(1, H, dtype=torch.bfloat16))
        if d:
            t.split(d, torch.zeros(1, H, dtype=torch.bfloat16), word.data_ptr())
        ts.append((t, ids))
    tasks[name] = ts
pool = default_pool()
print(f"{L} layers, {PASSES} passes, {pool.threads} threads, int4 groups of {layers[0].group_size}; {steal_line()}", flush=True)
got = {name: {"job": [], "top": []} for name in variants}
for rnd in range(PASSES):
    for name, (_, phases) in variants.items():
        os.environ["KTINJECT_DEFER_PHASES"] = phases
        for t, ids in tasks[name]:  # fresh experts each pass
            ids.copy_(torch.randperm(E, generator=gen)[:K].view(1, K))
        with pool.profiling() as prof:
            for t, _ in tasks[name]:
                t.submit()
                t.wait()
        if rnd >= 2:  # the first two passes warm up
            got[name]["job"].append(prof["job_us"])
            got[name]["top"].append(prof["top_us"] if prof["top_jobs"] else float("nan"))
print(steal_line())
base = statistics.median(got["d0"]["job"]) + G_US
for name, v in got.items():
    job, top = statistics.median(v["job"]), statistics.median(v["top"])
    step = base if name == "d0" else max(top + G_US, job)
    print(f"{name:>10}: a layer's job {job:6.1f} us (quartiles {statistics.quantiles(v['job'], n=4)[0]:.1f}-"
          f"{statistics.quantiles(v['job'], n=4)[2]:.1f}), immediate part done at "
          + ("   -  " if name == "d0" else f"{top:6.1f}") + f" us; a step a layer with G={G_US:g} us: {step:6.1f} us,"
          f" {base / step:.3f}x of d0")
# the layout whose predicted steps, summed over the deferral settings, are the shortest (resolve_stage.sh reads it)
steps = {lay: sum(max(statistics.median(got[f"d{d}/{lay}"]["top"]) + G_US, statistics.median(got[f"d{d}/{lay}"]["job"]))
                  for d in DEFERS) for lay in ("one", "cut", "two")}
print("best=" + min(steps, key=steps.get) + " (" + ", ".join(f"{k} {v / len(DEFERS):.1f} us" for k, v in steps.items())
      + " a layer, mean over the settings)")
