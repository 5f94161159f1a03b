"""`observe`: one model's state from what Nomad, Consul and the planner's document say."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from llmgw_contract import (
    ModelRecord,
    ModelState,
    Parked,
    ReplicaRecord,
    ScalingBounds,
    StateDocument,
    Unplaceable,
    UsageRecord,
)
from planner.agents.consul import ServiceHealth
from planner.model.status import Observed, ReplicaState, observe
from tests.support.nomad_mock import alloc, job

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
RECORD = ModelRecord(name="m", definition_hash="d1", replicas=2)
ON_DEMAND = ModelRecord(name="m", definition_hash="d1", replicas=1, on_demand={"idle_after": 60})


def health(*passing: str) -> ServiceHealth:
    return ServiceHealth(
        total=len(passing), passing=len(passing), passing_allocs=frozenset(passing)
    )


def doc(*replicas: ReplicaRecord, **fields: object) -> StateDocument:
    return StateDocument(name="m", definition_hash="d1", replicas=replicas, **fields)


def replica(
    alloc_id: str, failures: int = 0, stable: int = 0, node: str = "node-a", index: int = 0
) -> ReplicaRecord:
    return ReplicaRecord(
        alloc_id=alloc_id,
        name=f"m.server[{index}]",
        node=node,
        definition_hash="d1",
        consecutive_failures=failures,
        last_error="Terminated: Exit Code: 1" if failures else None,
        healthy_entries=(stable,) if stable else (),
        stable_entry=stable,
    )


def see(
    allocs: list[dict],
    passing: ServiceHealth,
    state: StateDocument | None = None,
    record: ModelRecord = RECORD,
    count: int = 2,
    **job_fields: object,
):
    return observe(
        "m", record, Observed(job(count=count, **job_fields), allocs, passing), state, now=T0
    )


A = alloc("a1", index=0)
B = alloc("b1", index=1, node="node-b")


def test_serving_and_loading() -> None:
    assert see([A, B], health("a1", "b1")).state == ModelState.SERVING
    loading = see([A, B], health("a1"))
    assert (loading.state, loading.reason) == (ModelState.LOADING, "1 of 2 ready")


def test_one_replica_failing_beside_a_healthy_one_is_degraded_naming_it() -> None:
    stopped = alloc("b1", index=1, node="node-b", client="failed")
    status = see(
        [A, stopped],
        health("a1"),
        doc(
            replica("a1"), replica("b1", failures=5, node="node-b", index=1), consecutive_failures=5
        ),
    )
    assert status.state == ModelState.DEGRADED
    assert "server[1] on node-b: 5 consecutive failures, stopped by Nomad" in status.reason
    assert status.last_error == "Terminated: Exit Code: 1"
    [_, bad] = status.replicas
    assert (bad.state, bad.node, bad.consecutive_failures) == (ReplicaState.STOPPED, "node-b", 5)
    assert not status.satisfied


def test_a_replica_that_passes_between_crashes_is_failing_never_serving() -> None:
    one = ModelRecord(name="m", definition_hash="d1", replicas=1)
    status = see(
        [A],
        health("a1"),
        doc(replica("a1", failures=2), consecutive_failures=2),
        record=one,
        count=1,
    )
    assert status.state == ModelState.FAILING
    forgiven = see([A], health("a1"), doc(replica("a1", failures=0, stable=5)), record=one, count=1)
    assert forgiven.state == ModelState.SERVING and forgiven.replicas[0].stable


def test_failing_with_nothing_ready() -> None:
    status = see(
        [A, B], health(), doc(replica("a1", failures=3), consecutive_failures=3, last_error="boom")
    )
    assert (status.state, status.last_error) == (ModelState.FAILING, "boom")
    assert "3 consecutive start failures" in status.reason


def test_partly_placed_keeps_its_reason() -> None:
    short = Unplaceable(
        reason="1 of 2 replicas placed; memory exhausted on 1 of 1 node", placed=1, desired=2
    )
    status = see([A], health("a1"), doc(replica("a1"), unplaceable=short))
    assert status.state == ModelState.DEGRADED and short.reason in status.reason
    none = see([], health(), doc(unplaceable=short.model_copy(update={"placed": 0})))
    assert none.state == ModelState.UNPLACEABLE
    # A replica placed (its allocation not read yet) is loading, never unplaceable.
    placed = see([], health(), doc(unplaceable=short))
    assert placed.state == ModelState.LOADING and placed.reason == short.reason


def test_a_scale_up_that_fits_nowhere_keeps_serving_and_says_so() -> None:
    """Issue 22, "capacity is honest": load-based scaling asked for 3, 2 were placed; the
    model serves what it has (never unplaceable, never degraded for want of room)."""
    short = Unplaceable(
        reason="2 of 3 replicas placed; memory exhausted on 2 of 2 nodes", placed=2, desired=3
    )
    scaling = RECORD.model_copy(update={"scaling": ScalingBounds(min=1, max=4, target=2)})
    status = see([A, B], health("a1", "b1"), doc(unplaceable=short), record=scaling, count=3)
    assert status.state == ModelState.SERVING
    assert status.reason == "2 ready; wants 3, 2 placed: memory exhausted on 2 of 2 nodes"
    assert status.scaling is not None
    assert (status.scaling["min"], status.scaling["desired"], status.scaling["max"]) == (1, 3, 4)
    assert status.scaling["shortfall"] == "wants 3, 2 placed: memory exhausted on 2 of 2 nodes"
    # Room being made is not a shortfall, and none is none.
    room = short.model_copy(update={"provisional": True})
    making = see([A, B], health("a1", "b1"), doc(unplaceable=room), record=scaling, count=3)
    assert making.scaling is not None and making.scaling["shortfall"] == ""
    # Unless it follows a told shortfall: that stands, first, while Nomad looks again.
    waits = "waiting for room: 1 allocation(s) stopping or stopped on n1"
    standing = room.model_copy(update={"standing": True, "waiting": waits})
    stands = see([A, B], health("a1", "b1"), doc(unplaceable=standing), record=scaling, count=3)
    assert (stands.state, stands.reason) == (ModelState.SERVING, f"{status.reason}; {waits}")
    assert stands.scaling is not None
    assert stands.scaling["shortfall"] == status.scaling["shortfall"]
    placed = see([A, B], health("a1", "b1"), doc(), record=scaling, count=2)
    assert placed.scaling is not None and placed.scaling["shortfall"] == ""
    # Below its floor it is short of what it must have: degraded, as a fixed model.
    floor = scaling.model_copy(update={"scaling": ScalingBounds(min=3, max=4, target=2)})
    below = see([A, B], health("a1", "b1"), doc(unplaceable=short), record=floor, count=3)
    assert below.state == ModelState.DEGRADED


def test_room_being_made_is_loading_not_unplaceable() -> None:
    room = Unplaceable(reason="waiting for room: 1 allocation(s) stopping", provisional=True)
    status = see([], health(), doc(unplaceable=room))
    assert (status.state, status.reason) == (ModelState.LOADING, room.reason)
    # Room being made after a told shortfall: it stands, room words after it.
    short = Unplaceable(reason="memory exhausted", since="2026-11-30T11:00:00")
    standing = short.model_copy(
        update={"provisional": True, "standing": True, "waiting": "waiting for room: 1 ..."}
    )
    stands = see([], health(), doc(unplaceable=standing))
    assert (stands.state, stands.reason, stands.since) == (
        ModelState.UNPLACEABLE,
        "memory exhausted; waiting for room: 1 ...",
        short.since,
    )


def test_parked_is_read_from_the_job_meta_first() -> None:
    meta = {
        "llmgw_parked_reason": "5 consecutive start failures",
        "llmgw_parked_last_error": "kev",
        "llmgw_parked_since": "2026-11-29T12:00:00+00:00",
    }
    status = see([], health(), None, stop=True, meta=meta)
    assert (status.state, status.last_error) == (ModelState.PARKED, "kev")
    # A KV copy that lags behind a running job is not believed.
    stale = doc(parked=Parked(reason="old"))
    assert see([A, B], health("a1", "b1"), stale).state == ModelState.SERVING


def test_wants_none() -> None:
    assert see([], health(), count=0).state == ModelState.IDLE
    stopped = observe("m", RECORD, Observed(None, [], health()), now=T0)
    assert (stopped.state, stopped.reason) == (ModelState.STOPPED, "job not registered")
    idle = see([], health(), record=ON_DEMAND, count=0)
    assert idle.state == ModelState.IDLE and idle.satisfied
    asked = observe(
        "m",
        ON_DEMAND,
        Observed(job(count=0), [], health()),
        None,
        UsageRecord(last_used_at=(T0 - timedelta(seconds=3)).isoformat()),
        T0,
    )
    assert (asked.state, asked.reason) == (ModelState.LOADING, "asked for 3 s ago; no instance yet")


def test_a_scale_up_under_way_serves_and_satisfies_status() -> None:
    """Issue 22's QA: while load-based scaling adds replicas (1 of 3 ready, the others
    starting), the model showed `loading` and `planner status` exited 1, failing a
    pipeline because load rose. At or over its floor it serves; below it, it loads."""
    scaling = RECORD.model_copy(update={"scaling": ScalingBounds(min=1, max=4, target=2)})
    up = see([A, B], health("a1"), doc(), record=scaling, count=3)
    assert (up.state, up.reason) == (ModelState.SERVING, "1 of 3 ready; scaling up")
    assert up.satisfied
    floor = scaling.model_copy(update={"scaling": ScalingBounds(min=2, max=4, target=2)})
    below = see([A, B], health("a1"), doc(), record=floor, count=3)
    assert below.state == ModelState.LOADING
    fixed = see([A, B], health("a1"), doc(), count=3)
    assert fixed.state == ModelState.LOADING


def test_a_scale_up_waiting_for_room_says_so() -> None:
    """Issue 22's fourth QA: while another model's allocation stopped, a scale-up short of
    memory showed "1 of 2 ready; scaling up" and nothing of the room it waited for."""
    scaling = RECORD.model_copy(update={"scaling": ScalingBounds(min=1, max=2, target=1)})
    room = Unplaceable(
        reason="1 of 2 replicas placed; memory exhausted on 1 of 1 node",
        waiting="waiting for room: 1 allocation(s) stopping or stopped on n1",
        placed=1,
        desired=2,
        provisional=True,
    )
    up = see([A], health("a1"), doc(unplaceable=room), record=scaling, count=2)
    assert (up.state, up.reason) == (ModelState.SERVING, f"1 of 2 ready; scaling up; {room.told}")
