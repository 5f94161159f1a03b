"""A model's placement answer from one evaluation: placed, short (why), or waiting for room.

Called by the watcher (every completed evaluation of a model's job) and by
activation (the evaluation of its fresh placement attempt). It adds to the
pure reasons of `planner.placement` what only Nomad knows now: the GPU
inventory of the nodes (read only when the model asks for GPUs and a
replica went unplaced), and whether allocations are stopping anywhere.

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

from dataclasses import replace
from datetime import datetime
from typing import Any

from llmgw_contract import ModelRecord, StateDocument, Unplaceable
from planner.engines.install import progress
from planner.nomad_client import Job, NomadClient, group_count
from planner.placement import (
    ENGINE_META_PREFIX,
    EngineNeed,
    GpuNeed,
    Shortfall,
    evaluation_shortfall,
    gpu_inventory,
)


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
                return EngineNeed(target[len(prefix):-1], constraint.get("RTarget") or "")
    return None


def _filtered_for(engine: EngineNeed, evaluation: dict[str, Any]) -> bool:
    return any(engine.constraint in ((metric or {}).get("ConstraintFiltered") or {})
               for metric in (evaluation.get("FailedTGAllocs") or {}).values())


def shortfall(nomad: NomadClient, record: ModelRecord, job: Job | None,
              evaluation: dict[str, Any], datacenters: tuple[str, ...],
              engine: EngineNeed | None = None) -> Shortfall | None:
    """What the evaluation left unplaced and why; None when it placed everything.
    `engine`: the engine need with its counts (default: read from the job, counted
    only when the scheduler filtered nodes for it)."""
    if not evaluation.get("FailedTGAllocs"):
        return None
    need = gpu_need(record)
    gpus = gpu_inventory(nomad.nodes(), datacenters=datacenters) if need else []
    if engine is None:
        engine, _ = _engine_coming(nomad, job, evaluation, datacenters)
    return evaluation_shortfall(evaluation, max(group_count(job), 1), need, gpus,
                                engine=engine)


def _engine_coming(nomad: NomadClient, job: Job | None, evaluation: dict[str, Any],
                   datacenters: tuple[str, ...]) -> tuple[EngineNeed | None, int]:
    """The engine the scheduler filtered nodes for, counted, and on how many nodes its
    install is still on its way (0: it is not, or no engine was missing)."""
    engine = engine_need(job)
    if engine is None or not _filtered_for(engine, evaluation):
        return None, 0
    counted = progress(nomad, engine.name, engine.version, datacenters)
    return (replace(engine, installed=counted.installed, nodes=counted.nodes,
                    crashed=counted.crashed),
            counted.installing)


def room_helps(evaluation: dict[str, Any]) -> bool:
    """Some node was ruled out for lack of free resources (NodesExhausted), so an
    allocation that ends can make room. When every node was filtered (no GPU device, a
    constraint, a datacenter), nothing that stops changes the answer (found by test: a
    GPU model on a CPU cluster waited 45 s because a CPU model was scaling down)."""
    return any((metric or {}).get("NodesExhausted")
               for metric in (evaluation.get("FailedTGAllocs") or {}).values())


def answer(nomad: NomadClient, record: ModelRecord, job: Job | None,
           evaluation: dict[str, Any], datacenters: tuple[str, ...],
           now: datetime) -> Unplaceable | None:
    """The Unplaceable record an evaluation calls for, provisional while allocations
    stop somewhere; None when it placed every replica."""
    if not evaluation.get("FailedTGAllocs"):
        return None
    engine, installing = _engine_coming(nomad, job, evaluation, datacenters)
    short = shortfall(nomad, record, job, evaluation, datacenters, engine)
    if short is None:
        return None
    stopping = nomad.stopping_allocations(int(evaluation.get("SnapshotIndex") or 0)) \
        if room_helps(evaluation) else []
    reason = short.reason
    if installing and engine is not None:
        # The node's metadata change unblocks Nomad's blocked evaluation (nomad/fsm.go,
        # a node upsert unblocks its class): it places the model when the install ends.
        reason = (f"waiting for engine {engine.name} {engine.version} to install on "
                  f"{installing} node(s); Nomad places it when it is recorded ({reason})")
    elif stopping:
        nodes = sorted({a.get("NodeName") or a.get("NodeID", "")[:8] for a in stopping})
        reason = (f"waiting for room: {len(stopping)} allocation(s) stopping or stopped on "
                  f"{', '.join(nodes)}; Nomad places it again when they end ({reason})")
    return Unplaceable(reason=reason, since=now.isoformat(timespec="seconds"),
                       eval_id=evaluation.get("ID"), placed=short.placed,
                       desired=short.desired, provisional=bool(stopping or installing))


def with_unplaceable(state: StateDocument, unplaceable: Unplaceable | None) -> StateDocument:
    """Set the placement answer, keeping `since` while the reason stays the same."""
    old = state.unplaceable
    if unplaceable is not None and old is not None and old.reason == unplaceable.reason:
        unplaceable = unplaceable.model_copy(update={"since": old.since})
    return state.model_copy(update={"unplaceable": unplaceable})
