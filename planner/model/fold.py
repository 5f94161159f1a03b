"""Fold one fresh observation of a model into its state document (pure).

What every decision but TICK starts from (`planner.model.transition.decide`):

1. **The current definition** is the one in the registered job's meta
   (`JobMeta.DEFINITION_HASH`), not the KV record's: after a partial apply (the
   record written, the job not yet registered) the running definition's failures
   still count (issue 19). With no job, the record's.
2. **Parking** in the document is the job's meta (the durable record,
   `planner.model.parking`), whatever `job_index` the document remembers: with one
   writer per model and the applier's CAS at the observed index, no older answer
   can arrive later, and after a Nomad index reset a lower JobModifyIndex is the
   truth (issue 19). A job without parking meta lifts the document's parking and
   forgives the counts (`failures.retried`).
3. **Rollbacks**: an applied definition Nomad rolled back (`rollout.rolled_back`)
   is recorded in `update_failed`, after counting its replicas' last failures.
4. **Replicas** are tracked from the allocations; a record whose allocation Nomad
   no longer shows is dropped, and the records are bounded by the definition's
   replicas (the job's count, the record's `replicas`), never dropping a live one.
5. **Failures** are counted from Nomad-side facts only: an allocation of the
   current definition (its job version's meta; of a version Nomad no longer
   keeps, its own job's: `Observation.own_definitions`), created in this
   incarnation of the job (CreateIndex >= the job's CreateIndex: a purged and recreated job
   starts over), each failure once (`StateDocument.counted`, pruned to the keys
   whose allocation Nomad still shows). A document that was not stored
   (`observation.state_index == 0`: new, or lost from KV) takes every failure
   Nomad shows now as counted, instead of comparing this machine's clock with
   the nodes' (`counting_from_ns` is no longer read).
6. **Placement**: the latest evaluation's answer (`unplaceable.with_unplaceable`),
   cleared once every wanted replica runs.
7. **Parking** is decided (`failures.decide_parking`), or a stuck update reverted
   (`rollout.stuck_update`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from llmgw_contract import StateDocument, Unplaceable
from planner import engines
from planner.model.effects import Effect, Park, Reason, Revert
from planner.model.failures import (
    AllocInfo,
    Rules,
    StartFailure,
    all_stopped,
    decide_parking,
    headline,
    judge,
    passing,
    retried,
    start_failures,
    track,
    unseen_failures,
)
from planner.model.observation import Observation
from planner.model.parking import parked_from_job
from planner.model.placement import scale_shortfall
from planner.model.rollout import (
    definition_of,
    record_rollback,
    rolled_back,
    rollout_failed,
    stuck_update,
)
from planner.model.unplaceable import with_unplaceable
from planner.spec.jobspec import ENGINE_KIND_META
from planner.vocab import Allocation, Job, group_count

NoteLine = tuple[int, str]  # (logging level, text)


@dataclass(frozen=True)
class Folded:
    state: StateDocument
    effects: tuple[Effect, ...] = ()
    notes: tuple[NoteLine, ...] = ()


def current_definition(observation: Observation) -> str:
    """The definition the job runs (its meta), else the record's; "" with neither."""
    if observation.job is not None:
        return definition_of(observation.job)
    return observation.record.definition_hash if observation.record else ""


def definitions(observation: Observation) -> dict[int, str]:
    """Job version -> the definition hash its meta carries."""
    known = {int(v.get("Version") or 0): definition_of(v) for v in observation.versions}
    if observation.job is not None:
        known[observation.job_version] = definition_of(observation.job)
    return known


def alloc_info(alloc: Allocation, versions: Mapping[int, str], own: str = "") -> AllocInfo:
    """What counting needs of an allocation; an allocation without JobVersion (an event
    stub) has no known definition and never counts. `own`: the definition of the job
    the allocation was placed with (`Observation.own_definitions`), for a version
    Nomad no longer keeps."""
    version = alloc.get("JobVersion")
    return AllocInfo(
        alloc_id=alloc["ID"],
        name=alloc.get("Name", ""),
        node=alloc.get("NodeName") or str(alloc.get("NodeID", ""))[:8],
        definition_hash=versions.get(int(version), own) if version is not None else "",
        client_status=alloc.get("ClientStatus", ""),
        desired_status=alloc.get("DesiredStatus", ""),
        replaced=bool(alloc.get("NextAllocation")),
    )


def infos(observation: Observation) -> dict[str, AllocInfo]:
    versions = definitions(observation)
    own = observation.own_definitions
    return {a["ID"]: alloc_info(a, versions, own.get(a["ID"], "")) for a in observation.allocations}


