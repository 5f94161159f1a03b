"""The applier: the only writer of Nomad jobs and of state documents after a decision.

Every command and loop of the planner that changes a model's job hands a
`Plan` (`planner.model.transition`) to `Applier.apply`, with the
`Observation` it was decided on. The applier:

1. checks this planner still leads (when fenced: Nomad writes cannot be
   fenced by a Consul transaction, so the check comes right before them);
2. carries out the plan's effects in order. The one job write is checked
   against the job as it was read: `EnforceIndex` with the observed
   JobModifyIndex on register and scale (0: the job must not exist),
   `EnforcePriorVersion` on revert. Nomad refusing that check means the plan
   was decided on an answer that is no longer true: `Stale` is raised and the
   caller observes and decides again;
3. writes `plan.state` with one check-and-set at the observed ModifyIndex
   (fenced by the leader's session): `Stale` again when another writer came
   first. A Nomad write already made stays made: the next decision reads it
   (a parked job's meta is the durable record, `planner.model.parking`).

Effects are idempotent against Nomad by construction: a repeated plan is
refused by its index check, never applied twice.

Two more doors, for writes decided without a state document at an observed
index: `write_job` (the engines' install jobs, `planner apply`'s registrations:
the same index checks, the same `Stale`) and `update` (a pure change of a
state document under check-and-set, for one that is ordered by the job index
it carries, such as `planner.model.parking.set_parked`, and may run again).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmgw_contract import StateDocument
from planner.agents.nomad import Job, NomadClient
from planner.agents.state import Change, StateStore, Updated
from planner.errors import NomadRejected
from planner.model.effects import (
    Deregister,
    Effect,
    Evaluate,
    Park,
    Register,
    Revert,
    Scale,
    Unpark,
)
from planner.model.observation import Observation
from planner.model.parking import parked_job, unparked_job
from planner.model.resurrect import renewed

if TYPE_CHECKING:
    # Only a type here: `transition` imports the decisions, and they the placement
    # views, which import the engines, whose install jobs this module writes.
    from planner.model.transition import Plan

log = logging.getLogger("planner.applier")


class Stale(Exception):
    """The plan was decided on reads that are no longer true (a Nomad index check or
    the document's check-and-set failed): observe and decide again. `written`: the
    plan whose Nomad writes landed before its document's check-and-set failed (None:
    nothing was written), so its caller can still say what was done."""

    def __init__(self, message: str, written: Plan | None = None) -> None:
        super().__init__(message)
        self.written = written


@dataclass
class Applied:
    """What one plan did: the document written, and Nomad's answer to each effect (the
    job writes' {EvalID, JobModifyIndex, ...}; {"EvalID": id} for scale and evaluate)."""

    state: StateDocument
    answers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def eval_id(self) -> str | None:
        """The evaluation of the last effect that created one."""
        ids = [a.get("EvalID") for a in self.answers if a.get("EvalID")]
        return ids[-1] if ids else None


