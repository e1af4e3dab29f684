"""Tool calls in a model's output text, per family: pure functions of the text, no tokenizer, no engine.

Every family's parser has one interface: ``parse(text) -> (content, calls)`` for a whole reply, and ``streamer()``
for one streamed reply, whose ``feed(delta) -> (content, calls)`` passes text on at once except what might be the
start of a call (held back until it is a complete call or plainly text), and whose ``finish()`` gives what is left.
A call block is found by the family's ``block`` pattern (from one of its ``starts`` markers to its end marker) and
decoded by ``decode``; a block that does not decode (bad JSON, no name) stays text, as does a block never closed.
Markers that only wrap a section of calls (``drops``) leave the content once found.

Families (``PARSERS``; chosen from the model type by ``for_model_type``, first match of ``MODEL_TYPES`` wins):
``qwen3`` (``<tool_call>{json}</tool_call>``, and Qwen3-Coder / Qwen3.5's ``<tool_call><function=..><parameter=..>``
inside the same markers; ``qwen3_coder`` reads the same, its forced calls are the XML form), ``deepseek_v3``
(V3 / R1 and V3.1 forms), ``glm45`` (``<arg_key>``/``<arg_value>``),
``kimi_k2``, ``minimax_m2`` (``<invoke name=..>``), ``llama4_pythonic`` (``[f(a=1)]`` as the whole reply),
``harmony`` (gpt-oss: ``<|channel|>commentary to=functions.NAME ...<|message|>{json}<|call|>``, read by
``harmony.py``, which also splits the reply's reasoning off: a chat reply gets all of it from ``chat_output``).
"""
from __future__ import annotations

import ast
import json
import re
import uuid
import warnings
from dataclasses import dataclass, field

from ktinject.serve import harmony


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's ``name``, its ``arguments`` as a JSON object's text, and the call's ``id``."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}", compare=False)

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _args(value) -> str | None:
    """A call's arguments as JSON text, or None where they are not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _param_types(tools) -> dict[str, dict[str, str]]:
    """function name -> parameter name -> its JSON-schema type (where the tool says one)."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            props = (fn.get("parameters") or {}).get("properties") or {}
            out[fn["name"]] = {k: v.get("type") for k, v in props.items() if isinstance(v, dict)} \
                if isinstance(props, dict) else {}
    return out


class ToolParser:
    """One family's parser (see the module docstring); ``tools``: the request's tools (the XML forms read each
    parameter's schema type: a string parameter stays a string, others are taken as JSON where they parse)."""

    name = ""
    starts: tuple[str, ...] = ()
    drops: tuple[str, ...] = ()
    block: re.Pattern

    def __init__(self, tools=None):
        self.types = _param_types(tools)

    def decode(self, match: re.Match) -> list[ToolCall] | None:
        raise NotImplementedError

    def value(self, function: str, param: str, raw: str):
        """A parameter's value from the XML forms: by its schema type, else JSON where it parses, else the text."""
        kind = self.types.get(function, {}).get(param)
        if kind == "string":
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            return raw

    # ---- whole replies ---------------------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the text that is not a call, the calls in order)."""
        s = self.streamer()
        content, calls = s.feed(text)
        more, rest = s.finish()
        return content + more, calls + rest

    def streamer(self) -> "ToolStreamer":
        return ToolStreamer(self)

    def match_at(self, text: str, i: int, final: bool) -> re.Match | None:
        """The block that starts at ``text[i]`` (a start marker), or None while it is not complete."""
        return self.block.match(text, i)


class ToolStreamer:
    """The calls of one streamed reply (``ToolParser.streamer``): ``feed(delta)`` and ``finish()`` each return
    (content to send now, calls complete now)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.buf = ""  # text not yet passed on: from a marker (or a possible beginning of one) on
        self.calls = 0
        self.markers = parser.starts + parser.drops

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buf += delta
        return self._scan(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = self._scan(final=True)
        content, self.buf = content + self.buf, ""
        return content, calls

    def _scan(self, final: bool) -> tuple[str, list[ToolCall]]:
        out, calls, p = [], [], self.parser
        while self.buf:
            hits = [(i, m) for m in self.markers if (i := self.buf.find(m)) >= 0]
            if not hits:
                keep = 0 if final else _partial_suffix(self.buf, self.markers)
                out.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            i, marker = min(hits, key=lambda h: (h[0], -len(h[1])))
            out.append(self.buf[:i])
            self.buf = self.buf[i:]
            if marker in p.drops:
                self.buf = self.buf[len(marker):]
                continue
            m = p.match_at(self.buf, 0, final)
            if m is None:
                if not final:
                    break  # an open block: held until it closes or the reply ends
                out.append(marker)  # never closed: text
                self.buf = self.buf[len(marker):]
                continue
            got = p.decode(m)
            if got is None:
                out.append(m.group(0))  # malformed: stays text
            else:
                calls.extend(got)
            self.buf = self.buf[m.end():]
        self.calls += len(calls)
        return "".join(out), calls


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is the beginning of a marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


# ---- families ------------------------------------------------------------------------------------------------
_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


class Qwen3ToolParser(ToolParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen3, Hermes), or inside the same
    markers Qwen3-Coder / Qwen3.5's ``<function=NAME><parameter=KEY>\\nVALUE\\n</parameter></function>``."""

    name = "qwen3"
    starts = ("<tool_call>",)
    block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def decode(self, match):
        body = match.group(1)
        if body.startswith("<function="):
            return self.decode_xml(body)
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = _args(obj.get("arguments", obj.get("parameters", {})))
        return None if args is None else [ToolCall(obj["name"], args)]

    def decode_xml(self, body: str) -> list[ToolCall] | None:
        m = _XML_FUNCTION.fullmatch(body.strip())
        if m is None:
            return None
        name = m.group(1).strip()
        params = {k.strip(): self.value(name, k.strip(), v) for k, v in _XML_PARAM.findall(m.group(2))}
        return [ToolCall(name, json.dumps(params, ensure_ascii=False))]


