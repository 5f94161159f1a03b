"""When a forced reschedule would start a definition git no longer has (pure).

Nomad re-places a failed allocation that a forced reschedule
(`Evaluate(force_reschedule=True)`) marks at that allocation's own job version
while the job's current version rolls out with canaries that are not promoted
(Nomad 1.6.3, scheduler/reconcile.go `computePlacements`: `downgradeNonCanary`,
`minJobVersion`; scheduler/generic_sched.go `downgradedJobForPlacement`: the
newest version whose deployment had no canaries or was promoted). A replica
that failed under an older definition and still holds its place in the count
(failed, still wanted, nothing placed in its stead: Nomad keeps it across a job
stop) is then started again under that older definition, five more times,
and its failures count against no definition the planner judges (issue 19's
QA: D1, lifting parking with a new definition; D2 and D3, `planner retry`
soon after such an apply, the count forgiven, never parked again, the router
answering `model_loading` for ever).

So a forced reschedule is asked for only when every allocation it would place
again is of the job's current definition (`stale_failed` empty). Otherwise the
job is registered renewed (`renewed`): a new job version whose meta differs
from every version an allocation was placed with, which Nomad treats as a
destructive update of each (it compares job meta), so it replaces them all with
the current version, through canaries when the group has them, and never
re-places an old one. Failures of the replacements are of the current
definition and count toward parking as any others do (five starts, then
parked).
"""

from __future__ import annotations

from collections.abc import Iterable

from llmgw_contract import JobMeta
from planner.model.observation import Observation
from planner.model.rollout import definition_of
from planner.vocab import Allocation, Job


def stale_failed(observation: Observation) -> tuple[str, ...]:
    """The IDs of the allocations a forced reschedule of `observation.job` would place
    again whose job version's definition is not the job's current one
    (`failed_elsewhere`); empty without a job."""
    job = observation.job
    if job is None:
        return ()
    return failed_elsewhere(
        definition_of(job), (job, *observation.versions), observation.allocations
    )


def failed_elsewhere(
    definition: str, versions: Iterable[Job], allocations: Iterable[Allocation]
) -> tuple[str, ...]:
    """The IDs, sorted, of the `allocations` a forced reschedule would place again
    (failed, still wanted, not replaced) whose job version is not of `definition`, by
    `versions` (job versions, Nomad's shape: Version, Meta; the first of a number wins).
    A version Nomad no longer keeps (it keeps the last 6: structs.JobTrackedVersions)
    has no known definition: such an allocation counts too."""
    known: dict[int, str] = {}
    for version in versions:
        known.setdefault(int(version.get("Version") or 0), definition_of(version))
    return tuple(
        sorted(
            a["ID"]
            for a in allocations
            if a.get("ClientStatus") == "failed"
            and a.get("DesiredStatus") == "run"
            and not a.get("NextAllocation")
            and known.get(int(a.get("JobVersion") or 0), "") != definition
        )
    )


def renewed(job: Job, job_index: int) -> Job:
    """`job` with `JobMeta.RENEWED` set to `job_index` (the JobModifyIndex it was read
    at, which the registration is checked against: a value no earlier version
    carries): registered, it is a new version that replaces every allocation."""
    meta = {**(job.get("Meta") or {}), JobMeta.RENEWED: str(job_index)}
    return {**job, "Meta": meta}