def error_lines(job: Job | None) -> Callable[[str], str]:
    """The model's engine's reading of its stderr (its job names the kind)."""
    meta: dict[str, Any] = (job or {}).get("Meta") or {}
    kind = meta.get(ENGINE_KIND_META) or engines.DEFAULT_KIND
    return engines.KINDS.get(kind, engines.engine(engines.DEFAULT_KIND)).error_lines


def fold(document: StateDocument, observation: Observation, rules: Rules, now: datetime) -> Folded:
    """The document as `observation` shows the model now, with the effects it calls
    for (at most one: `Park` or `Revert`) and notes. A pruned model (no record) is
    left as it is."""
    record, job = observation.record, observation.job
    if record is None:
        return Folded(document)
    notes: list[NoteLine] = []
    state = _sync_parking(document, job, notes)
    allocs = infos(observation)
    state = _applied(state, record.definition_hash)
    state, rollback = _rollback(state, observation, allocs, rules, now, notes)
    current = current_definition(observation)
    state = _for_definition(state, current)
    if observation.state_index == 0:
        state = _seed(state, observation, allocs, rules)
    for info in allocs.values():
        state = track(state, info)
    state = healthy_runs(state, observation.passing)
    state = _count(state, observation, allocs, current, rules, notes)
    if job is not None:
        state = _prune(state, observation, allocs)
    state = _placement(state, observation, notes)
    effects: tuple[Effect, ...] = ()
    if job is not None and not job.get("Stop"):
        park = _park(state, allocs, observation, rules, now, notes)
        if park is not None:
            state = state.model_copy(update={"parked": park.parked})
            effects = (park,)
        elif not rollback:  # Nomad reverted it itself
            effects = _revert(job, observation)
    return Folded(state, effects, tuple(notes))


def _sync_parking(state: StateDocument, job: Job | None, notes: list[NoteLine]) -> StateDocument:
    if job is None:
        return state
    parked = parked_from_job(job)
    index = int(job.get("JobModifyIndex") or 0)
    if parked is None and state.parked is not None:
        notes.append((logging.INFO, "parking lifted (the job has no parking meta)"))
        state = retried(state)
    return state.model_copy(update={"parked": parked, "job_index": index})


def _applied(state: StateDocument, applied: str) -> StateDocument:
    """A rollback of another definition than the applied one is forgotten (a new apply)."""
    failed = state.update_failed
    if failed is not None and failed.definition_hash != applied:
        return state.model_copy(update={"update_failed": None})
    return state


def _for_definition(state: StateDocument, definition_hash: str) -> StateDocument:
    """A new definition starts every count over and forgets the old replicas."""
    if not definition_hash or state.definition_hash == definition_hash:
        return state
    return state.model_copy(
        update={
            "definition_hash": definition_hash,
            "consecutive_failures": 0,
            "replicas": (),
            "last_error": None,
            "last_error_at": None,
        }
    )


def _rollback(
    state: StateDocument,
    observation: Observation,
    allocs: Mapping[str, AllocInfo],
    rules: Rules,
    now: datetime,
    notes: list[NoteLine],
) -> tuple[StateDocument, bool]:
    """Record an applied definition Nomad rolled back; True when it was rolled back."""
    record, job = observation.record, observation.job
    if record is None or job is None:
        return state, False
    failed = rolled_back(
        list(observation.versions), list(observation.deployments), record.definition_hash
    )
    if failed is None:
        return state, False
    known = state.update_failed
    if known is not None and (known.definition_hash, known.job_version) == (
        failed.definition_hash,
        failed.job_version,
    ):
        return state, True
    # Its replicas' last failures first: Nomad may fail the deployment before the last
    # failed start was seen (found by test: rolled back at 4 of 5).
    state = _for_definition(state, failed.definition_hash)
    state = _count(state, observation, allocs, failed.definition_hash, rules, [])
    running = definition_of(job)
    after = record_rollback(state, failed, running, now)
    notes.append(
        (
            logging.ERROR,
            f"update to definition {failed.definition_hash[:12]} rolled "
            f"back ({failed.reason}); it serves on {running[:12]}; last error: "
            f"{headline(state.last_error)}",
        )
    )
    return after, True


def _incarnation(alloc: Allocation, job: Job | None) -> bool:
    """The allocation belongs to this incarnation of the job (a purged and recreated job
    starts over; Nomad's indexes, not clocks)."""
    if "CreateIndex" not in alloc:
        return True  # nothing says otherwise (Nomad's listings always carry it)
    return int(alloc["CreateIndex"] or 0) >= int((job or {}).get("CreateIndex") or 0)


