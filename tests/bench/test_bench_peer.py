"""The llama-bench peer of the decode and prefill benches (ktinject.bench.llamacpp): its command line, its JSON read back,
every way it can fail named, and the comparison rows, against a fake llama-bench (a script that answers as the real
one does with -o json)."""
from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from types import SimpleNamespace

import pytest

from ktinject.bench import decode, prefill, targets
from ktinject.bench import llamacpp as peer

# what llama-bench -o json prints (fields trimmed to those read, plus two it also prints)
SAMPLE = """[
  {
    "build_commit": "abc1234",
    "model_filename": "/tmp/q.gguf",
    "model_type": "qwen3moe 30B.A3B Q4_0",
    "n_prompt": 512,
    "n_gen": 0,
    "avg_ts": 2214.5,
    "stddev_ts": 20.1,
    "samples_ns": [ 1, 2 ],
    "samples_ts": [ 2200.0, 2229.0 ]
  },
  {
    "build_commit": "abc1234",
    "model_filename": "/tmp/q.gguf",
    "model_type": "qwen3moe 30B.A3B Q4_0",
    "n_prompt": 0,
    "n_gen": 64,
    "avg_ts": 33.8,
    "stddev_ts": 1.3,
    "samples_ns": [ 1 ],
    "samples_ts": [ 33.8 ]
  }
]
"""


def _fake(tmp_path, body: str, name: str = "llama-bench"):
    """An executable Python script standing in for llama-bench."""
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


# answers like llama-bench: one test per -p length (n_prompt) and one for -n when > 0; the GGUF's type from its name;
# its command line goes to argv.json beside it
ECHO = """
import json, os, sys
a = sys.argv[1:]
opt = lambda k: a[a.index(k) + 1]
json.dump(a, open(os.path.join(os.path.dirname(sys.argv[0]), "argv.json"), "w"))
model = opt("-m")
kind = "Q8_0" if "q8" in os.path.basename(model) else "Q4_0"
tests = [(int(p), 0) for p in opt("-p").split(",") if int(p)] + ([(0, int(opt("-n")))] if int(opt("-n")) else [])
reps = int(opt("-r"))
out = [{"model_filename": model, "model_type": "qwen3moe 30B.A3B " + kind, "n_prompt": p, "n_gen": g,
        "avg_ts": (1000.0 + p / 10) if p else 30.0, "samples_ts": [(1000.0 + p / 10) if p else 30.0] * reps}
       for p, g in tests]
print("main: loading model (a log line on stdout before the JSON)")
print(json.dumps(out, indent=2))
"""


@pytest.fixture
def gguf(tmp_path):
    paths = []
    for name in ("q4.gguf", "q8.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
        paths.append(str(tmp_path / name))
    return paths


def test_parse_reads_llama_bench_json():
    got = peer.parse(SAMPLE)
    assert [(r.n_prompt, r.n_gen, r.tok_s) for r in got] == [(512, 0, 2214.5), (0, 64, 33.8)]
    assert got[0].samples == (2200.0, 2229.0) and got[0].model == "q.gguf"
    assert got[0].gguf_type == "Q4_0" and got[0].label == "llama.cpp Q4_0 -ot exps=CPU"


@pytest.mark.parametrize("model_type, want", [
    ("qwen3moe 30B.A3B Q4_0", "Q4_0"), ("qwen3moe 30B.A3B Q8_0", "Q8_0"), ("llama 8B BF16", "BF16"),
    ("llama 8B F16", "F16"), ("qwen3moe 30B.A3B Q4_K - Medium", "Q4_K"), ("gpt-oss 20B MXFP4 MoE", "MXFP4"),
    ("something else", None), ("", None),
])
def test_gguf_type_from_model_type(model_type, want):
    assert peer.gguf_type(model_type) == want


def test_parse_skips_log_lines_and_trailing_text():
    text = "[INFO] loading model [q.gguf]\nbuild: abc (1)\n" + SAMPLE + "\nmain: done [0 errors]\n"
    assert [r.n_gen for r in peer.parse(text)] == [0, 64]


@pytest.mark.parametrize("text, says", [
    ("not json at all", "not JSON"),
    ("[]", "an empty list of tests"),
    ("[1, 2", "not JSON"),
    ('{"n_prompt": 1}', "not JSON"),  # no list in it
    ("[3]", "test 0 is not an object"),
    ('[{"n_prompt": 1, "n_gen": 0}]', "no field 'avg_ts'"),
    ('[{"n_prompt": "x", "n_gen": 0, "avg_ts": 1}]', "not a number"),
    ('[{"n_prompt": 1, "n_gen": 0, "avg_ts": 0}]', "expected a positive rate"),
])
def test_parse_names_what_is_wrong(text, says):
    with pytest.raises(peer.PeerError, match=says):
        peer.parse(text)


def test_run_passes_the_peer_setup_and_reads_every_test(tmp_path, gguf):
    binary = _fake(tmp_path, ECHO)
    got = peer.run(binary, gguf[0], prompts=(512, 2048), gen=0, threads=7, reps=2, extra="-ub 1024")
    assert [(r.n_prompt, r.tok_s, r.samples) for r in got] == [(512, 1051.2, (1051.2,) * 2),
                                                               (2048, 1204.8, (1204.8,) * 2)]
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("-ot") + 1] == "exps=CPU" and argv[argv.index("-ngl") + 1] == "99"
    assert argv[argv.index("-t") + 1] == "7" and argv[argv.index("-r") + 1] == "2"
    assert argv[argv.index("-o") + 1] == "json" and argv[-2:] == ["-ub", "1024"]
    dec = peer.run(binary, gguf[1], gen=64)
    assert [(r.n_prompt, r.n_gen, r.gguf_type) for r in dec] == [(0, 64, "Q8_0")]


