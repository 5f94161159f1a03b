"""A replica's errors in OpenAI's shape, so a client sees one kind of error object.

llama-server's errors (``format_error_response`` in llama.cpp
tools/server/server-common.cpp) carry a numeric ``code`` (the HTTP status)
and a ``type`` of its own (``exceed_context_size_error``,
``unavailable_error`` ...), sometimes with extra fields
(``n_prompt_tokens``, ``n_ctx``)::

    {"error": {"code": 400, "message": "...", "type": "exceed_context_size_error",
               "n_prompt_tokens": 1500, "n_ctx": 1024}}

OpenAI's error object has ``message``, ``type``, ``param`` and ``code``, the
last a string or null (platform.openai.com/docs/guides/error-codes; an
over-long prompt is ``invalid_request_error`` / ``context_length_exceeded``).
:func:`translate` maps llama-server's ``type`` to OpenAI's ``type`` and a
string ``code`` (:data:`TYPES`; an unknown one keeps its name as the code),
and keeps every other field beside them. Two places need it, both in
:mod:`router.proxy` and :mod:`router.streaming`:

- a non-streaming error answer (status >= 400): :func:`error_answer`, which
  also wraps a body that is not an error object at all (an HTML page from a
  proxy, httplib's plain 404) as one;
- an error event inside a stream (``data: {"error": {...}}``, what
  llama-server sends when generation fails after the stream began):
  :class:`StreamErrors`, which rewrites such events and passes every other
  byte through unchanged.
"""

from __future__ import annotations

import json
from typing import Any

from router.sse import EVENT_END, EVENT_SPLIT, whole_events

# llama-server's error type -> (OpenAI's type, OpenAI-style code). Every code is a
# string (issue 21: one error shape): an SDK user branches on it.
TYPES: dict[str, tuple[str, str]] = {
    "invalid_request_error": ("invalid_request_error", "invalid_request"),
    "exceed_context_size_error": ("invalid_request_error", "context_length_exceeded"),
    "authentication_error": ("invalid_request_error", "invalid_api_key"),
    "permission_error": ("invalid_request_error", "permission_denied"),
    "not_found_error": ("invalid_request_error", "not_found"),
    "not_supported_error": ("invalid_request_error", "not_supported"),
    "unavailable_error": ("server_error", "replica_unavailable"),
    "server_error": ("server_error", "replica_error"),
}

# OpenAI's two types: under them a string code an error carries is kept.
_GENERIC_TYPES = frozenset({"invalid_request_error", "server_error"})

# The start of an error event in llama-server's stream (format_oai_sse).
_ERROR_EVENT = b'data: {"error"'
# Bytes of an unfinished event held back at most: llama-server's events are one
# token each (an error event, a usage event: a few hundred bytes); a longer one
# passes unheld, so a replica that never ends an event costs no memory.
HOLD_LIMIT = 64 * 1024
# Bytes of a body that is not an error object kept in the message.
_TEXT_LIMIT = 2000


def _type_for(status: int) -> str:
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


def translate(error: dict[str, Any], status: int) -> dict[str, Any]:
    """``error`` (the inside of ``{"error": ...}``) in OpenAI's shape: ``message``
    (a string; the error's JSON when it has none), ``type``, ``param`` (a string or
    null), ``code`` (always a non-empty string) first, then llama-server's other
    fields unchanged. ``status`` decides the type of an error without one. An error
    already in OpenAI's shape (a type of its own, a string or null ``code``) keeps its
    type, and a null or empty code becomes the type's name; one with neither a known
    type nor a string code gets :data:`TYPES`' code for the type its status gives."""
    code = error.get("code")
    kind = error.get("type")
    if not isinstance(kind, str) or not kind:
        kind = None
    if kind is not None and kind not in TYPES and (code is None or isinstance(code, str)):
        openai_type, openai_code = kind, code or kind
    else:
        known = None if kind is None else TYPES.get(kind)
        if known is None:
            openai_type = _type_for(status)
            openai_code = kind or TYPES[openai_type][1]
        else:
            openai_type, openai_code = known
        if isinstance(code, str) and code and (kind is None or kind in _GENERIC_TYPES):
            openai_code = code  # a string code says more than a generic or no type
    message = error.get("message")
    param = error.get("param")
    out: dict[str, Any] = {
        "message": message if isinstance(message, str) else json.dumps(error),
        "type": openai_type,
        "param": param if isinstance(param, str) else None,
        "code": openai_code,
    }
    for key, value in error.items():
        if key not in out:
            out[key] = value
    return out


def error_answer(body: bytes, status: int, model: str) -> bytes:
    """The body a client gets for a replica's error answer with ``status``: its
    error object translated, or, for a body that holds none, one that quotes it."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        error = translate(doc["error"], status)
    else:
        text = body[:_TEXT_LIMIT].decode("utf-8", "replace").strip()
        if isinstance(doc, dict) and isinstance(doc.get("error"), str):
            text = doc["error"]
        error = {
            "message": f"The model `{model}` replica answered {status}: {text or '(no body)'}",
            "type": _type_for(status),
            "param": None,
            "code": "upstream_error",
        }
    return json.dumps({"error": error}).encode()


class StreamErrors:
    """Rewrites the error events of one event stream, chunk by chunk, and passes
    only whole events.

    A chunk's unfinished last event is held until it ends (or :meth:`flush`), so a
    stream the replica breaks off mid-event never hands the client half an event:
    the router's own error event would follow it, and an SDK that reads the half
    as an event of its own fails on its JSON before it reads the error (the OpenAI
    SDK's JSONDecodeError, found in review). A stream framed as llama-server frames
    it (one write per event) passes with no delay and no copy; a chunk is scanned
    for an error event's start, which is all a token costs. An unfinished event
    longer than :data:`HOLD_LIMIT` is passed on as it comes.
    """

    __slots__ = ("_held", "_status")

    def __init__(self, status: int = 500) -> None:
        self._held = b""
        self._status = status

    def feed(self, chunk: bytes) -> bytes:
        """What of ``chunk`` (after what was held) can go to the client now."""
        if self._held:
            chunk = self._held + chunk
            self._held = b""
        if not chunk.endswith(EVENT_END):
            tail = chunk[whole_events(chunk) :]
            if len(tail) <= HOLD_LIMIT:
                self._held = tail
                chunk = chunk[: len(chunk) - len(tail)]
        if _ERROR_EVENT not in chunk:
            return chunk
        return b"".join(self._event(part) for part in EVENT_SPLIT.split(chunk))

    def flush(self) -> bytes:
        """What was held when the stream ended."""
        held, self._held = self._held, b""
        return self._event(held) if held else b""

    def _event(self, event: bytes) -> bytes:
        """``event`` (or a blank line between two) with its error in OpenAI's shape."""
        body = event.lstrip(b"\r\n")
        if not body.startswith(_ERROR_EVENT):
            return event
        try:
            doc = json.loads(body[len(b"data: ") :])
        except (ValueError, RecursionError):
            return event
        if not isinstance(doc, dict) or not isinstance(doc.get("error"), dict):
            return event
        error = doc["error"]
        code = error.get("code")
        status = code if isinstance(code, int) else self._status
        head = event[: len(event) - len(body)]
        return head + b"data: " + json.dumps({"error": translate(error, status)}).encode()
