"""Activation: a fresh placement answer for a model someone is asking for.

Called by the admin API's `POST /v1/models/{name}/activate` (the router calls
it when a defined model has no passing endpoint) and `POST /v1/usage`.

An activation:
  parked               -> answered at once with the reason (no attempt)
  replicas: 0          -> "stopped" (an always-on model defined with no instances)
  passing somewhere    -> "serving"
  starting already     -> "loading" (an allocation is pending or running; no attempt)
  otherwise            -> clear the old placement answer and make a fresh attempt:
                          scale the group up to its replicas (on-demand, from 0), or
                          force a new evaluation when it is already scaled; then wait
                          for *that* evaluation (at most `EVAL_WAIT`) and answer
                          "unplaceable" with Nomad's reason, or "loading".
Concurrent activations of one model share one attempt (single flight): twenty
clients asking at once make one evaluation, and each later request asks again,
which is what lets a model that fit nowhere an hour ago be placed now.

One planner for now: with two, each would make its own attempt and both would
write the same state (last writer wins, and both writes say the same thing);
the leader election issue makes followers forward here instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from planner.consul_client import ConsulClient
from planner.errors import NomadRejected, Rejected
from planner.nomad_client import Job, NomadClient
from planner.placement import evaluation_reason
from planner.state import StateStore, Unplaceable

log = logging.getLogger("planner.activation")

# An evaluation of one job on a small cluster completes in milliseconds; two
# seconds bounds the router's question, not the scheduler's work.
EVAL_WAIT = 2.0
EVAL_DONE = frozenset({"complete", "failed", "canceled", "blocked"})
GROUP = "server"  # the task group in jobspecs/model.nomad.hcl


@dataclass(frozen=True)
class Answer:
    """What the router is told: status serving | loading | parked | unplaceable | stopped."""

    name: str
    status: str
    reason: str
    last_error: str | None = None
    since: str | None = None
    eval_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ModelNotFound(Rejected):
    pass


def _now() -> datetime:
    return datetime.now(UTC)


def _count(job: Job) -> int:
    return sum(tg.get("Count", 0) for tg in job.get("TaskGroups") or [])


def _starting(allocations: list[dict[str, Any]]) -> bool:
    return any(a.get("DesiredStatus") == "run" and a.get("ClientStatus") in ("pending", "running")
               for a in allocations)


class Activator:
    """Makes and shares fresh placement attempts; records use for idle scale-down."""

    def __init__(self, nomad: NomadClient, consul: ConsulClient, store: StateStore,
                 clock: Callable[[], datetime] = _now, eval_wait: float = EVAL_WAIT) -> None:
        self.nomad, self.consul, self.store = nomad, consul, store
        self.clock = clock
        self.eval_wait = eval_wait
        self._inflight: dict[str, asyncio.Task[Answer]] = {}
        self.attempts = 0  # fresh placement attempts made, for tests and metrics

    async def activate(self, name: str) -> Answer:
        """The answer for `name`, sharing an attempt already in flight. Raises
        ModelNotFound for a model never applied, Unavailable when Nomad is down."""
        task = self._inflight.get(name)
        if task is None:
            task = asyncio.create_task(asyncio.to_thread(self._activate, name))
            self._inflight[name] = task
            task.add_done_callback(lambda _: self._inflight.pop(name, None))
        return await asyncio.shield(task)

    def used(self, names: list[str]) -> None:
        """The router says these models had requests: remember when (idle scale-down)."""
        now = self.clock().isoformat(timespec="seconds")
        records = self.consul.model_records()
        for name in names:
            if name in records:
                state = self.store.load(name)
                self.store.save(state.model_copy(update={"last_used_at": now}))

    def _activate(self, name: str) -> Answer:
        record = self.consul.model_records().get(name)
        if record is None:
            raise ModelNotFound(f"model {name!r} was never applied")
        self.used([name])
        state = self.store.load(name)
        if state.parked:
            return Answer(name, "parked", state.parked.reason, state.parked.last_error,
                          state.parked.since)
        if self.consul.service_health(f"llmgw-{name}").passing > 0:
            return Answer(name, "serving", "an instance passes its health check")
        job = self.nomad.job(name)
        if job is None or job.get("Stop"):
            return Answer(name, "unplaceable", "its Nomad job is not running; run `planner "
                                               "apply` (or `planner retry`) first")
        if not record.get("on_demand") and _count(job) == 0:
            return Answer(name, "stopped", "0 replicas wanted (replicas: 0 in its definition)")
        if _starting(self.nomad.allocations(name)) and not state.unplaceable:
            return Answer(name, "loading", "an instance is starting")
        self.store.save(state.model_copy(update={"unplaceable": None}))
        target = max(int(record.get("replicas", 1)), 1) if record.get("on_demand") else _count(job)
        return self._attempt(name, job, target, state.unplaceable)

    def _attempt(self, name: str, job: Job, target: int,
                 previous: Unplaceable | None) -> Answer:
        """One fresh placement attempt, answered by the evaluation it creates. An
        answer with the previous reason keeps its `since`: unplaceable since then."""
        self.attempts += 1
        if _count(job) < target:
            try:
                eval_id = self.nomad.scale(name, GROUP, target, "llmgw activation")
            except NomadRejected as exc:
                if "active deployment" not in str(exc):
                    raise
                eval_id = self.nomad.evaluate(name)
        else:
            eval_id = self.nomad.evaluate(name)
        log.info("model %s: placement attempt (evaluation %s)", name, (eval_id or "")[:8])
        evaluation = self._wait(eval_id)
        reason = evaluation_reason(evaluation) if evaluation else None
        if reason is None:
            return Answer(name, "loading", "placed; the server is starting", eval_id=eval_id)
        since = previous.since if previous and previous.reason == reason else \
            self.clock().isoformat(timespec="seconds")
        state = self.store.load(name)
        self.store.save(state.model_copy(update={"unplaceable": Unplaceable(
            reason=reason, since=since, eval_id=eval_id)}))
        return Answer(name, "unplaceable", reason, since=since, eval_id=eval_id)

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
