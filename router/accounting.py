"""Token accounting: reading each answer's ``usage`` on its way to the client.

Used by :mod:`router.proxy` (request side, whole answers) and
:mod:`router.streaming` (streams); the counts go to
:meth:`router.metrics.RequestMetrics.account`, by model and key name.

Where the counts come from (measured on the bootstrap's llama-server, b11434):

- a whole answer (``/v1/chat/completions``, ``/v1/completions``,
  ``/v1/embeddings``...) carries a top-level ``usage`` object::

      "usage": {"completion_tokens": 5, "prompt_tokens": 26, "total_tokens": 31,
                "prompt_tokens_details": {"cached_tokens": 0}}

  beside llama-server's own ``timings`` (``cache_n``, ``prompt_n``,
  ``predicted_n``). The portable ``usage`` is read, not ``timings``:
  ``prompt_tokens_details.cached_tokens`` equals ``timings.cache_n``;
- a chat stream carries ``usage`` only when asked (OpenAI's
  ``stream_options: {"include_usage": true}``), as one more event before
  ``data: [DONE]`` whose ``choices`` is empty; unasked, its last event carries
  llama-server's ``timings`` instead, and those are read
  (:func:`parse_timings`: ``prompt_n + cache_n`` prompt tokens, ``cache_n``
  cached, ``predicted_n`` completion: the same numbers, checked against each
  other by tests/integration/test_serving.py). So by default the router does
  not change the request: the client gets the replica's bytes;
- a ``/v1/completions`` stream carries ``usage`` in its last choice event
  whether asked or not (llama-server ignores the option there); llama-server's
  own ``/completion`` carries ``timings``.

Asking for usage (:func:`ask_for_usage`, ``LLMGW_ROUTER_ASK_STREAM_USAGE``, off
by default) is for engines that send neither: the option is added to the
request body when the client did not ask, and the stream strips that event
(:class:`StreamMeter` with ``strip``). It is off because on llama-server it
costs the client the ``timings`` of the last choice event (llama-server moves
them into the usage event, which is stripped): the llama.cpp web UI shows its
speed from them.

Reading costs two substring searches per chunk (``"usage":``, ``"timings":``)
and one JSON parse of the event that holds them (every event, only when a
client asks llama-server for ``timings_per_token``): no event the client gets
is re-serialised, and only a stripping stream holds back the unfinished end of
a chunk until its event ends (a partial event is of no use to a client
anyway). Usage in other shapes (input/output tokens of ``/v1/responses`` and
``/v1/messages``) is read when it sits at the top level; the nested usage of
their streams is not (not metered, see ``llmgw_router_unmetered_requests_total``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from router.sse import EVENT_END, EVENT_SPLIT, whole_events

# The routes whose streams take OpenAI's stream_options (llama-server's OAI
# handlers: tools/server registers /chat/completions as the same handler).
STREAM_OPTION_ROUTES = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions"})

_USAGE_KEY = b'"usage":'
_TIMINGS_KEY = b'"timings":'
_DATA = b"data:"
_INCLUDE_USAGE = b'"stream_options":{"include_usage":true},'
# Longer unfinished events are not scanned (or held) further: a usage event is
# a few hundred bytes; a choice event with a long text may be larger, but then
# it is passed on and only its usage, if any, is missed.
MAX_EVENT_BYTES = 64 * 1024

_decoder = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one answer, as its replica reported them.

    ``cached``: the part of ``prompt`` served from the replica's prompt cache
    (llama-server's ``prompt_tokens_details.cached_tokens``), not extra tokens.
    """

    prompt: int
    cached: int
    completion: int


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def parse_usage(usage: Any) -> Usage | None:
    """A :class:`Usage` from a ``usage`` object (OpenAI's ``prompt_tokens`` /
    ``completion_tokens``, or ``input_tokens`` / ``output_tokens``); ``None``
    when it holds no prompt count."""
    if not isinstance(usage, dict):
        return None
    prompt = _count(usage.get("prompt_tokens", usage.get("input_tokens")))
    if prompt is None:
        return None
    completion = _count(usage.get("completion_tokens", usage.get("output_tokens", 0))) or 0
    details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(prompt, min(cached or 0, prompt), completion)


def parse_timings(timings: Any) -> Usage | None:
    """A :class:`Usage` from llama-server's ``timings`` object (``cache_n``,
    ``prompt_n``, ``predicted_n``), or ``None``."""
    if not isinstance(timings, dict):
        return None
    cached = _count(timings.get("cache_n"))
    fresh = _count(timings.get("prompt_n"))
    completion = _count(timings.get("predicted_n"))
    if cached is None or fresh is None or completion is None:
        return None
    return Usage(fresh + cached, cached, completion)


def whole_usage(body: bytes) -> Usage | None:
    """The top-level ``usage`` of a whole JSON answer, else its ``timings``
    (llama-server's own routes), or ``None``.

    Parses only the object after the last ``"usage":`` (llama-server writes it
    near the end): a bare ``"usage":`` cannot occur inside a JSON string (its
    quotes would be escaped), so the last one is a key.
    """
    usage = parse_usage(_last_object(body, _USAGE_KEY))
    return usage if usage is not None else parse_timings(_last_object(body, _TIMINGS_KEY))


