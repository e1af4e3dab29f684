"""The engine's token logprobs (``logprobs.TokenLogprob``) in OpenAI's shapes, pure functions of them and of the
tokens' texts (``texts``: token id -> its text, ``Engine.token_texts``).

Chat (``chat(entries, texts)``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
"logprob", "bytes"}, ...]}, ...]}``, most likely first; completions (``completion(entries, texts, offset)``):
``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``, offsets counted from ``offset``
(the characters of the completion before these tokens). A token's text is its own decoding: a token that holds part
of a character's UTF-8 bytes reads as U+FFFD, and ``bytes`` are its text's UTF-8 bytes.
"""
from __future__ import annotations


def token_ids(entries) -> set[int]:
    """Every token id ``entries`` name (picked and top), for ``Engine.token_texts``."""
    return {e.token for e in entries} | {t for e in entries for t, _ in e.top}


def _one(token: int, logprob: float, texts: dict[int, str]) -> dict:
    text = texts[token]
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "backslashreplace"))}


def chat(entries, texts: dict[int, str]) -> dict:
    return {"content": [{**_one(e.token, e.logprob, texts), "top_logprobs": [_one(t, lp, texts) for t, lp in e.top]}
                        for e in entries]}


def completion(entries, texts: dict[int, str], offset: int = 0) -> dict:
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(texts[e.token])
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{texts[t]: lp for t, lp in e.top} for e in entries], "text_offset": offsets}
