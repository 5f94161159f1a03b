"""On-demand activation and usage reports (router.activation, router.plannerapi, router.usage).

A unit test of the router's policy, not of the planner: the planner's
activator API is played by a small scripted aiohttp server on 127.0.0.1
(:class:`StubPlanner`) that answers each activate call from a list, records
every call and header, and doubles as the upstream replica once a test makes
an endpoint "pass" (by writing it into the endpoint table, as the Consul watch
would). The router app is driven over ASGI in the test's event loop, without
its lifespan (no Consul). The real planner and Consul are in
tests/integration/test_router_consul.py and tests/integration/test_on_demand.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from llmgw_contract import ActivationStatus, Parked, ScalingBounds, StateDocument, Unplaceable
from llmgw_contract.documents import USAGE_GOODBYE_INTERVAL_S
from router.settings import RouterSettings
from tests.support.router_harness import (
    LocalServer,
    RouterUnderTest,
    asgi_post,
    count_activation_steps,
    free_port,
    in_process_router,
    run,
    until,
)


def parked_state(name: str, reason: str) -> StateDocument:
    return StateDocument(name=name, parked=Parked(reason=reason))


def unplaceable_state(name: str, reason: str, since: str = "", **more: object) -> StateDocument:
    return StateDocument(name=name, unplaceable=Unplaceable(reason=reason, since=since, **more))


TOKEN = "s3cret"
MISSING_GPU = 'no node has an nvidia/gpu device: 1 of 1 nodes filtered ("missing devices")'


class StubPlanner(LocalServer):
    """Scripted activator API plus a trivial upstream, on one aiohttp server.

    ``answers[model]`` is a list of activate answers, used in order (the last
    one repeats): a dict (merged over ``{"status": ...}`` defaults) or an int
    HTTP status answered with an error body. A model without a script is 404.
    While ``hold`` is an unset event, answers wait until the test sets it (an
    activate call in flight for as long as a test needs, whatever the machine's
    load).
    """

    def __init__(self, answers: dict[str, list[dict | int]]) -> None:
        self.answers = answers
        self.activations: list[str] = []
        self.authorization: list[str | None] = []
        self.usage: list[list[str]] = []
        self.reports: list[dict] = []
        self.upstream_hits = 0
        self.usage_status = 204
        self.hold: asyncio.Event | None = None
        super().__init__(
            web.post("/v1/models/{name}/activate", self._activate),
            web.post("/v1/usage", self._usage),
            web.post("/v1/completions", self._upstream),
        )

    async def _activate(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.activations.append(name)
        self.authorization.append(request.headers.get("Authorization"))
        if self.hold is not None:
            await self.hold.wait()
        script = self.answers.get(name)
        if not script:
            error = {"message": f"model {name!r} was never applied", "code": "model_not_found"}
            return web.json_response({"error": error}, status=404)
        answer = script.pop(0) if len(script) > 1 else script[0]
        if isinstance(answer, int):
            error = {"message": "nomad is unreachable", "type": "planner_error", "code": "x"}
            return web.json_response({"error": error}, status=answer)
        body = {"name": name, "reason": "", "last_error": None, "since": None, **answer}
        return web.json_response(body)

    async def _usage(self, request: web.Request) -> web.Response:
        self.authorization.append(request.headers.get("Authorization"))
        body = await request.json()
        self.usage.append(body["models"])
        self.reports.append(body)
        return web.Response(status=self.usage_status)

    async def _upstream(self, request: web.Request) -> web.Response:
        self.upstream_hits += 1
        return web.json_response({"object": "text_completion", "served_by": "stub"})


def router_tasks() -> set[asyncio.Task]:
    """Running tasks, minus the stub server's keep-alive connection handlers."""
    return {
        t
        for t in asyncio.all_tasks()
        if t.get_coro().__qualname__ != "RequestHandler.start"  # type: ignore[union-attr]
    }


class Harness(RouterUnderTest):
    def __init__(self, app: Any, stub: StubPlanner) -> None:
        super().__init__(app, stub)
        self.stub = stub

    async def post(
        self, model: str = "m", leave: asyncio.Event | None = None
    ) -> tuple[int | None, dict[str, str], dict]:
        """One request over ASGI: (status, headers, JSON body); status None if the client
        left (once `leave` is set)."""
        return await asgi_post(self.app, {"model": model, "prompt": "hi"}, leave=leave)


