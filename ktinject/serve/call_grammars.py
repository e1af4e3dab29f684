"""Forced calls for the families whose calls carry their arguments one parameter at a time instead of as one JSON
object (``constraints.forced_call`` uses these): the Qwen3-Coder / Qwen3.5 XML form (``qwen3_coder``), GLM-4.5's
``<arg_key>`` / ``<arg_value>`` pairs (``glm45``), MiniMax-M2's ``<invoke>`` (``minimax_m2``) and Llama 4's pythonic
list (``llama4_pythonic``). Each grammar writes one call in the exact markup its parser (``tool_parsers.py``) reads,
with the parameters of the tool's ``parameters`` schema:

- the schema must be an object's (``type`` ``object`` or none) described by ``properties``, ``required`` and
  ``additionalProperties`` (``$defs`` / ``definitions`` are carried into each parameter's schema, so that their
  ``$ref`` still resolve); other object keywords (``anyOf``, ``patternProperties``, ``minProperties``...) cannot be
  held one parameter at a time and get a RequestError naming them. The call holds every required parameter and
  may hold the optional ones, in the schema's order (Llama 4: the required ones first), and no others.
- in the XML forms a parameter whose schema type is exactly ``"string"`` is written raw, as the parser reads it
  back (``enum`` / ``const``, ``minLength`` / ``maxLength`` and ``pattern`` held; ``format`` is an annotation, as
  JSON Schema validation takes it by default), never holding the markers that would end it early (its closing
  marker, the call's end); any other parameter is JSON for its schema (llguidance's ``%json``), which the parser
  takes as JSON. A JSON string inside such a value (a ``["string", "null"]`` parameter, an object's string
  field) is not kept from holding the closing marker's text: a reply that does so reads as text, not a call.
- in the pythonic form every value is JSON for its schema; the parser reads a value as JSON where it is JSON
  (``true`` / ``false`` / ``null`` included) and as a Python literal otherwise. Names and parameters must be Python
  identifiers (a required one that is not gets a RequestError; an optional one is left out).

A marker that is one special token of the tokenizer is matched as that token (``literal``), else as its text; a
raw value followed by a text marker is one lexeme with it (the value cannot hold the marker, so it ends at its
first occurrence).
"""
from __future__ import annotations

import json
import keyword
from typing import Callable

from ktinject.serve import grammar
from ktinject.serve.errors import RequestError

#: the object keywords a schema may use here (the rest cannot be held one parameter at a time)
_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title", "$schema",
                "$defs", "definitions", "$id", "$comment", "default", "examples", "strict"}
#: the keywords a raw string parameter may use
_STRING_KEYS = {"type", "description", "title", "default", "examples", "minLength", "maxLength", "enum", "const",
                "pattern", "format", "$comment"}
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def _regex_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in _REGEX_META else c for c in text)


def _lark_regex(pattern: str) -> str:
    return "/" + pattern.replace("/", "\\/") + "/"


