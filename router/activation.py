"""On-demand activation: what a request gets when its model has no passing endpoint.

:class:`Activator` is the router's default :data:`router.proxy.NoEndpoint`
policy, built by :func:`router.app.create_app` and called by the proxy only
for a defined model with no passing endpoint, so a model that is serving
never reaches this module. It:

1. refuses a model whose Consul KV state says parked (503 ``model_parked``)
   without asking the planner: only an operator lifts that;
2. asks the planner to activate the model (:mod:`router.plannerapi`). Every
   request asks again, because asking is what makes the planner retry: a
   model that fit nowhere an hour ago may fit now. Requests that arrive while
   a call for the same model is in flight share it (one call per model per
   router at a time);
3. acts on the answer (an :class:`llmgw_contract.ActivationAnswer`; every
   :class:`llmgw_contract.ActivationStatus` has an outcome here, and
   tests/unit/contract/test_router_reads.py proves it): ``parked``, ``unplaceable``
   and ``stopped`` are refused at once with the planner's reason (503
   ``model_parked``, ``model_unplaceable``, ``model_stopped``); ``serving`` and
   ``loading`` hold the request up to the activation window, measured from
   when this request found no endpoint (the activate call included), and
   forward it as soon as an endpoint passes. The planner unreachable, or an
   answer outside the contract, is 503 ``planner_unavailable`` within the
   call's timeout (a refused connection: at once). For a model the table
   remembers after Consul lost its record (``ModelEntry.forgotten``), the planner
   unreachable or not knowing it (yet) is the retryable 503 that names the cause
   (:func:`router.refusals.forgotten`), never 404.

While a request waits, a change wakes it (:meth:`ModelEntry.wait_changed`,
set by the Consul watches), rather than a poll of the table: the table only
changes on a watch update, so a poll would spend wake-ups on nothing and add
up to its interval to every cold start. On each wake-up it checks, in order:
the model was removed (404); parked (503 ``model_parked`` at once, not at the
end of the window); a passing endpoint (forward); an unplaceable record
other than the one the router held when the planner answered (503: that is
Nomad's answer to the fresh attempt; the one held before may be the stale
record the planner has just cleared, not yet seen by the watch). Only a record
that refuses (:attr:`llmgw_contract.Unplaceable.refuses`) is refused on: a
*provisional* one (allocations on the cluster are stopping: room is being
made, and Nomad's blocked evaluation places the model when they end), or one
that placed some replicas (placed in part: they start and will serve), keeps
the request waiting, as for ``loading``.

A window that runs out is 503 ``model_loading`` with ``Retry-After``; its
message says for how long the model has been loading, measured from this
router's first activate call of the current loading episode
(``ModelEntry.loading_since``, ended by a passing endpoint), so a client
retrying for minutes sees the whole wait, not its last 45 s; or, while the
record is provisional, that room is being made.

A client that disconnects while waiting cancels its request task
(:class:`router.streaming.DisconnectWatch`); the wait ends with it, and a
shared activate call it was awaiting is shielded, so the other requests
sharing it keep their answer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from llmgw_contract import ActivationAnswer, ActivationStatus, Parked, Unplaceable
from router import errors, refusals
from router.endpoints import EndpointTable, ModelEntry
from router.metrics import ACTIVATION_ERROR
from router.plannerapi import PlannerAPI

log = logging.getLogger(__name__)

# Retry-After of a model_loading refusal: a load that outlived the window is
# usually seconds from done, and each retry asks the planner again.
LOADING_RETRY_AFTER_S = 5


def refusal_for(model: str, answer: ActivationAnswer) -> errors.ModelUnavailable | None:
    """The at-once refusal an activate answer means, or ``None`` for "wait for an
    endpoint" (``serving``, ``loading``)."""
    status = answer.status
    if status is ActivationStatus.PARKED:
        parked = Parked(
            reason=answer.reason or "parked by the planner",
            last_error=answer.last_error,
            since=answer.since or "",
        )
        return refusals.parked(model, parked)
    if status is ActivationStatus.UNPLACEABLE:
        unplaceable = Unplaceable(
            reason=answer.reason or "no node fits it", since=answer.since or ""
        )
        return refusals.unplaceable(model, unplaceable)
    if status is ActivationStatus.STOPPED:
        return refusals.stopped(model, answer.reason)
    return None


