"""Generated tokens -> text as it streams (incremental detokenization), and stop strings across token boundaries.

``Detokenizer.push(token)`` returns the text that may be sent now. Decoding is incremental (the last few tokens
are decoded again with each new one, as vLLM and TGI do), so a token that ends inside a multi-byte character, or
whose leading space depends on the token before it, is only released once the text is complete. Stop strings
are searched in the decoded text, so one spread over several tokens is found; text that could still become a
stop string (a suffix that is a prefix of one) is held back until the next token decides. When a stop string
appears, the text ends right before it and ``stopped`` is set. ``finish()`` releases what is held.
"""
from __future__ import annotations

_CONTEXT = 6  # prompt tokens decoded with the first new ones: leading spaces and merges come out right


class Detokenizer:
    """One request's output text (see the module docstring). ``tokenizer``: a Hugging Face tokenizer, or None
    (token ids only: no text, no stop strings)."""

    def __init__(self, tokenizer, prompt_tail: list[int] = (), stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip = skip_special_tokens
        self.ids = list(prompt_tail)[-_CONTEXT:]
        self.prefix = 0  # ids[prefix:read] decode to text already taken in
        self.read = len(self.ids)
        self.text = ""  # everything decoded so far (cut at a stop string)
        self.sent = 0  # characters of text released
        self.stopped: str | None = None  # the stop string that ended the text
        if self.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def push(self, token: int) -> str:
        """Take one generated token; the text that can be released now ("" while it is held or incomplete)."""
        if self.tokenizer is None or self.stopped is not None:
            return ""
        self.ids.append(int(token))
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing new yet, or a character still incomplete
        start = len(self.text)
        self.text += after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        if self.stop:
            self._find_stop(start)
        return self._release(final=self.stopped is not None)

    def finish(self) -> str:
        """The text still held back (the generation ended): released as it is."""
        if self.tokenizer is not None and self.stopped is None and self.read < len(self.ids):
            self.text += self._decode(self.ids[self.prefix:])[len(self._decode(self.ids[self.prefix:self.read])):]
            self.read = len(self.ids)
            if self.stop:
                self._find_stop(0)
        return self._release(final=True)

    def _find_stop(self, start: int) -> None:
        longest = max(len(s) for s in self.stop)
        lo = max(0, start - longest + 1)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, lo)) >= 0]
        if hits:
            i, s = min(hits)
            self.text, self.stopped = self.text[:i], s

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final and self.stop:
            end -= self._held()
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def _held(self) -> int:
        """Length of the longest end of the text that is the beginning of a stop string (it may still become one).
        Only the positions of the text's last len(s) - 1 characters that hold s's first character are tried (a
        slice of s per length tried would take O(len(s)^2) a token: long stop strings would slow every stream)."""
        best, t = 0, self.text
        for s in self.stop:
            i = t.find(s[0], max(0, len(t) - len(s) + 1))
            while i >= 0 and len(t) - i > best:  # t[i:] is shorter than s: a candidate beginning of it
                if s.startswith(t[i:]):
                    best = len(t) - i
                    break
                i = t.find(s[0], i + 1)
        return best
