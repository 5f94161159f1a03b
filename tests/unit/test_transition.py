"""planner.model.transition.decide, per event and per finding of issue 19, against
tests/support/nomad_mock.py's Nomad objects and a fixed clock.

Task event times are seconds after the Unix epoch (the nodes' clocks); `NOW` is
2026: every test is "a planner clock far ahead of the nodes'" (finding 3)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from llmgw_contract import (
    ActivationStatus,
    JobMeta,
    ModelRecord,
    Parked,
    ReplicaRecord,
    StateDocument,
    Unplaceable,
    UpdateFailed,
)
from planner.errors import Rejected
from planner.model.effects import Evaluate, Park, Reason, Register, Revert, Scale, Unpark
from planner.model.failures import Rules
from planner.model.observation import Observation
from planner.model.parking import parked_job
from planner.model.resurrect import stale_failed
from planner.model.transition import Event, Plan, decide
from tests.support.nomad_mock import TASK, S, alloc, event, job, run

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
NOW_NS = int(NOW.timestamp()) * S
RULES = Rules(park_after=5, stable_after_ns=120 * S)
RECORD = ModelRecord(name="m", definition_hash="d1", replicas=1)
ON_DEMAND = RECORD.model_copy(update={"on_demand": {"idle_after": 600}})
STORED = StateDocument(name="m", definition_hash="d1")  # as apply created it


def failing(alloc_id: str = "a1", starts: int = 5, at: float = 1, **extra: Any) -> dict[str, Any]:
    """An allocation whose `starts` runs each failed (Nomad stops it after the 5th)."""
    events = [e for i in range(starts) for e in run(at + 10 * i, at + 10 * i + 1)]
    client = "failed" if starts >= 5 else "running"
    return alloc(alloc_id, *events, **{"client": client, **extra})


def observe(
    *allocs: dict[str, Any],
    the_job: dict[str, Any] | None = None,
    record: ModelRecord | None = RECORD,
    passing: dict[str, int] | None = None,
    state_index: int = 7,
    versions: tuple[dict[str, Any], ...] | None = None,
    **extra: Any,
) -> Observation:
    j = job() if the_job is None else the_job
    return Observation(
        name="m",
        record=record,
        job=j,
        versions=(j,) if versions is None else versions,
        allocations=allocs,
        passing=passing or {},
        state_index=state_index,
        **extra,
    )


def observed(document: StateDocument, observation: Observation, now: datetime = NOW) -> Plan:
    return decide(document, observation, Event.OBSERVED, RULES, now)


# --- OBSERVED: counting and parking ------------------------------------------------------


def test_five_failed_starts_park_the_model_with_the_reason_and_last_error() -> None:
    plan = observed(
        STORED,
        observe(
            failing(),
            stderr={f"a1/llama-server/{42 * S}": "error: unknown model architecture: 'kev'"},
        ),
    )
    [park] = plan.effects
    assert isinstance(park, Park) and park.reason is Reason.START_FAILURES
    assert park.parked.reason == "5 consecutive start failures"
    assert plan.state.parked == park.parked and plan.state.consecutive_failures == 5
    assert "unknown model architecture" in (plan.state.last_error or "")


def test_each_failure_counts_once_however_often_it_is_observed() -> None:
    first = observed(STORED, observe(failing(starts=3)))
    assert first.state.consecutive_failures == 3 and first.effects == ()
    assert observed(first.state, observe(failing(starts=3))).state == first.state


def test_a_planner_clock_far_ahead_of_the_nodes_still_counts_and_parks() -> None:
    # Finding 3: a document created with the applying machine's clock (40 s ahead of the
    # nodes', and here decades) used to hide every failure.
    ahead = STORED.model_copy(update={"counting_from_ns": NOW_NS + 40 * S})
    plan = observed(ahead, observe(failing()))
    assert plan.state.parked is not None and isinstance(plan.effects[0], Park)


def test_a_lost_document_takes_what_nomad_shows_as_history_and_counts_what_follows() -> None:
    # Finding 3: no document stored (state_index 0), three failures shown: not counted
    # again (a wiped KV), by what Nomad shows rather than by a time.
    lost = observed(StateDocument(name="m"), observe(failing(starts=3), state_index=0))
    assert lost.state.consecutive_failures == 0 and len(lost.state.counted) == 3
    later = observed(lost.state, observe(failing(starts=4)))
    assert later.state.consecutive_failures == 1


def test_failures_of_an_earlier_incarnation_of_the_job_never_count() -> None:
    # A purged and recreated job: allocations created before it are not its own.
    recreated = job(CreateIndex=500)
    plan = observed(
        STORED,
        observe(failing(CreateIndex=40), failing("a2", 2, CreateIndex=501), the_job=recreated),
    )
    assert plan.state.consecutive_failures == 2 and plan.effects == ()


def test_the_definition_in_the_jobs_meta_is_the_current_one_after_a_partial_apply() -> None:
    # The record says d2 (apply wrote it), the job still runs d1 (apply died before
    # registering): d1's failures count, and park.
    record = RECORD.model_copy(update={"definition_hash": "d2"})
    plan = observed(STORED, observe(failing(), record=record))
    assert plan.state.definition_hash == "d1" and plan.state.parked is not None


def test_allocations_of_another_definition_never_count() -> None:
    v0, v1 = job(definition_hash="d0"), job(definition_hash="d1", Version=1)
    plan = observed(STORED, observe(failing(version=0), the_job=v1, versions=(v1, v0)))
    assert plan.state.consecutive_failures == 0 and plan.effects == ()


def test_a_replica_passing_now_always_protects() -> None:
    # Finding 1: it failed five times, passes now, younger than the stability window.
    flapping = alloc(
        "a1", *[e for i in range(5) for e in run(1 + 10 * i, 2 + 10 * i)], event("Started", 60)
    )
    plan = observed(STORED, observe(flapping, passing={"a1": NOW_NS - 5 * S}))
    assert plan.state.consecutive_failures == 5
    assert plan.effects == () and plan.state.parked is None
    # Once it stops passing, nothing protects the model.
    assert isinstance(observed(plan.state, observe(flapping)).effects[0], Park)


def test_a_healthy_replica_beside_a_failing_one_leaves_the_model_degraded() -> None:
    two = job(count=2)
    healthy = alloc("a0", event("Started", 1), index=0)
    plan = observed(
        STORED, observe(healthy, failing("a1", index=1), the_job=two, passing={"a0": 2 * S})
    )
    assert plan.state.consecutive_failures == 5 and plan.effects == ()


def test_nomad_stopping_every_replica_parks_with_fewer_failures_counted() -> None:
    history = observed(StateDocument(name="m"), observe(failing(starts=3), state_index=0))
    # Two more failures, then Nomad gives up: 2 counted, all stopped.
    plan = observed(history.state, observe(failing()))
    [park] = plan.effects
    assert isinstance(park, Park) and park.reason is Reason.ALL_STOPPED


def test_replica_records_are_bounded_by_the_definition_and_never_drop_a_live_one() -> None:
    # Finding 2: 40 replicas (more than the old bound of 32), all serving.
    forty = job(count=40)
    allocs = [
        alloc(f"a{i:02}", event("Started", 1), index=i, CreateIndex=100 + i) for i in range(40)
    ]
    gone = [alloc(f"x{i}", *run(1, 2), client="failed", index=i, CreateIndex=10) for i in range(5)]
    plan = observed(
        STORED, observe(*allocs, *gone, the_job=forty, passing={a["ID"]: S for a in allocs})
    )
    assert {r.alloc_id for r in plan.state.replicas} == {a["ID"] for a in allocs}
    assert plan.effects == ()


def test_counted_keys_are_pruned_by_what_nomad_shows_never_recounted() -> None:
    # Finding 2: more than 64 keys of allocations Nomad still shows stay counted (the
    # old eviction recounted them), and keys of allocations Nomad forgot go.
    many = job(count=1)
    failed = [
        failing(f"f{i:02}", 5, client="failed", NextAllocation=f"f{i + 1:02}", CreateIndex=10 + i)
        for i in range(20)
    ]
    stale = STORED.model_copy(update={"counted": ("gone/llama-server/1",)})
    first = observed(stale, observe(*failed, the_job=many))
    assert len(first.state.counted) == 100 and "gone/llama-server/1" not in first.state.counted
    again = observed(
        first.state.model_copy(update={"parked": None}), observe(*failed, the_job=many)
    )
    assert again.state.start_failures_total == first.state.start_failures_total


# --- OBSERVED: parking follows the job --------------------------------------------------


PARKED = Parked(
    reason="5 consecutive start failures",
    last_error="boom",
    since="2026-11-29T11:00:00+00:00",
    definition_hash="d1",
)


def test_the_kv_copy_of_parking_follows_the_jobs_meta() -> None:
    parked = parked_job(job(), PARKED)
    plan = observed(STORED, observe(the_job=parked))
    assert plan.state.parked == PARKED and plan.effects == ()
    lifted = observed(
        plan.state.model_copy(update={"consecutive_failures": 5}),
        observe(the_job=job(JobModifyIndex=20)),
    )
    assert lifted.state.parked is None and lifted.state.consecutive_failures == 0


def test_a_nomad_index_reset_never_blocks_unparking() -> None:
    # Finding 4: rebuilt servers, the job's indexes are lower than the document remembers.
    remembered = STORED.model_copy(update={"parked": PARKED, "job_index": 5000})
    plan = observed(remembered, observe(the_job=job(JobModifyIndex=12)))
    assert plan.state.parked is None and plan.state.job_index == 12


def test_an_operators_stop_is_not_a_park() -> None:
    plan = observed(STORED, observe(failing(), the_job=job(stop=True)))
    assert plan.effects == () and plan.state.parked is None


# --- OBSERVED: updates and placement -----------------------------------------------------


def deployment(version: int, status: str) -> dict[str, Any]:
    return {
        "JobVersion": version,
        "JobCreateIndex": 10,
        "Status": status,
        "StatusDescription": "Failed due to unhealthy allocations",
        "CreateIndex": 100 + version,
    }


def test_a_rolled_back_update_is_recorded_with_its_failures_and_judged_by_the_running() -> None:
    v0 = job(definition_hash="good", Version=0, CreateIndex=10)
    v1 = job(definition_hash="bad", Version=1, CreateIndex=10)
    v2 = job(definition_hash="good", Version=2, CreateIndex=10)
    record = RECORD.model_copy(update={"definition_hash": "bad"})
    obs = observe(
        failing("canary", 4, version=1, client="failed"),
        alloc("old", event("Started", 1), version=0),
        the_job=v2,
        versions=(v2, v1, v0),
        record=record,
        passing={"old": S},
        deployments=(deployment(0, "successful"), deployment(1, "failed")),
    )
    plan = observed(StateDocument(name="m", definition_hash="bad"), obs)
    failed = plan.state.update_failed
    assert failed is not None and (failed.definition_hash, failed.job_version) == ("bad", 1)
    assert failed.consecutive_failures == 4
    assert plan.state.definition_hash == "good" and plan.effects == ()
    assert observed(plan.state, obs).state == plan.state


def test_a_stuck_update_is_reverted_to_the_version_that_serves() -> None:
    v1 = job(definition_hash="d1", Version=1, CreateIndex=10)
    v0 = job(definition_hash="d0", Version=0, CreateIndex=10)
    obs = observe(
        alloc("old", event("Started", 1), version=0),
        failing("new", 3, version=1, client="failed"),
        the_job=v1,
        versions=(v1, v0),
        passing={"old": S},
        deployments=(deployment(0, "cancelled"), deployment(1, "failed")),
    )
    assert observed(STORED, obs).effects == (
        Revert(
            Reason.UPDATE_STUCK, observed(STORED, obs).effects[0].words, version=0, prior_version=1
        ),
    )


def a_failed_rollout(
    canary: dict[str, Any], *deployments: dict[str, Any], state_index: int = 7
) -> Observation:
    """Issue 19's QA, found on real agents: d0's replica (version 0) failed and holds its
    place beside d1's `canary` (version 1)."""
    v1 = job(definition_hash="d1", Version=1, CreateIndex=10)
    v0 = job(definition_hash="d0", Version=0, CreateIndex=10)
    return observe(
        failing("old", version=0),
        canary,
        the_job=v1,
        versions=(v1, v0),
        deployments=deployments,
        state_index=state_index,
    )


