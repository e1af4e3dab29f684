"""A chat reply's text made into OpenAI's message parts: reasoning split off first (``reasoning.py``), then tool
calls parsed out of the content (``tool_parsers.py``). ``ChatOutput.feed(delta)`` and ``finish()`` give the stream's
deltas (``{"reasoning_content": ...}``, ``{"content": ...}``, ``{"tool_calls": [...]}``); ``message(text)`` the whole
reply's message fields. Either part may be off (None). ``chat_parsers``: which parts a server's model gets.
"""
from __future__ import annotations

from ktinject.serve import reasoning, tool_parsers
from ktinject.serve.reasoning import ThinkStreamer
from ktinject.serve.tool_parsers import ToolParser


class ChatOutput:
    def __init__(self, tool_parser: ToolParser | None = None, think_inside: bool | None = None):
        """``think_inside``: None, no reasoning split; else whether the prompt opened a ``<think>`` block."""
        self.think = None if think_inside is None else ThinkStreamer(think_inside)
        self.tools = tool_parser.streamer() if tool_parser is not None else None
        self.calls = 0

    def feed(self, delta: str) -> list[dict]:
        return self._parts(*(self.think.feed(delta) if self.think else ("", delta)), final=False)

    def finish(self) -> list[dict]:
        return self._parts(*(self.think.finish() if self.think else ("", "")), final=True)

    def _parts(self, reasoning: str, content: str, final: bool) -> list[dict]:
        out = [{"reasoning_content": reasoning}] if reasoning else []
        calls = []
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
    """(the tool-call parser's name or None, whether replies are split at <think>) for ``engine``'s model: "auto"
    chooses by the model's ``config.model_type``; ValueError for a name that is no parser."""
    model_type = getattr(getattr(getattr(engine, "model", None), "config", None), "model_type", None)
    tools = None if tool_call_parser in (None, "none") else (
        tool_parsers.for_model_type(model_type) if tool_call_parser == "auto"
        else tool_parsers.parser_name(tool_call_parser))
    if reasoning_parser not in (None, "none", "auto", "think"):
        raise ValueError(f"no reasoning parser {reasoning_parser!r}; choose think, auto or none")
    think = reasoning_parser == "think" or (reasoning_parser == "auto" and
                                            reasoning.for_model_type(model_type) is not None)
    return tools, think
