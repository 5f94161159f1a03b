"""Activation as a decision (pure): an answer now, or one placement attempt.

Ported from `planner.daemon.activation.Activator._activate`; the order of answers:

  parked                      -> PARKED, with the reason (no attempt)
  passing somewhere           -> SERVING (while the job asks for a replica: an idle
                                 scale-down's draining replica serves no new request)
  job missing or stopped      -> STOPPED ("run `planner apply` (or `planner retry`)")
  replicas: 0, always on      -> STOPPED
  every wanted replica of the current definition stopped by Nomad after its restart
  attempts                    -> `Park` (reason ALL_STOPPED) and PARKED: nothing would
                                 start again without a forced reschedule, which is
                                 `planner retry`'s alone (issue 19: a 6th start). Decided
                                 from what Nomad shows, not from whether the daemon has
                                 counted the last failure yet.
  starting already            -> LOADING (an allocation pending or running, the job
                                 asking for a replica, and no standing shortfall)
  otherwise                   -> an attempt: the old placement answer cleared, then
                                 `Scale(GROUP, target)` when the job wants fewer than the
                                 target, else `Evaluate(force_reschedule=False)`; no
                                 answer: the caller waits for that evaluation and
                                 answers from it (`planner.daemon.activation._answer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from llmgw_contract import ActivationAnswer, ActivationStatus, Parked, StateDocument, Unplaceable
from planner.model import fold
from planner.model.effects import Effect, Evaluate, Park, Reason, Scale
from planner.model.observation import Observation
from planner.model.parking import parked_from_job
from planner.vocab import GROUP, group_count

ASKED_AGAIN = "waiting for the scheduler's answer to a fresh placement attempt"

__all__ = ["GROUP", "Activated", "Reason", "activate", "parked_answer", "reverting"]


@dataclass(frozen=True)
class Activated:
    state: StateDocument
    effects: tuple[Effect, ...] = ()
    answer: ActivationAnswer | None = None


def parked_answer(state: StateDocument) -> ActivationAnswer | None:
    parked = state.parked
    if parked is None:
        return None
    return ActivationAnswer(
        name=state.name,
        status=ActivationStatus.PARKED,
        reason=parked.reason,
        last_error=parked.last_error,
        since=parked.since,
    )


def reverting(name: str) -> ActivationAnswer:
    """The answer while a failed update is rolled back to the version that serves."""
    return ActivationAnswer(
        name=name, status=ActivationStatus.LOADING, reason="a failed update is being rolled back"
    )


def _starting(allocations: tuple[dict[str, Any], ...]) -> bool:
    return any(
        a.get("DesiredStatus") == "run" and a.get("ClientStatus") in ("pending", "running")
        for a in allocations
    )


def activate(state: StateDocument, observation: Observation, now: datetime) -> Activated:
    """The activation of the model in `state` (folded from `observation`, whose record
    exists)."""
    record, job = observation.record, observation.job
    assert record is not None  # checked by transition.decide
    name = observation.name
    parked = parked_from_job(job) or (state.parked if job is None or job.get("Stop") else None)
    if parked is not None:
        return Activated(
            state,
            answer=ActivationAnswer(
                name=name,
                status=ActivationStatus.PARKED,
                reason=parked.reason,
                last_error=parked.last_error,
                since=parked.since,
            ),
        )
    # A job that asks for no replica (an idle scale-down just written) serves nothing
    # whatever still passes or runs: its replica is being stopped, and only a scale up
    # keeps the one this request asks for (found by CI: an activation right after an
    # idle scale-down was answered "serving" from a draining replica, and the model
    # stayed at 0).
    wanted = job is not None and not job.get("Stop") and group_count(job) > 0
    if observation.passing and wanted:
        return Activated(
            state,
            answer=ActivationAnswer(
                name=name,
                status=ActivationStatus.SERVING,
                reason="an instance passes its health check",
            ),
        )
    if job is None or job.get("Stop"):
        return Activated(
            state,
            answer=ActivationAnswer(
                name=name,
                status=ActivationStatus.STOPPED,
                reason="its Nomad job is not running; run `planner apply` (or `planner retry`) "
                "first",
            ),
        )
    count = group_count(job)
    if record.idle_after is None and count == 0:
        return Activated(
            state,
            answer=ActivationAnswer(
                name=name,
                status=ActivationStatus.STOPPED,
                reason="0 replicas wanted (replicas: 0 in its definition)",
            ),
        )
    if fold.stopped_by_nomad(state, observation):
        return _park_stopped(state, now)
    short = state.unplaceable if state.unplaceable and not state.unplaceable.provisional else None
    if wanted and _starting(observation.allocations) and short is None:
        return Activated(
            state,
            answer=ActivationAnswer(
                name=name,
                status=ActivationStatus.LOADING,
                reason=state.unplaceable.told if state.unplaceable else "an instance is starting",
            ),
        )
    target = max(record.replicas, 1) if record.idle_after is not None else count
    # An idle job (count 0) asks for nothing: an answer kept from before is history.
    kept = _asked_again(state.unplaceable) if count > 0 else None
    state = state.model_copy(update={"unplaceable": kept})
    if count < target:
        return Activated(
            state, (Scale(Reason.ACTIVATION, "activation", group=GROUP, count=target),)
        )
    return Activated(
        state,
        (
            Evaluate(
                Reason.ACTIVATION, "activation: a fresh placement attempt", force_reschedule=False
            ),
        ),
    )


def _park_stopped(state: StateDocument, now: datetime) -> Activated:
    reason = (
        f"every replica stopped by Nomad after its restart attempts "
        f"({state.consecutive_failures} consecutive start failures counted)"
    )
    parked = Parked(
        reason=reason,
        last_error=state.last_error,
        since=now.isoformat(timespec="seconds"),
        definition_hash=state.definition_hash,
    )
    state = state.model_copy(update={"parked": parked})
    return Activated(
        state, (Park(Reason.ALL_STOPPED, reason, parked=parked),), parked_answer(state)
    )


def _asked_again(short: Unplaceable | None) -> Unplaceable | None:
    """The placement answer while a fresh attempt is evaluated: provisional (the router
    waits for the new answer instead of refusing on the last), and standing when the last
    was told, so the next answer continues it (`with_unplaceable`). Cleared instead, a
    told shortfall restarted its `since`, dropped its series to 0 and was logged again
    at every activation (found in review)."""
    if short is None:
        return None
    return short.model_copy(
        update={"provisional": True, "standing": short.stands, "waiting": ASKED_AGAIN}
    )
