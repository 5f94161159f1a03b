"""Activation: a fresh placement answer for a model someone is asking for.

Called by the admin API's `POST /v1/models/{name}/activate` on the leader
(the router calls it when a defined model has no passing endpoint). Answers
are the contract's `ActivationAnswer`:

  parked               -> at once, with the reason (no attempt)
  job stopped, or replicas: 0 on an always-on model -> "stopped" (no attempt)
  passing somewhere    -> "serving"
  starting already     -> "loading" (an allocation is pending or running; no attempt)
  otherwise            -> clear the old placement answer and make a fresh attempt:
                          scale the group up to its replicas (on-demand, from 0), or
                          force a new evaluation when it is already scaled; then wait
                          for *that* evaluation (at most `EVAL_WAIT`) and answer
                          "unplaceable" with Nomad's reason, or "loading" (placed, or
                          room is being made: `planner.unplaceable`).

Concurrent activations of one model share one attempt (single flight):
twenty clients asking at once make one evaluation, and each later request
asks again, which is what lets a model that fit nowhere an hour ago be
placed now. Only the leader activates (followers forward), so two planners
never make two attempts for one burst.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from llmgw_contract import (
    ActivationAnswer,
    ActivationStatus,
    ModelRecord,
    StateDocument,
    Unplaceable,
    service_name,
)
from planner import unplaceable as unplaced
from planner.actions import parked_from_job
from planner.consul_client import ConsulClient
from planner.errors import NomadRejected, Rejected
from planner.nomad_client import Job, NomadClient, group_count
from planner.state import StateStore
from planner.usage import UsageBook

log = logging.getLogger("planner.activation")

# An evaluation of one job on a small cluster completes in milliseconds; two
# seconds bounds the router's question, not the scheduler's work.
EVAL_WAIT = 2.0
EVAL_DONE = frozenset({"complete", "failed", "canceled", "blocked"})
GROUP = "server"  # the task group in planner/jobspecs/model.nomad.hcl


class ModelNotFound(Rejected):
    pass


def _now() -> datetime:
    return datetime.now(UTC)


def _starting(allocations: list[dict[str, Any]]) -> bool:
    return any(a.get("DesiredStatus") == "run" and a.get("ClientStatus") in ("pending", "running")
               for a in allocations)


class Activator:
    """Makes and shares fresh placement attempts; records use for idle scale-down."""

    def __init__(self, nomad: NomadClient, consul: ConsulClient, store: StateStore,
                 usage: UsageBook, clock: Callable[[], datetime] = _now,
                 eval_wait: float = EVAL_WAIT, datacenters: tuple[str, ...] = ("*",),
                 changed: Callable[[str], None] = lambda name: None) -> None:
        self.nomad, self.consul, self.store, self.usage = nomad, consul, store, usage
        self.changed = changed  # told each model asked for (it may want replicas now)
        self.clock = clock
        self.eval_wait = eval_wait
        self.datacenters = datacenters
        self._inflight: dict[str, asyncio.Task[ActivationAnswer]] = {}
        self.attempts = 0  # fresh placement attempts made, for tests and metrics

    async def activate(self, name: str) -> ActivationAnswer:
        """The answer for `name`, sharing an attempt already in flight. Raises
        ModelNotFound for a model never applied, Unavailable when Nomad is down."""
        task = self._inflight.get(name)
        if task is None:
            task = asyncio.create_task(asyncio.to_thread(self._activate, name))
            self._inflight[name] = task
            task.add_done_callback(lambda _: self._inflight.pop(name, None))
        return await asyncio.shield(task)

    def _activate(self, name: str) -> ActivationAnswer:
        record = self.consul.model_records().get(name)
        if record is None:
            raise ModelNotFound(f"model {name!r} was never applied")
        self.usage.used([name], persist_now=True)
        self.changed(name)
        job = self.nomad.job(name)
        state = self.store.load(name)
        parked = parked_from_job(job) or (state.parked if job is None or job.get("Stop")
                                          else None)
        if parked is not None:
            return ActivationAnswer(name=name, status=ActivationStatus.PARKED,
                                    reason=parked.reason, last_error=parked.last_error,
                                    since=parked.since)
        if self.consul.service_health(service_name(name)).passing > 0:
            return ActivationAnswer(name=name, status=ActivationStatus.SERVING,
                                    reason="an instance passes its health check")
        if job is None or job.get("Stop"):
            return ActivationAnswer(name=name, status=ActivationStatus.STOPPED,
                                    reason="its Nomad job is not running; run `planner apply` "
                                           "(or `planner retry`) first")
        if record.idle_after is None and group_count(job) == 0:
            return ActivationAnswer(name=name, status=ActivationStatus.STOPPED,
                                    reason="0 replicas wanted (replicas: 0 in its definition)")
        short = state.unplaceable if state.unplaceable and not state.unplaceable.provisional \
            else None
        if _starting(self.nomad.allocations(name)) and short is None:
            return ActivationAnswer(name=name, status=ActivationStatus.LOADING,
                                    reason=state.unplaceable.reason if state.unplaceable
                                    else "an instance is starting")
        target = max(record.replicas, 1) if record.idle_after is not None else group_count(job)
        return self._attempt(name, record, job, target, state)

    def _attempt(self, name: str, record: ModelRecord, job: Job, target: int,
                 state: StateDocument) -> ActivationAnswer:
        """One fresh placement attempt, answered by the evaluation it creates. The old
        answer is cleared first; a new one with the same reason keeps its `since`."""
        self.attempts += 1
        self.store.update(name, lambda s: s.model_copy(update={"unplaceable": None}))
        if group_count(job) < target:
            try:
                eval_id = self.nomad.scale(name, GROUP, target, "llmgw activation")
            except NomadRejected as exc:
                if "active deployment" not in str(exc):
                    raise
                eval_id = self.nomad.evaluate(name, force_reschedule=True)
        else:
            # Forced: a replica Nomad stopped after its restart attempts is placed again
            # (it keeps its place in the count otherwise, and nothing would start).
            eval_id = self.nomad.evaluate(name, force_reschedule=True)
        log.info("model %s: placement attempt (evaluation %s)", name, (eval_id or "")[:8])
        evaluation = self._wait(eval_id)
        if evaluation is None:
            return ActivationAnswer(name=name, status=ActivationStatus.LOADING,
                                    reason="placed; the server is starting", eval_id=eval_id)
        answer = unplaced.answer(self.nomad, record, self.nomad.job(name), evaluation,
                                 self.datacenters, self.clock())
        if answer is not None and state.unplaceable is not None and \
                state.unplaceable.reason == answer.reason:
            answer = answer.model_copy(update={"since": state.unplaceable.since})
        self.store.update(name, lambda s: unplaced.with_unplaceable(s, answer))
        return _answer(name, answer, eval_id)

    def _wait(self, eval_id: str | None) -> dict[str, Any] | None:
        """Poll the evaluation until the scheduler is done with it, at most eval_wait s."""
        if not eval_id:
            return None
        deadline = time.monotonic() + self.eval_wait
        while True:
            evaluation = self.nomad.evaluation(eval_id)
            if evaluation.get("Status") in EVAL_DONE or time.monotonic() > deadline:
                return evaluation
            time.sleep(0.05)


def _answer(name: str, unplaceable: Unplaceable | None, eval_id: str | None) -> ActivationAnswer:
    if unplaceable is None:
        return ActivationAnswer(name=name, status=ActivationStatus.LOADING,
                                reason="placed; the server is starting", eval_id=eval_id)
    if unplaceable.provisional:
        return ActivationAnswer(name=name, status=ActivationStatus.LOADING,
                                reason=unplaceable.reason, since=unplaceable.since,
                                eval_id=eval_id)
    return ActivationAnswer(name=name, status=ActivationStatus.UNPLACEABLE,
                            reason=unplaceable.reason, since=unplaceable.since, eval_id=eval_id)


def answers_for_every_status() -> list[ActivationAnswer]:
    """One answer of each kind this module gives (the contract test feeds them to the
    router's reader)."""
    room = Unplaceable(reason="waiting for room", provisional=True)
    short = Unplaceable(reason="memory exhausted on 1 of 1 node")
    return [
        ActivationAnswer(name="m", status=ActivationStatus.PARKED, reason="5 consecutive start "
                         "failures", last_error="Terminated: Exit Code: 1", since="2026-01-01"),
        ActivationAnswer(name="m", status=ActivationStatus.SERVING, reason="passes"),
        ActivationAnswer(name="m", status=ActivationStatus.STOPPED, reason="0 replicas wanted"),
        ActivationAnswer(name="m", status=ActivationStatus.LOADING, reason="an instance is "
                         "starting"),
        _answer("m", None, "e1"), _answer("m", room, "e2"), _answer("m", short, "e3"),
    ]

