"""The admin API bounds what it reads and answers every error in its one shape
(planner.api.bodybound, planner.api.admin): run in process over ASGI, the node a
stand-in leader whose usage book records what reaches it."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from planner.api.admin import create_app
from planner.api.bodybound import MAX_BODY_BYTES
from tests.unit.planner.test_forwarding import TOKEN, follower


def leader() -> SimpleNamespace:
    node = follower(None)
    node.is_leader = True
    node.reports = []
    node.usage = SimpleNamespace(used=lambda models: node.reports.append(models))
    node.demand = SimpleNamespace(report=lambda report: None)
    node.consul = SimpleNamespace(model_records=lambda: {"m": object()})
    return node


def post(node: SimpleNamespace, body: bytes, length: bool = True) -> tuple[int, dict[str, Any]]:
    """POST `body` to /v1/usage in 64 KiB chunks (announced with Content-Length, or not:
    chunked); the status and the JSON answer."""
    app = create_app(node, TOKEN, run_node=False)  # type: ignore[arg-type]
    chunks = [body[i : i + 65536] for i in range(0, len(body), 65536)] or [b""]
    sent: list[dict[str, Any]] = []
    read = []

    async def receive() -> dict[str, Any]:
        chunk = chunks.pop(0)
        read.append(len(chunk))
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [
        (b"content-type", b"application/json"),
        (b"authorization", f"Bearer {TOKEN}".encode()),
    ]
    if length:
        headers.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "method": "POST", "path": "/v1/usage", "query_string": b""}
    asyncio.run(app({**scope, "headers": headers}, receive, send))
    node.read_bytes = sum(read)
    answer = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], json.loads(answer) if answer else {}


def test_a_usage_report_within_the_bound_is_taken() -> None:
    node = leader()
    assert post(node, json.dumps({"models": ["m", "other"]}).encode()) == (204, {})
    assert node.reports == [["m"]]


def test_a_body_announced_too_large_is_refused_before_it_is_read() -> None:
    node = leader()
    status, answer = post(node, b'{"models": []}' + b" " * MAX_BODY_BYTES)
    assert status == 413 and answer["error"]["code"] == "body_too_large"
    assert node.read_bytes == 0 and node.reports == []


def test_a_chunked_body_is_refused_once_it_grows_past_the_bound() -> None:
    node = leader()
    body = b'{"models": [], "x": "' + b"a" * (4 * MAX_BODY_BYTES) + b'"}'
    status, answer = post(node, body, length=False)
    assert status == 413 and answer["error"]["code"] == "body_too_large"
    assert node.read_bytes <= MAX_BODY_BYTES + 65536 and node.reports == []


def test_a_body_nested_too_deeply_or_of_the_wrong_shape_is_a_clear_error() -> None:
    nested = b'{"models": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, answer = post(leader(), nested)
    assert status == 400 and answer["error"]["type"] == "planner_error"
    status, answer = post(leader(), json.dumps({"models": "m"}).encode())
    assert status == 422 and answer["error"]["code"] == "invalid_request"
    assert "models" in answer["error"]["message"]
