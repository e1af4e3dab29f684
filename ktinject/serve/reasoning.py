"""A thinking model's reasoning split from its answer: ``<think>`` ... ``</think>`` blocks, pure text functions.

``ThinkStreamer(inside)`` takes a reply's text as it streams (``feed(delta) -> (reasoning, content)``, ``finish()``);
``inside``: the prompt already opened the block (templates of Qwen3.5, Qwen3 thinking-2507, DeepSeek-V3.1,
MiniMax-M2 end their generation prompt with ``<think>``), so the reply starts as reasoning until ``</think>``.
Otherwise a reply that begins with ``<think>`` (after white space) reasons until ``</think>``; any other reply is all
content. Text that might be the beginning of a marker is held back until the next delta decides.

gpt-oss reasons in harmony's ``analysis`` channel instead (``harmony.py``): ``for_model_type`` names its parser
``"harmony"``.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"

#: model_type prefixes of the families that think in <think> blocks
THINKING_TYPES = ("qwen3", "deepseek", "glm4_moe", "glm", "minimax", "kimi", "mimo")
#: model_type prefixes of the families that reason in harmony's analysis channel
HARMONY_TYPES = ("gpt_oss",)
#: the reasoning parsers, by the name ``--reasoning-parser`` takes
PARSERS = ("think", "harmony")


def for_model_type(model_type: str | None) -> str | None:
    """``"think"`` for a family that reasons in ``<think>`` blocks, ``"harmony"`` for harmony's channels, else
    None."""
    t = (model_type or "").lower()
    if any(t.startswith(p) for p in HARMONY_TYPES):
        return "harmony"
    return "think" if any(t.startswith(p) for p in THINKING_TYPES) else None


def prompt_opens_think(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves the reply inside a ``<think>`` block."""
    return prompt_text.rstrip().endswith(OPEN)


class ThinkStreamer:
    def __init__(self, inside: bool = False):
        self.state = "reasoning" if inside else "start"
        self.buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning = []
        if self.state == "start":
            head = self.buf.lstrip()
            if OPEN.startswith(head):
                return "", ""  # (the beginning of <think>, or nothing yet)
            if head.startswith(OPEN):
                self.state, self.buf = "reasoning", head[len(OPEN):]
            else:
                self.state = "content"
        if self.state == "reasoning":
            i = self.buf.find(CLOSE)
            if i < 0:
                keep = next((n for n in range(min(len(CLOSE) - 1, len(self.buf)), 0, -1)
                             if self.buf.endswith(CLOSE[:n])), 0)
                out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return out, ""
            reasoning.append(self.buf[:i])
            self.state, self.buf = "after", self.buf[i + len(CLOSE):]
        if self.state == "after":  # the white space between </think> and the answer is neither
            self.buf = self.buf.lstrip()
            if not self.buf:
                return "".join(reasoning), ""
            self.state = "content"
        out, self.buf = self.buf, ""
        return "".join(reasoning), out

    def finish(self) -> tuple[str, str]:
        out, self.buf = self.buf, ""
        if self.state == "reasoning":
            return out, ""
        return "", out if self.state != "after" else ""


def split(text: str, inside: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a whole reply."""
    s = ThinkStreamer(inside)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2