def test_a_failed_rollout_whose_canaries_nomad_stopped_parks_the_model() -> None:
    """A retry forgave the canary's first 3 failures; its last 2 failed the deployment
    (no stable version), Nomad stopped it, and nothing will start again."""
    canary = {"version": 1, "DeploymentStatus": {"Canary": True}}
    forgiven = observed(
        StateDocument(name="m"),
        a_failed_rollout(failing("c", 3, **canary), deployment(1, "running"), state_index=0),
    ).state
    stopped = failing("c", 5, desired="stop", **canary)
    failed = a_failed_rollout(stopped, deployment(0, "cancelled"), deployment(1, "failed"))
    [park] = observed(forgiven, failed).effects
    assert isinstance(park, Park) and park.reason is Reason.ALL_STOPPED
    answered = activated(forgiven, failed)
    assert answered.answer is not None and answered.answer.status is ActivationStatus.PARKED
    # While the deployment runs, the canary is Nomad's to place again: not parked.
    running = a_failed_rollout(stopped, deployment(0, "cancelled"), deployment(1, "running"))
    assert observed(forgiven, running).effects == ()
    assert not any(isinstance(e, Park) for e in activated(forgiven, running).effects)
    # A canary of the failed rollout that still starts: not parked either.
    starting = alloc("c2", event("Started", 1), version=1)
    assert observed(forgiven, a_failed_rollout(starting, deployment(1, "failed"))).effects == ()


