"""A replica's errors in OpenAI's shape (router.replica_errors): llama-server's error
objects as its format_error_response writes them (llama.cpp tools/server)."""

from __future__ import annotations

import json

from router.replica_errors import StreamErrors, error_answer, translate

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


def test_every_type_gets_a_string_or_null_code_and_an_openai_type() -> None:
    for kind, status in (
        ("invalid_request_error", 400), ("authentication_error", 401),
        ("not_found_error", 404), ("server_error", 500), ("permission_error", 403),
        ("not_supported_error", 501), ("unavailable_error", 503), ("new_error", 418),
        ("new_error", 502),
    ):  # fmt: skip
        out = translate({"code": status, "message": "m", "type": kind}, status)
        assert out["code"] is None or isinstance(out["code"], str), out
        assert out["type"] in {"invalid_request_error", "server_error"}, out
    unknown = translate({"code": 502, "message": "m", "type": "new_error"}, 502)
    assert (unknown["type"], unknown["code"]) == ("server_error", "new_error")


def test_an_error_already_in_openai_shape_is_kept() -> None:
    error = {"message": "m", "type": "invalid_request_error", "param": "model", "code": "x"}
    assert translate(error, 400) == error


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


def test_error_events_in_a_stream_are_rewritten_wherever_the_chunks_split() -> None:
    expected = STREAM.replace(
        b'{"error":{"code":500,"message":"boom","type":"server_error"}}',
        json.dumps(
            {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}
        ).encode(),
    )
    for cut in range(len(STREAM) + 1):
        for second in range(cut, len(STREAM) + 1):
            rewriter = StreamErrors()
            parts = [STREAM[:cut], STREAM[cut:second], STREAM[second:]]
            out = b"".join(rewriter.feed(p) for p in parts if p) + rewriter.flush()
            assert out == expected, (cut, second)


def test_a_stream_without_errors_passes_unchanged_and_unheld() -> None:
    rewriter = StreamErrors()
    event = b'data: {"choices":[{"text":"a"}]}\n\n'
    assert rewriter.feed(event) is event  # no copy
    assert rewriter.feed(b'data: {"choi') == b'data: {"choi'  # not an error: not held
    assert rewriter.feed(b'ces":[]}\n\n') == b'ces":[]}\n\n'