@contextlib.asynccontextmanager
async def harness(
    answers: dict[str, list[dict | int]] | None = None,
    *,
    window_s: float = 5.0,
    planner_url: str | None = None,
    token: str | None = TOKEN,
    models: tuple[str, ...] = ("m",),
) -> AsyncIterator[Harness]:
    stub = StubPlanner(answers or {})
    await stub.start()
    settings = RouterSettings(
        planner_url=planner_url or stub.url,
        planner_token=token,
        activation_window_s=window_s,
        usage_interval_s=0.1,
    )
    try:
        async with in_process_router(settings, models) as app:
            yield Harness(app, stub)
    finally:
        await stub.stop()


LOADING = {"status": "loading", "reason": "scaled up from 0; allocation pending"}


# --- answers that refuse at once ------------------------------------------------


def test_unplaceable_is_refused_at_once_with_the_reason() -> None:
    async def scenario() -> None:
        answer = {"status": "unplaceable", "reason": MISSING_GPU, "since": "2026-11-29T21:00Z"}
        async with harness({"m": [answer]}) as h:
            status, headers, body = await h.post()
            # At once: it never waited for an endpoint (no wait observed).
            assert h.metric("llmgw_router_activation_wait_seconds_count", model="m") == 0
            assert status == 503 and "retry-after" not in headers
            error = body["error"]
            assert error["code"] == "model_unplaceable" and MISSING_GPU in error["message"]
            assert h.stub.activations == ["m"] and h.stub.authorization == [f"Bearer {TOKEN}"]
            assert h.metric("llmgw_router_activations_total", model="m", outcome="unplaceable") == 1
            assert h.metric("llmgw_router_refusals_total", model="m", reason="unplaceable") == 1
            # Each request asks again: asking is what makes the planner retry.
            await h.post()
            assert h.stub.activations == ["m", "m"]

    run(scenario())


def test_parked_answer_and_parked_state() -> None:
    async def scenario() -> None:
        answer = {"status": "parked", "reason": "5 consecutive start failures",
                  "last_error": "Terminated: Exit Code: 1\nerror loading model: kev"}  # fmt: skip
        async with harness({"m": [answer], "k": [LOADING]}, models=("m", "k")) as h:
            status, _, body = await h.post()
            assert status == 503 and body["error"]["code"] == "model_parked"
            assert "5 consecutive start failures" in body["error"]["message"]
            assert "error loading model: kev" in body["error"]["message"]
            # Parked in Consul KV: refused without asking the planner.
            h.table.set_states({"k": parked_state("k", "5 consecutive start failures")})
            status, _, body = await h.post("k")
            assert status == 503 and body["error"]["code"] == "model_parked"
            assert h.stub.activations == ["m"]

    run(scenario())


def test_planner_not_found_is_model_not_found() -> None:
    async def scenario() -> None:
        async with harness({}) as h:
            status, _, body = await h.post()
            assert status == 404 and body["error"]["code"] == "model_not_found"
            assert f"the planner at {h.stub.url} does not know it" in body["error"]["message"]
            assert h.metric("llmgw_router_activations_total", model="m", outcome="error") == 1

    run(scenario())


def test_stopped_is_refused_at_once_in_the_planners_words() -> None:
    async def scenario() -> None:
        answer = {"status": "stopped", "reason": "defined with replicas: 0"}
        async with harness({"m": [answer]}) as h:
            status, headers, body = await h.post()
            # At once: it never waited for an endpoint (no wait observed).
            assert h.metric("llmgw_router_activation_wait_seconds_count", model="m") == 0
            assert status == 503 and "retry-after" not in headers
            assert headers["x-should-retry"] == "false"
            error = body["error"]
            assert error["code"] == "model_stopped" and error["param"] == "model"
            assert "`m` is stopped: defined with replicas: 0." in error["message"]
            assert h.metric("llmgw_router_activations_total", model="m", outcome="stopped") == 1
            assert h.metric("llmgw_router_activations_total", model="m", outcome="error") == 0
            assert h.metric("llmgw_router_refusals_total", model="m", reason="stopped") == 1
            assert h.table.get("m").loading_since is None

    run(scenario())


