"""The planner's actions on a model's job: park, unpark (retry). One place that acts.

Called by the watcher (park, when `failures.decide_parking` says so), by
`planner retry` and the admin API's retry route (both through `retry`), and
by `apply` (a parked model's new job version is registered stopped, with the
parking meta, until its definition changes).

A parked job is stopped but kept, so the Nomad UI shows it, with these meta
keys on the job (Nomad meta values are strings):
  llmgw_parked_reason      "5 consecutive start failures"
  llmgw_parked_last_error  the last task event and stderr tail (at most 2000 chars)
  llmgw_parked_since       ISO 8601 UTC
"""

from __future__ import annotations

from planner.errors import Rejected
from planner.failures import retried
from planner.nomad_client import Job, NomadClient
from planner.state import ModelState, Parked, StateStore

PARKED_META = ("llmgw_parked_reason", "llmgw_parked_last_error", "llmgw_parked_since")
META_VALUE_LIMIT = 2000


def parked_job(job: Job, parked: Parked) -> Job:
    """`job` stopped, with the parking reason in its meta."""
    meta = {**(job.get("Meta") or {}),
            "llmgw_parked_reason": parked.reason,
            "llmgw_parked_last_error": (parked.last_error or "")[-META_VALUE_LIMIT:],
            "llmgw_parked_since": parked.since}
    return {**job, "Stop": True, "Meta": meta}


def unparked_job(job: Job) -> Job:
    meta = {k: v for k, v in (job.get("Meta") or {}).items() if k not in PARKED_META}
    return {**job, "Stop": False, "Meta": meta}


def park(nomad: NomadClient, name: str, parked: Parked) -> None:
    """Stop the model's job, keeping it, with the reason in its meta."""
    job = nomad.job(name)
    if job is not None:
        nomad.register(parked_job(job, parked))


def retry(nomad: NomadClient, store: StateStore, name: str) -> tuple[ModelState, str]:
    """Try a model again: lift parking and start the job, or, for an unplaceable model,
    ask the scheduler again. Returns the state and what was done, in words.
    Raises Rejected when there is no such job."""
    job = nomad.job(name)
    if job is None:
        raise Rejected(f"model {name!r} has no Nomad job; run `planner apply` first")
    state = store.load(name)
    if state.parked is not None:
        state = retried(state)
        store.save(state)
        nomad.register(unparked_job(job))
        return state, "parking lifted; the job is starting again"
    if state.unplaceable is not None or job.get("Stop"):
        if job.get("Stop"):
            nomad.register(unparked_job(job))
        else:
            nomad.evaluate(name)
        return state, "asked the scheduler to place it again"
    return state, "not parked or unplaceable; nothing to retry"