def _failures(
    observation: Observation,
    allocs: Mapping[str, AllocInfo],
    definition: str,
    counted: tuple[str, ...] = (),
    stable_after_ns: int = 0,
) -> list[StartFailure]:
    """Every failure of an allocation of `definition` in this incarnation, oldest first:
    those its events show, and those Nomad no longer shows (`unseen_failures`, against
    the keys `counted`)."""
    found = [
        f
        for alloc in observation.allocations
        if allocs[alloc["ID"]].definition_hash == definition
        and _incarnation(alloc, observation.job)
        for f in (*unseen_failures(alloc, counted, stable_after_ns), *start_failures(alloc))
    ]
    return sorted(found, key=lambda f: (f.at_ns, f.key))


def _seed(
    state: StateDocument, observation: Observation, allocs: Mapping[str, AllocInfo], rules: Rules
) -> StateDocument:
    """A document not stored (new, or lost from KV): what Nomad shows failed already is
    history, taken as counted, and so are the failures it no longer shows; the replicas
    passing now start their healthy runs.

    Except when Nomad already gave up on the current definition (`all_stopped`): then
    nothing will fail again to be counted, and taking its failures as history left the
    model `failing` with 0 counted for good, never parked (issue 19's fourth QA: Consul
    restarted, or `llmgw/` deleted, between a replica's 4th and 5th failed start). Those
    replicas' failures are counted instead; none of them can have been forgiven, since a
    retry that forgives places the failed replica again (`planner.model.retry`)."""
    given_up = _given_up(state, observation, allocs)
    keys = tuple(
        f.key
        for alloc in observation.allocations
        if alloc["ID"] not in given_up
        for f in (*start_failures(alloc), *unseen_failures(alloc, (), rules.stable_after_ns))
    )
    return state.model_copy(update={"counted": tuple(dict.fromkeys((*state.counted, *keys)))})


def _given_up(
    state: StateDocument, observation: Observation, allocs: Mapping[str, AllocInfo]
) -> frozenset[str]:
    """The failed replicas of the current definition Nomad placed nothing after, when
    Nomad stopped every replica of it (`all_stopped`); empty otherwise."""
    if not all_stopped(state, allocs.values(), _rollout_failed(observation)):
        return frozenset()
    return frozenset(
        a.alloc_id
        for a in allocs.values()
        if a.definition_hash == state.definition_hash
        and not a.replaced
        and a.client_status == "failed"
    )


def healthy_runs(state: StateDocument, passing_since: Mapping[str, int]) -> StateDocument:
    """Each replica passing now has a healthy run that began at its `since`."""
    for alloc_id, since in sorted(passing_since.items()):
        state = passing(state, alloc_id, since)
    return state


def _count(
    state: StateDocument,
    observation: Observation,
    allocs: Mapping[str, AllocInfo],
    definition: str,
    rules: Rules,
    notes: list[NoteLine],
) -> StateDocument:
    lines = error_lines(observation.job)
    for failure in _failures(observation, allocs, definition, state.counted, rules.stable_after_ns):
        if failure.key in state.counted:
            continue
        before = state.consecutive_failures
        state = judge(state, failure, observation.stderr.get(failure.key, ""), rules, lines)
        if state.consecutive_failures > before:
            replica = state.replica(failure.alloc_id)
            info = allocs[failure.alloc_id]
            notes.append(
                (
                    logging.WARNING,
                    # Nomad's name of the allocation, whatever the record holds: a
                    # record `judge` made has none (issue 19's second QA: the log
                    # switched from server[0] to the allocation ID mid-run).
                    f"replica {info.name.partition('.')[2] or info.alloc_id[:8]} on "
                    f"{info.node}: "
                    f"start failure {replica.consecutive_failures if replica else 0} in "
                    f"a row (model: {state.consecutive_failures}): "
                    f"{headline(state.last_error)}",
                )
            )
    return state


def _prune(
    state: StateDocument, observation: Observation, allocs: Mapping[str, AllocInfo]
) -> StateDocument:
    """Keep what Nomad still shows: counted keys of allocations it lists (a key of a
    garbage-collected allocation can never be seen again), and replica records of
    allocations it lists, bounded by the definition's replicas; live ones never go."""
    counted = tuple(k for k in state.counted if k.partition("/")[0] in allocs)
    created = {a["ID"]: int(a.get("CreateIndex") or 0) for a in observation.allocations}
    shown = [r for r in state.replicas if r.alloc_id in allocs]
    live = [r for r in shown if allocs[r.alloc_id].live]
    rest = sorted(
        (r for r in shown if not allocs[r.alloc_id].live),
        key=lambda r: created.get(r.alloc_id, 0),
        reverse=True,
    )
    bound = max(
        group_count(observation.job), observation.record.replicas if observation.record else 0, 1
    )
    keep = {r.alloc_id for r in (*live, *rest[: max(bound - len(live), 0)])}
    replicas = tuple(r for r in state.replicas if r.alloc_id in keep)
    return state.model_copy(update={"counted": counted, "replicas": replicas})


