"""The routed experts' backward (ktk_backward) beside their forward: ms per call and GB/s of stored weights read.

Run by ``python -m ktinject.bench kernels --backward`` (its --threads, --quick / --full, --isa, --quant, --repeats).
Qwen3-30B-A3B expert shapes (H 2048, I 768, top-8; E' of its 128 experts built: 32 quick, 128 full), random bf16
weights stored in each quant; T tokens in (1, 16, 256), routed top-8 at random over the E' experts (T = 1: the
tokens of successive calls rotate over E'/8 disjoint expert sets, so the weights read are not cache-resident).
Per call: forward (bf16 x and out; on the first ISA asked for other than generic) and backward (float x and dy, dx
and the routing weights' gradient; on every ISA asked for) of the same tokens, timed in alternation (forward, then
the backward of every ISA, per repeat: the same stretch of time on a shared host), medians. GB/s = stored bytes of the experts the call routes to (weights incl. scales: what one pass reads) /
time; the backward reads them once per 32-row chunk of an expert and recomputes gate and up.
"""
from __future__ import annotations

import statistics
import time

import torch

H, I, K_TOP = 2048, 768, 8
TOKENS = (1, 16, 256)


def _cases(built: int, seed: int = 0):
    """{T: [(x bf16, x f32, dy f32, ids, weights)]}: one case per call of a rotation (T = 1: every expert set)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for T in TOKENS:
        calls = built // K_TOP if T == 1 else 1
        cases = []
        for s in range(calls):
            if T == 1:
                ids = torch.arange(s * K_TOP, (s + 1) * K_TOP, dtype=torch.int64).view(1, K_TOP)
            else:
                ids = torch.rand(T, built, generator=g).topk(K_TOP, dim=-1).indices
            x = torch.randn(T, H, generator=g)
            cases.append((x.bfloat16(), x, torch.randn(T, H, generator=g) * 0.01, ids,
                          torch.softmax(torch.randn(T, K_TOP, generator=g), dim=-1)))
        out[T] = cases
    return out


def measure(native, quants, isas, threads: int, built: int, repeats: int) -> list[tuple]:
    """Rows (quant, T, isa, forward s, backward s, forward GB/s, backward GB/s) per call."""
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(built, 2 * I, H, generator=g) * 0.02).to(torch.bfloat16)
    down = (torch.randn(built, H, I, generator=g) * 0.02).to(torch.bfloat16)
    cases = _cases(built)
    fwd_isa = next((i for i in isas if i != "generic"), isas[0])   # the forward of the fastest ISA asked for
    rows, isa0 = [], native.isa()
    pool = native.Pool(threads)
    try:
        for quant in quants:
            ex = native.Experts.from_hf(gate_up, down, quant=quant)
            per_expert = ex.nbytes / built
            for T, cs in cases.items():
                outs = [torch.empty(T, H, dtype=torch.bfloat16) for _ in cs]
                nbytes = statistics.mean(len(ids.unique()) for *_, ids, _ in cs) * per_expert

                def fwd():
                    for (xb, _, _, ids, w), o in zip(cs, outs):
                        ex.forward(xb, ids, w, out=o, pool=pool)

                def bwd():
                    for _, x, dy, ids, w in cs:
                        ex.backward(x, ids, w, dy, pool=pool)

                times = {"fwd": []} | {i: [] for i in isas}
                for r in range(repeats + 1):   # the first round warms up
                    for isa, fn in [(fwd_isa, fwd)] + [(i, bwd) for i in isas]:
                        native.set_isa(isa)
                        t0 = time.perf_counter()
                        fn()
                        if r:
                            times["fwd" if fn is fwd else isa].append((time.perf_counter() - t0) / len(cs))
                tf = statistics.median(times["fwd"])
                for isa in isas:
                    tb = statistics.median(times[isa])
                    rows.append((quant, T, isa, tf, tb, nbytes / tf / 1e9, nbytes / tb / 1e9))
            ex = None
    finally:
        native.set_isa(isa0)
        pool.close()
    return rows


def report(rows, threads: int, built: int, repeats: int, fwd_isa: str) -> list[str]:
    head = ("quant", "T", "backward isa", f"forward ({fwd_isa})", "backward", "backward / forward")
    body = [(q, str(T), isa, f"{tf * 1e3:.2f} ms {gf:.1f} GB/s", f"{tb * 1e3:.2f} ms {gb:.1f} GB/s", f"{tb / tf:.1f}x")
            for q, T, isa, tf, tb, gf, gb in rows]
    widths = [max(len(r[c]) for r in body + [head]) for c in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return ([f"backward (Qwen3-30B-A3B experts: H {H}, I {I}, top-{K_TOP} of {built} built; {threads} threads; "
             f"median of {repeats}, forward and backward alternating): ms per call, GB/s of stored weights routed to",
             fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in body])
