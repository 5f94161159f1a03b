"""The planner's actions on a model's job: park, retry. One place that acts.

Called by the watcher (park, when `failures.decide_parking` says so), by
`planner retry` and the admin API's retry route (both through `retry`), and
by `apply` (a parked model's new job version is registered stopped, with the
parking meta, until its definition changes).

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

import logging
from typing import Any

from llmgw_contract import PARKED_META, JobMeta, Parked, StateDocument, UpdateFailed
from llmgw_contract.lasterror import clipped
from planner.errors import NomadRejected, Rejected
from planner.failures import forgiven, retried
from planner.nomad_client import Job, NomadClient
from planner.state import StateStore

log = logging.getLogger("planner.actions")

META_VALUE_LIMIT = 2000


def parked_job(job: Job, parked: Parked) -> Job:
    """`job` stopped, with the parking reason in its meta."""
    meta = {**(job.get("Meta") or {}),
            JobMeta.PARKED_REASON: parked.reason,
            JobMeta.PARKED_LAST_ERROR: clipped(parked.last_error or "", META_VALUE_LIMIT),
            JobMeta.PARKED_SINCE: parked.since}
    return {**job, "Stop": True, "Meta": meta}


def unparked_job(job: Job) -> Job:
    meta = {k: v for k, v in (job.get("Meta") or {}).items() if k not in PARKED_META}
    return {**job, "Stop": False, "Meta": meta}


def parked_from_job(job: Job | None) -> Parked | None:
    """The parking record a job's meta holds (the durable one), or None."""
    meta: dict[str, Any] = (job or {}).get("Meta") or {}
    if JobMeta.PARKED_REASON not in meta:
        return None
    return Parked(reason=meta[JobMeta.PARKED_REASON],
                  last_error=meta.get(JobMeta.PARKED_LAST_ERROR) or None,
                  since=meta.get(JobMeta.PARKED_SINCE, ""),
                  definition_hash=meta.get(JobMeta.DEFINITION_HASH, ""))


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


def _index(answer: dict[str, Any]) -> int:
    return int(answer.get("JobModifyIndex") or 0)


def park(nomad: NomadClient, store: StateStore, name: str, parked: Parked) -> bool:
    """Stop the model's job, keeping it, with the reason in its meta; then record it.
    False when the job is gone, stopped or changed since it was read (nothing done).
    Raises NotLeader for a store fenced by a leadership this planner lost."""
    store.assert_leading()
    job = nomad.job(name)
    if job is None or job.get("Stop"):
        return False  # stopped meanwhile: an operator's stop is not a park
    try:
        # Only the job as read: an `apply` or a stop in between wins, and the next
        # event decides again on what it did.
        answer = nomad.register(parked_job(job, parked),
                                enforce_index=int(job.get("JobModifyIndex") or 0))
    except NomadRejected as exc:
        log.warning("model %s: not parked, its job changed meanwhile (%s)", name, exc)
        return False
    store.update(name, lambda s: set_parked(s, parked, _index(answer)))
    return True


def sync_parking(store: StateStore, name: str, job: Job) -> None:
    """Make the KV cache say what the job (read at its JobModifyIndex) says."""
    index = int(job.get("JobModifyIndex") or 0)
    store.update(name, lambda s: set_parked(s, parked_from_job(job), index))


def _retry_update(nomad: NomadClient, store: StateStore, name: str, job: Job,
                  failed: UpdateFailed) -> tuple[StateDocument, str]:
    """Roll the definition Nomad rolled back out again: its job version registered
    anew (Nomad's revert, only if the job is still at the version read), then the
    rollback forgotten; if it fails again, Nomad rolls it back again."""
    nomad.revert(name, failed.job_version, int(job.get("Version") or 0))
    after = store.update(name, lambda s: s.model_copy(update={"update_failed": None})).after
    return after, (f"rolling definition {failed.definition_hash[:12]} out again (job "
                   f"version {failed.job_version}) beside the one serving")


def retry(nomad: NomadClient, store: StateStore, name: str) -> tuple[StateDocument, str]:
    """Try a model again: lift parking and start the job; for a job Nomad gave up on
    (replicas stopped after their restart attempts) or an unplaceable one, ask the
    scheduler to place it again. Returns the state and what was done, in words.
    Raises Rejected when there is no such job."""
    job = nomad.job(name)
    if job is None:
        raise Rejected(f"model {name!r} has no Nomad job; run `planner apply` first")
    if parked_from_job(job) is not None or job.get("Stop"):
        answer = nomad.register(unparked_job(job))
        # A replica Nomad stopped after its restart attempts stays failed and keeps its
        # place in the count, stopped job or not (no reschedule): only a forced
        # reschedule replaces it, so that the job really starts again.
        nomad.evaluate(name, force_reschedule=True)
        after = store.update(name, lambda s: set_parked(s, None, _index(answer))).after
        return after, "parking lifted; the job is starting again" \
            if parked_from_job(job) else "the stopped job is starting again"
    rolled_back = store.load(name).update_failed
    if rolled_back is not None:
        return _retry_update(nomad, store, name, job, rolled_back)
    failed = [a for a in nomad.allocations(name)
              if a.get("ClientStatus") == "failed" and a.get("DesiredStatus") == "run"
              and not a.get("NextAllocation")]
    state = store.update(name, forgiven).after
    if failed:
        nomad.evaluate(name, force_reschedule=True)
        return state, f"{len(failed)} stopped replica(s) placed again"
    if state.unplaceable is not None:
        nomad.evaluate(name)
        return state, "asked the scheduler to place it again"
    return state, "not parked, unplaceable or stopped; nothing to retry"