def test_an_answer_outside_the_contract_is_planner_unavailable() -> None:
    async def scenario() -> None:
        async with harness({"m": [{"status": "sleeping", "reason": "?"}]}) as h:
            status, headers, body = await h.post()
            assert status == 503 and headers["retry-after"] == "5"
            error = body["error"]
            assert error["code"] == "planner_unavailable"
            assert "an answer this router does not understand" in error["message"]
            assert h.metric("llmgw_router_activations_total", model="m", outcome="error") == 1

    run(scenario())


# --- waiting for an endpoint ------------------------------------------------------


def test_loading_then_endpoint_passes_is_forwarded(monkeypatch: pytest.MonkeyPatch) -> None:
    _, waits = count_activation_steps(monkeypatch)

    async def scenario() -> None:
        async with harness({"m": [LOADING]}, window_s=30) as h:
            started = time.monotonic()
            request = asyncio.ensure_future(h.post())
            # Waiting is a state, not a duration: the planner has answered `loading`
            # and the request is held, waiting for a change.
            await until(lambda: waits["m"] == 1, what="the request waits for an endpoint")
            assert not request.done()
            h.pass_endpoint()
            passed_after = time.monotonic() - started
            status, _, body = await asyncio.wait_for(request, 10)
            assert status == 200 and body["served_by"] == "stub"
            assert h.metric("llmgw_router_activations_total", model="m", outcome="loading") == 1
            assert h.metric("llmgw_router_activation_wait_seconds_count", model="m") == 1
            waited = h.metric("llmgw_router_activation_wait_seconds_sum", model="m")
            assert 0 < waited <= time.monotonic() - started and passed_after > 0
            # Served from now on without asking the planner.
            assert (await h.post())[0] == 200
            assert h.stub.activations == ["m"]
            assert h.table.get("m").loading_since is None

    run(scenario())


def test_serving_answer_waits_for_the_watch_to_catch_up(monkeypatch: pytest.MonkeyPatch) -> None:
    _, waits = count_activation_steps(monkeypatch)

    async def scenario() -> None:
        async with harness({"m": [{"status": "serving"}]}, window_s=30) as h:
            request = asyncio.ensure_future(h.post())
            await until(lambda: waits["m"] == 1, what="the request waits for the watch")
            assert not request.done() and h.stub.activations == ["m"]
            h.pass_endpoint()
            assert (await asyncio.wait_for(request, 2))[0] == 200

    run(scenario())


def test_window_shorter_than_the_load_is_503_loading_then_served() -> None:
    async def scenario() -> None:
        async with harness({"m": [LOADING]}, window_s=0.3) as h:
            started = time.monotonic()
            # The window ends the wait: without it the stub's `loading` would hold
            # the request for ever (10 s bound, not a timing figure).
            status, headers, body = await asyncio.wait_for(h.post(), 10)
            assert time.monotonic() - started >= 0.3
            assert status == 503 and headers["retry-after"] == "5"
            error = body["error"]
            assert error["code"] == "model_loading" and error["param"] == "model"
            assert "`m` is loading (planner: scaled up from 0" in error["message"]
            assert "first asked the planner to start it" in error["message"]
            first_asked = h.table.get("m").loading_since
            # A second try asks again; the episode (and its start) carries on.
            assert (await h.post())[2]["error"]["code"] == "model_loading"
            assert h.table.get("m").loading_since == first_asked
            assert h.stub.activations == ["m", "m"]
            assert h.metric("llmgw_router_refusals_total", model="m", reason="loading") == 2
            h.pass_endpoint()
            assert (await h.post())[0] == 200

    run(scenario())


def test_parked_while_waiting_is_refused_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _, waits = count_activation_steps(monkeypatch)

    async def scenario() -> None:
        async with harness({"m": [LOADING]}, window_s=30) as h:
            request = asyncio.ensure_future(h.post())
            await until(lambda: waits["m"] == 1, what="the request waits for an endpoint")
            h.table.set_states({"m": parked_state("m", "5 consecutive start failures")})
            # At once: on the change itself (no second wait), not at the window's end.
            status, _, body = await asyncio.wait_for(request, 10)
            assert waits["m"] == 1
            assert status == 503 and body["error"]["code"] == "model_parked"

    run(scenario())


