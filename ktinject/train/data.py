"""Training data for ``ktinject finetune``: files to documents to packed token blocks.

Files:
  ``*.jsonl``  one example a line (blank lines skipped): ``{"messages": [{"role": ..., "content": ...}, ...]}``, a
               chat rendered with the tokenizer's chat template, the loss on the assistant turns only (their
               content and the template's end-of-turn after it; the role headers, system and user turns are context);
               or ``{"text": "..."}``, a document with the loss on every token.
  text file    the whole file one document (``--text``), the loss on every token.
Text documents end with the tokenizer's eos token. A bad file is a ``DataError`` naming the file and the line: not
JSON, a line that is not an object with "messages" or "text", malformed messages, a chat without an assistant turn,
a chat longer than the sequence length, an empty file.

``chat_document``: the assistant-only mask. The conversation is rendered whole and tokenized with offsets (as
inference sees it); a token is trained where its characters overlap an assistant turn, whose span is found by
rendering the conversation up to it (``render(messages[:i])``, ``render(messages[:i + 1])``: both must be a prefix
of the whole, else the template rewrites earlier turns and the chat is refused with a way round).

``pack``: documents into blocks of ``seq_len`` tokens, back to back; a chat never straddles two blocks (the block is
padded and the chat starts the next), a text document runs on into the next block. Padding has label -100 and
attention mask 0. ``split``: the last ``ceil(fraction * N)`` blocks held out for perplexity.

Legend: N blocks, S sequence length.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

IGNORE = -100  # the label of a position without loss (transformers' ignore_index)


class DataError(ValueError):
    """A training file that cannot be used; the message names the file (and line) and what to fix."""


@dataclass
class Document:
    """Token ids, which of them carry loss, where they came from ("file:line"), and whether they must stay in one
    block (a chat)."""

    ids: list[int]
    trained: list[bool]
    where: str
    whole: bool = False


@dataclass
class Blocks:
    input_ids: torch.Tensor  # [N, S]
    labels: torch.Tensor  # [N, S], IGNORE where there is no loss
    attention_mask: torch.Tensor  # [N, S]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def take(self, rows) -> Blocks:
        return Blocks(self.input_ids[rows], self.labels[rows], self.attention_mask[rows])

    def trained_tokens(self) -> int:
        return int((self.labels != IGNORE).sum())


def _render(tokenizer, messages, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as e:  # noqa: BLE001 - the template's own error (jinja raise_exception, a missing role), named
        raise DataError(f"{where}: the chat template cannot render this conversation: {type(e).__name__}: {e}") \
            from None


def assistant_spans(tokenizer, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, [start, end) character spans of its assistant turns)."""
    full = _render(tokenizer, messages, where)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], where) if i else ""
        after = _render(tokenizer, messages[:i + 1], where)
        if not (full.startswith(before) and full.startswith(after)):
            raise DataError(f"{where}: the chat template renders the first {i + 1} messages differently from the "
                            f"start of the whole conversation (it rewrites earlier turns), so the assistant turns "
                            f"cannot be found; give the rendered conversation as {{\"text\": ...}} instead")
        start = full.find(message["content"], len(before)) if message["content"] else -1
        spans.append((start if 0 <= start < len(after) else len(before), len(after)))
    return full, spans


def chat_document(tokenizer, messages: list[dict], where: str) -> Document:
    """A chat rendered with the template, trained on its assistant turns only."""
    full, spans = assistant_spans(tokenizer, messages, where)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        trained = [any(s < e_tok and s_tok < e for s, e in spans) for s_tok, e_tok in enc["offset_mapping"]]
    else:  # no offsets: the pieces between span boundaries tokenized one by one
        cuts = sorted({0, len(full), *(c for span in spans for c in span)})
        ids, trained = [], []
        for a, b in zip(cuts, cuts[1:]):
            piece = tokenizer(full[a:b], add_special_tokens=False)["input_ids"]
            ids += piece
            trained += [any(s <= a < e for s, e in spans)] * len(piece)
    return Document(ids, trained, where, whole=True)


