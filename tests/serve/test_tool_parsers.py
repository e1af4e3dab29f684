"""The tool-call and reasoning parsers as tables: reply text -> (content, calls), whole and streamed in every split
(one character at a time too), malformed and unclosed calls staying text."""
from __future__ import annotations

import json

import pytest

from ktinject.serve import reasoning, tool_parsers
from ktinject.serve.chat_output import ChatOutput

W = {"city": "Paris"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
DS_B, DS_E, DS_CB, DS_CE, DS_S = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                  "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")

CASES = [  # (parser, text, content, [(name, arguments)])
    ("qwen3", "plain text", "plain text", []),
    ("qwen3", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.\n", [("get_weather", W)]),
    ("qwen3", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
              '{"x": 1}}</tool_call>', "\n", [("a", {}), ("b", {"x": 1})]),
    ("qwen3", '<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>', "", [("a", {"x": 2})]),
    ("qwen3", '<tool_call>{"name": "a", "arguments": {</tool_call>', '<tool_call>{"name": "a", "arguments": {'
                                                                     '</tool_call>', []),  # bad JSON
    ("qwen3", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ("qwen3", 'x <tool_call>{"name": "a", "arguments": {}}', 'x <tool_call>{"name": "a", "arguments": {}}', []),
    ("qwen3", "a < b and <tool", "a < b and <tool", []),
    ("qwen3", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
              "</parameter>\n</function>\n</tool_call>", "", [("get_weather", {"city": "Paris", "days": 3})]),
    ("qwen3", "<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n</parameter>\n</function>\n</tool_call>",
     "", [("get_weather", {"city": "123"})]),  # a string parameter stays a string
    ("deepseek_v3", f"Sure.{DS_B}{DS_CB}function{DS_S}get_weather\n```json\n{json.dumps(W)}\n```{DS_CE}{DS_E}",
     "Sure.", [("get_weather", W)]),
    ("deepseek_v3", f"{DS_B}{DS_CB}get_weather{DS_S}{json.dumps(W)}{DS_CE}{DS_CB}f{DS_S}{{}}{DS_CE}{DS_E}", "",
     [("get_weather", W), ("f", {})]),
    ("deepseek_v3", f"{DS_B}{DS_CB}get_weather{DS_S}{{bad{DS_CE}{DS_E}", f"{DS_CB}get_weather{DS_S}{{bad{DS_CE}", []),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>"
              "\n<arg_value>2</arg_value>\n</tool_call>", "", [("get_weather", {"city": "Paris", "days": 2})]),
    ("glm45", "<tool_call>f</tool_call>", "", [("f", {})]),
    ("glm45", "<tool_call>get_weather <arg_key>city</arg_key></tool_call>",
     "<tool_call>get_weather <arg_key>city</arg_key></tool_call>", []),
    ("kimi_k2", "ok<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>', "ok", [("get_weather", W)]),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                   '</invoke>\n<invoke name="f">\n</invoke>\n</minimax:tool_call>', "",
     [("get_weather", W), ("f", {})]),
    ("minimax_m2", "<minimax:tool_call>junk</minimax:tool_call>", "<minimax:tool_call>junk</minimax:tool_call>", []),
    ("llama4_pythonic", '[get_weather(city="Paris"), f(n=1)]', "", [("get_weather", W), ("f", {"n": 1})]),
    ("llama4_pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
    ("llama4_pythonic", "[f(x)]", "[f(x)]", []),  # positional arguments: not a call of this form
    ("llama4_pythonic", "Hello [there]", "Hello [there]", []),
    ("harmony", '<|channel|>analysis<|message|>need weather<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>', "",
     [("get_weather", W)]),  # (the analysis channel is reasoning: test_harmony.py)
    ("harmony", "<|channel|>final<|message|>plain text", "plain text", []),
    ("harmony", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": ',
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": ', []),  # cut off
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parse_whole_reply(name, text, content, calls):
    got_content, got_calls = tool_parsers.make(name, TOOLS).parse(text)
    assert (got_content, _calls(got_calls)) == (content, calls)


@pytest.mark.parametrize("step", [1, 3, 7])
@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_streamed_reply_gives_the_same_content_and_calls(name, text, content, calls, step):
    s = tool_parsers.make(name, TOOLS).streamer()
    out, got = [], []
    for i in range(0, len(text), step):
        c, k = s.feed(text[i:i + step])
        out.append(c)
        got.extend(k)
    c, k = s.finish()
    assert ("".join(out) + c, _calls(got + k)) == (content, calls)


def test_text_before_a_call_streams_at_once_and_a_marker_is_held():
    s = tool_parsers.make("qwen3").streamer()
    assert s.feed("Hello <tool") == ("Hello ", [])
    assert s.feed("_call>{") == ("", [])
    content, calls = s.feed('"name": "f", "arguments": {}}</tool_call> bye')
    assert content == " bye" and [c.name for c in calls] == ["f"]


def test_kimi_keeps_the_models_call_id():
    text = '<|tool_call_begin|>functions.f:3<|tool_call_argument_begin|>{}<|tool_call_end|>'
    assert tool_parsers.make("kimi_k2").parse(text)[1][0].id == "functions.f:3"


@pytest.mark.parametrize("model_type,parser", [("qwen3_moe", "qwen3"), ("qwen3_5_moe", "qwen3_coder"),
                                               ("deepseek_v3", "deepseek_v3"), ("kimi_k2", "kimi_k2"),
                                               ("glm4_moe", "glm45"), ("minimax_m2", "minimax_m2"),
                                               ("llama4", "llama4_pythonic"), ("gpt_oss", "harmony"),
                                               ("mixtral", None), (None, None)])
def test_parser_by_model_type(model_type, parser):
    assert tool_parsers.for_model_type(model_type) == parser


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="qwen3"):
        tool_parsers.parser_name("nope")
    assert tool_parsers.parser_name("hermes") == "qwen3"


THINK = [  # (text, prompt opened <think>, reasoning, content)
    ("<think>\nplan\n</think>\n\nAnswer.", False, "\nplan\n", "Answer."),
    ("plan</think>Answer.", True, "plan", "Answer."),
    ("Just an answer.", False, "", "Just an answer."),
    ("<think>never closed", False, "never closed", ""),
    ("a < b", False, "", "a < b"),
    ("  <thin", False, "", "  <thin"),
    ("</think>", True, "", ""),
]


@pytest.mark.parametrize("text,inside,reason,content", THINK)
@pytest.mark.parametrize("step", [1, 2, 100])
def test_reasoning_split_whole_and_streamed(text, inside, reason, content, step):
    s = reasoning.ThinkStreamer(inside)
    parts = [s.feed(text[i:i + step]) for i in range(0, len(text), step)] + [s.finish()]
    assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == (reason, content)
    assert reasoning.split(text, inside) == (reason, content)


def test_chat_output_splits_reasoning_then_calls():
    text = '<think>need weather</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    msg = ChatOutput(tool_parsers.make("qwen3", TOOLS), think_inside=False).message(text)
    assert msg["content"] is None and msg["reasoning_content"] == "need weather"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("get_weather", W)]
    out = ChatOutput(tool_parsers.make("qwen3", TOOLS), think_inside=False)
    deltas = [d for ch in text for d in out.feed(ch)] + out.finish()
    assert [list(d) for d in deltas if "content" not in d][-1] == ["tool_calls"]
    assert deltas[-1]["tool_calls"][0]["index"] == 0