def test_the_placement_answer_is_kept_then_cleared_when_every_replica_runs() -> None:
    short = Unplaceable(reason="memory exhausted on 1 of 1 node", since="2026-11-29T11:00:00")
    evaluation = {"ID": "e1", "Status": "complete"}
    plan = observed(STORED, observe(placement=short, evaluation=evaluation))
    assert plan.state.unplaceable == short
    again = short.model_copy(update={"since": "later"})
    assert (
        observed(plan.state, observe(placement=again, evaluation=evaluation)).state.unplaceable
        == short
    )  # its `since` kept
    placed = observed(
        plan.state,
        observe(alloc("a1", event("Started", 1)), placement=short, evaluation=evaluation),
    )
    assert placed.state.unplaceable is None


def test_a_pruned_model_is_left_alone() -> None:
    plan = observed(STORED, observe(failing(), record=None))
    assert plan == Plan(STORED)


# --- TICK ---------------------------------------------------------------------------------


def test_a_replica_passing_for_the_stability_window_resets_the_counts() -> None:
    counted = observed(
        STORED,
        observe(
            failing(starts=3),
            alloc("a2", event("Started", 40)),
            the_job=job(count=2),
            passing={"a2": 50 * S},
        ),
    )
    assert counted.state.consecutive_failures == 3
    young = decide(counted.state, observe(passing={"a2": NOW_NS - 60 * S}), Event.TICK, RULES, NOW)
    assert young.state.consecutive_failures == 3
    tick = decide(counted.state, observe(passing={"a2": NOW_NS - 120 * S}), Event.TICK, RULES, NOW)
    assert tick.state.consecutive_failures == 0 and tick.effects == ()


