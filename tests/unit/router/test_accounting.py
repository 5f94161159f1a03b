"""router.accounting: reading usage from whole answers and streams, asking for it.

The events are llama-server's (b11434), recorded from a real chat stream with
``stream_options.include_usage``; tests/integration/test_router_usage.py checks
the same against a running llama-server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web

from router.accounting import (
    StreamMeter,
    Usage,
    ask_for_usage,
    parse_timings,
    parse_usage,
    whole_usage,
)
from router.bodies import parse_request
from router.keys import digest
from router.settings import RouterSettings
from tests.support.router_harness import LocalServer, RouterUnderTest, in_process_router, run

USAGE = {
    "completion_tokens": 3,
    "prompt_tokens": 26,
    "total_tokens": 29,
    "prompt_tokens_details": {"cached_tokens": 21},
}


def event(doc: dict | str) -> bytes:
    data = doc if isinstance(doc, str) else json.dumps(doc, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n"


TIMINGS = {"cache_n": 21, "prompt_n": 5, "prompt_ms": 300.5, "predicted_n": 3}
TOKEN = event({"choices": [{"finish_reason": None, "index": 0, "delta": {"content": "Say"}}]})
# The last choice event: with llama-server's timings when the client did not ask
# for usage, without them when it did (they move to the usage event).
FINISH_TIMED = event(
    {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}], "timings": TIMINGS}
)
FINISH = event({"choices": [{"finish_reason": "length", "index": 0, "delta": {}}]})
USAGE_EVENT = event({"choices": [], "id": "chatcmpl-1", "usage": USAGE, "timings": TIMINGS})
DONE = event("[DONE]")
STREAM = TOKEN + FINISH + USAGE_EVENT + DONE
UNASKED = TOKEN + FINISH_TIMED + DONE


def test_parse_usage_shapes() -> None:
    assert parse_usage(USAGE) == Usage(prompt=26, cached=21, completion=3)
    assert parse_usage({"prompt_tokens": 4, "total_tokens": 4}) == Usage(4, 0, 0)  # embeddings
    assert parse_usage(
        {"input_tokens": 7, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 1}}
    ) == Usage(7, 1, 2)
    for bad in (
        None,
        [],
        {},
        {"prompt_tokens": -1},
        {"prompt_tokens": True},
        {"prompt_tokens": "3"},
    ):
        assert parse_usage(bad) is None


def test_parse_timings() -> None:
    assert parse_timings(TIMINGS) == Usage(26, 21, 3)
    assert parse_timings({"cache_n": 1, "prompt_n": 2}) is None
    assert parse_timings(None) is None


def test_whole_usage_reads_the_last_usage_key_only() -> None:
    body = json.dumps(
        {
            "choices": [{"message": {"content": 'he said "usage": {"prompt_tokens": 999}'}}],
            "usage": USAGE,
            "id": "x",
            "timings": {"cache_n": 21},
        }
    ).encode()
    assert whole_usage(body) == Usage(26, 21, 3)
    assert whole_usage(b'{"choices": []}') is None
    # llama-server's own /completion: timings only.
    assert whole_usage(json.dumps({"content": "x", "timings": TIMINGS}).encode()) == Usage(
        26, 21, 3
    )
    assert whole_usage(b'{"usage": {"prompt_tokens": ') is None


def test_ask_for_usage_splices_or_merges() -> None:
    body = b' {"model": "m", "stream": true}'
    asked = ask_for_usage(body, json.loads(body))
    assert asked is not None
    assert json.loads(asked) == {
        "model": "m", "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    # The client's own options are kept, and its include_usage false overridden.
    doc = {"model": "m", "stream": True, "stream_options": {"include_usage": False, "x": 1}}
    asked = ask_for_usage(json.dumps(doc).encode(), doc)
    assert asked is not None
    assert json.loads(asked)["stream_options"] == {"include_usage": True, "x": 1}
    doc = {"model": "m", "stream": True, "stream_options": None}
    assert json.loads(ask_for_usage(json.dumps(doc).encode(), doc) or b"")["stream_options"] == {
        "include_usage": True
    }
    # The client asked: nothing to change, and nothing to strip.
    doc = {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
    assert ask_for_usage(json.dumps(doc).encode(), doc) is None


def test_ask_for_usage_sends_the_clients_numbers_exactly() -> None:
    # The proxy's document comes from orjson, which reads an integer past 64 bits
    # as a float: re-serialised from it, the seed would reach the replica changed.
    seed = b'"seed": 123456789012345678901234567890'
    body = b'{"model": "m", "stream": true, ' + seed + b', "stream_options": {}}'
    asked = ask_for_usage(body, parse_request(body)[1])
    assert asked is not None
    assert seed in asked
    # Inside the client's stream_options too (found in review).
    big = b'"x": 123456789012345678901234567890'
    body = b'{"model": "m", "stream": true, "stream_options": {' + big + b"}}"
    asked = ask_for_usage(body, parse_request(body)[1])
    assert asked is not None
    assert big in asked


def chunked(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("size", [len(STREAM), len(TOKEN), 7, 1])
def test_a_stream_the_client_asked_usage_of_passes_unchanged(size: int) -> None:
    meter = StreamMeter()
    out = b"".join(meter.feed(c) for c in chunked(STREAM, size)) + meter.flush()
    assert out == STREAM
    assert meter.usage == Usage(26, 21, 3)
    assert meter.first_at is not None


@pytest.mark.parametrize("size", [len(STREAM), len(TOKEN), 7, 1])
def test_the_usage_event_the_router_asked_for_is_stripped(size: int) -> None:
    meter = StreamMeter(strip=True)
    out = b"".join(meter.feed(c) for c in chunked(STREAM, size)) + meter.flush()
    assert out == TOKEN + FINISH + DONE
    assert meter.usage == Usage(26, 21, 3)


def test_stripping_sends_whole_events_at_once_and_holds_only_an_unfinished_one() -> None:
    meter = StreamMeter(strip=True)
    assert meter.feed(TOKEN) is TOKEN  # no copy of a whole event
    assert meter.feed(TOKEN[:10]) == b""
    assert meter.feed(TOKEN[10:] + FINISH[:5]) == TOKEN
    assert meter.flush() == FINISH[:5]


@pytest.mark.parametrize("size", [len(UNASKED), 7, 1])
def test_a_stream_without_usage_is_counted_from_its_timings(size: int) -> None:
    meter = StreamMeter()
    out = b"".join(meter.feed(c) for c in chunked(UNASKED, size)) + meter.flush()
    assert out == UNASKED and meter.usage == Usage(26, 21, 3)


def framed(stream: bytes, end: bytes) -> bytes:
    """``stream`` (LF LF framed) with each event ended by ``end`` instead."""
    return stream.replace(b"\n\n", end)


@pytest.mark.parametrize("end", [b"\r\n\r\n", b"\r\r", b"\n\r\n"])
@pytest.mark.parametrize("size", [len(STREAM), 7, 1])
def test_every_sse_framing_is_metered_and_stripped_in_its_own_framing(
    end: bytes, size: int
) -> None:
    """Events ended by CRLF CRLF or CR CR (WHATWG HTML 9.2.6) are read as LF LF ones:
    found in review, the meter read LF-framed events only, so such a replica's usage
    and events went uncounted (and its key's token limit unspent)."""
    stream = framed(STREAM, end)
    meter = StreamMeter()
    assert b"".join(meter.feed(c) for c in chunked(stream, size)) + meter.flush() == stream
    assert meter.usage == Usage(26, 21, 3) and meter.events == 4
    meter = StreamMeter(strip=True)
    out = b"".join(meter.feed(c) for c in chunked(stream, size)) + meter.flush()
    assert out == framed(TOKEN + FINISH + DONE, end)
    assert meter.usage == Usage(26, 21, 3)


def test_usage_wins_over_timings_whatever_the_order() -> None:
    other = {"prompt_tokens": 30, "completion_tokens": 4}
    meter = StreamMeter()
    meter.feed(FINISH_TIMED + event({"choices": [], "usage": other}))
    assert meter.usage == Usage(30, 0, 4)
    meter.feed(FINISH_TIMED)
    assert meter.usage == Usage(30, 0, 4)


def test_usage_inside_a_choice_event_is_read_and_never_stripped() -> None:
    # llama-server's /v1/completions stream: usage in the last choice event.
    last = event({"choices": [{"text": "", "finish_reason": "length"}], "usage": USAGE})
    meter = StreamMeter(strip=True)
    assert meter.feed(TOKEN + last + DONE) == TOKEN + last + DONE
    assert meter.usage == Usage(26, 21, 3)


def test_an_event_longer_than_the_bound_is_passed_on() -> None:
    big = event({"choices": [{"delta": {"content": "x" * 70_000}}]})
    meter = StreamMeter(strip=True)
    out = meter.feed(big[:1000]) + meter.feed(big[1000:-2])
    assert out == big[:-2]
    assert meter.feed(big[-2:] + USAGE_EVENT + DONE) == big[-2:] + DONE
    assert meter.usage == Usage(26, 21, 3)


# Through the proxy: a stand-in replica (aiohttp on 127.0.0.1) that answers in
# llama-server's shapes; the integration test uses the real one.


class UsageReplica(LocalServer):
    """Answers a chat request with ``USAGE``: a whole answer, or a stream that has
    the usage event only when the request asked for it (as llama-server does)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        super().__init__(web.post("/v1/chat/completions", self._handle))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        doc = await request.json()
        self.bodies.append(doc)
        if not doc.get("stream"):
            return web.json_response({"choices": [], "usage": USAGE, "timings": {}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        asked = (doc.get("stream_options") or {}).get("include_usage") is True
        for part in (TOKEN, FINISH, USAGE_EVENT) if asked else (TOKEN, FINISH_TIMED):
            await response.write(part)
        await response.write(DONE)
        await response.write_eof()
        return response


async def chat(app, body: dict, key: str | None = None) -> tuple[int, bytes]:
    sent: list[dict] = []
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
        sent.append(message)

    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    path = "/v1/chat/completions"
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
             "query_string": b"", "headers": headers}  # fmt: skip
    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def tokens(router: RouterUnderTest, key: str, kind: str) -> float | None:
    return router.metric("llmgw_router_tokens_total", model="m", key=key, type=kind)


def test_usage_is_counted_per_key_and_the_stream_reaches_the_client_unchanged(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"keys:\n  - name: team-a\n    sha256: {digest('sk-team-a-0123456789')}\n")

    async def scenario() -> None:
        replica = UsageReplica()
        await replica.start()
        settings = RouterSettings(activation=False, api_keys_file=str(keys))
        try:
            async with in_process_router(settings) as app:
                router = RouterUnderTest(app, replica)
                router.pass_endpoint()
                key = "sk-team-a-0123456789"
                status, body = await chat(app, {"model": "m", "stream": True}, key)
                assert status == 200 and body == UNASKED
                assert "stream_options" not in replica.bodies[-1]
                asked = {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
                status, body = await chat(app, asked, key)
                assert body == STREAM
                status, body = await chat(app, {"model": "m"}, key)
                assert status == 200 and json.loads(body)["usage"] == USAGE
                assert tokens(router, "team-a", "prompt") == 3 * 26
                assert tokens(router, "team-a", "cached_prompt") == 3 * 21
                assert tokens(router, "team-a", "completion") == 3 * 3
                outcomes = {"model": "m", "key": "team-a"}
                assert (
                    router.metric("llmgw_router_key_requests_total", **outcomes, outcome="ok") == 3
                )
                assert (
                    router.metric("llmgw_router_key_requests_total", **outcomes, outcome="refused")
                    == 0
                )
                assert (
                    router.metric("llmgw_router_time_to_first_token_seconds_count", model="m") == 2
                )
                assert (
                    router.metric("llmgw_router_time_per_output_token_seconds_count", model="m")
                    == 2
                )
                assert router.metric("llmgw_router_unmetered_requests_total", model="m") == 0
                # A refused key is counted under its own name, never the key.
                status, _ = await chat(app, {"model": "m"}, "sk-wrong-0123456789")
                assert status == 401
                assert router.metric(
                    "llmgw_router_key_requests_total", model="", key="unauthenticated",
                    outcome="refused",
                ) == 1  # fmt: skip
        finally:
            await replica.stop()

    run(scenario())


def test_asked_for_usage_never_reaches_the_client() -> None:
    async def scenario() -> None:
        replica = UsageReplica()
        await replica.start()
        settings = RouterSettings(activation=False, ask_stream_usage=True)
        try:
            async with in_process_router(settings) as app:
                router = RouterUnderTest(app, replica)
                router.pass_endpoint()
                status, body = await chat(app, {"model": "m", "stream": True})
                assert status == 200 and body == TOKEN + FINISH + DONE
                assert replica.bodies[-1]["stream_options"] == {"include_usage": True}
                assert tokens(router, "anonymous", "prompt") == 26
        finally:
            await replica.stop()

    run(scenario())


def test_accounting_off_counts_nothing() -> None:
    async def scenario() -> None:
        replica = UsageReplica()
        await replica.start()
        settings = RouterSettings(activation=False, accounting=False, ask_stream_usage=True)
        try:
            async with in_process_router(settings) as app:
                router = RouterUnderTest(app, replica)
                router.pass_endpoint()
                status, body = await chat(app, {"model": "m", "stream": True})
                assert status == 200 and body == UNASKED
                assert "stream_options" not in replica.bodies[-1]
                assert tokens(router, "anonymous", "prompt") is None
        finally:
            await replica.stop()

    run(scenario())
