"""gpt-oss's harmony format read from a reply's text: its channels split into reasoning, content and tool calls.

A harmony reply is a run of messages, each a header and a body: ``<|channel|>analysis<|message|>...<|end|>``, then
``<|start|>assistant<|channel|>final<|message|>...``; a tool call is a message to a function,
``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`` (the recipient may also stand
before the channel: ``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>``). The generation
prompt ends with ``<|start|>assistant``, so the reply begins with the first message's header.

``HarmonyStreamer(calls)`` takes the text as it streams: ``feed(delta)`` and ``finish()`` each give (reasoning,
content, calls now complete) with calls as (name, arguments as a JSON object's text). The ``analysis`` channel is
reasoning; ``final``, ``commentary`` without a recipient (a preamble the user sees) and any other channel are
content; a body to ``functions.NAME`` is a call (when ``calls``; else its markup stays text). Reasoning and content
pass on at once but for what might be the beginning of a marker; a call is held until it ends. A body ends at
``<|end|>``, ``<|call|>``, ``<|return|>``, the next ``<|start|>`` or the reply's end (``<|call|>`` and
``<|return|>`` are end-of-sequence tokens: the reply's text usually stops before them).

Malformed markup stays text (content): a header that never reaches ``<|message|>``, a header that is not one, a
call whose arguments are not a JSON object or whose recipient is not a function. Text before any header (a reply
that is not harmony) is content.
"""
from __future__ import annotations

import json
import re

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN, START)  # what ends a body
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
FUNCTIONS = "functions."
_HEADER_MAX = 512  # characters a header may run to before the text is taken as not one

_HEADER = re.compile(
    r"\s*(?:assistant)?\s*(?:to=(?P<to1>[^\s<]+))?\s*<\|channel\|>(?P<channel>\w+)\s*(?:to=(?P<to2>[^\s<]+))?"
    r"\s*(?:<\|constrain\|>)?\s*(?P<format>\w+)?\s*")
_HEADS = ("assistant", "to=", CHANNEL)  # what a header (after any <|start|>) begins with


def _header(text: str) -> tuple[str, str | None] | None:
    """(channel, recipient or None) of a header's text, or None where it is not a header."""
    m = _HEADER.fullmatch(text)
    if m is None or (m.group("to1") and m.group("to2")):
        return None
    return m.group("channel"), m.group("to1") or m.group("to2")


def _may_be_header(text: str) -> bool:
    """Whether ``text`` (a header so far, without its ``<|message|>``) may still become a header."""
    if len(text) > _HEADER_MAX or "\n" in text.strip() or any(e in text for e in (END, CALL, RETURN)):
        return False
    head = text.lstrip()
    return any(head.startswith(h) or h.startswith(head) for h in _HEADS)


def _partial_suffix(text: str, markers=MARKERS) -> int:
    """Length of the longest end of ``text`` that is the beginning of a marker."""
    for n in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def arguments(body: str) -> str | None:
    """A call body as a JSON object's text, or None where it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


class HarmonyStreamer:
    """One reply's reader (see the module docstring)."""

    def __init__(self, calls: bool = True):
        self.calls = calls
        self.state = "header"  # header | reasoning | content | call
        self.buf = ""  # text not yet passed on
        self.raw = ""  # the markup of the message being read (its header), given back as text if it is malformed
        self.recipient: str | None = None  # the function a call body is to (None: a message to no function)

    def feed(self, delta: str) -> tuple[str, str, list[tuple[str, str]]]:
        self.buf += delta
        return self._scan(final=False)

    def finish(self) -> tuple[str, str, list[tuple[str, str]]]:
        return self._scan(final=True)

    def _scan(self, final: bool):
        out = {"reasoning": [], "content": [], "calls": []}
        while True:
            more = self._header(out, final) if self.state == "header" else self._body(out, final)
            if not more:
                break
        return "".join(out["reasoning"]), "".join(out["content"]), out["calls"]

    def _header(self, out, final: bool) -> bool:
        """Read a message's header; True when it moved on (a body begins), False when it waits for more text."""
        if self.buf.lstrip().startswith(START):
            cut = self.buf.index(START) + len(START)
            self.raw, self.buf = self.raw + self.buf[:cut], self.buf[cut:]
        i = self.buf.find(MESSAGE)
        head = self.buf if i < 0 else self.buf[:i]
        if i >= 0 and not any(e in head for e in ENDS):
            got = _header(head)
            self.raw += self.buf[:i + len(MESSAGE)]
            self.buf = self.buf[i + len(MESSAGE):]
            if got is None:  # not a header: its text is content, and so is the body
                out["content"].append(self.raw)
                self.raw, self.state = "", "content"
                return True
            channel, to = got
            if to is not None and to.startswith(FUNCTIONS) and len(to) > len(FUNCTIONS) and self.calls:
                self.state, self.recipient = "call", to[len(FUNCTIONS):]
            elif to is not None:  # a call to something other than a function, or calls are not read: text
                self.state, self.recipient = "call", None
            else:
                self.state = "reasoning" if channel == "analysis" else "content"
                self.raw = ""
            return True
        if final:
            if (self.raw + self.buf).strip():
                out["content"].append(self.raw + self.buf)
            self.raw = self.buf = ""
            return False
        if not self.raw and not self.buf.strip():
            return False  # nothing yet (or white space between messages)
        if START.startswith(self.buf.lstrip()) or _may_be_header(head if i >= 0 else self.buf):
            if i < 0:
                return False  # wait for <|message|>
        # not a header: the text so far is content, read as a body
        out["content"].append(self.raw)
        self.raw, self.state = "", "content"
        return True

    def _body(self, out, final: bool) -> bool:
        hits = [(j, e) for e in ENDS if (j := self.buf.find(e)) >= 0]
        j, end = min(hits) if hits else (-1, "")
        if self.state == "call":
            if j < 0 and not final:
                return False  # held until the call ends
            body = self.buf if j < 0 else self.buf[:j]
            args = arguments(body.strip()) if self.recipient is not None else None
            if args is None:  # not a call: all of it is text
                out["content"].append(self.raw + body + (end if end != START else ""))
            else:
                out["calls"].append((self.recipient, args))
            self.raw = ""
        else:
            if j < 0:
                keep = 0 if final else _partial_suffix(self.buf)
                text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                if text:
                    out[self.state].append(text)
                return False
            if self.buf[:j]:
                out[self.state].append(self.buf[:j])
        if j < 0:
            self.buf, self.state = "", "header"
            return False
        # an end marker is dropped; a <|start|> is left for the header to read
        self.buf = self.buf[j + (0 if end == START else len(end)):]
        self.state = "header"
        return True


def split(text: str, calls: bool = True) -> tuple[str, str, list[tuple[str, str]]]:
    """(reasoning, content, calls) of a whole reply."""
    s = HarmonyStreamer(calls)
    r1, c1, k1 = s.feed(text)
    r2, c2, k2 = s.finish()
    return r1 + r2, c1 + c2, k1 + k2
