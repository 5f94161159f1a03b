"""Dead fast, busy never (router.firstbyte, router.outliers), through the proxy, against
real aiohttp replicas on 127.0.0.1.

The replicas are FAKES of llama-server's parts, because a real one cannot be made
to hold its inference loop for a set time on demand: ``/health`` (its HTTP thread:
answers at once, or never for a dead replica), ``/slots`` (answered between batch
steps by older builds: after ``loop_after_s``) and ``/metrics`` (its work
counters: moving while it works, still when ``stuck``). Their behaviour is
llama.cpp's (tools/server: ``get_health`` touches no task queue).
tests/integration/test_router_faults.py does the same with a real llama-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import web

from router.catalog import ServiceAddress
from router.endpoint import Failure
from router.settings import RouterSettings
from tests.support.router_harness import (
    LocalServer,
    RouterUnderTest,
    asgi_post,
    in_process_router,
    run,
)

# Short, but with a probe window (half of it) that a loaded 2-core machine's
# local round trip fits in many times over.
TIMEOUT_S = 1.0
NEVER = 3600.0


class Replica(LocalServer):
    """Answers completions after ``answer_after_s``; ``/health`` at once (or never, or
    with ``health_status``); ``/slots`` after ``loop_after_s`` (``NEVER``: never)."""

    def __init__(
        self,
        answer_after_s: float,
        health: bool = True,
        loop_after_s: float = 0.0,
        health_status: int = 200,
        stuck: bool = False,
    ) -> None:
        self.answer_after_s = answer_after_s
        self.health = health
        self.health_status = health_status
        self.loop_after_s = loop_after_s
        self.stuck = stuck
        self.decodes = 0
        self.completions = 0
        self.health_probes = 0
        self.loop_probes = 0
        self.released = asyncio.Event()  # ends every wait, so stop() does not hang
        super().__init__(
            web.post("/v1/completions", self._complete),
            web.get("/health", self._health),
            web.get("/slots", self._slots),
            web.get("/metrics", self._metrics),
        )

    async def _hold(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.released.wait(), seconds)

    async def _complete(self, request: web.Request) -> web.Response:
        await request.read()
        self.completions += 1
        await self._hold(self.answer_after_s)
        return web.json_response({"object": "text_completion", "served_by": self.port})

    async def _health(self, request: web.Request) -> web.Response:
        self.health_probes += 1
        if not self.health:
            await self.released.wait()
        return web.json_response({"status": "ok"}, status=self.health_status)

    async def _slots(self, request: web.Request) -> web.Response:
        self.loop_probes += 1
        await self._hold(self.loop_after_s)
        return web.json_response([{"id": 0, "is_processing": True}])

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self.stuck:
            self.decodes += 1  # working: a batch step ended since the last read
        text = f"llamacpp:n_decode_total {self.decodes}\nllamacpp:prompt_tokens_total 7\n"
        return web.Response(text=text, content_type="text/plain")

    async def stop(self) -> None:
        self.released.set()
        await super().stop()


def settings(**changes: object) -> RouterSettings:
    return RouterSettings(
        activation=False, replica_concurrency=4, first_byte_timeout_s=TIMEOUT_S, **changes
    )


def ejections(router: RouterUnderTest, reason: Failure) -> float:
    return router.metric("llmgw_router_replica_ejections_total", model="m", reason=reason) or 0


async def until(condition: object, timeout_s: float = 10.0) -> None:
    """Wait until ``condition()`` holds (polled), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_a_slow_replica_that_answers_its_health_keeps_the_request() -> None:
    async def scenario() -> None:
        slow = Replica(answer_after_s=2.5 * TIMEOUT_S)
        await slow.start()
        try:
            async with in_process_router(settings()) as app:
                RouterUnderTest(app, slow).pass_endpoint()
                # Two at once: one probe per replica answers for both.
                answers = await asyncio.gather(*(asgi_post(app, {"model": "m"}) for _ in range(2)))
                assert [status for status, _, _ in answers] == [200, 200], answers
                assert slow.completions == 2
                # About one every (timeout - probe window) = 0.5 s over 2.5 s, shared
                # by both requests (not one each: 8 or more).
                assert 2 <= slow.health_probes <= 5, slow.health_probes
        finally:
            await slow.stop()

    run(scenario())


