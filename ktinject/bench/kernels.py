"""Expert kernels: decode GB/s and prefill TFLOPS of one MoE layer, next to torch and the machine's limits.

``python -m ktinject.bench kernels [--threads N] [--quick | --full] [--isa NAME,...|all] [--quant bf16,int8]``

Layers (legend: T tokens, k experts per token, E experts, H hidden, I expert intermediate):
  Qwen3-30B-A3B  H 2048, I 768,  E 128, k 8
  DeepSeek-V3    H 7168, I 2048, E 256, k 8
Random bf16 weights, built in memory for E' <= E experts (a DeepSeek-V3 layer is 22.5 GB in bf16):
  decode   1 token routed to k of the E' experts; successive tokens rotate over E'/k disjoint expert sets, so the
           weights read per token (k x gate+up+down in the stored format) are never cache-resident.
           Figure: effective GB/s = stored bytes of the k experts / time of one forward.
  prefill  T' = 4096 * E'/E tokens with random top-k routing over E' experts: the same rows per expert (4096 k / E)
           as 4096 tokens over the real E. Figure: 2 * T' * k * 3 * H * I / time, in TFLOPS.
Baseline: the same work in torch on the CPU, the transformers "eager" experts loop (bf16 weights, F.linear per
expert). Limits: memory read bandwidth over a buffer far larger than the caches, all threads (the better of a native
read loop compiled with cffi and a torch int64 sum) for decode; a dense bf16 torch GEMM (oneDNN; AMX where the CPU
has it) for prefill, a practical reference rather than a bound. Times: time.perf_counter, warm-up, median.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ktinject.info import cpu_model


@dataclass(frozen=True)
class Layer:
    name: str
    hidden: int        # H
    intermediate: int  # I
    experts: int       # E
    top_k: int         # k
    built_full: int    # E' experts built by a full run
    built_quick: int   # E' experts built by a quick run


LAYERS = (Layer("Qwen3-30B-A3B", 2048, 768, 128, 8, built_full=128, built_quick=32),
          Layer("DeepSeek-V3", 7168, 2048, 256, 8, built_full=32, built_quick=16))
PREFILL_TOKENS = 4096


# ---- machine ----
def _mem_total_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


_READ_LOOP_C = r"""
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
/* Each thread reads its slice as STREAMS interleaved sequential streams with software prefetch (the access
 * pattern of the decode kernels: one stream per column block in flight); 64-bit xor, vectorized by -O3. */
