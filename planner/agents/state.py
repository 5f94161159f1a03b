"""Per-model state documents in Consul KV, changed only by check-and-set.

Called by the watcher (failures, parking, placement), `apply` and `retry`
(parking), activation (placement answers) and the status views (reads). The
document is `llmgw_contract.StateDocument` at `llmgw/state/<name>`; the
router reads its part of it, `llmgw_contract.RoutingDocument` at
`llmgw/routing/<name>`, written in the same transaction when that part changes.

Every change goes through `StateStore.update(name, change)`: read the
document and its ModifyIndex, compute `change(document)` (a pure function: it
may run more than once), and write with `?cas=<index>` (Consul KV API,
"Check-And-Set"). When another writer got there first, Consul answers false
and the update starts over from the fresh document; so a usage report, a
`planner retry` in another process and the watcher can never undo each
other's work (issue "Model state done right", item 2). A change that leaves
the document as it was writes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_random

from llmgw_contract import (
    LEADER_KEY,
    KVPrefix,
    StateDocument,
    decode,
    encode,
    kv_key,
    model_from_key,
    routing_of,
)
from planner.agents.consul import ConsulClient
from planner.errors import ConsulUnavailable, NotLeader

log = logging.getLogger("planner.agents.state")

Change = Callable[[StateDocument], StateDocument]

# Conflicts need another writer of the same key in the same few milliseconds;
# twenty in a row would mean a writer stuck in a loop, not contention.
MAX_CAS_ATTEMPTS = 20


class CasConflict(Exception):
    """Another writer changed the key between our read and our write."""


@dataclass(frozen=True)
class Updated:
    """The document before and after one update (equal when nothing changed)."""

    before: StateDocument
    after: StateDocument

    @property
    def changed(self) -> bool:
        return self.before != self.after


def _document(name: str, text: str | None) -> StateDocument:
    """The document stored as `text`; an empty one when there is none. What Nomad
    already shows of a model whose document was missing is history, taken as counted
    by the decision (`planner.model.fold`) from what Nomad shows, never from this
    machine's clock (issue 19: a clock ahead of the nodes' hid every failure)."""
    if not text:
        return StateDocument(name=name)
    try:
        return decode(StateDocument, text)
    except ValueError as exc:
        # A document we cannot read is replaced, not fatal: it is a cache of what
        # Nomad holds (parking lives in the job's meta, failures in its events).
        log.error("model %s: unreadable state document, starting from empty (%s)", name, exc)
        return StateDocument(name=name)


class StateStore:
    """Reads and check-and-set writes of the state documents."""

    def __init__(
        self,
        consul: ConsulClient,
        absent: Callable[[StateDocument], StateDocument | None] | None = None,
        fence: Callable[[], str | None] | None = None,
    ) -> None:
        """`absent`, when given, completes the document created for a model that has
        none (the watcher seeds what it knows: the replicas passing now), or returns
        None for a model whose document must not be created (then nothing is written). `fence`, when
        given, names the leader's session (None: not leading): every write then checks,
        in the same transaction, that the session still holds `llmgw/leader`, and
        raises NotLeader otherwise (a paused leader that resumes cannot write)."""
        self._consul = consul
        self._absent = absent
        self._fence = fence

    def _put(
        self, key: str, text: str | None, index: int, also: dict[str, str | None] | None = None
    ) -> bool:
        """One check-and-set of `key` (`text` None: only checked) with the writes of
        `also`, in one fenced transaction (`ConsulClient.cas_put_with`)."""
        fence = None
        if self._fence is not None:
            session = self._fence()
            if session is None:
                raise NotLeader(f"write {key}: this planner is not the leader")
            fence = (LEADER_KEY, session)
        return self._consul.cas_put_with(key, text, index, also=also, fence=fence)

    def _put_state(
        self, name: str, after: StateDocument, index: int, before: StateDocument | None
    ) -> bool:
        """Write `after` at `index`, and its routing document in the same transaction
        when that part changed from `before` (None: not known, written), or the document
        is new: a failure counted writes one key and wakes no router."""
        routing = routing_of(after)
        also = None
        if index == 0 or before is None or routing_of(before) != routing:
            also = {kv_key(KVPrefix.ROUTING, name): encode(routing)}
        return self._put(kv_key(KVPrefix.STATE, name), encode(after), index, also)

    def assert_leading(self) -> None:
        """Raise NotLeader unless the fence's session holds the lock now (before acting
        on Nomad, which no Consul transaction can fence)."""
        if self._fence is None:
            return
        session = self._fence()
        if session is None or not self._consul.holds(LEADER_KEY, session):
            raise NotLeader("this planner no longer holds the leader lock")

    def load(self, name: str) -> StateDocument:
        """The model's document (an empty one when it has none)."""
        _, text = self._consul.get_indexed(kv_key(KVPrefix.STATE, name))
        return _document(name, text)

    def read(self, name: str) -> tuple[int, StateDocument]:
        """The model's document and its ModifyIndex (0: it has none; then the document
        is a new one, seeded by `absent` when given, None from it reads as empty)."""
        index, text = self._consul.get_indexed(kv_key(KVPrefix.STATE, name))
        document = _document(name, text)
        if index == 0 and self._absent is not None:
            document = self._absent(document) or document
        return index, document

    def write(
        self,
        name: str,
        document: StateDocument,
        index: int,
        before: StateDocument | None = None,
    ) -> bool:
        """One check-and-set of `document` at `index` (0: only if it has none), fenced
        like every write of this store; False when another writer got there first.
        `before`: the document read at `index`, when known (its routing document is
        then written only if that part changed)."""
        return self._put_state(name, document, index, before)

    def load_all(self) -> dict[str, StateDocument]:
        """Every model's document: {name: document}."""
        states = {}
        for key, text in self._consul.get_texts(KVPrefix.STATE).items():
            name = model_from_key(KVPrefix.STATE, key)
            if name is not None:
                states[name] = _document(name, text)
        return states

    def update(self, name: str, change: Change) -> Updated:
        """Apply `change` to the current document with check-and-set, starting over on a
        conflict (at most MAX_CAS_ATTEMPTS times, then ConsulUnavailable)."""
        key = kv_key(KVPrefix.STATE, name)
        retrying = Retrying(
            retry=retry_if_exception_type(CasConflict),
            stop=stop_after_attempt(MAX_CAS_ATTEMPTS),
            wait=wait_random(0, 0.02),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    index, text = self._consul.get_indexed(key)
                    before = _document(name, text)
                    if index == 0 and self._absent is not None:
                        seeded = self._absent(before)
                        if seeded is None:  # not to be created: nothing written
                            return Updated(before, before)
                        before = seeded
                    after = change(before)
                    if after == before and index != 0:
                        return Updated(before, after)
                    if not self._put_state(name, after, index, before):
                        raise CasConflict(key)
                    return Updated(before, after)
        except CasConflict:
            raise ConsulUnavailable(
                f"write {key}: {MAX_CAS_ATTEMPTS} check-and-set conflicts in a row"
            ) from None
        raise AssertionError("unreachable: tenacity either returns or raises")

    def put_new(self, key: str, text: str) -> bool:
        """Write `key` only if it does not exist (fenced like every write of this store);
        False when it does."""
        return self._put(key, text, 0)

    def create(self, name: str) -> bool:
        """Write a new model's document (counting failures from now) unless it has one;
        whether it wrote one."""
        document = _document(name, None)
        routing = {kv_key(KVPrefix.ROUTING, name): encode(routing_of(document))}
        return self._consul.cas_put_with(
            kv_key(KVPrefix.STATE, name), encode(document), 0, also=routing
        )

    def delete(self, name: str) -> None:
        """Delete the model's state and routing documents (one transaction)."""
        self._consul.delete_keys(kv_key(KVPrefix.STATE, name), kv_key(KVPrefix.ROUTING, name))

    def sync_routing(self) -> frozenset[str]:
        """Make every routing document say what its state document says, and delete the
        routing documents of models with none. Written by `_put_state` beside every
        change, so this finds work only after a planner of an older version, an
        operator's edit, or a restored snapshot. Each write is checked against the state
        document's index (one that changed meanwhile wrote its own). Returns the models
        that have a state document (read once for both: 12-16 MiB with 1,000 models);
        those whose routing document it wrote or deleted are logged."""
        # Routing first: a model created between the two reads has both keys in the
        # second, so it is never taken for an orphan.
        routing = self._consul.get_indexed_texts(KVPrefix.ROUTING)
        states = self._consul.get_indexed_texts(KVPrefix.STATE)
        fixed = []
        for key, (index, text) in sorted(states.items()):
            name = model_from_key(KVPrefix.STATE, key)
            if name is None:
                continue
            want = encode(routing_of(_document(name, text)))
            if routing.get(kv_key(KVPrefix.ROUTING, name), (0, None))[1] == want:
                continue
            if self._put(key, None, index, {kv_key(KVPrefix.ROUTING, name): want}):
                fixed.append(name)
        for key, (index, _) in sorted(routing.items()):
            name = model_from_key(KVPrefix.ROUTING, key)
            if name is None or kv_key(KVPrefix.STATE, name) in states:
                continue
            if self._put(key, None, index, {key: None}):  # unless it changed meanwhile
                fixed.append(name)
        if fixed:
            log.warning("routing documents out of step with the state, rewritten: %s", fixed)
        return frozenset(
            name for key in states if (name := model_from_key(KVPrefix.STATE, key)) is not None
        )
