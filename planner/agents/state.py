"""Per-model state documents in Consul KV, changed only by check-and-set.

Called by the watcher (failures, parking, placement), `apply` and `retry`
(parking), activation (placement answers) and the status views (reads). The
document is `llmgw_contract.StateDocument` at `llmgw/state/<name>`; the
router reads the same document.

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

    def _put(self, key: str, text: str, index: int) -> bool:
        if self._fence is None:
            return self._consul.cas_put(key, text, index)
        session = self._fence()
        if session is None:
            raise NotLeader(f"write {key}: this planner is not the leader")
        return self._consul.fenced_cas_put(key, text, index, LEADER_KEY, session)

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

    def write(self, name: str, document: StateDocument, index: int) -> bool:
        """One check-and-set of `document` at `index` (0: only if it has none), fenced
        like every write of this store; False when another writer got there first."""
        return self._put(kv_key(KVPrefix.STATE, name), encode(document), index)

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
                    if not self._put(key, encode(after), index):
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
        return self._consul.cas_put(kv_key(KVPrefix.STATE, name), encode(_document(name, None)), 0)

    def delete(self, name: str) -> None:
        self._consul.delete_key(kv_key(KVPrefix.STATE, name))
