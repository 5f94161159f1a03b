"""Following the planners (router.planners, router.plannerapi, router.catalog.parse_leader;
the resolution rule itself: tests/unit/contract/test_leadership.py).

The candidate order is a pure value, tested as one. The "move on only when a
planner could not be reached" rule runs against real sockets on 127.0.0.1:
aiohttp servers that answer (:class:`Planner`), a port nothing listens on
(refused), a listening socket whose accept queue is full (the kernel drops the
SYN: a connect timeout), an HTTPS server whose certificate the client does not
trust (a TLS handshake failure), a server that hangs after reading the request
and one that closes the connection after reading it. The router app itself is
driven over ASGI as in test_activation.py, its Consul watches played by
writing into :class:`PlannerCandidates` by hand.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import socket
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from llmgw_contract import LeaderRecord, encode
from llmgw_contract.leadership import LeaderRefused, LeaderRoute, Refusal
from router import errors
from router.catalog import ServiceAddress, parse_leader
from router.metrics import RouterMetrics
from router.plannerapi import PlannerAPI
from router.planners import PlannerCandidates
from router.settings import RouterSettings
from tests.support.router_harness import (
    LocalServer,
    RouterUnderTest,
    asgi_post,
    free_port,
    in_process_router,
    run,
)
from tests.support.tls import make_ca

SWITCHES = "llmgw_router_planner_switches_total"
NO_LEADER = {"message": "no planner leads now (an election is under way)", "code": "no_leader"}


def leader(address: str) -> LeaderRoute:
    """The lock holder, as resolved from its registration."""
    return LeaderRoute(planner_id="abc", url=address, node="n1", session="sess-1")


# --- the order ---------------------------------------------------------------------


def test_the_configured_url_alone_until_consul_says_more() -> None:
    planners = PlannerCandidates("http://10.0.0.1:4650/", RouterMetrics())
    assert planners.ordered() == ["http://10.0.0.1:4650"]


def test_leader_then_configured_then_instances_without_repeats() -> None:
    planners = PlannerCandidates("https://10.0.0.1:4650", RouterMetrics())
    planners.set_instances(
        [
            ServiceAddress("10.0.0.1", 4650),
            ServiceAddress("10.0.0.3", 4650),
            ServiceAddress("fd00::2", 4650),
        ]
    )
    planners.set_leader(leader("https://10.0.0.2:4650/"))
    # Instances take the configured URL's scheme; an IPv6 address goes in brackets.
    assert planners.ordered() == [
        "https://10.0.0.2:4650",
        "https://10.0.0.1:4650",
        "https://10.0.0.3:4650",
        "https://[fd00::2]:4650",
    ]
    planners.set_leader(None)  # the lock is free: an election
    assert planners.ordered()[0] == "https://10.0.0.1:4650"


def test_no_fixed_url_lists_only_the_leader_and_the_instances() -> None:
    """LLMGW_PLANNER_URL=none (the router job's default): no 127.0.0.1:4650 fallback."""
    settings = RouterSettings(planner_url="none")
    planners = PlannerCandidates(
        settings.fixed_planner_url, RouterMetrics(), settings.planner_scheme
    )
    assert planners.ordered() == []
    planners.set_instances([ServiceAddress("10.0.0.3", 4650)])
    planners.set_leader(leader("https://10.0.0.2:4650"))
    assert planners.ordered() == ["https://10.0.0.2:4650", "http://10.0.0.3:4650"]
    # With the planners' CA the instances are called over https.
    tls = RouterSettings(planner_url="none", planner_cacert="/ca.pem")
    planners = PlannerCandidates(tls.fixed_planner_url, RouterMetrics(), tls.planner_scheme)
    planners.set_instances([ServiceAddress("10.0.0.3", 4650)])
    assert planners.ordered() == ["https://10.0.0.3:4650"]


def test_the_planner_that_answered_comes_right_after_the_leader() -> None:
    metrics = RouterMetrics()
    planners = PlannerCandidates("http://a:4650", metrics)
    planners.set_instances(
        [ServiceAddress("a", 4650), ServiceAddress("b", 4650), ServiceAddress("c", 4650)]
    )
    planners.answered("http://c:4650")
    assert planners.ordered() == ["http://c:4650", "http://a:4650", "http://b:4650"]
    planners.set_leader(leader("http://b:4650"))
    assert planners.ordered() == ["http://b:4650", "http://c:4650", "http://a:4650"]
    # One that no source lists any more (it stopped and deregistered) is not tried.
    planners.set_instances([ServiceAddress("a", 4650), ServiceAddress("b", 4650)])
    assert planners.ordered() == ["http://b:4650", "http://a:4650"]


def test_a_switch_is_logged_once_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    metrics = RouterMetrics()
    planners = PlannerCandidates("http://a:4650", metrics)
    assert metrics.registry.get_sample_value(SWITCHES) == 0  # published at zero
    with caplog.at_level(logging.INFO, logger="router.planners"):
        planners.answered("http://a:4650")
        planners.answered("http://a:4650")
        planners.answered("http://b:4650")
        planners.answered("http://b:4650")
    assert [r.getMessage() for r in caplog.records] == [
        "planner calls go to http://a:4650 (the configured --planner-url)",
        "planner calls switched from http://a:4650 to http://b:4650 "
        "(a passing llmgw-planner instance)",
    ]
    assert metrics.registry.get_sample_value(SWITCHES) == 1


def kv_entry(record: LeaderRecord, session: str | None) -> list[dict]:
    value = base64.b64encode(encode(record).encode()).decode()
    return [{"Key": "llmgw/leader", "Value": value, **({"Session": session} if session else {})}]


def registration(address: str = "10.0.0.2", port: int = 4650) -> tuple[list, list]:
    """/v1/session/info/sess-1 and /v1/health/service/llmgw-planner, as Consul 1.8 answers."""
    check = "service:llmgw-planner-abc"
    sessions = [{"ID": "sess-1", "Node": "n1", "Checks": ["serfHealth", check]}]
    instances = [
        {
            "Node": {"Node": "n1", "Address": "10.0.0.9"},
            "Service": {
                "ID": "llmgw-planner-abc",
                "Service": "llmgw-planner",
                "Address": address,
                "Port": port,
                "Meta": {"llmgw_scheme": "http"},
            },
            "Checks": [
                {"CheckID": "serfHealth", "Status": "passing"},
                {"CheckID": check, "Status": "passing"},
            ],
        }
    ]
    return sessions, instances


def test_parse_leader_trusts_the_registration_of_a_held_lock() -> None:
    record = LeaderRecord(id="abc", address="http://10.0.0.2:4650")
    sessions, instances = registration()
    assert parse_leader(kv_entry(record, "sess-1"), sessions, instances) == LeaderRoute(
        "abc", "http://10.0.0.2:4650", "n1", "sess-1"
    )
    # Released (the leader stopped, or its check lapsed): its record stays behind.
    assert parse_leader(kv_entry(record, None), sessions, instances) is None
    assert parse_leader(None) is None  # 404: no planner ever led
    # Rewritten outside the lock: refused, whatever it names.
    forged = LeaderRecord(id="abc", address="http://203.0.113.7:4650")
    refused = parse_leader(kv_entry(forged, "sess-1"), sessions, instances)
    assert isinstance(refused, LeaderRefused) and refused.code is Refusal.MISMATCH
    for garbage in (base64.b64encode(b"{").decode(), "not base64!"):
        entry = [{"Key": "llmgw/leader", "Value": garbage, "Session": "sess-1"}]
        refused = parse_leader(entry, sessions, instances)
        assert isinstance(refused, LeaderRefused) and refused.code is Refusal.RECORD_INVALID


def test_a_refused_leader_is_not_called_and_is_logged_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = RouterMetrics()
    planners = PlannerCandidates("http://10.0.0.1:4650", metrics)
    planners.set_leader(leader("http://10.0.0.2:4650"))
    with caplog.at_level(logging.WARNING, logger="router.planners"):
        planners.set_leader(LeaderRefused(Refusal.MISMATCH, "llmgw/leader names another"))
    assert planners.ordered() == ["http://10.0.0.1:4650"]
    assert "not calling the planner llmgw/leader names: llmgw/leader names another" in caplog.text
    assert (
        metrics.registry.get_sample_value(
            "llmgw_router_planner_leader_refusals_total", {"code": "leader_mismatch"}
        )
        == 1
    )


# --- what moves a call on, against real sockets -----------------------------------


class Planner(LocalServer):
    """A planner's two POST routes, answering `status` (activate: a loading answer
    for 200), after `delay_s`; records the paths it was asked."""

    def __init__(self, status: int = 200, delay_s: float = 0.0) -> None:
        self.status = status
        self.delay_s = delay_s
        self.calls: list[str] = []
        super().__init__(
            web.post("/v1/models/{name}/activate", self._answer),
            web.post("/v1/usage", self._answer),
        )

    async def _answer(self, request: web.Request) -> web.Response:
        self.calls.append(request.path)
        await asyncio.sleep(self.delay_s)
        if self.status == 503:
            return web.json_response({"error": NO_LEADER}, status=503)
        if request.path == "/v1/usage":
            return web.Response(status=204)
        name = request.match_info["name"]
        return web.json_response({"name": name, "status": "loading", "reason": "scaled up"})


@contextlib.contextmanager
def full_accept_queue() -> Iterator[str]:
    """A listening socket whose accept queue is full: the kernel drops further SYNs,
    so a connect to it times out (a host that drops packets, on loopback)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            yield f"http://127.0.0.1:{port}"


async def closes_after_reading() -> tuple[asyncio.Server, str]:
    """A server that reads the request and closes the connection without answering."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@contextlib.asynccontextmanager
async def api(*urls: str, timeout_s: float = 3.0) -> AsyncIterator[PlannerAPI]:
    """A started PlannerAPI whose candidates are `urls`, in that order (the first as
    the configured URL, the rest as passing instances)."""
    planners = PlannerCandidates(urls[0], RouterMetrics())
    planners.instances = tuple(urls[1:])
    client = PlannerAPI(planners, "t0ken", timeout_s)
    await client.start()
    try:
        yield client
    finally:
        await client.close()


def refused_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_a_refused_connection_moves_on_and_the_one_that_answered_is_remembered() -> None:
    async def scenario() -> None:
        second = Planner()
        await second.start()
        down = refused_url()
        try:
            async with api(down, second.url) as client:
                started = time.monotonic()
                answer = await client.activate("m")
                assert time.monotonic() - started < 1.0
                assert answer.status == "loading" and second.calls == ["/v1/models/m/activate"]
                assert client.planners.current == second.url
                assert client.planners.ordered() == [second.url, down]
                await client.report_usage(["m"])
                assert second.calls[-1] == "/v1/usage"
        finally:
            await second.stop()

    run(scenario())


def test_a_connect_timeout_costs_the_connect_timeout_then_moves_on() -> None:
    async def scenario() -> None:
        second = Planner()
        await second.start()
        try:
            with full_accept_queue() as dropped:
                async with api(dropped, second.url, timeout_s=2.0) as client:
                    started = time.monotonic()
                    answer = await client.activate("m")
                    took = time.monotonic() - started
            # sock_connect is min(2 s, timeout_s / 2): the dead candidate cost that 1 s,
            # not the call's 2 s.
            assert 0.9 < took < 2.0, took
            assert answer.status == "loading" and len(second.calls) == 1
        finally:
            await second.stop()

    run(scenario())


def test_a_tls_handshake_failure_moves_on(tmp_path: Path) -> None:
    ca = make_ca(tmp_path)  # a CA the client does not trust
    serving = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    serving.load_cert_chain(ca.cert, ca.key)

    async def scenario() -> None:
        untrusted, second = Planner(), Planner()
        await untrusted.start(serving)
        await second.start()
        try:
            async with api(untrusted.url, second.url) as client:
                assert (await client.activate("m")).status == "loading"
            assert untrusted.calls == [] and len(second.calls) == 1
            # Alone, it is a configuration error: no Retry-After, and what to check.
            async with api(untrusted.url) as client:
                with pytest.raises(errors.PlannerUnavailable) as info:
                    await client.activate("m")
            assert info.value.retry_after_s is None
            message = info.value.message
            assert f"The planner at {untrusted.url} could not be verified" in message
            assert "LLMGW_PLANNER_CACERT" in message
        finally:
            await untrusted.stop()
            await second.stop()

    run(scenario())


def test_an_answer_is_final_even_503_no_leader() -> None:
    async def scenario() -> None:
        follower, other = Planner(status=503), Planner()
        await follower.start()
        await other.start()
        try:
            async with api(follower.url, other.url) as client:
                with pytest.raises(errors.PlannerUnavailable) as info:
                    await client.activate("m")
                assert info.value.retry_after_s == 5
                assert "HTTP 503: no planner leads now" in info.value.message
                with pytest.raises(errors.PlannerUnavailable):
                    await client.report_usage(["m"])
                # It answered: it is where calls go now.
                assert client.planners.current == follower.url
            assert len(follower.calls) == 2 and other.calls == []
        finally:
            await follower.stop()
            await other.stop()

    run(scenario())


def test_a_planner_that_hangs_or_drops_after_the_request_went_out_is_not_left() -> None:
    async def scenario() -> None:
        hanging, other = Planner(delay_s=5), Planner()
        await hanging.start()
        await other.start()
        dropping, dropping_url = await closes_after_reading()
        try:
            async with api(hanging.url, other.url, timeout_s=0.5) as client:
                with pytest.raises(errors.PlannerUnavailable, match=r"did not answer within 0\.5"):
                    await client.activate("m")
            async with api(dropping_url, other.url) as client:
                with pytest.raises(errors.PlannerUnavailable, match="may have acted"):
                    await client.activate("m")
            assert hanging.calls == ["/v1/models/m/activate"] and other.calls == []
        finally:
            dropping.close()
            await dropping.wait_closed()
            await hanging.stop()
            await other.stop()

    run(scenario())


def test_none_reached_names_each_one_with_retry_after() -> None:
    async def scenario() -> None:
        first, second = refused_url(), refused_url()
        async with api(first, second) as client:
            with pytest.raises(errors.PlannerUnavailable) as info:
                await client.report_usage(["m"])
        assert info.value.retry_after_s == 5
        message = info.value.message
        assert message.startswith("No planner could be reached to record the use of 1 model(s)")
        assert message.index(first) < message.index(second)

    run(scenario())


# --- the router app ----------------------------------------------------------------


def test_the_router_follows_a_failover_for_activation_and_usage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The configured planner is gone; Consul names another leader: requests are
    activated and usage reported there, and the switch is logged once and counted."""

    async def scenario() -> None:
        leader_now = Planner()
        await leader_now.start()
        down = refused_url()
        settings = RouterSettings(
            planner_url=down, planner_token="t", activation_window_s=0.2, usage_interval_s=0.1
        )
        try:
            async with in_process_router(settings, ("m",)) as app:
                h = RouterUnderTest(app, leader_now)
                planners: PlannerCandidates = app.state.planners
                planners.answered(down)  # it answered before it died
                body = {"model": "m", "prompt": "hi"}
                status, headers, error = await asgi_post(app, body)
                assert status == 503 and headers["retry-after"] == "5"
                assert down in error["error"]["message"]
                # The Consul watches see the new leader.
                planners.set_leader(leader(leader_now.url))
                status, _, error = await asgi_post(app, body)  # loading past a 0.2 s window
                assert status == 503 and error["error"]["code"] == "model_loading"
                assert leader_now.calls == ["/v1/models/m/activate"]
                assert await app.state.usage.report() == ["m"]
                assert leader_now.calls[-1] == "/v1/usage"
                assert h.metric(SWITCHES) == 1
        finally:
            await leader_now.stop()

    with caplog.at_level(logging.INFO, logger="router.planners"):
        run(scenario())
    switched = [r for r in caplog.records if "switched" in r.getMessage()]
    assert len(switched) == 1
    assert (
        "(the leader: the lock holder of Consul llmgw/leader, as registered)"
        in switched[0].getMessage()
    )
