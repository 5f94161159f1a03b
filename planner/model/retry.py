"""`planner retry` as a decision (pure): what to write to try a model again.

Ported from `planner.model.parking.retry`, whose order it keeps:

  parked, or its job stopped  -> `Unpark`, then `Evaluate(force_reschedule=True)` (a
                                 replica Nomad stopped after its restart attempts keeps
                                 its place in the count, stopped job or not: only a
                                 forced reschedule starts it again); counts forgiven
  an update Nomad rolled back -> `Revert` to its job version (only while the job is at
                                 the version read), `update_failed` cleared; when Nomad
                                 no longer keeps that version, only cleared (the next
                                 `planner apply` registers it again)
  replicas Nomad stopped      -> counts forgiven, `Evaluate(force_reschedule=True)`
  unplaceable                 -> counts forgiven, `Evaluate()`
  otherwise                   -> counts forgiven, nothing written to Nomad

A forced reschedule would place a failed replica of an older definition again, at
its own job version, while the current one rolls out with canaries
(`planner.model.resurrect`, issue 19's QA: D2, D3). When one such replica holds its
place, the job is registered renewed instead (`Unpark(renew=True)`, or `Register` of
the renewed job), and no evaluation is forced: Nomad replaces every allocation with
the current definition.

The caller checks there is a job (`transition.decide` raises Rejected otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw_contract import StateDocument, UpdateFailed
from planner.model.effects import Effect, Evaluate, Reason, Register, Revert, Unpark
from planner.model.failures import forgiven, retried
from planner.model.observation import Observation
from planner.model.parking import parked_from_job
from planner.model.resurrect import renewed, stale_failed
from planner.model.rollout import definition_of


@dataclass(frozen=True)
class Retried:
    state: StateDocument
    effects: tuple[Effect, ...]
    summary: str  # what was done, for the CLI and the admin API


def stopped_replicas(observation: Observation) -> int:
    """Allocations Nomad stopped after their restart attempts (failed, still wanted,
    nothing placed in their stead)."""
    return sum(
        1
        for a in observation.allocations
        if a.get("ClientStatus") == "failed"
        and a.get("DesiredStatus") == "run"
        and not a.get("NextAllocation")
    )


def retry(state: StateDocument, observation: Observation) -> Retried:
    """The retry of the model in `state` (folded from `observation`, whose job exists)."""
    job = observation.job or {}
    stale = stale_failed(observation)
    if parked_from_job(job) is not None or job.get("Stop"):
        summary = (
            "parking lifted; the job is starting again"
            if parked_from_job(job)
            else "the stopped job is starting again"
        )
        if stale:
            return Retried(
                retried(state),
                (Unpark(Reason.RETRY, f"{summary}{_renewing(stale)}", renew=True),),
                f"{summary}{_renewing(stale)}",
            )
        return Retried(
            retried(state),
            (
                Unpark(Reason.RETRY, summary),
                Evaluate(Reason.RETRY, "place the stopped replicas again", force_reschedule=True),
            ),
            summary,
        )
    failed = state.update_failed
    if failed is not None and not _kept(observation, failed):
        # Nomad dropped that version (it keeps 6; every scale makes one): nothing to
        # revert to. Forgotten, the next `planner apply` registers the definition again.
        summary = (
            f"definition {failed.definition_hash[:12]}'s job version {failed.job_version} "
            "is no longer kept by Nomad; its rollback is forgotten: run `planner apply` "
            "to roll it out again"
        )
        return Retried(state.model_copy(update={"update_failed": None}), (), summary)
    if failed is not None:
        summary = (
            f"rolling definition {failed.definition_hash[:12]} out again (job "
            f"version {failed.job_version}) beside the one serving"
        )
        return Retried(
            state.model_copy(update={"update_failed": None}),
            (
                Revert(
                    Reason.RETRY,
                    summary,
                    version=failed.job_version,
                    prior_version=observation.job_version,
                ),
            ),
            summary,
        )
    state = forgiven(state)
    stopped = stopped_replicas(observation)
    if stale:
        summary = f"{stopped} stopped replica(s) replaced{_renewing(stale)}"
        return Retried(
            state,
            (Register(Reason.RETRY, summary, renewed(job, observation.job_index)),),
            summary,
        )
    if stopped:
        summary = f"{stopped} stopped replica(s) placed again"
        return Retried(state, (Evaluate(Reason.RETRY, summary, force_reschedule=True),), summary)
    if state.unplaceable is not None:
        summary = "asked the scheduler to place it again"
        return Retried(state, (Evaluate(Reason.RETRY, summary),), summary)
    return Retried(state, (), "not parked, unplaceable or stopped; nothing to retry")


def _renewing(stale: tuple[str, ...]) -> str:
    return (
        f" as a new job version ({len(stale)} of them failed under an older definition, "
        "which a forced reschedule would start again)"
    )


def _kept(observation: Observation, failed: UpdateFailed) -> bool:
    """Nomad still keeps the job version `failed` names, carrying its definition."""
    return any(
        int(v.get("Version") or 0) == failed.job_version
        and definition_of(v) == failed.definition_hash
        for v in observation.versions
    )
