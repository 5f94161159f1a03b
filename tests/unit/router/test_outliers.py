"""Passive outlier ejection (router.outliers) and its filter in router.balancer.pick.

Ejections end on the event loop's timers, so the back-off tests run a real
loop with ejection times of a few tens of milliseconds. They read how long an
ejection was scheduled for from its timer and wait for it to end by polling,
never by measuring or sleeping (a loaded machine stretches both).
"""

from __future__ import annotations

import asyncio

from llmgw_contract import ModelRecord
from router.admission import Slots
from router.balancer import pick
from router.catalog import ServiceAddress
from router.endpoint import Endpoint, Failure
from router.endpoints import EndpointTable
from router.metrics import RouterMetrics
from router.outliers import OutlierDetector, OutlierPolicy, not_ejected
from tests.support.router_harness import run, until


def setup(
    n: int = 2, **policy: float
) -> tuple[OutlierDetector, Slots, list[Endpoint], RouterMetrics]:
    metrics = RouterMetrics()
    slots = Slots(metrics.model_defined("m"))
    eps = [Endpoint(ServiceAddress("10.0.0.1", 9000 + i), 4) for i in range(n)]
    slots.replace(tuple(eps))
    return OutlierDetector(OutlierPolicy(**policy)), slots, eps, metrics


def ejections(metrics: RouterMetrics, reason: Failure) -> float | None:
    return metrics.registry.get_sample_value(
        "llmgw_router_replica_ejections_total", {"model": "m", "reason": reason}
    )


def ejected_now(metrics: RouterMetrics) -> float | None:
    return metrics.registry.get_sample_value("llmgw_router_ejected_replicas", {"model": "m"})


def test_consecutive_failures_eject_and_a_good_answer_resets_the_count() -> None:
    async def scenario() -> None:
        detector, slots, (a, b), metrics = setup()
        bound = metrics.for_model("m")
        detector.failed("m", bound, slots, a, Failure.CONNECT)
        detector.answered("m", bound, slots, a, 200)
        detector.failed("m", bound, slots, a, Failure.CONNECT)
        assert not a.health.ejected  # not two in a row
        detector.failed("m", bound, slots, a, Failure.CONNECT)
        assert a.health.ejected
        assert ejections(metrics, Failure.CONNECT) == 1
        assert ejections(metrics, Failure.DEAD) == 0
        assert ejected_now(metrics) == 1
        # No new request goes to it while b can take one.
        assert {pick(slots.endpoints, turn) for turn in range(4)} == {b}

    run(scenario())


def test_a_failed_liveness_check_or_a_stall_ejects_at_once() -> None:
    async def scenario() -> None:
        detector, slots, (a, b), metrics = setup()
        bound = metrics.for_model("m")
        detector.failed("m", bound, slots, a, Failure.DEAD)
        detector.failed("m", bound, slots, b, Failure.STALLED)
        assert a.health.ejected and b.health.ejected
        assert ejections(metrics, Failure.DEAD) == 1
        assert ejections(metrics, Failure.STALLED) == 1

    run(scenario())


def test_5xx_count_separately_and_501_is_not_a_failure() -> None:
    async def scenario() -> None:
        detector, slots, (a, _), metrics = setup(consecutive_5xx=3)
        bound = metrics.for_model("m")
        for _ in range(10):
            detector.answered("m", bound, slots, a, 501)
        detector.answered("m", bound, slots, a, 500)
        detector.answered("m", bound, slots, a, 503)
        assert not a.health.ejected
        detector.answered("m", bound, slots, a, 502)
        assert a.health.ejected and ejections(metrics, Failure.HTTP_5XX) == 1

    run(scenario())


