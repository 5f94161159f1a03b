"""Parking as a job's meta, and its KV cache: the values, not the writes.

Used by the applier (`planner.daemon.applier`: a `Park` effect registers
`parked_job`, an `Unpark` `unparked_job`), by the decisions that read parking
(`planner.model`), by `apply` (a parked model's new job version is registered
stopped, with the parking meta, until its definition changes), by the status
views and by `planner.daemon.repair`. Nomad is written only by the
applier.

Nomad first, Consul KV second. A parked job is stopped but kept, so the
Nomad UI shows it, with the reason in its meta (`llmgw_contract.PARKED_META`):

  llmgw_parked_reason      "5 consecutive start failures"
  llmgw_parked_last_error  the last error: its first line, then as much of the stderr
                           lines' end as fits in 2000 chars
  llmgw_parked_since       ISO 8601 UTC

That meta is the durable record (docs/architecture.md, "Parking"); the
`parked` member of the KV state document is a cache of it, written after
Nomad with the job's modify index (`set_parked`), so a late writer holding an
older Nomad answer can never undo a newer one: KV and Nomad agree at the end
whatever order a park, a retry and the watcher's sync run in.
"""

from __future__ import annotations

from typing import Any

from llmgw_contract import PARKED_META, JobMeta, Parked, StateDocument
from llmgw_contract.lasterror import clipped
from planner.model.failures import retried
from planner.vocab import Job

META_VALUE_LIMIT = 2000


def parked_job(job: Job, parked: Parked) -> Job:
    """`job` stopped, with the parking reason in its meta."""
    meta = {
        **(job.get("Meta") or {}),
        JobMeta.PARKED_REASON: parked.reason,
        JobMeta.PARKED_LAST_ERROR: clipped(parked.last_error or "", META_VALUE_LIMIT),
        JobMeta.PARKED_SINCE: parked.since,
    }
    return {**job, "Stop": True, "Meta": meta}


def unparked_job(job: Job) -> Job:
    meta = {k: v for k, v in (job.get("Meta") or {}).items() if k not in PARKED_META}
    return {**job, "Stop": False, "Meta": meta}


def parked_from_job(job: Job | None) -> Parked | None:
    """The parking record a job's meta holds (the durable one), or None."""
    meta: dict[str, Any] = (job or {}).get("Meta") or {}
    if JobMeta.PARKED_REASON not in meta:
        return None
    return Parked(
        reason=meta[JobMeta.PARKED_REASON],
        last_error=meta.get(JobMeta.PARKED_LAST_ERROR) or None,
        since=meta.get(JobMeta.PARKED_SINCE, ""),
        definition_hash=meta.get(JobMeta.DEFINITION_HASH, ""),
    )


def set_parked(state: StateDocument, parked: Parked | None, job_index: int) -> StateDocument:
    """The KV cache of parking, as of the Nomad job at modify index `job_index`; a park
    older than the answer the document already reflects changes nothing. Un-parking is
    never refused: its callers write it right after their own job write, and after a
    Nomad index reset (rebuilt servers) a lower JobModifyIndex is the truth (issue 19:
    the guard kept a KV copy parked that even `planner retry` could not lift). The
    daemon keeps the copy equal to the job's meta at every observation
    (`planner.model.fold`)."""
    if parked is not None and job_index < state.job_index:
        return state
    if parked is None and state.parked is not None:
        state = retried(state)
    return state.model_copy(update={"parked": parked, "job_index": job_index})
