"""The error of quantizing a quantized checkpoint's experts again, measured while they load.

Where a checkpoint's stored values are not exactly a native expert format (FP8 into int8, MXFP4 into int8, an int4
release asked for as int8), the loader decodes them to float32 and the native experts quantize those. This measures
what that costs against the decoded values themselves (the checkpoint's own dequantization, the reference a user
compares with): every SAMPLE_EVERY-th expert's matrices are read back from the native experts. Reported once per
load (a warning naming the formats and the relative error) and kept in ``model._ktinject_load_stats["experts"]``.
"""
from __future__ import annotations

import math
import threading

import torch

#: experts 0, SAMPLE_EVERY, 2 * SAMPLE_EVERY ... of each block are read back (a read-back costs about a pack)
SAMPLE_EVERY = 8


class RequantError:
    """Sums of squared errors and values per (source format, native format), thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._sums: dict[tuple[str, str], list[float]] = {}  # -> [err^2, ref^2, max |err| / rms(ref), matrices]

    def sample(self, block: str, source: str, quant: str, experts, expert: int, which: str,
               values: torch.Tensor) -> None:
        """Compare matrix ``which`` of ``expert`` as stored with the float ``values`` it was packed from."""
        if expert % SAMPLE_EVERY:
            return
        ref = values.float()
        err = experts.get(expert, which) - ref
        e2, r2 = float(err.double().square().sum()), float(ref.double().square().sum())
        rms = math.sqrt(r2 / max(ref.numel(), 1))
        worst = float(err.abs().max()) / rms if rms > 0 else 0.0
        with self._lock:
            s = self._sums.setdefault((source, quant), [0.0, 0.0, 0.0, 0])
            s[0] += e2
            s[1] += r2
            s[2] = max(s[2], worst)
            s[3] += 1

    def report(self) -> list[dict]:
        """One entry per (source, native format): relative RMS error, worst element error over the matrix RMS."""
        with self._lock:
            return [{"from": src, "to": quant, "rel_rms_error": math.sqrt(e2 / r2) if r2 > 0 else 0.0,
                     "max_error_over_rms": worst, "matrices_sampled": n}
                    for (src, quant), (e2, r2, worst, n) in sorted(self._sums.items())]

    def describe(self) -> str:
        """A line for the log, or '' when nothing was requantized."""
        parts = [f"{r['from']} -> {r['to']}: relative RMS error {r['rel_rms_error']:.2e}, worst element "
                 f"{r['max_error_over_rms']:.2f} x the matrix RMS ({r['matrices_sampled']} matrices sampled)"
                 for r in self.report()]
        if not parts:
            return ""
        return ("routed experts were quantized again from the checkpoint's format (pass quant= to choose the "
                "native format): " + "; ".join(parts))
