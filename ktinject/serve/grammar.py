"""Constrained decoding's grammar side: what a request asks for (a grammar's text), checked against the model's
tokenizer, and one matcher per request that says which tokens may come next. The engine is llguidance
(``pip install "ktinject[structured]"``; why this one and not xgrammar: docs/serving.md); without it installed,
a request that needs a grammar gets a RequestError that names the extra, and everything else works.

A grammar is llguidance's grammar text (``grammar_from_json_schema`` / ``grammar_from_lark``): plain data that
``SamplingParams.grammar`` carries. JSON is generated compact with Python's separators (``", "``, ``": "``), no
free whitespace: a reply always moves on (a model cannot pad a reply with blanks until ``max_tokens``), and it reads
as ``json.dumps`` writes, which the tool-call parsers expect.

``Grammars`` (one per engine) builds llguidance's view of the tokenizer once, at the first request that needs it
(seconds for a large vocabulary: the API calls ``check`` in a worker thread), over the model's vocabulary (rows of
the logits the tokenizer has no token for are never allowed) with the engine's end-of-sequence token as the
grammar's end. ``Matcher``: ``consume(token)`` after each sampled token; ``fill(bitmask, row)`` writes the allowed
tokens of the next one (bit t of the row: token t); ``done`` once the grammar has ended (its end token consumed) or
failed. The masks themselves go to the device in ``grammar_masks.py``.
"""
from __future__ import annotations

import importlib.util
import json
import re
import threading

from ktinject.serve.errors import RequestError

#: the extra that brings the grammar engine, named in every error about it
EXTRA = 'pip install "ktinject[structured]"'
#: llguidance's JSON options: compact, Python's separators (see the module docstring)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def available() -> bool:
    """Whether the grammar engine (llguidance) is installed."""
    return importlib.util.find_spec("llguidance") is not None


def require(param: str) -> None:
    """RequestError naming ``param`` and the extra when the grammar engine is not installed."""
    if not available():
        raise RequestError(f"{param} needs constrained decoding, which this server does not have installed: {EXTRA}",
                           param=param)


def with_options(schema: dict) -> dict:
    """``schema`` with llguidance's JSON options (its own ``x-guidance`` keys win where it has them)."""
    return {**schema, "x-guidance": {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}}


def json_schema(schema, param: str) -> str:
    """The grammar of JSON values valid for ``schema`` (a JSON schema object); RequestError where it is no object."""
    require(param)
    if not isinstance(schema, dict):
        raise RequestError(f"{param}: expected a JSON schema object, got {type(schema).__name__}", param=param)
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(with_options(schema))
    except (ValueError, TypeError) as e:
        raise RequestError(f"{param}: not a usable JSON schema: {e}", param=param) from None


def json_object(param: str) -> str:
    """Any JSON object (``response_format`` ``json_object``)."""
    return json_schema({"type": "object"}, param)


def lark(text: str, param: str) -> str:
    """The grammar of a Lark text (llguidance's dialect: ``%json {schema}`` embeds a schema, ``<[id]>`` a token)."""
    require(param)
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(text)


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def end_token(tokenizer, eos) -> int | None:
    """The token a grammar's reply ends with: the tokenizer's end-of-sequence where it is one of the engine's
    ``eos`` ids, else their lowest."""
    own = getattr(tokenizer, "eos_token_id", None)
    if isinstance(own, int) and own in eos:
        return own
    return min(eos) if eos else None


def advance(reqs, tokens) -> None:
    """Each request's matcher (``Request.matcher``) advanced by its new token; requests without one, ended
    meanwhile or whose grammar is over are skipped."""
    for req, tok in zip(reqs, tokens):
        m = req.matcher
        if m is not None and not req.done and not m.done:
            m.consume(tok)


class Grammars:
    """The grammars of one engine: its tokenizer as llguidance sees it (built once, at first use) and the
    matchers of its requests (see the module docstring). ``vocab``: the model's vocabulary (the logits' width);
    ``eos``: the token that ends a grammar's reply."""

    def __init__(self, tokenizer, vocab: int, eos: int | None):
        self.tokenizer, self.vocab, self.eos = tokenizer, vocab, eos
        self._ll = None
        self._lock = threading.Lock()

    def ll_tokenizer(self):
        """llguidance's tokenizer (built at the first call; any thread)."""
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                if self.tokenizer is None:
                    raise RequestError("constrained decoding needs a tokenizer (this engine has none)")
                self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab, eos_token=self.eos)
            return self._ll

    def use(self, ll_tokenizer) -> None:
        """Use ``ll_tokenizer`` (an ``llguidance.LLTokenizer`` of the model's vocabulary) instead of one built from
        the tokenizer (a bench's model without a tokenizer)."""
        with self._lock:
            self._ll = ll_tokenizer

    def check(self, grammar: str, param: str) -> None:
        """RequestError naming ``param`` where ``grammar`` does not compile for this tokenizer (an invalid schema,
        say). Any thread; the first call builds the tokenizer's view."""
        import llguidance

        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer())
        if error:
            # the first line says what; the rest quotes the grammar built from the request, and where in it
            first = (messages[0] if messages else "").strip().splitlines()
            why = re.sub(r"^at \d+\(\d+\): ", "", first[0]) if first else "the grammar does not compile"
            raise RequestError(f"{param}: {why}", param=param)

    def literal(self, text: str) -> str:
        """A marker's text in a Lark grammar: ``<[id]>`` where it is one token the grammar engine holds special
        (matched by id, as the model emits it), else its text as a string."""
        added = self.tokenizer.get_added_vocab() if self.tokenizer is not None else {}
        tid = added.get(text)
        if tid is not None and tid < self.vocab and self.ll_tokenizer().is_special_token(tid):
            return f"<[{tid}]>"
        return lark_string(text)

    def matcher(self, grammar: str) -> "Matcher":
        import llguidance

        return Matcher(llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0))


class Matcher:
    """One request's place in its grammar (see the module docstring)."""

    def __init__(self, ll):
        self.ll = ll

    @property
    def done(self) -> bool:
        """The grammar's reply has ended (its end token consumed) or the matcher failed: nothing more to mask."""
        return self.ll.is_stopped() or self.ll.is_error()

    @property
    def error(self) -> str | None:
        return self.ll.get_error() if self.ll.is_error() else None

    def consume(self, token: int) -> bool:
        """Advance by a sampled token; False where the grammar does not allow it (the matcher has failed then)."""
        return self.ll.consume_token(token)

    def fill(self, bitmask, row: int) -> None:
        """The allowed next tokens into row ``row`` of ``bitmask`` (int32 [rows, ceil(V / 32)], host memory)."""
        v = bitmask[row]
        self.ll.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
