"""Where replies end (ktinject.decode.stop_tokens): the end-of-turn tokens derived from the tokenizer, the chat template and the
generation config for each family's template, and the demo model's replies ending there in ``model.generate`` with
its defaults, the chat and the server (a checkpoint whose eos_token_id names one token only included)."""
from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from ktinject.decode.stop_tokens import END_OF_TEXT, context_limit, stop_token_ids, template_end_of_turn

CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3 = ("{{- bos_token }}{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' "
          "+ m['content'] + '<|eot_id|>' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
# gpt-oss (harmony): <|end|> closes a message, the model goes on (analysis, then the final channel); <|return|> ends
# the generation, and the template writes it after an assistant message that ends the conversation
GPT_OSS = ("{%- for m in messages %}{%- if m['role'] == 'assistant' %}"
           "{{- '<|start|>assistant<|channel|>final<|message|>' + m['content'] }}"
           "{%- if loop.last and not add_generation_prompt %}{{- '<|return|>' }}{%- else %}{{- '<|end|>' }}{%- endif %}"
           "{%- else %}{{- '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}{%- endif %}"
           "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}")
DEEPSEEK = ("{{- bos_token }}{%- for m in messages %}{%- if m['role'] == 'user' %}{{- '<｜User｜>' + m['content'] }}"
            "{%- else %}{{- '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}{%- endif %}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}")
PHI3 = ("{%- for m in messages %}{{- '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}")
GEMMA = ("{{- bos_token }}{%- for m in messages %}{%- set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "{{- '<start_of_turn>' + role + '\\n' + m['content'] + '<end_of_turn>\\n' }}{%- endfor %}"
         "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}")
PLAIN = ("{%- for m in messages %}{{- '### ' + m['role'] + ':\\n' + m['content'] + '\\n\\n' }}{%- endfor %}"
         "{%- if add_generation_prompt %}{{- '### assistant:\\n' }}{%- endif %}")
REFUSES = "{{- raise_exception('this template wants a system message first') }}"


def _tokenizer(template: str | None, special: list[str], eos: str | None, **named):
    """A word-level tokenizer with ``special`` as special tokens, ``eos`` its eos_token and ``template`` its chat
    template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "Hello", ".", "ktinject", "stop", "probe", "7", "user", "assistant", "system", "model",
             "final", "###", ":"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token=eos, chat_template=template,
                                   additional_special_tokens=special, **named)


FAMILIES = {
    "chatml (qwen)": (CHATML, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], "<|endoftext|>", {},
                      ["<|endoftext|>", "<|im_end|>"]),
    "llama 3": (LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                         "<|end_of_text|>"], "<|end_of_text|>", {"bos_token": "<|begin_of_text|>"},
                ["<|end_of_text|>", "<|eot_id|>"]),
    "gpt-oss": (GPT_OSS, ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|endoftext|>"],
                "<|return|>", {}, ["<|return|>", "<|endoftext|>"]),
    "deepseek": (DEEPSEEK, ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
                 "<｜end▁of▁sentence｜>", {"bos_token": "<｜begin▁of▁sentence｜>"}, ["<｜end▁of▁sentence｜>"]),
    "phi 3": (PHI3, ["<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"], "<|endoftext|>", {},
              ["<|endoftext|>", "<|end|>"]),
    "gemma": (GEMMA, ["<bos>", "<start_of_turn>", "<end_of_turn>", "<eos>"], "<eos>", {"bos_token": "<bos>"},
              ["<eos>", "<end_of_turn>"]),
    "plain-text turns": (PLAIN, ["<|endoftext|>"], "<|endoftext|>", {}, ["<|endoftext|>"]),
    "template that refuses": (REFUSES, ["</s>"], "</s>", {}, ["</s>"]),
    "no template": (None, ["<|im_end|>"], None, {}, []),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_stop_tokens_of_each_family(family):
    template, special, eos, named, expected = FAMILIES[family]
    tok = _tokenizer(template, special, eos, **named)
    got = [tok.convert_ids_to_tokens(i) for i in stop_token_ids(tok)]
    assert got == expected


def test_generation_config_ids_come_first_and_are_kept():
    from transformers import GenerationConfig

    tok = _tokenizer(LLAMA3, FAMILIES["llama 3"][1], "<|end_of_text|>", bos_token="<|begin_of_text|>")
    eom = tok.convert_tokens_to_ids("<|start_header_id|>")  # any id: what the checkpoint says stays
    got = stop_token_ids(tok, GenerationConfig(eos_token_id=[eom, tok.eos_token_id]))
    assert got[:2] == [eom, tok.eos_token_id]
    assert tok.convert_tokens_to_ids("<|eot_id|>") in got and len(got) == len(set(got))


def test_end_of_text_needs_to_be_special():
    """A word that happens to be spelled like an end-of-text token but is ordinary text is no stop."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "</s>": 1, "<eos>": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    assert all(t in END_OF_TEXT for t in ("</s>", "<eos>"))
    assert stop_token_ids(fast) == [] and template_end_of_turn(fast) is None


# ---- the demo model ---------------------------------------------------------------------------------------------
PROMPT = "Hello!"
SEEDS = (5, 6, 7)  # sampled replies that, ended at <|im_end|> alone, ran on into <|endoftext|><|im_start|>user...
LONG = 200
SERVE_SEEDS = (0, 1, 2)  # the engine draws with its own generator: other replies than generate's for a seed


@pytest.fixture(scope="module")
def demo(demo_engine_model):
    model, tokenizer = demo_engine_model
    msgs = [{"role": "user", "content": PROMPT}]
    ids = tokenizer(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                    return_tensors="pt", add_special_tokens=False).input_ids
    return model, tokenizer, ids


def _ends_at_the_turn(tokenizer, new: list[int], stops) -> None:
    """``new`` (a reply's token ids) holds no stop token but as its last token, and no turn of its own."""
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    cut = [i for i, t in enumerate(new) if t in stops]
    text = tokenizer.decode(new)
    assert not cut or cut[0] == len(new) - 1, f"text after the end of the turn: {text!r}"
    assert start not in new, f"the reply wrote a turn of its own: {text!r}"


def test_demo_checkpoint_stops_at_both_of_its_end_tokens(demo):
    model, tokenizer, _ = demo
    from transformers import GenerationConfig

    from ktinject.demo import demo_model_dir

    end, eot = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert GenerationConfig.from_pretrained(demo_model_dir()).eos_token_id == [end, eot]
    assert stop_token_ids(tokenizer, model.generation_config) == [end, eot]
    assert context_limit(model) == 2048


def test_demo_generate_defaults_end_at_the_turn(demo):
    """``model.generate`` with the checkpoint's defaults (sampled) and greedy, at full length."""
    import torch

    model, tokenizer, ids = demo
    stops = set(stop_token_ids(tokenizer, model.generation_config))
    for seed in (None, *SEEDS):
        kw = {"do_sample": False} if seed is None else {}
        if seed is not None:
            torch.manual_seed(seed)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=LONG, **kw)
        _ends_at_the_turn(tokenizer, out[0, ids.shape[1]:].tolist(), stops)


