"""A follower forwards a write, with the admin token, only to where the lock holder
registered (planner.api.admin `_forward`, fed by planner.daemon.leader's resolution).

The admin app runs in process over ASGI (its lifespan included); the leaders are
real aiohttp servers on 127.0.0.1 that record what reaches them. The follower's
node is a stand-in holding only what `_forward` reads (its resolution is set by
hand: the rule itself is tests/unit/contract/test_leadership.py, on real Consul
agents tests/integration/test_leader_forwarding.py).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

from llmgw_contract.leadership import LeaderRefused, LeaderRoute, Refusal, Resolution
from planner.api.admin import create_app
from planner.daemon.metrics import PlannerMetrics
from tests.support.ports import free_port

TOKEN = "admin-secret"


class Recorder:
    """An HTTP server that records every request and answers `status` (with `location`)."""

    def __init__(self, status: int = 204, location: str | None = None) -> None:
        self.requests: list[tuple[str, str | None]] = []
        self.status, self.location = status, location
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)

    async def _handle(self, request: web.Request) -> web.Response:
        self.requests.append((request.path, request.headers.get("Authorization")))
        headers = {"Location": self.location} if self.location else None
        return web.Response(status=self.status, headers=headers)

    async def __aenter__(self) -> Recorder:
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._runner.cleanup()


def follower(route: Resolution) -> SimpleNamespace:
    leadership = SimpleNamespace(id="me", route=route, address="http://127.0.0.1:1")
    return SimpleNamespace(
        leadership=leadership,
        is_leader=False,
        ready=False,
        metrics=PlannerMetrics(lambda: []),
        nomad=None,
        consul=None,
    )


async def post(app: Any, path: str) -> tuple[int, dict[str, str], bytes]:
    """POST {"models": []} to `path` with the admin token over ASGI."""
    sent: list[dict] = []
    body = json.dumps({"models": []}).encode()

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/json"),
            (b"authorization", f"Bearer {TOKEN}".encode()),
        ],
    }
    await app(scope, receive, send)
    headers = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


async def forward(
    route: Resolution, path: str = "/v1/usage"
) -> tuple[int, dict[str, str], bytes, SimpleNamespace]:
    node = follower(route)
    app = create_app(node, TOKEN, run_node=False)  # type: ignore[arg-type]
    async with app.router.lifespan_context(app):
        status, headers, body = await post(app, path)
    return status, headers, body, node


def test_a_refused_leader_gets_nothing_and_the_client_is_told_why() -> None:
    async def scenario() -> None:
        async with Recorder() as forged:
            refusal = LeaderRefused(Refusal.MISMATCH, f"llmgw/leader names {forged.url}")
            status, headers, body, node = await forward(refusal)
            assert forged.requests == []
        assert status == 503 and "retry-after" not in headers
        error = json.loads(body)["error"]
        assert error["code"] == "leader_mismatch"
        assert error["message"].startswith("this follower does not forward writes")
        assert (
            node.metrics.registry.get_sample_value(
                "llmgw_planner_leader_forward_refusals_total", {"code": "leader_mismatch"}
            )
            == 1
        )

    asyncio.run(scenario())


def test_a_lock_changing_hands_is_worth_a_retry() -> None:
    async def scenario() -> None:
        status, headers, body, _ = await forward(LeaderRefused(Refusal.SESSION_GONE, "gone"))
        assert status == 503 and headers["retry-after"] == "2"
        assert json.loads(body)["error"]["code"] == "leader_session_gone"
        status, headers, body, _ = await forward(None)
        assert status == 503 and json.loads(body)["error"]["code"] == "no_leader"

    asyncio.run(scenario())


def test_the_registered_leader_gets_the_write_and_its_answer_is_relayed() -> None:
    async def scenario() -> None:
        async with Recorder() as leader:
            route = LeaderRoute("abc", leader.url, "node-1", "sess-1")
            status, _, _, _ = await forward(route)
            assert status == 204
            assert leader.requests == [("/v1/usage", f"Bearer {TOKEN}")]

    asyncio.run(scenario())


def test_a_redirect_from_the_leader_is_relayed_not_followed() -> None:
    async def scenario() -> None:
        async with Recorder() as elsewhere:
            async with Recorder(307, elsewhere.url + "/v1/usage") as leader:
                route = LeaderRoute("abc", leader.url, "node-1", "sess-1")
                status, _, _, _ = await forward(route)
                assert status == 307 and len(leader.requests) == 1
            assert elsewhere.requests == []

    asyncio.run(scenario())


def test_forwarding_refuses_a_context_that_skips_the_host_name() -> None:
    lax = ssl.create_default_context()
    lax.check_hostname = False
    with pytest.raises(ValueError, match="host name"):
        create_app(follower(None), TOKEN, run_node=False, forward_ssl=lax)  # type: ignore[arg-type]
    create_app(
        follower(None),
        TOKEN,
        run_node=False,  # type: ignore[arg-type]
        forward_ssl=ssl.create_default_context(),
    )
