"""``python -m ktinject.serve`` as a user starts it (a subprocess on a free port, the demo model, the CPU), its
argument errors, the docs' Serving page (docs/serving.md) against the parser, and ``python -m ktinject.bench serve
--tiny``."""
from __future__ import annotations

import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

REPO = Path(__file__).resolve().parents[2]
SERVING_DOC = REPO / "docs" / "serving.md"  # the Serving guide (was the README's Serving section)


def _read_until(proc, pattern: str, timeout: float) -> re.Match:
    """Read the process's stdout (in a thread: a blocking readline never hangs the test) until ``pattern`` shows."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    text, end = "", time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        try:
            text += lines.get(timeout=0.2)
        except queue.Empty:
            continue
        m = re.search(pattern, text)
        if m:
            return m
    proc.kill()
    raise AssertionError(f"no {pattern!r} in the server's output:\n{text}\n{proc.stderr.read()}")


def test_server_starts_answers_and_stops_on_ctrl_c(demo_env):
    env = dict(demo_env, KTINJECT_API_KEY="sekret")
    proc = subprocess.Popen([sys.executable, "-m", "ktinject.serve", "--gpu", "cpu", "--port", "0", "--max-batch", "2",
                             "--max-context", "256"], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        m = _read_until(proc, r"Serving 'ktinject-demo' at (http://127\.0\.0\.1:\d+)/v1 \(OpenAI API; API key required",
                        timeout=240)
        url = m.group(1)
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        auth = {"Authorization": "Bearer sekret"}
        r = httpx.post(f"{url}/v1/chat/completions", headers=auth, timeout=60,
                       json={"model": "ktinject-demo", "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_ends_running_requests_with_an_answer(demo_env):
    """Stopped while a stream and a plain request run: the stream gets an error event and [DONE], the plain request
    a 503 in OpenAI's error shape (not uvicorn's 500 or a cut-off stream after its graceful wait), the process exits
    0 at once, without tracebacks."""
    proc = subprocess.Popen([sys.executable, "-m", "ktinject.serve", "--gpu", "cpu", "--port", "0", "--max-batch", "2",
                             "--max-context", "2048"], env=demo_env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        url = _read_until(proc, r"Serving 'ktinject-demo' at (http://127\.0\.0\.1:\d+)/v1", timeout=240).group(1)
        body = {"model": "ktinject-demo", "prompt": "hi", "max_tokens": 2000, "ignore_eos": True}
        plain: dict = {}
        waiter = threading.Thread(target=lambda: plain.update(r=httpx.post(f"{url}/v1/completions", json=body,
                                                                               timeout=60)))
        waiter.start()
        lines = []
        with httpx.stream("POST", f"{url}/v1/completions", json=dict(body, stream=True), timeout=60) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 6:  # tokens are coming: stop the server
                    t0 = time.monotonic()
                    proc.send_signal(signal.SIGTERM)
        waiter.join(60)
        assert proc.wait(30) == 0 and time.monotonic() - t0 < 10
        events = [x for x in lines if x.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and '"code":"cancelled"' in events[-2].replace(" ", ""), events[-3:]
        assert plain["r"].status_code == 503 and plain["r"].json()["error"]["code"] == "cancelled", plain["r"].text
        assert "the engine stopped" in plain["r"].json()["error"]["message"]
        err = proc.stderr.read()
        assert "Traceback" not in err and "Exception in ASGI" not in err, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_port_in_use_fails_before_loading(demo_env):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "ktinject.serve", "--gpu", "cpu", "--port", str(port)],
                           env=demo_env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
    assert "Loaded" not in r.stdout and time.monotonic() - t0 < 60


def test_model_errors_are_one_line_as_in_the_chat(demo_env, tmp_path):
    """The options shared with the chat (ktinject/cli/options.py) are checked as the chat checks them, before loading."""
    for args, needle in ((["--model", str(tmp_path / "nope")], "model directory not found"),
                         (["--model", str(tmp_path)], "no config.json"),
                         (["--rules", str(tmp_path / "nope.yaml")], "rules file not found"),
                         (["--defer", "-1"], "argument --defer: '-1' is out of range: expected an int D >= 0")):
        r = subprocess.run([sys.executable, "-m", "ktinject.serve", "--gpu", "cpu", "--port", "0", *args],
                           env=demo_env, cwd=REPO, capture_output=True, text=True, timeout=120)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and needle in lines[-1] and "Traceback" not in r.stderr, (args, r.stderr)


def section(title: str) -> str:
    """The serving page of the docs (docs/serving.md: its examples and its options table; ``title`` is the page's)."""
    text = SERVING_DOC.read_text()
    assert text.startswith(f"# {title}\n"), f"docs/serving.md should start with '# {title}'"
    return text


def test_readme_serving_examples_run_against_the_server(demo_env, tmp_path):
    """The Serving section's curl command and openai-client script, as written, against the demo server the section
    starts (``--gpu cpu``; only the port differs: the examples say 8000, the test takes a free one)."""
    text = section("Serving")
    curl = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if b.startswith("curl "))
    script = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    assert "127.0.0.1:8000" in curl and "127.0.0.1:8000" in script
    proc = subprocess.Popen([sys.executable, "-m", "ktinject.serve", "--gpu", "cpu", "--port", "0", "--max-batch", "2",
                             "--max-context", "512"],
                            env={k: v for k, v in demo_env.items() if k != "KTINJECT_API_KEY"}, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = _read_until(proc, r"Serving 'ktinject-demo' at http://127\.0\.0\.1:(\d+)/v1", timeout=240).group(1)
        here = lambda block: block.replace("127.0.0.1:8000", f"127.0.0.1:{port}")  # noqa: E731
        r = subprocess.run(["bash", "-c", here(curl)], capture_output=True, text=True, timeout=120)
        events = [line for line in r.stdout.splitlines() if line.startswith("data: ")]
        assert r.returncode == 0 and events[-1] == "data: [DONE]", (r.stdout, r.stderr)
        assert '"finish_reason":"length"' in events[-2].replace(" ", "") or \
            '"finish_reason":"stop"' in events[-2].replace(" ", ""), events[-2:]
        (tmp_path / "readme_client.py").write_text(here(script))
        r = subprocess.run([sys.executable, str(tmp_path / "readme_client.py")], env=demo_env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip(), (r.stdout, r.stderr)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_readme_serving_table_lists_every_option():
    from ktinject.cli.serve import build_parser

    listed = set()
    for row in section("Serving").splitlines():
        if row.startswith("| `"):
            first = row.strip("| ").split(" | ", 1)[0]
            listed |= {span.split(" ")[0] for span in re.findall(r"`([^`]+)`", first)}
    options = {s for a in build_parser()._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    assert options <= listed, f"docs/serving.md's options table misses {sorted(options - listed)}"
    assert listed <= options | {"-v"}, \
        f"docs/serving.md's options table lists unknown options {sorted(listed - options)}"


def test_bench_serve_tiny(monkeypatch, capsys):
    from ktinject.bench import memory, serve

    class Fake:
        best_gbs = 10.0

        def summary(self):
            return "memory read 10.0 GB/s (stub)"

    monkeypatch.setattr(memory, "measure_read_bandwidth", lambda *a, **k: Fake())
    assert serve.main(["--tiny", "--quant", "bf16", "--streams", "1,3", "--prompts", "5,17", "--tokens", "4",
                       "--rounds", "1", "--overlap", "on,off"]) == 0
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| bf16 |")]
    assert [r[1:3] for r in rows] == [["1", "on"], ["1", "off"], ["3", "on"], ["3", "off"]], out
    head = next(line for line in out.splitlines() if line.startswith("| quant |")).split(" | ")
    step, engine = (float(r[head.index("step ms")]) for r in rows), (float(r[head.index("engine ms")]) for r in rows)
    assert all(0 < e < s for s, e in zip(step, engine)), out  # the engine's share of a step: some, not all of it
    assert "TTFT p99" in out and "roofline" in out
