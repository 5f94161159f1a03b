"""Activation: a fresh placement answer for a model someone is asking for.

Called by the admin API's `POST /v1/models/{name}/activate` on the leader
(the router calls it when a defined model has no passing endpoint). The
decision is the model's transition (`decide(..., Event.ACTIVATE, ...)`,
`planner.model.transition`), run by the model's worker
(`planner.daemon.workers`) and written by the applier: activation itself
writes nothing to Nomad. Answers are the contract's `ActivationAnswer`:

  the plan answers at once (parked with its reason, serving, stopped, loading:
  no attempt)  -> that answer
  the plan asks for an attempt (scale the group up to its replicas, or a new
  evaluation; never a forced reschedule: an allocation Nomad stopped after its
  restart attempts is `planner retry`'s alone, issue 19)
               -> wait for the evaluation the applier's answer names (at most
                  `EVAL_WAIT`) and answer "unplaceable" with Nomad's reason when it
                  placed no replica, or "loading" (placed; placed in part, the placed
                  replicas starting: "the replicas placed are starting; wants 2, 1
                  placed: memory exhausted on 1 of 1 node", never a refusal of a model
                  that will serve; or room is being made: `planner.model.unplaceable`).
                  The model is then marked, so its next pass records the answer.

Concurrent activations of one model share one attempt (single flight):
twenty clients asking at once make one evaluation, and each later request
asks again, which is what lets a model that fit nowhere an hour ago be
placed now. Only the leader activates (followers forward), so two planners
never make two attempts for one burst.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from llmgw_contract import (
    ActivationAnswer,
    ActivationStatus,
    Unplaceable,
)
from planner.agents.consul import ConsulClient
from planner.agents.nomad import NomadClient
from planner.agents.state import StateStore
from planner.daemon import placement_answer as unplaced
from planner.daemon import repair
from planner.daemon.applier import Stale
from planner.daemon.usage import UsageBook
from planner.daemon.workers import Guard, Outcome
from planner.errors import NotLeader, Rejected, Unavailable
from planner.model.placement import scale_shortfall
from planner.model.transition import Event
from planner.model.unplaceable import waited_for, with_unplaceable

log = logging.getLogger("planner.daemon.activation")

# An evaluation of one job on a small cluster completes in milliseconds; two
# seconds bounds the router's question, not the scheduler's work.
EVAL_WAIT = 2.0
# One pass of the model (a handful of reads and one write), queued behind at most
# one other of the same model: a Nomad slower than this is answered as unavailable.
PASS_WAIT = 20.0
EVAL_DONE = frozenset({"complete", "failed", "canceled", "blocked"})
# Evaluations whose FailedTGAllocs are the scheduler's answer (a failed or cancelled
# one was never scheduled: it has none, and says nothing of room).
ANSWERED = frozenset({"complete", "blocked"})
GROUP = "server"  # the task group in planner/jobspecs/model.nomad.hcl

Submit = Callable[[str, Event, Guard | None], "concurrent.futures.Future[Outcome]"]


class ModelNotFound(Rejected):
    pass


def _now() -> datetime:
    return datetime.now(UTC)


def not_leading(
    name: str, event: Event, guard: Guard | None = None
) -> concurrent.futures.Future[Outcome]:
    """The `submit` of a planner that does not lead: raises NotLeader."""
    raise NotLeader("this planner does not lead: no worker decides for models here")


class Activator:
    """Asks the model's worker for an activation and waits for its evaluation; records
    use for idle scale-down."""

    def __init__(
        self,
        nomad: NomadClient,
        consul: ConsulClient,
        store: StateStore,
        usage: UsageBook,
        clock: Callable[[], datetime] = _now,
        eval_wait: float = EVAL_WAIT,
        datacenters: tuple[str, ...] = ("*",),
        changed: Callable[[str], None] = lambda name: None,
        submit: Submit = not_leading,
        mark: Callable[[str], None] = lambda name: None,
    ) -> None:
        """`submit` hands an event to the model's worker (the leader's `Workers.submit`);
        `mark` asks for one more pass of the model (`Watcher.mark`)."""
        self.nomad, self.consul, self.store, self.usage = nomad, consul, store, usage
        self.changed = changed  # told each model asked for (it may want replicas now)
        self.clock = clock
        self.eval_wait = eval_wait
        self.datacenters = datacenters
        self.submit = submit
        self.mark = mark
        self._inflight: dict[str, asyncio.Task[ActivationAnswer]] = {}
        self.attempts = 0  # fresh placement attempts made, for tests and metrics

    async def activate(self, name: str) -> ActivationAnswer:
        """The answer for `name`, sharing an attempt already in flight. Raises
        ModelNotFound for a model never applied, Unavailable when Nomad is down or the
        model's job keeps changing under the decision, NotLeader when not leading."""
        task = self._inflight.get(name)
        if task is None:
            task = asyncio.create_task(asyncio.to_thread(self._activate, name))
            self._inflight[name] = task
            task.add_done_callback(lambda _: self._inflight.pop(name, None))
        return await asyncio.shield(task)

    def _activate(self, name: str) -> ActivationAnswer:
        # From the job's meta where KV forgot it (a restarted Consul): "never applied"
        # only when Nomad has no such model either.
        record = repair.record_or_restored(self.nomad, self.consul, self.store, name)
        if record is None:
            raise ModelNotFound(f"model {name!r} was never applied")
        # Used before deciding: an idle scale-down decided from here on is refused
        # (its guard reads this), and one already written is undone by this pass.
        self.usage.used([name], persist_now=True)
        self.changed(name)
        try:
            outcome = self.submit(name, Event.ACTIVATE, None).result(PASS_WAIT)
        except Stale as exc:
            raise Unavailable(
                f"model {name}: its job kept changing while deciding ({exc}); ask again"
            ) from exc
        except concurrent.futures.TimeoutError:
            raise Unavailable(
                f"model {name}: no decision within {PASS_WAIT:.0f} s (Nomad or Consul slow)"
            ) from None
        if outcome.plan.answer is not None:
            return outcome.plan.answer
        self.attempts += 1
        eval_id = outcome.applied.eval_id
        log.info("model %s: placement attempt (evaluation %s)", name, (eval_id or "")[:8])
        evaluation = self._wait(eval_id)
        if evaluation is None:
            return ActivationAnswer(
                name=name,
                status=ActivationStatus.LOADING,
                reason="placed; the server is starting",
                eval_id=eval_id,
            )
        before = outcome.document.unplaceable
        if evaluation.get("Status") not in ANSWERED:
            self.mark(name)
            return unanswered(name, evaluation, before)
        job = self.nomad.job(name)
        waited = waited_for(outcome.document)
        answer = unplaced.answer(
            self.nomad, record, job, evaluation, self.datacenters, self.clock(), waited
        )
        # As the next pass will record it (`since` kept for the same shortfall).
        answer = with_unplaceable(outcome.document, answer).unplaceable
        self.mark(name)  # its next pass records this evaluation's answer
        return activation_answer(name, answer, eval_id)

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


