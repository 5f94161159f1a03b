"""The engines' durable records: which engines are defined, kept where Nomad's GC cannot
remove them.

An engine's install job is a sysbatch job: once it ran on every node it is `dead`, and
Nomad's GC (`nomad system gc`, or by itself after the servers' `job_gc_threshold`, 4 h
by default) deletes it. So the job cannot be the record of what is defined (issue 20:
after a GC, `planner apply` rendered every model without its engine constraint). The
record is Consul KV `llmgw/engines/<name>` (`llmgw_contract.EngineRecord`), written by
`planner engines apply` beside the model records; what each node has installed stays
in the node's metadata (`llmgw_engine_<name> = <version>`).

Each install job also carries its definition in its meta (META_RECORD, and the command
it installed, META_COMMAND), as a model job carries its record: the leader restores a
missing KV record from a job Nomad still has (`restore`, run with the models' repair),
and an engine registered before the KV record existed is read from its job.

Called by `planner.daemon.engine_install` (reads, and the writes of `engines apply`),
the engine follower (`planner.daemon.engine_follow`) and the leader's repair.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from llmgw_contract import EngineRecord, KVPrefix, encode, kv_key
from planner.agents.consul import ConsulClient
from planner.agents.state import StateStore
from planner.spec.engine_definitions import DEFAULT_ENGINE_ROOT, JOB_PREFIX, EngineDefinition
from planner.vocab import Job

log = logging.getLogger("planner.engines")

# Meta keys of an engine's install job that make its record.
META_ENGINE = "llmgw_engine"
META_RECORD = "llmgw_engine_record"  # the EngineDefinition as JSON
# The program's path on the nodes as this install wrote it (`path`, or under the
# LLMGW_ENGINE_ROOT of `planner engines apply`): model jobs run this, so `planner apply`
# needs no engine root of its own.
META_COMMAND = "llmgw_engine_command"
# What Nomad adds to a job it stores; left out of the job a record keeps to register again.
_SERVER_FIELDS = frozenset(
    {
        "Status",
        "StatusDescription",
        "Stable",
        "Version",
        "SubmitTime",
        "CreateIndex",
        "ModifyIndex",
        "JobModifyIndex",
    }
)


def is_engine_job(job: Mapping[str, Any]) -> bool:
    return META_RECORD in (job.get("Meta") or {}) and str(job.get("ID", "")).startswith(JOB_PREFIX)


def record(definition: EngineDefinition, job: Job) -> EngineRecord:
    """The record of `definition`, installed by `job` (as rendered, its command in its
    meta)."""
    return EngineRecord(
        name=definition.name,
        version=definition.version,
        definition=definition.model_dump(mode="json"),
        command=(job.get("Meta") or {}).get(META_COMMAND) or "",
        install_job={k: v for k, v in job.items() if k not in _SERVER_FIELDS},
    )


def record_of_job(job: Job, root: str = DEFAULT_ENGINE_ROOT) -> EngineRecord | None:
    """The record an install job carries in its meta; None when it cannot be read (not
    written by this planner). `root` places the command only for a job registered
    before META_COMMAND existed."""
    meta = job.get("Meta") or {}
    try:
        definition = EngineDefinition.model_validate_json(meta[META_RECORD])
    except (KeyError, ValueError):
        return None
    found = record(definition, job)
    return (
        found if found.command else found.model_copy(update={"command": definition.command(root)})
    )


def definition_of(found: EngineRecord) -> EngineDefinition:
    """The engine file a record keeps. Raises ValueError when it no longer validates
    (a record written by a planner whose schema differed)."""
    return EngineDefinition.model_validate(found.definition)


def definitions(records: Mapping[str, EngineRecord]) -> dict[str, EngineDefinition]:
    """The definitions of `records`, leaving out (with an error logged) one that no
    longer validates."""
    found = {}
    for name, r in records.items():
        try:
            found[name] = definition_of(r)
        except ValueError as exc:
            log.error("engine %s: its record does not validate: %s", name, exc)
    return found


def merged(
    records: Mapping[str, EngineRecord], jobs: Mapping[str, Job], root: str = DEFAULT_ENGINE_ROOT
) -> dict[str, EngineRecord]:
    """Pure: the engines defined. The KV `records`, and for an engine without one (a KV
    wiped, not yet restored; an engine registered before the records existed) the record
    its install job in `jobs` carries."""
    from_jobs = {n: r for n, j in jobs.items() if (r := record_of_job(j, root)) is not None}
    return {**from_jobs, **records}


def restore(jobs: Mapping[str, Job], consul: ConsulClient, store: StateStore) -> list[str]:
    """Write back the KV record of each engine whose install job Nomad has (`jobs`, by
    engine) and whose record is gone, through `store` (fenced: a deposed leader writes
    nothing). Returns the engines restored. An engine whose job was also removed (GC) is
    known to no one but the nodes' metadata, which holds only a version: `planner engines
    apply` defines it again."""
    have = set(consul.get_texts(KVPrefix.ENGINES))
    restored = []
    for name, job in sorted(jobs.items()):
        key = kv_key(KVPrefix.ENGINES, name)
        if key in have or (found := record_of_job(job)) is None:
            continue
        if store.put_new(key, encode(found)):
            restored.append(name)
            log.warning("engine %s: its KV record was gone; restored from its install job", name)
    return restored