@contextlib.contextmanager
def _eos_only(model, on: bool):
    """The model's generation config with eos_token_id <|im_end|> alone (as config.json says), while it runs."""
    saved = model.generation_config.eos_token_id
    if on:
        model.generation_config.eos_token_id = model.config.eos_token_id
    try:
        yield model
    finally:
        model.generation_config.eos_token_id = saved


@pytest.mark.parametrize("eos_only", [False, True], ids=["checkpoint", "eos_token_id-alone"])
def test_demo_chat_replies_end_at_the_turn(demo, eos_only):
    model, tokenizer, _ = demo
    with _eos_only(model, eos_only):
        stops = set(stop_token_ids(tokenizer, model.generation_config))
        _chat_replies(model, tokenizer, stops)


def _chat_replies(model, tokenizer, stops):
    from ktinject.cli.chat import Chat

    import torch

    ended = 0
    for seed in (None, *SEEDS):
        args = argparse.Namespace(system=None, max_new_tokens=LONG, temperature=0.0 if seed is None else None,
                                  top_p=None)
        chat = Chat(model, tokenizer, args, notes=io.StringIO())
        if seed is not None:
            torch.manual_seed(seed)
        out = io.StringIO()
        answer = chat.reply(PROMPT, out=out)
        ids = tokenizer(answer, add_special_tokens=False).input_ids
        assert "user\n" not in answer, answer
        _ends_at_the_turn(tokenizer, ids, stops)
        ended += len(ids) < LONG
    # a sampled reply may ramble past LONG tokens without a turn (which seed does depends on the CPU's float
    # kernels); most must end, at their turn
    assert ended >= len(SEEDS), f"only {ended} of {len(SEEDS) + 1} replies ended within {LONG} tokens"


@pytest.mark.parametrize("eos_only", [False, True], ids=["checkpoint", "eos_token_id-alone"])
def test_demo_server_replies_end_at_the_turn(demo, eos_only):
    from ktinject.serve.engine import Engine, EngineConfig
    from ktinject.serve.sampling import SamplingParams

    model, tokenizer, _ = demo
    with _eos_only(model, eos_only):
        engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_context=512, prefill_chunk=512)).start()
    try:
        prompt = engine.render_chat([{"role": "user", "content": PROMPT}])
        stops = engine.eos_ids
        assert set(tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])) <= stops
        for seed in (None, *SERVE_SEEDS):
            params = SamplingParams(max_tokens=LONG, temperature=0.0 if seed is None else 0.7, top_p=0.9, seed=seed)
            r = engine.generate(prompt, params, timeout=600)
            _ends_at_the_turn(tokenizer, r.token_ids, stops)
    finally:
        engine.stop()
