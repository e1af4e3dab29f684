"""Where a reply ends and how much room the context leaves: what the chat and the server share.

``stop_token_ids(tokenizer, generation_config)``: the token ids that end the assistant's turn. A checkpoint's
``eos_token_id`` (config, generation_config, tokenizer) often names one token where the model ends its turns with
another: the chat template's end-of-turn token (ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``, Phi's ``<|end|>``,
gpt-oss's ``<|return|>``, DeepSeek's ``<｜end▁of▁sentence｜>``, Gemma's ``<end_of_turn>``), or the end-of-text token
of its pretraining documents (``<|endoftext|>``, ``<|end_of_text|>``, ``</s>``, ...), after which it goes on to write
the next turn itself. The set is the generation config's and the tokenizer's end-of-sequence ids, the special token
the chat template puts right after an assistant message that ends the conversation, and those end-of-text tokens the
tokenizer has as special tokens.

``context_limit(model)``: the tokens a sequence may hold (``max_position_embeddings`` of the text config), or None.

No torch import here: the tokenizer and the configs do the work.
"""
from __future__ import annotations

import logging

__all__ = ["END_OF_TEXT", "context_limit", "stop_token_ids", "template_end_of_turn"]

log = logging.getLogger(__name__)

#: special tokens that end a pretraining document: a model that writes one has finished (kept when it is special)
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<｜end▁of▁sentence｜>", "<eos>")

_SENTINEL = "ktinject stop probe 7"


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple, set, frozenset)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def _special_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens: the named ones and the added tokens marked special."""
    ids = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []) if i is not None}
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def template_end_of_turn(tokenizer) -> int | None:
    """The special token the chat template writes right after the content of an assistant message that ends the
    conversation (whitespace between them skipped), or None (no template, a template that fails on a plain
    user/assistant exchange, or no special token there)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    except Exception as e:  # noqa: BLE001 - a template with demands of its own (tools, a system message, ...)
        log.debug("stop tokens: the chat template did not render a user/assistant exchange (%s: %s)",
                  type(e).__name__, e)
        return None
    if not isinstance(text, str) or _SENTINEL not in text:
        return None
    after = text.rsplit(_SENTINEL, 1)[1]
    try:
        ids = tokenizer(after, add_special_tokens=False).input_ids
    except Exception:  # noqa: BLE001
        return None
    special = _special_ids(tokenizer)
    for i in ids:
        if int(i) in special:
            return int(i)
        if tokenizer.decode([i]).strip():
            return None  # text before any special token: the template ends turns with plain text
    return None


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """The token ids that end a reply (see the module docstring): the generation config's end-of-sequence ids first
    (in their order), then the tokenizer's, the chat template's end-of-turn token and the end-of-text tokens."""
    ids = _ids(getattr(generation_config, "eos_token_id", None)) if generation_config is not None else []
    if tokenizer is not None:
        ids += _ids(getattr(tokenizer, "eos_token_id", None))
        end = template_end_of_turn(tokenizer)
        if end is not None:
            ids.append(end)
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        special = _special_ids(tokenizer)
        ids += [vocab[t] for t in END_OF_TEXT if t in vocab and vocab[t] in special]
    return list(dict.fromkeys(ids))


def context_limit(model) -> int | None:
    """The tokens one sequence of ``model`` may hold: its text config's max_position_embeddings (None if unknown)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    return int(limit) if limit else None