def test_a_run_found_stable_by_the_tick_ends_stable_whatever_the_nodes_clock_says() -> None:
    # The planner's clock 40 s ahead of the node's: the run passed at node time 100 s
    # (140 s on the planner's), the tick found it stable at 260 s, and it ended at node
    # time 230 s: 90 s after its entry by the two clocks, yet stable.
    ahead = 40 * S
    serving = alloc("a1", event("Started", 90))
    seen = observed(STORED, observe(serving, passing={"a1": 100 * S + ahead}))
    stable = decide(
        seen.state,
        observe(serving, passing={"a1": 100 * S + ahead}),
        Event.TICK,
        RULES,
        datetime.fromtimestamp(260, UTC),
    )
    [replica] = stable.state.replicas
    assert replica.stable_entry == 100 * S + ahead
    ended = alloc("a1", *run(90, 230), event("Restarting", 230), event("Started", 236))
    plan = observed(stable.state, observe(ended))
    assert plan.state.consecutive_failures == 0 and len(plan.state.counted) == 1


def crash_looped(lifetime_s: float, kept: int = 10) -> dict[str, Any]:
    """A replica Nomad failed after five starts (Restarts 4) as Nomad shows it: only
    its task's last `kept` events (Nomad keeps 10), and its life on the server's clock
    (CreateTime, ModifyTime) `lifetime_s` long."""
    events = [event("Received", 0.5)]
    for i in range(5):
        events += [*run(1 + 6 * i, 2 + 6 * i), event("Restarting", 2.1 + 6 * i)]
    events[-1] = event("Not Restarting", 27)
    looped = alloc("a1", *events[-kept:], client="failed")
    looped["TaskStates"][TASK].update({"Restarts": 4, "State": "dead", "Failed": True})
    return {**looped, "CreateTime": 1000 * S, "ModifyTime": int((1000 + lifetime_s) * S)}


def test_failures_nomad_no_longer_shows_are_counted_once() -> None:
    """Issue 19's third QA (D4): Nomad keeps a task's last 10 events, so a cold read of a
    replica that failed five times showed three failures (`planner retry` with no
    planner running, a restarted leader): "3 consecutive start failures" beside 5
    starts. A replica whose whole life was shorter than the stability window failed
    every run it ended: Restarts + 1 are counted, each once, however often it is read."""
    cold = observed(STORED, observe(crash_looped(30)))
    assert cold.state.consecutive_failures == 5 and cold.state.start_failures_total == 5
    [park] = cold.effects
    assert isinstance(park, Park) and park.parked.reason == "5 consecutive start failures"
    again = observed(cold.state, observe(crash_looped(30), the_job=parked_job(job(), park.parked)))
    assert again.state.consecutive_failures == 5 and again.state.counted == cold.state.counted
    # Counted live (every event shown), then read with the first ones gone: nothing more.
    live = observed(STORED, observe(crash_looped(30, kept=100)))
    assert live.state.consecutive_failures == 5
    [live_park] = live.effects
    later = observed(
        live.state, observe(crash_looped(30), the_job=parked_job(job(), live_park.parked))
    )
    assert later.state.consecutive_failures == 5 and later.state.start_failures_total == 5
    # A life longer than the window may have held a stable run: only what is shown counts.
    slow = observed(STORED, observe(crash_looped(600)))
    assert slow.state.consecutive_failures == 3


def test_a_recreated_document_takes_unseen_failures_as_history_too() -> None:
    # A replica still restarting: the failures Nomad shows (its last events) are history.
    restarting = crash_looped(30)
    restarting["ClientStatus"] = "running"
    seeded = observed(STORED, observe(restarting, state_index=0))
    assert seeded.state.consecutive_failures == 0 and len(seeded.state.counted) == 3


def test_a_recreated_document_counts_what_nomad_gave_up_on_and_parks() -> None:
    """Issue 19's fourth QA: Consul restarted (or `llmgw/` deleted) between a replica's
    4th and 5th failed start; the document written again took all five as history and
    the model stayed `failing` with 0 counted for good (9.5 min watched), since nothing
    would ever fail again to be counted. Nomad stopped every replica: they count."""
    seeded = observed(StateDocument(name="m"), observe(crash_looped(30), state_index=0))
    [park] = seeded.effects
    assert isinstance(park, Park) and park.parked.reason == "5 consecutive start failures"
    assert seeded.state.consecutive_failures == 5
    shown = observed(StateDocument(name="m"), observe(failing(), state_index=0))
    assert shown.state.parked is not None and shown.state.consecutive_failures == 5
    # A failed replica Nomad placed again (a retry) is not given up on: history.
    replaced = failing(NextAllocation="a2")
    again = observed(StateDocument(name="m"), observe(replaced, failing("a2", 2), state_index=0))
    assert again.state.consecutive_failures == 0 and again.effects == ()


# --- RETRY --------------------------------------------------------------------------------


