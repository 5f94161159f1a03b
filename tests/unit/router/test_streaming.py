"""router.streaming's disconnect watches: one loop timer for all of them."""

from __future__ import annotations

import asyncio
import contextlib
import json

from router.streaming import DisconnectWatches, event
from tests.support.router_harness import run

AFTER_S = 0.2


class Client:
    """``receive`` of a client that sent its body: the next message is its leaving."""

    def __init__(self) -> None:
        self.left = asyncio.Event()
        self.reads = 0

    async def receive(self) -> dict:
        self.reads += 1
        await self.left.wait()
        return {"type": "http.disconnect"}


def test_a_fast_request_never_watches_and_a_slow_one_is_cancelled_when_its_client_leaves() -> None:
    run(_watches())


async def _watches() -> None:
    loop = asyncio.get_running_loop()
    watches = DisconnectWatches(AFTER_S)
    fast, slow = Client(), Client()

    async def request(client: Client, seconds: float) -> None:
        watch = watches.watch(client.receive)
        try:
            await asyncio.sleep(seconds)
        finally:
            watch.disarm()

    await request(fast, 0.01)
    began = loop.time()
    task = asyncio.ensure_future(request(slow, 30))
    while slow.reads == 0:
        await asyncio.sleep(0.01)
    # Never before AFTER_S (how much later depends on the machine's load: not checked).
    assert loop.time() - began >= AFTER_S
    slow.left.set()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert task.cancelled()
    await asyncio.sleep(AFTER_S)
    assert fast.reads == 0
    assert watches._timer is None and not watches._armed  # nothing left ticking


def test_watches_used_on_a_later_event_loop_still_start() -> None:
    """A loop that ended with the sweep's timer pending leaves it dead: the next
    loop arms its own (found in review: a proxy reused across loops watched no more)."""
    watches = DisconnectWatches(AFTER_S)

    async def ends_with_the_timer_pending() -> None:
        watches.watch(Client().receive).disarm()
        assert watches._timer is not None

    async def slow_request_on_a_new_loop() -> None:
        client = Client()
        watch = watches.watch(client.receive)
        try:
            while client.reads == 0:
                await asyncio.sleep(0.01)
        finally:
            watch.disarm()

    run(ends_with_the_timer_pending())
    run(slow_request_on_a_new_loop())


def test_an_event_of_many_lines_is_one_event_whose_data_is_the_json() -> None:
    """What a client's SSE parser (WHATWG HTML 9.2.6) makes of each: one event whose
    data, its ``data:`` lines joined with LF, is the JSON sent."""
    for data in (b'{"a": 1}', b'{\n  "a": 1\n}\n', b'{\r\n "a":\r 1}'):
        sent = event(data)
        assert sent.endswith(b"\n\n") and sent.count(b"\n\n") == 1, sent
        lines = sent[:-2].split(b"\n")
        assert all(line.startswith(b"data: ") for line in lines), sent
        joined = b"\n".join(line.removeprefix(b"data: ") for line in lines)
        assert json.loads(joined) == json.loads(data)
