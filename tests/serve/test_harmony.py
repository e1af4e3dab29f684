"""gpt-oss's harmony replies as a table: reply text -> (reasoning, content, calls), whole and streamed 1, 3 and 7
characters at a time, through ``harmony.split`` and a chat reply's ``ChatOutput``; malformed and unclosed markup
staying text (content)."""
from __future__ import annotations

import json

import pytest

from ktinject.serve import harmony, reasoning, tool_parsers
from ktinject.serve.chat_output import ChatOutput, chat_parsers

W = {"city": "Paris"}
A = "<|channel|>analysis<|message|>"
NEXT = "<|end|><|start|>assistant"
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'

CASES = [  # (text, reasoning, content, [(name, arguments)])
    (f"{A}The user greets.{NEXT}<|channel|>final<|message|>Hello!<|return|>", "The user greets.", "Hello!", []),
    (f"{A}Need the weather.{NEXT}{CALL}<|call|>", "Need the weather.", "", [("get_weather", W)]),
    (f"{A}x{NEXT}{CALL}", "x", "", [("get_weather", W)]),  # <|call|> is an end token: the text stops before it
    # the recipient in the role's part of the header, the format without <|constrain|>
    (f'{A}x{NEXT} to=functions.f<|channel|>commentary json<|message|>{{"n": 1}}<|call|>', "x", "", [("f", {"n": 1})]),
    # a preamble (commentary to no one) is content; two calls in a row
    ('<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant<|channel|>commentary to=functions.a '
     '<|constrain|>json<|message|>{}<|call|><|start|>assistant<|channel|>commentary to=functions.b<|message|>'
     '{"x": [1, 2]}<|call|>', "", "Checking both.", [("a", {}), ("b", {"x": [1, 2]})]),
    (f"{A}truncated reasoning", "truncated reasoning", "", []),  # cut off by max_tokens: reasoning as far as it got
    ("plain text, no harmony", "", "plain text, no harmony", []),
    ("a <| b", "", "a <| b", []),
    ("<|channel|>final<|message|>1 < 2 and <|en", "", "1 < 2 and <|en", []),
    # malformed: stays text
    ("<|channel|>analysis", "", "<|channel|>analysis", []),  # a header never closed
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{bad<|call|>", "",
     "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{bad<|call|>", []),  # not JSON
    ("<|channel|>commentary to=functions.f<|message|>[1]", "", "<|channel|>commentary to=functions.f<|message|>[1]",
     []),  # arguments not an object
    ("<|channel|>commentary to=browser.search<|message|>{}<|call|>", "",
     "<|channel|>commentary to=browser.search<|message|>{}<|call|>", []),  # not a function: no call of the API's
    ("<|channel|>no channel here<|message|>hi", "", "<|channel|>no channel here<|message|>hi", []),
]


def _calls(calls):
    return [(name, json.loads(args)) for name, args in calls]


@pytest.mark.parametrize("text,reason,content,calls", CASES)
def test_split_whole_reply(text, reason, content, calls):
    r, c, k = harmony.split(text)
    assert (r, c, _calls(k)) == (reason, content, calls)


@pytest.mark.parametrize("step", [1, 3, 7])
@pytest.mark.parametrize("text,reason,content,calls", CASES)
def test_streamed_reply_gives_the_same_parts(text, reason, content, calls, step):
    s = harmony.HarmonyStreamer()
    parts = [s.feed(text[i:i + step]) for i in range(0, len(text), step)] + [s.finish()]
    got = ("".join(p[0] for p in parts), "".join(p[1] for p in parts), _calls([c for p in parts for c in p[2]]))
    assert got == (reason, content, calls)


@pytest.mark.parametrize("text,reason,content,calls", CASES)
def test_chat_message(text, reason, content, calls):
    msg = ChatOutput(tool_parsers.make("harmony"), harmony=True).message(text)
    assert msg.get("reasoning_content", "") == reason
    assert msg["content"] == (content if content or not calls else None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", ())] \
        == calls


def test_reasoning_and_content_stream_at_once_and_a_call_is_held():
    s = harmony.HarmonyStreamer()
    assert s.feed("<|channel|>anal") == ("", "", [])  # a header: held until <|message|>
    assert s.feed("ysis<|message|>Let me") == ("Let me", "", [])
    assert s.feed(" see<|e") == (" see", "", [])  # the beginning of a marker is held
    assert s.feed("nd|><|start|>assistant<|channel|>commentary to=functions.f<|message|>{\"a\"") == ("", "", [])
    assert s.feed(": 1}<|call|>") == ("", "", [("f", '{"a": 1}')])


def test_without_tools_a_call_is_text_and_the_reasoning_still_split():
    text = f"{A}hmm{NEXT}{CALL}<|call|>"
    msg = ChatOutput(None, harmony=True).message(text)
    assert msg == {"role": "assistant", "content": f"<|start|>assistant{CALL}<|call|>",
                   "reasoning_content": "hmm"}


def test_streamed_chat_deltas_number_the_calls():
    out = ChatOutput(tool_parsers.make("harmony"), harmony=True)
    text = CASES[4][0]
    deltas = [d for ch in text for d in out.feed(ch)] + out.finish()
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "a"), (1, "b")] and out.calls == 2


class _Engine:
    def __init__(self, model_type):
        self.model = type("M", (), {"config": type("C", (), {"model_type": model_type})})()


def test_chosen_for_gpt_oss_and_by_name():
    assert reasoning.for_model_type("gpt_oss") == "harmony"
    assert chat_parsers(_Engine("gpt_oss"), "auto", "auto") == ("harmony", "harmony")
    assert chat_parsers(_Engine("gpt_oss"), "none", "auto") == (None, "harmony")
    assert chat_parsers(_Engine("mixtral"), "gpt_oss", "harmony") == ("harmony", "harmony")
    assert chat_parsers(_Engine("qwen3_moe"), "auto", "harmony") == ("harmony", "harmony")
    with pytest.raises(ValueError, match="harmony"):
        chat_parsers(_Engine("gpt_oss"), "qwen3", "auto")  # harmony's calls are not qwen3's
    with pytest.raises(ValueError, match="think, harmony"):
        chat_parsers(_Engine("gpt_oss"), "auto", "nope")


def test_cli_refuses_harmony_reasoning_with_another_familys_calls_before_loading(demo_env):
    import subprocess
    import sys
    from pathlib import Path

    r = subprocess.run([sys.executable, "-m", "ktinject.serve", "--gpu", "cpu", "--port", "0", "--reasoning-parser",
                        "harmony", "--tool-call-parser", "qwen3"], env=demo_env, cwd=Path(__file__).parents[2],
                       capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and "--tool-call-parser harmony" in lines[-1] and "Traceback" not in r.stderr, r.stderr
    assert "Loaded" not in r.stdout
