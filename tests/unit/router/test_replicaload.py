"""Other routers' load, read from the replicas (router.replicaload), and the choices
that use it (router.balancer.pick, router.prefix.PrefixChooser). The replicas in the
sampler test are real aiohttp servers on 127.0.0.1 answering llama-server's
/metrics text (the gauge lines of the pinned build; the real replicas:
bench/prefix_routing.py --routers)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from router import replicaload
from router.balancer import pick, preferable
from router.catalog import ServiceAddress
from router.endpoint import Endpoint
from router.prefix import PrefixChooser
from router.replicaload import LoadSampler, others_on, reported_load
from tests.support.ports import free_port

METRICS = b"""# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing %d
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred %d
llamacpp:n_decode_total 42
"""


def endpoints(*inflight: int, limit: int = 4) -> list[Endpoint]:
    made = []
    for i, n in enumerate(inflight):
        endpoint = Endpoint(ServiceAddress("10.0.0.1", 9000 + i), limit)
        endpoint.inflight = n
        made.append(endpoint)
    return made


def test_the_replica_s_gauges_give_every_router_s_requests_less_this_one_s() -> None:
    assert reported_load(METRICS % (3, 2)) == 5
    assert reported_load(b"llamacpp:n_decode_total 1\n") is None
    assert reported_load(b"llamacpp:requests_processing nan-ish\n") is None
    [mine] = endpoints(2)
    assert others_on(mine, 5) == 3
    assert others_on(mine, 1) == 0  # this router's request not yet counted there
    assert others_on(mine, None) == 0  # no gauges: this router's own counts only
    # One of its own ended while it asked: counted there or not, not another router's.
    assert others_on(mine, 3, asked_at=3) == 0


def test_pick_orders_by_every_router_s_load_and_admits_on_its_own_limit() -> None:
    a, b = endpoints(0, 1)
    a.others = 3  # another router keeps a busy
    assert pick([a, b], start=0) is b
    full = endpoints(4, 0)
    full[1].others = 9  # busy elsewhere, but this router's slot there is free
    assert pick(full, start=0) is full[1]


def test_the_prefix_bound_counts_the_other_routers_requests() -> None:
    chooser = PrefixChooser(load_factor=1.25)
    a, b = endpoints(0, 0)
    key = next(k for k in (f"chat {i}" for i in range(100)) if chooser.choose([a, b], k, bool) is a)
    a.others = 4  # bound: ceil(1.25 * 5 / 2) = 4, and a holds 4
    assert chooser.choose([a, b], key, lambda e: True) is b


@contextlib.asynccontextmanager
async def metrics_replicas(
    loads: dict[int, tuple[int, int]], asked: list[tuple[int, str]]
) -> AsyncIterator[list[int]]:
    """Two aiohttp replicas on 127.0.0.1 answering ``/metrics`` with ``loads[i]``
    (processing, deferred); each read is recorded in ``asked``. Yields their ports."""

    def serve(i: int) -> web.Application:
        async def metrics(request: web.Request) -> web.Response:
            asked.append((i, request.path))
            return web.Response(body=METRICS % loads[i])

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        return app

    runners = [web.AppRunner(serve(i)) for i in (0, 1)]
    ports = [free_port(), free_port()]
    for runner, port in zip(runners, ports, strict=True):
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield ports
    finally:
        for runner in runners:
            await runner.cleanup()


def test_the_sampler_reads_busy_models_replicas_and_leaves_idle_ones_alone() -> None:
    async def run() -> tuple[list[int], list[int], list[str]]:
        asked: list[tuple[int, str]] = []
        async with metrics_replicas({0: (3, 1), 1: (1, 0)}, asked) as ports:
            busy = tuple(Endpoint(ServiceAddress("127.0.0.1", p), 4) for p in ports)
            busy[0].inflight = 1
            idle = tuple(Endpoint(ServiceAddress("127.0.0.1", p), 4) for p in ports)
            async with aiohttp.ClientSession() as session:
                sampler = LoadSampler(lambda: (busy, idle), lambda: session, interval_s=0.05)
                sampler.start()
                while len(asked) < 4:
                    await asyncio.sleep(0.01)
                await sampler.close()
        return [e.others for e in busy], [e.others for e in idle], [f"{i}{p}" for i, p in asked]

    busy, idle, asked = asyncio.run(run())
    assert busy == [3, 1] and idle == [0, 0]
    assert set(asked) == {"0/metrics", "1/metrics"}


def test_an_answer_slower_than_the_interval_still_counts(monkeypatch) -> None:
    """The wait for /metrics is at least READ_TIMEOUT_MIN_S, not the interval: a
    replica that answers after 30 intervals is still heard (here the floor is 5 s, so
    only a machine stalled for seconds could miss it)."""
    monkeypatch.setattr(replicaload, "READ_TIMEOUT_MIN_S", 5.0)

    async def run() -> list[int]:
        answered = asyncio.Event()

        async def metrics(request: web.Request) -> web.Response:
            await asyncio.sleep(0.3)
            answered.set()
            return web.Response(body=METRICS % (2, 1))

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        # The second replica refuses connections: it counts nobody else's requests.
        busy = tuple(Endpoint(ServiceAddress("127.0.0.1", p), 4) for p in (port, free_port()))
        busy[0].inflight = 1
        async with aiohttp.ClientSession() as session:
            sampler = LoadSampler(lambda: (busy,), lambda: session, interval_s=0.01)
            sampler.start()
            await answered.wait()
            # Set once the read that waited returns (bounded: a failure, not a hang).
            for _ in range(200):
                if busy[0].others:
                    break
                await asyncio.sleep(0.01)
            await sampler.close()
        await runner.cleanup()
        return [e.others for e in busy]

    assert asyncio.run(run()) == [2, 0]


def test_a_prefix_s_replica_full_over_all_routers_gives_way_to_the_least_loaded() -> None:
    chooser = PrefixChooser(load_factor=4.0)  # a bound that never binds here
    a, b = endpoints(1, 1)
    key = next(
        k for k in (f"chat {i}" for i in range(100)) if pick([a, b], 0, (), (chooser, k)) is a
    )
    a.others = 1  # 2 of its 4 slots taken: still preferred
    assert pick([a, b], 0, (), (chooser, key)) is a
    # 3 of 4 taken, some by other routers whose count may be an interval old: the last
    # slot is kept spare, the least loaded instead.
    a.others = 2
    assert pick([a, b], 0, (), (chooser, key)) is b
    a.others = 3  # every slot taken, by this router and others
    assert pick([a, b], 0, (), (chooser, key)) is b
    # Alone on it, this router's own count is exact: every slot is used.
    a.inflight, a.others = 3, 0
    assert pick([a, b], 0, (), (chooser, key)) is a


def test_a_replica_of_one_or_two_slots_spares_none() -> None:
    """Found in review: sparing a slot of 1 or 2 lost a small replica its prefix
    affinity whenever another router had a request there."""
    for limit in (1, 2):
        replica = endpoints(0, limit=limit)[0]
        replica.others = limit - 1
        assert preferable(replica)
        replica.others = limit
        assert not preferable(replica)
    three = endpoints(0, limit=3)[0]
    three.others = 1
    assert preferable(three)
    three.others = 2
    assert not preferable(three)


def test_a_hushed_replica_is_not_read_until_its_quiet_ends() -> None:
    """Found in review (issue 21 item 8): the sampler's 10 reads a second kept
    llama-server waiting on results, so a request whose client left ran to its end
    (59 s); after a leave the replica is left alone for QUIET_AFTER_LEAVE_S."""

    async def run() -> list[int]:
        asked: list[tuple[int, str]] = []
        async with metrics_replicas({0: (1, 0), 1: (1, 0)}, asked) as ports:
            busy = tuple(Endpoint(ServiceAddress("127.0.0.1", p), 4) for p in ports)
            busy[1].inflight = 1
            busy[0].quiet_until = time.monotonic() + 3600  # as hush() sets it, for longer
            async with aiohttp.ClientSession() as session:
                sampler = LoadSampler(lambda: (busy,), lambda: session, interval_s=0.01)
                sampler.start()
                while [i for i, _ in asked].count(1) < 20:
                    await asyncio.sleep(0.01)
                read = [i for i, _ in asked]
                busy[0].quiet_until = 0.0  # the quiet ends
                while (0, "/metrics") not in asked:
                    await asyncio.sleep(0.01)
                await sampler.close()
        return read

    hushed = asyncio.run(run())
    assert 0 not in hushed, hushed


def test_hush_lasts_longer_than_llama_server_s_one_second_wait() -> None:
    endpoint = endpoints(0)[0]
    before = time.monotonic()
    replicaload.hush(endpoint)
    assert endpoint.quiet_until >= before + replicaload.QUIET_AFTER_LEAVE_S > before + 1.0
