"""Constrained decoding on the CPU with the demo model (it was never trained to write JSON or tool calls: whatever
it writes under a grammar must still parse): ``response_format`` JSON schemas validate (jsonschema) for a table of
schemas, streamed and not; forced tool calls (OpenAI's ``required`` / a named function, Anthropic's ``any`` / a
named tool) parse into calls whose arguments are valid for the tool's schema, through the official clients; rows
with a grammar leave the other rows of their batch unchanged; bad schemas, unknown tools and a missing grammar
engine get 400s in each API's shape; the device mask equals llguidance's own on the CPU."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

import torch  # noqa: E402

from ktinject.serve import grammar  # noqa: E402
from ktinject.serve.engine import Engine, EngineConfig, SamplingParams  # noqa: E402

from tests.serve.soak_mix_module import soak_mix  # noqa: E402
from tests.serve.test_serve import _free_server  # noqa: E402

NAME = "ktinject-demo"
ASK = [{"role": "user", "content": "tell me about the sea"}]

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                              "ok": {"type": "boolean"}},
             "required": ["name", "age", "ok"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                  "tag": {"type": "string", "maxLength": 8}},
                 "required": ["id", "tag"], "additionalProperties": False},
        "score": {"type": "integer", "minimum": 0, "maximum": 10}},
        "required": ["user", "score"], "additionalProperties": False},
    "enums_and_arrays": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "sizes": {"type": "array", "items": {"enum": ["S", "M", "L"]}, "minItems": 1, "maxItems": 4},
        "level": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["color", "sizes", "level"], "additionalProperties": False},
    "array_of_objects": {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"k": {"type": "string", "maxLength": 6}, "v": {"type": "boolean"}},
            "required": ["k", "v"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
}
ADD, SCHEMA_OF, TOOLS = soak_mix.ADD, soak_mix.SCHEMA_OF, soak_mix.TOOLS  # (the tool schemas the soak sends too)


@pytest.fixture(scope="module")
def served(demo_engine_model):
    from ktinject.serve.api import create_app

    model, tokenizer = demo_engine_model
    engine = Engine(model, tokenizer, EngineConfig(max_batch=8, max_context=512, prefill_chunk=16), name=NAME).start()
    server, thread, sock = _free_server(create_app(engine, NAME))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield engine, url
    server.should_exit = True
    thread.join(10)
    engine.stop()


@pytest.fixture(scope="module")
def oa(served):
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key="none", max_retries=0, timeout=120)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_replies_validate(oa, name, stream):
    schema = SCHEMAS[name]
    for temperature in (0.0, 1.0):
        kw = dict(model=NAME, messages=ASK, max_tokens=150, temperature=temperature, seed=7,
                  response_format=_schema_format(schema))
        if stream:
            chunks = list(oa.chat.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            r = oa.chat.completions.create(**kw)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_replies_are_json_objects(oa):
    # (greedy: sampled, the demo model's keys run on like its fortunes, past any max_tokens worth a CI test)
    for question in ("tell me about the sea", "a robot", "who are you?"):
        r = oa.chat.completions.create(model=NAME, messages=[{"role": "user", "content": question}], max_tokens=200,
                                       temperature=0, response_format={"type": "json_object"})
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def _check_call(name: str, arguments) -> None:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMA_OF[name])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_choice_gives_a_valid_call(oa, choice, stream):
    kw = dict(model=NAME, messages=[{"role": "user", "content": "what is 2 + 3?"}], tools=TOOLS, tool_choice=choice,
              max_tokens=120)
    if stream:
        chunks = list(oa.chat.completions.create(stream=True, **kw))
        calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or ())]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        r = oa.chat.completions.create(**kw)
        calls, finish, content = r.choices[0].message.tool_calls, r.choices[0].finish_reason, \
            r.choices[0].message.content
    assert finish == "tool_calls" and len(calls) == 1 and not (content or "").strip(), (calls, content)
    if isinstance(choice, dict):
        assert calls[0].function.name == "add"
    _check_call(calls[0].function.name, calls[0].function.arguments)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_forced_tool_choice_gives_tool_use(served, choice, stream):
    client = anthropic.Anthropic(base_url=served[1], api_key="none", max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    kw = dict(model=NAME, max_tokens=120, tools=tools, tool_choice=choice,
              messages=[{"role": "user", "content": "weather in Paris?"}])
    if stream:
        with client.messages.stream(**kw) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**kw)
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(uses) == 1, message.content
    if choice["type"] == "tool":
        assert uses[0].name == "get_weather"
    _check_call(uses[0].name, uses[0].input)


def _together(engine, requests):
    """Submit ``requests`` ((prompt, params)) so that they start in one step; their token ids."""
    import threading

    results = [None] * len(requests)
    done = [threading.Event() for _ in requests]

    def sink(i):
        parts = []

        def on(out):
            parts.extend(out.token_ids)
            if out.finish_reason is not None:
                results[i] = (parts, out.finish_reason)
                done[i].set()
        return on

    with engine._cond:  # the engine thread waits for this lock: all are queued before its next step
        for i, (prompt, params) in enumerate(requests):
            engine.submit(prompt, params, sink(i))
    for d in done:
        assert d.wait(120)
    return results


def test_rows_without_a_grammar_are_unchanged_by_rows_with_one(served):
    engine = served[0]
    prompts = [engine.render_chat([{"role": "user", "content": q}]) for q in ("the sea", "a robot", "paint", "a town")]
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = _together(engine, [(p, plain) for p in prompts[:2]])
    rule = grammar.json_schema(SCHEMAS["flat"], "response_format")
    schema = SamplingParams(max_tokens=80, temperature=0, grammar=rule)
    mixed = _together(engine, [(prompts[0], plain), (prompts[2], schema), (prompts[1], plain), (prompts[3], schema)])
    assert [mixed[0], mixed[2]] == alone
    tok = engine.tokenizer
    for tokens, finish in (mixed[1], mixed[3]):
        assert finish == "stop"
        text = tok.decode([t for t in tokens if t not in engine.eos_ids])
        jsonschema.validate(json.loads(text), SCHEMAS["flat"])
    alone_schema = _together(engine, [(prompts[2], schema)])
    assert alone_schema[0] == mixed[1]  # and a grammar row's own tokens are those it gets alone


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format", "objec"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema", "JSON schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name",
     "letters"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_object"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "required"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "cannot be combined"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "grammar"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
      "tool_choice": "required"}, "tool_choice", "objec"),
])
def test_bad_constraints_get_openai_400s(served, body, param, words):
    r = httpx.post(f"{served[1]}/v1/chat/completions", json={"model": NAME, "messages": ASK, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("choice,words", [({"type": "tool", "name": "nope"}, "'nope'"),
                                          ({"type": "tool"}, "name"), ({"type": "sometimes"}, "any")])
def test_bad_tool_choice_gets_anthropic_400s(served, choice, words):
    tools = [{"name": "add", "input_schema": ADD}]
    r = httpx.post(f"{served[1]}/v1/messages", json={"model": NAME, "max_tokens": 5, "messages": ASK, "tools": tools,
                                                     "tool_choice": choice}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert words in r.json()["error"]["message"], r.text


def test_without_the_extra_a_grammar_is_a_400_naming_it_and_the_rest_works(served, oa, monkeypatch):
    monkeypatch.setattr(grammar, "available", lambda: False)
    for body in ({"response_format": {"type": "json_object"}}, {"tools": TOOLS, "tool_choice": "required"}):
        r = httpx.post(f"{served[1]}/v1/chat/completions", json={"model": NAME, "messages": ASK, **body}, timeout=60)
        assert r.status_code == 400 and 'pip install "ktinject[structured]"' in r.json()["error"]["message"], r.text
    r = oa.chat.completions.create(model=NAME, messages=ASK, max_tokens=4, tools=TOOLS)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_the_device_mask_equals_llguidance_s_own(served):
    import llguidance.torch

    from ktinject.serve import grammar_masks

    engine = served[0]
    vocab = engine.vocab_size
    gs = engine.grammars
    matchers = [gs.matcher(grammar.json_schema(SCHEMAS[k], "x")) for k in ("flat", "enums_and_arrays")]
    tok = engine.tokenizer
    assert matchers[0].consume(tok.encode('{"name": "', add_special_tokens=False)[0])
    masks = grammar_masks.GrammarMasks(4, vocab, "cpu")
    step = masks.fill([1, 3], matchers)
    logits = torch.randn(4, vocab)
    got = step.apply(logits.clone())
    ref = logits.clone()
    bits = llguidance.torch.allocate_token_bitmask(2, vocab)
    for i, m in enumerate(matchers):
        llguidance.torch.fill_next_token_bitmask(m.ll, bits, i)
    for i, row in enumerate((1, 3)):
        one = ref[row:row + 1]
        llguidance.torch.apply_token_bitmask_inplace(one, bits[i:i + 1])
    assert torch.equal(got, ref)
    assert torch.isinf(got[1]).sum() > 0 and torch.isfinite(got[0]).all() and torch.isfinite(got[2]).all()


def _accepts(grammars, rule: str, ids: list[int]) -> bool:
    m = grammars.matcher(rule)
    return all(m.consume(t) for t in ids) and m.ll.is_accepting()


@pytest.mark.parametrize("parser", ["deepseek_v3", "kimi_k2", "qwen3", "harmony"])
def test_forced_call_markers_that_are_special_tokens_are_matched_by_id(demo_engine_model, parser):
    """A family whose call markers are special tokens (DeepSeek's, Kimi's): the grammar takes each marker as its
    token, not as its text, and the family's parser reads the call back from the text with the markers kept."""
    import copy

    from ktinject.serve import constraints, tool_parsers

    tok = copy.deepcopy(demo_engine_model[1])
    markers = ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
               "<｜tool▁calls▁end｜>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
               "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>", "<|channel|>",
               "<|constrain|>", "<|message|>"]
    tok.add_special_tokens({"additional_special_tokens": markers})
    gs = grammar.Grammars(tok, len(tok), tok.eos_token_id)
    rule = constraints.forced_call(parser, TOOLS, "add", gs.literal)
    gs.check(rule, "tool_choice")
    args = '{"a": 2, "b": 3}'
    text = {"deepseek_v3": f"{markers[0]}{markers[1]}add{markers[2]}{args}{markers[3]}{markers[4]}",
            "kimi_k2": f"{markers[5]}{markers[6]}functions.add:0{markers[7]}{args}{markers[8]}{markers[9]}",
            "qwen3": f'<tool_call>\n{{"name": "add", "arguments": {args}}}\n</tool_call>',
            "harmony": f"{markers[10]}commentary to=functions.add {markers[11]}json{markers[12]}{args}"}[parser]
    ids = tok.encode(text, add_special_tokens=False)
    if parser != "qwen3":
        assert set(tok.convert_tokens_to_ids(markers)) & set(ids)  # the markers went in as their tokens
    assert _accepts(gs, rule, ids)
    assert not _accepts(gs, rule, tok.encode(text.replace('"b": 3', '"c": 3'), add_special_tokens=False))
    content, calls = tool_parsers.make(parser, TOOLS).parse(tok.decode(ids, skip_special_tokens=False))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 3})] and not content.strip()


