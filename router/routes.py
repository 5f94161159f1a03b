"""Which requests are model-addressed, and the exact path their replica receives.

A request goes to :class:`router.proxy.Proxy` when the path it was sent with,
byte for byte as it came over the wire (ASGI's ``raw_path``, before any
percent-decoding), is one of :data:`MODEL_ROUTES`: llama-server's model routes,
OpenAI's under ``/v1/`` and its own (from the routes tools/server registers in
llama.cpp). The body must name a defined model (``"model": "<name>"``), even
where llama-server itself ignores the field (``/tokenize``, ``/detokenize``,
``/apply-template``): it is how the router picks the replica. Other methods on
those paths get 405 from the proxy; everything else goes to the app's own routes
(``/v1/models``, ``/health``, ``/metrics``) or the app's 404, and no replica
hears of it.

Why an exact match on the raw path, not a check of a decoded one: every layer
between client and replica decodes or normalises paths its own way (uvicorn
percent-decodes once; yarl decoded ``%2e`` again and resolved dot segments, so
``/v1/%252e%252e/slots/0`` reached llama-server's slot actions, issue 18;
servers differ on ``;`` parameters, backslashes, ``//``, ``%2f`` and overlong
UTF-8). A path that is one of a fixed set of plain ASCII strings
(``[a-z/-]`` only) means the same thing to all of them, so no encoding form of
anything else can be judged allowed. The replica receives the route from this
table, not the client's bytes, and the upstream URL is built with no further
decoding (:meth:`router.endpoint.Endpoint.url`). Not reachable through the
router, whatever the encoding: ``/slots*``, ``/props``, ``/lora-adapters``, a
replica's ``/metrics`` and ``/health``, ``/v1/chat/completions/control``, and any
route a later llama-server adds until it is listed here.

The query string goes on unchanged when it is printable ASCII without ``#``
(:func:`upstream_query`); otherwise the request is refused (400).

Read by :class:`router.app.RouterApp` on every request: one set lookup.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

V1_ROUTES = frozenset(
    {
        "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/rerank",
        "/v1/reranking", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
    }
)  # fmt: skip

LLAMA_SERVER_ROUTES = frozenset(
    {
        "/completion", "/completions", "/chat/completions", "/embedding", "/embeddings",
        "/infill", "/tokenize", "/detokenize", "/apply-template", "/rerank", "/reranking",
    }
)  # fmt: skip

MODEL_ROUTES: frozenset[str] = V1_ROUTES | LLAMA_SERVER_ROUTES
"""Every path the router forwards (``POST``), as the replica receives it."""

_BY_RAW_PATH: dict[bytes, str] = {route.encode("ascii"): route for route in MODEL_ROUTES}

# Printable ASCII but "#" (a fragment is never sent); "%" stays: the replica decodes it.
_QUERY_BYTES = frozenset(range(0x21, 0x7F)) - {ord("#")}


def model_route(scope: Mapping[str, Any]) -> str | None:
    """The route the replica receives for this request, or ``None``: not model-addressed.

    Judged on ``scope["raw_path"]`` (the request target's path exactly as sent);
    an ASGI server that omits it is judged on ``scope["path"]``, which can only
    match a route whose raw form decoded to it, and the replica still receives
    the route from :data:`MODEL_ROUTES`, never the client's spelling.
    """
    raw = scope.get("raw_path")
    if raw is None:
        raw = scope["path"].encode("utf-8", "surrogateescape")
    return _BY_RAW_PATH.get(raw)


def upstream_query(query_string: bytes) -> str | None:
    """``query_string`` as the upstream URL carries it (``""`` for none), or ``None``
    when it holds a byte no URL may (control, space, non-ASCII) or a ``#``."""
    if not query_string:
        return ""
    if not _QUERY_BYTES.issuperset(query_string):
        return None
    return query_string.decode("ascii")
