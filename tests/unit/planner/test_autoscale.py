"""Load-based scaling (issue 22): the pure decision (`planner.model.autoscale`), its place
in a TICK (`planner.model.transition`), and the routers' summed load
(`planner.daemon.demand`), all on a fixed clock."""

from __future__ import annotations

import dataclasses
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
    UpdateFailed,
    UsageReport,
)
from llmgw_contract.documents import USAGE_GOODBYE_INTERVAL_S
from planner.daemon.demand import DemandBook
from planner.model.autoscale import SAVE_EVERY_S, Demand, decide, wanted
from planner.model.effects import Reason, Register, Scale
from planner.model.failures import Rules
from planner.model.observation import Observation
from planner.model.status import scaling_view
from planner.model.transition import Event
from planner.model.transition import decide as transition
from planner.vocab import group_count
from tests.support.nomad_mock import job

T0 = datetime(2026, 12, 2, 4, 0, tzinfo=UTC)
BOUNDS = ScalingBounds(min=1, max=4, target=2, window=30, up_after=15, down_after=300)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def load(
    average: float,
    now: float | None = None,
    covered: float = 30.0,
    surge: float = 0.0,
    lost: int = 0,
) -> Demand:
    return Demand(
        average=average,
        now=average if now is None else now,
        covered_s=covered,
        routers=2,
        surge=surge,
        lost=lost,
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
    surge = decide(None, BOUNDS, 1, load(1.0, now=7.0, surge=7.0), None, at(0))
    assert surge.count == 4
    assert surge.words == "1 -> 4: 7 in flight per replica now (a surge), target 2"
    assert (
        decide(None, BOUNDS, 2, load(1.0, now=7.0, surge=7.0), None, at(0)).count is None
    )  # 3.5 < 4


def test_down_only_after_down_after_and_never_below_the_floor() -> None:
    first = decide(None, BOUNDS, 3, load(0.0), None, at(0))
    assert first.count is None and first.state.below_since == at(0).timestamp()
    state = first.state
    for second in range(10, 300, 10):  # ticks: the scaler saves its state as it goes
        held = decide(state, BOUNDS, 3, load(0.0), None, at(second))
        assert held.count is None
        state = held.state
    assert decide(state, BOUNDS, 3, load(0.0), None, at(299)).count is None
    down = decide(state, BOUNDS, 3, load(0.0), None, at(300))
    assert down.count == 1 and down.state.last is not None
    assert down.state.last.direction == "down"


def test_no_scale_while_a_deployment_runs_and_it_says_why() -> None:
    blocked = "deployment 1234abcd of version 3 is running; scaling waits for it"
    first = decide(None, BOUNDS, 1, load(1.0, now=7.0, surge=7.0), blocked, at(0))
    assert first.count is None
    assert first.state.waiting == f"wants 4: {blocked}"
    assert first.state.last is None
    done = decide(first.state, BOUNDS, 1, load(1.0, now=7.0, surge=7.0), None, at(1))
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
    state = ScalingState(
        above_since=at(-1000).timestamp(),
        below_since=at(-1000).timestamp(),
        average_at=at(-1).timestamp(),
    )
    for now in (value, 0.0):
        scaled = decide(state, BOUNDS, count, load(value, now=now, surge=now), None, at(0))
        if scaled.count is not None:
            assert BOUNDS.min <= scaled.count <= BOUNDS.max


# --- in a TICK ----------------------------------------------------------------------


RECORD = ModelRecord(name="m", definition_hash="d1", replicas=1, scaling=BOUNDS)
RULES = Rules(park_after=5, stable_after_ns=120 * 10**9)
OBSERVED_AT_T0 = (Event.OBSERVED, RULES, T0)


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
    plan = transition(document, observed(1, load(1.0, now=7.0, surge=7.0)), Event.TICK, RULES, T0)
    [scale] = plan.effects
    assert isinstance(scale, Scale) and scale.reason is Reason.LOAD
    assert (scale.group, scale.count) == ("server", 4)
    assert plan.state.scaling is not None and plan.state.scaling.last is not None


def test_a_tick_never_scales_during_a_deployment_a_parked_or_a_fixed_model() -> None:
    document = StateDocument(name="m", definition_hash="d1")
    running = {"ID": "dep1", "JobCreateIndex": 5, "JobVersion": 2, "Status": "running"}
    plan = transition(
        document,
        observed(1, load(1.0, now=7.0, surge=7.0), deployments=(running,)),
        Event.TICK,
        RULES,
        T0,
    )
    assert plan.effects == ()
    assert plan.state.scaling is not None
    assert "deployment dep1 of version 2 is running" in plan.state.scaling.waiting
    done = {**running, "Status": "successful"}
    assert transition(
        document,
        observed(1, load(1.0, now=7.0, surge=7.0), deployments=(done,)),
        Event.TICK,
        RULES,
        T0,
    ).effects
    serving_none = observed(1, load(1.0, now=7.0, surge=7.0), passing={})
    plan = transition(document, serving_none, Event.TICK, RULES, T0)
    assert plan.effects == () and plan.state.scaling is not None
    assert "no replica passes" in plan.state.scaling.waiting
    parked = document.model_copy(update={"parked": Parked(reason="r")})
    assert (
        transition(
            parked, observed(1, load(1.0, now=7.0, surge=7.0)), Event.TICK, RULES, T0
        ).effects
        == ()
    )
    fixed = Observation(name="m", record=RECORD.model_copy(update={"scaling": None}), job=job())
    assert transition(document, fixed, Event.TICK, RULES, T0).effects == ()


def test_a_scale_up_waits_while_nomad_cannot_place_what_the_job_asks_for() -> None:
    short = Unplaceable(
        reason="2 of 3 replicas placed; memory exhausted on 2 of 2 nodes", placed=2, desired=3
    )
    document = StateDocument(name="m", definition_hash="d1", unplaceable=short)
    plan = transition(document, observed(3, load(1.0, now=20.0, surge=20.0)), Event.TICK, RULES, T0)
    assert plan.effects == ()
    assert plan.state.scaling is not None
    assert plan.state.scaling.waiting == (
        "wants 4: 2 of 3 replicas placed; memory exhausted on 2 of 2 nodes "
        "(Nomad places them when room appears)"
    )
    # Down is not held by a shortfall: fewer wanted is fewer asked for.
    quiet = document.model_copy(
        update={
            "scaling": ScalingState(
                below_since=(T0 - timedelta(hours=1)).timestamp(),
                average_at=(T0 - timedelta(seconds=2)).timestamp(),
            )
        }
    )
    [down] = transition(quiet, observed(3, load(0.0)), Event.TICK, RULES, T0).effects
    assert isinstance(down, Scale) and down.count == 1


def stuck_deployment(canaries: int = 0, placed: int = 2) -> dict:
    """The deployment of a count change to 3 (Nomad's shape: /v1/job/:id/deployments)."""
    group = {"DesiredCanaries": canaries, "DesiredTotal": 3, "PlacedAllocs": placed}
    return {
        "ID": "dep12345678",
        "JobCreateIndex": 5,
        "JobVersion": 1,
        "Status": "running",
        "TaskGroups": {"server": group},
    }


def test_a_scale_up_that_fits_nowhere_does_not_hold_the_scale_down_for_good() -> None:
    """The deployment of a scale-up Nomad could not finish runs until room appears
    (progress_deadline 0), and Nomad refuses a scale while it runs: the scale-down is a
    register of the job as read with the new count, which supersedes it (found on real
    agents: the load ended and the count stayed 3, 'wants 1: deployment ... is running')."""
    short = Unplaceable(
        reason="2 of 3 replicas placed; memory exhausted on 1 of 1 node", placed=2, desired=3
    )
    quiet = StateDocument(
        name="m",
        definition_hash="d1",
        unplaceable=short,
        scaling=ScalingState(
            below_since=(T0 - timedelta(hours=1)).timestamp(),
            average_at=(T0 - timedelta(seconds=2)).timestamp(),
        ),
    )
    seen = observed(3, load(0.0), deployments=(stuck_deployment(),))
    [down] = transition(quiet, seen, Event.TICK, RULES, T0).effects
    assert isinstance(down, Register) and down.reason is Reason.LOAD
    assert [tg["Count"] for tg in down.job["TaskGroups"]] == [1]
    assert down.words.startswith("3 -> 1: ")
    assert seen.job is not None and group_count(seen.job) == 3  # the observation is kept
    # Without a shortfall the deployment is progressing: wait for it, as before.
    placed = quiet.model_copy(update={"unplaceable": None})
    held = transition(placed, seen, Event.TICK, RULES, T0)
    assert held.effects == () and held.state.scaling is not None
    assert "deployment dep12345 of version 1 is running" in held.state.scaling.waiting
    # A rollout (canaries) short of room is no scale's deployment: it waits too.
    rollout = observed(3, load(0.0), deployments=(stuck_deployment(canaries=3),))
    assert transition(quiet, rollout, Event.TICK, RULES, T0).effects == ()
    # So does one that placed every replica it wants.
    done = observed(3, load(0.0), deployments=(stuck_deployment(placed=3),))
    assert transition(quiet, done, Event.TICK, RULES, T0).effects == ()


def test_the_log_says_a_scale_up_is_short_never_unplaceable() -> None:
    """A scaling model with replicas placed serves what it has: the planner's log line for
    Nomad's answer, and for its end, says so in issue 22's words."""
    short = Unplaceable(
        reason="2 of 3 replicas placed; memory exhausted on 1 of 1 node", placed=2, desired=3
    )
    document = StateDocument(name="m", definition_hash="d1")
    answered = observed(3, None, evaluation={"ID": "e1"}, placement=short)
    plan = transition(document, answered, Event.OBSERVED, RULES, T0)
    assert [n.text for n in plan.notes] == [
        "short of a scale-up: wants 3, 2 placed: memory exhausted on 1 of 1 node"
    ]
    # Room made on the node and Nomad looking again, then short still: said once.
    room = short.model_copy(update={"provisional": True, "waiting": "waiting for room: ..."})
    looking = observed(3, None, evaluation={"ID": "e1"}, placement=room)
    looked = transition(plan.state, looking, Event.OBSERVED, RULES, T0)
    again = transition(looked.state, answered, Event.OBSERVED, RULES, T0)
    assert (looked.notes, again.notes) == ((), ()), (looked.notes, again.notes)
    # Another shortfall while Nomad looks again stands at once: said once, then not again.
    other = room.model_copy(update={"reason": "2 of 3 replicas placed; cpu exhausted"})
    moved = transition(plan.state, dataclasses.replace(looking, placement=other), *OBSERVED_AT_T0)
    settles = dataclasses.replace(answered, placement=other.model_copy(update={"waiting": ""}))
    settled_again = transition(moved.state, settles, *OBSERVED_AT_T0)
    assert [n.text for n in moved.notes] == [
        "short of a scale-up: wants 3, 2 placed: cpu exhausted"
    ] and settled_again.notes == ()
    # Room being made first, then settled: said when settled.
    fresh = transition(document, looking, Event.OBSERVED, RULES, T0)
    settled = transition(fresh.state, answered, Event.OBSERVED, RULES, T0)
    assert (fresh.notes, [n.text for n in settled.notes]) == ((), [plan.notes[0].text])
    placed = observed(3, None, evaluation={"ID": "e2"})
    after = transition(plan.state, placed, Event.OBSERVED, RULES, T0)
    assert after.state.unplaceable is None
    assert "placed (was short of a scale-up: wants 3, 2 placed: " in after.notes[0].text
    # Scaled down to what was placed: nothing was placed (issue 22's fourth QA).
    down = observed(1, None, evaluation={"ID": "e2"})
    after = transition(plan.state, down, Event.OBSERVED, RULES, T0)
    assert after.notes[0].text.startswith(
        "no longer short: the job asks for 1 (was short of a scale-up: wants 3, 2 placed: "
    ), after.notes[0].text
    # A fixed model short of room is told as before.
    fixed = observed(3, None, evaluation={"ID": "e1"}, placement=short)
    fixed = dataclasses.replace(fixed, record=RECORD.model_copy(update={"scaling": None}))
    texts = [n.text for n in transition(document, fixed, Event.OBSERVED, RULES, T0).notes]
    assert texts == [f"unplaceable: {short.reason}"]


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


def test_what_the_replicas_say_counts_when_it_is_more_never_twice() -> None:
    """Issue 22, item 2: the replicas' own count (requests_processing + deferred, every
    client's) is one figure, however many routers read it; the routers' in flight are
    summed; the load is the larger, plus what waits in the routers."""
    clock = Clock()
    book = DemandBook(clock)

    def said(router: str, inflight: int, replicas: int, waiting: int = 0) -> UsageReport:
        load = ModelLoad(inflight=inflight, waiting=waiting, replicas=replicas)
        return UsageReport(models=["m"], router=router, interval_s=10.0, load={"m": load})

    # Both routers read the same replicas: 2 + 1 of theirs, nothing else.
    book.report(said("r1", 2, 3))
    book.report(said("r2", 1, 3, waiting=2))
    assert book.demand("m", 30).now == 5.0  # 3 in flight + 2 waiting, not 3 + 3 + 2
    assert book.snapshot() == {"m": 5.0}
    # 4 more on the replicas that no report carries (a router whose reports fail, a
    # client that bypasses the routers): the largest read counts.
    book.report(said("r1", 2, 7))
    assert book.demand("m", 30).now == 9.0
    # A router that read nothing beyond its own says 0: the sum of in flight stands.
    book.report(said("r1", 2, 0))
    book.report(said("r2", 1, 0))
    assert book.demand("m", 30).now == 3.0


def test_a_report_without_a_router_id_carries_no_load() -> None:
    book = DemandBook(Clock())
    book.report(UsageReport(models=["m"]))
    assert book.demand("m", 30).routers == 0


# --- review fixes (issue 22): timers, surges, silent routers, rollbacks --------------


def test_a_new_leader_does_not_scale_down_on_its_first_report() -> None:
    """A: an old leader's below_since 601 s ago and one router's report of 1 s: no scale
    down until this leader's reports cover the window, and then on the kept timer."""
    t = 1000.0
    saved = ScalingState(
        average=0.5, average_at=at(t - 20).timestamp(), below_since=at(t - 601).timestamp()
    )
    one_report = Demand(average=0.0, now=0.0, covered_s=1.0, routers=1)
    first = decide(saved, BOUNDS, 3, one_report, None, at(t))
    assert first.count is None
    assert first.state.waiting == (
        "wants 1: 1 s of the 30 s window reported (a new leader); "
        "scaling down waits for the whole window"
    )
    covered = Demand(average=0.0, now=0.0, covered_s=30.0, routers=1)
    assert decide(first.state, BOUNDS, 3, covered, None, at(t + 29)).count == 1


def test_saved_timers_from_the_future_or_a_stale_state_start_again() -> None:
    """A: a since-marker later than now (clock skew) or saved with an average older
    than the stale limit (nobody watched the gap) is dropped: the wait starts now."""
    t = at(1000).timestamp()
    skewed = ScalingState(average=0.0, average_at=t - 5, below_since=t + 3600)
    assert decide(skewed, BOUNDS, 3, load(0.0), None, at(1000)).state.below_since == t
    stale = ScalingState(average=0.0, average_at=t - 61, below_since=t - 900)
    held = decide(stale, BOUNDS, 3, load(0.0), None, at(1000))
    assert held.count is None and held.state.below_since == t
    fresh = ScalingState(average=0.0, average_at=t - 59, below_since=t - 900)
    assert decide(fresh, BOUNDS, 3, load(0.0), None, at(1000)).count == 1


def test_a_momentary_spike_is_no_surge() -> None:
    """B: `now` at 7 (3.5 x target) without a sustained surge figure waits for up_after."""
    spike = decide(None, BOUNDS, 1, load(1.0, now=7.0, surge=0.0), None, at(0))
    assert spike.count is None and spike.state.above_since == 0.0


def test_the_book_sees_a_surge_only_when_it_held_for_two_reports_of_a_router() -> None:
    """B: the panic window is 2.5 report intervals (25 s here); its lowest sum counts
    once one router reported twice in it."""
    clock = Clock()
    book = DemandBook(clock)
    book.report(report("r1", m=1))
    clock.now = at(5)
    book.report(report("r2", m=9))  # a spike
    assert book.demand("m", 30).surge == 0.0  # no router reported twice yet
    clock.now = at(10)
    book.report(report("r1", m=1))
    assert book.demand("m", 30).surge == 1.0  # the lowest sum, not the spike
    for second in range(15, 55, 5):
        clock.now = at(second)
        book.report(report("r1" if second % 10 == 0 else "r2", m=8))
    # From 25 s on (the window from 50 - 25) both routers reported 8 at every report.
    assert book.demand("m", 30).surge == 16.0


def test_a_router_gone_silent_holds_scale_downs_for_down_after() -> None:
    """C: its load is unknown; a scale-down waits, a scale-up does not."""
    clock = Clock()
    book = DemandBook(clock)
    book.report(report("r1", m=1))
    book.report(report("r2", m=3))
    for second in (10, 20, 30):
        clock.now = at(second)
        book.report(report("r1", m=1))
    clock.now = at(31)  # r2: 31 s without a report
    demand = book.demand("m", 30, 300)
    assert (demand.routers, demand.lost, demand.now) == (1, 1, 1.0)
    assert book.demand("m", 30, 300).lost == 1
    clock.now = at(331)
    book.report(report("r1", m=1))
    assert book.demand("m", 30, 300).lost == 0  # down_after passed
    clock.now = at(30)
    book2 = DemandBook(clock)
    book2.report(report("r2", m=3))
    clock.now = at(61)
    assert book2.demand("m", 30, 300).lost == 1
    book2.report(report("r2", m=3))  # it reports again
    assert book2.demand("m", 30, 300).lost == 0
    due = ScalingState(average_at=at(-1).timestamp(), below_since=at(-400).timestamp())
    held = decide(due, BOUNDS, 3, load(0.0, lost=1), None, at(0))
    assert held.count is None
    assert held.state.waiting == (
        "wants 1: 1 router(s) stopped reporting within 300 s (their load is unknown); "
        "scaling down waits"
    )
    assert decide(None, BOUNDS, 1, load(1.0, now=7.0, surge=7.0, lost=1), None, at(0)).count == 4


def test_a_router_that_says_goodbye_is_forgotten_at_once_and_not_lost() -> None:
    """B/C: a router shutting down sends an empty report with the goodbye interval."""
    clock = Clock()
    book = DemandBook(clock)
    book.report(report("r1", m=1))
    book.report(report("old", m=4))
    clock.now = at(1)
    book.report(UsageReport(models=[], router="old", interval_s=USAGE_GOODBYE_INTERVAL_S, load={}))
    demand = book.demand("m", 30, 300)
    assert (demand.routers, demand.now, demand.lost) == (1, 1.0, 0)
    # An empty heartbeat at an ordinary interval is no goodbye.
    book.report(UsageReport(models=[], router="r1", interval_s=10.0, load={}))
    assert book.demand("m", 30, 300).routers == 1


def test_no_load_scaling_while_the_update_is_rolled_back() -> None:
    """E: the job runs the definition before the applied one."""
    failed = UpdateFailed(definition_hash="d1", job_version=2, reason="deployment failed")
    document = StateDocument(name="m", definition_hash="d1", update_failed=failed)
    surge = load(1.0, now=7.0, surge=7.0)
    plan = transition(document, observed(1, surge), Event.TICK, RULES, T0)
    assert plan.effects == () and plan.state.scaling is not None
    assert plan.state.scaling.waiting == (
        "wants 4: the update to definition d1 was rolled back; scaling waits for a new apply"
    )
    older = failed.model_copy(update={"definition_hash": "d0"})
    newer = document.model_copy(update={"update_failed": older})
    assert transition(newer, observed(1, surge), Event.TICK, RULES, T0).effects


def test_at_max_and_the_average_only_from_a_scaler_with_a_signal() -> None:
    """D: a held scaler (no router reports) never refreshes the saved average."""
    record = RECORD
    hot = ScalingState(average=20.0, average_at=at(0).timestamp())
    document = StateDocument(name="m", definition_hash="d1", scaling=hot)
    view = scaling_view(record, document, 4, at(10))
    assert view is not None and view["at_max"] and not view["average_stale"]
    view = scaling_view(record, document, 4, at(61))
    assert view is not None and not view["at_max"] and view["average_stale"]
    empty = scaling_view(record, StateDocument(name="m"), 4, at(0))
    assert empty is not None and empty["average_stale"] and not empty["at_max"]
