"""``benchmarks/soak_serve.py --mix`` on the CPU with the demo model: a short run passes and every kind of the mix
ran; the mix's checkers reject a broken stream (wrong Anthropic event order, a JSON reply that does not validate,
a missing choice of n = 4, a forced tool call that is not there)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from tests.serve.soak_mix_module import soak_mix  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_short_mixed_soak_passes_and_runs_every_kind():
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "soak_serve.py"), "--gpu", "cpu", "--mix",
           "--minutes", "0.2", "--streams", "4", "--disconnects", "3", "--prompt-max", "24", "--max-tokens", "32",
           "--sample-every", "2"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "# soak PASSED" in out, out[-4000:]
    per_kind = re.search(r"# per kind \(requests / errors\): (.*)", out)
    assert per_kind, out[-4000:]
    counts = {k: (int(n), int(e)) for k, n, e in re.findall(r"(\w+) (\d+) / (\d+)", per_kind.group(1))}
    want = soak_mix.kinds(soak_mix.grammar_ok())
    assert set(counts) == set(want), counts
    assert all(n >= 1 and e == 0 for n, e in counts.values()), counts
    if not soak_mix.grammar_ok():
        assert "llguidance or jsonschema is not installed" in out


def test_the_anthropic_event_order_is_checked():
    good = ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
            "content_block_stop", "content_block_start", "content_block_stop", "message_delta", "message_stop"]
    assert soak_mix._judge_events(good, "end_turn") is None
    assert soak_mix._judge_events(good, None) is not None
    for bad in (good[1:], good[:-1], good[:4] + good[5:], ["message_start", "content_block_delta"] + good[-2:],
                good[:2] + ["message_delta", "message_stop"]):
        assert soak_mix._judge_events(bad, "end_turn") is not None, bad


def test_the_openai_replies_are_judged():
    pytest.importorskip("jsonschema")
    judge = soak_mix._judge_openai
    assert judge("json", {}, {0: '{"name": "x", "age": 3, "tags": ["a"]}'}, {0: "stop"}, {}) is None
    assert judge("json", {}, {0: '{"name": "x", "age": 300, "tags": []}'}, {0: "stop"}, {}) is not None
    assert judge("json", {}, {0: '{"name": "x'}, {0: "stop"}, {}) is not None
    assert judge("json", {}, {0: '{"name": "x'}, {0: "length"}, {}) is None  # cut by max_tokens
    assert judge("n4", {}, {}, {i: "length" for i in range(4)}, {}) is None
    assert judge("n4", {}, {}, {i: "length" for i in range(3)}, {}) is not None
    assert judge("plain", {}, {0: ""}, {0: "error"}, {}) is not None
    required = {"tool_choice": "required"}
    call = {(0, 0): {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    assert judge("tools", required, {0: ""}, {0: "tool_calls"}, call) is None
    assert judge("tools", required, {0: "hi"}, {0: "stop"}, {}) is not None
    assert judge("tools", required, {0: ""}, {0: "tool_calls"},
                 {(0, 0): {"name": "add", "arguments": '{"a": 2}'}}) is not None