class Activator:
    """The activating :data:`router.proxy.NoEndpoint` policy for one router."""

    def __init__(
        self,
        table: EndpointTable,
        api: PlannerAPI,
        *,
        window_s: float,
        retry_after_s: int = LOADING_RETRY_AFTER_S,
    ) -> None:
        self.table = table
        self.api = api
        self.window_s = window_s
        self.retry_after_s = retry_after_s
        self._inflight: dict[str, asyncio.Task[ActivationAnswer]] = {}

    async def __call__(self, entry: ModelEntry) -> None:
        """Return once ``entry`` has a passing endpoint, or raise the refusal."""
        started = time.monotonic()
        if entry.parked is not None:
            entry.loading_since = None
            raise refusals.parked(entry.name, entry.parked)
        # Asking counts as use: an activated model must not look idle to the
        # planner before its first request is served.
        entry.used = True
        held_unplaceable = entry.unplaceable
        # What the table knew when the planner was asked: the record may come back while
        # the question is in flight, and the answer is then from before it.
        forgotten = entry.forgotten
        try:
            answer = await self._ask(entry)
        except (errors.PlannerUnavailable, errors.ModelNotFound) as exc:
            cause = entry.forgotten or forgotten
            if cause is None:
                raise
            # Consul lost the model's record: the planner may not lead yet, or lead and
            # not have rewritten it; neither means the model is gone (issue 20). Judged
            # by the table as it was asked too (found by CI: the new leader's planner
            # answered "never applied" just before it restored the record, and the
            # answer, arriving just after, was a 404 for a model being served).
            raise refusals.forgotten(entry, exc.message, cause) from None
        refusal = refusal_for(entry.name, answer)
        if refusal is not None:
            entry.loading_since = None
            raise refusal
        if entry.loading_since is None:
            entry.loading_since = started
            log.info(
                "model %s: no passing endpoint; planner says %s%s; holding requests up to %g s",
                entry.name,
                answer.status,
                f" ({answer.reason})" if answer.reason else "",
                self.window_s,
            )
        try:
            await self._wait(entry, started, held_unplaceable, answer)
        finally:
            entry.metrics.activation_wait.observe(time.monotonic() - started)

    async def _wait(
        self,
        entry: ModelEntry,
        started: float,
        held_unplaceable: Unplaceable | None,
        answer: ActivationAnswer,
    ) -> None:
        deadline = started + self.window_s
        while True:
            if self.table.get(entry.name) is not entry:
                raise errors.ModelNotFound(entry.name)
            if entry.parked is not None:
                raise refusals.parked(entry.name, entry.parked)
            if entry.endpoints:
                return
            fresh = entry.unplaceable
            if fresh is not None and fresh.refuses and fresh != held_unplaceable:
                raise refusals.unplaceable(entry.name, fresh)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._loading(entry, started, answer)
            # No await between the checks above and taking the entry's
            # current change event inside wait_changed: nothing is missed.
            await entry.wait_changed(remaining)

    def _loading(
        self, entry: ModelEntry, started: float, answer: ActivationAnswer
    ) -> errors.ModelLoading:
        now = time.monotonic()
        if entry.unplaceable is not None and entry.unplaceable.provisional:
            waited = (
                f" This request waited {now - started:.0f} s (the router's activation "
                f"window is {self.window_s:g} s)."
            )
            return refusals.room_being_made(
                entry.name, entry.unplaceable, self.retry_after_s, waited
            )
        loading_for = now - (entry.loading_since or started)
        planner = f" (planner: {answer.reason})" if answer.reason else ""
        message = (
            f"The model `{entry.name}` is loading{planner}: this router first asked the "
            f"planner to start it {loading_for:.0f} s ago, and no replica has passed its "
            f"health check yet. This request waited {now - started:.0f} s (the router's "
            f"activation window is {self.window_s:g} s). Retry in {self.retry_after_s} s."
        )
        return errors.ModelLoading(entry.name, message, self.retry_after_s)

    async def _ask(self, entry: ModelEntry) -> ActivationAnswer:
        """The answer of the model's in-flight activate call, starting one if none is."""
        task = self._inflight.get(entry.name)
        if task is None:
            task = asyncio.ensure_future(self._call(entry))
            self._inflight[entry.name] = task
            task.add_done_callback(functools.partial(self._finished, entry.name))
        # Shielded: a waiter whose client left must not cancel the others' answer.
        return await asyncio.shield(task)

    async def _call(self, entry: ModelEntry) -> ActivationAnswer:
        try:
            answer = await self.api.activate(entry.name)
        except errors.RouterError as exc:
            entry.metrics.activations[ACTIVATION_ERROR].inc()
            log.warning("model %s: activation failed: %s", entry.name, exc.message)
            raise
        entry.metrics.activations[answer.status].inc()
        log.debug("model %s: planner answered %s (%s)", entry.name, answer.status, answer.reason)
        return answer

    def _finished(self, model: str, task: asyncio.Task[ActivationAnswer]) -> None:
        if self._inflight.get(model) is task:
            del self._inflight[model]
        if not task.cancelled():
            # Retrieved here, so a call every waiter left does not log
            # "exception was never retrieved".
            task.exception()

    async def close(self) -> None:
        """Cancel activate calls still in flight (shutdown)."""
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