class _Form:
    """One family's markup (see the module docstring): ``param`` and ``call`` give the grammar's text."""

    #: the marker text a raw value may never hold (the ones after it in the markup)
    ends: tuple[str, ...] = ()
    #: the text that closes a parameter's value
    close = ""
    #: whether a raw value may begin or end with a newline (the parser strips one there)
    edge_newlines = True

    def __init__(self, literal: Callable[[str], str], rule: str):
        self.lit, self.rule, self.rules = literal, rule, []

    def raw_value(self, i: int, schema: dict, param: str) -> str:
        """The rule name of a raw string value followed by this form's ``close``."""
        extra = set(schema) - _STRING_KEYS
        if extra:
            raise RequestError(f"{param}: a string parameter's {', '.join(sorted(extra))} cannot be held in this "
                               f"tool-call format", param=param)
        bad = "(?s:.*)(?:" + "|".join(_regex_escape(e) for e in (self.close.strip(),) + self.ends) + ")(?s:.*)"
        parts = []
        if not self.edge_newlines:
            parts += ["~" + _lark_regex("\\n(?s:.*)"), "~" + _lark_regex("(?s:.*)\\n")]
        choices = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
        if choices is not None:
            strings = [c for c in choices if isinstance(c, str)]
            if not strings:
                raise RequestError(f"{param}: a string parameter's enum holds no string", param=param)
            body = "(" + " | ".join(grammar.lark_string(c) for c in strings) + ")"
        else:
            lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
            body = _lark_regex(f"(?s:.{{{lo},{'' if hi is None else int(hi)}}})")
            pattern = schema.get("pattern")
            if isinstance(pattern, str):
                head = "" if pattern.startswith("^") else "(?s:.*)"
                tail = "" if pattern.endswith("$") and not pattern.endswith("\\$") else "(?s:.*)"
                core = pattern[1 if not head else 0:len(pattern) - (0 if tail else 1)]
                parts.append(_lark_regex(f"{head}(?:{core}){tail}"))
        value = " & ".join([body, "~" + _lark_regex(bad)] + parts)
        lead, text = self._close_parts()
        close, name = self.lit(text), f"{self.rule.upper()}_V{i}"
        tail = grammar.lark_string(lead) if lead else ""
        if close.startswith("<["):  # a special token: the value's lexeme ends where it comes
            self.rules.append(f"{name}: ({value}) {tail}\n")
            return f"{name} {close}"
        self.rules.append(f"{name}: ({value}) {grammar.lark_string(lead + text)}\n")
        return name

    def _close_parts(self) -> tuple[str, str]:
        """``close`` as (its leading newline(s), its marker)."""
        text = self.close.lstrip()
        return self.close[:len(self.close) - len(text)], text

    def json_value(self, i: int, schema: dict) -> str:
        name = f"{self.rule}_j{i}"
        self.rules.append(f"{name}: %json {json.dumps(grammar.with_options(schema), ensure_ascii=False)}\n")
        return name

    def value(self, i: int, schema: dict, param: str) -> str:
        if schema.get("type") == "string":
            return self.raw_value(i, schema, param)
        return f"{self.json_value(i, schema)} {self.closing()}"

    def closing(self) -> str:
        lead, text = self._close_parts()
        return f"{grammar.lark_string(lead)} {self.lit(text)}" if lead else self.lit(text)


class _Qwen3Coder(_Form):
    """``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>``."""

    ends = ("</tool_call>",)
    close = "\n</parameter>"

    def param(self, key: str, value: str) -> str:
        return f'{self.lit("<parameter=")} {grammar.lark_string(key)} {grammar.lark_string(">")} ' \
               f'{grammar.lark_string(chr(10))} {value} {grammar.lark_string(chr(10))}'

    def call(self, name: str, params: str) -> str:
        return (f'{self.lit("<tool_call>")} {grammar.lark_string(chr(10))} {self.lit("<function=")} '
                f'{grammar.lark_string(name + ">" + chr(10))} {params} {self.lit("</function>")} '
                f'{grammar.lark_string(chr(10))} {self.lit("</tool_call>")}')


class _Glm45(_Form):
    """``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>``."""

    ends = ("</tool_call>",)
    close = "</arg_value>"

    def param(self, key: str, value: str) -> str:
        return (f'{self.lit("<arg_key>")} {grammar.lark_string(key)} {self.lit("</arg_key>")} '
                f'{grammar.lark_string(chr(10))} {self.lit("<arg_value>")} {value} {grammar.lark_string(chr(10))}')

    def call(self, name: str, params: str) -> str:
        return f'{self.lit("<tool_call>")} {grammar.lark_string(name + chr(10))} {params} {self.lit("</tool_call>")}'


class _MiniMaxM2(_Form):
    """``<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="K">V</parameter>\\n</invoke>\\n
    </minimax:tool_call>``."""

    ends = ("</invoke>", "</minimax:tool_call>")
    close = "</parameter>"
    edge_newlines = False

    def param(self, key: str, value: str) -> str:
        head = '<parameter name="' + key + '">'
        return f"{grammar.lark_string(head)} {value} {grammar.lark_string(chr(10))}"

    def call(self, name: str, params: str) -> str:
        head = '\n<invoke name="' + name + '">\n'
        return (f'{self.lit("<minimax:tool_call>")} {grammar.lark_string(head)} {params} '
                f'{grammar.lark_string("</invoke>" + chr(10))} {self.lit("</minimax:tool_call>")}')