def test_a_busy_replica_whose_loop_answers_late_is_never_ejected_nor_asked_twice() -> None:
    """One batch step four first-byte timeouts long: /slots (an older build's loop)
    answers only after 3 timeouts (the old liveness probe's question would have
    failed twice and ejected it), the work counters stand still (shorter than the
    stall timeout), /health answers at once."""

    async def scenario() -> None:
        busy = Replica(answer_after_s=4 * TIMEOUT_S, loop_after_s=3 * TIMEOUT_S, stuck=True)
        other = Replica(answer_after_s=0)
        await busy.start()
        await other.start()
        try:
            async with in_process_router(settings()) as app:
                router = RouterUnderTest(app, busy)
                router.pass_endpoint()
                status, _, body = await asgi_post(app, {"model": "m"})
                assert status == 200 and body["served_by"] == busy.port
                app.state.table.set_endpoints(
                    "m",
                    [ServiceAddress("127.0.0.1", p) for p in (busy.port, other.port)],
                )
                # And beside another replica: still its own answer, never sent twice.
                status, _, body = await asgi_post(app, {"model": "m"})
                assert status == 200
                assert busy.completions + other.completions == 2
                assert busy.health_probes >= 2  # asked, and waited for
                assert not any(ejections(router, f) for f in Failure)
        finally:
            await busy.stop()
            await other.stop()

    run(scenario())


def test_a_dead_replica_costs_one_request_at_the_deadline_and_is_ejected_at_once() -> None:
    async def scenario() -> None:
        dead = Replica(answer_after_s=NEVER, health=False)
        good = Replica(answer_after_s=0)
        await dead.start()
        await good.start()
        try:
            async with in_process_router(settings(ejection_base_s=0.3)) as app:
                router = RouterUnderTest(app, dead)
                router.pass_endpoint()
                started = time.monotonic()
                status, _, body = await asgi_post(app, {"model": "m"})
                # The only replica: nothing else to try, 504 at the deadline.
                assert status == 504 and body["error"]["code"] == "upstream_timeout"
                assert "GET /health" in body["error"]["message"]
                # The deadline, plus at most a late sweep on a loaded machine.
                assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + 1.0
                # Ejected by that one failure, not two.
                assert ejections(router, Failure.DEAD) == 1
                app.state.table.set_endpoints(
                    "m",
                    [ServiceAddress("127.0.0.1", p) for p in (dead.port, good.port)],
                )
                # The table kept the ejected endpoint (same address): nothing goes to
                # it, and at the end of each ejection it is asked /health again
                # before any request, so it stays out while it stays dead.
                for _ in range(6):
                    status, _, body = await asgi_post(app, {"model": "m"})
                    assert status == 200 and body["served_by"] == good.port
                await until(lambda: ejections(router, Failure.DEAD) >= 3)
                status, _, body = await asgi_post(app, {"model": "m"})
                assert status == 200 and body["served_by"] == good.port
                assert dead.completions == 1
                # Alive again: back on probation, and it gets requests.
                dead.health = True
                dead.answer_after_s = 0
                endpoint = next(
                    e for e in app.state.table.get("m").endpoints if e.address.port == dead.port
                )
                await until(lambda: endpoint.health.probation)
                served = set()
                for _ in range(4):
                    status, _, body = await asgi_post(app, {"model": "m"})
                    served.add(body["served_by"])
                assert dead.port in served
        finally:
            await dead.stop()
            await good.stop()

    run(scenario())


