"""router.serving: uvicorn's httptools protocol with a header-read timeout and a
header size bound, served for real on 127.0.0.1 in the test's event loop (no
Consul: a plain ASGI app answers what gets through). `router serve` itself is
tested in tests/integration/test_router_security.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator

import httptools
import pytest
import uvicorn

from router.serving import (
    MAX_HEADER_BYTES,
    _CycleTransport,
    _parser_reason,
    body_whole,
    protocol_class,
)
from tests.support.ports import free_port
from tests.support.router_harness import run

TIMEOUT_S = 1.0


class App:
    """Answers ``ok``; a request to ``/slow`` waits for ``release`` first. Counts
    the requests it saw."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.seen: list[str] = []

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return
        self.seen.append(scope["path"])
        if scope["path"] == "/slow":
            await self.release.wait()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        )
        await send({"type": "http.response.body", "body": b"ok"})


@contextlib.asynccontextmanager
async def served(
    app: App | None = None, keep_alive_s: float = 5
) -> AsyncIterator[tuple[int, uvicorn.Server]]:
    port = free_port()
    config = uvicorn.Config(
        app or App(),
        host="127.0.0.1",
        port=port,
        lifespan="off",
        http=protocol_class(TIMEOUT_S),
        log_config=None,
        timeout_keep_alive=keep_alive_s,
    )
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield port, server
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
        async with served() as (port, _):
            for start in (b"", b"GET / HTTP/1.1\r\nHost: x\r\n"):
                answer, seconds = await exchange(port, start)
                assert status_and_error(answer) == (408, "request_timeout"), answer
                assert seconds >= TIMEOUT_S
            answer, _ = await exchange(
                port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok")

    run(scenario())


def test_headers_over_the_bound_get_431() -> None:
    async def scenario() -> None:
        async with served() as (port, _):
            big = b"GET / HTTP/1.1\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1024)
            answer, _ = await exchange(port, big)
            assert status_and_error(answer) == (431, "request_header_fields_too_large")

    run(scenario())


def padded(size: int, *, close: bool = True) -> bytes:
    """A GET whose request line and headers take exactly ``size`` bytes."""
    start = b"GET / HTTP/1.1\r\nHost: x\r\n" + (b"Connection: close\r\n" if close else b"")
    start += b"X-Pad: "
    return start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"


def test_the_header_bound_is_exact_whatever_the_reads() -> None:
    """Issue 18, D1: a header section that completed in the read crossing the bound
    was never counted (one 66,000-100,000 byte header, or 1,000 of 100 bytes, was
    served); now it is counted before the parser sees it."""
    many = (
        b"GET / HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 90) for i in range(1000))
        + b"\r\n"
    )

    async def scenario() -> None:
        app = App()
        async with served(app) as (port, _):
            for request in (
                padded(MAX_HEADER_BYTES + 1),
                padded(66_000),
                padded(100_000),
                padded(130_000),
                many,
            ):
                answer, _ = await exchange(port, request)
                assert status_and_error(answer) == (431, "request_header_fields_too_large")
            assert app.seen == []
            answer, _ = await exchange(port, padded(MAX_HEADER_BYTES))
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok")
            # Headers then a body in one write: the body is no header byte.
            post = padded(MAX_HEADER_BYTES - 30).replace(b"GET", b"PUT", 1)
            post = post.replace(b"Host: x\r\n", b"Host: x\r\nContent-Length: 9000\r\n", 1)
            answer, _ = await exchange(port, post + b"b" * 9000)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]

    run(scenario())


def test_a_pipelined_request_s_headers_are_bounded_too() -> None:
    """A request that begins inside a read after another's body is checked before
    the app sees it."""

    async def scenario() -> None:
        app = App()
        async with served(app) as (port, _):
            first = b"PUT /first HTTP/1.1\r\nHost: x\r\nContent-Length: 20000\r\n\r\n"
            answer, _ = await exchange(port, first + b"b" * 20000 + padded(MAX_HEADER_BYTES + 1000))
            assert answer.startswith(b"HTTP/1.1 200") and b"431" in answer, answer[:300]
            assert app.seen == ["/first"]

    run(scenario())


