"""Shared by the GPU test files and probes: the reference/injected model pair and the greedy-margin check against
it; the probes' decode set-up (bench model, prompt, runner) and the host's steal time."""
from __future__ import annotations

import torch

import ktinject
from ktinject.testing import build_tiny_model


def pair(family: str, dtype: torch.dtype):
    """(reference on CUDA with its expert weights rounded to bf16 as native stores them, injected model on CUDA)."""
    ref = build_tiny_model(family, dtype=dtype).cuda()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if ".experts." in name:
                p.copy_(p.to(torch.bfloat16).to(dtype))
    inj = build_tiny_model(family, dtype=dtype)
    ktinject.inject(inj, gpu="cuda")
    return ref, inj


def greedy_margins(ref, seq: torch.Tensor, mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[B, N]: how far (in the reference's logits, teacher-forced) each generated token of seq is below the
    reference's argmax at its step; 0 where it is the argmax. mask: the prompt's attention mask [B, prompt_len]."""
    full = torch.cat([mask, torch.ones_like(seq[:, prompt_len:])], dim=1)
    with torch.no_grad():
        logits = ref(seq, attention_mask=full).logits.float()  # [B, S, V]
    pred = logits[:, prompt_len - 1:-1]  # [B, N, V] predicting seq[:, prompt_len:]
    chosen = pred.gather(-1, seq[:, prompt_len:, None]).squeeze(-1)
    return pred.max(-1).values - chosen


def steal_jiffies() -> int:
    """The host's steal time so far (/proc/stat, jiffies): probes print its growth beside CPU timings."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def steal_line() -> str:
    """The host's steal time and all its CPU time so far, as probes print them: "steal S of T jiffies"."""
    with open("/proc/stat") as f:
        v = f.readline().split()
    return f"steal {v[8]} of {sum(int(x) for x in v[1:9])} jiffies"


def int4_layers(n: int, gen: torch.Generator, H: int = 2048, I: int = 768, E: int = 128):
    """n layers of int4 experts of Qwen3-30B-A3B shapes (the CPU probes' layers), the same random weights (drawn
    from ``gen``) packed once and loaded into each layer's own memory, so that passes over the layers are
    cache-cold."""
    from ktinject.native import Experts

    gu = (torch.randn(E, 2 * I, H, generator=gen) * 0.02).to(torch.bfloat16)
    dn = (torch.randn(E, H, I, generator=gen) * 0.02).to(torch.bfloat16)
    first = Experts.from_hf(gu, dn, quant="int4")
    packed = first.export()
    layers = [first]
    for _ in range(n - 1):
        ex = Experts(E, H, I, quant="int4", group_size=first.group_size)
        ex.load_packed(packed)
        layers.append(ex)
    return layers


def decode_setup(quant: str, layers: int, threads: int | None = None, prompt_len: int = 32):
    """The probes' decode set-up: the bench model (Qwen3-30B-A3B shapes, ``layers`` layers) injected with
    ``quant``, a random prompt, its graph runner, and one generate run (captures the decode graph).
    Returns (model, prompt, runner)."""
    from ktinject.bench.model import bench_model
    from ktinject.bench.timing import gen_time
    from ktinject.generate import get_runner

    model, device = bench_model(False, layers, threads)
    ktinject.inject(model, gpu=str(device), quant=quant)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=device)
    runner = get_runner(model, prefill_chunk=2048)
    gen_time(model, prompt, 3)
    return model, prompt, runner


def capture_and_time(model, runner, prompt, tokens: int, muted_runs: int = 1) -> tuple[float, float, float, int]:
    """One variant of a decode-graph A/B (probe_qkv_choice.py, probe_variants.py): the graphs captured anew with the
    variant's setting, then (bare replay, muted replay (median of ``muted_runs``), generate) seconds a token and the
    host's steal jiffies over them."""
    import statistics

    from ktinject.bench.timing import gen_time, graph_replay, muted_replay
    from ktinject.generate import invalidate_graphs

    P = prompt.shape[1]
    invalidate_graphs(model)
    gen_time(model, prompt, 3)  # captures with this setting
    s0 = steal_jiffies()
    bare = graph_replay(runner, 1, P, tokens)
    mutes = [muted_replay(model, runner, 1, P, tokens) for _ in range(muted_runs)]
    if bare is None or None in mutes:
        raise RuntimeError("no decode graph to replay (its capture failed?)")
    t1 = gen_time(model, prompt, 1)
    gen = (gen_time(model, prompt, tokens + 1) - t1) / tokens
    return bare, statistics.median(mutes), gen, steal_jiffies() - s0


def print_medians(res: dict, label: str = "") -> None:
    """Per variant of ``res`` (name -> [(bare, muted, generate) seconds]), the medians over its rounds."""
    import statistics

    for name, rows in res.items():
        med = [statistics.median(x[i] for x in rows) * 1e3 for i in range(3)]
        print(f"{label}{name:12s} median: muted {med[1]:.3f} ms (all {' '.join(f'{x[1] * 1e3:.3f}' for x in rows)}), "
              f"bare {med[0]:.3f} ms, generate {med[2]:.3f} ms ({1e3 / med[2]:.1f} tok/s)")
