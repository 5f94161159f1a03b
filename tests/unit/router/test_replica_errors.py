"""A replica's errors in OpenAI's shape (router.replica_errors): llama-server's error
objects as its format_error_response writes them (llama.cpp tools/server)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from router.replica_errors import HOLD_LIMIT, StreamErrors, error_answer, translate
from router.settings import RouterSettings
from tests.support.router_harness import (
    LocalServer,
    RouterUnderTest,
    asgi_post,
    in_process_router,
    run,
)

CONTEXT = {
    "code": 400,
    "message": "request (1500 tokens) exceeds the available context size (1024 tokens)",
    "type": "exceed_context_size_error",
    "n_prompt_tokens": 1500,
    "n_ctx": 1024,
}


def test_a_llama_server_error_gets_openai_fields_and_keeps_its_extras() -> None:
    out = translate(CONTEXT, 400)
    assert out == {
        "message": CONTEXT["message"],
        "type": "invalid_request_error",
        "param": None,
        "code": "context_length_exceeded",
        "n_prompt_tokens": 1500,
        "n_ctx": 1024,
    }
    assert list(out)[:4] == ["message", "type", "param", "code"]


def test_every_type_gets_a_string_code_and_an_openai_type() -> None:
    for kind, status in (
        ("invalid_request_error", 400), ("authentication_error", 401),
        ("not_found_error", 404), ("server_error", 500), ("permission_error", 403),
        ("not_supported_error", 501), ("unavailable_error", 503), ("new_error", 418),
        ("new_error", 502),
    ):  # fmt: skip
        out = translate({"code": status, "message": "m", "type": kind}, status)
        assert isinstance(out["code"], str) and out["code"], out
        assert out["type"] in {"invalid_request_error", "server_error"}, out
    unknown = translate({"code": 502, "message": "m", "type": "new_error"}, 502)
    assert (unknown["type"], unknown["code"]) == ("server_error", "new_error")
    # llama-server's two generic types (a bad parameter, a failed decode), and an error
    # with no type at all: a string code each (found in review: both were null).
    bad = translate({"code": 400, "message": "m", "type": "invalid_request_error"}, 400)
    assert (bad["type"], bad["code"]) == ("invalid_request_error", "invalid_request")
    failed = translate({"code": 500, "message": "m", "type": "server_error"}, 500)
    assert (failed["type"], failed["code"]) == ("server_error", "replica_error")
    typeless = translate({"code": 503, "message": "m"}, 503)
    assert (typeless["type"], typeless["code"]) == ("server_error", "replica_error")


def test_an_openai_shaped_error_with_a_null_code_gets_its_type_as_the_code() -> None:
    error = {"message": "m", "type": "rate_limit_error", "param": None, "code": None}
    assert translate(error, 429) == {**error, "code": "rate_limit_error"}
    generic = {"message": "m", "type": "server_error", "param": None, "code": None}
    assert translate(generic, 500)["code"] == "replica_error"


def test_an_error_already_in_openai_shape_is_kept() -> None:
    error = {"message": "m", "type": "invalid_request_error", "param": "model", "code": "x"}
    assert translate(error, 400) == error


def test_a_partial_error_object_gets_every_openai_field() -> None:
    """Found in review: ``{"type": "x"}`` passed without message or param, and an
    empty type gave an empty code."""
    bare = translate({"type": "x"}, 500)
    assert bare == {"message": '{"type": "x"}', "type": "x", "param": None, "code": "x"}
    for empty in ({"type": "", "message": "m"}, {"type": "x", "code": "", "message": "m"}):
        out = translate(empty, 503)
        assert out["code"] and out["type"], out
        assert list(out)[:4] == ["message", "type", "param", "code"]
    # A string code with no type is kept (it says more than the status's default).
    assert translate({"code": "overloaded", "message": "m"}, 503)["code"] == "overloaded"
    assert translate({"type": "x", "param": 3, "message": "m"}, 400)["param"] is None


def test_a_body_that_is_no_error_object_is_quoted_in_one() -> None:
    body = json.loads(error_answer(b"<html>Bad Gateway</html>", 502, "m"))
    assert body["error"]["type"] == "server_error"
    assert body["error"]["code"] == "upstream_error"
    assert "answered 502: <html>Bad Gateway</html>" in body["error"]["message"]
    body = json.loads(error_answer(json.dumps({"error": CONTEXT}).encode(), 400, "m"))
    assert body["error"]["code"] == "context_length_exceeded"


STREAM = (
    b'data: {"choices":[{"text":"a"}]}\n\n'
    b'data: {"choices":[{"text":"b"}]}\n\n'
    b'data: {"error":{"code":500,"message":"boom","type":"server_error"}}\n\n'
)


@pytest.mark.parametrize("end", [b"\n\n", b"\r\n\r\n", b"\r\r"], ids=["lf", "crlf", "cr"])
def test_error_events_in_a_stream_are_rewritten_wherever_the_chunks_split(end: bytes) -> None:
    """Each of SSE's line ends (WHATWG HTML 9.2.6); llama-server writes LF. Only whole
    events go out, whatever the cut."""
    stream = STREAM.replace(b"\n\n", end)
    expected = stream.replace(
        b'{"error":{"code":500,"message":"boom","type":"server_error"}}',
        json.dumps(
            {
                "error": {
                    "message": "boom",
                    "type": "server_error",
                    "param": None,
                    "code": "replica_error",
                }
            }
        ).encode(),
    )
    for cut in range(len(stream) + 1):
        for second in range(cut, len(stream) + 1):
            rewriter = StreamErrors()
            parts = [stream[:cut], stream[cut:second], stream[second:]]
            sent = [rewriter.feed(p) for p in parts if p]
            assert all(not out or out.endswith(end) for out in sent), (cut, second, sent)
            assert b"".join(sent) + rewriter.flush() == expected, (cut, second)


def test_a_stream_passes_unchanged_and_only_in_whole_events() -> None:
    rewriter = StreamErrors()
    event = b'data: {"choices":[{"text":"a"}]}\n\n'
    assert rewriter.feed(event) is event  # no copy
    # Half an event is held until it ends: a stream cut there never sends it.
    assert rewriter.feed(event + b'data: {"choi') == event
    assert rewriter.feed(b'ces":[]}\n\n') == b'data: {"choices":[]}\n\n'
    assert rewriter.feed(b"data: [DO") == b""
    assert rewriter.flush() == b"data: [DO"  # the stream's end passes what was held


def test_an_event_that_never_ends_is_passed_on_past_the_hold_limit() -> None:
    rewriter = StreamErrors()
    assert rewriter.feed(b"data: " + b"x" * HOLD_LIMIT) == b"data: " + b"x" * HOLD_LIMIT
    assert rewriter.flush() == b""


class ErringReplica(LocalServer):
    """A FAKE llama-server whose generation fails: a stream that ends with its error
    event, and a plain 400 (llama-server cannot be made to fail mid-stream on demand)."""

    def __init__(self) -> None:
        super().__init__(web.post("/v1/completions", self._complete))

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"error": CONTEXT}, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(STREAM)
        await response.write_eof()
        return response


def test_the_proxy_translates_plain_and_streamed_errors() -> None:
    async def scenario() -> None:
        replica = ErringReplica()
        await replica.start()
        try:
            settings = RouterSettings(activation=False, replica_concurrency=4)
            async with in_process_router(settings) as app:
                RouterUnderTest(app, replica).pass_endpoint()
                status, headers, body = await asgi_post(app, {"model": "m"})
                assert status == 400 and headers["content-type"] == "application/json"
                assert body["error"]["code"] == "context_length_exceeded"
                assert body["error"]["n_ctx"] == 1024
                sent: list[dict] = []
                scope = {
                    "type": "http", "method": "POST", "path": "/v1/completions",
                    "query_string": b"", "headers": [],
                }  # fmt: skip
                await app(
                    scope,
                    _once(json.dumps({"model": "m", "stream": True}).encode()),
                    _collect(sent),
                )
                data = b"".join(m.get("body", b"") for m in sent[1:])
                last = data.rstrip().split(b"\n\n")[-1]
                error = json.loads(last.removeprefix(b"data: "))["error"]
                assert error["type"] == "server_error" and error["code"] == "replica_error"
                assert "code" in error and error["message"] == "boom"
        finally:
            await replica.stop()

    run(scenario())


def _once(payload: bytes):  # type: ignore[no-untyped-def]
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.Event().wait()
        return {}

    return receive


def _collect(sent: list[dict]):  # type: ignore[no-untyped-def]
    async def send(message: dict) -> None:
        sent.append(message)

    return send
