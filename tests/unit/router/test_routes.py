"""router.routes: the path judge, and the upstream URL it leads to (issue 18).

The same forms go over real HTTP through `router serve` in
tests/integration/test_router_path.py; here the judge alone, on the ASGI scope
uvicorn builds (``raw_path`` as sent, ``path`` decoded once).
"""

from __future__ import annotations

import urllib.parse

from router.catalog import ServiceAddress
from router.endpoint import Endpoint
from router.routes import LLAMA_SERVER_ROUTES, MODEL_ROUTES, model_route, upstream_query
from tests.support.path_forms import REFUSED


def scope(raw_path: str) -> dict:
    """The scope uvicorn's httptools protocol builds for a request target's path."""
    return {"raw_path": raw_path.encode(), "path": urllib.parse.unquote(raw_path)}


def test_every_spelling_of_a_private_route_is_refused() -> None:
    for raw in (*REFUSED, "", "*"):
        assert model_route(scope(raw)) is None, raw


def test_each_model_route_is_forwarded_as_itself_and_yarl_leaves_it_alone() -> None:
    endpoint = Endpoint(ServiceAddress("127.0.0.1", 8080), 4)
    assert "/v1/chat/completions" in MODEL_ROUTES and "/tokenize" in LLAMA_SERVER_ROUTES
    for route in MODEL_ROUTES:
        assert model_route(scope(route)) == route
        url = endpoint.url(f"{route}?a=%2e%2e/b")
        assert (url.raw_path, url.raw_query_string) == (route, "a=%2e%2e/b"), url


def test_the_url_is_not_normalised_even_for_a_path_the_judge_would_refuse() -> None:
    # What made issue 18: yarl decoded %2e and resolved the dot segments.
    url = Endpoint(ServiceAddress("127.0.0.1", 8080), 4).url("/v1/%2e%2e/slots/0")
    assert url.raw_path == "/v1/%2e%2e/slots/0"


def test_without_raw_path_the_decoded_path_is_judged() -> None:
    assert model_route({"path": "/v1/completions"}) == "/v1/completions"
    assert model_route({"path": "/v1/../slots/0"}) is None


def test_query_strings() -> None:
    assert upstream_query(b"") == ""
    assert upstream_query(b"a=1&b=%20") == "a=1&b=%20"
    for bad in (b"a=1#x", b"a= 1", b"a=\x00", b"a=\xff", b"a=\r\n"):
        assert upstream_query(bad) is None, bad
