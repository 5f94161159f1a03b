"""A streaming request for a loading on-demand model is told it is waiting
(router.heartbeat, through router.proxy and router.activation).

The planner's activator API is :class:`StubPlanner` (tests/unit/router/test_activation.py:
a scripted aiohttp server that always says ``loading``), and the replica that passes
later is a real aiohttp server streaming SSE. What a client makes of the bytes is
checked with the OpenAI SDK's own SSE decoder (openai-python ``_streaming``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from aiohttp import web
from openai._streaming import SSEDecoder

from router.settings import RouterSettings
from tests.support.router_harness import LocalServer, in_process_router, run
from tests.unit.router.test_activation import StubPlanner

BEAT_S = 0.1
LOADING = {"m": [{"status": "loading", "reason": "starting"}]}


class StreamingReplica(LocalServer):
    """Streams three SSE events and ``[DONE]``; 400 for ``"max_tokens": -1``."""

    def __init__(self) -> None:
        super().__init__(web.post("/v1/completions", self._complete))

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("max_tokens") == -1:
            error = {"code": 400, "message": "bad max_tokens", "type": "invalid_request_error"}
            return web.json_response({"error": error}, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for text in ("a", "b", "c"):
            await response.write(f'data: {{"choices":[{{"text":"{text}"}}]}}\n\n'.encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class Client:
    """One ASGI client connection; ``sent`` is what the router sent it, in order."""

    def __init__(self, app: object, body: dict) -> None:
        self.sent: list[dict] = []
        self.changed = asyncio.Event()
        payload = json.dumps(body).encode()
        delivered = False

        async def receive() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": payload, "more_body": False}
            await asyncio.Event().wait()
            return {}

        async def send(message: dict) -> None:
            self.sent.append(message)
            self.changed.set()

        scope = {
            "type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
            "headers": [(b"content-type", b"application/json")],
        }  # fmt: skip
        self.task = asyncio.ensure_future(app(scope, receive, send))  # type: ignore[operator]

    async def until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 10)

    def starts(self) -> list[dict]:
        return [m for m in self.sent if m["type"] == "http.response.start"]

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")

    def comments(self) -> int:
        return self.body().count(b": loading model m\n\n")


def settings(stub: StubPlanner, window_s: float = 10.0) -> RouterSettings:
    return RouterSettings(
        planner_url=stub.url, activation_window_s=window_s, loading_heartbeat_s=BEAT_S
    )


def events(data: bytes) -> list[str]:
    """The data of each event the OpenAI SDK's decoder finds (comments are dropped)."""
    return [sse.data for sse in SSEDecoder().iter_bytes(iter([data]))]


def test_a_waiting_stream_gets_comments_then_its_answer() -> None:
    async def scenario() -> None:
        stub = StubPlanner({k: list(v) for k, v in LOADING.items()})
        replica = StreamingReplica()
        await stub.start()
        address = await replica.start()
        try:
            async with in_process_router(settings(stub)) as app:
                client = Client(app, {"model": "m", "prompt": "hi", "stream": True})
                await client.until(lambda: client.comments() >= 3)
                assert [m["status"] for m in client.starts()] == [200]
                headers = dict(client.starts()[0]["headers"])
                assert headers[b"content-type"] == b"text/event-stream"
                # As llama-server's own streams: an nginx in front must not buffer them.
                assert headers[b"x-accel-buffering"] == b"no", headers
                app.state.table.set_endpoints("m", [address])
                await asyncio.wait_for(client.task, 10)
                assert len(client.starts()) == 1
                assert events(client.body()) == [
                    '{"choices":[{"text":"a"}]}', '{"choices":[{"text":"b"}]}',
                    '{"choices":[{"text":"c"}]}', "[DONE]",
                ]  # fmt: skip
                assert client.sent[-1].get("more_body", False) is False
        finally:
            await replica.stop()
            await stub.stop()

    run(scenario())


def test_a_stream_whose_model_never_loads_ends_with_an_error_event() -> None:
    async def scenario() -> None:
        stub = StubPlanner({k: list(v) for k, v in LOADING.items()})
        await stub.start()
        try:
            async with in_process_router(settings(stub, window_s=5 * BEAT_S)) as app:
                client = Client(app, {"model": "m", "prompt": "hi", "stream": True})
                await asyncio.wait_for(client.task, 10)
                assert [m["status"] for m in client.starts()] == [200]
                assert client.comments() >= 1
                (last,) = events(client.body())
                error = json.loads(last)["error"]
                assert error["code"] == "model_loading" and error["type"] == "server_error"
                assert set(error) == {"message", "type", "param", "code"}
        finally:
            await stub.stop()

    run(scenario())


def test_a_replica_error_after_the_wait_is_an_error_event_in_openai_shape() -> None:
    async def scenario() -> None:
        stub = StubPlanner({k: list(v) for k, v in LOADING.items()})
        replica = StreamingReplica()
        await stub.start()
        address = await replica.start()
        try:
            async with in_process_router(settings(stub)) as app:
                body = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": -1}
                client = Client(app, body)
                await client.until(lambda: client.comments() >= 1)
                app.state.table.set_endpoints("m", [address])
                await asyncio.wait_for(client.task, 10)
                (last,) = events(client.body())
                error = json.loads(last)["error"]
                assert error == {
                    "message": "bad max_tokens", "type": "invalid_request_error",
                    "param": None, "code": "invalid_request",
                }  # fmt: skip
        finally:
            await replica.stop()
            await stub.stop()

    run(scenario())


def test_no_comment_for_a_request_that_does_not_stream_or_does_not_wait() -> None:
    async def scenario() -> None:
        stub = StubPlanner({k: list(v) for k, v in LOADING.items()})
        replica = StreamingReplica()
        await stub.start()
        address = await replica.start()
        try:
            async with in_process_router(settings(stub, window_s=5 * BEAT_S)) as app:
                # Not streaming: the refusal keeps its status.
                client = Client(app, {"model": "m", "prompt": "hi"})
                await asyncio.wait_for(client.task, 10)
                assert [m["status"] for m in client.starts()] == [503]
                assert client.comments() == 0
                # Streaming, but an endpoint passes at once: the replica's stream as is.
                app.state.table.set_endpoints("m", [address])
                client = Client(app, {"model": "m", "prompt": "hi", "stream": True})
                await asyncio.wait_for(client.task, 10)
                assert client.comments() == 0 and events(client.body())[-1] == "[DONE]"
        finally:
            await replica.stop()
            await stub.stop()

    run(scenario())


def test_the_heartbeat_is_off_at_zero() -> None:
    async def scenario() -> None:
        stub = StubPlanner({k: list(v) for k, v in LOADING.items()})
        await stub.start()
        try:
            quiet = settings(stub, window_s=3 * BEAT_S).with_overrides(loading_heartbeat_s=0.0)
            async with in_process_router(quiet) as app:
                client = Client(app, {"model": "m", "prompt": "hi", "stream": True})
                await asyncio.wait_for(client.task, 10)
                assert [m["status"] for m in client.starts()] == [503]
        finally:
            await stub.stop()

    run(scenario())