def all_running(observation: Observation) -> bool:
    """Every replica the job wants runs."""
    count = group_count(observation.job)
    running = [
        a
        for a in observation.allocations
        if a.get("ClientStatus") == "running" and a.get("DesiredStatus") == "run"
    ]
    return count > 0 and len(running) >= count


def _placement(
    state: StateDocument, observation: Observation, notes: list[NoteLine]
) -> StateDocument:
    before = state.unplaceable
    if observation.evaluation is not None:
        state = with_unplaceable(state, observation.placement)
    if state.unplaceable is not None and all_running(observation):
        state = state.model_copy(update={"unplaceable": None})
    if before is not None and state.unplaceable is None:
        notes.append((logging.INFO, _shortfall_ended(before, observation)))
    elif (
        state.unplaceable is not None
        and state.unplaceable.stands
        # Told once: a shortfall that stood while Nomad looked again is not news.
        and (before is None or not before.stands or before.reason != state.unplaceable.reason)
    ):
        notes.append((logging.WARNING, _unplaced_words(state.unplaceable, observation)))
    return state


def _shortfall_ended(before: Unplaceable, observation: Observation) -> str:
    """The log's words when a shortfall ends: placed, or no longer asked for (a
    scale-down to what was placed read "placed (was short ...)": issue 22's fourth QA)."""
    was = _unplaced_words(before, observation)
    count = group_count(observation.job)
    if before.desired and count <= before.placed:
        return f"no longer short: the job asks for {count} (was {was})"
    return f"placed (was {was})"


def _unplaced_words(short: Unplaceable, observation: Observation) -> str:
    """The log's words for a placement answer: a scaling model with replicas placed is
    short of a scale-up, not unplaceable (issue 22: it serves what it has)."""
    record = observation.record
    if record is not None and record.scaling is not None and short.placed > 0:
        words = f"short of a scale-up: {scale_shortfall(short.reason, short.placed, short.desired)}"
    else:
        words = f"unplaceable: {short.reason}"
    # Room words of an answer told for the first time, or ended before it stood.
    return f"{words}; {short.waiting}" if short.waiting and not short.stands else words


def _park(
    state: StateDocument,
    allocs: Mapping[str, AllocInfo],
    observation: Observation,
    rules: Rules,
    now: datetime,
    notes: list[NoteLine],
) -> Park | None:
    passing_now = frozenset(observation.passing)
    decided = decide_parking(state, allocs, passing_now, now, rules, _rollout_failed(observation))
    if decided.parked is None:
        if state.parked is None and state.consecutive_failures >= rules.park_after:
            notes.append(
                (
                    logging.WARNING,
                    f"{state.consecutive_failures} consecutive start "
                    "failures, not parked: a healthy replica serves (degraded)",
                )
            )
        return None
    reason = (
        Reason.START_FAILURES
        if decided.consecutive_failures >= rules.park_after
        else Reason.ALL_STOPPED
    )
    notes.append(
        (
            logging.ERROR,
            f"parked ({decided.parked.reason}); last error: {headline(state.last_error)}",
        )
    )
    return Park(reason, decided.parked.reason, parked=decided.parked)


def _revert(job: Job, observation: Observation) -> tuple[Effect, ...]:
    """Do what auto_revert could not: roll a failed update back to the version whose
    replicas serve (`rollout.stuck_update`)."""
    version = stuck_update(
        job,
        list(observation.deployments),
        list(observation.allocations),
        frozenset(observation.passing),
    )
    if version is None:
        return ()
    return (
        Revert(
            Reason.UPDATE_STUCK,
            f"its update failed and Nomad had no stable version "
            f"to roll back to; reverting to version {version}, which serves",
            version=version,
            prior_version=observation.job_version,
        ),
    )


def stopped_by_nomad(state: StateDocument, observation: Observation) -> bool:
    """Nothing of the current definition will start again by itself: Nomad stopped
    every replica of it after its restart attempts, or failed its rollout
    (`failures.all_stopped`)."""
    return all_stopped(state, infos(observation).values(), _rollout_failed(observation))


def _rollout_failed(observation: Observation) -> bool:
    job = observation.job
    return job is not None and rollout_failed(job, list(observation.deployments))