def text_document(tokenizer, text: str, where: str) -> Document:
    """A text document (eos appended where the tokenizer has one), trained on every token."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        ids = ids + [tokenizer.eos_token_id]
    return Document(ids, [True] * len(ids), where)


def _messages(value, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    for j, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: message {j} is not an object with string \"role\" and \"content\" ({m!r:.80})")
    if not any(m["role"] == "assistant" for m in value):
        raise DataError(f"{where}: the chat has no assistant turn, so nothing to learn from (roles: "
                        f"{', '.join(m['role'] for m in value)})")
    return value


def read_jsonl(path, tokenizer, seq_len: int) -> list[Document]:
    """The documents of a JSONL file (module docstring); chats longer than ``seq_len`` tokens are errors."""
    path = Path(path)
    docs = []
    for n, line in enumerate(_read(path).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            record = json.loads(line)
        except ValueError as e:
            raise DataError(f"{where}: not valid JSON ({getattr(e, 'msg', e)}, column {getattr(e, 'colno', '?')}); "
                            f"each line must be one JSON object") from None
        if not isinstance(record, dict) or not ({"messages", "text"} & set(record)):
            keys = f"keys {sorted(record)}" if isinstance(record, dict) else f"a {type(record).__name__}"
            raise DataError(f"{where}: expected an object with \"messages\" (a chat) or \"text\", got {keys}")
        if "messages" in record:
            doc = chat_document(tokenizer, _messages(record["messages"], where), where)
            if len(doc.ids) > seq_len:
                raise DataError(f"{where}: the chat is {len(doc.ids)} tokens, longer than the sequence length "
                                f"{seq_len}: shorten it, split it, or raise --seq-len (up to the model's context)")
        else:
            if not isinstance(record["text"], str) or not record["text"]:
                raise DataError(f"{where}: \"text\" must be a non-empty string")
            doc = text_document(tokenizer, record["text"], where)
        docs.append(doc)
    if not docs:
        raise DataError(f"{path}: no examples (the file is empty)")
    return docs


def read_text(path, tokenizer) -> Document:
    """A plain text file as one document."""
    path = Path(path)
    text = _read(path)
    if not text.strip():
        raise DataError(f"{path}: no text (the file is empty)")
    return text_document(tokenizer, text, str(path))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror})") from None


def pack(docs: list[Document], seq_len: int, pad_id: int) -> Blocks:
    """Documents into [N, S = seq_len] blocks (module docstring)."""
    rows: list[tuple[list[int], list[int], int]] = []  # (ids, labels, positions before the padding)
    ids: list[int] = []
    labels: list[int] = []

    def close() -> None:
        if ids:
            pad = seq_len - len(ids)
            rows.append((ids + [pad_id] * pad, labels + [IGNORE] * pad, len(ids)))
            ids.clear()
            labels.clear()

    for doc in docs:
        if doc.whole and len(doc.ids) > seq_len:
            raise DataError(f"{doc.where}: {len(doc.ids)} tokens do not fit a block of {seq_len}")
        if doc.whole and len(ids) + len(doc.ids) > seq_len:
            close()
        for t, keep in zip(doc.ids, doc.trained):
            ids.append(t)
            labels.append(t if keep else IGNORE)
            if len(ids) == seq_len:
                close()
    close()
    if not rows:
        raise DataError("the training data has no tokens")
    mask = [[1] * used + [0] * (seq_len - used) for _, _, used in rows]
    return Blocks(torch.tensor([r[0] for r in rows], dtype=torch.long),
                  torch.tensor([r[1] for r in rows], dtype=torch.long), torch.tensor(mask, dtype=torch.long))


def split(blocks: Blocks, fraction: float) -> tuple[Blocks, Blocks | None]:
    """(training blocks, the last ceil(fraction * N) held out; None for fraction 0)."""
    if fraction <= 0:
        return blocks, None
    held = math.ceil(fraction * len(blocks))
    if held >= len(blocks):
        raise DataError(f"the data makes {len(blocks)} block(s) of tokens, too few to hold out a share of "
                        f"{fraction} and train on the rest: give more data, a lower --seq-len or a lower "
                        f"--eval-fraction (0: none held out)")
    return blocks.take(slice(0, len(blocks) - held)), blocks.take(slice(len(blocks) - held, len(blocks)))