def test_fresh_unplaceable_while_waiting_is_refused_but_not_a_stale_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, waits = count_activation_steps(monkeypatch)

    async def scenario() -> None:
        stale = unplaceable_state("m", "an hour-old answer", "2026-11-29T20:00Z")
        fresh = unplaceable_state("m", MISSING_GPU, "2026-11-29T21:00Z")
        async with harness({"m": [LOADING]}, window_s=30) as h:
            h.table.set_states({"m": stale})  # the planner cleared it; the watch lags
            request = asyncio.ensure_future(h.post())
            await until(lambda: waits["m"] == 1, what="the request waits, stale record held")
            h.table.set_states({})
            # It checked the entry after the change and waits on: not refused.
            await until(lambda: request.done() or waits["m"] == 2, what="acted on the change")
            assert not request.done()
            h.table.set_states({"m": fresh})  # Nomad's answer to the fresh attempt
            status, _, body = await asyncio.wait_for(request, 2)
            assert status == 503 and body["error"]["code"] == "model_unplaceable"
            assert MISSING_GPU in body["error"]["message"]

    run(scenario())


MEMORY = "memory exhausted on 1 of 1 nodes"


def test_room_being_made_is_waited_for_never_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _, waits = count_activation_steps(monkeypatch)

    async def scenario() -> None:
        provisional = unplaceable_state("m", MEMORY, "2026-11-29T21:00Z", provisional=True)
        room = {"status": "loading", "reason": "waiting for room being made"}
        async with harness({"m": [room]}, window_s=30) as h:
            request = asyncio.ensure_future(h.post())
            await until(lambda: waits["m"] == 1, what="the request waits for an endpoint")
            h.table.set_states({"m": provisional})  # Nomad: no room yet, allocations stopping
            await until(lambda: request.done() or waits["m"] == 2, what="acted on the change")
            assert not request.done()  # not refused on it
            h.table.set_states({})  # the blocked evaluation placed it
            h.pass_endpoint()
            status, _, _ = await asyncio.wait_for(request, 2)
            assert status == 200
            assert h.metric("llmgw_router_refusals_total", model="m", reason="unplaceable") == 0

    run(scenario())