XML_FORMS = {"qwen3_coder": _Qwen3Coder, "glm45": _Glm45, "minimax_m2": _MiniMaxM2}


def _parameters(schema: dict, parser: str, param: str) -> list[tuple[str, dict, bool]]:
    """(name, schema, required) of each parameter of a tool's ``parameters`` schema, in its order (see the module
    docstring); RequestError where the schema cannot be held one parameter at a time."""
    extra = set(schema) - _OBJECT_KEYS
    if extra or schema.get("type", "object") != "object":
        what = ", ".join(sorted(extra)) if extra else f"type {schema.get('type')!r}"
        raise RequestError(f"{param}: the tool's parameters use {what}, which a forced call in the {parser} format "
                           f"cannot hold (it holds an object's properties, required and additionalProperties)",
                           param=param)
    props = schema.get("properties") or {}
    required = list(schema.get("required") or ())
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    out = [(k, {**v, **defs} if defs and isinstance(v, dict) else v, k in required) for k, v in props.items()]
    out += [(k, {**defs}, True) for k in required if k not in props]
    for k, v, _ in out:
        if not isinstance(v, dict):
            raise RequestError(f"{param}: the schema of parameter {k!r} is not an object", param=param)
    return out


def xml_call(parser: str, rule: str, name: str, schema: dict, literal: Callable[[str], str], param: str) -> str:
    """The rules of one call of the tool ``name`` in an XML form (``XML_FORMS``), the call's rule named ``rule``."""
    form = XML_FORMS[parser](literal, rule)
    params = []
    for i, (key, sub, required) in enumerate(_parameters(schema, parser, param)):
        if any(c in key for c in "<>\n\"") or not key.strip() or key != key.strip():
            raise RequestError(f"{param}: parameter name {key!r} cannot be written in the {parser} format",
                               param=param)
        one = form.param(key, form.value(i, sub, param))
        params.append(one if required else f"({one})?")
    if any(c in name for c in "<>\n\"") or name != name.strip() or not name:
        raise RequestError(f"{param}: tool name {name!r} cannot be written in the {parser} format", param=param)
    body = " ".join(params) if params else '""'
    return f"{rule}: {form.call(name, body)}\n" + "".join(form.rules)


def pythonic_call(rule: str, name: str, schema: dict, param: str) -> str:
    """The rules of one call ``[name(k=v, ...)]`` of Llama 4's pythonic form, the call's rule named ``rule``."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise RequestError(f"{param}: tool name {name!r} is not a Python identifier, which Llama 4's pythonic "
                           f"calls need", param=param)
    required, optional, rules = [], [], []
    for i, (key, sub, req) in enumerate(_parameters(schema, "llama4_pythonic", param)):
        if not key.isidentifier() or keyword.iskeyword(key):
            if req:
                raise RequestError(f"{param}: parameter name {key!r} is not a Python identifier, which Llama 4's "
                                   f"pythonic calls need", param=param)
            continue
        rules.append(f"{rule}_j{i}: %json {json.dumps(grammar.with_options(sub), ensure_ascii=False)}\n")
        (required if req else optional).append(f'{grammar.lark_string(key + "=")} {rule}_j{i}')
    sep = grammar.lark_string(", ")
    if required:
        args = f" {sep} ".join(required) + "".join(f" ({sep} {o})?" for o in optional)
    elif optional:  # any subset in order: the first one held, then each later one or not
        firsts = [o + "".join(f" ({sep} {later})?" for later in optional[j + 1:]) for j, o in enumerate(optional)]
        args = "(" + " | ".join(f"({f})" for f in firsts) + ")?"
    else:
        args = '""'
    return f'{rule}: {grammar.lark_string("[" + name + "(")} {args} {grammar.lark_string(")]")}\n' + "".join(rules)
