"""Body parsing, the refusals the proxy answers itself, and when it retries
(router.proxy, router.app).

The retry tests run the app over ASGI in the test's event loop in front of
real aiohttp replicas on 127.0.0.1: one that reads the request and then drops
the connection (closed, or reset), one that answers, and a port nobody
listens on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from fastapi import FastAPI
from starlette.testclient import TestClient

from llmgw_contract import ModelRecord
from router import errors
from router.app import create_app
from router.catalog import ServiceAddress
from router.proxy import (
    REPLICA_HEADER_MAX_BYTES,
    REPLICA_HEADERS_FORWARDED_MAX,
    REPLICA_TARGET_MAX,
    _target,
    extract_model,
)
from router.settings import RouterSettings
from tests.support.router_harness import (
    LocalServer,
    RouterUnderTest,
    asgi_messages,
    asgi_post,
    free_port,
    in_process_router,
    router_app,
    run,
)


def test_extract_model() -> None:
    assert extract_model(b'{"model": "m", "prompt": "x"}') == "m"
    for bad in (b"{", b"[]", b"{}", b'{"model": 3}', b'{"model": ""}'):
        with pytest.raises(errors.InvalidRequest):
            extract_model(bad)


@pytest.fixture
def client() -> TestClient:
    # No lifespan: no Consul and no upstream pool, the table is filled by hand.
    # Activation off: it needs the planner client the lifespan opens
    # (tests/unit/router/test_activation.py covers it).
    app = router_app(RouterSettings(activation=False), models=("ready-later",))
    return TestClient(app, raise_server_exceptions=False)


def error_of(response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_unknown_model_is_404(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json={"model": "nope"})
    assert response.status_code == 404
    assert error_of(response)["code"] == "model_not_found"


def test_model_without_endpoint_is_503(client: TestClient) -> None:
    response = client.post("/v1/embeddings", json={"model": "ready-later"})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "5"
    assert error_of(response)["code"] == "model_not_ready"


def test_bad_body_method_and_route(client: TestClient) -> None:
    assert client.post("/v1/completions", content=b"nope").status_code == 400
    response = client.get("/v1/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert error_of(response)["code"] == "method_not_allowed"
    response = client.get("/v2/whatever")
    assert response.status_code == 404
    assert error_of(response)["code"] == "not_found"
    # Exact paths: no redirect to the slash-less one on the client's Host (review).
    for path in ("/health/", "/metrics/"):
        response = client.get(path, headers={"host": "evil.example"}, follow_redirects=False)
        assert response.status_code == 404 and "location" not in response.headers, path
        assert error_of(response)["code"] == "not_found"


def test_models_health_and_metrics(client: TestClient) -> None:
    models = client.get("/v1/models").json()
    assert models == {
        "object": "list",
        "data": [{"id": "ready-later", "object": "model", "created": 0, "owned_by": "llmgw"}],
    }
    assert client.get("/health").json()["status"] == "ok"
    client.post("/v1/completions", json={"model": "nope"})
    text = client.get("/metrics").text
    assert 'llmgw_router_endpoints{model="ready-later"} 0.0' in text
    assert 'llmgw_router_requests_total{code="404",model=""} 1.0' in text


def test_health_is_503_until_models_were_read() -> None:
    client = TestClient(create_app(RouterSettings()))
    assert client.get("/health").status_code == 503


def test_no_endpoint_policy_is_pluggable() -> None:
    async def parked(entry) -> None:
        raise errors.ModelUnavailable(f"{entry.name} is parked", retry_after_s=None)

    app = create_app(RouterSettings(), no_endpoint=parked)
    app.state.table.set_models({"p": ModelRecord(name="p", definition_hash="h", replicas=0)})
    response = TestClient(app).post("/v1/completions", json={"model": "p"})
    assert response.status_code == 503
    assert error_of(response)["message"] == "p is parked"


# --- no request runs twice ---------------------------------------------------------


class Replica(LocalServer):
    """A real aiohttp replica that records every request it read. ``drop``:
    after reading the whole request, close the connection (``"close"``) or
    reset it (``"reset"``) instead of answering, as a server that crashes
    mid-request does."""

    def __init__(self, drop: str | None = None) -> None:
        self.drop = drop
        self.seen: list[dict] = []
        super().__init__(web.post("/v1/completions", self._handle))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(await request.json())
        if self.drop is None:
            return web.json_response({"object": "text_completion"})
        transport = request.transport
        assert transport is not None
        if self.drop == "reset":
            transport.abort()
        else:
            transport.close()
        return web.Response()  # goes nowhere: the connection is gone


async def post(app: FastAPI, n: int) -> tuple[int | None, dict]:
    status, _, body = await asgi_post(app, {"model": "m", "prompt": f"request {n}"})
    return status, body


@contextlib.asynccontextmanager
async def route_to(*addresses: ServiceAddress) -> AsyncIterator[FastAPI]:
    settings = RouterSettings(activation=False, replica_concurrency=4)
    async with in_process_router(settings, replicas=2) as app:
        app.state.table.set_endpoints("m", addresses)
        yield app


@pytest.mark.parametrize("drop", ["close", "reset"])
def test_a_request_that_reached_a_replica_is_never_sent_to_another(drop: str) -> None:
    async def scenario() -> None:
        dropper, good = Replica(drop), Replica()
        addresses = await dropper.start(), await good.start()
        try:
            async with route_to(*addresses) as app:
                results = [await post(app, n) for n in range(6)]
                ejected = RouterUnderTest(app, dropper).metric(
                    "llmgw_router_replica_ejections_total", model="m", reason="connection_broken"
                )
        finally:
            await dropper.stop()
            await good.stop()
        statuses = [status for status, _ in results]
        # Least-loaded with rotation sends every other request to the dropper, until
        # its second broken connection in a row ejects it (found in review: never
        # ejected, it failed half of all requests).
        assert ejected == 1
        assert statuses.count(502) == len(dropper.seen) == 2
        assert statuses.count(200) == len(good.seen) == 4
        seen = [r["prompt"] for r in dropper.seen + good.seen]
        assert sorted(seen) == [f"request {n}" for n in range(6)]  # each exactly once
        error = next(body["error"] for status, body in results if status == 502)
        assert error["code"] == "upstream_unavailable"
        assert "failed after the request was sent" in error["message"]
        assert "not retried on another replica" in error["message"]

    run(scenario())


def test_a_replica_that_cannot_be_connected_to_is_retried_on_another() -> None:
    async def scenario() -> None:
        good = Replica()
        refused = ServiceAddress("127.0.0.1", free_port())  # nobody listens
        address = await good.start()
        try:
            async with route_to(refused, address) as app:
                statuses = [(await post(app, n))[0] for n in range(4)]
                assert statuses == [200] * 4 and len(good.seen) == 4
                # Only the refusing replica left: nothing to retry on.
                app.state.table.set_endpoints("m", [refused])
                status, body = await post(app, 9)
                assert status == 502 and body["error"]["code"] == "upstream_unavailable"
                assert "could be connected to (1 tried)" in body["error"]["message"]
        finally:
            await good.stop()

    run(scenario())


class HeaderReplica(LocalServer):
    """A real aiohttp replica that records the headers of each request."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        super().__init__(web.post("/v1/completions", self._handle))

    async def _handle(self, request: web.Request) -> web.Response:
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        return web.json_response({"object": "text_completion"})


