"""Restore what a wiped `llmgw/` in Consul lost, from the Nomad jobs' meta.

Called by the leader's watcher on every reconcile and every 30 s. Consul KV
is a cache of what Nomad holds durably (docs/architecture.md, "Parking"): an
operator's `consul kv delete -recurse llmgw/`, or a restored snapshot, must
not make a defined model unknown or un-park a parked one. Each model job
carries its KV record (`llmgw_record` meta) and a parked job its parking
(`llmgw_parked_*` meta), so both can be written back.

A stopped job is a model too (parked, or stopped by an operator with `nomad
job stop`): `apply --prune` purges the jobs it removes, so every llmgw job
Nomad still has gets its record back.

Engines too: the record of a defined engine (`llmgw/engines/<name>`) is written back
from its install job's meta while Nomad still has the job
(`planner.daemon.engine_records.restore`). Once Nomad's GC removed that job as well,
nothing but the nodes' metadata (a version, no source) remains: `planner engines
apply` defines the engine again, and `planner apply` refuses meanwhile to drop a
model's engine constraint.
"""

from __future__ import annotations

import logging
import re

from llmgw_contract import JobMeta, KVPrefix, ModelRecord, encode, kv_key
from planner.agents.consul import ConsulClient
from planner.agents.nomad import NomadClient
from planner.agents.state import StateStore
from planner.daemon import engine_records
from planner.daemon.engine_records import META_ENGINE, is_engine_job
from planner.daemon.observe import read_record
from planner.model.parking import parked_from_job, set_parked
from planner.spec.definitions import NAME_PATTERN
from planner.spec.jobspec import record_of
from planner.vocab import Job

log = logging.getLogger("planner.daemon.repair")


def restore(nomad: NomadClient, consul: ConsulClient, store: StateStore) -> list[str]:
    """Write back the records of model jobs that run or are parked, where missing, and
    the KV copy of every parked job's parking, through `store` (so a deposed leader's
    writes are fenced off). Returns the models whose record it wrote."""
    keys = set(consul.get_texts(KVPrefix.MODELS))
    restored = []
    stubs = nomad.jobs()
    _restore_engines(stubs, nomad, consul, store)
    for stub in stubs:
        meta = stub.get("Meta") or {}
        name = stub.get("ID", "")
        parked = JobMeta.PARKED_REASON in meta
        if JobMeta.MODEL not in meta:
            continue
        if kv_key(KVPrefix.MODELS, name) not in keys and JobMeta.RECORD in meta:
            job = nomad.job(name)
            if job is None:
                continue
            if _write_back(store, name, job) is not None:
                restored.append(name)
        if parked:
            job = nomad.job(name)
            if job is not None:
                _sync_parking(store, name, job)
    return restored


def record_or_restored(
    nomad: NomadClient, consul: ConsulClient, store: StateStore, name: str
) -> ModelRecord | None:
    """The model's record: its KV record, or, where KV has none and Nomad has the
    model's job, the record the job carries, written back first with the job's parking
    (what `restore` does for every model, done for this one now). None when neither has
    it: the model was never applied (or was purged).

    For an answer about one model that must not wait for the next repair pass (found in
    CI: after Consul restarted, the new leader answered an activation "never applied"
    54 ms before its first pass restored the record, and the router told a client 404
    for a model it was serving). Raises what `NomadClient.job` raises."""
    if not re.fullmatch(NAME_PATTERN, name):
        return None  # no model has it (apply validates names): asked of neither
    record = read_record(consul, name)
    if record is not None:
        return record
    job = model_job(nomad, name)
    if job is None:
        return None
    record = _write_back(store, name, job) or read_record(consul, name)
    if JobMeta.PARKED_REASON in (job.get("Meta") or {}):
        _sync_parking(store, name, job)
    return record


def record_in_job(nomad: NomadClient, name: str) -> ModelRecord | None:
    """The record model `name`'s Nomad job carries, read-only (what a follower may say
    of a model KV forgot until the leader writes it back: never "never applied" for a
    model Nomad has). None when there is no such job or its meta cannot be read."""
    job = model_job(nomad, name)
    if job is None:
        return None
    try:
        return record_of(job)
    except ValueError:
        return None


def model_job(nomad: NomadClient, name: str) -> Job | None:
    """Nomad's job for model `name` when it carries the model's record in its meta
    (read-only: what a follower may say of a model KV forgot); else None.

    `name` comes from a URL or a command line: one no model may have is asked of no
    one, and the job must be that model's by ID and meta (found in review: python-nomad
    does not quote the job ID, so "gemma?x" read gemma's job, and `retry` wrote its
    record under "gemma?x", which broke `planner status`)."""
    if not re.fullmatch(NAME_PATTERN, name):
        return None
    job = nomad.job(name)
    meta = (job or {}).get("Meta") or {}
    if job is None or job.get("ID") != name or meta.get(JobMeta.MODEL) != name:
        return None
    return job if JobMeta.RECORD in meta else None


def _write_back(store: StateStore, name: str, job: Job) -> ModelRecord | None:
    """Write the record `job` carries to KV where none is (`put_new`); the record, or
    None when the meta cannot be read (logged) or `apply` wrote one meanwhile."""
    try:
        record = record_of(job)
    except ValueError as exc:
        log.error("model %s: cannot restore its record from job meta: %s", name, exc)
        return None
    if not store.put_new(kv_key(KVPrefix.MODELS, name), encode(record)):
        return None  # `apply` wrote it meanwhile
    log.warning("model %s: its KV record was gone; restored from the job's meta", name)
    return record


def _restore_engines(
    stubs: list[Job], nomad: NomadClient, consul: ConsulClient, store: StateStore
) -> list[str]:
    """The engine records gone from KV, written back from the install jobs Nomad has
    (read in full only for an engine without a record)."""
    have = set(consul.get_texts(KVPrefix.ENGINES))
    jobs = {}
    for stub in stubs:
        name = (stub.get("Meta") or {}).get(META_ENGINE, "")
        if not is_engine_job(stub) or stub.get("Stop") or kv_key(KVPrefix.ENGINES, name) in have:
            continue
        job = nomad.job(stub["ID"])
        if job is not None and not job.get("Stop"):
            jobs[name] = job
    return engine_records.restore(jobs, consul, store) if jobs else []


def _sync_parking(store: StateStore, name: str, job: Job) -> None:
    """Make the KV cache say what the job (read at its JobModifyIndex) says."""
    index = int(job.get("JobModifyIndex") or 0)
    store.update(name, lambda s: set_parked(s, parked_from_job(job), index))
