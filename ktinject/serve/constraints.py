"""What a request's reply is held to, as a grammar (``grammar.py``): ``response_format``'s JSON (``json_object``,
``json_schema``) and a forced tool call (OpenAI's ``tool_choice`` ``"required"`` or a named function, Anthropic's
``any`` or a named tool), written in the family's call markup so that its tool-call parser (``tool_parsers.py``)
reads the reply back as one call, with arguments valid for the tool's ``parameters`` schema.

Forced calls exist for the families whose calls carry JSON arguments (``FORCED``): ``qwen3``
(``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``), ``deepseek_v3`` (V3.1's form: the name,
``<｜tool▁sep｜>`` and the arguments in one call block, inside the calls markers), ``kimi_k2`` and ``harmony``
(gpt-oss: ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}``, the reply's first message;
the call's end, ``<|call|>``, is an end-of-sequence token that follows the finished grammar). The families whose
calls carry their arguments one parameter at a time (``PER_PARAMETER``: ``qwen3_coder``, ``glm45``, ``minimax_m2``,
``llama4_pythonic``) get their grammars from ``call_grammars.py``. A marker that is one special token of the
tokenizer is matched as that token (``literal``: the grammar's text of a marker), else as its text.

Where the prompt opened a reasoning block (``think``: the template ended it with ``<think>``), the grammar lets the
reasoning run up to the first ``</think>`` and holds what follows; otherwise it holds the reply from its first token.
"""
from __future__ import annotations

import json
from typing import Callable

from ktinject.serve import call_grammars, grammar
from ktinject.serve.errors import RequestError

#: the reasoning a prompt opened, up to its end (llguidance's lazy rule: the shortest text that ends with it)
_THINK = 'think[lazy]: /(?s:.*)<\\/think>/'


def _start(body: str, think: bool) -> str:
    return f"start: think /\\n*/ {body}\n{_THINK}\n" if think else f"start: {body}\n"


def _json_rule(name: str, schema: dict) -> str:
    return f"{name}: %json {json.dumps(grammar.with_options(schema), ensure_ascii=False)}\n"


def response_format(value, think: bool = False) -> str | None:
    """The grammar of OpenAI's ``response_format`` (a dict the protocol checked the shape of), None for text."""
    kind = value.get("type")
    if kind == "text":
        return None
    param = "response_format"
    grammar.require(param)
    if kind == "json_object":
        schema = {"type": "object"}
    else:
        spec = value.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError(f"{param}.json_schema.schema: expected a JSON schema object", param=param)
    return grammar.lark(_start("value", think) + _json_rule("value", schema), param)


def _tool_schema(tool: dict) -> dict:
    schema = tool["function"].get("parameters")
    return schema if isinstance(schema, dict) and schema else {"type": "object", "properties": {}}


def _qwen3(name: str, lit) -> tuple[str, str]:
    return (lit("<tool_call>") + " " + grammar.lark_string(f'\n{{"name": {json.dumps(name, ensure_ascii=False)}, '
                                                           f'"arguments": '),
            grammar.lark_string("}\n") + " " + lit("</tool_call>"))


def _deepseek_v3(name: str, lit) -> tuple[str, str]:
    return (f'{lit("<｜tool▁calls▁begin｜>")} {lit("<｜tool▁call▁begin｜>")} {grammar.lark_string(name)} '
            f'{lit("<｜tool▁sep｜>")}', f'{lit("<｜tool▁call▁end｜>")} {lit("<｜tool▁calls▁end｜>")}')


def _kimi_k2(name: str, lit) -> tuple[str, str]:
    return (f'{lit("<|tool_calls_section_begin|>")} {lit("<|tool_call_begin|>")} '
            f'{grammar.lark_string(f"functions.{name}:0")} {lit("<|tool_call_argument_begin|>")}',
            f'{lit("<|tool_call_end|>")} {lit("<|tool_calls_section_end|>")}')


def _harmony(name: str, lit) -> tuple[str, str]:
    return (f'{lit("<|channel|>")} {grammar.lark_string(f"commentary to=functions.{name} ")} {lit("<|constrain|>")} '
            f'{grammar.lark_string("json")} {lit("<|message|>")}', "")


#: parser -> (tool name, literal) -> (the grammar before a call's JSON arguments, after them)
FORCED: dict[str, Callable] = {"qwen3": _qwen3, "deepseek_v3": _deepseek_v3, "kimi_k2": _kimi_k2, "harmony": _harmony}
#: the parsers whose forced calls come one parameter at a time (``call_grammars.py``)
PER_PARAMETER = (*call_grammars.XML_FORMS, "llama4_pythonic")


def forced_call(parser: str | None, tools: list[dict], name: str | None, literal: Callable[[str], str],
                think: bool = False, param: str = "tool_choice") -> str:
    """The grammar of one call of the tool ``name`` (None: any of ``tools``, OpenAI's tool functions) in the markup
    of ``parser`` (a tool-call parser's name); RequestError naming ``param`` where no call can be forced."""
    grammar.require(param)
    if parser is None:
        raise RequestError(f"{param}: a forced tool call needs a tool-call parser for this model "
                           f"(--tool-call-parser)", param=param)
    if parser not in FORCED and parser not in PER_PARAMETER:
        raise RequestError(f"{param}: forced tool calls are not supported for the {parser} tool-call parser (they are "
                           f"for {', '.join(sorted((*FORCED, *PER_PARAMETER)))}); use \"auto\"", param=param)
    if not tools:
        raise RequestError(f"{param}: a forced tool call needs tools", param=param)
    names = [t["function"]["name"] for t in tools]
    if name is not None and name not in names:
        raise RequestError(f"{param}: no tool named {name!r} in tools (there are {', '.join(map(repr, names))})",
                           param=param)
    picked = [t for t in tools if name is None or t["function"]["name"] == name]
    rules, calls = [], []
    for i, tool in enumerate(picked):
        fn, schema = tool["function"]["name"], _tool_schema(tool)
        calls.append(f"call{i}")
        if parser == "llama4_pythonic":
            rules.append(call_grammars.pythonic_call(f"call{i}", fn, schema, param))
        elif parser in call_grammars.XML_FORMS:
            rules.append(call_grammars.xml_call(parser, f"call{i}", fn, schema, literal, param))
        else:
            before, after = FORCED[parser](fn, literal)
            rules.append(f"call{i}: {before} args{i} {after}\n" + _json_rule(f"args{i}", schema))
    return grammar.lark(_start(" | ".join(calls) if len(calls) == 1 else f"({' | '.join(calls)})", think)
                        + "".join(rules), param)