def retried(document: StateDocument, observation: Observation) -> Plan:
    return decide(document, observation, Event.RETRY, RULES, NOW)


def test_retry_of_a_parked_model_unparks_and_forces_a_reschedule() -> None:
    parked = STORED.model_copy(update={"parked": PARKED, "consecutive_failures": 5})
    plan = retried(parked, observe(failing(), the_job=parked_job(job(), PARKED)))
    assert [type(e) for e in plan.effects] == [Unpark, Evaluate]
    assert isinstance(plan.effects[1], Evaluate) and plan.effects[1].force_reschedule
    assert plan.state.parked is None and plan.state.consecutive_failures == 0
    assert plan.summary == "parking lifted; the job is starting again"


def test_retry_of_a_stopped_job_starts_it() -> None:
    plan = retried(STORED, observe(the_job=job(stop=True)))
    assert [type(e) for e in plan.effects] == [Unpark, Evaluate]
    assert plan.summary == "the stopped job is starting again"


def test_retry_of_a_rolled_back_update_reverts_to_it() -> None:
    failed = UpdateFailed(definition_hash="d1", job_version=3, reason="failed")
    current = job(definition_hash="d0", Version=4)
    plan = retried(
        STORED.model_copy(update={"update_failed": failed}),
        observe(the_job=current, versions=(current, job(definition_hash="d1", Version=3))),
    )
    assert plan.effects == (Revert(Reason.RETRY, plan.summary, version=3, prior_version=4),)
    assert plan.state.update_failed is None


def test_retry_of_a_rollback_whose_version_nomad_dropped_forgets_it() -> None:
    """Nomad keeps a job's last 6 versions and every scale makes one: a Revert to the
    failed version would be refused. The rollback is forgotten instead, so the next
    `planner apply` (which refuses a recorded one: `rollout.recorded_rollback`)
    registers the definition again."""
    failed = UpdateFailed(definition_hash="d1", job_version=3, reason="failed")
    current = job(definition_hash="d0", Version=10)
    plan = retried(
        STORED.model_copy(update={"update_failed": failed}),
        observe(the_job=current, versions=(current, job(definition_hash="d0", Version=9))),
    )
    assert plan.effects == () and plan.state.update_failed is None
    assert "run `planner apply`" in plan.summary


def test_retry_places_replicas_nomad_stopped_and_forgives_them() -> None:
    two = job(count=2)
    counted = observed(
        STORED,
        observe(
            failing(starts=3, client="failed"),
            alloc("a2", event("Started", 1), index=1),
            the_job=two,
            passing={"a2": S},
        ),
    )
    plan = retried(
        counted.state,
        observe(
            failing(starts=3, client="failed"),
            alloc("a2", event("Started", 1), index=1),
            the_job=two,
            passing={"a2": S},
        ),
    )
    assert plan.effects == (
        Evaluate(Reason.RETRY, "1 stopped replica(s) placed again", force_reschedule=True),
    )
    assert plan.state.consecutive_failures == 0


def test_retry_of_an_unplaceable_model_asks_again_and_of_a_fine_one_does_nothing() -> None:
    short = STORED.model_copy(update={"unplaceable": Unplaceable(reason="no room")})
    assert retried(short, observe()).effects == (
        Evaluate(Reason.RETRY, "asked the scheduler to place it again"),
    )
    fine = retried(STORED, observe(alloc("a1", event("Started", 1))))
    assert fine.effects == () and "nothing to retry" in fine.summary


# Issue 19's QA, D2 and D3: definition d0 at job version 0, its replica stopped by Nomad
# after its restarts and still holding its place; d1 rolls out with a canary at version 3.
OLD_AND_NEW = (job(definition_hash="d0"), job(definition_hash="d1", Version=3))


def test_retry_never_forces_a_reschedule_of_a_replica_of_an_older_definition() -> None:
    """A forced reschedule would start version 0 (d0) again, at that version: once the
    current definition's canary failed too (Nomad stopped it), the job is registered
    renewed instead, a new version that replaces every allocation, and the canary's
    count is forgiven (it was seen failing)."""
    current = job(definition_hash="d1", Version=3, JobModifyIndex=40)
    plan = retried(
        STORED.model_copy(update={"consecutive_failures": 4}),
        observe(
            failing(version=0),
            failing("a2", version=3, index=0),
            the_job=current,
            versions=(current, OLD_AND_NEW[0]),
        ),
    )
    [register] = plan.effects
    assert isinstance(register, Register) and register.reason is Reason.RETRY
    assert register.job["Meta"][JobMeta.RENEWED] == "40"
    assert register.job["Meta"][JobMeta.DEFINITION_HASH] == "d1"
    assert not any(isinstance(e, Evaluate) for e in plan.effects)
    assert plan.state.consecutive_failures == 0
    assert "as a new job version" in plan.summary


