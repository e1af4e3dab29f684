"""A chat reply's text made into OpenAI's message parts: reasoning split off first (``reasoning.py``), then tool
calls parsed out of the content (``tool_parsers.py``). ``ChatOutput.feed(delta)`` and ``finish()`` give the stream's
deltas (``{"reasoning_content": ...}``, ``{"content": ...}``, ``{"tool_calls": [...]}``); ``message(text)`` the whole
reply's message fields. Either part may be off (None). ``chat_parsers``: which parts a server's model gets.

A harmony reply (gpt-oss, ``harmony=True``) is read by ``harmony.HarmonyStreamer`` instead, which gives all three
parts at once (its calls only where a tool parser is on; else their markup stays text).
"""
from __future__ import annotations

from ktinject.serve import harmony as harmony_format
from ktinject.serve import reasoning, tool_parsers
from ktinject.serve.reasoning import ThinkStreamer
from ktinject.serve.tool_parsers import ToolCall, ToolParser


class ChatOutput:
    def __init__(self, tool_parser: ToolParser | None = None, think_inside: bool | None = None,
                 harmony: bool = False):
        """``think_inside``: None, no reasoning split; else whether the prompt opened a ``<think>`` block.
        ``harmony``: the reply is in harmony's channels (then ``think_inside`` is not used, and ``tool_parser``
        only says whether calls are read)."""
        self.harmony = harmony_format.HarmonyStreamer(calls=tool_parser is not None) if harmony else None
        self.think = None if think_inside is None or harmony else ThinkStreamer(think_inside)
        self.tools = tool_parser.streamer() if tool_parser is not None and not harmony else None
        self.calls = 0

    def feed(self, delta: str) -> list[dict]:
        if self.harmony is not None:
            return self._harmony(self.harmony.feed(delta))
        return self._parts(*(self.think.feed(delta) if self.think else ("", delta)), final=False)

    def finish(self) -> list[dict]:
        if self.harmony is not None:
            return self._harmony(self.harmony.finish())
        return self._parts(*(self.think.finish() if self.think else ("", "")), final=True)

    def _harmony(self, got) -> list[dict]:
        reasoning, content, calls = got
        return self._parts(reasoning, content, final=False, calls=[ToolCall(n, a) for n, a in calls])

    def _parts(self, reasoning: str, content: str, final: bool, calls=()) -> list[dict]:
        out = [{"reasoning_content": reasoning}] if reasoning else []
        calls = list(calls)
        if self.tools is not None:
            text, calls = self.tools.feed(content) if content else ("", [])
            if final:
                more, rest = self.tools.finish()
                text, calls = text + more, calls + rest
            content = text
        if content:
            out.append({"content": content})
        if calls:
            out.append({"tool_calls": [c.openai(self.calls + i) for i, c in enumerate(calls)]})
            self.calls += len(calls)
        return out

    def message(self, text: str) -> dict:
        """The whole reply's message: content (None when there are calls and no text), reasoning_content, tool_calls."""
        parts = self.feed(text) + self.finish()
        content = "".join(p.get("content", "") for p in parts)
        thought = "".join(p.get("reasoning_content", "") for p in parts)
        calls = [{k: v for k, v in c.items() if k != "index"} for p in parts for c in p.get("tool_calls", ())]
        msg = {"role": "assistant", "content": content if content or not calls else None}
        if thought:
            msg["reasoning_content"] = thought
        if calls:
            msg["tool_calls"] = calls
        return msg


def chat_parsers(engine, tool_call_parser: str | None, reasoning_parser: str | None):
    """(the tool-call parser's name or None, the reasoning parser's: ``"think"``, ``"harmony"`` or None) for
    ``engine``'s model: "auto" chooses by the model's ``config.model_type``; ValueError for a name that is no
    parser, or for harmony reasoning with another family's tool calls."""
    model_type = getattr(getattr(getattr(engine, "model", None), "config", None), "model_type", None)
    tools = None if tool_call_parser in (None, "none") else (
        tool_parsers.for_model_type(model_type) if tool_call_parser == "auto"
        else tool_parsers.parser_name(tool_call_parser))
    if reasoning_parser not in (None, "none", "auto") + reasoning.PARSERS:
        raise ValueError(f"no reasoning parser {reasoning_parser!r}; choose {', '.join(reasoning.PARSERS)}, auto "
                         f"or none")
    think = reasoning.for_model_type(model_type) if reasoning_parser == "auto" else (
        None if reasoning_parser in (None, "none") else reasoning_parser)
    if think == "harmony" and tool_call_parser == "auto":
        tools = "harmony"  # harmony's calls are in its channels, whatever the model's type says
    if think == "harmony" and tools not in (None, "harmony"):
        raise ValueError(f"harmony replies carry their tool calls in harmony's channels: the {tools} tool-call "
                         f"parser cannot read them (use --tool-call-parser harmony, auto or none)")
    return tools, think


def harmony_replies(tool_parser: str | None, reasoning_parser: str | None) -> bool:
    """Whether replies are read as harmony (either parser, as ``chat_parsers`` chose them, is harmony's)."""
    return "harmony" in (tool_parser, reasoning_parser)
