"""Per-key limits (router.limits): the token bucket and concurrency on a fixed clock,
and the 429 a key over its limits gets through the proxy (router.proxy), with
OpenAI's headers and error body."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from aiohttp import web

from router import errors
from router.keys import ApiKey, ApiKeys, digest
from router.limits import Admission, KeyLimits, duration
from router.settings import RouterSettings
from tests.support.router_harness import (
    LocalServer,
    RouterUnderTest,
    asgi_post,
    in_process_router,
    run,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def admit(limits: KeyLimits, key: ApiKey) -> Admission:
    return asyncio.run(limits.admit(key))


def refusal(limits: KeyLimits, key: ApiKey) -> errors.RateLimited:
    with pytest.raises(errors.RateLimited) as raised:
        admit(limits, key)
    return raised.value


def test_duration_spelling() -> None:
    assert [duration(s) for s in (0.0001, 0.25, 1.5, 20, 90, 360)] == [
        "1ms", "250ms", "1.5s", "20s", "1m30s", "6m0s",
    ]  # fmt: skip


def test_requests_per_minute_is_a_bucket_refilled_over_the_minute() -> None:
    clock = Clock()
    limits = KeyLimits(clock)
    key = ApiKey("team", ("*",), requests_per_minute=3)
    for _ in range(3):
        limits.release(admit(limits, key))
    refused = refusal(limits, key)
    assert refused.status == 429 and refused.code == "rate_limit_exceeded"
    assert refused.type == "requests"
    headers = dict(refused.headers())
    assert headers[b"retry-after"] == b"20"  # one request every 60/3 s
    assert headers[b"x-ratelimit-limit-requests"] == b"3"
    assert headers[b"x-ratelimit-remaining-requests"] == b"0"
    assert headers[b"x-ratelimit-reset-requests"] == b"1m0s"
    clock.now += 19.9
    refusal(limits, key)
    clock.now += 0.1
    admit(limits, key)
    # Another key has a bucket of its own; a reload that changes the rate starts afresh.
    admit(limits, ApiKey("other", ("*",), requests_per_minute=1))
    admit(limits, ApiKey("team", ("*",), requests_per_minute=10))


def test_concurrent_requests_are_counted_until_released() -> None:
    limits = KeyLimits(Clock())
    key = ApiKey("team", ("*",), concurrent_requests=2)
    first = admit(limits, key)
    admit(limits, key)
    refused = refusal(limits, key)
    assert dict(refused.headers()) == {b"retry-after": b"1"}
    assert "concurrent requests: limit 2" in refused.message
    limits.release(first)
    admit(limits, key)


def test_a_refused_request_counts_against_nothing() -> None:
    clock = Clock()
    limits = KeyLimits(clock)
    key = ApiKey("team", ("*",), requests_per_minute=60, concurrent_requests=1)
    first = admit(limits, key)
    refusal(limits, key)  # concurrency: the bucket was not charged
    limits.release(first)
    clock.now += 1
    admit(limits, key)


def test_limits_in_the_keys_file() -> None:
    document = (
        f"keys:\n  - name: a\n    sha256: {digest('sk-a-0123456789')}\n"
        "    limits: {requests_per_minute: 5, concurrent_requests: 2}\n"
        f"  - name: b\n    sha256: {digest('sk-b-0123456789')}\n"
    ).encode()
    keys = ApiKeys.parse(document, "test")
    a = keys.authenticate(b"Bearer sk-a-0123456789")
    assert (a.requests_per_minute, a.concurrent_requests, a.limited) == (5, 2, True)
    assert not keys.authenticate(b"Bearer sk-b-0123456789").limited
    budgeted = ApiKeys.parse(
        f"keys:\n  - name: a\n    sha256: {digest('x')}\n"
        "    limits: {tokens_per_minute: 9, tokens_per_month: 7}\n".encode(),
        "test",
    ).authenticate(b"Bearer x")
    assert (budgeted.tokens_per_minute, budgeted.budget_tokens, budgeted.budget_period) == (
        9, 7, "month",
    )  # fmt: skip
    assert budgeted.limited
    for bad in (
        "{requests_per_minute: 0}",
        "{tokens_per_hour: 5}",
        "{tokens_per_minute: 0}",
        "{tokens_per_day: 5, tokens_per_month: 9}",
    ):
        with pytest.raises(ValueError, match="limits"):
            ApiKeys.parse(
                f"keys:\n  - name: a\n    sha256: {digest('x')}\n    limits: {bad}\n".encode(),
                "test",
            )


class HeldReplica(LocalServer):
    def __init__(self) -> None:
        self.release = asyncio.Event()
        super().__init__(web.post("/v1/completions", self._handle))

    async def _handle(self, request: web.Request) -> web.Response:
        await request.read()
        await self.release.wait()
        return web.json_response({"object": "text_completion", "usage": {"prompt_tokens": 1}})


def test_a_key_over_its_limits_gets_429_through_the_router(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        f"keys:\n  - name: team\n    sha256: {digest('sk-team-0123456789')}\n"
        "    limits: {requests_per_minute: 3, concurrent_requests: 1}\n"
    )
    auth = [(b"authorization", b"Bearer sk-team-0123456789")]

    async def scenario() -> None:
        replica = HeldReplica()
        await replica.start()
        # Per router (a token bucket): the shared path is tested in test_shared_limits.py.
        settings = RouterSettings(activation=False, api_keys_file=str(keys), shared_limits=False)
        try:
            async with in_process_router(settings) as app:
                router = RouterUnderTest(app, replica)
                router.pass_endpoint()
                held = asyncio.ensure_future(asgi_post(app, {"model": "m"}, headers=auth))
                while app.state.proxy.active < 1:
                    await asyncio.sleep(0.01)
                status, headers, body = await asgi_post(app, {"model": "m"}, headers=auth)
                assert status == 429 and headers["retry-after"] == "1"
                assert body["error"]["code"] == "rate_limit_exceeded"
                replica.release.set()
                assert (await held)[0] == 200
                for _ in range(2):  # the refused request was not charged: 2 more of 3
                    assert (await asgi_post(app, {"model": "m"}, headers=auth))[0] == 200
                status, headers, body = await asgi_post(app, {"model": "m"}, headers=auth)
                assert status == 429 and headers["x-ratelimit-limit-requests"] == "3"
                assert body["error"]["type"] == "requests"
                labels = {"model": "", "key": "team"}
                assert (
                    router.metric(
                        "llmgw_router_key_requests_total", **labels, outcome="rate_limited"
                    )
                    == 2
                )
                assert (
                    router.metric("llmgw_router_refusals_total", model="", reason="rate_limited")
                    == 2
                )
        finally:
            await replica.stop()

    run(scenario())


@pytest.mark.parametrize("shared", [False, True])
def test_requests_the_router_refuses_itself_use_no_allowance(tmp_path: Path, shared: bool) -> None:
    """Issue 23's defect: an unknown model (404), a model with no replica (503) and a
    bad body (400) were charged to the key's requests per minute; only requests that
    reach a replica are. ``shared``: the leases of router.limits over an in-memory
    store (no lifespan, so no Consul), else the per-router bucket."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        f"keys:\n  - name: team\n    sha256: {digest('sk-team-0123456789')}\n"
        "    limits: {requests_per_minute: 2}\n"
    )
    auth = [(b"authorization", b"Bearer sk-team-0123456789")]

    async def scenario() -> None:
        replica = HeldReplica()
        replica.release.set()
        await replica.start()
        settings = RouterSettings(activation=False, api_keys_file=str(keys), shared_limits=shared)
        try:
            async with in_process_router(settings, models=("m", "idle")) as app:
                RouterUnderTest(app, replica).pass_endpoint()
                for body in ({"model": "nope"}, {"model": "idle"}, {"prompt": "no model"}):
                    for _ in range(3):
                        status = (await asgi_post(app, body, headers=auth))[0]
                        assert status in (400, 404, 503), status
                for _ in range(2):
                    assert (await asgi_post(app, {"model": "m"}, headers=auth))[0] == 200
                status, _, body = await asgi_post(app, {"model": "m"}, headers=auth)
                assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
        finally:
            await replica.stop()

    run(scenario())