def test_a_request_waiting_behind_a_long_answer_still_has_the_header_timeout() -> None:
    """Issue 18, D2: the clock of a pipelined request ran out while the first answer
    was being sent, and was never restarted: its headers stayed open forever."""

    async def scenario() -> None:
        app = App()
        async with served(app) as (port, server):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nPOST /v1/completions HTTP/1.1\r\n")
            # Held until the second request's clock has run out during the answer.
            while not any(
                getattr(c, "_late_while_busy", False) for c in server.server_state.connections
            ):
                await asyncio.sleep(0.01)
            app.release.set()
            first = await reader.readuntil(b"ok")
            assert first.startswith(b"HTTP/1.1 200"), first
            started = time.monotonic()
            writer.write(b"Host: x\r\n")  # cancels uvicorn's keep-alive timer
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert status_and_error(answer) == (408, "request_timeout"), answer
            assert time.monotonic() - started < TIMEOUT_S + 2
            assert app.seen == ["/slow"]

    run(scenario())


def test_blank_lines_between_requests_do_not_stop_the_clock() -> None:
    """CRLFs before a request line begin no request (RFC 9112 2.2) but cancel
    uvicorn's keep-alive timer: the header clock runs from them."""

    async def scenario() -> None:
        async with served() as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
            writer.write(b"\r\n")
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert status_and_error(answer) == (408, "request_timeout"), answer

    run(scenario())


class _Wire:
    """A protocol's transport that records each write call (one call: one send)."""

    def __init__(self) -> None:
        self.calls: list[tuple[bytes, ...]] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.calls.append((data,))

    def writelines(self, parts) -> None:
        self.calls.append(tuple(parts))

    def is_closing(self) -> bool:
        return self.closed


class _Protocol:
    lingering = False

    def __init__(self) -> None:
        self.transport = _Wire()
        self.loop = asyncio.get_running_loop()

    def close_after_answer(self) -> None:
        self.transport.closed = True


def test_a_whole_answer_leaves_in_one_send() -> None:
    run(_whole_answer())


