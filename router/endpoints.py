"""The router's in-memory view: defined models, their planner state and passing endpoints.

:class:`EndpointTable` is written only by the watch loops in
:mod:`router.watch` (through :meth:`EndpointTable.set_models`,
:meth:`~EndpointTable.set_services`, :meth:`~EndpointTable.set_states` and
:meth:`~EndpointTable.set_endpoints`) and read by :mod:`router.proxy` and
:mod:`router.app` on every request, with no I/O and no lock: everything runs
on one event loop and each update swaps whole tuples.

**Which models are defined.** The union of two sources: the records under
Consul KV ``llmgw/models/`` and the Consul services named ``llmgw-<model>``
(:func:`router.catalog.parse_services`). A model leaves the table only when
both drop it, so a model that serves is never answered 404 because its KV
record vanished (an operator's ``consul kv delete -recurse llmgw/``, case
C16). A model known only from its service has ``record is None``: it is served
normally, its replica count is unknown.

**A Consul that forgot is not a removal.** A Consul agent that lost its state (a
dev agent restarted, a rebuilt cluster, a restored snapshot) answers with an index
lower than the one the watch had seen (:class:`router.watch.HighWater`). The
records and planner states that such a read drops are *remembered*, not removed:
the model stays defined with its last record and its last state (a parked model
is still refused as parked), and :attr:`ModelEntry.forgotten` names the cause, so a
request that finds no endpoint is answered a retryable 503 that says so
(:mod:`router.refusals`, :mod:`router.activation`), never 404 ``model_not_found``
(issue 20: 13 requests for a serving model were told "does not exist"). A
remembered model is the live one again as soon as its record is back (the leading
planner rewrites every record from the Nomad jobs' meta when it takes the lock,
``planner.daemon.repair``), and is removed :data:`REMEMBER_S` after the reset if
it never comes back (a model pruned meanwhile). A KV wipe (``consul kv delete
-recurse llmgw/``) moves the index forward: nothing is remembered, a serving model
stays defined by its service (C16) and the leader restores the records at once.

The diffs are pure functions (:func:`diff_models`, :func:`diff_endpoints`)
so unit tests can check them. An endpoint that stays keeps its
:class:`~router.endpoint.Endpoint` object, and so its in-flight count and its
limit; who left is computed before the list is replaced. A joining endpoint
starts at the table's default limit and is handed to ``on_joined``
(:class:`router.capacity.CapacityReader`), which may raise it.

A request for a model with no passing endpoint may wait for one
(:mod:`router.activation`): :meth:`ModelEntry.wait_changed` wakes it on the
next change of endpoints or planner state, so nobody polls the table.
Requests waiting for a free slot are in the model's
:class:`~router.admission.Slots`, which the table tells when endpoints change.

The planner's parked / unplaceable state (:class:`llmgw_contract.RoutingDocument`,
read by :func:`router.catalog.parse_states`) is hung on each
:class:`ModelEntry` as two attributes, so the proxy's check for a model that
is fine is one attribute read. States and passing addresses of models not
(yet) defined are kept and attached when the model appears: the watches race
at startup, and the health watch reads each model's instances only when its
checks change (:mod:`router.watch`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from llmgw_contract import ModelRecord, Parked, RoutingDocument, Unplaceable, service_name
from router import collector
from router.admission import Slots
from router.catalog import ServiceAddress
from router.endpoint import Endpoint
from router.metrics import ModelMetrics, RouterMetrics

log = logging.getLogger(__name__)

# How long records and states a Consul reset dropped are remembered at most: a new
# leader restores them at once, and a leader that stayed restores them at its next
# repair (planner.daemon.watcher, every 30 s); twice that and the election, with room.
REMEMBER_S = 120.0

OnJoined = Callable[[Slots, Endpoint], None]
"""Told about every endpoint that starts passing, with its model's slots."""


@dataclass(frozen=True, slots=True)
class ModelsDiff:
    """Model names added, removed, and redefined (a different record, or none)."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class EndpointDiff:
    """What a new passing list does to a model's endpoints."""

    kept: tuple[Endpoint, ...]
    joined: tuple[Endpoint, ...]
    left: tuple[Endpoint, ...]

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        """The new list, in address order."""
        return tuple(sorted(self.kept + self.joined, key=lambda e: e.address))

    def __bool__(self) -> bool:
        return bool(self.joined or self.left)


