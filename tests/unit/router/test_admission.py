"""Per-replica limits and the fair, bounded wait for a slot (router.admission, router.capacity).

The first half drives :class:`router.admission.Slots` directly. The second
half runs the router app over ASGI in the test's event loop (no lifespan, no
Consul: endpoints are written into the table as the Consul watch would) in
front of a real aiohttp upstream on 127.0.0.1 that answers ``GET /props`` like
llama-server and holds every completion until the test lets it finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from router import capacity
from router.admission import Held, Slots
from router.capacity import total_slots
from router.catalog import ServiceAddress
from router.endpoint import Endpoint
from router.metrics import RouterMetrics
from router.settings import RouterSettings
from tests.support.router_harness import (
    LocalServer,
    RouterUnderTest,
    asgi_post,
    in_process_router,
    run,
)


def slots_with(*limits: int) -> tuple[Slots, list[Endpoint], RouterMetrics]:
    metrics = RouterMetrics()
    slots = Slots(metrics.model_defined("m"))
    eps = [Endpoint(ServiceAddress("10.0.0.1", 9000 + i), limit) for i, limit in enumerate(limits)]
    slots.replace(tuple(eps))
    return slots, eps, metrics


def sample(metrics: RouterMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model": "m"})


# --- Slots ------------------------------------------------------------------------


def test_take_counts_and_held_releases() -> None:
    async def scenario() -> None:
        slots, (a, b), metrics = slots_with(1, 1)
        first, second = slots.take(), slots.take()
        assert {first, second} == {a, b} and a.inflight == b.inflight == 1
        assert slots.take() is None  # both full
        assert sample(metrics, "llmgw_router_inflight_requests") == 2
        with pytest.raises(RuntimeError), Held(slots, first):
            raise RuntimeError
        assert first.inflight == 0 and sample(metrics, "llmgw_router_inflight_requests") == 1

    run(scenario())


def test_waiters_get_freed_slots_in_arrival_order() -> None:
    async def scenario() -> None:
        slots, (a,), metrics = slots_with(1)
        assert slots.take() is a
        order: list[int] = []

        async def waiter(i: int) -> None:
            endpoint = await slots.wait(5)
            order.append(i)
            with Held(slots, endpoint):
                await asyncio.sleep(0)

        tasks = [asyncio.ensure_future(waiter(i)) for i in range(5)]
        await asyncio.sleep(0.01)
        assert slots.waiting == 5 and sample(metrics, "llmgw_router_queued_requests") == 5
        assert slots.take() is None  # a newcomer does not pass the queue
        slots.release(a)
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2, 3, 4]
        assert a.inflight == 0 and slots.waiting == 0
        assert sample(metrics, "llmgw_router_queued_requests") == 0
        assert sample(metrics, "llmgw_router_queue_wait_seconds_count") == 5

    run(scenario())


def test_wait_times_out_and_leaves_the_queue() -> None:
    async def scenario() -> None:
        slots, (a,), metrics = slots_with(1)
        slots.take()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await slots.wait(0.2)
        assert 0.2 <= time.monotonic() - started < 0.5
        assert slots.waiting == 0 and sample(metrics, "llmgw_router_queued_requests") == 0
        slots.release(a)
        assert a.inflight == 0  # nobody was handed the slot

    run(scenario())


def test_a_cancelled_waiter_leaves_and_one_granted_as_it_left_gives_the_slot_on() -> None:
    async def scenario() -> None:
        slots, (a,), _ = slots_with(1)
        slots.take()
        first = asyncio.ensure_future(slots.wait(5))
        second = asyncio.ensure_future(slots.wait(5))
        third = asyncio.ensure_future(slots.wait(5))
        await asyncio.sleep(0.01)
        first.cancel()  # its client left while it waited
        await asyncio.sleep(0.01)
        assert slots.waiting == 2
        slots.release(a)  # handed to `second`...
        second.cancel()  # ...whose client leaves before it runs: it passes the slot on
        with contextlib.suppress(asyncio.CancelledError):
            await second
        assert await third is a and a.inflight == 1 and slots.waiting == 0

    run(scenario())


def test_endpoint_changes_wake_waiters() -> None:
    async def scenario() -> None:
        slots, (a,), _ = slots_with(1)
        slots.take()
        waiter = asyncio.ensure_future(slots.wait(5))
        await asyncio.sleep(0.01)
        slots.replace(())  # every endpoint left: the waiter checks the model again
        assert await waiter is None
        waiter = asyncio.ensure_future(slots.wait(5))
        await asyncio.sleep(0.01)
        b = Endpoint(ServiceAddress("10.0.0.2", 9000), 1)
        slots.replace((a, b))  # a new replica passes: it takes the waiter
        assert await waiter is b

    run(scenario())


def test_a_raised_limit_serves_waiters() -> None:
    async def scenario() -> None:
        slots, (a,), _ = slots_with(1)
        slots.take()
        waiter = asyncio.ensure_future(slots.wait(5))
        await asyncio.sleep(0.01)
        a.limit = 2  # /props said 2 slots
        slots.capacity_changed()
        assert await waiter is a and a.inflight == 2

    run(scenario())


def test_a_retry_goes_first_but_never_back_to_the_replica_it_failed_on() -> None:
    async def scenario() -> None:
        slots, (a, b), _ = slots_with(1, 1)
        slots.take(), slots.take()
        plain = asyncio.ensure_future(slots.wait(5))
        await asyncio.sleep(0.01)
        retry = asyncio.ensure_future(slots.wait(5, (a,), first=True))
        await asyncio.sleep(0.01)
        slots.release(a)  # only the replica the retry failed on has room
        assert await plain is a
        slots.release(b)
        assert await retry is b

    run(scenario())


def test_total_slots_from_props() -> None:
    assert total_slots({"total_slots": 4, "model_alias": "gemma"}) == 4
    for bad in ({}, {"total_slots": 0}, {"total_slots": "4"}, {"total_slots": True}, [4], None):
        with pytest.raises(ValueError):
            total_slots(bad)


# --- through the app, against a real upstream ----------------------------------


class HoldingUpstream(LocalServer):
    """llama-server's shape for what matters here: ``GET /props`` with
    ``total_slots`` (or 404 when ``slots`` is None), and completions that
    each wait until :meth:`finish` lets one through, in arrival order."""

    def __init__(self, slots: int | None, props_silent: int = 0) -> None:
        self.slots = slots
        self.seen: list[str] = []
        self.props_reads = 0
        # The first reads of /props that never answer (a replica not answering).
        self.props_silent = props_silent
        self._released = asyncio.Event()  # ends the silent reads, so stop() does not wait
        self._gate = asyncio.Semaphore(0)
        super().__init__(
            web.get("/props", self._props), web.post("/v1/completions", self._complete)
        )

    def finish(self, count: int = 1) -> None:
        self._released.set()
        for _ in range(count):
            self._gate.release()

    async def _props(self, request: web.Request) -> web.Response:
        self.props_reads += 1
        if self.props_reads <= self.props_silent:
            await self._released.wait()
        if self.slots is None:
            return web.Response(status=404)
        return web.json_response({"total_slots": self.slots, "model_alias": "tiny"})

    async def _complete(self, request: web.Request) -> web.Response:
        prompt = (await request.json())["prompt"]
        self.seen.append(prompt)
        await self._gate.acquire()
        return web.json_response({"object": "text_completion", "prompt": prompt})


class Router(RouterUnderTest):
    def __init__(self, app: Any, upstream: HoldingUpstream) -> None:
        super().__init__(app, upstream)
        self.upstream = upstream

    def post(self, model: str, prompt: str, leave_after_s: float | None = None) -> asyncio.Future:
        body = {"model": model, "prompt": prompt}
        return asyncio.ensure_future(asgi_post(self.app, body, leave_after_s))


@contextlib.asynccontextmanager
async def router(
    slots: int | None = 2, models: tuple[str, ...] = ("m",), props_silent: int = 0,
    **settings: Any,
) -> AsyncIterator[Router]:  # fmt: skip
    upstream = HoldingUpstream(slots, props_silent)
    await upstream.start()
    try:
        async with in_process_router(RouterSettings(activation=False, **settings), models) as app:
            try:
                yield Router(app, upstream)
            finally:
                upstream.finish(1000)
    finally:
        await upstream.stop()


async def until(check: Any, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_limit_from_props_then_first_come_first_served() -> None:
    async def scenario() -> None:
        async with router(slots=2) as r:
            r.pass_endpoint("m")
            (endpoint,) = r.table.get("m").endpoints
            await until(lambda: endpoint.limit == 2)  # read off the request path
            first = [r.post("m", f"p{i}") for i in range(2)]
            await until(lambda: len(r.upstream.seen) == 2)
            queued = [r.post("m", f"q{i}") for i in range(3)]
            await until(lambda: r.metric("llmgw_router_queued_requests", model="m") == 3)
            assert len(r.upstream.seen) == 2  # the replica has only what it can run
            r.upstream.finish()
            await until(lambda: len(r.upstream.seen) == 3)
            assert r.upstream.seen[2] == "q0"
            r.upstream.finish(4)
            results = await asyncio.gather(*first, *queued)
            assert [s for s, _, _ in results] == [200] * 5
            assert r.upstream.seen == ["p0", "p1", "q0", "q1", "q2"]  # each once, in order
            assert r.metric("llmgw_router_queue_wait_seconds_count", model="m") == 3
            assert r.metric("llmgw_router_queued_requests", model="m") == 0
            assert r.metric("llmgw_router_inflight_requests", model="m") == 0

    run(scenario())


def test_until_props_answers_one_request_at_a_time_and_it_is_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica that has not answered /props (a wedged one never will) takes one
    request at a time (router.capacity); asked again after no answer, its slot count
    then serves the requests that queued."""
    monkeypatch.setattr(capacity, "RETRY_MIN_S", 0.05)

    async def scenario() -> None:
        async with router(slots=3, props_silent=1, props_timeout_s=0.2) as r:
            r.pass_endpoint("m")
            (endpoint,) = r.table.get("m").endpoints
            assert endpoint.limit == 1
            held = [r.post("m", f"p{i}") for i in range(3)]
            await until(lambda: r.metric("llmgw_router_queued_requests", model="m") == 2)
            assert r.upstream.seen == ["p0"]
            await until(lambda: endpoint.limit == 3)  # the second read answered
            await until(lambda: len(r.upstream.seen) == 3)  # the queue served at once
            assert r.upstream.props_reads == 2
            r.upstream.finish(3)
            assert [s for s, _, _ in await asyncio.gather(*held)] == [200] * 3

    run(scenario())