def test_ejection_grows_while_it_keeps_failing_and_ends_by_itself() -> None:
    async def scenario() -> None:
        detector, slots, (a, _), metrics = setup(base_ejection_s=0.05, max_ejection_s=0.12)
        bound = metrics.for_model("m")
        loop = asyncio.get_running_loop()
        for expected_s in (0.05, 0.10, 0.12):  # base x times in a row, capped at max_ejection_s
            before = loop.time()
            detector.failed("m", bound, slots, a, Failure.CONNECT)
            if not a.health.ejected:  # the first time takes two in a row
                detector.failed("m", bound, slots, a, Failure.CONNECT)
            after = loop.time()
            assert a.health.timer is not None
            # The timer was set between `before` and `after`, expected_s ahead.
            ends = a.health.timer.when()
            assert ends - after - 1e-9 <= expected_s <= ends - before + 1e-9
            await until(lambda: not a.health.ejected, what="the ejection ends by itself")
            # Back on probation: its very next failure ejects it again.
            assert a.health.probation and ejected_now(metrics) == 0
        detector.answered("m", bound, slots, a, 200)
        assert not a.health.probation and a.health.ejections == 0

    run(scenario())


def test_when_every_replica_is_ejected_all_are_used() -> None:
    async def scenario() -> None:
        detector, slots, (a, b), metrics = setup()
        bound = metrics.for_model("m")
        for endpoint in (a, b):
            for _ in range(2):
                detector.failed("m", bound, slots, endpoint, Failure.CONNECT)
        assert a.health.ejected and b.health.ejected
        assert not_ejected(slots.endpoints) == slots.endpoints
        assert pick(slots.endpoints, 0) is not None

    run(scenario())


def test_a_retry_may_use_an_ejected_replica_when_the_others_failed_it() -> None:
    async def scenario() -> None:
        detector, slots, (a, b), metrics = setup()
        bound = metrics.for_model("m")
        detector.failed("m", bound, slots, a, Failure.CONNECT)
        detector.failed("m", bound, slots, a, Failure.CONNECT)
        assert pick(slots.endpoints, 0, exclude=[b]) is a
        assert not_ejected(slots.endpoints) == (b,)

    run(scenario())


def test_a_returning_replica_serves_waiters() -> None:
    async def scenario() -> None:
        detector, slots, (a, b), metrics = setup(base_ejection_s=0.05)
        bound = metrics.for_model("m")
        detector.failed("m", bound, slots, a, Failure.CONNECT)
        detector.failed("m", bound, slots, a, Failure.CONNECT)
        b.inflight = b.limit  # the only replica not ejected is full
        assert slots.take() is None
        granted = await slots.wait(2)
        assert granted is a  # handed over when its ejection ended

    run(scenario())


def test_consul_stays_the_authority_a_re_registered_replica_starts_clean() -> None:
    async def scenario() -> None:
        metrics = RouterMetrics()
        table = EndpointTable(metrics)
        table.set_models({"m": ModelRecord(name="m", definition_hash="h", replicas=2)})
        a, b = ServiceAddress("10.0.0.1", 9000), ServiceAddress("10.0.0.2", 9000)
        table.set_endpoints("m", [a, b])
        entry = table.get("m")
        assert entry is not None
        detector = OutlierDetector()
        first = entry.endpoints[0]
        for _ in range(2):
            detector.failed("m", entry.metrics, entry.slots, first, Failure.CONNECT)
        assert first.health.ejected and ejected_now(metrics) == 1
        # Consul drops it from the passing list, then it passes again.
        table.set_endpoints("m", [b])
        assert ejected_now(metrics) == 0
        table.set_endpoints("m", [a, b])
        back = entry.endpoints[0]
        assert back.address == a and back is not first and not back.health.ejected

    run(scenario())


def test_on_probation_a_replica_takes_one_request_at_a_time() -> None:
    # Half-open: a burst arriving as an ejection ends must not all meet a replica
    # still wedged (a new user saw 4 of 10 streams do so).
    async def scenario() -> None:
        detector, slots, (a, b), metrics = setup(base_ejection_s=0.05)
        bound = metrics.for_model("m")
        detector.failed("m", bound, slots, a, Failure.CONNECT)
        detector.failed("m", bound, slots, a, Failure.CONNECT)
        await until(lambda: not a.health.ejected, what="the ejection ends")
        assert a.health.probation
        b.inflight = 1
        assert pick(slots.endpoints, 0) is a  # the idle one: its probe
        a.inflight = 1
        assert not_ejected(slots.endpoints) == (b,)
        assert {pick(slots.endpoints, turn) for turn in range(4)} == {b}
        detector.answered("m", bound, slots, a, 200)  # the probe passed
        assert not a.health.probation and not_ejected(slots.endpoints) == slots.endpoints

    run(scenario())
