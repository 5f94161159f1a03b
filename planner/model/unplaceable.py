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

from typing import Any

from llmgw_contract import ModelRecord, StateDocument, Unplaceable
from planner.model.placement import (
    ENGINE_META_PREFIX,
    EngineNeed,
    GpuNeed,
)
from planner.vocab import Job


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
    keeping a told shortfall told (`standing`) when a provisional answer follows it:
    room being made may end it, and until Nomad says so it stands
    (`llmgw_contract.Unplaceable.stands`)."""
    old = state.unplaceable
    if unplaceable is not None and old is not None:
        update: dict[str, object] = {}
        if old.reason == unplaceable.reason:
            update["since"] = old.since
        if unplaceable.provisional and old.stands:
            update["standing"] = True
        unplaceable = unplaceable.model_copy(update=update)
    return state.model_copy(update={"unplaceable": unplaceable})


def settled_shortfall(state: StateDocument) -> Unplaceable | None:
    """Nomad's answer that left replicas unplaced, unless it is provisional on its own
    (room being made for a shortfall not yet settled: requests wait for Nomad to place
    the model); a standing one is still told."""
    short = state.unplaceable
    return short if short is not None and short.stands else None
