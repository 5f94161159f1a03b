"""OpenAI error-object shapes (router.errors)."""

from __future__ import annotations

import json

import pytest

from router import errors


def parsed(exc: errors.RouterError) -> tuple[int, dict[bytes, bytes], dict]:
    status, headers, body = errors.render(exc)
    return status, dict(headers), json.loads(body)


def test_model_not_found_shape() -> None:
    status, headers, body = parsed(errors.ModelNotFound("llama"))
    assert status == 404
    assert headers[b"content-type"] == b"application/json"
    assert int(headers[b"content-length"]) == len(errors.render(errors.ModelNotFound("llama"))[2])
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "model_not_found"
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "model"
    assert "llama" in error["message"]


def test_model_not_ready_says_what_is_happening() -> None:
    status, headers, body = parsed(errors.ModelNotReady("m", 2, retry_after_s=5))
    assert status == 503
    assert headers[b"retry-after"] == b"5"
    assert body["error"]["code"] == "model_not_ready"
    assert "2 replica(s) desired" in body["error"]["message"]
    assert "llmgw-m" in body["error"]["message"]


def test_model_with_zero_replicas_gets_no_retry_after() -> None:
    status, headers, body = parsed(errors.ModelNotReady("m", 0, retry_after_s=None))
    assert status == 503
    assert b"retry-after" not in headers
    assert "0 replicas desired" in body["error"]["message"]


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (errors.BodyTooLarge("big"), 413, "request_too_large"),
        (errors.UpstreamUnavailable("down"), 502, "upstream_unavailable"),
        (errors.UpstreamTimeout("slow"), 504, "upstream_timeout"),
        (errors.ModelStopped("m", "stopped"), 503, "model_stopped"),
        (errors.ReplicasBusy("m", "busy", retry_after_s=2), 503, "replicas_busy"),
        (errors.RouterError("bug"), 500, "internal_error"),
        (errors.InvalidRequest("bad"), 400, "invalid_request"),
        (errors.InvalidJson("bad"), 400, "invalid_json"),
        (errors.MissingModel("none", param="model"), 400, "missing_required_parameter"),
    ],
)
def test_status_and_code(exc: errors.RouterError, status: int, code: str) -> None:
    got_status, _, body = parsed(exc)
    assert got_status == status
    assert body["error"]["code"] == code
    assert body["error"]["message"] == exc.message


def test_every_error_class_has_a_string_code() -> None:
    """Issue 21: one error shape, ``code`` a string in every answer (found in review:
    the router's own 400s for bad JSON or no model had a null code)."""
    pending = [errors.RouterError]
    while pending:
        cls = pending.pop()
        assert isinstance(cls.code, str) and cls.code, cls
        pending.extend(cls.__subclasses__())


def test_retry_headers_say_whether_waiting_helps() -> None:
    _, stopped, _ = parsed(errors.ModelStopped("m", "stopped"))
    assert stopped[b"x-should-retry"] == b"false" and b"retry-after" not in stopped
    _, busy, _ = parsed(errors.ReplicasBusy("m", "busy", retry_after_s=2))
    assert busy[b"retry-after"] == b"2" and b"x-should-retry" not in busy


def test_unknown_model_names_both_sources() -> None:
    message = errors.ModelNotFound("x").message
    assert "llmgw/models/x" in message and "service llmgw-x" in message


def test_unknown_reserved_name_says_why_and_not_that_its_service_is_missing() -> None:
    # llmgw-planner exists (the planner's own service): the 404 must not deny it.
    message = errors.ModelNotFound("planner").message
    assert message == (
        "The model `planner` does not exist: the name is reserved (llmgw keeps the names of "
        "its own jobs and services: a model's Consul service is llmgw-<name>, and "
        "llmgw-planner is the planner's service); no model has it (no Consul KV key "
        "llmgw/models/planner)."
    )
    assert "no Consul service" not in errors.ModelNotFound("llmgw-router").message


def test_tree_splits_by_what_the_caller_can_do() -> None:
    assert issubclass(errors.ModelNotFound, errors.RequestRefused)
    assert issubclass(errors.ModelNotReady, errors.ModelUnavailable)
    assert issubclass(errors.UpstreamTimeout, errors.UpstreamError)
    assert not issubclass(errors.CatalogUnavailable, errors.RouterError)