def test_retry_while_the_current_definition_rolls_out_does_nothing() -> None:
    """Issue 19's second QA: `planner retry` 1-4 s after `planner apply` of a failing
    definition d1 (its canary restarting, 2 failures counted), d0's failed replica still
    holding its place: renewing replaced the canary and the count started over, 7 starts
    of d1 between parks. Now nothing is written and nothing forgiven; the rollout
    replaces d0's replica. The same right after the apply, before Nomad's evaluation of
    it completed (no allocation of d1 yet)."""
    current = job(definition_hash="d1", Version=3, JobModifyIndex=40)
    canary = failing("a2", starts=2, version=3, index=0)
    counted = STORED
    seen = observe(failing(version=0), canary, the_job=current, versions=(current, OLD_AND_NEW[0]))
    plan = retried(counted, seen)
    assert plan.effects == () and plan.state == observed(counted, seen).state
    assert plan.state.consecutive_failures == 2
    assert "nothing to retry now" in plan.summary

    def evaluated_at(index: int) -> Plan:
        """The retry with the latest complete evaluation made at JobModifyIndex `index`."""
        evaluation = {"Status": "complete", "JobModifyIndex": index}
        return retried(
            counted,
            observe(
                failing(version=0),
                the_job=current,
                versions=(current, OLD_AND_NEW[0]),
                evaluation=evaluation,
            ),
        )

    early = evaluated_at(31)
    assert early.effects == () and early.state.consecutive_failures == 0
    done = evaluated_at(40)
    assert [type(e) for e in done.effects] == [Register] and done.state.consecutive_failures == 0


def test_retry_of_replicas_of_a_failed_deployment_renews_the_job() -> None:
    """Issue 19's third QA (D3): no planner ran to park it, Nomad stopped the replica and
    failed the deployment; a forced reschedule places nothing for a failed deployment
    (scheduler/reconcile.go), yet retry said "placed again" and forgave the count. It
    renews the job now; with a replica still live it writes nothing and says why."""
    current = job(CreateIndex=5, JobModifyIndex=12)
    failed = (
        {"ID": "d", "JobVersion": 0, "JobCreateIndex": 5, "CreateIndex": 9, "Status": "failed"},
    )
    plan = retried(STORED, observe(failing(), the_job=current, deployments=failed))
    assert plan.state.parked is None  # the park this look found due is not kept
    assert not [n for n in plan.notes if n.text.startswith("parked (")]
    [register] = plan.effects
    assert isinstance(register, Register) and register.job["Meta"][JobMeta.RENEWED] == "12"
    assert plan.state.consecutive_failures == 0
    two = job(count=2, CreateIndex=5, JobModifyIndex=12)
    live = retried(
        STORED,
        observe(
            failing(), alloc("a2", event("Started", 1), index=1), the_job=two, deployments=failed
        ),
    )
    assert live.effects == () and "deployment of job version 0 failed" in live.summary
    assert live.state.consecutive_failures == 5


def test_retry_of_a_replica_nomad_still_restarts_forgives_nothing() -> None:
    restarting = STORED
    seen = observe(failing(starts=2))
    plan = retried(restarting, seen)
    assert plan.effects == () and plan.state == observed(restarting, seen).state
    assert plan.state.consecutive_failures == 2
    assert "nothing to retry" in plan.summary


def test_retry_of_a_parked_job_with_a_replica_of_an_older_definition_renews_it() -> None:
    parked_at = parked_job(job(definition_hash="d1", Version=4), PARKED)
    plan = retried(
        STORED.model_copy(update={"parked": PARKED, "consecutive_failures": 5}),
        observe(
            failing(version=0),
            failing("a2", version=3, index=0),
            the_job=parked_at,
            versions=(parked_at, OLD_AND_NEW[1], OLD_AND_NEW[0]),
        ),
    )
    [unpark] = plan.effects
    assert isinstance(unpark, Unpark) and unpark.renew
    assert plan.state.parked is None and plan.state.consecutive_failures == 0


def test_retry_takes_a_replica_of_a_version_nomad_no_longer_keeps_as_older() -> None:
    """Nomad keeps a job's last 6 versions: a replica of a version it dropped has no
    known definition, and a forced reschedule would place that version again."""
    current = job(definition_hash="d1", Version=9)
    plan = retried(STORED, observe(failing(version=2), the_job=current, versions=(current,)))
    assert [type(e) for e in plan.effects] == [Register]
    same = retried(
        STORED,
        observe(
            failing(version=8),
            the_job=current,
            versions=(current, job(definition_hash="d1", Version=8)),
        ),
    )
    assert [(type(e), getattr(e, "force_reschedule", None)) for e in same.effects] == [
        (Evaluate, True)
    ]


def test_stale_failed_names_only_what_a_forced_reschedule_would_place_again() -> None:
    current = job(definition_hash="d1", Version=3)
    observation = observe(
        failing("old", version=0),  # failed, wanted: placed again at version 0
        failing("gone", version=0, desired="stop"),  # Nomad stopped it: not placed
        failing("next", version=0, NextAllocation="x"),  # replaced already
        alloc("live", event("Started", 1), version=0),  # running: not rescheduled
        failing("mine", version=3),  # the current definition's
        the_job=current,
        versions=OLD_AND_NEW,
    )
    assert stale_failed(observation) == ("old",)
    assert stale_failed(Observation(name="m", record=RECORD, job=None)) == ()


