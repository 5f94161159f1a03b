"""A model's placement answer from one evaluation: what only Nomad knows now.

Called by observe (the latest completed evaluation of a model's job) and by
activation (the evaluation of its fresh placement attempt). It adds to the
pure reasons of `planner.model.placement` and `planner.model.unplaceable` the GPU
inventory of the nodes (read only when the model asks for GPUs and a replica
went unplaced), the engine installs on their way, and whether allocations
are stopping anywhere (`planner.model.unplaceable` says why that makes an answer
provisional).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Any

from llmgw_contract import ROOM_IDS_KEPT, ModelRecord, Unplaceable
from planner.agents.nomad import NomadClient
from planner.daemon.engine_install import progress
from planner.model.placement import EngineNeed, Shortfall, evaluation_shortfall, gpu_inventory
from planner.model.unplaceable import engine_need, filtered_for, gpu_need, room_helps
from planner.vocab import Job, group_count


def shortfall(
    nomad: NomadClient,
    record: ModelRecord,
    job: Job | None,
    evaluation: dict[str, Any],
    datacenters: tuple[str, ...],
    engine: EngineNeed | None = None,
) -> Shortfall | None:
    """What the evaluation left unplaced and why; None when it placed everything.
    `engine`: the engine need with its counts (default: read from the job, counted
    only when the scheduler filtered nodes for it)."""
    if not evaluation.get("FailedTGAllocs"):
        return None
    need = gpu_need(record)
    gpus = gpu_inventory(nomad.nodes(), datacenters=datacenters) if need else []
    if engine is None:
        engine, _ = _engine_coming(nomad, job, evaluation, datacenters)
    return evaluation_shortfall(evaluation, max(group_count(job), 1), need, gpus, engine=engine)


def _engine_coming(
    nomad: NomadClient, job: Job | None, evaluation: dict[str, Any], datacenters: tuple[str, ...]
) -> tuple[EngineNeed | None, int]:
    """The engine the scheduler filtered nodes for, counted, and on how many nodes its
    install is still on its way (0: it is not, or no engine was missing)."""
    engine = engine_need(job)
    if engine is None or not filtered_for(engine, evaluation):
        return None, 0
    counted = progress(nomad, engine.name, engine.version, datacenters)
    return (
        replace(engine, installed=counted.installed, nodes=counted.nodes, crashed=counted.crashed),
        counted.installing,
    )


def answer(
    nomad: NomadClient,
    record: ModelRecord,
    job: Job | None,
    evaluation: dict[str, Any],
    datacenters: tuple[str, ...],
    now: datetime,
    waited: tuple[str, ...] = (),
) -> Unplaceable | None:
    """The Unplaceable record an evaluation calls for, provisional while allocations
    stop somewhere; None when it placed every replica. `waited`: the allocations the
    model's last answer waited for (`Unplaceable.room`); its `room` is those of them
    still stopping, else (none is) the first ROOM_IDS_KEPT of what stops now, sorted
    (`planner.model.unplaceable.with_unplaceable` reads it)."""
    if not evaluation.get("FailedTGAllocs"):
        return None
    engine, installing = _engine_coming(nomad, job, evaluation, datacenters)
    short = shortfall(nomad, record, job, evaluation, datacenters, engine)
    if short is None:
        return None
    stopping = (
        nomad.stopping_allocations(int(evaluation.get("SnapshotIndex") or 0))
        if room_helps(evaluation)
        else []
    )
    waiting = ""
    room: tuple[str, ...] = ()
    if installing and engine is not None:
        # The node's metadata change unblocks Nomad's blocked evaluation (nomad/fsm.go,
        # a node upsert unblocks its class): it places the model when the install ends.
        waiting = (
            f"waiting for engine {engine.name} {engine.version} to install on "
            f"{installing} node(s); Nomad places it when it is recorded"
        )
    elif stopping:
        nodes = sorted({a.get("NodeName") or a.get("NodeID", "")[:8] for a in stopping})
        waiting = (
            f"waiting for room: {len(stopping)} allocation(s) stopping or stopped on "
            f"{', '.join(nodes)}; Nomad places it again when they end"
        )
        ids = sorted(str(a.get("ID", "")) for a in stopping)
        # Checked against the whole list, never a cut of it: other allocations that
        # start stopping must not push out the ones still awaited (found in review).
        still = set(ids).intersection(waited)
        room = tuple(i for i in waited if i in still) or tuple(ids[:ROOM_IDS_KEPT])
    return Unplaceable(
        reason=short.reason,
        since=now.isoformat(timespec="seconds"),
        eval_id=evaluation.get("ID"),
        placed=short.placed,
        desired=short.desired,
        provisional=bool(waiting),
        waiting=waiting,
        room=room,
    )