def test_every_answer_to_a_limited_key_carries_its_x_ratelimit_headers(tmp_path: Path) -> None:
    """OpenAI sends x-ratelimit-* on every answer, not only on 429s (issue 23)."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        f"keys:\n  - name: team\n    sha256: {digest('sk-team-0123456789')}\n"
        "    limits: {requests_per_minute: 3, tokens_per_minute: 1000}\n"
        f"  - name: free\n    sha256: {digest('sk-free-0123456789')}\n"
    )
    auth = [(b"authorization", b"Bearer sk-team-0123456789")]

    async def scenario() -> None:
        replica = HeldReplica()
        replica.release.set()
        await replica.start()
        settings = RouterSettings(activation=False, api_keys_file=str(keys), shared_limits=False)
        try:
            async with in_process_router(settings) as app:
                RouterUnderTest(app, replica).pass_endpoint()
                status, headers, _ = await asgi_post(app, {"model": "m"}, headers=auth)
                assert status == 200
                assert headers["x-ratelimit-limit-requests"] == "3"
                assert headers["x-ratelimit-remaining-requests"] == "2"
                assert headers["x-ratelimit-reset-requests"].endswith("s")
                assert headers["x-ratelimit-limit-tokens"] == "1000"
                assert int(headers["x-ratelimit-remaining-tokens"]) < 1000  # the estimate
                # Refused by the router itself: given back, and said so.
                status, headers, _ = await asgi_post(app, {"model": "nope"}, headers=auth)
                assert status == 404 and headers["x-ratelimit-remaining-requests"] == "2"
                # A key without limits: none.
                free = [(b"authorization", b"Bearer sk-free-0123456789")]
                status, headers, _ = await asgi_post(app, {"model": "m"}, headers=free)
                assert status == 200 and "x-ratelimit-limit-requests" not in headers
        finally:
            await replica.stop()

    run(scenario())


class StreamReplica(LocalServer):
    def __init__(self) -> None:
        super().__init__(web.post("/v1/completions", self._handle))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"text": "hi"}]}\n\n')
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def test_a_streamed_answer_carries_the_x_ratelimit_headers_too(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        f"keys:\n  - name: team\n    sha256: {digest('sk-team-0123456789')}\n"
        "    limits: {requests_per_minute: 5}\n"
    )

    async def scenario() -> None:
        replica = StreamReplica()
        await replica.start()
        settings = RouterSettings(activation=False, api_keys_file=str(keys), shared_limits=False)
        sent: list[dict] = []
        body = b'{"model": "m", "stream": true}'
        delivered = asyncio.Event()

        async def receive() -> dict:
            if not delivered.is_set():
                delivered.set()
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # connected until the answer ends
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "query_string": b"",
            "headers": [
                (b"content-type", b"application/json"),
                (b"authorization", b"Bearer sk-team-0123456789"),
            ],
        }
        try:
            async with in_process_router(settings) as app:
                RouterUnderTest(app, replica).pass_endpoint()
                await app(scope, receive, send)
        finally:
            await replica.stop()
        start = sent[0]
        assert start["status"] == 200
        headers = dict(start["headers"])
        assert headers[b"Content-Type"] == b"text/event-stream"
        assert headers[b"x-ratelimit-limit-requests"] == b"5"
        assert headers[b"x-ratelimit-remaining-requests"] == b"4"
        assert b"[DONE]" in b"".join(m.get("body", b"") for m in sent[1:])

    run(scenario())


class EndlessStreamReplica(LocalServer):
    """A stream that repeats `line` (default: a one-token event) until its client is
    gone: the usage a replica sends in its last event never comes."""

    def __init__(self, line: bytes = b'data: {"choices": [{"text": "x"}]}\n\n') -> None:
        super().__init__(web.post("/v1/completions", self._handle))
        self.line = line

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if b'"stream": true' not in await request.read():
            return web.json_response({"usage": {"prompt_tokens": 1, "completion_tokens": 1}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        with contextlib.suppress(ConnectionError):
            while True:
                await response.write(self.line)
                await asyncio.sleep(0.01)
        return response


async def leave_stream(app: object, auth: tuple[bytes, bytes], events: int) -> None:
    """A streaming completion whose client leaves once `events` events arrived."""
    body = b'{"model": "m", "stream": true, "prompt": "hi"}'
    read = asyncio.Event()
    got: list[bytes] = []

    async def receive() -> dict:
        if not read.is_set():
            read.set()
            return {"type": "http.request", "body": body, "more_body": False}
        while sum(chunk.count(b"data:") for chunk in got) < events:
            await asyncio.sleep(0.005)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        got.append(message.get("body", b""))

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), auth],
    }
    await app(scope, receive, send)  # type: ignore[operator]


def test_leaving_a_stream_before_its_usage_still_spends_the_budget(tmp_path: Path) -> None:
    """Issue 23's QA: a client that closed each stream just before its last event (the
    one with the usage) got 312 tokens through a budget of 100 a day, and
    `llmgw_router_unmetered_requests_total` stayed 0. Now what the client got (one token
    an event) and the prompt's estimate are charged, and the request counts unmetered."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        f"keys:\n  - name: team\n    sha256: {digest('sk-team-0123456789')}\n"
        "    limits: {tokens_per_day: 20}\n"
    )
    auth = (b"authorization", b"Bearer sk-team-0123456789")

    async def scenario() -> None:
        replica = EndlessStreamReplica()
        await replica.start()
        settings = RouterSettings(activation=False, api_keys_file=str(keys), shared_limits=False)
        try:
            async with in_process_router(settings) as app:
                router = RouterUnderTest(app, replica)
                router.pass_endpoint()
                await leave_stream(app, auth, 25)  # 25 tokens and the prompt: over 20
                assert router.metric("llmgw_router_unmetered_requests_total", model="m") == 1
                status, _, body = await asgi_post(app, {"model": "m"}, headers=[auth])
                assert status == 429 and body["error"]["code"] == "insufficient_quota"
        finally:
            await replica.stop()

    run(scenario())


def test_leaving_before_any_event_still_spends_the_prompts_estimate(tmp_path: Path) -> None:
    """Issue 23's second QA: streams left right after the answer's headers, before any
    event, charged nothing (10 prompts of ~525 tokens through a 100-token budget)."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        f"keys:\n  - name: team\n    sha256: {digest('sk-team-0123456789')}\n"
        "    limits: {tokens_per_day: 20}\n"
    )
    auth = (b"authorization", b"Bearer sk-team-0123456789")

    async def scenario() -> None:
        # Headers, then only SSE comments (no event).
        replica = EndlessStreamReplica(b": still thinking\n\n")
        await replica.start()
        settings = RouterSettings(activation=False, api_keys_file=str(keys), shared_limits=False)
        try:
            async with in_process_router(settings) as app:
                RouterUnderTest(app, replica).pass_endpoint()
                for _ in range(2):  # a 46-byte body: 11 tokens estimated each, 22 > 20
                    await leave_stream(app, auth, 0)
                status, _, body = await asgi_post(app, {"model": "m"}, headers=[auth])
                assert status == 429 and body["error"]["code"] == "insufficient_quota"
        finally:
            await replica.stop()

    run(scenario())