async def _whole_answer() -> None:
    protocol = _Protocol()
    cycle = _CycleTransport(protocol)  # type: ignore[arg-type]
    cycle.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    cycle.write(b"ok")
    await asyncio.sleep(0)
    assert protocol.transport.calls == [(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n", b"ok")]


def test_a_stream_head_leaves_at_the_end_of_the_turn() -> None:
    run(_stream_head())


async def _stream_head() -> None:
    protocol = _Protocol()
    cycle = _CycleTransport(protocol)  # type: ignore[arg-type]
    cycle.write(b"HEAD")
    assert protocol.transport.calls == []
    await asyncio.sleep(0)
    assert protocol.transport.calls == [(b"HEAD",)]
    cycle.write(b"event")
    assert protocol.transport.calls == [(b"HEAD",), (b"event",)]


def test_closing_sends_a_held_head_first() -> None:
    run(_closing())


async def _closing() -> None:
    protocol = _Protocol()
    cycle = _CycleTransport(protocol)  # type: ignore[arg-type]
    cycle.write(b"HEAD")
    cycle.close()
    assert protocol.transport.calls == [(b"HEAD",)]
    assert protocol.transport.closed
    await asyncio.sleep(0)
    assert protocol.transport.calls == [(b"HEAD",)]


class BodyApp(App):
    """Records, per request, whether the server marked its body whole before the app
    read it, then reads the body and answers its length."""

    def __init__(self) -> None:
        super().__init__()
        self.whole: list[bool] = []

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return
        self.whole.append(body_whole(scope))
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        answer = str(len(body)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", str(len(answer)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": answer})


def test_a_body_received_with_its_headers_is_marked_whole_and_a_late_one_is_not() -> None:
    """The proxy reads a body marked whole with no clock (router.intake): the mark
    must never be on a body whose end has not arrived."""
    run(_body_whole())


async def _body_whole() -> None:
    app = BodyApp()
    async with served(app) as (port, _):
        head = b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + b"abcd")  # one write: headers and body
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        assert await reader.readexactly(1) == b"4"
        writer.write(head + b"ab")  # the body's end comes later, on the same connection
        await asyncio.sleep(0.2)
        writer.write(b"cd")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        assert await reader.readexactly(1) == b"4"
        writer.write(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        assert await reader.readexactly(1) == b"0"
        writer.close()
    assert app.whole == [True, False, True]


def test_each_keep_alive_request_is_bounded_and_timed_on_its_own() -> None:
    """A request read whole in one read once counted as a next request begun: its
    header bytes were added to the next request's (431 for two of 40 KiB) and the
    clock ran on the idle connection (408 after the header timeout)."""
    run(_keep_alive_requests())


async def _keep_alive_requests() -> None:
    # Keep-alive far above the header timeout: only the header clock could close it.
    async with served(keep_alive_s=60) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        big = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n"
        for _ in range(2):
            writer.write(big)
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            assert await reader.readexactly(2) == b"ok"
        await asyncio.sleep(TIMEOUT_S * 1.5)  # idle: no request has begun
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        assert await reader.readexactly(2) == b"ok"
        # A next request that begins and stops: timed from its first byte.
        began = time.monotonic()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        assert status_and_error(answer) == (408, "request_timeout"), answer
        assert time.monotonic() - began >= TIMEOUT_S
        writer.close()


def test_a_blank_line_split_across_reads_does_not_hide_the_header_section() -> None:
    """Found in review: keyed on bytes counted, the blank line's second half was taken
    for the end of a header section, and 100 KB of header whitespace (which the
    parser does not report) after it was served."""
    padding = b"X-Pad:" + b" " * 100_000 + b"v\r\n"
    request = b"GET / HTTP/1.1\r\nHost: x\r\n" + padding + b"\r\n"

    async def scenario() -> None:
        async with served() as (port, _):
            for first, rest in ((b"\r\n", b"\r\n"), (b"\r\n\r", b"\n")):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(first)
                await writer.drain()
                await asyncio.sleep(0.05)  # two reads (either order passes the fix)
                writer.write(rest + request)
                answer = await asyncio.wait_for(reader.read(), 10)
                assert status_and_error(answer)[0] == 431, answer[:60]
                writer.close()

    run(scenario())


def test_a_pipelined_request_late_while_busy_leaves_no_clock_once_its_headers_came() -> None:
    """Found in review: the flag that a request's clock ran out during an earlier
    answer stayed set once its headers completed, and restarted the clock at that
    answer's end for no request: 408 on an idle keep-alive connection."""
    run(_late_then_whole())


async def _late_then_whole() -> None:
    app = App()
    async with served(app, keep_alive_s=60) as (port, server):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\n")
        while not any(c._late_while_busy for c in server.server_state.connections):
            await asyncio.sleep(0.01)  # /b's clock ran out while /slow is answered
        writer.write(b"Host: x\r\n\r\n")
        while not any(c.pipeline for c in server.server_state.connections):
            await asyncio.sleep(0.01)  # /b's headers parsed, queued behind /slow
        app.release.set()
        for _ in range(2):
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            assert await reader.readexactly(2) == b"ok"
        with contextlib.suppress(TimeoutError):
            extra = await asyncio.wait_for(reader.read(), TIMEOUT_S * 2)
            raise AssertionError(f"the idle connection got {extra[:60]!r}")
        writer.close()


# Requests httptools cannot read, each with what the parser says of it (issue: they
# got uvicorn's 400 text/plain "Invalid HTTP request received.").
MALFORMED = {
    "content_length_not_a_number": (
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        "Content-Length",
    ),
    "garbage_request_line": (b"HELLO\r\n\r\n", "method"),
    "bad_chunk_size": (
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
        "chunk size",
    ),
    "content_length_and_transfer_encoding": (
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        "Content-Length",
    ),
    "http2_preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "HTTP/2"),
    # uvicorn's own parse of the target fails in its callback: the parser's reason
    # quotes the target, cut to a bound.
    "connect_target_uvicorn_cannot_parse": (
        b"CONNECT " + b"x" * 20_000 + b":443 HTTP/1.1\r\nHost: x\r\n\r\n",
        "invalid url",
    ),
}


def invalid_http_request(answer: bytes) -> str:
    """Check ``answer`` is the only answer, a 400 OpenAI error object, closed; its
    message."""
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    assert lines[0] == b"http/1.1 400 bad request", answer[:300]
    assert b"content-type: application/json" in lines
    assert b"connection: close" in lines
    assert answer.count(b"HTTP/1.1 ") == 1, answer[:300]
    error = json.loads(body)
    assert set(error) == {"error"}
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] is None
    assert error["error"]["code"] == "invalid_http_request"
    message = error["error"]["message"]
    assert isinstance(message, str) and message
    return message


def test_a_malformed_request_gets_a_400_error_object_and_is_closed(caplog) -> None:
    async def scenario() -> None:
        app = App()
        async with served(app) as (port, _):
            for name, (request, says) in MALFORMED.items():
                caplog.clear()
                answer, _ = await exchange(port, request)  # read until closed
                message = invalid_http_request(answer)
                assert says in message, (name, message)
                assert len(message) < 300, (name, len(message))
                # One log line: uvicorn's warning, not a second from the router.
                logged = [r.getMessage() for r in caplog.records]
                assert logged == ["Invalid HTTP request received."], (name, logged)
            # The request whose body was malformed got this answer, not its app's.
            assert app.seen in ([], ["/"]), app.seen

    with caplog.at_level(logging.INFO):
        run(scenario())