def test_headers_the_connection_header_names_are_not_forwarded() -> None:
    """RFC 9110 7.6.1: a header named in ``Connection`` is for that hop only."""

    async def scenario() -> None:
        replica = HeaderReplica()
        address = await replica.start()
        try:
            async with in_process_router(
                RouterSettings(activation=False, replica_concurrency=4)
            ) as app:
                app.state.table.set_endpoints("m", [address])
                sent = [
                    (b"connection", b"keep-alive, X-Hop ,x-other"),
                    (b"x-hop", b"1"),
                    (b"x-other", b"2"),
                    (b"x-end-to-end", b"3"),
                ]
                status, _, _ = await asgi_post(app, {"model": "m", "prompt": "hi"}, headers=sent)
                assert status == 200
        finally:
            await replica.stop()
        got = replica.headers[0]
        assert got["x-end-to-end"] == "3"
        assert "x-hop" not in got and "x-other" not in got, got

    run(scenario())


def test_a_utf8_header_reaches_the_replica_unchanged_and_other_bytes_are_refused() -> None:
    """Found in review: values were decoded as latin-1, which aiohttp sends as UTF-8,
    so every byte over 0x7f arrived as two."""

    async def scenario() -> None:
        replica = HeaderReplica()
        address = await replica.start()
        try:
            async with route_to(address) as app:
                utf8 = [(b"x-user", "Zoë 東京".encode())]
                status, _, _ = await asgi_post(app, {"model": "m"}, headers=utf8)
                assert status == 200
                status, _, body = await asgi_post(
                    app, {"model": "m"}, headers=[(b"x-user", b"Zo\xeb")]
                )
                assert status == 400 and body["error"]["code"] == "invalid_request", body
                assert "x-user is not UTF-8" in body["error"]["message"], body
        finally:
            await replica.stop()
        assert [h["x-user"] for h in replica.headers] == ["Zoë 東京"]

    run(scenario())


