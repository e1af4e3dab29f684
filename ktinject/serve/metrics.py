"""The engine's counters and their Prometheus text (``GET /metrics``): thread-safe, no dependency.

The engine thread records prefill chunks, decode steps, first tokens and finished requests; ``render()`` writes
the Prometheus text exposition format (version 0.0.4) for a scrape. Decode tok/s is over the last
``window`` seconds of decode steps (0 when none ran in it). With a prefix cache (``prefix_cache``, set by the
engine: a ``PrefixCache``), its counters too: prompt tokens restored, lookups, block hits per tier, blocks and bytes
per tier (read from the store's ``stats`` at the scrape).
"""
from __future__ import annotations

import threading
import time
from collections import deque

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FINISH_REASONS = ("stop", "length", "cancelled", "error")


class Metrics:
    def __init__(self, window: float = 10.0):
        self.window = window
        self._lock = threading.Lock()
        self.prompt_tokens = 0  # prefilled
        self.generated_tokens = 0  # every sampled token (first tokens included)
        self.decode_steps = 0
        self.decode_rows = 0  # rows of running requests over all decode steps (mean batch = rows / steps)
        self.decode_seconds = 0.0
        self.decode_forward_seconds = 0.0  # of decode_seconds, the forwards' (on the device); the rest: the engine
        self.prefill_seconds = 0.0
        self.prefill_forwards = 0  # a forward prefills chunks of one or several requests
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.rejected: dict[str, int] = {}
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self._steps: deque = deque()  # (end time, tokens) of recent decode steps
        self.prefix_cache = None  # the engine's PrefixCache, or None (no prefix cache metrics)

    # ---- recording (engine thread) -------------------------------------------------------------------------
    def prefill(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self.prompt_tokens += tokens
            self.prefill_seconds += seconds
            self.prefill_forwards += 1

    def decode_step(self, rows: int, seconds: float, forward: float = 0.0) -> None:
        """A decode step of ``rows`` requests took ``seconds`` of the loop, ``forward`` of them in the forward."""
        now = time.monotonic()
        with self._lock:
            self.decode_steps += 1
            self.decode_rows += rows
            self.decode_seconds += seconds
            self.decode_forward_seconds += forward
            self._steps.append((now, rows, seconds))
            self._trim(now)

    def token(self, n: int = 1) -> None:
        with self._lock:
            self.generated_tokens += n

    def first_token(self, seconds: float) -> None:
        with self._lock:
            i = next((i for i, b in enumerate(TTFT_BUCKETS) if seconds <= b), len(TTFT_BUCKETS))
            self.ttft_counts[i] += 1
            self.ttft_sum += seconds

    def finish(self, reason: str) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def _trim(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self.window:
            self._steps.popleft()

    # ---- reading -------------------------------------------------------------------------------------------
    def decode_rate(self) -> float:
        """Tokens per second of decode steps over the last ``window`` seconds (wall time from the first step's
        start to now, so idle time lowers it and an idle server reads 0)."""
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            if not self._steps:
                return 0.0
            t0 = self._steps[0][0] - self._steps[0][2]
            tokens = sum(rows for _, rows, _ in self._steps)
        return tokens / max(now - t0, 1e-9)

    def render(self, running: int, waiting: int, slots: int) -> str:
        rate = self.decode_rate()
        with self._lock:
            lines = []

            def metric(name, kind, help_, samples):
                lines.append(f"# HELP ktinject_{name} {help_}")
                lines.append(f"# TYPE ktinject_{name} {kind}")
                for labels, value in samples:
                    lines.append(f"ktinject_{name}{labels} {_num(value)}")

            metric("requests_running", "gauge", "Requests holding a KV-cache row (prefilling or decoding).",
                   [("", running)])
            metric("requests_waiting", "gauge", "Requests queued for a row.", [("", waiting)])
            metric("kv_slots", "gauge", "KV-cache rows (--max-batch).", [("", slots)])
            metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [("", self.prompt_tokens)])
            metric("generation_tokens_total", "counter", "Tokens generated.", [("", self.generated_tokens)])
            metric("decode_steps_total", "counter", "Batched decode steps.", [("", self.decode_steps)])
            metric("decode_rows_total", "counter", "Request rows over all decode steps (/ steps = mean batch).",
                   [("", self.decode_rows)])
            metric("decode_seconds_total", "counter", "Time in decode steps.", [("", self.decode_seconds)])
            metric("decode_forward_seconds_total", "counter",
                   "Time of the decode steps' forwards (the rest of decode_seconds is the engine's own).",
                   [("", self.decode_forward_seconds)])
            metric("prefill_seconds_total", "counter", "Time in prefill forwards.", [("", self.prefill_seconds)])
            metric("prefill_forwards_total", "counter", "Prefill forwards (each of one or several requests' chunks).",
                   [("", self.prefill_forwards)])
            metric("decode_tokens_per_second", "gauge",
                   f"Tokens per second of decode steps over the last {self.window:g} s.", [("", rate)])
            metric("requests_finished_total", "counter", "Finished requests by finish reason.",
                   [(f'{{finish_reason="{k}"}}', v) for k, v in self.finished.items()])
            metric("requests_rejected_total", "counter", "Requests refused before admission, by reason.",
                   [(f'{{reason="{k}"}}', v) for k, v in sorted(self.rejected.items())] or [('{reason="none"}', 0)])
            store = self.prefix_cache
            if store is not None:
                st, tiers = store.stats, store.tiers.all
                metric("prefix_cache_hit_tokens_total", "counter",
                       "Prompt tokens restored from the prefix cache instead of prefilled.", [("", st.hit_tokens)])
                metric("prefix_cache_lookup_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.",
                       [("", st.lookup_tokens)])
                metric("prefix_cache_lookups_total", "counter", "Prefix cache lookups.", [("", st.lookups)])
                metric("prefix_cache_inserted_blocks_total", "counter", "Blocks stored in the prefix cache.",
                       [("", st.inserted_blocks)])
                metric("prefix_cache_hits_total", "counter", "Prefix cache blocks restored, by the tier found in.",
                       [(f'{{tier="{t.name}"}}', st.hits.get(t.name, 0)) for t in tiers])
                metric("prefix_cache_blocks", "gauge", "Prefix cache blocks held, by tier.",
                       [(f'{{tier="{t.name}"}}', t.stats.blocks) for t in tiers])
                metric("prefix_cache_bytes", "gauge", "Prefix cache bytes held, by tier.",
                       [(f'{{tier="{t.name}"}}', t.stats.bytes) for t in tiers])
                metric("prefix_cache_budget_bytes", "gauge", "Prefix cache budget, by tier.",
                       [(f'{{tier="{t.name}"}}', t.budget) for t in tiers])
            name = "time_to_first_token_seconds"
            lines.append(f"# HELP ktinject_{name} Time from arrival to the first generated token.")
            lines.append(f"# TYPE ktinject_{name} histogram")
            total = 0
            for b, c in zip((*TTFT_BUCKETS, float("inf")), self.ttft_counts):
                total += c
                le = "+Inf" if b == float("inf") else _num(b)
                lines.append(f'ktinject_{name}_bucket{{le="{le}"}} {total}')
            lines.append(f"ktinject_{name}_sum {_num(self.ttft_sum)}")
            lines.append(f"ktinject_{name}_count {total}")
        return "\n".join(lines) + "\n"


def _num(v) -> str:
    if isinstance(v, int):
        return str(v)
    return repr(float(v))