def test_after_an_opened_think_block_the_reasoning_runs_free_then_the_grammar_holds(served):
    from ktinject.serve import constraints

    engine = served[0]
    tok, gs = engine.tokenizer, engine.grammars
    rule = constraints.response_format(_schema_format(SCHEMAS["flat"]), think=True)
    reply = '{"name": "x", "age": 3, "ok": true}'
    assert _accepts(gs, rule, tok.encode(f"let me think </think>\n\n{reply}", add_special_tokens=False))
    assert not _accepts(gs, rule, tok.encode(reply, add_special_tokens=False))  # the reasoning's end first
    assert not _accepts(gs, rule, tok.encode("hmm </think>\n\nnot json", add_special_tokens=False))
    tools = constraints.forced_call("qwen3", TOOLS, None, gs.literal, think=True)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": -2}}\n</tool_call>'
    assert _accepts(gs, tools, tok.encode(f"ok</think>\n{call}", add_special_tokens=False))


PER_PARAMETER = ["glm45", "minimax_m2", "qwen3_coder", "llama4_pythonic"]


@pytest.fixture(scope="module")
def parser_urls(served):
    """parser -> the URL of an app over the same engine with that tool-call parser chosen."""
    from ktinject.serve.api import create_app

    urls, servers = {}, []
    for parser in PER_PARAMETER:
        server, thread, sock = _free_server(create_app(served[0], NAME, tool_call_parser=parser))
        servers.append((server, thread))
        urls[parser] = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield urls
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("parser", PER_PARAMETER)
def test_forced_calls_of_the_per_parameter_families_are_valid(parser_urls, parser, choice, stream):
    client = openai.OpenAI(base_url=f"{parser_urls[parser]}/v1", api_key="none", max_retries=0, timeout=120)
    kw = dict(model=NAME, messages=[{"role": "user", "content": "weather in Paris?"}], tools=TOOLS,
              tool_choice=choice, max_tokens=160)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or ())]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        r = client.chat.completions.create(**kw)
        calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
    assert finish == "tool_calls" and len(calls) == 1, calls
    if isinstance(choice, dict):
        assert calls[0].function.name == "get_weather"
    _check_call(calls[0].function.name, calls[0].function.arguments)


