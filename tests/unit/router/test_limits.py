"""The router-wide bounds of router.proxy: the overall admission limit and the body limit,
against a real aiohttp replica on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from router.settings import RouterSettings
from tests.support.router_harness import (
    LocalServer,
    RouterUnderTest,
    asgi_post,
    in_process_router,
    run,
)


class SlowReplica(LocalServer):
    def __init__(self) -> None:
        self.release = asyncio.Event()
        super().__init__(web.post("/v1/completions", self._handle))

    async def _handle(self, request: web.Request) -> web.Response:
        await request.read()
        await self.release.wait()
        return web.json_response({"object": "text_completion"})


def test_past_the_overall_limit_the_router_answers_503_router_overloaded() -> None:
    async def scenario() -> None:
        replica = SlowReplica()
        await replica.start()
        settings = RouterSettings(activation=False, max_requests=2, replica_concurrency=8)
        try:
            async with in_process_router(settings) as app:
                router = RouterUnderTest(app, replica)
                router.pass_endpoint()
                held = [asyncio.ensure_future(asgi_post(app, {"model": "m"})) for _ in range(2)]
                while app.state.proxy.active < 2:
                    await asyncio.sleep(0.01)
                status, headers, body = await asgi_post(app, {"model": "m"})
                assert status == 503 and body["error"]["code"] == "router_overloaded"
                assert headers["retry-after"] == "2"
                assert (
                    router.metric(
                        "llmgw_router_refusals_total", model="", reason="router_overloaded"
                    )
                    == 1
                )
                replica.release.set()
                assert [(await h)[0] for h in held] == [200, 200]
                assert app.state.proxy.active == 0
                assert (await asgi_post(app, {"model": "m"}))[0] == 200
        finally:
            await replica.stop()

    run(scenario())


def test_a_body_over_the_limit_is_413() -> None:
    async def scenario() -> None:
        settings = RouterSettings(activation=False, max_body_bytes=1000)
        async with in_process_router(settings) as app:
            sent: list[dict] = []
            chunks = [b'{"model": "m", "prompt": "', b"x" * 600, b"x" * 600, b'"}']

            async def receive() -> dict:
                chunk = chunks.pop(0)
                return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

            async def send(message: dict) -> None:
                sent.append(message)

            scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                     "query_string": b"", "headers": []}  # fmt: skip
            await app(scope, receive, send)
            assert sent[0]["status"] == 413

    run(scenario())


def test_a_replica_never_gets_more_in_flight_than_its_connections() -> None:
    settings = RouterSettings(replica_concurrency=1024, max_connections_per_replica=64)
    assert settings.initial_replica_limit == 64
    assert RouterSettings(replica_concurrency=8).initial_replica_limit == 8


def test_request_path_settings_from_env_and_their_errors() -> None:
    settings = RouterSettings.from_env(
        {
            "LLMGW_ROUTER_CORS_ORIGINS": "https://a.example.com/, http://b.example.com:8080",
            "LLMGW_ROUTER_FIRST_BYTE_TIMEOUT": "15",
            "LLMGW_ROUTER_MAX_REQUESTS": "100",
            "LLMGW_ROUTER_EJECTION_BASE": "10",
            "LLMGW_ROUTER_STALL_TIMEOUT": "120",
            "LLMGW_ROUTER_LOADING_HEARTBEAT": "2.5",
        }
    )
    assert (settings.stall_timeout_s, settings.loading_heartbeat_s) == (120.0, 2.5)
    assert RouterSettings().first_byte_timeout_s == 10.0  # issue 21: a dead replica within 15 s
    assert settings.cors_origins == ("https://a.example.com", "http://b.example.com:8080")
    assert (settings.first_byte_timeout_s, settings.max_requests) == (15.0, 100)
    assert settings.ejection_base_s == 10.0 and settings.max_body_bytes == 100 * 1024 * 1024
    settings.validate()
    for bad, words in (
        ({"cors_origins": ("app.example.com",)}, "CORS origin 'app.example.com'"),
        ({"first_byte_timeout_s": 0}, "first-byte and stall timeouts"),
        ({"stall_timeout_s": 0}, "first-byte and stall timeouts"),
        ({"loading_heartbeat_s": -1}, "loading heartbeat"),
        ({"ejection_base_s": 400.0}, "base <= max"),
        ({"max_connections_per_replica": 0}, "per replica"),
    ):
        with pytest.raises(ValueError, match=words):
            settings.with_overrides(**bad).validate()
