"""The request side of the tokenizer: prompts tokenized and chats rendered for the engine's callers (any thread).

``PromptTokenizer`` works on a copy of the model's tokenizer with a lock of its own, so that tokenizing one long
prompt or rendering a template never holds up the engine thread, which decodes every token's text with the original
(a fast tokenizer is not safe from two threads at once: each copy has one user). Input that cannot become a prompt
(invalid Unicode, text too long for the context whatever its tokens, a template that rejects it) is a
``RequestError`` naming the field.
"""
from __future__ import annotations

import copy
import json
import logging
import threading

from ktinject.serve.errors import RequestError, check_unicode

log = logging.getLogger("ktinject.serve")

#: token texts kept by ``PromptTokenizer.token_texts`` (logprobs' tokens) before the store starts over
TOKEN_TEXTS_KEPT = 1 << 16


class PromptTokenizer:
    """``encode`` and ``render_chat`` on a copy of ``tokenizer`` (None: token ids only, both refuse) for a context of
    ``max_context`` tokens."""

    def __init__(self, tokenizer, max_context: int):
        self.tokenizer = _copy_tokenizer(tokenizer)
        self.max_context = max_context
        self._lock = threading.Lock()
        self._max_token_chars: int | None = None
        self._token_text: dict[int, str] = {}  # token_texts(): id -> text

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens added as the tokenizer does). RequestError where it cannot be
        tokenized, or is too long for the context whatever its tokens (checked before tokenizing it)."""
        self._need_tokenizer()
        check_unicode(text, "prompt")
        self._check_chars(text, "prompt")
        try:
            with self._lock:
                return list(self.tokenizer(text, add_special_tokens=True).input_ids)
        except Exception as e:  # noqa: BLE001 - text the tokenizer refuses (a lone surrogate): the client's input
            raise RequestError(f"the prompt cannot be tokenized: {type(e).__name__}: {str(e)[:200]}",
                               param="prompt") from e

    def render_chat(self, messages: list[dict], tools: list | None = None, **template_kwargs) -> list[int]:
        """Token ids of ``messages`` through the tokenizer's chat template, with the generation prompt; ``tools``
        and ``template_kwargs`` (``enable_thinking``, ...) go to the template. RequestError when it fails."""
        self._need_tokenizer()
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("this model's tokenizer has no chat template: use /v1/completions",
                               param="messages")
        self._check_chars(str(messages) + str(tools or ""), "messages")
        for value, param in ((tools, "tools"), (template_kwargs, "chat_template_kwargs"), (messages, "messages")):
            if value:  # surrogates anywhere in them (the texts themselves: protocol.py names their fields)
                check_unicode(json.dumps(value, ensure_ascii=False, default=str), param, where=False)

        def render(tools, kwargs) -> str:
            with self._lock:
                return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                          add_generation_prompt=True, **kwargs)

        try:
            text = render(tools, template_kwargs)
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation: the client's input
            param = "messages"  # which part: the conversation may render without the kwargs, or without the tools
            parts = ([("chat_template_kwargs", tools, {})] if template_kwargs else []) + \
                ([("tools", None, template_kwargs)] if tools else [])
            for name, part_tools, part_kwargs in parts:
                try:
                    render(part_tools, part_kwargs)
                except Exception:  # noqa: BLE001 - fails that way as well: not this part alone
                    continue
                param = name
                break
            raise RequestError(f"the chat template rejected the {param.replace('_', ' ')}: {type(e).__name__}: "
                               f"{str(e)[:200]}", param=param) from e
        self._check_chars(text, "messages")
        check_unicode(text, "messages")
        try:
            with self._lock:
                return list(self.tokenizer(text, add_special_tokens=False).input_ids)
        except Exception as e:  # noqa: BLE001
            raise RequestError(f"the messages cannot be tokenized: {type(e).__name__}: {str(e)[:200]}",
                               param="messages") from e

    def tail_text(self, ids: list[int], tokens: int = 4) -> str:
        """The text of the last ``tokens`` of ``ids``, special tokens kept ("" without a tokenizer)."""
        if self.tokenizer is None:
            return ""
        with self._lock:
            return self.tokenizer.decode(list(ids[-tokens:]), skip_special_tokens=False)

    def token_texts(self, ids) -> dict[int, str]:
        """Each token id's own text (special tokens kept; ``"token_id:ID"`` without a tokenizer), kept once
        decoded."""
        cache = self._token_text
        missing = [i for i in set(ids) if i not in cache]
        if missing:
            if self.tokenizer is None:
                got = [f"token_id:{i}" for i in missing]
            else:
                with self._lock:
                    got = [self.tokenizer.decode([i], skip_special_tokens=False) for i in missing]
            if len(cache) + len(got) > TOKEN_TEXTS_KEPT:
                cache.clear()
            cache.update(zip(missing, got))
        return {i: cache[i] for i in ids}

    def _check_chars(self, text: str, param: str) -> None:
        """RequestError where ``text`` has more characters than max_context tokens of the longest token can hold:
        too long for the context whatever it tokenizes to (so a huge prompt is refused before it is tokenized)."""
        if self._max_token_chars is None:
            with self._lock:
                vocab = self.tokenizer.get_vocab()  # byte-level keys: no shorter than their text
            self._max_token_chars = max((len(k) for k in vocab), default=1) or 1
        limit = self.max_context * self._max_token_chars
        if len(text) > limit:
            raise RequestError(f"{param} is {len(text):,} characters: more than the context of "
                               f"{self.max_context:,} tokens can hold (at most {self._max_token_chars} "
                               f"characters a token)", param=param, code="context_length_exceeded")

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise RequestError("this engine has no tokenizer: send token ids", param="prompt")


def _copy_tokenizer(tokenizer):
    """A copy of ``tokenizer`` for the request side (the engine thread keeps the original), or the tokenizer itself
    where it cannot be copied (logged; its two users then stall each other)."""
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception as e:  # noqa: BLE001 - a tokenizer class that does not deep-copy
        log.warning("serve: the tokenizer cannot be copied (%s: %s); requests share the engine's", type(e).__name__, e)
        return tokenizer
