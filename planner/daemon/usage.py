"""When each model was last asked for: the leader's memory, with a coarse copy in KV.

Routers report the models they served every 10 s (`POST /v1/usage`) and an
activation counts as use. Those reports reach the leading planner only
(followers forward them), which keeps them in memory: they are the
high-frequency part of a model's state, and writing each into the state
document would rewrite 12-16 KiB several times a second (and, before routing
documents, woke every router's watch). A copy goes to `llmgw/usage/<name>`
at most every `PERSIST_EVERY` per model (and at once on activation), for
`planner status` in another process and for the next leader.

Called by the admin API (reports, activation), the idle scaler (last use)
and `planner.daemon.leader` (a new leader starts from the copies, and counts every
active model as used at the moment it took over: scaling a model down too
late is cheap, too early drops a client's model under it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta

from llmgw_contract import KVPrefix, UsageRecord, encode, kv_key
from planner.agents.consul import ConsulClient

log = logging.getLogger("planner.daemon.usage")

PERSIST_EVERY = timedelta(seconds=30)


class UsageBook:
    """Last use per model, in memory; `used` is cheap and thread-safe."""

    def __init__(self, consul: ConsulClient, clock: Callable[[], datetime]) -> None:
        self._consul = consul
        self._clock = clock
        self._last: dict[str, datetime] = {}
        self._persisted: dict[str, datetime] = {}
        self._lock = threading.Lock()

    def start_over(self, active: Iterable[str]) -> None:
        """A new leader: forget, read the copies, and count `active` models used now."""
        now = self._clock()
        with self._lock:
            self._last = {
                n: datetime.fromisoformat(r.last_used_at)
                for n, r in self._consul.usage_records().items()
            }
            self._persisted = dict(self._last)
            for name in active:
                self._last[name] = now

    def used(self, names: Iterable[str], persist_now: bool = False) -> None:
        """These models were asked for now; persist the copies that are due."""
        now = self._clock()
        due = []
        with self._lock:
            for name in names:
                self._last[name] = now
                persisted = self._persisted.get(name)
                if persist_now or persisted is None or now - persisted >= PERSIST_EVERY:
                    self._persisted[name] = now
                    due.append(name)
        for name in due:
            record = UsageRecord(last_used_at=now.isoformat(timespec="seconds"))
            self._consul.put_text(kv_key(KVPrefix.USAGE, name), encode(record))

    def last_used(self, name: str) -> datetime | None:
        with self._lock:
            return self._last.get(name)

    def forget(self, name: str) -> None:
        with self._lock:
            self._last.pop(name, None)
            self._persisted.pop(name, None)
        self._consul.delete_key(kv_key(KVPrefix.USAGE, name))
