"""Which requests are model-addressed, and so go to :class:`router.proxy.Proxy`.

A request is forwarded to a replica of the model its JSON body names when it is
a ``POST`` and its path is

- under ``/v1/`` (OpenAI's API and llama-server's ``/v1/rerank``,
  ``/v1/responses``, ``/v1/messages`` ...: whatever the engine serves; a route
  it lacks gets its own 404), or
- one of llama-server's own model routes (:data:`LLAMA_SERVER_ROUTES`, from
  the routes tools/server registers in llama.cpp).

The body must name a defined model (``"model": "<name>"``), even where
llama-server itself ignores the field (``/tokenize``, ``/detokenize``,
``/apply-template``): it is how the router picks the replica. Other methods on
the paths in :data:`NAMED_PATHS` get 405 from the proxy; everything else goes
to the app's own routes (``/v1/models``, ``/health``, ``/metrics``) or 404.

Read by :class:`router.app.RouterApp` on every request: two string checks.
"""

from __future__ import annotations

V1_PREFIX = "/v1/"

LLAMA_SERVER_ROUTES = frozenset(
    {
        "/completion", "/completions", "/chat/completions", "/embedding", "/embeddings",
        "/infill", "/tokenize", "/detokenize", "/apply-template", "/rerank", "/reranking",
    }
)  # fmt: skip

# The routes clients are told about; a GET on one of them is 405, not 404.
NAMED_PATHS = frozenset(
    {
        "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank",
        "/v1/responses", *LLAMA_SERVER_ROUTES,
    }
)  # fmt: skip


def proxied(method: str, path: str) -> bool:
    """``True`` when the proxy answers ``method path`` (forwarding it, or 405).

    A path with a dot segment (``/v1/../slots``, however encoded: ASGI's path is
    percent-decoded, ``%2e%2e`` included) is never proxied: the upstream URL would
    resolve it to a route outside ``/v1/``, such as llama-server's slot actions
    (found by a new user, issue 10). It gets the app's 404."""
    if method == "POST":
        if "/." in path:
            return False
        return path.startswith(V1_PREFIX) or path in LLAMA_SERVER_ROUTES
    return path in NAMED_PATHS
