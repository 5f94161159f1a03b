"""Leader election: one `planner serve` acts at a time; the others stand by.

Run by `planner serve` (`planner.daemon.serve`). Each instance registers its admin
API as the Consul service `llmgw-planner` with a TTL check that a thread of
its own keeps passing every `ttl/3`, creates a Consul session bound to that
check (and to the node's `serfHealth`), and campaigns for the lock on
`llmgw/leader` (Consul's "Sessions and distributed locks" design). The holder
writes its `LeaderRecord` (id, admin address) into the key. The others forward
writes to the lock holder, at the address its session's check says it
registered (`llmgw_contract.leadership.resolve_leader`, read again whenever the
key changes): the key's text alone is not trusted, since a plain KV write can
rewrite it without taking the lock. A record that disagrees with the
registration is a `LeaderRefused`, and writes are refused (`planner.api.admin`).

Why a check-bound session rather than a session TTL: Consul may wait up to
twice a session's TTL (10 s at least) before invalidating it, while a TTL
*check* goes critical at its TTL and invalidates its sessions at once. A
leader killed with SIGKILL stops passing its check; after `ttl` (6 s) the
session is invalidated and the lock released, a standby's blocking query on
the key returns, and it takes the lock once the `lock_delay` (2 s; Consul's
default is 15 s) has passed: about 8-9 s in all, inside the 15 s the issue
asks for. A leader that stops itself releases the lock at once.

A Consul agent that lost its state (a dev agent restarted, a rebuilt cluster, a
restored snapshot) forgot the service, the check, the session and the key: the
next pass of the check fails, and that failure, like every new session, compares
the agent's services and checks with this registration and registers what is
missing (`_ensure_registered`), then campaigns again; the new leader's first
reconcile restores the records (`planner.daemon.repair`). Measured in
tests/integration/test_consul_forgets.py: leading again 1.3 s after Consul had a
leader.

A leader that loses the lock (its session invalidated because its check
lapsed, or the key deleted) learns it from the same blocking query and stops
acting before campaigning again; every state write is a check-and-set, so a
write it had in flight cannot undo the new leader's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from llmgw_contract import LEADER_KEY, PLANNER_SERVICE, LeaderRecord, encode
from llmgw_contract.leadership import (
    SCHEME_META,
    LeaderRefused,
    LeaderRoute,
    Resolution,
    parse_admin_url,
    resolve_leader,
)
from planner.agents.consul import ConsulClient
from planner.errors import PlannerError

log = logging.getLogger("planner.daemon.leader")

TTL_S = 6
LOCK_DELAY_S = 2
# A standby whose acquire was refused (lock delay, or a race) tries again this often.
RETRY_ACQUIRE_S = 0.5

OnChange = Callable[[bool], Awaitable[None]]


class Leadership:
    """Campaigns for `llmgw/leader` forever; calls `on_change(True/False)` on each change."""

    def __init__(
        self,
        consul: ConsulClient,
        address: str,
        on_change: OnChange,
        ttl_s: int = TTL_S,
        lock_delay_s: int = LOCK_DELAY_S,
        on_retaken: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """`on_retaken` is awaited when this leader took its lock's key again after the
        key was deleted (a wiped `llmgw/`): the records went with it."""
        self.consul = consul
        self.on_retaken = on_retaken
        self._url = parse_admin_url(address)  # ValueError for a bad --advertise
        self.address = str(self._url)
        self.on_change = on_change
        self.ttl_s = ttl_s
        self.lock_delay_s = lock_delay_s
        self.id = uuid.uuid4().hex[:12]
        self.service_id = f"{PLANNER_SERVICE}-{self.id}"
        self.is_leader = False
        # Where the lock holder registered, as last resolved (None: no holder, or
        # Consul could not be asked; a LeaderRefused: its record disagrees).
        self.route: Resolution = None
        self._resolved_for: tuple[str, int] | None = None  # (session, ModifyIndex)
        self.changes = 0  # times this instance became or stopped being the leader
        self._session: str | None = None
        self._check_id: str | None = None
        self._stop = threading.Event()
        self._registering = threading.Lock()
        self.registrations = 0  # times the service was registered (again after a loss)

    def session(self) -> str | None:
        """The session holding the lock while this instance leads (None otherwise): the
        fence every leader write checks in its own transaction (`planner.agents.state`)."""
        return self._session if self.is_leader else None

    # --- the check this instance's session is bound to -------------------------------

    def _register(self) -> None:
        # The scheme goes into the registration too: it, not the key's text, says
        # whether followers and routers must speak TLS to this instance.
        self._check_id = self.consul.register_ttl_service(
            PLANNER_SERVICE,
            self.service_id,
            self._url.host,
            self._url.port,
            f"{self.ttl_s}s",
            deregister_after="1m",
            meta={SCHEME_META: self._url.scheme},
        )
        self.registrations += 1

    def _ensure_registered(self) -> None:
        """Register the service and its check unless the agent lists both, as Nomad's
        own Consul sync does (command/agent/consul/service_client.go: it compares what
        the agent has with what it should have, and registers what is missing). A Consul
        agent that lost its state (a dev agent restarted, a rebuilt cluster, a restored
        snapshot) forgot them, and without the check no session can be made: the
        planner would stand without a leader for good (issue 20: 177 s, `Missing check
        ... registration` every 2 s, until restarted). Raises PlannerError."""
        with self._registering:
            if self._check_id is None:
                self._register()
                self._start_heartbeat()
                return
            if not self.consul.knows_service(self.service_id, self._check_id):
                log.warning(
                    "Consul no longer knows this planner's service %s (the agent lost its "
                    "state); registering it again",
                    self.service_id,
                )
                self._register()

    def _start_heartbeat(self) -> None:
        threading.Thread(target=self._heartbeat, name="leader-heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        """Pass the check every ttl/3; a pass that fails (Consul down, or it forgot the
        check) compares the registration with the agent's and passes again."""
        while not self._stop.wait(self.ttl_s / 3):
            try:
                assert self._check_id is not None
                self.consul.pass_ttl(self._check_id)
            except PlannerError as exc:
                log.warning("could not pass the leadership check: %s", exc)
                try:
                    self._ensure_registered()
                    self.consul.pass_ttl(self._check_id)
                except PlannerError as again:
                    log.debug("registration check: %s", again)

    # --- campaign ----------------------------------------------------------------------

    async def run(self) -> None:
        """Register, then campaign until cancelled; Consul errors are retried."""
        while True:
            try:
                # Every new session first: Consul may have forgotten the check (its
                # "Missing check" refusal of a session is what it says then).
                await asyncio.to_thread(self._ensure_registered)
                self._session = await asyncio.to_thread(
                    self.consul.create_session,
                    f"llmgw planner {self.id}",
                    ["serfHealth", self._check_id or ""],
                    self.lock_delay_s,
                )
                await self._campaign(self._session)
            except PlannerError as exc:
                log.warning("leader election: %s; again in 2 s", exc)
            await self._set(False)
            await asyncio.sleep(2)

    async def _campaign(self, session: str) -> None:
        """Hold or wait for the lock with `session`; return when the session is gone."""
        record = encode(
            LeaderRecord(
                id=self.id,
                address=self.address,
                since=datetime.now(UTC).isoformat(timespec="seconds"),
            )
        )
        index: int | None = None
        while True:
            if not self.is_leader and await asyncio.to_thread(
                self.consul.acquire, LEADER_KEY, record, session
            ):
                log.info("this planner (%s, %s) is the leader", self.id, self.address)
                await self._set(True)
            index, item = await asyncio.to_thread(self.consul.watch_key, LEADER_KEY, index)
            holder = (item or {}).get("Session")
            await self._follow(item if holder and holder != session else None)
            if self.is_leader and holder != session:
                if item is None and await asyncio.to_thread(
                    self.consul.acquire, LEADER_KEY, record, session
                ):
                    # The key was deleted (`consul kv delete -recurse llmgw/`) but the
                    # session is still ours: take it again without stopping the work.
                    log.warning("the leader lock's key was deleted; this planner took it again")
                    if self.on_retaken is not None:
                        await self.on_retaken()
                    continue
                log.warning(
                    "this planner lost the leader lock (%s)",
                    "key deleted" if item is None else "session invalidated",
                )
                await self._set(False)
                if item is None or holder is not None:
                    continue  # the key went away (or another holds it): campaign again
                return  # our session is no longer valid: make a new one
            if not self.is_leader and holder is None:
                index = None  # free: try at once, then keep trying past any lock delay
                await asyncio.sleep(RETRY_ACQUIRE_S)

    async def _follow(self, item: dict | None) -> None:
        """Resolve where another lock holder registered (`item`: the key, None when
        this instance holds it or nobody does), once per change of the key."""
        if item is None:
            self.route, self._resolved_for = None, None
            return
        seen = (str(item["Session"]), int(item.get("ModifyIndex") or 0))
        if seen == self._resolved_for:
            return
        try:
            route = await asyncio.to_thread(self._resolve, item)
        except PlannerError as exc:
            # Unknown, not refused: tried again on the next round of the watch (<= 5 s).
            log.warning("could not find where the leader registered: %s", exc)
            self.route, self._resolved_for = None, None
            return
        if isinstance(route, LeaderRefused):
            log.warning(
                "writes will not be forwarded to the leader: %s (%s)", route.reason, route.code
            )
        elif isinstance(route, LeaderRoute) and route != self.route:
            log.info(
                "the leader is planner %s at %s (its registration on node %s)",
                route.planner_id,
                route.url,
                route.node,
            )
        self.route, self._resolved_for = route, seen

    def _resolve(self, item: dict) -> Resolution:
        holder = str(item["Session"])
        return resolve_leader(
            holder,
            item.get("Value"),
            self.consul.session_info(holder),
            self.consul.service_instances(PLANNER_SERVICE),
        )

    async def _set(self, leader: bool) -> None:
        if leader == self.is_leader:
            return
        self.is_leader = leader
        self.changes += 1
        await self.on_change(leader)

    async def resign(self) -> None:
        """Stop acting and let a standby take over at once (a clean shutdown)."""
        self._stop.set()
        await self._set(False)
        try:
            if self._session is not None:
                await asyncio.to_thread(self.consul.release, LEADER_KEY, self._session)
                await asyncio.to_thread(self.consul.destroy_session, self._session)
            await asyncio.to_thread(self.consul.deregister_service, self.service_id)
        except PlannerError as exc:
            log.warning("resigning: %s", exc)
