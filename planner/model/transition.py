"""decide(document, observation, event, rules, now) -> Plan: the model's one transition.

Pure: everything it needs was read before (`Observation`), and what it wants
written comes back as values (`Plan`). The same inputs always give the same
plan, so tests drive it with `tests/support/nomad_mock.py` and a fixed `now`,
and the daemon may decide again, on fresh reads, whenever a write is refused.

Every event but TICK first folds the observation into the document
(`planner.model.fold`: parking as the job's meta says, replicas, new failures,
rollbacks, placement), then does what the event asks:

  OBSERVED  the fold's own decisions: park (`Park`), or revert a stuck update
            (`Revert`).
  TICK      replicas passing for the whole stability window reset the counts (it
            reads `observation.passing` and the document); and a model with
            `scaling` follows its demand (`planner.model.autoscale`): a `Scale` when
            due, never while a deployment of the job runs, for a parked or stopped
            job, or one whose update was rolled back.
  RETRY     `planner retry` (`planner.model.retry`); `Plan.summary` says what was
            done, in words. Raises `planner.errors.Rejected` when Nomad has no job.
  ACTIVATE  a request for the model (`planner.model.activate`): `Plan.answer` when
            it can be answered without an attempt, else a `Scale` or a non-forced
            `Evaluate` (answer None: the caller waits for the evaluation and decides
            OBSERVED on it). A park the fold decides comes first (answer parked); a
            stuck update's revert replaces the attempt (answer loading). Raises
            `planner.errors.Rejected` for a model never applied
            (`observation.record` None): callers answer 404 first.
  IDLE      an on-demand model the idle scaler found unused: `Scale(0)`.

Extensions of the interface of a43e503: `Plan.summary` (RETRY's words).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from llmgw_contract import ActivationAnswer, StateDocument
from planner.errors import Rejected
from planner.model import activate, autoscale, fold, retry
from planner.model.effects import Effect, Park, Reason, Register, Scale
from planner.model.failures import Rules, due_stable, headline, stabilize
from planner.model.observation import Observation
from planner.model.unplaceable import settled_shortfall
from planner.vocab import ACTIVE_DEPLOYMENT, GROUP, group_count, with_count


class Event(StrEnum):
    """What asked for a decision."""

    OBSERVED = "observed"  # a Nomad event, a health change or a reconcile: re-read all
    TICK = "tick"  # time passed (stability windows)
    RETRY = "retry"  # `planner retry`
    ACTIVATE = "activate"  # a request for the model (the router, via the admin API)
    IDLE = "idle"  # the idle scaler found it unused for its idle_after


@dataclass(frozen=True)
class Note:
    """A line for the log (and `planner status`), at a `logging` level."""

    level: int
    text: str


@dataclass(frozen=True)
class Plan:
    """The next document, the Nomad writes that go with it (in order), notes, for
    `Event.ACTIVATE` the answer when one can be given without a placement attempt, and
    for `Event.RETRY` what was done in words (`summary`, printed by `planner retry`)."""

    state: StateDocument
    effects: tuple[Effect, ...] = ()
    notes: tuple[Note, ...] = ()
    answer: ActivationAnswer | None = None
    summary: str = ""

    def note(self, text: str, level: int = logging.INFO) -> Plan:
        return dataclasses.replace(self, notes=(*self.notes, Note(level, text)))


def decide(
    document: StateDocument, observation: Observation, event: Event, rules: Rules, now: datetime
) -> Plan:
    """The plan for one model after `event`, given `document` (as stored at
    `observation.state_index`; 0: none stored, the document is a new one) and what
    `observation` read. Raises Rejected for RETRY without a job and ACTIVATE without
    a record (see the module's docstring)."""
    if event is Event.TICK:
        return _tick(document, observation, rules, now)
    folded = fold.fold(document, observation, rules, now)
    notes = tuple(Note(level, text) for level, text in folded.notes)
    if event is Event.OBSERVED:
        return Plan(folded.state, folded.effects, notes)
    if event is Event.RETRY:
        if observation.job is None:
            raise Rejected(
                f"model {observation.name!r} has no Nomad job; run `planner apply` first (a "
                f"parked model's job is registered again still parked), then `planner retry "
                f"{observation.name}`"
            )
        state = folded.state
        if any(isinstance(e, Park) for e in folded.effects):
            # The retry decides instead of the park this look found due: neither its
            # record nor its log line stand (a tester read "parked" from a retry that
            # renewed the job and started it: issue 19's second QA this session).
            state = state.model_copy(update={"parked": document.parked})
            notes = tuple(n for n in notes if not n.text.startswith("parked ("))
        retried = retry.retry(state, observation)
        return Plan(
            retried.state,
            retried.effects,
            (*notes, Note(logging.INFO, retried.summary)),
            summary=retried.summary,
        )
    if event is Event.ACTIVATE:
        if observation.record is None:
            raise Rejected(f"model {observation.name!r} was never applied")
        if any(isinstance(e, Park) for e in folded.effects):  # parking due: at once
            return Plan(
                folded.state, folded.effects, notes, answer=activate.parked_answer(folded.state)
            )
        activated = activate.activate(folded.state, observation, now)
        if folded.effects:  # a stuck update's revert: the one job write of this plan
            return Plan(
                folded.state,
                folded.effects,
                notes,
                answer=activated.answer or activate.reverting(observation.name),
            )
        plan = Plan(activated.state, activated.effects, notes, answer=activated.answer)
        if activated.state.parked is not None and folded.state.parked is None:
            plan = plan.note(
                f"parked ({activated.state.parked.reason}); last error: "
                f"{headline(activated.state.last_error)}",
                logging.ERROR,
            )
        return plan
    if event is Event.IDLE:
        if folded.effects:
            return Plan(folded.state, folded.effects, notes)
        return Plan(folded.state, _idle(observation, folded.state), notes)
    raise ValueError(f"unknown event {event!r}")


def _tick(document: StateDocument, observation: Observation, rules: Rules, now: datetime) -> Plan:
    state = fold.healthy_runs(document, observation.passing)
    now_ns = int(now.timestamp() * 10**9)
    due = due_stable(state, observation.passing, now_ns, rules)
    reset = state.consecutive_failures > 0 and bool(due)
    for alloc_id, entry in due:
        state = stabilize(state, alloc_id, entry)
    plan = Plan(state)
    if reset:
        plan = plan.note(
            f"healthy for {rules.stable_after_ns // 10**9} s; consecutive failures reset"
        )
    return _autoscale(plan, observation, now)


def _autoscale(plan: Plan, observation: Observation, now: datetime) -> Plan:
    """A scaling model's TICK: follow its demand (`planner.model.autoscale`)."""
    record, job, state = observation.record, observation.job, plan.state
    if record is None or record.scaling is None or job is None or job.get("Stop"):
        return plan
    if state.parked is not None:
        return plan
    count = group_count(job)
    short = settled_shortfall(state)
    deployment = _active_deployment(observation)
    # A deployment of a scale-up that fits nowhere runs until room appears
    # (progress_deadline 0: it never fails by itself), so waiting for it would hold the
    # count for good; such a deployment does not block scaling (`_count_write`).
    stuck = deployment is not None and _stuck_on_room(deployment, state)
    blocked = None if deployment is None or stuck else _deployment_words(deployment)
    failed = state.update_failed
    if blocked is None and failed is not None and failed.definition_hash == record.definition_hash:
        # Nomad serves the definition before the applied one: scaling it would follow
        # a job nobody defined; a new apply (or `planner retry`) ends the hold.
        blocked = (
            f"the update to definition {failed.definition_hash[:12]} was rolled back; "
            "scaling waits for a new apply"
        )
    if blocked is None and count > 0 and not observation.passing:
        # More replicas of a model nothing serves would only fail beside the others
        # (each its own 5 starts); fewer would not help it start.
        blocked = "no replica passes its check yet; scaling waits for one that serves"
    scaled = autoscale.decide(
        state.scaling, record.scaling, count, observation.demand, blocked, now
    )
    if scaled.count is not None and scaled.count > count and short is not None:
        # Capacity is honest: what runs keeps serving; a scale-up waits until Nomad's
        # blocked evaluation places what the job already asks for.
        no_room = f"{short.reason} (Nomad places them when room appears)"
        scaled = autoscale.decide(
            state.scaling, record.scaling, count, observation.demand, no_room, now
        )
    plan = dataclasses.replace(plan, state=state.model_copy(update={"scaling": scaled.state}))
    if scaled.count is None:
        return plan
    effect = _count_write(observation, state, Reason.LOAD, scaled.words, scaled.count)
    return dataclasses.replace(plan, effects=(*plan.effects, effect)).note(
        f"scaling {scaled.words}"
    )


def _active_deployment(observation: Observation) -> dict[str, Any] | None:
    """The deployment of this job incarnation that runs, if any: while it does Nomad
    refuses a scale (nomad/job_endpoint.go: "job scaling blocked due to active
    deployment")."""
    created = (observation.job or {}).get("CreateIndex")
    for deployment in observation.deployments:
        if (
            deployment.get("JobCreateIndex") == created
            and deployment.get("Status") in ACTIVE_DEPLOYMENT
        ):
            return deployment
    return None


def _deployment_words(deployment: dict[str, Any]) -> str:
    return (
        f"deployment {str(deployment.get('ID', ''))[:8]} of version "
        f"{deployment.get('JobVersion')} is {deployment.get('Status')}; "
        "scaling waits for it"
    )


def _count_write(
    observation: Observation, state: StateDocument, reason: Reason, words: str, count: int
) -> Effect:
    """The write that sets the job's count: a Scale, or over a deployment stuck on room
    (`_stuck_on_room`) a Register of the job as read with the new count. Nomad refuses a
    scale while a deployment runs ("job scaling blocked due to active deployment"); the
    register writes what the scale would have, and supersedes the stuck deployment
    (Nomad cancels a deployment of an older job version)."""
    deployment = _active_deployment(observation)
    if observation.job and deployment is not None and _stuck_on_room(deployment, state):
        return Register(reason, words, job=with_count(observation.job, GROUP, count))
    return Scale(reason, words, group=GROUP, count=count)


def _stuck_on_room(deployment: dict[str, Any], state: StateDocument) -> bool:
    """A deployment that only waits for replicas Nomad could not place: Nomad's settled
    answer left some unplaced, and it has no canaries (a count change, which Nomad
    deploys as an in-place update of the running replicas; a definition's rollout has
    canaries) and fewer placed than it wants."""
    if settled_shortfall(state) is None:
        return False
    groups = (deployment.get("TaskGroups") or {}).values()
    return bool(groups) and all(
        not g.get("DesiredCanaries")
        and int(g.get("PlacedAllocs") or 0) < int(g.get("DesiredTotal") or 0)
        for g in groups
    )


def _idle(observation: Observation, state: StateDocument) -> tuple[Effect, ...]:
    """Scale an on-demand model's running job to 0 (the idle rule is `planner.daemon.idle`);
    over an activation's deployment stuck on room too (`_count_write`)."""
    record, job = observation.record, observation.job
    if (
        record is None
        or record.idle_after is None
        or job is None
        or job.get("Stop")
        or group_count(job) == 0
    ):
        return ()
    words = f"idle: no request for {record.idle_after} s"
    return (_count_write(observation, state, Reason.IDLE, words, 0),)
