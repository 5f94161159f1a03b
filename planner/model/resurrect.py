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

from collections.abc import Iterable, Mapping

from llmgw_contract import JobMeta
from planner.model.observation import Observation
from planner.model.rollout import definition_of
from planner.vocab import Allocation, Job

# The most allocations whose own job one observation reads (`unknown_failed`): each is
# one GET /v1/allocation/:id. Nomad re-places at most a group's count of them, and one
# left unread counts as of an older definition (a renewal, never a wrong reschedule).
MAX_OWN_READS = 8


def stale_failed(observation: Observation) -> tuple[str, ...]:
    """The IDs of the allocations a forced reschedule of `observation.job` would place
    again whose job version's definition is not the job's current one
    (`failed_elsewhere`, with `observation.own_definitions`); empty without a job."""
    job = observation.job
    if job is None:
        return ()
    return failed_elsewhere(
        definition_of(job),
        (job, *observation.versions),
        observation.allocations,
        observation.own_definitions,
    )


def _rescheduled(allocation: Allocation) -> bool:
    """Failed, still wanted, not replaced: what a forced reschedule places again."""
    return (
        allocation.get("ClientStatus") == "failed"
        and allocation.get("DesiredStatus") == "run"
        and not allocation.get("NextAllocation")
    )


def held_places(allocations: Iterable[Allocation]) -> tuple[str, ...]:
    """The IDs, sorted, of the allocations that hold their place in the count failed
    (failed, still wanted, not replaced), of any version: Nomad keeps them across a
    job stop, and a registration whose job equals theirs (the same definition again,
    A -> B -> A) is no update of them, so it places nothing (issue 19's third QA: A
    parked again 0.3 s later, 0 starts)."""
    return tuple(sorted(a["ID"] for a in allocations if _rescheduled(a)))


def _known(versions: Iterable[Job]) -> dict[int, str]:
    known: dict[int, str] = {}
    for version in versions:
        known.setdefault(int(version.get("Version") or 0), definition_of(version))
    return known


def failed_elsewhere(
    definition: str,
    versions: Iterable[Job],
    allocations: Iterable[Allocation],
    own: Mapping[str, str] | None = None,
) -> tuple[str, ...]:
    """The IDs, sorted, of the `allocations` a forced reschedule would place again
    (failed, still wanted, not replaced) whose job version is not of `definition`, by
    `versions` (job versions, Nomad's shape: Version, Meta; the first of a number wins).
    A version Nomad no longer keeps (it keeps the last 6: structs.JobTrackedVersions;
    every scale or activation makes one) is judged by `own` (allocation ID -> the
    definition hash of the allocation's own job, `unknown_failed`'s reads); one
    without either counts too."""
    known, own = _known(versions), own or {}
    return tuple(
        sorted(
            a["ID"]
            for a in allocations
            if _rescheduled(a)
            and known.get(int(a.get("JobVersion") or 0), own.get(a["ID"], "")) != definition
        )
    )


def unknown_failed(versions: Iterable[Job], allocations: Iterable[Allocation]) -> tuple[str, ...]:
    """The IDs, sorted, at most MAX_OWN_READS, of the allocations a forced reschedule
    would place again whose job version is none of `versions`: the ones whose own job
    (GET /v1/allocation/:id, its Meta) `failed_elsewhere` needs to judge them."""
    known = _known(versions)
    return tuple(
        sorted(
            a["ID"]
            for a in allocations
            if _rescheduled(a) and int(a.get("JobVersion") or 0) not in known
        )
    )[:MAX_OWN_READS]


def renewed(job: Job, job_index: int) -> Job:
    """`job` with `JobMeta.RENEWED` set to `job_index` (the JobModifyIndex it was read
    at, which the registration is checked against: a value no earlier version
    carries): registered, it is a new version that replaces every allocation."""
    meta = {**(job.get("Meta") or {}), JobMeta.RENEWED: str(job_index)}
    return {**job, "Meta": meta}


def renewal_kept(job: Job, old: Job | None) -> Job:
    """`job` (rendered from git, without `JobMeta.RENEWED`) carrying the renewal marker
    of `old` (the registered job) when both are of the same definition: without it,
    Nomad sees a meta change, a destructive update of every allocation (canaries for
    each), where a change of count or scaling bounds is an in-place one (reviewer's
    finding on issue 19's QA fix). Another definition replaces every allocation
    anyway, and drops the marker."""
    marker = ((old or {}).get("Meta") or {}).get(JobMeta.RENEWED)
    if marker is None or old is None or definition_of(old) != definition_of(job):
        return job
    return {**job, "Meta": {**(job.get("Meta") or {}), JobMeta.RENEWED: marker}}