class Qwen3CoderToolParser(Qwen3ToolParser):
    """Qwen3-Coder / Qwen3.5: read as ``qwen3`` reads (both forms); its forced calls are written in the XML form."""

    name = "qwen3_coder"


class DeepSeekV3ToolParser(ToolParser):
    """DeepSeek-V3 / R1: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``;
    V3.1: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``; calls inside
    ``<｜tool▁calls▁begin｜>`` ... ``<｜tool▁calls▁end｜>``."""

    name = "deepseek_v3"
    starts = ("<｜tool▁call▁begin｜>",)
    drops = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    block = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S)
    _fenced = re.compile(r"\s*([^\n`]+?)\s*\n```(?:json)?\s*(.*?)\s*```\s*", re.S)

    def decode(self, match):
        kind, rest = match.group(1).strip(), match.group(2)
        if kind == "function":  # V3 / R1
            m = self._fenced.fullmatch(rest)
            if m is None:
                return None
            name, args = m.group(1), _args(m.group(2))
        else:  # V3.1
            name, args = kind, _args(rest.strip())
        return None if args is None or not name else [ToolCall(name, args)]


class Glm45ToolParser(ToolParser):
    """GLM-4.5 / 4.6 / 4.7: ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>``."""

    name = "glm45"
    starts = ("<tool_call>",)
    block = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
    _pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def decode(self, match):
        body = match.group(1)
        cut = body.find("<arg_key>")
        name = (body if cut < 0 else body[:cut]).strip()
        rest = "" if cut < 0 else body[cut:]
        if not name or "<" in name or self._pair.sub("", rest).strip():
            return None
        args = {k.strip(): self.value(name, k.strip(), v) for k, v in self._pair.findall(rest)}
        return [ToolCall(name, json.dumps(args, ensure_ascii=False))]


class KimiK2ToolParser(ToolParser):
    """Kimi-K2: ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>`` inside
    ``<|tool_calls_section_begin|>`` ... ``<|tool_calls_section_end|>``; the call's id is the model's
    ``functions.NAME:IDX``."""

    name = "kimi_k2"
    starts = ("<|tool_call_begin|>",)
    drops = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    block = re.compile(r"<\|tool_call_begin\|>\s*([^<]+?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
                       re.S)

    def decode(self, match):
        call_id, args = match.group(1), _args(match.group(2).strip())
        name = call_id.split(":", 1)[0]
        name = name.split(".", 1)[1] if name.startswith("functions.") else name
        return None if args is None or not name else [ToolCall(name, args, id=call_id)]


class MiniMaxM2ToolParser(ToolParser):
    """MiniMax-M2: ``<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter></invoke>...
    </minimax:tool_call>`` (one block, any number of invokes)."""

    name = "minimax_m2"
    starts = ("<minimax:tool_call>",)
    block = re.compile(r"<minimax:tool_call>(.*?)</minimax:tool_call>", re.S)
    _invoke = re.compile(r"<invoke name=\"?([^\">]+)\"?>(.*?)</invoke>", re.S)
    _param = re.compile(r"<parameter name=\"?([^\">]+)\"?>\n?(.*?)\n?</parameter>", re.S)

    def decode(self, match):
        body = match.group(1)
        if not body.strip() or self._invoke.sub("", body).strip():
            return None
        calls = []
        for name, inner in self._invoke.findall(body):
            name = name.strip()
            args = {k.strip(): self.value(name, k.strip(), v) for k, v in self._param.findall(inner)}
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls


class Llama4PythonicToolParser(ToolParser):
    """Llama 4: the whole reply is a Python list of calls, ``[get_weather(city="Paris"), f(n=1)]`` (optionally in
    ``<|python_start|>`` ... ``<|python_end|>``), arguments literals; found only once the reply has ended."""

    name = "llama4_pythonic"
    starts = ("[", "<|python_start|>")
    block = re.compile(r"(?:<\|python_start\|>)?\s*(\[.*\])\s*(?:<\|python_end\|>)?\s*\Z", re.S)

    def streamer(self):
        return _WholeReplyStreamer(self)

    def decode(self, match):
        try:
            with warnings.catch_warnings():  # a JSON string's escapes ("\\/") are no Python escapes
                warnings.simplefilter("ignore", (SyntaxWarning, DeprecationWarning))
                tree = ast.parse(match.group(1), mode="eval").body
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
                return None
            try:
                args = {kw.arg: self._literal(match.group(1), kw.value) for kw in node.keywords}
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
            if None in args:
                return None
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        return calls


    @staticmethod
    def _literal(source: str, node):
        """A keyword's value: JSON where its text is JSON (``true``, ``null``, JSON's escapes), else a Python
        literal."""
        text = ast.get_source_segment(source, node)
        try:
            return json.loads(text)
        except (ValueError, TypeError):
            return ast.literal_eval(node)


class _WholeReplyStreamer(ToolStreamer):
    """A reply that is all calls or all text (Llama 4's pythonic form): held back while it begins as a call might,
    decided when it ends."""

    def feed(self, delta):
        self.buf += delta
        head = self.buf.lstrip()
        if self.calls < 0 or not any(head.startswith(m) or m.startswith(head) for m in self.parser.starts):
            self.calls, out, self.buf = -1, self.buf, ""  # plainly text from here on
            return out, []
        return "", []

    def finish(self):
        text, self.buf = self.buf, ""
        m = self.parser.block.fullmatch(text.strip()) if text.strip() else None
        got = self.parser.decode(m) if m else None
        return ("", got) if got else (text, [])


class HarmonyToolParser(ToolParser):
    """gpt-oss's harmony channels (``harmony.py``): calls are the messages to ``functions.NAME``; content is the
    ``final`` and ``commentary`` channels' text (the ``analysis`` channel is reasoning, not content: this interface
    has no place for it, ``harmony.split`` and ``chat_output.ChatOutput`` keep it)."""

    name = "harmony"

    def streamer(self):
        return _HarmonyToolStreamer()


class _HarmonyToolStreamer:
    """``ToolStreamer``'s interface on ``harmony.HarmonyStreamer`` (the reasoning left out)."""

    def __init__(self):
        self.reader = harmony.HarmonyStreamer(calls=True)
        self.calls = 0

    def _out(self, got) -> tuple[str, list[ToolCall]]:
        _, content, calls = got
        self.calls += len(calls)
        return content, [ToolCall(name, args) for name, args in calls]

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        return self._out(self.reader.feed(delta))

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._out(self.reader.finish())


#: every parser, by the name ``--tool-call-parser`` takes
PARSERS: dict[str, type[ToolParser]] = {c.name: c for c in (
    Qwen3ToolParser, Qwen3CoderToolParser, DeepSeekV3ToolParser, Glm45ToolParser, KimiK2ToolParser, MiniMaxM2ToolParser,
    Llama4PythonicToolParser, HarmonyToolParser)}
ALIASES = {"hermes": "qwen3", "qwen3_xml": "qwen3_coder", "glm47": "glm45",
           "llama4": "llama4_pythonic", "gpt_oss": "harmony", "openai": "harmony"}

#: model_type prefix -> parser (first match wins)
MODEL_TYPES = (("qwen3_5", "qwen3_coder"), ("qwen", "qwen3"), ("deepseek", "deepseek_v3"), ("kimi", "kimi_k2"),
               ("glm4_moe", "glm45"), ("glm", "glm45"), ("minimax", "minimax_m2"), ("llama4", "llama4_pythonic"),
               ("mimo", "qwen3"), ("gpt_oss", "harmony"))


def parser_name(name: str) -> str:
    """The parser ``name`` (an alias too) stands for; ValueError naming the choices when there is none."""
    key = ALIASES.get(name, name)
    if key not in PARSERS:
        raise ValueError(f"no tool-call parser {name!r}; choose one of {', '.join(sorted(PARSERS))} (or none)")
    return key


def for_model_type(model_type: str | None) -> str | None:
    """The parser of a model type (``config.model_type``), or None where no family matches."""
    t = (model_type or "").lower()
    return next((p for prefix, p in MODEL_TYPES if t.startswith(prefix)), None)


def make(name: str, tools=None) -> ToolParser:
    return PARSERS[parser_name(name)](tools)