def test_a_malformed_request_read_in_pieces_gets_the_same_answer() -> None:
    """The parser fails on a later read (headers whole, a chunk size after)."""

    async def scenario() -> None:
        async with served() as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            await writer.drain()
            writer.write(b"zz\r\n")
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert "chunk size" in invalid_http_request(answer)

    run(scenario())


def test_a_malformed_pipelined_request_is_answered_after_the_answer_in_progress() -> None:
    """uvicorn wrote its 400 at once, into the middle of the earlier answer; the
    request whose body is malformed (queued behind it) never reaches its app."""

    async def scenario() -> None:
        app = App()
        async with served(app) as (port, server):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
                b"POST /bad HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
            )
            while not any(c._refusal for c in server.server_state.connections):
                await asyncio.sleep(0.01)  # the 400 waits for /slow's answer
            app.release.set()
            first = await reader.readuntil(b"ok")
            assert first.startswith(b"HTTP/1.1 200"), first
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert "chunk size" in invalid_http_request(answer)
            assert app.seen == ["/slow"]

    run(scenario())


def test_an_unsupported_upgrade_is_served_as_the_plain_request_it_is() -> None:
    """No upgrade is answered in text: h2c and WebSocket (which uvicorn's websockets
    protocol refused with text/plain) reach the app as plain requests."""
    upgrades = (
        b"Connection: Upgrade\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n",
        b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n",
    )

    async def scenario() -> None:
        app = App()
        async with served(app) as (port, _):
            for headers in upgrades:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /up HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200"), head
                assert await reader.readexactly(2) == b"ok"
                writer.close()
            assert app.seen == ["/up", "/up"]
            # Requests pipelined after an upgrade request, in one write (found in
            # review: the parser stopped at the upgrade, and what followed in that
            # read was dropped, its client left waiting).
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            upgrade = b"GET /up HTTP/1.1\r\nHost: x\r\n" + upgrades[0] + b"\r\n"
            plain = b"GET /%d HTTP/1.1\r\nHost: x\r\n\r\n"
            writer.write(upgrade + plain % 1 + upgrade + upgrade + plain % 2)
            for _ in range(5):
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200"), head
                assert await reader.readexactly(2) == b"ok"
            writer.close()
            assert app.seen[2:] == ["/up", "/1", "/up", "/up", "/2"], app.seen

    run(scenario())


def test_an_upgrade_request_s_body_reaches_its_app() -> None:
    """``curl --http2`` on http:// asks to upgrade to h2c (found in review: its POST
    reached the app with no body, and the body was read as a request of its own)."""

    async def scenario() -> None:
        app = BodyApp()
        async with served(app) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            upgrade = (
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings"
                b"\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
                b"Content-Length: 11\r\n\r\n" + b'{"a": "b"}\n'
            )
            writer.write(upgrade + b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
            answers = []
            for _ in range(2):
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200"), head
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                answers.append(await reader.readexactly(length))
            writer.close()
            assert answers == [b"11", b"0"]  # the POST's body, then the GET's none

    run(scenario())


@pytest.mark.parametrize(
    "body",
    [
        b"Transfer-Encoding: chunked\r\n\r\nb\r\n" + b'{"a": "b"}\n' + b"\r\n0\r\n\r\n",
        b"Content-Length: 11\r\n\r\n" + b'{"a":',  # the rest never came with it
    ],
    ids=["chunked", "partial"],
)
def test_an_upgrade_request_s_body_it_cannot_read_gets_one_clear_400(body: bytes) -> None:
    """The parser stops at an upgrade request's headers; a body that is chunked or did
    not arrive with them cannot be read after that (found in review: the request got
    400 invalid_json for its empty body, then its body was read as a request of its
    own, 400 "Invalid method"). One 400 says why, and the app's answer is not sent."""

    async def scenario() -> None:
        app = BodyApp()
        async with served(app) as (port, _):
            answer, _ = await exchange(
                port,
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, "
                b"HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
                + body,
            )
            assert status_and_error(answer) == (400, "invalid_http_request"), answer
            assert answer.count(b"HTTP/1.1 ") == 1, answer
            assert b"Upgrade: h2c" in answer and b"--http1.1" in answer

    run(scenario())


def test_the_parser_s_reason_is_bounded_and_said_plainly() -> None:
    long = httptools.HttpParserError("invalid url b'" + "x" * 10_000 + "'")
    message = _parser_reason(long, "fallback")
    assert message.startswith("The request is not valid HTTP/1.1: invalid url b'xxx")
    assert len(message) < 300
    assert _parser_reason(None, "fallback") == "fallback"
    preface = _parser_reason(httptools.HttpParserError("Pause on PRI/Upgrade"), "fallback")
    assert "HTTP/2" in preface and "PRI" not in preface
