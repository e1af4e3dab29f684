"""Where the host time of a graph decode step through generate goes (a probe for the GPU machine, not a test).

    PYTHONPATH=/tmp/site:$PWD python3 tests/gpu/probe_decode.py [LAYERS]   (after run_gpu_machine.sh build)
"""
import statistics, sys, time, torch, ktinject
from ktinject.bench.decode import build_model, set_generation_defaults
from ktinject.generate import get_runner


def compare_pieces(m, ids, pieces=(1, 4, 1, 4), tokens=48) -> None:
    """Per-token decode time through generate, and bare replays, for each graph_pieces setting (same process)."""
    def gen(n):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        ktinject.generate(m, ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize(); return time.perf_counter() - t0
    for p in pieces:
        r = get_runner(m, use_graphs=True, prefill_chunk=2048, graph_pieces=p)
        gen(3)
        t1 = min(gen(1) for _ in range(2)); tn = gen(tokens + 1)
        entry = next(g for g in r.graphs.values() if g is not None)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(10):
            entry.graph.replay(); torch.cuda.synchronize()
        one = (time.perf_counter() - t0) / 10
        print(f"graph_pieces {p}: generate {(tn - t1) / tokens * 1e3:.2f} ms/token; replay+sync {one * 1e3:.2f} ms",
              flush=True)


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 48
    dev = torch.device("cuda")
    m = build_model(layers, dev); set_generation_defaults(m)
    ktinject.inject(m, gpu="cuda")
    ids = torch.randint(3, 1000, (1, 32), device=dev)
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    if "--pieces" in sys.argv:
        compare_pieces(m, ids)
        return
    r = get_runner(m, use_graphs=True, prefill_chunk=2048)
    ktinject.generate(m, ids, **kw)
    entry = next(g for g in r.graphs.values() if g is not None)
    # 1. CPU cost of launching the replay; 2. replay+sync one by one; 3. back-to-back
    def med(f, n=10):
        xs = []
        for _ in range(n):
            t0 = time.perf_counter(); f(); xs.append(time.perf_counter() - t0)
        return statistics.median(xs) * 1e3
    torch.cuda.synchronize()
    launch = []
    for _ in range(10):
        t0 = time.perf_counter(); entry.graph.replay(); launch.append(time.perf_counter() - t0); torch.cuda.synchronize()
    print(f"replay() call on the host: median {statistics.median(launch)*1e3:.2f} ms")
    print(f"replay + synchronize, one by one: {med(lambda: (entry.graph.replay(), torch.cuda.synchronize())):.2f} ms")
    def b2b():
        for _ in range(10): entry.graph.replay()
        torch.cuda.synchronize()
    print(f"back-to-back replays: {med(b2b, 3)/10:.2f} ms")
    # generate: time inside the runner call vs outside
    inside = [0.0]; calls = [0]
    orig = r.__class__.__call__
    def wrapped(self, **k):
        t0 = time.perf_counter(); out = orig(self, **k); inside[0] += time.perf_counter() - t0; calls[0] += 1; return out
    r.__class__.__call__ = wrapped
    N = 32
    torch.cuda.synchronize(); t0 = time.perf_counter()
    ktinject.generate(m, ids, max_new_tokens=N, min_new_tokens=N, do_sample=False)
    torch.cuda.synchronize(); tot = time.perf_counter() - t0
    print(f"generate {N} tokens: {tot/N*1e3:.2f} ms/token (incl. prefill); runner calls {calls[0]}, "
          f"host time inside them {inside[0]/calls[0]*1e3:.2f} ms/call")
    r.__class__.__call__ = orig
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ktinject.generate(m, ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))



if __name__ == "__main__":
    main()