def test_retry_without_a_job_is_refused() -> None:
    with pytest.raises(Rejected, match="planner apply"):
        decide(STORED, Observation(name="m", record=RECORD, job=None), Event.RETRY, RULES, NOW)


# --- ACTIVATE -----------------------------------------------------------------------------


def activated(document: StateDocument, observation: Observation) -> Plan:
    return decide(document, observation, Event.ACTIVATE, RULES, NOW)


def test_activation_answers_without_an_attempt_when_it_can() -> None:
    parked = activated(STORED, observe(the_job=parked_job(job(), PARKED)))
    assert parked.answer is not None and parked.answer.status is ActivationStatus.PARKED
    assert parked.effects == ()
    serving = activated(STORED, observe(alloc("a1", event("Started", 1)), passing={"a1": S}))
    assert serving.answer is not None and serving.answer.status is ActivationStatus.SERVING
    stopped = activated(STORED, observe(the_job=job(stop=True)))
    assert stopped.answer is not None and stopped.answer.status is ActivationStatus.STOPPED
    none = activated(STORED, observe(the_job=job(count=0)))
    assert none.answer is not None and none.answer.status is ActivationStatus.STOPPED
    loading = activated(STORED, observe(alloc("a1", event("Started", 1))))
    assert loading.answer is not None and loading.answer.status is ActivationStatus.LOADING
    assert loading.effects == ()


def test_activation_scales_an_idle_on_demand_model_up() -> None:
    short = STORED.model_copy(update={"unplaceable": Unplaceable(reason="no room")})
    plan = activated(short, observe(the_job=job(count=0), record=ON_DEMAND))
    assert plan.effects == (Scale(Reason.ACTIVATION, "activation", group="server", count=1),)
    assert plan.answer is None and plan.state.unplaceable is None


def test_an_activation_right_after_an_idle_scale_down_scales_up_again() -> None:
    """Found by CI (the idle race): the idle pass wrote count 0; the next activation saw
    the draining replica still passing (or still running, before Nomad's evaluation told
    it to stop) and answered serving or loading, and the replica it asked for went."""
    idle = job(count=0)
    for seen in (
        observe(
            alloc("a1", event("Started", 1)), the_job=idle, record=ON_DEMAND, passing={"a1": S}
        ),
        observe(alloc("a1", event("Started", 1)), the_job=idle, record=ON_DEMAND),
    ):
        plan = activated(STORED, seen)
        assert plan.effects == (Scale(Reason.ACTIVATION, "activation", group="server", count=1),)
        assert plan.answer is None


def test_activation_never_forces_a_reschedule() -> None:
    # A replica Nomad stopped after its restarts beside one still loading, with a
    # standing shortfall: a fresh, non-forced evaluation, never one that starts the
    # stopped replica a 6th time (issue 19).
    two = job(count=2)
    short = STORED.model_copy(update={"unplaceable": Unplaceable(reason="no room")})
    plan = activated(
        short,
        observe(
            failing("a1", 5),
            alloc("a2", event("Started", 1), index=1),
            the_job=two,
            record=RECORD.model_copy(update={"replicas": 2}),
        ),
    )
    assert plan.effects == (
        Evaluate(Reason.ACTIVATION, plan.effects[0].words, force_reschedule=False),
    )
    assert plan.answer is None


def test_activation_parks_at_once_when_nomad_stopped_every_replica() -> None:
    # The 5th failure ended and Nomad gave up; the daemon has not parked yet (the count
    # is 4 in the document, the 5th not seen): parked by construction, not by timing.
    four = observed(STORED, observe(failing(starts=4))).state
    plan = activated(four, observe(failing(starts=5)))
    [park] = plan.effects
    assert isinstance(park, Park) and plan.state.parked == park.parked
    assert any(n.text.startswith("parked (") for n in plan.notes)
    assert plan.answer is not None and plan.answer.status is ActivationStatus.PARKED
    # Even with failures never counted (taken as history while the replica still
    # restarted): parked, not started again.
    restarting = failing(client="running")
    lost = observed(StateDocument(name="m"), observe(restarting, state_index=0)).state
    assert lost.consecutive_failures == 0 and lost.parked is None
    plan = activated(lost, observe(failing()))
    [park] = plan.effects
    assert isinstance(park, Park) and park.reason is Reason.ALL_STOPPED
    assert any(n.text.startswith("parked (every replica stopped") for n in plan.notes)


def test_activation_of_a_model_never_applied_is_refused() -> None:
    with pytest.raises(Rejected, match="never applied"):
        activated(STORED, observe(record=None))


# --- IDLE ---------------------------------------------------------------------------------


def test_idle_scales_an_on_demand_model_to_zero() -> None:
    plan = decide(
        STORED, observe(alloc("a1", event("Started", 1)), record=ON_DEMAND), Event.IDLE, RULES, NOW
    )
    [scale] = plan.effects
    assert isinstance(scale, Scale) and (scale.group, scale.count) == ("server", 0)
    assert decide(STORED, observe(), Event.IDLE, RULES, NOW).effects == ()  # always on
    assert (
        decide(
            STORED, observe(the_job=job(count=0), record=ON_DEMAND), Event.IDLE, RULES, NOW
        ).effects
        == ()
    )