NOTE = {"type": "object", "properties": {"text": {"type": "string", "minLength": 1}, "tag": {"enum": ["a", "b"]},
                                         "n": {"type": ["integer", "null"]}},
        "required": ["text"], "additionalProperties": False}
#: parser -> (a reply its grammar accepts, its arguments; a reply it refuses)
REPLIES = {
    "qwen3_coder": ('<tool_call>\n<function=note>\n<parameter=text>\n\na <b>\n\n</parameter>\n<parameter=n>\nnull\n'
                    '</parameter>\n</function>\n</tool_call>', {"text": "\na <b>\n", "n": None},
                    '<tool_call>\n<function=note>\n<parameter=text>\na</parameter>b\n</parameter>\n</function>\n'
                    '</tool_call>'),
    "glm45": ('<tool_call>note\n<arg_key>text</arg_key>\n<arg_value>x < y\nz</arg_value>\n<arg_key>tag</arg_key>\n'
              '<arg_value>"b"</arg_value>\n</tool_call>', {"text": "x < y\nz", "tag": "b"},
              '<tool_call>note\n<arg_key>tag</arg_key>\n<arg_value>"b"</arg_value>\n</tool_call>'),  # text missing
    "minimax_m2": ('<minimax:tool_call>\n<invoke name="note">\n<parameter name="text">hi <there></parameter>\n'
                   '<parameter name="n">4</parameter>\n</invoke>\n</minimax:tool_call>', {"text": "hi <there>", "n": 4},
                   '<minimax:tool_call>\n<invoke name="note">\n<parameter name="text">\nhi</parameter>\n</invoke>\n'
                   '</minimax:tool_call>'),  # a leading newline the parser would strip
    "llama4_pythonic": ('[note(text="a \\"q\\"", n=null)]', {"text": 'a "q"', "n": None}, '[note(text="")]'),
}


