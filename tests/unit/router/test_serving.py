"""router.serving: uvicorn's httptools protocol with a header-read timeout and a
header size bound, served for real on 127.0.0.1 in the test's event loop (no
Consul: a plain ASGI app answers what gets through). `router serve` itself is
tested in tests/integration/test_router_security.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import uvicorn

from router.serving import MAX_HEADER_BYTES, protocol_class
from tests.support.ports import free_port
from tests.support.router_harness import run

TIMEOUT_S = 1.0


async def hello(scope: dict, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@contextlib.asynccontextmanager
async def served() -> AsyncIterator[int]:
    port = free_port()
    config = uvicorn.Config(hello, host="127.0.0.1", port=port, lifespan="off",
                            http=protocol_class(TIMEOUT_S), log_config=None)
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await task


async def exchange(port: int, data: bytes) -> tuple[bytes, float]:
    """Send ``data``, then read until the server closes; the answer and the seconds."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    writer.write(data)
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer, time.monotonic() - started


def status_and_error(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"\r\nconnection: close" in head.lower(), head
    return int(head.split(b" ")[1]), json.loads(body)["error"]["code"]


def test_silent_and_slow_headers_get_408_and_fast_ones_are_served() -> None:
    async def scenario() -> None:
        async with served() as port:
            for start in (b"", b"GET / HTTP/1.1\r\nHost: x\r\n"):
                answer, seconds = await exchange(port, start)
                assert status_and_error(answer) == (408, "request_timeout"), answer
                assert seconds >= TIMEOUT_S
            answer, _ = await exchange(
                port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok")

    run(scenario())


def test_headers_over_the_bound_get_431() -> None:
    async def scenario() -> None:
        async with served() as port:
            big = b"GET / HTTP/1.1\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1024)
            answer, _ = await exchange(port, big)
            assert status_and_error(answer) == (431, "request_header_fields_too_large")

    run(scenario())