def diff_models(
    old: Mapping[str, ModelRecord | None], new: Mapping[str, ModelRecord | None]
) -> ModelsDiff:
    """Compare two ``{name: record or None}`` maps; names come back sorted."""
    return ModelsDiff(
        added=tuple(sorted(new.keys() - old.keys())),
        removed=tuple(sorted(old.keys() - new.keys())),
        changed=tuple(sorted(n for n in new.keys() & old.keys() if new[n] != old[n])),
    )


def diff_endpoints(
    current: Sequence[Endpoint], addresses: Iterable[ServiceAddress], limit: int
) -> EndpointDiff:
    """Match ``addresses`` against ``current``, reusing the objects that stay; new
    endpoints start with ``limit`` slots."""
    wanted = set(addresses)
    by_address = {e.address: e for e in current}
    kept = tuple(e for e in current if e.address in wanted)
    left = tuple(e for e in current if e.address not in wanted)
    joined = tuple(Endpoint(a, limit) for a in sorted(wanted - by_address.keys()))
    return EndpointDiff(kept=kept, joined=joined, left=left)


def _told(answer: Unplaceable | None) -> tuple[str, bool, bool] | None:
    """What a placement answer tells a reader of the log: its shortfall, whether it
    stands and whether it refuses. A new evaluation of the same shortfall, or Nomad
    looking again at room while it stands, is not news (found in an audit: every
    router logged each such flip and back)."""
    return None if answer is None else (answer.reason, answer.stands, answer.refuses)


class ModelEntry:
    """A defined model as the request path sees it."""

    __slots__ = (
        "_changed", "_ready", "forgotten", "loading_since", "metrics", "name", "parked",
        "record", "slots", "unplaceable", "used",
    )  # fmt: skip

    def __init__(
        self,
        name: str,
        record: ModelRecord | None,
        metrics: ModelMetrics,
        state: RoutingDocument | None = None,
    ) -> None:
        self.name = name
        self.record = record
        self.metrics = metrics
        self.slots = Slots(metrics)
        self.parked: Parked | None = None
        self.unplaceable: Unplaceable | None = None
        self._ready = asyncio.Event()
        # Replaced on every change, so a waiter that took the current one
        # before checking the entry cannot miss a change (one event loop).
        self._changed = asyncio.Event()
        # Set by the proxy on every request, read and cleared by the usage
        # reporter (router.usage): one attribute write on the hot path.
        self.used = False
        # When this router first asked the planner to start the model in the
        # current loading episode (time.monotonic()); router.activation sets
        # it, a passing endpoint ends the episode.
        self.loading_since: float | None = None
        # Why Consul no longer has its record (a reset: :class:`EndpointTable`), while
        # the table remembers it; None when its record is live (or never was).
        self.forgotten: str | None = None
        self._set_state(state)

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        """The passing endpoints, in address order."""
        return self.slots.endpoints

    @property
    def replicas(self) -> int | None:
        """Replicas its record asks for; ``None`` when only its Consul service is known."""
        return None if self.record is None else self.record.replicas

    def _set_endpoints(self, endpoints: tuple[Endpoint, ...]) -> None:
        self.slots.replace(endpoints)
        self.metrics.endpoints.set(len(endpoints))
        if endpoints:
            self._ready.set()
            self.loading_since = None
        else:
            self._ready.clear()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _set_state(self, state: RoutingDocument | None) -> None:
        parked = None if state is None else state.parked
        unplaceable = None if state is None else state.unplaceable
        if parked != self.parked:
            if parked is not None:
                log.warning("model %s parked: %s", self.name, parked.reason)
            else:
                log.info("model %s no longer parked", self.name)
        if _told(unplaceable) != _told(self.unplaceable):
            if unplaceable is not None:
                what = "waiting for Nomad" if unplaceable.provisional else "unplaceable"
                log.warning("model %s %s: %s", self.name, what, unplaceable.told)
            else:
                log.info("model %s no longer unplaceable", self.name)
        changed = parked != self.parked or unplaceable != self.unplaceable
        self.parked = parked
        self.unplaceable = unplaceable
        if changed:
            self._notify()

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for a passing endpoint; ``True`` if one is."""
        if self.endpoints:
            return True
        try:
            async with asyncio.timeout(timeout_s):
                await self._ready.wait()
        except TimeoutError:
            return False
        return bool(self.endpoints)

    async def wait_changed(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the next change of endpoints or
        planner state (parked / unplaceable); ``False`` on timeout.

        Check the entry, then call this with no ``await`` in between: a change
        made after the check wakes the call.
        """
        event = self._changed
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
        except TimeoutError:
            return False
        return True