def test_headers_a_replica_would_refuse_get_the_router_s_431() -> None:
    """llama-server (cpp-httplib) refuses a header line over 8 KiB and more than 100
    lines with an empty 400 (found in review: the client got "replica answered 400:
    (no body)"); the router answers 431 itself and the replica is never asked."""

    async def scenario() -> None:
        replica = HeaderReplica()
        address = await replica.start()
        # asgi_post sends content-type: one forwarded line besides these.
        many = REPLICA_HEADERS_FORWARDED_MAX - 1
        cases = [
            ([(b"x-big", b"a" * (REPLICA_HEADER_MAX_BYTES - 5))], 200),
            ([(b"x-big", b"a" * (REPLICA_HEADER_MAX_BYTES - 4))], 431),
            ([(b"x-h%d" % i, b"v") for i in range(many)], 200),
            ([(b"x-h%d" % i, b"v") for i in range(many + 1)], 431),
            # Lines the router drops are not the replica's to count.
            ([(b"host", b"a" * 9000), *((b"x-h%d" % i, b"v") for i in range(many))], 200),
        ]
        try:
            async with in_process_router(
                RouterSettings(activation=False, replica_concurrency=4)
            ) as app:
                app.state.table.set_endpoints("m", [address])
                for headers, expected in cases:
                    status, _, body = await asgi_post(app, {"model": "m"}, headers=headers)
                    assert status == expected, (len(headers), body)
                    if expected == 431:
                        assert body["error"]["code"] == "request_header_fields_too_large"
                        assert "llama-server" in body["error"]["message"], body
        finally:
            await replica.stop()
        assert len(replica.headers) == 3

    run(scenario())


class RedirectingReplica(LocalServer):
    """A FAKE replica that answers a completion with a redirect to its own
    ``/elsewhere`` (llama-server never redirects; a proxy in front of it might)."""

    def __init__(self) -> None:
        self.followed = 0
        super().__init__(
            web.post("/v1/completions", self._redirect), web.post("/elsewhere", self._elsewhere)
        )

    async def _redirect(self, request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect("/elsewhere")

    async def _elsewhere(self, request: web.Request) -> web.Response:
        self.followed += 1
        return web.json_response({"object": "text_completion"})


def test_a_replica_s_redirect_goes_to_the_client_unfollowed() -> None:
    """Found in review: the router followed a replica's 302 and returned what it
    pointed to as a 200."""

    async def scenario() -> None:
        replica = RedirectingReplica()
        address = await replica.start()
        try:
            async with route_to(address) as app:
                start = (await asgi_messages(app, {"model": "m"}))[0]
                headers = {k.lower(): v for k, v in start["headers"]}
                assert start["status"] == 307 and headers[b"location"] == b"/elsewhere", start
        finally:
            await replica.stop()
        assert replica.followed == 0

    run(scenario())


def test_a_target_longer_than_a_replica_takes_gets_the_router_s_414() -> None:
    """Found in review: llama-server drops a request line over about 32 KiB unanswered,
    and the broken connection counted toward ejecting a healthy replica."""

    async def scenario() -> None:
        replica = HeaderReplica()
        address = await replica.start()
        room = REPLICA_TARGET_MAX - len("/v1/completions?q=")
        try:
            async with route_to(address) as app:
                # (aiohttp, the replica here, takes a request line of 8,190 bytes.)
                for size, expected in ((4_000, 200), (room + 1, 414), (40_000, 414)):
                    status, _, body = await asgi_post(
                        app, {"model": "m"}, query=b"q=" + b"a" * size
                    )
                    assert status == expected, (size, body)
                    if expected == 414:
                        assert body["error"]["code"] == "uri_too_long", body
        finally:
            await replica.stop()
        assert len(replica.headers) == 1
        assert _target(scope_for(b"q=" + b"a" * room)) == "/v1/completions?q=" + "a" * room

    run(scenario())


def scope_for(query: bytes) -> dict:
    return {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": query}


def test_the_proxy_finds_its_task_on_every_loop_it_runs_on() -> None:
    # It keeps the loop it ran on (Python 3.11's current_task() is a getpid system
    # call); a later loop, as in a test or an embedding app, is found again.
    proxy = create_app(RouterSettings()).state.proxy

    async def found() -> bool:
        return proxy._current_task() is asyncio.current_task()

    assert asyncio.run(found())
    assert asyncio.run(found())
    assert asyncio.run(found())
