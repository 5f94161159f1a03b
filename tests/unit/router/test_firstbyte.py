"""The first-byte timeout and its liveness probe (router.firstbyte), through the proxy,
against real aiohttp replicas on 127.0.0.1: one slow but alive (it answers ``/slots``),
one whose inference loop is stuck (``/slots`` hangs too, as on a wedged llama-server)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import web

from router.catalog import ServiceAddress
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


class Replica(LocalServer):
    """Answers completions after ``answer_after_s``; ``/slots`` at once, or never."""

    def __init__(self, answer_after_s: float, slots_answer: bool) -> None:
        self.answer_after_s = answer_after_s
        self.slots_answer = slots_answer
        self.completions = 0
        self.probes = 0
        self.released = asyncio.Event()  # ends every wait, so stop() does not hang
        super().__init__(
            web.post("/v1/completions", self._complete), web.get("/slots", self._slots)
        )

    async def _complete(self, request: web.Request) -> web.Response:
        await request.read()
        self.completions += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.released.wait(), self.answer_after_s)
        return web.json_response({"object": "text_completion", "served_by": self.port})

    async def stop(self) -> None:
        self.released.set()
        await super().stop()

    async def _slots(self, request: web.Request) -> web.Response:
        self.probes += 1
        if not self.slots_answer:
            await self.released.wait()
        return web.json_response([{"id": 0, "is_processing": True}])


def settings() -> RouterSettings:
    return RouterSettings(activation=False, replica_concurrency=4, first_byte_timeout_s=TIMEOUT_S)


def test_a_slow_replica_that_answers_its_probes_keeps_the_request() -> None:
    async def scenario() -> None:
        slow = Replica(answer_after_s=2.5 * TIMEOUT_S, slots_answer=True)
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
                assert 2 <= slow.probes <= 5, slow.probes
        finally:
            await slow.stop()

    run(scenario())


def test_a_stuck_replica_is_given_up_at_the_deadline_and_another_answers() -> None:
    async def scenario() -> None:
        stuck = Replica(answer_after_s=3600, slots_answer=False)
        good = Replica(answer_after_s=0, slots_answer=True)
        await stuck.start()
        await good.start()
        try:
            async with in_process_router(settings()) as app:
                router = RouterUnderTest(app, stuck)
                router.pass_endpoint()
                started = time.monotonic()
                status, _, body = await asgi_post(app, {"model": "m"})
                # The only replica: nothing else to try, 504 at the deadline.
                assert status == 504 and body["error"]["code"] == "upstream_timeout"
                # The deadline, plus at most a late sweep on a loaded machine.
                assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + 1.0
                app.state.table.set_endpoints(
                    "m",
                    [
                        ServiceAddress("127.0.0.1", stuck.port),
                        ServiceAddress("127.0.0.1", good.port),
                    ],
                )
                for _ in range(4):
                    status, _, body = await asgi_post(app, {"model": "m"})
                    assert status == 200 and body["served_by"] == good.port
        finally:
            await stuck.stop()
            await good.stop()

    run(scenario())