def test_replicas_busy_after_the_queue_timeout() -> None:
    async def scenario() -> None:
        async with router(slots=1, queue_timeout_s=0.3) as r:
            r.pass_endpoint("m")
            await until(lambda: r.upstream.props_reads == 1)
            running = r.post("m", "running")
            await until(lambda: r.upstream.seen == ["running"])
            started = time.monotonic()
            status, headers, body = await r.post("m", "late")
            assert 0.3 <= time.monotonic() - started < 0.8
            assert status == 503 and headers["retry-after"] == "2"
            error = body["error"]
            assert error["code"] == "replicas_busy" and error["param"] == "model"
            assert "1 passing replica(s) with requests in flight/limit 1/1" in error["message"]
            assert "queue timeout of 0.3 s" in error["message"]
            assert r.metric("llmgw_router_refusals_total", model="m", reason="replicas_busy") == 1
            assert r.metric("llmgw_router_queue_wait_seconds_count", model="m") == 1
            assert r.metric("llmgw_router_queue_wait_seconds_sum", model="m") >= 0.3
            r.upstream.finish()
            assert (await running)[0] == 200
            assert r.upstream.seen == ["running"]

    run(scenario())


def test_a_busy_model_never_delays_another() -> None:
    async def scenario() -> None:
        async with router(slots=1, models=("busy", "free")) as r:
            r.pass_endpoint("busy")
            r.pass_endpoint("free")  # the same server, its own limit for this model
            await until(lambda: r.upstream.props_reads == 2)
            held = [r.post("busy", f"b{i}") for i in range(5)]
            await until(lambda: r.metric("llmgw_router_queued_requests", model="busy") == 4)
            other = r.post("free", "f")
            await until(lambda: "f" in r.upstream.seen)
            r.upstream.finish()  # the upstream's gate is FIFO: b0 ends
            await until(lambda: "b1" in r.upstream.seen)
            assert r.upstream.seen.index("f") < r.upstream.seen.index("b1")
            r.upstream.finish(10)
            assert (await other)[0] == 200
            assert [s for s, _, _ in await asyncio.gather(*held)] == [200] * 5

    run(scenario())