def test_a_model_placed_in_part_is_waited_for_and_served_never_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nomad placed 1 of 2 replicas: the one placed starts and will serve, so the
    shortfall the state document records is no refusal (`Unplaceable.refuses`)."""
    _, waits = count_activation_steps(monkeypatch)

    async def scenario() -> None:
        part = unplaceable_state(
            "m", f"1 of 2 replicas placed; {MEMORY}", "2026-11-29T21:00Z", placed=1, desired=2
        )
        starting = {"status": "loading", "reason": "the replicas placed are starting"}
        async with harness({"m": [starting]}, window_s=30) as h:
            request = asyncio.ensure_future(h.post())
            await until(lambda: waits["m"] == 1, what="the request waits for an endpoint")
            h.table.set_states({"m": part})  # the planner records Nomad's answer
            await until(lambda: request.done() or waits["m"] == 2, what="acted on the change")
            assert not request.done()  # not refused on it
            h.pass_endpoint()  # the placed replica passes; the record stays
            status, _, _ = await asyncio.wait_for(request, 2)
            assert status == 200
            assert h.metric("llmgw_router_refusals_total", model="m", reason="unplaceable") == 0

    run(scenario())


def test_room_being_made_past_the_window_is_loading_and_says_so() -> None:
    async def scenario() -> None:
        provisional = unplaceable_state("m", MEMORY, provisional=True)
        async with harness({"m": [{"status": "loading"}]}, window_s=0.3) as h:
            h.table.set_states({"m": provisional})
            status, headers, body = await h.post()
            assert status == 503 and headers["retry-after"] == "5"
            error = body["error"]
            assert error["code"] == "model_loading"
            assert "waiting for room being made on the cluster" in error["message"]
            assert MEMORY in error["message"] and "activation window is 0.3 s" in error["message"]
            assert h.metric("llmgw_router_refusals_total", model="m", reason="loading") == 1

    run(scenario())


def test_model_removed_while_waiting_is_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    _, waits = count_activation_steps(monkeypatch)

    async def scenario() -> None:
        async with harness({"m": [LOADING]}, window_s=30) as h:
            request = asyncio.ensure_future(h.post())
            await until(lambda: waits["m"] == 1, what="the request waits for an endpoint")
            h.table.set_models({})
            status, _, body = await asyncio.wait_for(request, 10)
            assert status == 404 and body["error"]["code"] == "model_not_found"

    run(scenario())


def test_concurrent_requests_share_one_activate_call(monkeypatch: pytest.MonkeyPatch) -> None:
    entered, waits = count_activation_steps(monkeypatch)

    async def scenario() -> None:
        async with harness({"m": [LOADING]}, window_s=30) as h:
            h.stub.hold = asyncio.Event()  # the call stays in flight until all 8 joined it
            requests = [asyncio.ensure_future(h.post()) for _ in range(8)]
            await until(lambda: entered["m"] == 8, what="8 requests in the activator")
            h.stub.hold.set()
            await until(lambda: waits["m"] == 8, what="8 requests wait for an endpoint")
            h.pass_endpoint()
            results = await asyncio.wait_for(asyncio.gather(*requests), 10)
            assert [r[0] for r in results] == [200] * 8
            assert h.stub.activations == ["m"]
            assert h.metric("llmgw_router_activations_total", model="m", outcome="loading") == 1
            assert h.metric("llmgw_router_activation_wait_seconds_count", model="m") == 8

    run(scenario())


def test_client_leaving_while_waiting_stops_the_wait_without_leaking_tasks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, waits = count_activation_steps(monkeypatch)

    async def scenario() -> None:
        async with harness({"m": [LOADING]}, window_s=30) as h:
            before = router_tasks()
            leave = asyncio.Event()
            request = asyncio.ensure_future(h.post(leave=leave))
            await until(lambda: waits["m"] == 1, what="the request waits for an endpoint")
            leave.set()
            # The wait ends with the client (well before the 30 s window).
            status, _, _ = await asyncio.wait_for(request, 10)
            assert status is None  # nothing sent: the client is gone
            # The request's tasks end as the cancellation unwinds them.
            await until(lambda: router_tasks() == before, what="no task left behind")
            assert h.metric("llmgw_router_requests_total", model="m", code="499") == 1
            assert h.metric("llmgw_router_activation_wait_seconds_count", model="m") == 1

    run(scenario())


def test_a_waiter_leaving_does_not_cancel_the_shared_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entered, waits = count_activation_steps(monkeypatch)

    async def scenario() -> None:
        async with harness({"m": [LOADING]}, window_s=30) as h:
            h.stub.hold = asyncio.Event()  # the shared call is in flight while the leaver goes
            leave = asyncio.Event()
            leaver = asyncio.ensure_future(h.post(leave=leave))
            stayer = asyncio.ensure_future(h.post())
            await until(lambda: entered["m"] == 2, what="both requests share the call")
            leave.set()
            assert (await asyncio.wait_for(leaver, 10))[0] is None
            h.stub.hold.set()
            # The stayer got the shared call's answer: it waits for an endpoint.
            await until(lambda: waits["m"] == 1, what="the stayer waits for an endpoint")
            h.pass_endpoint()
            assert (await asyncio.wait_for(stayer, 10))[0] == 200
            assert h.stub.activations == ["m"]

    run(scenario())


# --- the planner failing ----------------------------------------------------------


def test_planner_down_is_planner_unavailable_fast() -> None:
    async def scenario() -> None:
        down = f"http://127.0.0.1:{free_port()}"
        async with harness(planner_url=down) as h:
            status, headers, body = await h.post()
            assert status == 503 and headers["retry-after"] == "5"
            error = body["error"]
            assert error["code"] == "planner_unavailable" and down in error["message"]
            # Fast: the connection was refused, which costs nothing; the slow failure,
            # a connect timeout (2 s), would say ConnectionTimeoutError.
            assert "(ClientConnectorError: " in error["message"]
            assert "could not be reached to activate the model `m`" in error["message"]
            assert h.metric("llmgw_router_activations_total", model="m", outcome="error") == 1
            refused = h.metric(
                "llmgw_router_refusals_total", model="m", reason="planner_unavailable"
            )
            assert refused == 1

    run(scenario())


def test_planner_errors_and_a_refused_token() -> None:
    async def scenario() -> None:
        async with harness({"m": [503], "t": [401]}, models=("m", "t")) as h:
            status, headers, body = await h.post("m")
            assert status == 503 and body["error"]["code"] == "planner_unavailable"
            assert "HTTP 503: nomad is unreachable" in body["error"]["message"]
            status, headers, body = await h.post("t")
            assert status == 503 and "retry-after" not in headers
            assert "LLMGW_PLANNER_TOKEN" in body["error"]["message"]
            assert TOKEN not in body["error"]["message"]

    run(scenario())


# --- usage reports ----------------------------------------------------------------


def test_usage_heartbeat_posts_the_used_models() -> None:
    async def scenario() -> None:
        answers = {"cold": [{"status": "unplaceable", "reason": "no room"}]}
        async with harness(answers, models=("m", "cold", "unused")) as h:
            h.pass_endpoint("m")
            reporter = h.app.state.usage
            assert await reporter.report() == []  # nothing used: nothing sent
            assert h.stub.usage == []
            await h.post("m")
            await h.post("cold")  # refused, but activating counts as use
            # Count the loop's rounds, so "nothing more was sent" is read after
            # rounds that happened, not after a time.
            rounds = 0
            report = reporter.report

            async def counted() -> list[str]:
                nonlocal rounds
                try:
                    return await report()
                finally:
                    rounds += 1

            reporter.report = counted
            reporter.start()  # every 0.1 s
            await until(lambda: rounds >= 3, what="three report rounds")
            assert h.stub.usage == [["cold", "m"]]  # once, and only while used
            assert h.stub.authorization[-1] == f"Bearer {TOKEN}"
            # A request in flight (a long stream) keeps its model counted.
            h.table.get("m").endpoints[0].inflight += 1
            await until(lambda: len(h.stub.usage) >= 3, what="two more reports")
            assert h.stub.usage[1:] == [["m"]] * (len(h.stub.usage) - 1)
            h.table.get("m").endpoints[0].inflight -= 1

    run(scenario())


def test_usage_reports_carry_the_load_and_say_once_when_it_ended() -> None:
    """Issue 22: each report names this router and its requests per model (in flight on
    its endpoints and waiting for a slot); after the load ends one report carries the
    zeros, then nothing is sent while nothing is used."""

    async def scenario() -> None:
        async with harness(models=("m", "other")) as h:
            h.pass_endpoint("m")
            reporter = h.app.state.usage
            h.table.get("m").endpoints[0].inflight += 2
            assert await reporter.report() == ["m"]
            report = h.stub.reports[-1]
            assert report["load"] == {"m": {"inflight": 2, "waiting": 0, "replicas": 0}}
            assert report["router"] == reporter.router_id and report["interval_s"] == 0.1
            # The replica said it holds 3 more than ours (router.replicaload): reported
            # as what the replicas hold, ours included.
            h.table.get("m").endpoints[0].others = 3
            assert await reporter.report() == ["m"]
            replicas = {"inflight": 2, "waiting": 0, "replicas": 5}
            assert h.stub.reports[-1]["load"] == {"m": replicas}
            h.table.get("m").endpoints[0].others = 0
            h.table.get("m").endpoints[0].inflight -= 2
            assert await reporter.report() == []  # nothing used, but the load ended:
            assert h.stub.reports[-1]["load"] == {} and len(h.stub.reports) == 3
            assert await reporter.report() == []
            assert len(h.stub.reports) == 3  # then silence
            # A model with scaling: every interval, used or not ("no load" is a signal).
            record = h.table.get("m").record
            assert record is not None
            h.table.set_models(
                {
                    "m": record.model_copy(
                        update={"scaling": ScalingBounds(min=1, max=2, target=1)}
                    ),
                    "other": h.table.get("other").record,
                }
            )
            await reporter.report()
            await reporter.report()
            assert len(h.stub.reports) == 5 and h.stub.reports[-1]["load"] == {}

    run(scenario())


def test_a_stopping_router_says_goodbye_once_if_it_ever_reported() -> None:
    """Issue 22: an empty report with the goodbye interval, so the planner forgets this
    router's load at once instead of holding scale-downs as for a silent router."""

    async def scenario() -> None:
        async with harness(models=("m",)) as h:
            h.pass_endpoint("m")
            reporter = h.app.state.usage
            await reporter.stop()
            assert h.stub.reports == []  # never reported: nothing to forget
            h.table.get("m").endpoints[0].inflight += 1
            assert await reporter.report() == ["m"]
            await reporter.stop()
            assert h.stub.reports[-1] == {
                "models": [],
                "router": reporter.router_id,
                "interval_s": USAGE_GOODBYE_INTERVAL_S,
                "load": {},
            }
            await reporter.stop()
            assert len(h.stub.reports) == 2  # once
            h.table.get("m").endpoints[0].inflight -= 1

    run(scenario())