class EndpointTable:
    """Defined models and passing endpoints, kept fresh by :mod:`router.watch`.

    ``default_limit`` is the concurrency limit a joining endpoint starts with;
    ``on_joined`` is told about each one (to read its real limit).
    """

    def __init__(
        self, metrics: RouterMetrics, *, default_limit: int = 4, on_joined: OnJoined | None = None
    ) -> None:
        self._metrics = metrics
        self._default_limit = default_limit
        self._on_joined = on_joined
        self._models: dict[str, ModelEntry] = {}
        self._records: dict[str, ModelRecord] = {}
        self._services: frozenset[str] = frozenset()
        self._states: dict[str, RoutingDocument] = {}
        # Every model's passing addresses as last read, defined or not (empty: absent).
        self._addresses: dict[str, tuple[ServiceAddress, ...]] = {}
        self._models_read = self._services_read = self._states_read = False
        # What a Consul reset dropped, kept until it is back or REMEMBER_S passed.
        self._remembered: dict[str, ModelRecord] = {}
        self._kept_states: dict[str, RoutingDocument] = {}
        self._remember_until = 0.0
        self._forgot_cause = ""

    @property
    def synced(self) -> bool:
        """The models, services and states were all read from Consul at least once.

        Until then a parked model could be proxied or told "retry shortly", or a
        serving one (whose KV record is gone) answered 404.
        """
        return self._models_read and self._services_read and self._states_read

    def get(self, model: str) -> ModelEntry | None:
        """The entry of a defined ``model``, or ``None`` if it is not defined."""
        if self._remember_until and time.monotonic() >= self._remember_until:
            self._forget_remembered()
        return self._models.get(model)

    @property
    def remembered(self) -> frozenset[str]:
        """The models defined only because a Consul reset dropped their record."""
        return frozenset(self._remembered)

    def _remember(self, cause: str) -> None:
        self._remember_until = time.monotonic() + REMEMBER_S
        self._forgot_cause = cause

    def _forget_remembered(self) -> None:
        """REMEMBER_S passed since the reset: what did not come back is gone."""
        if self._remembered or self._kept_states:
            log.warning(
                "Consul did not get back the records of %s within %.0f s of its reset; "
                "no longer remembered",
                ", ".join(sorted(self._remembered | self._kept_states)) or "no model",
                REMEMBER_S,
            )
        self._remembered.clear()
        self._kept_states.clear()
        self._remember_until = 0.0
        self._define()
        self._apply_states()

    def entries(self) -> list[ModelEntry]:
        """Every defined model's entry (a copy: safe to iterate across awaits)."""
        return list(self._models.values())

    def names(self) -> list[str]:
        """Every defined model's name, sorted."""
        return sorted(self._models)

    def ready_count(self) -> int:
        """How many defined models have at least one passing endpoint."""
        return sum(1 for entry in self._models.values() if entry.endpoints)

    def set_models(
        self, records: Mapping[str, ModelRecord], consul_reset: bool = False
    ) -> ModelsDiff:
        """Replace the KV records; returns what changed so watches can follow.
        ``consul_reset``: read from a Consul whose index went back (it lost its state):
        the records this read drops are remembered (the module's docstring)."""
        if consul_reset:
            dropped = {n: r for n, r in self._records.items() if n not in records}
            if dropped:
                self._remember("Consul lost its record (its state was reset)")
                self._remembered.update(dropped)
                log.warning(
                    "Consul's index went back (it lost its state): remembering the records "
                    "of %s until the planner writes them again (at most %.0f s)",
                    ", ".join(sorted(dropped)),
                    REMEMBER_S,
                )
        back = [n for n in records if n in self._remembered]
        for name in back:
            del self._remembered[name]
            self._kept_states.pop(name, None)
            log.info("model %s: its Consul KV record is back", name)
        self._records = dict(records)
        self._models_read = True
        diff = self._define()
        if back:
            self._apply_states()
        return diff

    def set_services(self, models: Iterable[str]) -> ModelsDiff:
        """Replace the models that have an ``llmgw-<model>`` Consul service."""
        self._services = frozenset(models)
        self._services_read = True
        return self._define()

    def set_states(
        self,
        states: Mapping[str, RoutingDocument],
        consul_reset: bool = False,
        present: Collection[str] = (),
    ) -> None:
        """Replace every model's planner state (models absent from ``states`` have none).
        ``consul_reset``: as for :meth:`set_models`; the states this read drops are kept
        until the model's record or routing key is back. ``present``: the models with a
        routing key in the read (:attr:`router.states.StateView.present`), parked or not;
        a key back ends what a reset kept whatever its document says (a model the
        planner un-parked meanwhile is not refused as parked)."""
        if consul_reset:
            dropped = {n: d for n, d in self._states.items() if n not in states}
            if dropped:
                self._remember("Consul lost its routing document (its state was reset)")
                self._kept_states.update(dropped)
        # Only the entries whose state changed are touched: the catalog hands back
        # the same object for a document that did not change (router.states).
        previous = self._states
        changed = {
            n for n in previous.keys() | states.keys() if previous.get(n) is not states.get(n)
        }
        for name in states.keys() | set(present):
            if self._kept_states.pop(name, None) is not None:
                changed.add(name)
        self._states = dict(states)
        self._apply_states(changed)
        self._states_read = True

    def _apply_states(self, names: Iterable[str] | None = None) -> None:
        """Hang each model's state (or the one a Consul reset dropped) on its entry:
        every entry's, or those of ``names``."""
        models = self._models
        for name in models if names is None else names:
            entry = models.get(name)
            if entry is not None:
                entry._set_state(self._states.get(name) or self._kept_states.get(name))

    def set_endpoints(self, model: str, addresses: Iterable[ServiceAddress]) -> EndpointDiff | None:
        """Replace ``model``'s passing endpoints; ``None`` if the model is not defined
        (the addresses are kept, and become its endpoints when it is)."""
        addresses = tuple(addresses)
        if addresses:
            self._addresses[model] = addresses
        else:
            self._addresses.pop(model, None)
        entry = self._models.get(model)
        if entry is None:
            return None
        diff = diff_endpoints(entry.endpoints, addresses, self._default_limit)
        if diff or not entry.endpoints:
            for gone in diff.left:
                log.info(
                    "model %s: endpoint %s left (%d in flight finish there)",
                    model,
                    gone.base_url,
                    gone.inflight,
                )
            for new in diff.joined:
                log.info("model %s: endpoint %s passing", model, new.base_url)
            # Told before they are published: publishing hands queued requests to
            # them at once, so a limit lowered afterwards came too late (found in
            # review: a wedged replica joining under a queue got 4 requests, not 1).
            if self._on_joined is not None:
                for new in diff.joined:
                    self._on_joined(entry.slots, new)
            entry._set_endpoints(diff.endpoints)
        return diff

    def _define(self) -> ModelsDiff:
        """Make the table's models the union of KV records and Consul services."""
        names = self._records.keys() | self._services | self._remembered.keys()
        wanted = {name: self._records.get(name) or self._remembered.get(name) for name in names}
        current = {name: entry.record for name, entry in self._models.items()}
        diff = diff_models(current, wanted)
        for name in diff.removed:
            entry = self._models.pop(name)
            entry._set_endpoints(())
            self._metrics.model_removed(name)
            log.info("model %s removed: no Consul KV record and no Consul service", name)
        for name in diff.added:
            record = wanted[name]
            metrics = self._metrics.model_defined(name)
            state = self._states.get(name) or self._kept_states.get(name)
            self._models[name] = ModelEntry(name, record, metrics, state)
            log.info("model %s defined (%s)", name, _describe(name, record))
            if name in self._addresses:
                self.set_endpoints(name, self._addresses[name])
        for name in diff.changed:
            entry = self._models[name]
            record = wanted[name]
            if record is None:
                log.warning(
                    "model %s: its Consul KV record is gone; still serving it from its "
                    "Consul service",
                    name,
                )
            else:
                log.info("model %s redefined (%s)", name, _describe(name, record))
            entry.record = record
        for name, entry in self._models.items():
            entry.forgotten = self._forgot_cause if name in self._remembered else None
        if diff.added or diff.removed:
            # Their long-lived objects (series, slots) out of the collector's walks.
            collector.settle()
        return diff


def _describe(name: str, record: ModelRecord | None) -> str:
    if record is None:
        return f"only its Consul service {service_name(name)}: no KV record"
    return f"{record.replicas} replicas, definition {record.definition_hash}"
