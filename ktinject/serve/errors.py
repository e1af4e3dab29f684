"""The errors of the serving engine and its API, at the bottom of ``ktinject.serve``: every other module may raise
them, none of them imports anything of the package.

A caller of the engine handles three: ``RequestError`` (bad input: the API's 400, naming the field), ``QueueFull``
(every row busy and the queue at its limit: 429) and ``EngineUnavailable`` (stopping or stopped: 503). ``ApiError``
is the HTTP side's own: a status and OpenAI's error fields, raised inside ``api.py``'s handlers.
"""
from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot take (the API answers 400); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class QueueFull(Exception):
    """The waiting queue is at its limit (the API answers 429)."""


class EngineUnavailable(RuntimeError):
    """The engine is stopping or has stopped (the API answers 503)."""


class ApiError(Exception):
    """An HTTP error reply in OpenAI's shape: ``status``, and the ``type``, ``param`` and ``code`` of its body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code


def check_unicode(text: str, param: str, where: bool = True) -> str:
    """``text`` if it is valid Unicode; else RequestError naming ``param`` and the first unpaired surrogate (JSON's
    "\\ud800" escapes decode to one: no tokenizer takes it), and where it is when ``where`` (``text`` the client's
    own string, not a rendering of its JSON)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        at = f" at character {e.start}" if where else ""
        raise RequestError(f"{param}: an unpaired surrogate U+{ord(text[e.start]):04X}{at} (not valid Unicode text)",
                           param=param) from None
    return text
