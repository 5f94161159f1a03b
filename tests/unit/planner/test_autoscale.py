"""Load-based scaling (issue 22): the pure decision (`planner.model.autoscale`), its place
in a TICK (`planner.model.transition`), and the routers' summed load
(`planner.daemon.demand`), all on a fixed clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from llmgw_contract import (
    ModelLoad,
    ModelRecord,
    Parked,
    ScalingBounds,
    ScalingState,
    StateDocument,
    Unplaceable,
    UsageReport,
)
from planner.daemon.demand import DemandBook
from planner.model.autoscale import SAVE_EVERY_S, Demand, decide, wanted
from planner.model.effects import Reason, Scale
from planner.model.failures import Rules
from planner.model.observation import Observation
from planner.model.transition import Event
from planner.model.transition import decide as transition
from tests.support.nomad_mock import job

T0 = datetime(2026, 12, 2, 4, 0, tzinfo=UTC)
BOUNDS = ScalingBounds(min=1, max=4, target=2, window=30, up_after=15, down_after=300)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def load(average: float, now: float | None = None, covered: float = 30.0) -> Demand:
    return Demand(
        average=average, now=average if now is None else now, covered_s=covered, routers=2
    )


def test_wanted_is_the_ceiling_of_load_per_target_within_the_bounds() -> None:
    assert [wanted(x, BOUNDS) for x in (0, 0.5, 2, 2.1, 5.4, 8, 100)] == [1, 1, 1, 2, 3, 4, 4]


def test_up_only_after_the_average_asked_for_more_for_up_after() -> None:
    first = decide(None, BOUNDS, 1, load(5.4, now=3.0), None, at(0))
    assert first.count is None and first.state.above_since == at(0).timestamp()
    early = decide(first.state, BOUNDS, 1, load(5.4, now=3.0), None, at(14))
    assert early.count is None
    due = decide(early.state, BOUNDS, 1, load(5.4, now=3.0), None, at(15))
    assert due.count == 3
    assert due.words == "1 -> 3: 5.4 in flight per replica over 30 s, target 2"
    last = due.state.last
    assert last is not None and (last.before, last.after, last.direction) == (1, 3, "up")
    assert due.state.above_since == 0.0  # the next change starts its own wait


def test_a_dip_restarts_the_wait() -> None:
    first = decide(None, BOUNDS, 1, load(5.0, now=3.0), None, at(0))
    dip = decide(first.state, BOUNDS, 1, load(1.0), None, at(10))
    assert dip.state.above_since == 0.0
    again = decide(dip.state, BOUNDS, 1, load(5.0, now=3.0), None, at(20))
    assert decide(again.state, BOUNDS, 1, load(5.0, now=3.0), None, at(34)).count is None
    assert decide(again.state, BOUNDS, 1, load(5.0, now=3.0), None, at(35)).count == 3


def test_a_surge_of_twice_the_target_per_replica_scales_at_once() -> None:
    surge = decide(None, BOUNDS, 1, load(1.0, now=7.0), None, at(0))
    assert surge.count == 4
    assert surge.words == "1 -> 4: 7 in flight per replica now (a surge), target 2"
    assert decide(None, BOUNDS, 2, load(1.0, now=7.0), None, at(0)).count is None  # 3.5 < 4


def test_down_only_after_down_after_and_never_below_the_floor() -> None:
    first = decide(None, BOUNDS, 3, load(0.0), None, at(0))
    assert first.count is None and first.state.below_since == at(0).timestamp()
    assert decide(first.state, BOUNDS, 3, load(0.0), None, at(299)).count is None
    down = decide(first.state, BOUNDS, 3, load(0.0), None, at(300))
    assert down.count == 1 and down.state.last is not None
    assert down.state.last.direction == "down"


def test_no_scale_while_a_deployment_runs_and_it_says_why() -> None:
    blocked = "deployment 1234abcd of version 3 is running; scaling waits for it"
    first = decide(None, BOUNDS, 1, load(1.0, now=7.0), blocked, at(0))
    assert first.count is None
    assert first.state.waiting == f"wants 4: {blocked}"
    assert first.state.last is None
    done = decide(first.state, BOUNDS, 1, load(1.0, now=7.0), None, at(1))
    assert done.count == 4 and done.state.waiting == ""


def test_no_signal_holds_the_count() -> None:
    silent = Demand(average=0.0, now=0.0, covered_s=0.0, routers=0)
    held = decide(None, BOUNDS, 3, silent, None, at(1000))
    assert held.count is None and held.state.waiting.startswith("no router reports load")
    assert decide(None, BOUNDS, 3, None, None, at(1000)).count is None


def test_an_idle_on_demand_model_is_activations() -> None:
    assert decide(None, BOUNDS, 0, load(9.0), None, at(0)).count is None


def test_the_saved_average_fills_what_a_new_leader_has_no_reports_of() -> None:
    saved = ScalingState(average=6.0, average_at=at(0).timestamp())
    # 5 s of reports at 0 beside 25 s of the saved 6: (0 * 5 + 6 * 25) / 30 = 5.
    blended = decide(saved, BOUNDS, 3, load(0.0, covered=5.0), None, at(5))
    assert blended.state.below_since == 0.0  # 5 wants 3: no scale down started
    stale = saved.model_copy(update={"average_at": at(-100).timestamp()})
    assert decide(stale, BOUNDS, 3, load(0.0, covered=5.0), None, at(5)).state.below_since


def test_the_document_is_written_on_change_or_every_save_period_only() -> None:
    first = decide(None, BOUNDS, 2, load(3.0), None, at(0))
    same = decide(first.state, BOUNDS, 2, load(3.5), None, at(SAVE_EVERY_S - 1))
    assert same.state == first.state  # nothing moved: no write
    later = decide(first.state, BOUNDS, 2, load(3.5), None, at(SAVE_EVERY_S))
    assert later.state.average == 3.5


@pytest.mark.parametrize("count", range(0, 7))
@pytest.mark.parametrize("value", [0.0, 0.3, 2.0, 5.0, 9.0, 50.0])
def test_a_decision_is_always_within_the_bounds(count: int, value: float) -> None:
    state = ScalingState(above_since=at(-1000).timestamp(), below_since=at(-1000).timestamp())
    for now in (value, 0.0):
        scaled = decide(state, BOUNDS, count, load(value, now=now), None, at(0))
        if scaled.count is not None:
            assert BOUNDS.min <= scaled.count <= BOUNDS.max


# --- in a TICK ----------------------------------------------------------------------


RECORD = ModelRecord(name="m", definition_hash="d1", replicas=1, scaling=BOUNDS)
RULES = Rules(park_after=5, stable_after_ns=120 * 10**9)


def observed(count: int, demand: Demand | None, **extra: object) -> Observation:
    the_job = job(count=count, CreateIndex=5)
    extra.setdefault("passing", {"a1": 1})
    return Observation(
        name="m",
        record=RECORD,
        job=the_job,
        versions=(the_job,),
        demand=demand,
        state_index=7,
        **extra,  # type: ignore[arg-type]
    )


def test_a_tick_scales_a_scaling_model_through_the_scale_effect() -> None:
    document = StateDocument(name="m", definition_hash="d1")
    plan = transition(document, observed(1, load(1.0, now=7.0)), Event.TICK, RULES, T0)
    [scale] = plan.effects
    assert isinstance(scale, Scale) and scale.reason is Reason.LOAD
    assert (scale.group, scale.count) == ("server", 4)
    assert plan.state.scaling is not None and plan.state.scaling.last is not None


def test_a_tick_never_scales_during_a_deployment_a_parked_or_a_fixed_model() -> None:
    document = StateDocument(name="m", definition_hash="d1")
    running = {"ID": "dep1", "JobCreateIndex": 5, "JobVersion": 2, "Status": "running"}
    plan = transition(
        document, observed(1, load(1.0, now=7.0), deployments=(running,)), Event.TICK, RULES, T0
    )
    assert plan.effects == ()
    assert plan.state.scaling is not None
    assert "deployment dep1 of version 2 is running" in plan.state.scaling.waiting
    done = {**running, "Status": "successful"}
    assert transition(
        document, observed(1, load(1.0, now=7.0), deployments=(done,)), Event.TICK, RULES, T0
    ).effects
    serving_none = observed(1, load(1.0, now=7.0), passing={})
    plan = transition(document, serving_none, Event.TICK, RULES, T0)
    assert plan.effects == () and plan.state.scaling is not None
    assert "no replica passes" in plan.state.scaling.waiting
    parked = document.model_copy(update={"parked": Parked(reason="r")})
    assert transition(parked, observed(1, load(1.0, now=7.0)), Event.TICK, RULES, T0).effects == ()
    fixed = Observation(name="m", record=RECORD.model_copy(update={"scaling": None}), job=job())
    assert transition(document, fixed, Event.TICK, RULES, T0).effects == ()


def test_a_scale_up_waits_while_nomad_cannot_place_what_the_job_asks_for() -> None:
    short = Unplaceable(
        reason="2 of 3 replicas placed; memory exhausted on 2 of 2 nodes", placed=2, desired=3
    )
    document = StateDocument(name="m", definition_hash="d1", unplaceable=short)
    plan = transition(document, observed(3, load(1.0, now=20.0)), Event.TICK, RULES, T0)
    assert plan.effects == ()
    assert plan.state.scaling is not None
    assert plan.state.scaling.waiting == (
        "wants 4: 2 of 3 replicas placed; memory exhausted on 2 of 2 nodes "
        "(Nomad places them when room appears)"
    )
    # Down is not held by a shortfall: fewer wanted is fewer asked for.
    quiet = document.model_copy(
        update={"scaling": ScalingState(below_since=(T0 - timedelta(hours=1)).timestamp())}
    )
    [down] = transition(quiet, observed(3, load(0.0)), Event.TICK, RULES, T0).effects
    assert isinstance(down, Scale) and down.count == 1


# --- the routers' summed load --------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


def report(router: str, **loads: int) -> UsageReport:
    return UsageReport(
        models=sorted(loads),
        router=router,
        interval_s=10.0,
        load={name: ModelLoad(inflight=n, waiting=0) for name, n in loads.items()},
    )


def test_the_book_sums_routers_averages_over_time_and_forgets_a_silent_router() -> None:
    clock = Clock()
    book = DemandBook(clock)
    assert book.demand("m", 30).routers == 0
    book.report(report("r1", m=2))
    book.report(report("r2", m=4))
    clock.now = at(10)
    book.report(report("r1", m=0))
    book.report(report("r2", m=0))
    clock.now = at(20)
    demand = book.demand("m", 30)
    # 6 for 10 s, then 0 for 10 s, over the 20 s covered.
    assert (demand.average, demand.now, demand.covered_s, demand.routers) == (3.0, 0.0, 20.0, 2)
    book.report(report("r1", m=5))
    clock.now = at(22)
    book.report(report("r2"))  # r2 reports again (no load); r1 will go silent
    clock.now = at(23.5)
    assert book.demand("m", 30).now == 5.0
    clock.now = at(45)
    book.report(report("r2"))
    clock.now = at(51)  # r1: 31 s without a report, over 3 intervals of 10 s: gone
    demand = book.demand("m", 30)
    assert (demand.now, demand.routers) == (0.0, 1)
    assert book.snapshot() == {"m": 0.0}


def test_a_report_without_a_router_id_carries_no_load() -> None:
    book = DemandBook(Clock())
    book.report(UsageReport(models=["m"]))
    assert book.demand("m", 30).routers == 0