def test_a_client_leaving_the_queue_never_reaches_the_replica() -> None:
    async def scenario() -> None:
        async with router(slots=1) as r:
            r.pass_endpoint("m")
            await until(lambda: r.upstream.props_reads == 1)
            running = r.post("m", "running")
            await until(lambda: r.upstream.seen == ["running"])
            leaver = r.post("m", "leaver", leave_after_s=0.4)
            stayer = r.post("m", "stayer")
            await until(lambda: r.metric("llmgw_router_queued_requests", model="m") == 2)
            assert (await leaver)[0] is None  # gone: nothing sent
            assert r.metric("llmgw_router_queued_requests", model="m") == 1
            assert r.metric("llmgw_router_requests_total", model="m", code="499") == 1
            r.upstream.finish(2)
            assert (await running)[0] == 200 and (await stayer)[0] == 200
            assert r.upstream.seen == ["running", "stayer"]

    run(scenario())


def test_the_operators_limit_wins_and_nothing_reads_props() -> None:
    async def scenario() -> None:
        async with router(slots=8, replica_concurrency=1, queue_timeout_s=0.2) as r:
            assert r.app.state.capacity is None
            r.pass_endpoint("m")
            running = r.post("m", "one")
            await until(lambda: r.upstream.seen == ["one"])
            assert (await r.post("m", "two"))[2]["error"]["code"] == "replicas_busy"
            r.upstream.finish()
            assert (await running)[0] == 200
            assert r.upstream.props_reads == 0

    run(scenario())


def test_without_props_the_default_limit_holds() -> None:
    async def scenario() -> None:
        async with router(slots=None, queue_timeout_s=0.2) as r:
            r.pass_endpoint("m")
            await until(lambda: r.upstream.props_reads == 1)
            (endpoint,) = r.table.get("m").endpoints
            running = [r.post("m", f"p{i}") for i in range(4)]
            await until(lambda: len(r.upstream.seen) == 4)
            assert endpoint.limit == 4
            assert (await r.post("m", "fifth"))[2]["error"]["code"] == "replicas_busy"
            r.upstream.finish(4)
            await asyncio.gather(*running)

    run(scenario())
