"""Model updates: when Nomad rolled a new definition back, and what that leaves.

The job template rolls a changed definition out beside the old one with Nomad
deployments (`planner/jobspecs/model.nomad.hcl`, `update`): one canary per replica,
promoted automatically once every canary has passed its Consul check for
`min_healthy_time`, and `auto_revert` to the last stable job version when the
deployment fails. A canary's allocation turns unhealthy only when its task is
dead, that is after its restart attempts (5 starts, the planner's count, see
client/allochealth/tracker.go in Nomad 1.6.3), or at the healthy deadline; the
old replicas serve throughout.

A rolled-back definition is known from Nomad, so it survives planner restarts
and a wiped KV: the newest job version that carries the definition is not the
job's current version, and that version's deployment failed. Nomad keeps only
a job's last 6 versions, so it is also known from the state document's
`update_failed`, which survives the versions a scaling model makes
(`recorded_rollback`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from llmgw_contract import JobMeta, StateDocument, UpdateFailed
from planner.model.failures import for_definition
from planner.vocab import Job

# Nomad's deployment status for one that will not complete (structs.DeploymentStatusFailed).
FAILED = "failed"


def definition_of(job: Job) -> str:
    return str((job.get("Meta") or {}).get(JobMeta.DEFINITION_HASH, ""))


def rolled_back(
    versions: list[Job], deployments: list[dict[str, Any]], definition_hash: str
) -> UpdateFailed | None:
    """Pure: the rollback of `definition_hash`, if Nomad rolled it back.

    `versions` are the job's versions newest first (GET /v1/job/:id/versions),
    `deployments` its deployments (GET /v1/job/:id/deployments). Only deployments
    of this incarnation of the job count (same JobCreateIndex: a job purged and
    created again starts its versions over)."""
    if not versions or definition_of(versions[0]) == definition_hash:
        return None
    carrying = next((v for v in versions if definition_of(v) == definition_hash), None)
    if carrying is None:
        return None
    version, created = carrying.get("Version"), versions[0].get("CreateIndex")
    deployment = max(
        (
            d
            for d in deployments
            if d.get("JobVersion") == version and d.get("JobCreateIndex") == created
        ),
        key=lambda d: d.get("CreateIndex", 0),
        default=None,
    )
    if deployment is None or deployment.get("Status") != FAILED:
        return None
    return UpdateFailed(
        definition_hash=definition_hash,
        job_version=int(version or 0),
        reason=deployment.get("StatusDescription") or "deployment failed",
    )


def recorded_rollback(
    recorded: UpdateFailed | None, running: str, definition_hash: str
) -> UpdateFailed | None:
    """Pure: the state document's record of `definition_hash`'s rollback (`recorded`,
    `StateDocument.update_failed`) while the job runs another definition, `running`.

    What `rolled_back` cannot see once Nomad dropped the failed version: it keeps a
    job's last 6 versions (structs.JobTrackedVersions), and every scale, activation or
    idle stop makes one. The record lasts until a retry or another applied definition
    clears it (`planner.model.retry`, `planner.model.fold`)."""
    if recorded is None or recorded.definition_hash != definition_hash:
        return None
    return recorded if running != definition_hash else None


def record_rollback(
    state: StateDocument, failed: UpdateFailed, running: str, now: datetime
) -> StateDocument:
    """The state once `failed` was rolled back and the job runs definition `running`:
    the failed definition's count and last error move into `update_failed`, and the
    replicas are judged by `running` from now on. Recording it again changes nothing."""
    known = state.update_failed
    if known is not None and (known.definition_hash, known.job_version) == (
        failed.definition_hash,
        failed.job_version,
    ):
        return state
    same = state.definition_hash == failed.definition_hash
    failed = failed.model_copy(
        update={
            "consecutive_failures": state.consecutive_failures if same else 0,
            "last_error": state.last_error if same else None,
            "since": now.isoformat(timespec="seconds"),
        }
    )
    return for_definition(state.model_copy(update={"update_failed": failed}), running)


def for_applied(state: StateDocument, applied: str) -> StateDocument:
    """The state as the applied definition `applied` judges replicas: by `applied`,
    unless Nomad rolled `applied` back, then by the definition the job runs (which
    the state already holds). Applying another definition forgets the rollback."""
    failed = state.update_failed
    if failed is not None and failed.definition_hash == applied:
        return state
    if failed is not None:
        state = state.model_copy(update={"update_failed": None})
    return for_definition(state, applied)


def rollout_failed(job: Job, deployments: list[dict[str, Any]]) -> bool:
    """Pure: the latest deployment of the job's current version (in this incarnation:
    same JobCreateIndex) failed. Nomad places nothing more for it (scheduler/reconcile.go:
    a failed deployment is not place-ready) and stops its canaries that were never
    promoted."""
    version, created = job.get("Version"), job.get("CreateIndex")
    mine = [
        d
        for d in deployments
        if d.get("JobVersion") == version and d.get("JobCreateIndex") == created
    ]
    latest = max(mine, key=lambda d: d.get("CreateIndex", 0), default=None)
    return latest is not None and latest.get("Status") == FAILED


def stuck_update(
    job: Job,
    deployments: list[dict[str, Any]],
    allocations: list[dict[str, Any]],
    passing: frozenset[str],
) -> int | None:
    """Pure: the job version to revert to when the job's current version failed its
    deployment and Nomad did not roll it back, because no version was stable yet (an
    update applied before the previous one's deployment had completed), while
    replicas of an earlier version serve. None when there is nothing to do."""
    if not rollout_failed(job, deployments):
        return None
    version = job.get("Version")
    serving = [
        int(a.get("JobVersion") or 0)
        for a in allocations
        if a.get("ID") in passing
        and a.get("DesiredStatus") == "run"
        and a.get("ClientStatus") == "running"
        and a.get("JobVersion") != version
    ]
    return max(serving) if serving else None