#define STREAMS 4
#define PF_WORDS 128   /* prefetch 1 KB ahead per stream */
typedef struct { const uint64_t *p; size_t n; uint64_t r; } job;
static void *run(void *arg) {
    job *j = arg;
    const size_t per = j->n / STREAMS / 8 * 8;
    uint64_t s[STREAMS][8] = {{0}};
    for (size_t i = 0; i < per; i += 8)
        for (int q = 0; q < STREAMS; q++) {
            const uint64_t *p = j->p + q * per + i;
            __builtin_prefetch(p + PF_WORDS);
            for (int k = 0; k < 8; k++) s[q][k] ^= p[k];
        }
    uint64_t r = 0;
    for (int q = 0; q < STREAMS; q++)
        for (int k = 0; k < 8; k++) r ^= s[q][k];
    for (size_t i = per * STREAMS; i < j->n; i++) r ^= j->p[i];
    j->r = r;
    return NULL;
}
uint64_t ktb_read(const void *buf, size_t bytes, int threads) {
    pthread_t th[256];
    job jobs[256];
    size_t n = bytes / 8;
    uint64_t r = 0;
    if (threads < 1) threads = 1;
    if (threads > 256) threads = 256;
    for (int i = 0; i < threads; i++) {
        jobs[i].p = (const uint64_t *)buf + n * i / threads;
        jobs[i].n = n * (i + 1) / threads - n * i / threads;
        pthread_create(&th[i], NULL, run, &jobs[i]);
    }
    for (int i = 0; i < threads; i++) { pthread_join(th[i], NULL); r ^= jobs[i].r; }
    return r;
}
"""


def _native_read_loop():
    """cffi-compiled multi-threaded read loop (4 prefetched streams per thread, xor of 64-bit words, vectorized by
    -O3): (ffi, lib), or None without a compiler."""
    import importlib.util
    import tempfile

    try:
        from cffi import FFI
        ffi = FFI()
        ffi.cdef("uint64_t ktb_read(const void *buf, size_t bytes, int threads);")
        ffi.set_source("_ktb_read_loop", _READ_LOOP_C, extra_compile_args=["-O3", "-pthread"],
                       extra_link_args=["-pthread"])
        path = ffi.compile(tmpdir=tempfile.mkdtemp(prefix="ktb_"), verbose=False)
        spec = importlib.util.spec_from_file_location("_ktb_read_loop", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.ffi, mod.lib
    except Exception as e:  # no compiler / headers: fall back to torch alone
        print(f"(native read loop unavailable: {type(e).__name__}: {e}; using torch only)")
        return None


def memory_bandwidth(gb: float, repeats: int, threads: int) -> tuple[float, float | None]:
    """Read bandwidth in GB/s over a buffer of `gb` GB (written first, so its pages exist): (torch int64 sum,
    native read loop on `threads` threads or None). torch's reductions are compute-bound per thread on some CPUs,
    so the native loop is the honest limit where it can be built."""
    buf = torch.ones(int(gb * 1e9) // 8, dtype=torch.int64)
    nbytes = buf.numel() * 8
    torch_gbs = nbytes / _median_time(lambda: buf.sum(), repeats) / 1e9
    native_gbs = None
    loop = _native_read_loop()
    if loop is not None:
        ffi, lib = loop
        ptr = ffi.cast("void *", buf.data_ptr())
        native_gbs = nbytes / _median_time(lambda: lib.ktb_read(ptr, nbytes, threads), repeats) / 1e9
    return torch_gbs, native_gbs


def dense_gemm_tflops(n: int, repeats: int) -> float:
    """A dense bf16 torch matmul [n, n] x [n, n]: the practical compute limit (oneDNN; AMX where available)."""
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    t = _median_time(lambda: torch.matmul(a, b), repeats)
    return 2.0 * n ** 3 / t / 1e12


# ---- the torch baseline: transformers' eager experts loop ----
def torch_experts(hidden, ids, weights, gate_up, down):
    """hidden [T, H] bf16, ids [T, k], weights [T, k] f32, gate_up [E', 2I, H], down [E', H, I] -> [T, H]."""
    out = torch.zeros_like(hidden)
    mask = F.one_hot(ids, num_classes=gate_up.shape[0]).permute(2, 1, 0)  # [E', k, T]
    for e in (mask.sum(dim=(-1, -2)) > 0).nonzero().flatten().tolist():
        slot, tok = torch.where(mask[e])
        g, u = F.linear(hidden[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[e]) * weights[tok, slot, None].to(hidden.dtype)
        out.index_add_(0, tok, y)
    return out


# ---- workloads ----
@dataclass
class Work:
    decode_x: torch.Tensor       # [1, H] bf16
    decode_ids: list             # per expert set: [1, k] int64
    decode_w: torch.Tensor       # [1, k] f32
    prefill_x: torch.Tensor      # [T', H] bf16
    prefill_ids: torch.Tensor    # [T', k] int64
    prefill_w: torch.Tensor      # [T', k] f32
    decode_loops: int            # passes over the sets per timed call (>= ~50 ms of work)


def make_work(layer: Layer, built: int, seed: int = 0) -> Work:
    g = torch.Generator().manual_seed(seed)
    H, k = layer.hidden, layer.top_k
    sets = built // k
    t_pre = PREFILL_TOKENS * built // layer.experts
    ids_pre = torch.rand(t_pre, built, generator=g).topk(k, dim=-1).indices
    w_pre = torch.softmax(torch.randn(t_pre, k, generator=g), dim=-1)
    return Work(decode_x=torch.randn(1, H, generator=g).to(torch.bfloat16),
                decode_ids=[torch.arange(s * k, (s + 1) * k, dtype=torch.int64).view(1, k) for s in range(sets)],
                decode_w=torch.softmax(torch.randn(1, k, generator=g), dim=-1),
                prefill_x=torch.randn(t_pre, H, generator=g).to(torch.bfloat16), prefill_ids=ids_pre,
                prefill_w=w_pre, decode_loops=1)


def forward_overhead(native, pool, quant: str, repeats: int) -> float:
    """Seconds of a one-token forward of a tiny layer (E 8, H = I = 64, k 8): the fixed cost of a forward outside
    the weight streaming (pool wake-ups, phases, barriers), which bounds decode for small layers."""
    g = torch.Generator().manual_seed(2)
    ex = native.Experts.from_hf(torch.randn(8, 128, 64, generator=g).to(torch.bfloat16),
                                torch.randn(8, 64, 64, generator=g).to(torch.bfloat16), quant=quant)
    x = torch.randn(1, 64, generator=g).to(torch.bfloat16)
    ids, w = torch.arange(8).view(1, 8), torch.full((1, 8), 0.125)
    out = torch.empty(1, 64, dtype=torch.bfloat16)

    def run():
        for _ in range(200):
            ex.forward(x, ids, w, out=out, pool=pool)
    return _median_time(run, repeats) / 200


def time_decode(forward, work: Work, repeats: int) -> float:
    """Seconds per one-token forward; each timed call runs every expert set `decode_loops` times."""
    def run():
        for _ in range(work.decode_loops):
            for ids in work.decode_ids:
                forward(work.decode_x, ids, work.decode_w)
    calls = work.decode_loops * len(work.decode_ids)
    return _median_time(run, repeats) / calls


def time_prefill(forward, work: Work, repeats: int) -> float:
    return _median_time(lambda: forward(work.prefill_x, work.prefill_ids, work.prefill_w), repeats)


# ---- report ----
def _fmt_row(cols, widths) -> str:
    return "  ".join(str(c).ljust(w) for c, w in zip(cols, widths)).rstrip()


def _parse_list(text: str, allowed, what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad:
        raise SystemExit(f"--{what}: unknown {', '.join(bad)} (expected {', '.join(allowed)})")
    return items


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ktinject.bench kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="threads for ours and torch (default: physical cores)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="quick", action="store_true", default=None,
                      help="fewer experts built, smaller limit measurements (default when RAM < 64 GB or < 8 CPUs)")
    mode.add_argument("--full", dest="quick", action="store_false", help="full sizes (~6 GB of weights at most)")
    ap.add_argument("--isa", default=None, help="our ISA(s): a name, a comma list or 'all' (default: the current one)")
    ap.add_argument("--quant", default="bf16,int8", help="comma list of bf16, int8")
    ap.add_argument("--layers", default=",".join(l.name for l in LAYERS), help="comma list of layer names")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per figure (median; default 5, quick 3)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch baseline")
    args = ap.parse_args(argv)

    from ktinject import native

    quick = args.quick if args.quick is not None else (_mem_total_gb() < 64 or (os.cpu_count() or 1) < 8)
    repeats = args.repeats or (3 if quick else 5)
    threads = args.threads or native.physical_cores()
    quants = _parse_list(args.quant, ("bf16", "int8"), "quant")
    layers = [LAYERS[[l.name for l in LAYERS].index(n)] for n in
              _parse_list(args.layers, [l.name for l in LAYERS], "layers")]
    isa0 = native.isa()
    if args.isa in (None, ""):
        isas = [isa0]
    elif args.isa == "all":
        isas = [i for i in native.available_isas() if i != "generic"] or ["generic"]
    else:
        isas = _parse_list(args.isa, native.available_isas(), "isa")
    torch.set_num_threads(threads)

    print(f"ktinject kernels bench  CPU: {cpu_model()}  ({native.physical_cores()} physical cores, "
          f"{_mem_total_gb():.0f} GB RAM)")
    print(f"threads: {threads} (ours and torch)   ISA(s): {', '.join(isas)}   features: "
          f"{' '.join(native.cpu_features())}")
    print(f"mode: {'quick' if quick else 'full'}, median of {repeats}   torch {torch.__version__}")
    bw_gb = 1.0 if quick else 4.0
    bw_torch, bw_native = memory_bandwidth(bw_gb, max(repeats, 5), threads)
    bw = max(bw_torch, bw_native or 0.0)
    gemm_n = 2048 if quick else 4096
    peak = dense_gemm_tflops(gemm_n, repeats)
    native_txt = f"native read loop {bw_native:.1f} GB/s, " if bw_native else ""
    print(f"limits: memory read {bw:.1f} GB/s over {bw_gb:.0f} GB, {threads} threads ({native_txt}torch int64 sum "
          f"{bw_torch:.1f} GB/s); dense bf16 GEMM {peak:.2f} TFLOPS (torch matmul {gemm_n}^3)")

    pool = native.Pool(threads)
    try:
        over = {q: forward_overhead(native, pool, q, repeats) for q in quants}
    finally:
        pool.close()
    print("fixed cost of a forward (one token, tiny layer E 8, H = I = 64, k 8, current ISA): "
          + ", ".join(f"{q} {t * 1e6:.0f} us" for q, t in over.items()))

    rows = []
    notes = []
    for layer in layers:
        built = layer.built_quick if quick else layer.built_full
        H, I, k = layer.hidden, layer.intermediate, layer.top_k
        work = make_work(layer, built)
        t_pre = work.prefill_x.shape[0]
        flops = 2.0 * t_pre * k * 3 * H * I
        bf16_bytes = k * 3 * H * I * 2
        notes.append(f"{layer.name}: built {built} of {layer.experts} experts; decode rotates {len(work.decode_ids)} "
                     f"sets of {k} ({bf16_bytes * len(work.decode_ids) / 1e9:.2f} GB of bf16 weights); prefill "
                     f"{t_pre} tokens x top-{k} of {built} = {t_pre * k // built} rows per expert "
                     f"(as {PREFILL_TOKENS} tokens over {layer.experts})")
        g = torch.Generator().manual_seed(1)
        gate_up = (torch.randn(built, 2 * I, H, generator=g) * 0.02).to(torch.bfloat16)
        down = (torch.randn(built, H, I, generator=g) * 0.02).to(torch.bfloat16)
        # decode: enough loops over the sets for >= ~50 ms per timed call at the bandwidth limit
        work.decode_loops = max(1, int(0.05 * bw * 1e9 / (bf16_bytes * len(work.decode_ids))))

        ours = {}
        pool = native.Pool(threads)
        try:
            for quant in quants:
                ex = native.Experts.from_hf(gate_up, down, quant=quant)
                per_token = ex.nbytes / built * k
                out_d = torch.empty(1, H, dtype=torch.bfloat16)
                out_p = torch.empty(t_pre, H, dtype=torch.bfloat16)
                for isa in isas:
                    native.set_isa(isa)
                    td = time_decode(lambda x, i, w: ex.forward(x, i, w, out=out_d, pool=pool), work, repeats)
                    tp = time_prefill(lambda x, i, w: ex.forward(x, i, w, out=out_p, pool=pool), work, repeats)
                    ours[(quant, isa)] = (per_token / td / 1e9, td, flops / tp / 1e12, tp)
                ex = None  # free the packed weights before the next quant
                gc.collect()
        finally:
            native.set_isa(isa0)
            pool.close()

        tdec = tpre = None
        if not args.no_torch:
            time.sleep(0.2)
            with torch.inference_mode():
                tdec = time_decode(lambda x, i, w: torch_experts(x, i, w, gate_up, down), work, repeats)
                tpre = time_prefill(lambda x, i, w: torch_experts(x, i, w, gate_up, down), work, repeats)
        gate_up = down = None  # free before the next layer
        gc.collect()

        for (quant, isa), (gbs, td, tfl, tp) in ours.items():
            torch_d = f"{bf16_bytes / tdec / 1e9:.1f} GB/s {tdec * 1e3:.2f} ms" if tdec else "-"
            torch_p = f"{flops / tpre / 1e12:.2f} TFLOPS {tpre * 1e3:.0f} ms" if tpre else "-"
            rows.append((layer.name, "decode", quant, isa, f"{gbs:.1f} GB/s {td * 1e3:.2f} ms", torch_d,
                         f"{bw:.1f} GB/s", f"{100 * gbs / bw:.0f}%"))
            rows.append((layer.name, "prefill", quant, isa, f"{tfl:.2f} TFLOPS {tp * 1e3:.0f} ms", torch_p,
                         f"{peak:.2f} TFLOPS", f"{100 * tfl / peak:.0f}%"))

    head = ("layer", "phase", "quant", "isa", "ktinject", "torch (bf16, eager loop)", "limit", "of limit")
    rows.sort(key=lambda r: (r[0], r[1], r[2], r[3]))
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    print()
    print(_fmt_row(head, widths))
    print(_fmt_row(["-" * w for w in widths], widths))
    for r in rows:
        print(_fmt_row(r, widths))
    print()
    print("decode: GB/s = weights read per token in the stored format (k experts x gate+up+down, int8 incl. scales;")
    print("        torch: the same experts in bf16) / time of a one-token forward; limit = memory read bandwidth")
    print("prefill: TFLOPS = 2 T k 3 H I / time; limit = a dense bf16 GEMM in torch (oneDNN): a reference, not a bound")
    for n in notes:
        print(n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