@pytest.mark.parametrize("parser", PER_PARAMETER)
def test_per_parameter_grammars_accept_what_their_parser_reads_as_the_call(demo_engine_model, parser):
    from ktinject.serve import constraints, tool_parsers

    tok = demo_engine_model[1]
    gs = grammar.Grammars(tok, len(tok), tok.eos_token_id)
    tools = [{"type": "function", "function": {"name": "note", "parameters": NOTE}}]
    rule = constraints.forced_call(parser, tools, None, gs.literal)
    gs.check(rule, "tool_choice")
    good, args, bad = REPLIES[parser]
    assert _accepts(gs, rule, tok.encode(good, add_special_tokens=False))
    assert not _accepts(gs, rule, tok.encode(bad, add_special_tokens=False))
    content, calls = tool_parsers.make(parser, tools).parse(good)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("note", args)] and not content.strip()
    jsonschema.validate(args, NOTE)


@pytest.mark.parametrize("parser", PER_PARAMETER)
def test_per_parameter_forms_refuse_schemas_they_cannot_hold(parser):
    from ktinject.serve import constraints
    from ktinject.serve.errors import RequestError

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "anyOf": [{}]}}}]
    with pytest.raises(RequestError, match="anyOf"):
        constraints.forced_call(parser, tools, None, lambda t: grammar.lark_string(t))