def test_run_failures_say_what_to_fix(tmp_path, gguf):
    with pytest.raises(peer.PeerError, match="no such file .*build llama-bench"):
        peer.run(str(tmp_path / "missing"), gguf[0], gen=8)
    plain = tmp_path / "plain"
    plain.write_text("#!/bin/sh\n")
    with pytest.raises(peer.PeerError, match="not an executable"):
        peer.run(str(plain), gguf[0], gen=8)
    failing = _fake(tmp_path, "import sys\nprint('error: failed to load model', file=sys.stderr)\nsys.exit(1)\n",
                    "failing")
    with pytest.raises(peer.PeerError, match="(?s)exited with status 1.*failed to load model"):
        peer.run(failing, gguf[0], gen=8)
    slow = _fake(tmp_path, "import time\ntime.sleep(30)\n", "slow")
    with pytest.raises(peer.PeerError, match="did not finish within"):
        peer.run(slow, gguf[0], gen=8, timeout=0.5)
    with pytest.raises(peer.PeerError, match="not JSON"):
        peer.run(_fake(tmp_path, "print('| model | size |')\n", "markdown"), gguf[0], gen=8)
    # bytes that are not UTF-8 (a locale's log line) still give a clear error, not a decode traceback
    garbled = _fake(tmp_path, "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe oops')\n", "garbled")
    with pytest.raises(peer.PeerError, match="not JSON"):
        peer.run(garbled, gguf[0], gen=8)


def _args(**kw):
    base = dict(peer=None, peer_model=None, peer_threads=2, peer_reps=3, peer_args="", prefill="512,2048,8192",
                tokens=64, layers=48, tiny=False, batch=1)
    base.update(kw)
    return SimpleNamespace(**base)


def test_check_arguments(tmp_path, gguf):
    binary = _fake(tmp_path, ECHO)
    peer.check_arguments(_args())  # no peer: nothing to check
    peer.check_arguments(_args(peer=binary, peer_model=",".join(gguf)))
    for kw, says in [(dict(peer=binary), "needs --peer-model"), (dict(peer_model=gguf[0]), "needs --peer PATH"),
                     (dict(peer=binary, peer_model=str(tmp_path / "none.gguf")), "none.gguf: no such file"),
                     (dict(peer=str(tmp_path / "nope"), peer_model=gguf[0]), "no such file"),
                     (dict(peer=binary, peer_model=gguf[0], peer_reps=0), "--peer-reps 0"),
                     (dict(peer=binary, peer_model=gguf[0], peer_args='"-ub'), "quotation")]:
        with pytest.raises(SystemExit, match=says):
            peer.check_arguments(_args(**kw))


