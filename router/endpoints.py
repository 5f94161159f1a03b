"""The router's in-memory view: defined models and their passing endpoints.

:class:`EndpointTable` is written only by the watch loops in
:mod:`router.watch` (through :meth:`EndpointTable.set_models` and
:meth:`EndpointTable.set_endpoints`) and read by :mod:`router.proxy` and
:mod:`router.app` on every request, with no I/O and no lock: everything runs
on one event loop and each update swaps whole tuples.

The diffs are pure functions (:func:`diff_models`, :func:`diff_endpoints`)
so unit tests can check them. An endpoint that stays keeps its
:class:`~router.balancer.Endpoint` object, and so its in-flight count; who
left is computed before the list is replaced.

A request for a model with no passing endpoint may wait for one
(:mod:`router.activation`): :meth:`ModelEntry.wait_changed` wakes it on the
next change of endpoints or planner state, so nobody polls the table.

The planner's parked / unplaceable state (:mod:`router.state`) is hung on each
:class:`ModelEntry` as two attributes, so the proxy's check for a model that
is fine is one attribute read. States of models not (yet) defined are kept
and attached when the model appears: the two watches race at startup.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from router.balancer import Endpoint
from router.catalog import ModelDefinition, ServiceAddress
from router.metrics import ModelMetrics, RouterMetrics
from router.state import NO_STATE, ModelState, Parked, Unplaceable

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelsDiff:
    """Model names added, removed, and redefined (different definition)."""

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
    old: Mapping[str, ModelDefinition], new: Mapping[str, ModelDefinition]
) -> ModelsDiff:
    """Compare two ``{name: definition}`` maps; names come back sorted."""
    return ModelsDiff(
        added=tuple(sorted(new.keys() - old.keys())),
        removed=tuple(sorted(old.keys() - new.keys())),
        changed=tuple(sorted(n for n in new.keys() & old.keys() if new[n] != old[n])),
    )


def diff_endpoints(
    current: Sequence[Endpoint], addresses: Iterable[ServiceAddress]
) -> EndpointDiff:
    """Match ``addresses`` against ``current``, reusing the objects that stay."""
    wanted = set(addresses)
    by_address = {e.address: e for e in current}
    kept = tuple(e for e in current if e.address in wanted)
    left = tuple(e for e in current if e.address not in wanted)
    joined = tuple(Endpoint(a) for a in sorted(wanted - by_address.keys()))
    return EndpointDiff(kept=kept, joined=joined, left=left)


class ModelEntry:
    """A defined model as the request path sees it."""

    __slots__ = (
        "_changed", "_ready", "_turn", "definition", "endpoints", "loading_since", "metrics",
        "name", "parked", "unplaceable", "used",
    )  # fmt: skip

    def __init__(
        self, definition: ModelDefinition, metrics: ModelMetrics, state: ModelState = NO_STATE
    ) -> None:
        self.name = definition.name
        self.definition = definition
        self.metrics = metrics
        self.endpoints: tuple[Endpoint, ...] = ()
        self.parked: Parked | None = None
        self.unplaceable: Unplaceable | None = None
        self._turn = 0
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
        self._set_state(state)

    def next_turn(self) -> int:
        """Rotating start index for :func:`router.balancer.pick`."""
        self._turn += 1
        return self._turn

    def _set_endpoints(self, endpoints: tuple[Endpoint, ...]) -> None:
        self.endpoints = endpoints
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

    def _set_state(self, state: ModelState) -> None:
        if state.parked != self.parked:
            if state.parked is not None:
                log.warning("model %s parked: %s", self.name, state.parked.reason)
            else:
                log.info("model %s no longer parked", self.name)
        if state.unplaceable != self.unplaceable:
            if state.unplaceable is not None:
                log.warning("model %s unplaceable: %s", self.name, state.unplaceable.reason)
            else:
                log.info("model %s no longer unplaceable", self.name)
        changed = state.parked != self.parked or state.unplaceable != self.unplaceable
        self.parked = state.parked
        self.unplaceable = state.unplaceable
        if changed:
            self._notify()

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for a passing endpoint; ``True`` if one is.

        The seam for on-demand activation: a caller that asked the planner to
        start the model waits here instead of polling the table.
        """
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
    """Defined models and passing endpoints, kept fresh by :mod:`router.watch`."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics
        self._models: dict[str, ModelEntry] = {}
        self._states: dict[str, ModelState] = {}
        self._models_read = False
        self._states_read = False

    @property
    def synced(self) -> bool:
        """Both the models and their states were read from Consul at least once.

        Until then a parked model could be proxied or told "retry shortly".
        """
        return self._models_read and self._states_read

    def get(self, model: str) -> ModelEntry | None:
        """The entry of a defined ``model``, or ``None`` if it is not defined."""
        return self._models.get(model)

    def entries(self) -> list[ModelEntry]:
        """Every defined model's entry (a copy: safe to iterate across awaits)."""
        return list(self._models.values())

    def definitions(self) -> list[ModelDefinition]:
        """Every defined model, sorted by name."""
        return [self._models[n].definition for n in sorted(self._models)]

    def ready_count(self) -> int:
        """How many defined models have at least one passing endpoint."""
        return sum(1 for entry in self._models.values() if entry.endpoints)

    def set_models(self, definitions: Mapping[str, ModelDefinition]) -> ModelsDiff:
        """Replace the defined models; returns what changed so watches can follow."""
        current = {name: entry.definition for name, entry in self._models.items()}
        diff = diff_models(current, definitions)
        for name in diff.removed:
            entry = self._models.pop(name)
            entry._set_endpoints(())
            self._metrics.model_removed(name)
            log.info("model %s removed from Consul KV", name)
        for name in diff.added:
            state = self._states.get(name, NO_STATE)
            entry = ModelEntry(definitions[name], self._metrics.model_defined(name), state)
            self._models[name] = entry
            log.info("model %s defined (%d replicas)", name, entry.definition.replicas)
        for name in diff.changed:
            self._models[name].definition = definitions[name]
            log.info("model %s redefined (%s)", name, definitions[name].definition_hash)
        self._models_read = True
        return diff

    def set_states(self, states: Mapping[str, ModelState]) -> None:
        """Replace every model's planner state (models absent from ``states`` have none)."""
        self._states = dict(states)
        for name, entry in self._models.items():
            entry._set_state(self._states.get(name, NO_STATE))
        self._states_read = True

    def set_endpoints(self, model: str, addresses: Iterable[ServiceAddress]) -> EndpointDiff | None:
        """Replace ``model``'s passing endpoints; ``None`` if the model is not defined."""
        entry = self._models.get(model)
        if entry is None:
            return None
        diff = diff_endpoints(entry.endpoints, addresses)
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
            entry._set_endpoints(diff.endpoints)
        return diff
