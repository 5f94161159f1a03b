"""A model's placement answer from one evaluation: placed, short (why), or waiting for room.

The pure half: what a job needs (GPUs, an engine), whether room can help, and
the document's placement answer. `planner.daemon.placement_answer` reads what only
Nomad knows now and makes the answer from one evaluation.

Room being made is not "no room" (issue "Model state done right", item 9):
when some node lacked free resources and an allocation the scheduler told to
stop still runs, the resources it
holds are about to be freed, and Nomad's blocked evaluation for the model
runs again when it ends. The same holds for one that ended after the
scheduler took the snapshot it decided on (the evaluation's SnapshotIndex):
Nomad notices that missed unblock and runs the blocked evaluation again at
once (nomad/blocked_evals.go, missedUnblock). A shortfall seen in either case
is `provisional`: the router keeps a request waiting instead of refusing it on
an answer that is already stale or seconds from being so.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from llmgw_contract import ModelRecord, StateDocument, Unplaceable
from planner.model.placement import (
    ENGINE_META_PREFIX,
    EngineNeed,
    GpuNeed,
)
from planner.spec.definitions import MAX_SHUTDOWN_DELAY_S
from planner.vocab import Job

# The longest an allocation may take to stop: the longest drain a definition may ask for
# (shutdown_delay) and Nomad's client cap on kill_timeout (max_kill_timeout, 30 s by
# default), with as much again to spare. A shortfall still waiting for the room it first
# waited for after this stands: a stop that never ends (a hung driver, a node that keeps
# reporting a killed task running) is no room being made.
ROOM_WAIT_MAX_S = MAX_SHUTDOWN_DELAY_S + 2 * 30


def gpu_need(record: ModelRecord) -> GpuNeed | None:
    """What one replica asks for in GPUs, from the applied profile (None: no GPU)."""
    gpus = int(record.profile.get("gpus") or 0)
    if gpus == 0:
        return None
    memory = record.profile.get("gpu_memory")
    return GpuNeed(count=gpus, memory_bytes=int(memory) if memory else None)


def engine_need(job: Job | None) -> EngineNeed | None:
    """The versioned engine the job constrains on (its group's
    `${meta.llmgw_engine_<name>} = <version>`, planner/jobspecs/model.nomad.hcl); None
    for an engine of LLMGW_ENGINES, which has no constraint."""
    prefix = "${meta." + ENGINE_META_PREFIX
    for group in (job or {}).get("TaskGroups") or []:
        for constraint in group.get("Constraints") or []:
            target = constraint.get("LTarget") or ""
            if target.startswith(prefix) and constraint.get("Operand") in ("=", "==", "is"):
                return EngineNeed(target[len(prefix) : -1], constraint.get("RTarget") or "")
    return None


def filtered_for(engine: EngineNeed, evaluation: dict[str, Any]) -> bool:
    return any(
        engine.constraint in ((metric or {}).get("ConstraintFiltered") or {})
        for metric in (evaluation.get("FailedTGAllocs") or {}).values()
    )


def room_helps(evaluation: dict[str, Any]) -> bool:
    """Some node was ruled out for lack of free resources (NodesExhausted), so an
    allocation that ends can make room. When every node was filtered (no GPU device, a
    constraint, a datacenter), nothing that stops changes the answer (found by test: a
    GPU model on a CPU cluster waited 45 s because a CPU model was scaling down)."""
    return any(
        (metric or {}).get("NodesExhausted")
        for metric in (evaluation.get("FailedTGAllocs") or {}).values()
    )


def with_unplaceable(state: StateDocument, unplaceable: Unplaceable | None) -> StateDocument:
    """Set the placement answer, keeping `since` while the shortfall stays the same, and
    telling a provisional answer as the shortfall it is (`standing`) when it follows a
    told one, or when the room it first waited for was made and it is still short.

    A told shortfall stays told while Nomad looks again at room being made: until Nomad
    says so, it stands (`llmgw_contract.Unplaceable.stands`). Room that was made and
    left the model short ends the waiting: the allocations a provisional answer first
    waited for (`room`) are carried while any of them is still stopping; once none is,
    Nomad has re-run its evaluation on that room (`NomadClient.stopping_allocations`
    keeps an ended one for `RERUN_WITHIN_S`, the re-run's window) and still did not place
    the model. Without it, a cluster where some allocation is always stopping (other
    jobs' scale-downs, rollouts, batch work) kept a new shortfall provisional, so never
    in status, metrics or alerts (found in an audit: the "no placement, and no one knew"
    failure of docs/architecture.md, by another road)."""
    old = state.unplaceable
    if unplaceable is not None and old is not None:
        update: dict[str, object] = {}
        if old.reason == unplaceable.reason:
            update["since"] = old.since
        if unplaceable.provisional:
            update.update(_waited(old, unplaceable))
        unplaceable = unplaceable.model_copy(update=update)
    return state.model_copy(update={"unplaceable": unplaceable})


def _waited(old: Unplaceable, new: Unplaceable) -> dict[str, object]:
    """How a provisional answer continues the one before it: standing (its room no
    longer kept), or still waiting for the room it first waited for."""
    if old.stands:
        return {"standing": True, "room": ()}
    if not (old.room and new.room):
        return {}
    if set(old.room) & set(new.room) and _waited_s(old, new) < ROOM_WAIT_MAX_S:
        return {"room": old.room}
    return {"standing": True, "room": ()}


def _waited_s(old: Unplaceable, new: Unplaceable) -> float:
    """Seconds from the first answer of this shortfall to this one (0 when unknown)."""
    try:
        return (
            datetime.fromisoformat(new.since) - datetime.fromisoformat(old.since)
        ).total_seconds()
    except (TypeError, ValueError):
        return 0.0


def waited_for(state: StateDocument) -> tuple[str, ...]:
    """The allocations the model's placement answer waits for (`Unplaceable.room`)."""
    return state.unplaceable.room if state.unplaceable is not None else ()


def settled_shortfall(state: StateDocument) -> Unplaceable | None:
    """Nomad's answer that left replicas unplaced, unless it is provisional on its own
    (room being made for a shortfall not yet settled: requests wait for Nomad to place
    the model); a standing one is still told."""
    short = state.unplaceable
    return short if short is not None and short.stands else None