def _last_object(body: bytes, key: bytes) -> Any:
    at = body.rfind(key)
    if at < 0:
        return None
    try:
        value, _ = _decoder.raw_decode(body[at + len(key) :].decode().lstrip())
    except (ValueError, RecursionError):
        return None
    return value


def ask_for_usage(body: bytes | bytearray, doc: dict[str, Any]) -> bytes | None:
    """``body`` with ``stream_options.include_usage`` set, or ``None`` when the
    client asked for usage already (then its stream is left as it is).

    ``doc``: ``body`` parsed. Without ``stream_options`` the option is spliced in
    after the opening brace (one copy of the body, no re-serialising); with one,
    the body is parsed again by :func:`json.loads` and serialised, as a
    duplicate key would leave the client's value in force. Again, not ``doc``:
    it may come from orjson (:func:`router.bodies.parse_request`), which reads
    an integer past 64 bits as a float, and what the client sent must reach
    the replica unchanged.
    """
    options = doc.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return None
    if options is None and "stream_options" not in doc:
        brace = body.index(b"{") + 1
        return bytes(body[:brace]) + _INCLUDE_USAGE + bytes(body[brace:])
    exact = json.loads(body)
    options = exact.get("stream_options")
    merged = dict(options) if isinstance(options, dict) else {}
    merged["include_usage"] = True
    return json.dumps({**exact, "stream_options": merged}).encode()


class StreamMeter:
    """Reads the usage of one event stream as it passes; times its first byte.

    :meth:`feed` returns what of a chunk goes to the client: the chunk itself,
    unless ``strip`` (the router asked for usage the client did not), when the
    usage event is dropped and an unfinished event is held until it ends.
    """

    __slots__ = ("_rest", "_timed", "events", "first_at", "strip", "usage")

    def __init__(self, strip: bool = False) -> None:
        self.strip = strip
        self.usage: Usage | None = None
        # Whole events passed to the client: the completion tokens it got, at most one
        # off, when no usage came (a client that left before the last event: issue 23's
        # QA spent 312 tokens of a 100-token budget that way). llama-server sends one
        # token per event.
        self.events = 0
        # usage came from timings, so a later usage object replaces it.
        self._timed = False
        # perf_counter() when the first byte of the stream arrived.
        self.first_at: float | None = None
        # The unfinished event at the end of what was fed (held or only scanned).
        self._rest = b""

    def feed(self, chunk: bytes) -> bytes:
        """What of ``chunk`` the client gets now."""
        if not chunk:
            return chunk
        if self.first_at is None:
            self.first_at = time.perf_counter()
        data = self._rest + chunk if self._rest else chunk
        if data.endswith(EVENT_END):  # llama-server's framing, and whole: the common case
            whole, self._rest = data, b""
        else:
            end = whole_events(data)
            whole, rest = data[:end], data[end:]
            if len(rest) > MAX_EVENT_BYTES:
                # Not a usage event: pass what was held, scan no further into it.
                self._rest = b""
                return self._strip(whole) + rest if self.strip else chunk
            self._rest = rest
        self.events += whole.count(_DATA)
        if not self.strip:
            if _USAGE_KEY in whole or _TIMINGS_KEY in whole:
                for event in EVENT_SPLIT.split(whole)[::2]:
                    self._read(event)
            return chunk
        return self._strip(whole)

    def flush(self) -> bytes:
        """What was held when the stream ended (an unfinished last event)."""
        rest, self._rest = self._rest, b""
        return rest if self.strip else b""

    def _strip(self, whole: bytes) -> bytes:
        if _USAGE_KEY not in whole and _TIMINGS_KEY not in whole:
            return whole
        # [event, end, event, end, ..., b""]: each event kept with its own end.
        parts = EVENT_SPLIT.split(whole)
        return b"".join(
            parts[i] + parts[i + 1] for i in range(0, len(parts) - 1, 2) if not self._read(parts[i])
        )

    def _read(self, event: bytes) -> bool:
        """Take the usage (else the timings) of ``event`` if it has one; whether it
        is the extra usage event (no choices) a stripping stream drops."""
        if _USAGE_KEY not in event and _TIMINGS_KEY not in event:
            return False
        at = event.find(_DATA)
        if at < 0:
            return False
        try:
            doc = json.loads(event[at + len(_DATA) :])
        except (ValueError, RecursionError):
            return False
        if not isinstance(doc, dict):
            return False
        usage = parse_usage(doc.get("usage"))
        if usage is None:
            if self.usage is None or self._timed:
                timed = parse_timings(doc.get("timings"))
                if timed is not None:
                    self.usage, self._timed = timed, True
            return False
        self.usage, self._timed = usage, False
        return self.strip and doc.get("choices") == []
