"""Whether a shortfall waits for room being made (planner.model.unplaceable), and the
activation's answer from it (planner.daemon.activation)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

from llmgw_contract import (
    ROOM_IDS_KEPT,
    ActivationStatus,
    ModelRecord,
    StateDocument,
    Unplaceable,
    routing_of,
)
from planner.daemon.activation import activation_answer, unanswered
from planner.daemon.placement_answer import answer
from planner.model.failures import Rules
from planner.model.observation import Observation
from planner.model.transition import Event
from planner.model.transition import decide as transition
from planner.model.unplaceable import ROOM_WAIT_MAX_S, settled_shortfall, with_unplaceable
from tests.support.nomad_mock import job as nomad_job

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
RULES = Rules(park_after=5, stable_after_ns=120 * 10**9)
STOPPING = [{"ID": "a1", "NodeName": "node-a", "DesiredStatus": "stop", "ClientStatus": "running"}]


class Nomad:
    """Only the reads `answer` makes; an allocation is stopping on node-a."""

    def stopping_allocations(self, since_index: int = 0) -> list[dict[str, Any]]:
        return STOPPING

    def nodes(self) -> list[dict[str, Any]]:
        return [
            {
                "ID": "n1",
                "Name": "node-a",
                "Datacenter": "dc1",
                "Status": "ready",
                "NodeResources": {"Devices": []},
            }
        ]


def evaluation(**metric: Any) -> dict[str, Any]:
    return {
        "ID": "e1",
        "SnapshotIndex": 10,
        "FailedTGAllocs": {"server": {"NodesEvaluated": 1, **metric}},
    }


def record(**profile: Any) -> ModelRecord:
    return ModelRecord(
        name="m", definition_hash="d", replicas=1, profile={"memory": 2**30, **profile}
    )


def test_exhausted_memory_waits_for_the_allocation_that_stops() -> None:
    found = answer(
        Nomad(),
        record(),
        None,
        evaluation(NodesExhausted=1, DimensionExhausted={"memory": 1}),
        ("*",),
        NOW,
    )
    assert found is not None and found.provisional and not found.standing
    assert found.reason == "memory exhausted on 1 of 1 node"
    assert found.waiting == (
        "waiting for room: 1 allocation(s) stopping or stopped on node-a; "
        "Nomad places it again when they end"
    )
    assert found.told == f"{found.waiting} ({found.reason})"
    assert found.room == ("a1",)


def test_a_node_filtered_out_never_waits_for_room() -> None:
    found = answer(
        Nomad(),
        record(gpus=1),
        None,
        evaluation(NodesFiltered=1, ConstraintFiltered={"missing devices": 1}),
        ("*",),
        NOW,
    )
    assert found is not None and not found.provisional
    assert found.waiting == "" and found.told == found.reason


def test_an_activation_placed_in_part_is_loading_never_unplaceable() -> None:
    """Nomad placed 1 of 2: the one placed starts and will serve, so the activation
    answers "loading" with what is short; placing none is refused with the reason."""
    part = Unplaceable(
        reason="1 of 2 replicas placed; memory exhausted on 1 of 1 node",
        since="2026-11-30T12:00:00+00:00",
        placed=1,
        desired=2,
    )
    answered = activation_answer("m", part, "e1")
    assert answered.status == ActivationStatus.LOADING
    assert answered.reason == (
        "the replicas placed are starting; wants 2, 1 placed: memory exhausted on 1 of 1 node"
    )
    assert (answered.since, answered.eval_id) == (part.since, "e1")
    none = activation_answer("m", part.model_copy(update={"placed": 0}), "e2")
    assert none.status == ActivationStatus.UNPLACEABLE and none.reason == part.reason
    room = activation_answer("m", part.model_copy(update={"provisional": True}), "e3")
    assert room.status == ActivationStatus.LOADING
    assert activation_answer("m", None, "e4").status == ActivationStatus.LOADING


def test_the_placement_answer_of_a_part_placed_job_counts_what_was_placed() -> None:
    """A job asking for 2 whose evaluation left 1 unplaced: placed 1 of 2, settled when
    nothing is stopping (the answer the activation and the state document carry)."""

    class Settled(Nomad):
        def stopping_allocations(self, since_index: int = 0) -> list[dict[str, Any]]:
            return []

    job = {"TaskGroups": [{"Name": "server", "Count": 2}]}
    found = answer(
        Settled(),
        record(),
        job,
        evaluation(NodesExhausted=1, DimensionExhausted={"memory": 1}),
        ("*",),
        NOW,
    )
    assert found is not None and not found.provisional
    assert (found.placed, found.desired, found.refuses) == (1, 2, False)
    assert found.reason.startswith("1 of 2 replicas placed; ")


def test_a_told_shortfall_stands_while_nomad_looks_again_at_room_being_made() -> None:
    """Found by CI: a scale-up told "wants 3, 2 placed: memory exhausted" turned "waiting
    for room" for seconds whenever any allocation ended on the full node (Nomad re-runs
    the blocked evaluation): the unplaced metrics fell to 0, resetting an alert's `for`,
    `since` restarted and the log warned again. A provisional answer that follows a
    settled one stands: still told, `since` kept; one with nothing settled before is
    provisional alone."""
    settled = Unplaceable(
        reason="2 of 3 replicas placed; memory exhausted on 1 of 1 node",
        since="2026-11-30T12:00:00+00:00",
        placed=2,
        desired=3,
    )
    later = "2026-11-30T12:07:00+00:00"
    room = settled.model_copy(
        update={"since": later, "provisional": True, "waiting": "waiting for room: 1 ..."}
    )
    first = with_unplaceable(StateDocument(name="m"), settled)
    looking = with_unplaceable(first, room)
    assert looking.unplaceable is not None and looking.unplaceable.standing
    assert (looking.unplaceable.since, settled_shortfall(looking)) == (
        settled.since,
        looking.unplaceable,
    )
    assert not looking.unplaceable.refuses  # the router waits for what Nomad may place
    # Still looking: it stands; settled again: told as one shortfall since the first.
    again = with_unplaceable(looking, room)
    assert again.unplaceable is not None and again.unplaceable.standing
    back = with_unplaceable(again, settled.model_copy(update={"since": later}))
    assert back.unplaceable == settled
    # Room being made before any settled answer is provisional alone; so it is after
    # the shortfall ended (placed).
    fresh = with_unplaceable(StateDocument(name="m"), room)
    assert fresh.unplaceable is not None and not fresh.unplaceable.standing
    assert settled_shortfall(fresh) is None
    ended = with_unplaceable(with_unplaceable(first, None), room)
    assert settled_shortfall(ended) is None


def test_a_shortfall_the_room_it_waited_for_did_not_end_stands() -> None:
    """Found in an audit: on a cluster where some allocation is always stopping, a new
    shortfall was provisional at every look (each answer waited for the next room), so
    never in status, metrics or alerts. An answer waits for the allocations it first
    waited for while any of them is still stopping; once all have ended and Nomad still
    answers short, the shortfall stands (told, `since` kept), though the router still
    waits for the room that is coming."""
    short = Unplaceable(
        reason="memory exhausted on 1 of 1 node",
        since="2026-11-30T12:00:00+00:00",
        provisional=True,
        waiting="waiting for room: 1 ...",
        room=("a1",),
    )
    first = with_unplaceable(StateDocument(name="m"), short)
    assert settled_shortfall(first) is None
    # a1 still stopping, b1 too: still waiting for a1's room.
    both = short.model_copy(update={"since": "2026-11-30T12:00:05+00:00", "room": ("a1", "b1")})
    waiting = with_unplaceable(first, both)
    assert waiting.unplaceable is not None and not waiting.unplaceable.standing
    assert (waiting.unplaceable.room, settled_shortfall(waiting)) == (("a1",), None)
    # a1 ended, Nomad looked at its room and the model is still short: it stands.
    later = short.model_copy(update={"since": "2026-11-30T12:00:10+00:00", "room": ("b1",)})
    told = with_unplaceable(waiting, later)
    assert told.unplaceable is not None and told.unplaceable.standing
    assert (settled_shortfall(told), told.unplaceable.since) == (told.unplaceable, short.since)
    assert not told.unplaceable.refuses
    assert told.unplaceable.room == ()  # told: nothing to wait for, nothing to rewrite
    # And stays told while other room comes and goes.
    again = with_unplaceable(told, later.model_copy(update={"room": ("c1",)}))
    assert again.unplaceable is not None and again.unplaceable.standing
    assert routing_of(again).unplaceable == again.unplaceable  # room is not the router's
    # A stop that never ends is no room being made: past ROOM_WAIT_MAX_S it stands.
    hung = short.model_copy(update={"since": "2026-11-30T12:11:01+00:00"})
    assert ROOM_WAIT_MAX_S <= 660
    stuck = with_unplaceable(first, hung)
    assert stuck.unplaceable is not None and stuck.unplaceable.standing
    # Waiting for an engine's install is not room: it never stands by this rule.
    engine = short.model_copy(update={"room": (), "waiting": "waiting for engine ..."})
    installing = with_unplaceable(with_unplaceable(StateDocument(name="m"), engine), engine)
    assert settled_shortfall(installing) is None


def test_the_room_awaited_is_found_in_the_whole_list_of_what_stops() -> None:
    """Found in review: each answer's room was the first 16 IDs of what stopped, so 16
    allocations with lower IDs that started stopping pushed out the one still awaited,
    and the shortfall stood while its room was still coming."""
    awaited = "ffff-awaited"
    many = [
        {"ID": f"{i:04x}", "NodeName": "node-a", "DesiredStatus": "stop", "ClientStatus": "running"}
        for i in range(20)
    ] + [{"ID": awaited, "NodeName": "node-a", "DesiredStatus": "stop", "ClientStatus": "running"}]

    class Busy(Nomad):
        def stopping_allocations(self, since_index: int = 0) -> list[dict[str, Any]]:
            return many

    exhausted = evaluation(NodesExhausted=1, DimensionExhausted={"memory": 1})
    fresh = answer(Busy(), record(), None, exhausted, ("*",), NOW)
    assert fresh is not None and fresh.room == tuple(f"{i:04x}" for i in range(16))
    found = answer(Busy(), record(), None, exhausted, ("*",), NOW, (awaited, "gone"))
    assert found is not None and found.room == (awaited,)
    before = StateDocument(
        name="m", unplaceable=found.model_copy(update={"room": (awaited, "gone")})
    )
    still = with_unplaceable(before, found)
    assert still.unplaceable is not None and not still.unplaceable.stands
    # A document's longer list is cut, never a reason to reject the document.
    long = Unplaceable.model_validate({"reason": "r", "room": [str(i) for i in range(40)]})
    assert len(long.room) == ROOM_IDS_KEPT


def test_an_activation_asks_again_without_ending_a_told_shortfall() -> None:
    """Found in review: an activation (a request for a model with no replica passing)
    cleared the document's answer before its fresh placement attempt, so the next answer,
    the same shortfall, restarted `since`, dropped the unplaced series to 0 and was
    logged again, at every activation. It stays told (provisional: the router waits for
    the new answer rather than refusing on the last) until Nomad answers."""
    settled = Unplaceable(reason="memory exhausted on 1 of 1 node", since="2026-11-30T11:00:00")
    fixed = ModelRecord(name="m", definition_hash="d1", replicas=1, profile={})
    the_job = nomad_job(count=1, CreateIndex=5)
    observation = Observation(
        name="m", record=fixed, job=the_job, versions=(the_job,), state_index=7
    )
    document = StateDocument(name="m", definition_hash="d1", unplaceable=settled)
    asked = transition(document, observation, Event.ACTIVATE, RULES, NOW)
    assert [type(e).__name__ for e in asked.effects] == ["Evaluate"]
    kept = asked.state.unplaceable
    assert kept is not None and (kept.provisional, kept.standing) == (True, True)
    assert (kept.reason, kept.since, kept.refuses) == (settled.reason, settled.since, False)
    assert settled_shortfall(asked.state) == kept
    # The attempt's answer, the same shortfall: one shortfall since the first, not news.
    answered = dataclasses.replace(
        observation, evaluation={"ID": "e2"}, placement=settled.model_copy(update={"since": ""})
    )
    after = transition(asked.state, answered, Event.OBSERVED, RULES, NOW)
    assert after.state.unplaceable == settled and after.notes == ()


def test_an_attempt_the_scheduler_did_not_answer_is_never_placed() -> None:
    """Found in review: a fresh attempt's evaluation that failed (or was cancelled) has
    no FailedTGAllocs and was answered "placed; the server is starting". A shortfall told
    before it answers as it stood (an unplaceable model is refused at once); else, and
    while the evaluation is still pending, "loading" with the evaluation's status."""
    told = Unplaceable(reason="memory exhausted on 1 of 1 node", since="2026-11-30T11:00:00")
    kept = told.model_copy(update={"provisional": True, "standing": True, "waiting": "w"})
    failed = {"ID": "e2345678", "Status": "failed"}
    refused = unanswered("m", failed, kept)
    assert (refused.status, refused.reason, refused.since) == (
        ActivationStatus.UNPLACEABLE,
        told.reason,
        told.since,
    )
    fresh = unanswered("m", failed, None)
    assert (fresh.status, fresh.reason) == (
        ActivationStatus.LOADING,
        "the scheduler's evaluation e2345678 ended failed; the planner looks again",
    )
    pending = unanswered("m", {"ID": "e2345678", "Status": "pending"}, kept)
    assert pending.status == ActivationStatus.LOADING and "is still pending" in pending.reason
