"""The chat CLI driven as a user would: python -m ktinject.chat in a subprocess, on the CPU, with the demo model."""
from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPEED = re.compile(r"\[prefill (\d+) tokens(?: \(\d+ cached\))?, [\d.]+ tok/s \| "
                   r"decode (\d+) tokens, ([\d.]+|n/a) tok/s\]")
CACHED = re.compile(r"\[prefill (\d+) tokens(?: \((\d+) cached\))?, ")


def chat(env, *args, stdin: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ktinject.chat", *args], input=stdin, env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_prompt_answers_once(demo_env):
    """One-shot: the reply alone on stdout (so it can be piped); the banner, the load line and the speed line on
    stderr."""
    r = chat(demo_env, "--prompt", "hi", "--max-new-tokens", "8", "--gpu", "cpu")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    err = r.stderr.splitlines()
    assert "demo model" in err[0] and "fortune" in err[0], r.stderr
    assert any(line.startswith("Loaded demo_model in ") for line in err), r.stderr
    speed = SPEED.search(r.stderr)
    assert speed, r.stderr
    assert int(speed.group(1)) > 0 and int(speed.group(2)) == 8
    assert r.stdout.strip(), r.stdout  # the reply
    for needle in ("demo model", "Loaded", "[prefill", ">>>"):  # nothing else on stdout, no interactive loop
        assert needle not in r.stdout, r.stdout


def test_prompt_reply_is_all_of_stdout(demo_env):
    """Greedy one-shot at full length: stdout is the reply and its newline, ended at the turn's end."""
    r = chat(demo_env, "--prompt", "Hello!", "--temperature", "0", "--max-new-tokens", "200", "--gpu", "cpu")
    assert r.returncode == 0, r.stderr
    reply = r.stdout
    assert reply.endswith("\n") and reply.strip(), reply
    assert "user\n" not in reply and "<|im_" not in reply, reply
    assert int(SPEED.search(r.stderr).group(2)) < 200  # it ended at the end of the turn


SEA = "the sea " * 1340  # about 4,000 tokens: twice the demo model's context of 2,048


def _error_after_load(r: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit code 2, the error the last line of stderr (after the banner and the load line), nothing on stdout."""
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == "", (r.stdout, r.stderr)
    last = r.stderr.rstrip().splitlines()[-1]
    assert last.startswith("ktinject.chat: error: "), r.stderr
    for needle in needles:
        assert needle in last, last


def test_prompt_longer_than_the_context_is_refused(demo_env):
    r = chat(demo_env, "--prompt", SEA, "--gpu", "cpu")
    _error_after_load(r, "leaves no room for a reply in the model's context of 2048 tokens")
    assert "[prefill" not in r.stderr


def test_prompt_plus_max_new_tokens_past_the_context_is_refused(demo_env):
    """As the server refuses max_tokens past the context; without --max-new-tokens the reply gets what is left."""
    prompt = "the sea " * 600  # about 1,800 tokens
    r = chat(demo_env, "--prompt", prompt, "--max-new-tokens", "400", "--gpu", "cpu")
    _error_after_load(r, "plus --max-new-tokens (400)", "more than the model's context of 2048 tokens",
                    "lower --max-new-tokens to at most")
    r = chat(demo_env, "--prompt", prompt, "--temperature", "0", "--gpu", "cpu")
    assert r.returncode == 0, r.stderr
    left = re.search(r"\(the reply is limited to (\d+) tokens: the message's (\d+) tokens fill the rest of the "
                     r"model's context of 2048\)", r.stderr)
    assert left and int(left.group(1)) + int(left.group(2)) == 2048, r.stderr
    assert int(SPEED.search(r.stderr).group(2)) <= int(left.group(1))


def test_interactive_refuses_what_cannot_fit_and_says_what_it_drops(demo_env):
    """A message too long for the context is refused and the session goes on; old exchanges dropped to make room
    are counted."""
    long = "the sea " * 250  # about 750 tokens
    script = f"{SEA}\nhi\n{long}\n{long}\n{long}\n/stats\n/exit\n"
    r = chat(demo_env, "--gpu", "cpu", "--max-new-tokens", "4", "--temperature", "0", stdin=script, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert re.search(r"\(not sent: the message is \d+ tokens .*leaves no room for a reply in the model's context "
                     r"of 2048 tokens", r.stderr), r.stderr
    turns = SPEED.findall(r.stdout)
    assert len(turns) == 4, r.stdout  # every message but the refused one
    dropped = re.findall(r"\(dropped the oldest (\d+) messages \((\d+) exchanges?\) of the conversation to fit "
                         r"the model's context of 2048 tokens; (\d+) kept\)", r.stderr)
    assert dropped, r.stderr
    removed = sum(int(d[0]) for d in dropped)
    assert all(int(d[0]) == 2 * int(d[1]) for d in dropped)
    stats = re.search(r"turns: (\d+), history: (\d+) messages, (\d+) tokens", r.stdout)
    assert stats and stats.group(1) == "4" and int(stats.group(2)) == 8 - removed, r.stdout
    assert int(stats.group(3)) <= 2048


def test_a_refused_message_leaves_the_history_as_it_was(demo_env):
    """Making room for a message that is then refused drops nothing: the earlier exchanges are all still there."""
    script = f"hi\nhello\n{SEA}\n/stats\n/exit\n"
    r = chat(demo_env, "--gpu", "cpu", "--max-new-tokens", "4", "--temperature", "0", stdin=script, timeout=600)
    assert r.returncode == 0 and "(not sent: " in r.stderr, r.stderr
    assert "dropped the oldest" not in r.stderr, r.stderr
    stats = re.search(r"turns: (\d+), history: (\d+) messages", r.stdout)
    assert stats and stats.groups() == ("2", "4"), r.stdout


def test_model_file_is_not_a_directory(demo_env, tmp_path):
    from ktinject.demo import demo_model_dir

    config = demo_model_dir() / "config.json"
    _one_error_line(chat(demo_env, "--model", str(config)), f"--model {config} is a file, not a model directory",
                    f"its directory: --model {config.parent}")
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"GGUF")
    r = chat(demo_env, "--model", str(weights))  # a GGUF file is a model: this one is damaged
    _one_error_line(r, f"{weights}: the GGUF header is cut off (4 bytes): a truncated file")
    assert "not found" not in r.stderr


def test_interactive_history_stats_clear(demo_env):
    script = "hello there\nand now?\n/stats\n/clear\n/stats\n/help\n/exit\nnever read\n"
    r = chat(demo_env, "--gpu", "cpu", "--max-new-tokens", "6", "--temperature", "0", stdin=script)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    turns = SPEED.findall(r.stdout)
    assert len(turns) == 2, r.stdout  # "never read" comes after /exit
    (p1, n1, _), (p2, n2, _) = turns
    assert int(n1) == int(n2) == 6
    assert int(p2) > int(p1) + int(n1)  # the second prompt carries the first exchange
    stats = re.findall(r"turns: (\d+), history: (\d+) messages, (\d+) tokens", r.stdout)
    assert stats[0][:2] == ("2", "4") and int(stats[0][2]) >= int(p2)
    assert stats[1] == ("2", "0", "0")  # after /clear: totals kept, history gone
    assert "(conversation cleared)" in r.stdout
    assert re.search(r"decode: 12 tokens in [\d.]+ s, [\d.]+ tok/s", r.stdout)
    assert re.search(r"^fast path decode_attention: ", r.stdout, re.M), r.stdout  # /stats shows the fast paths


def test_system_prompt_and_eof(demo_env):
    r = chat(demo_env, "--gpu", "cpu", "--max-new-tokens", "2", "--system", "You are terse.", stdin="hi\n")
    assert r.returncode == 0, r.stderr
    assert len(SPEED.findall(r.stdout)) == 1


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT delivery to a child process")
def test_ctrl_c_stops_the_reply_not_the_program(demo_env):
    from ktinject.demo import random_model_dir

    # the random-weight model writes until --max-new-tokens (the trained demo model may stop at its EOS first)
    model = str(random_model_dir(demo_env["KTINJECT_CACHE"]))
    proc = subprocess.Popen([sys.executable, "-m", "ktinject.chat", "--model", model, "--gpu", "cpu",
                             "--max-new-tokens", "4000"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=demo_env,
                            cwd=REPO, text=True)
    try:
        proc.stdin.write("tell me everything\n")
        proc.stdin.flush()
        seen = _read_until(proc, lambda s: re.search(r">>> .", s) is not None, timeout=120)
        time.sleep(0.5)  # well into the reply
        proc.send_signal(signal.SIGINT)
        seen += _read_until(proc, lambda s: SPEED.search(s) is not None, timeout=60)
        out, err = proc.communicate("/exit\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "[stopped]" in seen
    assert int(SPEED.search(seen).group(2)) < 4000


def _read_until(proc, done, timeout: float) -> str:
    """Read the child's stdout as it comes until done(text) or timeout."""
    text, fd, end = "", proc.stdout.fileno(), time.monotonic() + timeout
    while not done(text):
        assert time.monotonic() < end, f"timed out; got {text!r}"
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            chunk = os.read(fd, 65536).decode(errors="replace")
            assert chunk, f"stdout closed; got {text!r}; stderr {proc.stderr.read()!r}"
            text += chunk
    return text


def _one_error_line(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ktinject.chat: error: "), r.stderr
    for needle in needles:
        assert needle in lines[0]


def test_missing_model_directory(demo_env, tmp_path):
    _one_error_line(chat(demo_env, "--model", str(tmp_path / "no-such-model")), "model directory", "no-such-model")


def test_not_a_model_directory(demo_env, tmp_path):
    _one_error_line(chat(demo_env, "--model", str(tmp_path)), "config.json")


def test_missing_rules_file(demo_env, tmp_path):
    _one_error_line(chat(demo_env, "--rules", str(tmp_path / "nope.yaml"), "--gpu", "cpu"), "rules file", "nope.yaml")


def test_invalid_rules_file(demo_env, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- match: {class: Qwen3MoeSparseMoeBlock}\n  replace: moe\n  colour: blue\n")
    r = chat(demo_env, "--rules", str(bad), "--gpu", "cpu", "--prompt", "hi")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("ktinject.chat: error: ")]
    assert len(errors) == 1 and "bad.yaml" in errors[0], r.stderr


def test_random_demo_model_is_deterministic_and_built_atomically(demo_env, tmp_path):
    """Two processes building the random-weight checkpoint at once in a fresh cache agree on one directory,
    identical to the session's build."""
    import hashlib

    from ktinject.demo import random_model_dir

    random_model_dir(demo_env["KTINJECT_CACHE"])
    code = "from ktinject.demo import random_model_dir; print(random_model_dir())"
    env = dict(demo_env, KTINJECT_CACHE=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    dirs = {p.communicate(timeout=180)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(dirs) == 1
    built = Path(dirs.pop())
    assert sorted(p.name for p in tmp_path.iterdir()) == [built.name]  # no temporary leftovers
    reference = Path(demo_env["KTINJECT_CACHE"]) / built.name

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert digest(built / name) == digest(reference / name), name


def test_misspelled_moe_class_is_named_first(demo_env, tmp_path):
    """A moe rule whose class matches nothing (so no expert would leave the GPU): the error line says so, naming
    that rule and the class it likely meant, before anything is read."""
    rules = tmp_path / "typo.yaml"
    rules.write_text("- match: {class: Qwen3MoeSparseMoeBlok}\n  replace: moe\n  device: gpu\n"
                     "- include: common.yaml\n")
    r = chat(demo_env, "--rules", str(rules), "--gpu", "cpu", "--prompt", "hi", "--max-new-tokens", "2")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("ktinject.chat: error: ")]
    assert len(errors) == 1, r.stderr
    message = errors[0].split(": RuleError: ", 1)[1]
    assert message.startswith("no module of Qwen3MoeForCausalLM matched a moe rule, so no experts would move to the "
                              f"CPU: {rules}: rule[0] (line 1) matched no module of Qwen3MoeForCausalLM "
                              "(match: class='Qwen3MoeSparseMoeBlok'; did you mean 'Qwen3MoeSparseMoeBlock'?)"), message


@pytest.mark.parametrize("args, needle", [
    (["--temperature", "-1"], "argument --temperature: must be >= 0 (0 = greedy), got -1"),
    (["--temperature", "inf"], "argument --temperature: must be a finite number, got inf"),
    (["--top-p", "2"], "argument --top-p: must be in (0, 1] (1 = no nucleus cut), got 2"),
    (["--top-p", "0"], "argument --top-p: must be in (0, 1]"),
    (["--top-p", "x"], "argument --top-p: not a number: 'x'"),
])
def test_sampling_arguments_out_of_range_are_rejected(args, needle, capsys):
    from ktinject.cli.chat import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(args)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_sampling_arguments_in_range():
    from ktinject.cli.chat import parse_args

    a = parse_args(["--temperature", "0", "--top-p", "1"])
    assert (a.temperature, a.top_p) == (0.0, 1.0)
    assert parse_args(["--top-p", "0.05"]).top_p == 0.05


def test_threads_above_the_cores_warn(demo_env):
    from ktinject.native.library import default_threads, usable_cpus

    cpus = usable_cpus()
    r = chat(demo_env, "--gpu", "cpu", "--prompt", "hi", "--max-new-tokens", "2", "--threads", str(cpus + 1))
    assert r.returncode == 0, r.stderr
    assert f"--threads {cpus + 1}: more expert threads than the {cpus} CPUs this process may run on" in r.stderr
    assert f"the default: {default_threads()} here" in r.stderr
    r = chat(demo_env, "--gpu", "cpu", "--prompt", "hi", "--max-new-tokens", "2", "--threads", str(cpus))
    assert r.returncode == 0 and "more expert threads" not in r.stderr, r.stderr


def test_stats_prints_one_line_per_fast_path(monkeypatch):
    import argparse

    import ktinject
    from ktinject.cli.chat import Chat

    model = object()
    paths = {"decode_attention": {"active": True, "reason": None},
             "graph_decode": {"active": False, "reason": "no CUDA device"},
             "fast_router": {"active": None, "reason": None}}
    monkeypatch.setattr(ktinject, "info", lambda m: {"fast_paths": paths} if m is model else {}, raising=False)
    lines = Chat(model, None, argparse.Namespace(system=None)).stats().splitlines()
    assert lines[3] == "prefix cache: off"
    assert lines[4:] == ["fast path decode_attention: active",
                         "fast path graph_decode: off (no CUDA device)",
                         "fast path fast_router: not run yet"]


def test_cpu_path_runs_torch_on_one_thread_unless_threads_say_otherwise():
    """On the CPU path torch's own intra-op team is one thread by default: a team of several spin-waits for its
    members at every parallel region and, beside a process that holds a core, stalls for time slices at every
    step (docs/performance.md, "Busy hosts"); --threads N sets both torch and the expert pool."""
    import argparse

    import torch

    from ktinject.cli import options

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert options.device(argparse.Namespace(gpu="cpu", threads=None)) == "cpu"
        assert torch.get_num_threads() == 1
        from ktinject.native import pool

        # the pool's own count where an earlier test in this process started it (it cannot change once running)
        running = pool._default_pool.threads if pool._default_pool is not None and pool._default_pool._p else 2
        torch.set_num_threads(1)
        options.device(argparse.Namespace(gpu="cpu", threads=running))
        assert torch.get_num_threads() == running
    finally:
        torch.set_num_threads(before)


def test_second_turn_prefills_only_the_new_tokens(demo_env, tmp_path):
    """With the prefix cache (on by default) a follow-up turn restores the first turn's prompt and reply and
    prefills the rest: at most the new message, its chat template tokens and the partial block before them; the
    reply is the one the chat gives without the cache; /stats counts the reused tokens and the tier's hits."""
    script = "hello there\nand now?\n/stats\n/exit\n"
    common = ["--gpu", "cpu", "--max-new-tokens", "6", "--temperature", "0"]
    r = chat(demo_env, *common, "--prefix-block", "4", stdin=script)
    off = chat(demo_env, *common, "--prefix-cache", "off", stdin=script)
    assert r.returncode == 0 and off.returncode == 0, (r.stderr, off.stderr)
    assert "prefix cache ram, blocks of 4 tokens" in r.stdout, r.stdout
    (p1, c1), (p2, c2) = [(int(a), int(b or 0)) for a, b in CACHED.findall(r.stdout)]
    n1 = int(SPEED.findall(r.stdout)[0][1])
    assert c1 == 0 and c2 > 0, r.stdout
    fed = p1 + n1 - 1  # the first turn's tokens the cache holds (the last reply token was never fed)
    assert c2 == fed // 4 * 4, r.stdout  # every whole block of them: the history re-renders to the same tokens
    new = p2 - fed  # the second message with its template tokens
    assert p2 - c2 == new + fed % 4  # what was prefilled: the new tokens and the partial block before them
    replies = [line for line in r.stdout.splitlines() if line.startswith(">>> ")]
    assert replies == [line for line in off.stdout.splitlines() if line.startswith(">>> ")]  # greedy: the same
    assert re.search(rf"prefill: \d+ tokens \({c2} from the prefix cache\)", r.stdout), r.stdout
    assert re.search(r"prefix cache ram: \d+ block hits", r.stdout) and "prefix cache: off" in off.stdout


def test_prefix_cache_options_are_checked(capsys):
    from ktinject.cli.chat import parse_args

    a = parse_args(["--prefix-cache", "disk", "--prefix-cache-ram", "2GiB", "--prefix-block", "64"])
    assert (a.prefix_cache, a.prefix_cache_ram, a.prefix_block) == ("disk", 2 * 2**30, 64)
    assert parse_args([]).prefix_cache == "ram"
    with pytest.raises(SystemExit):
        parse_args(["--prefix-cache-gpu", "lots"])
    assert "argument --prefix-cache-gpu: byte size" in capsys.readouterr().err


def test_disk_tier_serves_the_next_chat_process(demo_env, tmp_path):
    """--prefix-cache disk: a chat started again finds the blocks the last one wrote, so its first turn on the same
    message is restored (all but the partial last block)."""
    common = ["--gpu", "cpu", "--prompt", "hello there", "--max-new-tokens", "4", "--temperature", "0",
              "--prefix-cache", "disk", "--prefix-cache-dir", str(tmp_path), "--prefix-block", "4"]
    first, second = chat(demo_env, *common), chat(demo_env, *common)
    assert first.returncode == 0 and second.returncode == 0, (first.stderr, second.stderr)
    assert "prefix cache ram+disk, blocks of 4 tokens" in first.stderr, first.stderr
    (p1, c1), = [(int(a), int(b or 0)) for a, b in CACHED.findall(first.stderr)]
    (p2, c2), = [(int(a), int(b or 0)) for a, b in CACHED.findall(second.stderr)]
    assert p1 == p2 and c1 == 0 and c2 == (p2 - 1) // 4 * 4 > 0, second.stderr
    assert first.stdout == second.stdout
    assert list(tmp_path.glob("??/*.ktpc")), list(tmp_path.iterdir())