class Applier:
    """`store` None: a writer of jobs only (`write_job`), for a command that writes no
    state document (`planner engines apply`)."""

    def __init__(self, nomad: NomadClient, store: StateStore | None = None) -> None:
        self.nomad, self.store = nomad, store

    def apply(
        self, name: str, before: StateDocument, plan: Plan, observation: Observation
    ) -> Applied:
        """Carry out `plan` for model `name`, decided on `before` (the document read at
        `observation.state_index`) and `observation`. Raises Stale (nothing more done)
        when Nomad or Consul moved since; NotLeader when deposed; NomadRejected for any
        other refusal (e.g. "job scaling blocked due to active deployment")."""
        store = self._store()
        applied = Applied(plan.state)
        state_index = observation.state_index
        parks = any(isinstance(e, Park) for e in plan.effects)
        if parks:
            # What was counted is written before the job is parked, as the document
            # said before this core: otherwise, between the two writes, a reader sees
            # the job parked "after 5 failures" beside a document that counts 4 (found
            # by CI: `status` and the router read both). Then the park, then its record.
            counted = plan.state.model_copy(
                update={"parked": before.parked, "job_index": before.job_index}
            )
            if counted != before:
                if not store.write(name, counted, state_index, before):
                    raise Stale(f"model {name}: its state document changed meanwhile")
                state_index, stored = store.read(name)
                if stored != counted:  # another writer came between: decide again
                    raise Stale(f"model {name}: its state document changed meanwhile")
                before = counted
        answers = self._effects(name, plan.effects, observation.job, observation.job_index)
        applied.answers.extend(answers)
        index = _index_after(answers, observation.job_index)
        if parks or any(isinstance(e, Unpark) for e in plan.effects):
            # The parking the document caches is the job's as of this write.
            applied.state = applied.state.model_copy(update={"job_index": index})
        if applied.state != before and not store.write(name, applied.state, state_index, before):
            raise Stale(
                f"model {name}: its state document changed meanwhile",
                plan if plan.effects else None,
            )
        for note in plan.notes:
            log.log(note.level, "model %s: %s", name, note.text)
        return applied

    def write_job(
        self, job_id: str, effects: Sequence[Effect], job_index: int, job: Job | None = None
    ) -> list[dict[str, Any]]:
        """Carry out `effects` on job `job_id` as it was read at JobModifyIndex
        `job_index` (0: it did not exist; `job`: the job read, which Park and Unpark
        change), with `apply`'s index checks, for a write no state document is decided
        with. Returns Nomad's answers, one per effect. Raises Stale when the job changed
        since (nothing more done), NotLeader when a fenced store's leadership is lost,
        NomadRejected for any other refusal."""
        return self._effects(job_id, effects, job, job_index)

    def update(self, name: str, change: Change) -> Updated:
        """Apply `change` to model `name`'s document under check-and-set (again on a
        conflict: `change` must be pure and ordered by the job index it carries, like
        `planner.model.parking.set_parked`, so a late answer never undoes a newer one)."""
        return self._store().update(name, change)

    def _store(self) -> StateStore:
        if self.store is None:
            raise TypeError("this Applier writes jobs only: it was given no StateStore")
        return self.store

    def _effects(
        self, name: str, effects: Sequence[Effect], job: Job | None, index: int
    ) -> list[dict[str, Any]]:
        if effects and self.store is not None:
            self.store.assert_leading()
        answers = []
        for effect in effects:
            answer = self._write(name, effect, job, index)
            answers.append(answer)
            index = _index_after([answer], index)
        return answers

    def _write(self, name: str, effect: Effect, job: Job | None, index: int) -> dict[str, Any]:
        try:
            return self._call(name, effect, job or {}, index)
        except NomadRejected as exc:
            if _is_index_conflict(exc):
                raise Stale(f"model {name}: {exc}") from exc
            raise

    def _call(self, name: str, effect: Effect, job: Job, index: int) -> dict[str, Any]:
        match effect:
            case Park(parked=parked):
                return self.nomad.register(parked_job(job, parked), enforce_index=index)
            case Unpark(renew=renew):
                new = unparked_job(job)
                return self.nomad.register(
                    renewed(new, index) if renew else new, enforce_index=index
                )
            case Register(job=new):
                return self.nomad.register(new, enforce_index=index)
            case Scale(group=group, count=count, words=words):
                return {
                    "EvalID": self.nomad.scale(
                        name, group, count, f"llmgw: {words}", enforce_index=index
                    )
                }
            case Revert(version=version, prior_version=prior):
                return self.nomad.revert(name, version, prior)
            case Evaluate(force_reschedule=force):
                # Nomad's evaluate takes no index (api/jobs.go, EvalOptions): it follows
                # the plan's job write, or stands alone on a job that needs no change.
                return {"EvalID": self.nomad.evaluate(name, force_reschedule=force)}
            case Deregister(purge=purge):
                # Nomad's deregister takes no index (api/jobs.go, DeregisterOpts): the
                # plan's reads were just checked by the document's CAS at the latest.
                return self.nomad.deregister(name, purge=purge)
        raise TypeError(f"unknown effect {effect!r}")


def _index_after(answers: Sequence[dict[str, Any]], index: int) -> int:
    """The JobModifyIndex after `answers` (a write that made a new version says so)."""
    for answer in answers:
        index = int(answer.get("JobModifyIndex") or index)
    return index


def _is_index_conflict(exc: NomadRejected) -> bool:
    """Nomad's words for a lost EnforceIndex (register, scale) or EnforcePriorVersion
    (revert) check (nomad/job_endpoint.go)."""
    text = str(exc)
    return (
        "Enforcing job modify index" in text
        or "enforcing version" in text.lower()
        or "job exists with conflicting job modify index" in text
    )
