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
  unplaceable                 -> `Evaluate()`
  otherwise                   -> nothing written to Nomad, nothing forgiven

A forced reschedule would place a failed replica of an older definition again, at
its own job version, while the current one rolls out with canaries
(`planner.model.resurrect`, issue 19's QA: D2, D3). When one such replica holds its
place, the job is registered renewed instead (`Unpark(renew=True)`, or `Register` of
the renewed job), and no evaluation is forced: Nomad replaces every allocation with
the current definition. A renewal replaces live allocations too, so it is asked for
only when none is live and Nomad has placed the job's latest registration
(`settled`); otherwise the current definition's rollout is under way, and it is what
replaces the old failed replicas.

Nomad places nothing more for a job version whose deployment failed
(scheduler/reconcile.go: a failed deployment is not place-ready), a forced
reschedule included: a retry of replicas it stopped then renews the job too, when
none is live (issue 19's third QA, D3: with no planner running to park it,
`planner retry` said "1 stopped replica(s) placed again", forgave the count, and
nothing started); with live ones it says so and writes nothing.

A retry forgives counts only when it starts again what was seen failing: a parked
or stopped job, or replicas of the current definition Nomad stopped after their
restarts. A retry while Nomad still restarts a replica forgives nothing (issue 19's
second QA: `planner retry` 1-4 s after `planner apply` of a failing definition reset
the count and renewed the job over the replica apply had just started: 7 starts of
one definition between parks).

The caller checks there is a job (`transition.decide` raises Rejected otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw_contract import StateDocument, UpdateFailed
from planner.model.effects import Effect, Evaluate, Reason, Register, Revert, Unpark
from planner.model.failures import LIVE_CLIENT_STATUSES, forgiven, retried
from planner.model.observation import Observation
from planner.model.parking import parked_from_job
from planner.model.resurrect import renewed, stale_failed
from planner.model.rollout import definition_of, rollout_failed


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
    stopped = stopped_replicas(observation)
    mine = stopped - len(stale)  # the current definition's, seen failing: forgiven
    if stale and (live_replicas(observation) or not settled(observation)):
        summary = (
            f"nothing to retry now: the current definition is rolling out ("
            f"{live_replicas(observation)} replica(s) starting or running); it replaces "
            f"the {len(stale)} failed replica(s) of an older definition"
        )
        return Retried(state, (), summary)
    failed_rollout = bool(mine) and rollout_failed(job, list(observation.deployments))
    if failed_rollout and live_replicas(observation):
        summary = (
            f"{mine} stopped replica(s) not placed again: Nomad's deployment of job version "
            f"{observation.job_version} failed, and Nomad places nothing more for it; a "
            "new version (`planner apply` of a fixed definition) starts them"
        )
        return Retried(state, (), summary)
    state = forgiven(state) if mine else state
    if stale or failed_rollout:
        why = (
            _renewing(stale)
            if stale
            else " as a new job version (Nomad places nothing more for a failed deployment)"
        )
        summary = f"{stopped} stopped replica(s) replaced{why}"
        return Retried(
            state,
            (Register(Reason.RETRY, summary, renewed(job, observation.job_index)),),
            summary,
        )
    if mine:
        summary = f"{mine} stopped replica(s) placed again"
        return Retried(state, (Evaluate(Reason.RETRY, summary, force_reschedule=True),), summary)
    if state.unplaceable is not None:
        summary = "asked the scheduler to place it again"
        return Retried(state, (Evaluate(Reason.RETRY, summary),), summary)
    return Retried(state, (), "not parked, unplaceable or stopped; nothing to retry")


def live_replicas(observation: Observation) -> int:
    """Allocations still wanted whose task runs or may start (pending, running)."""
    return sum(
        1
        for a in observation.allocations
        if a.get("DesiredStatus") == "run" and a.get("ClientStatus") in LIVE_CLIENT_STATUSES
    )


def settled(observation: Observation) -> bool:
    """Nomad's scheduler has handled the job's latest registration: the latest complete
    evaluation was made at its JobModifyIndex or later (structs.Evaluation
    JobModifyIndex). Right after a register, before its evaluation completes, no
    allocation of it exists yet. Without a complete evaluation (garbage-collected after
    an hour: `eval_gc_threshold`) it is taken as handled."""
    evaluation = observation.evaluation
    if evaluation is None:
        return True
    return int(evaluation.get("JobModifyIndex") or 0) >= observation.job_index


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
