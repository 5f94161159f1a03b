"""Spellings of a path that some layer between a client and a replica might decode,
normalise or split into one of llama-server's private routes (issue 18).

Dot segments (plain, percent-encoded once, twice, thrice, mixed case, overlong
UTF-8, ``%u``), ``//``, ``;`` parameters, backslashes, ``%2f`` and ``%5c``, NUL,
case, trailing slashes, a route llama-server adds that the router does not list,
and the private routes themselves. Used by tests/unit/router/test_routes.py (the
judge) and tests/integration/test_router_security.py (over HTTP).
"""

REFUSED = (
    "/v1/%252e%252e/slots/0", "/v1/%2e%2e/slots/0", "/v1/../slots/0", "/v1/..%2fslots/0",
    "/v1/%2E%2E/props", "/v1/.%2e/lora-adapters", "/v1/%252E%252E%252Fslots/0",
    "/v1/%25252e%25252e/slots/0", "/v1/%c0%ae%c0%ae/slots/0", "/v1/%u002e%u002e/slots/0",
    "/v1/%e0%80%ae%e0%80%ae/metrics", "//slots/0", "/v1//../slots/0", "/v1/..;/slots/0",
    "/v1/completions/..;/../slots/0", "/v1\\..\\slots\\0", "/v1/%5c..%5cslots/0",
    "/v1/completions%2f..%2f..%2fslots/0", "/v1/completions/../../metrics", "/./slots/0",
    "/v1/./../health", "/slots", "/slots/0", "/props", "/lora-adapters", "/metrics",
    "/health", "/v1/health", "/v1/models", "/v1/chat/completions/control",
    "/v1/completions;x=1", "/V1/completions", "/v1/completions/", "/v1/completions%00",
    "/v1/comp%6cetions", "/v1/completions%20", "/%2fv1/completions", "/v1/./completions",
    "/v1/anything",
)  # fmt: skip
