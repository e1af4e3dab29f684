"""The finetune command's data as pure functions (``ktinject.train.data``): the assistant-only loss mask of a
rendered chat, packing into blocks (a chat never split, text running on, padding without loss or attention), the
held-out split, and bad files' errors naming the file and line."""
from __future__ import annotations

import json

import pytest
import torch

from ktinject.demo import demo_model_dir
from ktinject.train import data
from ktinject.train.data import IGNORE, DataError, Document


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir())


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "more"},
        {"role": "assistant", "content": "No."}]


def test_the_loss_mask_covers_the_assistant_turns_only(tok):
    doc = data.chat_document(tok, CHAT, "x:1")
    assert doc.whole and len(doc.ids) == len(doc.trained)
    assert doc.ids == tok(tok.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)["input_ids"]
    trained = [tok.decode(doc.ids[i:j]) for i, j in _runs(doc.trained)]
    assert trained == ["Hello there.<|im_end|>\n", "No.<|im_end|>\n"]  # content + end of turn, not the header
    untrained = tok.decode([t for t, keep in zip(doc.ids, doc.trained) if not keep])
    assert "Be brief." in untrained and "hi" in untrained and "assistant" in untrained


def _runs(mask):
    out, start = [], None
    for i, m in enumerate(mask + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_packing_keeps_chats_whole_and_runs_text_on():
    chat = Document([1, 2, 3, 4], [False, False, True, True], "c:1", whole=True)
    text = Document([10, 11, 12, 13, 14, 15, 16], [True] * 7, "t")
    blocks = data.pack([text, chat, chat], seq_len=5, pad_id=0)
    assert blocks.input_ids.tolist() == [[10, 11, 12, 13, 14], [15, 16, 0, 0, 0], [1, 2, 3, 4, 0], [1, 2, 3, 4, 0]]
    assert blocks.labels.tolist() == [[10, 11, 12, 13, 14], [15, 16, IGNORE, IGNORE, IGNORE],
                                      [IGNORE, IGNORE, 3, 4, IGNORE], [IGNORE, IGNORE, 3, 4, IGNORE]]
    assert blocks.attention_mask.tolist() == [[1] * 5, [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]]
    assert blocks.trained_tokens() == 7 + 2 + 2
    # a chat that fits the rest of a block shares it
    blocks = data.pack([Document([7], [True], "t"), chat], seq_len=5, pad_id=0)
    assert blocks.input_ids.tolist() == [[7, 1, 2, 3, 4]]
    with pytest.raises(DataError, match="c:1: 4 tokens do not fit a block of 3"):
        data.pack([chat], seq_len=3, pad_id=0)


def test_split_holds_out_the_last_blocks():
    blocks = data.pack([Document(list(range(1, 41)), [True] * 40, "t")], seq_len=4, pad_id=0)
    train, held = data.split(blocks, 0.25)
    assert (len(train), len(held)) == (7, 3)
    assert torch.equal(held.input_ids, blocks.input_ids[7:]) and torch.equal(train.input_ids, blocks.input_ids[:7])
    assert data.split(blocks, 0.0) == (blocks, None)
    with pytest.raises(DataError, match="too few to hold out"):
        data.split(data.pack([Document([1, 2], [True] * 2, "t")], 4, 0), 0.1)


def test_text_documents_end_with_eos(tok, tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"text": "Happiness is a positive cash flow."}) + "\n\n" + json.dumps(
        {"messages": CHAT}) + "\n")
    docs = data.read_jsonl(path, tok, 256)
    assert [d.where for d in docs] == [f"{path}:1", f"{path}:3"]  # blank lines skipped, numbered as in the file
    assert docs[0].ids[-1] == tok.eos_token_id and all(docs[0].trained) and not docs[0].whole
    assert docs[1].whole and docs[1].trained.count(True) < len(docs[1].ids)


BAD = [
    ('{"messages": [}', r"x.jsonl:2: not valid JSON"),
    ('["a list"]', r"x.jsonl:2: expected an object with \"messages\" \(a chat\) or \"text\", got a list"),
    ('{"prompt": "p", "completion": "c"}', r"x.jsonl:2: expected an object .*got keys \['completion', 'prompt'\]"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', r"x.jsonl:2: the chat has no assistant turn"),
    ('{"messages": [{"role": "user"}]}', r"x.jsonl:2: message 0 is not an object with string \"role\" and"),
    ('{"messages": []}', r"x.jsonl:2: \"messages\" must be a non-empty list"),
    ('{"text": ""}', r"x.jsonl:2: \"text\" must be a non-empty string"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 300}]}),
     r"x.jsonl:2: the chat is \d+ tokens, longer than the sequence length 64"),
]


@pytest.mark.parametrize("line,message", BAD)
def test_bad_lines_are_named(tok, tmp_path, line, message):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=message):
        data.read_jsonl(path, tok, 64)


def test_bad_files_are_named(tok, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=r"empty.jsonl: no examples \(the file is empty\)"):
        data.read_jsonl(empty, tok, 64)
    with pytest.raises(DataError, match=r"missing.txt: no such file"):
        data.read_text(tmp_path / "missing.txt", tok)
    binary = tmp_path / "b.txt"
    binary.write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(DataError, match=r"b.txt: not UTF-8 text"):
        data.read_text(binary, tok)
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n")
    with pytest.raises(DataError, match=r"blank.txt: no text"):
        data.read_text(blank, tok)


def test_a_template_that_rewrites_earlier_turns_is_refused(tok, tmp_path):
    import copy

    odd = copy.copy(tok)  # the last message rendered in capitals: a prefix of the chat renders unlike the whole
    odd.chat_template = ("{%- for m in messages %}{{ (m['content'] | upper) if loop.last else m['content'] }}"
                         "{%- endfor %}")
    with pytest.raises(DataError, match=r"c:1: the chat template renders the first 2 messages differently"):
        data.chat_document(odd, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                 {"role": "user", "content": "x"}], "c:1")