def unanswered(name: str, evaluation: dict[str, Any], kept: Unplaceable | None) -> ActivationAnswer:
    """The answer when the fresh attempt's evaluation gave no placement answer: it
    failed, was cancelled, or is still pending after `eval_wait`. A shortfall told
    before it (kept standing by the activation) answers as it stood, so an unplaceable
    model is still refused at once; else "loading", never "placed" (found in review: a
    failed evaluation has no FailedTGAllocs, and was answered "placed; the server is
    starting")."""
    eval_id = evaluation.get("ID")
    if kept is not None and kept.stands:
        told = kept.model_copy(update={"provisional": False, "standing": False, "waiting": ""})
        if evaluation.get("Status") in EVAL_DONE:
            return activation_answer(name, told, eval_id)
    status = evaluation.get("Status") or "pending"
    state = f"ended {status}" if status in EVAL_DONE else f"is still {status}"
    return ActivationAnswer(
        name=name,
        status=ActivationStatus.LOADING,
        reason=f"the scheduler's evaluation {(eval_id or '')[:8]} {state}; the planner looks again",
        eval_id=eval_id,
    )


def activation_answer(
    name: str, unplaceable: Unplaceable | None, eval_id: str | None
) -> ActivationAnswer:
    """The answer to an activation from its evaluation's placement answer (None: every
    replica placed): "unplaceable" only when it refuses (`Unplaceable.refuses`: settled,
    no replica placed), else "loading" with what is short."""
    if unplaceable is None:
        return ActivationAnswer(
            name=name,
            status=ActivationStatus.LOADING,
            reason="placed; the server is starting",
            eval_id=eval_id,
        )
    if unplaceable.provisional:
        return ActivationAnswer(
            name=name,
            status=ActivationStatus.LOADING,
            reason=unplaceable.told,
            since=unplaceable.since,
            eval_id=eval_id,
        )
    if not unplaceable.refuses:
        # Placed in part: the placed replicas start and will serve, so the request
        # waits for them; what is short stays in the state document (status, metrics).
        short = scale_shortfall(unplaceable.reason, unplaceable.placed, unplaceable.desired)
        return ActivationAnswer(
            name=name,
            status=ActivationStatus.LOADING,
            reason=f"the replicas placed are starting; {short}",
            since=unplaceable.since,
            eval_id=eval_id,
        )
    return ActivationAnswer(
        name=name,
        status=ActivationStatus.UNPLACEABLE,
        reason=unplaceable.reason,
        since=unplaceable.since,
        eval_id=eval_id,
    )


def answers_for_every_status() -> list[ActivationAnswer]:
    """One answer of each kind this module gives (the contract test feeds them to the
    router's reader)."""
    room = Unplaceable(reason="waiting for room", provisional=True)
    short = Unplaceable(reason="memory exhausted on 1 of 1 node")
    part = Unplaceable(
        reason="1 of 2 replicas placed; memory exhausted on 1 of 1 node", placed=1, desired=2
    )
    return [
        ActivationAnswer(
            name="m",
            status=ActivationStatus.PARKED,
            reason="5 consecutive start failures",
            last_error="Terminated: Exit Code: 1",
            since="2026-01-01",
        ),
        ActivationAnswer(name="m", status=ActivationStatus.SERVING, reason="passes"),
        ActivationAnswer(name="m", status=ActivationStatus.STOPPED, reason="0 replicas wanted"),
        ActivationAnswer(
            name="m", status=ActivationStatus.LOADING, reason="an instance is starting"
        ),
        activation_answer("m", None, "e1"),
        activation_answer("m", room, "e2"),
        activation_answer("m", short, "e3"),
        activation_answer("m", part, "e4"),
    ]