class Wedged:
    """A FAKE wedged replica: accepts connections, reads, and never answers anything
    (no /props, no /health, no completion); counts the completions sent to it."""

    def __init__(self) -> None:
        self.completions = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> ServiceAddress:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return ServiceAddress("127.0.0.1", self.port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                self.completions += data.count(b"POST /v1/completions")

    async def stop(self) -> None:
        for writer in self._writers:
            writer.close()
        assert self._server is not None
        self._server.close()


def test_a_burst_sends_a_wedged_replica_one_request() -> None:
    """Found in review: 8 requests at once, 4 went to a wedged replica (its limit the
    default, 4, since its /props never answered), each answered 10-12 s later. A
    replica that has not answered /props takes one request at a time."""

    async def scenario() -> None:
        wedged = Wedged()
        good = Replica(answer_after_s=0.05)
        addresses = [await wedged.start(), await good.start()]
        try:
            # No replica_concurrency: the limits come from /props (router.capacity).
            wanted = RouterSettings(activation=False, first_byte_timeout_s=TIMEOUT_S)
            async with in_process_router(wanted, replicas=2) as app:
                app.state.table.set_endpoints("m", addresses)
                answers = await asyncio.gather(*(asgi_post(app, {"model": "m"}) for _ in range(8)))
                assert [status for status, _, _ in answers] == [200] * 8, answers
                assert {body["served_by"] for _, _, body in answers} == {good.port}
                assert wedged.completions == 1
        finally:
            await wedged.stop()
            await good.stop()

    run(scenario())


def test_a_wedged_replica_joining_under_a_queue_is_handed_one_request() -> None:
    """Found in review: requests waiting when a wedged replica joined were handed to
    it up to its default limit (4) before its limit was lowered to one."""

    async def scenario() -> None:
        wedged = Wedged()
        good = Replica(answer_after_s=1.0)
        good_address, wedged_address = await good.start(), await wedged.start()
        try:
            wanted = RouterSettings(activation=False, first_byte_timeout_s=TIMEOUT_S)
            async with in_process_router(wanted, replicas=2) as app:
                app.state.table.set_endpoints("m", [good_address])
                burst = [asyncio.ensure_future(asgi_post(app, {"model": "m"})) for _ in range(8)]
                # The good replica's 4 slots are full (its /props: 404, the default),
                # so 4 requests wait in the queue.
                await until(lambda: good.completions == 4)
                app.state.table.set_endpoints("m", [good_address, wedged_address])
                answers = await asyncio.gather(*burst)
                assert [status for status, _, _ in answers] == [200] * 8, answers
                assert wedged.completions == 1
        finally:
            await wedged.stop()
            await good.stop()

    run(scenario())


def test_a_client_leaving_a_waiting_request_hushes_the_replica_s_load_reads() -> None:
    """Found in review (issue 21 item 8): the load sampler's reads kept a replica
    waiting on results, so a request whose client left ran to its end there."""

    async def scenario() -> None:
        slow = Replica(answer_after_s=NEVER)
        address = await slow.start()
        try:
            async with in_process_router(settings(), replicas=2) as app:
                app.state.table.set_endpoints("m", [address])
                endpoint = app.state.table.get("m").endpoints[0]
                status, _, _ = await asgi_post(app, {"model": "m"}, leave_after_s=0.3)
                assert status is None  # nothing sent: the client had gone
                await until(lambda: endpoint.inflight == 0)
                assert endpoint.quiet_until > 0.0  # hushed (how long: test_replicaload)
        finally:
            await slow.stop()

    run(scenario())


def test_a_replica_whose_health_says_500_is_dead_too() -> None:
    async def scenario() -> None:
        failing = Replica(answer_after_s=NEVER, health_status=500)
        await failing.start()
        try:
            async with in_process_router(settings()) as app:
                router = RouterUnderTest(app, failing)
                router.pass_endpoint()
                status, _, _ = await asgi_post(app, {"model": "m"})
                assert status == 504
                assert ejections(router, Failure.DEAD) == 1
        finally:
            await failing.stop()

    run(scenario())


def test_a_stalled_loop_is_found_logged_and_ejected_and_its_request_not_resent(
    caplog: object,
) -> None:
    async def scenario() -> None:
        stalled = Replica(answer_after_s=NEVER, loop_after_s=NEVER, stuck=True)
        good = Replica(answer_after_s=0)
        await stalled.start()
        await good.start()
        try:
            async with in_process_router(settings(stall_timeout_s=1.0, ejection_base_s=0.3)) as app:
                router = RouterUnderTest(app, stalled)
                router.pass_endpoint()
                waiting = asyncio.ensure_future(asgi_post(app, {"model": "m"}))
                await until(lambda: ejections(router, Failure.STALLED) == 1)
                app.state.table.set_endpoints(
                    "m",
                    [ServiceAddress("127.0.0.1", p) for p in (stalled.port, good.port)],
                )
                status, _, body = await asgi_post(app, {"model": "m"})
                assert status == 200 and body["served_by"] == good.port
                # The waiting request is neither cut nor sent elsewhere.
                assert not waiting.done()
                assert stalled.completions == 1 and good.completions == 1
                # At the end of its ejection its request is still on it and its
                # counters still stand: ejected again, before any request goes there.
                await until(lambda: ejections(router, Failure.STALLED) >= 2)
                # Counting again: back on probation.
                stalled.stuck = False
                endpoint = next(
                    e for e in app.state.table.get("m").endpoints if e.address.port == stalled.port
                )
                await until(lambda: endpoint.health.probation)
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
        finally:
            await stalled.stop()
            await good.stop()

    run(scenario())
    assert "have not moved for 1 s while 1 request(s) waited" in caplog.text  # type: ignore[attr-defined]


def test_a_replica_that_keeps_counting_is_never_stalled() -> None:
    async def scenario() -> None:
        working = Replica(answer_after_s=4 * TIMEOUT_S, loop_after_s=NEVER)
        await working.start()
        try:
            async with in_process_router(settings(stall_timeout_s=TIMEOUT_S)) as app:
                router = RouterUnderTest(app, working)
                router.pass_endpoint()
                status, _, _ = await asgi_post(app, {"model": "m"})
                assert status == 200 and working.completions == 1
                assert working.decodes >= 2  # its progress was read, and moved
                assert not any(ejections(router, f) for f in Failure)
        finally:
            await working.stop()

    run(scenario())