def test_prefill_rows_compare_each_quant_with_its_gguf(tmp_path, gguf):
    args = _args(peer=_fake(tmp_path, ECHO), peer_model=",".join(gguf), prefill="512,2048")
    # ktinject's 48-layer rates: int4 at 2048 2.5x the fake Q4_0 (1204.8), int8 1.5x the fake Q8_0
    ours = {("int4", 512): ("auto", 3000.0), ("int4", 2048): ("auto", 2.5 * 1204.8),
            ("int8", 2048): ("gpu", 1.5 * 1204.8), ("bf16", 2048): ("auto", 9999.0)}
    rows = {r[0]: r for r in prefill.peer_rows(args, ours)}
    assert rows["llama.cpp Q4_0 -ot exps=CPU prefill 2048"][1] == "1,205"
    assert rows["llama.cpp Q8_0 -ot exps=CPU prefill 512"][1] == "1,051"
    got4 = rows["int4 target: at 2048 >= 2x llama.cpp Q4_0 -ot exps=CPU"]
    assert got4[1] == "2.50x" and got4[2].startswith("met (ktinject auto")
    got8 = rows["int8 target: at 2048 >= 2x llama.cpp Q8_0 -ot exps=CPU"]
    assert got8[1] == "1.50x" and got8[2].startswith("NOT met (ktinject gpu")
    assert not any("512 >= 2x" in k or k.startswith("bf16") for k in rows)  # the lengths and formats
    assert "from" not in got4[2]  # 48 layers: no scaling to mention
    # 12 layers: the estimate says how it was made; a format without its GGUF type gets a row saying so
    args = _args(peer=_fake(tmp_path, ECHO), peer_model=gguf[0], prefill="2048", layers=12)
    rows = {r[0]: r for r in prefill.peer_rows(args, {("int4", 2048): ("gpu", 3000.0), ("int8", 2048): ("gpu", 1.0)})}
    assert "from 12 layers x 12/48" in rows["int4 target: at 2048 >= 2x llama.cpp Q4_0 -ot exps=CPU"][2]
    assert rows["int8 target: 2x llama.cpp"][1] == "n/a" and "no Q8_0 GGUF" in rows["int8 target: 2x llama.cpp"][2]


def test_decode_rows_and_our_rate(tmp_path, gguf):
    assert targets.our_rate([("ktinject graph", "71.5", "", ""), ("defer 0: graph decode", "80.0", "", "")]) == (
        "defer 0: graph decode", 80.0)
    assert targets.our_rate([("ktinject graph", "1,071.5", "", "")]) == ("ktinject graph", 1071.5)
    assert targets.our_rate([("ktinject graph", "n/a", "", "")]) is None
    args = _args(peer=_fake(tmp_path, ECHO), peer_model=gguf[0], layers=12)
    rows = {r[0]: r for r in decode.peer_rows(args, {"int4": ("ktinject graph", 240.0), "int8": ("x", 1.0)})}
    assert rows["llama.cpp Q4_0 -ot exps=CPU decode 64"][1] == "30.0"
    ratio = rows["int4 / llama.cpp Q4_0 -ot exps=CPU"]
    assert ratio[1] == "2.00x" and "x 12/48 layers" in ratio[3]  # 240 tok/s of 12 layers ~ 60 for 48
    assert rows["int8 / llama.cpp"][1] == "n/a" and "no Q8_0 GGUF among --peer-model" in rows["int8 / llama.cpp"][3]
    for kw, says in [(dict(tiny=True), "--tiny"), (dict(batch=4), "batch 4")]:
        args = _args(peer=_fake(tmp_path, ECHO), peer_model=gguf[0], **kw)
        rows = {r[0]: r for r in decode.peer_rows(args, {"int4": ("ktinject graph", 240.0)})}
        assert rows["int4 / llama.cpp Q4_0 -ot exps=CPU"][1] == "n/a" and says in rows["int4 / llama.cpp Q4_0 -ot "
                                                                                         "exps=CPU"][3]


def test_a_failing_peer_is_a_row_not_a_crash(tmp_path, gguf):
    failing = _fake(tmp_path, "import sys\nsys.exit(3)\n")
    rows = decode.peer_rows(_args(peer=failing, peer_model=gguf[0]), {"int4": ("ktinject graph", 80.0)})
    assert rows[0][0] == "peer failed" and "status 3" in rows[0][3] and len(rows) == 1


@pytest.mark.skipif(os.name != "posix", reason="scripts with a shebang")
def test_bench_prefill_tiny_with_peer_end_to_end(tmp_path, gguf, capsys):
    rc = prefill.main(["--tiny", "--quant", "int4", "--prefill", "64", "--mode", "cpu", "--reps", "1",
                       "--peer", _fake(tmp_path, ECHO), "--peer-model", gguf[0]])
    out = capsys.readouterr().out
    assert rc == 0 and "llama.cpp Q4_0 -ot exps=CPU prefill 64" in out