def test_idle_over_an_activation_stuck_on_room_registers_the_count() -> None:
    """An activation that placed 1 of 2 leaves its deployment running until room appears
    (progress_deadline 0), and Nomad refuses a scale while it runs: the idle scale-down
    is a register of the job as read with count 0, which supersedes it."""
    short = Unplaceable(
        reason="1 of 2 replicas placed; memory exhausted on 1 of 1 node", placed=1, desired=2
    )
    stuck = {
        "ID": "dep1",
        "JobCreateIndex": 5,
        "JobVersion": 1,
        "Status": "running",
        "TaskGroups": {"server": {"DesiredCanaries": 0, "DesiredTotal": 2, "PlacedAllocs": 1}},
    }
    seen = observe(
        alloc("a1", event("Started", 1)),
        the_job=job(count=2, CreateIndex=5),
        record=ON_DEMAND,
        deployments=(stuck,),
    )
    short_doc = STORED.model_copy(update={"unplaceable": short})
    [register] = decide(short_doc, seen, Event.IDLE, RULES, NOW).effects
    assert isinstance(register, Register) and register.reason is Reason.IDLE
    assert [tg["Count"] for tg in register.job["TaskGroups"]] == [0]
    # Without a shortfall it is Nomad's to answer (a deployment that progresses).
    [scale] = decide(STORED, seen, Event.IDLE, RULES, NOW).effects
    assert isinstance(scale, Scale) and scale.count == 0


def test_documents_stay_readable_with_records_of_any_kind() -> None:
    seeded = StateDocument(name="m", replicas=(ReplicaRecord(alloc_id="a1"),), counting_from_ns=5)
    assert observed(seeded, observe(alloc("a1", event("Started", 1)))).state.replicas[0].name


def test_the_running_definition_still_parks_while_a_rollback_stands() -> None:
    # Nomad rolled "bad" back to "good"; then the running definition's replica fails five
    # times, nothing serving: it parks (a standing rollback must not hide it).
    v0 = job(definition_hash="good", Version=0, CreateIndex=10)
    v1 = job(definition_hash="bad", Version=1, CreateIndex=10)
    v2 = job(definition_hash="good", Version=2, CreateIndex=10)
    record = RECORD.model_copy(update={"definition_hash": "bad"})
    obs = observe(
        failing("old", 5, version=2),
        the_job=v2,
        versions=(v2, v1, v0),
        record=record,
        deployments=(deployment(0, "successful"), deployment(1, "failed")),
    )
    plan = observed(StateDocument(name="m", definition_hash="bad"), obs)
    assert plan.state.update_failed is not None
    [park] = plan.effects
    assert isinstance(park, Park) and plan.state.definition_hash == "good"


def test_activation_during_a_stuck_update_reverts_and_answers() -> None:
    v1 = job(definition_hash="d1", Version=1, CreateIndex=10)
    v0 = job(definition_hash="d0", Version=0, CreateIndex=10)
    obs = observe(
        alloc("old", event("Started", 1), version=0),
        failing("new", 5, version=1),
        the_job=v1,
        versions=(v1, v0),
        passing={"old": S},
        deployments=(deployment(0, "cancelled"), deployment(1, "failed")),
    )
    plan = activated(STORED, obs)
    assert [type(e) for e in plan.effects] == [Revert]
    assert plan.answer is not None and plan.answer.status is ActivationStatus.SERVING


def test_retry_places_again_a_replica_whose_own_job_is_of_the_current_definition() -> None:
    """Reviewer's finding on issue 22: a scaling model makes a version per scale, so its
    failed replica's version soon is one Nomad dropped; observe reads that allocation's
    own job (`Observation.own_definitions`), and a replica of the current definition is
    placed again (a forced reschedule), not every serving replica replaced (renewed)."""
    current = job(definition_hash="d1", Version=9)
    mine = retried(
        STORED,
        observe(
            failing(version=2),
            alloc("a2", event("Started", 60), version=9, index=1),
            the_job=current,
            versions=(current,),
            own_definitions={"a1": "d1"},
        ),
    )
    assert [(type(e), getattr(e, "force_reschedule", None)) for e in mine.effects] == [
        (Evaluate, True)
    ]
    older = retried(
        STORED,
        observe(
            failing(version=2), the_job=current, versions=(current,), own_definitions={"a1": "d0"}
        ),
    )
    assert [type(e) for e in older.effects] == [Register]


def test_failures_of_a_replica_of_a_dropped_version_count_by_its_own_job() -> None:
    """The same finding, in counting: a replica whose version Nomad no longer keeps was of
    no known definition and its failures counted for none; its own job says which."""
    current = job(definition_hash="d1", Version=9)
    plan = observed(
        STORED,
        observe(failing(version=2), the_job=current, own_definitions={"a1": "d1"}),
    )
    assert [type(e) for e in plan.effects] == [Park]
    older = observed(
        STORED,
        observe(failing(version=2), the_job=current, own_definitions={"a1": "d0"}),
    )
    assert older.effects == () and older.state.consecutive_failures == 0