def test_failed_usage_report_is_logged_and_carried_over(caplog) -> None:
    async def scenario() -> None:
        async with harness(models=("m",)) as h:
            h.pass_endpoint("m")
            reporter = h.app.state.usage
            h.stub.usage_status = 500
            await h.post("m")
            assert await reporter.report() == []
            assert await reporter.report() == []  # retried, warned once
            h.stub.usage_status = 204
            assert await reporter.report() == ["m"]
            assert len(h.stub.usage) == 3

    run(scenario())
    warnings = [r for r in caplog.records if "usage report failed" in r.getMessage()]
    assert len(warnings) == 1 and "HTTP 500" in warnings[0].getMessage()


def test_activation_series_exist_at_zero() -> None:
    async def scenario() -> None:
        async with harness() as h:
            for outcome in (*ActivationStatus, "error"):
                assert h.metric("llmgw_router_activations_total", model="m", outcome=outcome) == 0
            for reason in ("loading", "stopped", "replicas_busy", "planner_unavailable"):
                assert h.metric("llmgw_router_refusals_total", model="m", reason=reason) == 0
            h.table.set_models({})
            text = h.app.state.metrics.exposition()[0].decode()
            assert 'model="m"' not in text

    run(scenario())


def test_a_model_consul_forgot_is_a_retryable_503_naming_the_cause_never_404() -> None:
    """Issue 20: Consul restarted with its state gone; the planner does not know the
    model yet (404) or cannot be reached: 503 model_not_ready with Retry-After."""

    async def scenario() -> None:
        for planner_url in (None, f"http://127.0.0.1:{free_port()}"):
            async with harness({}, planner_url=planner_url) as h:
                h.table.set_models({}, consul_reset=True)
                assert h.table.remembered == {"m"}
                status, headers, body = await h.post()
                assert status == 503 and headers["retry-after"] == "5", body
                error = body["error"]
                assert error["code"] == "model_not_ready"
                assert "Consul lost its record" in error["message"]
                assert "the leading planner writes it again" in error["message"]

    run(scenario())


def test_a_not_found_asked_while_forgotten_is_a_503_even_if_the_record_is_back() -> None:
    """Found by CI (issue 20's case): the new leader answered "never applied" just before
    it restored the record; the router saw the record back first and then the answer,
    and sent a 404 for a model it was serving. An answer is judged by the table as it
    stood when the planner was asked."""

    async def scenario() -> None:
        async with harness({}) as h:
            records = dict(h.table._records)
            h.table.set_models({}, consul_reset=True)
            h.stub.hold = asyncio.Event()
            request = asyncio.create_task(h.post())
            while not h.stub.activations:
                await asyncio.sleep(0.01)
            h.table.set_models(records)  # the record is back while the question is out
            assert h.table.remembered == set()
            h.stub.hold.set()
            status, headers, body = await request
            assert status == 503 and headers["retry-after"] == "5", body
            assert body["error"]["code"] == "model_not_ready"
            assert "Consul lost its record" in body["error"]["message"]

    run(scenario())
