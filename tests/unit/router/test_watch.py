"""Blocking-query index rules and watch supervision (router.watch)."""

from __future__ import annotations

import asyncio
import contextlib

from llmgw_contract import ModelRecord, Parked, StateDocument
from llmgw_contract.leadership import LeaderRoute, Resolution
from router.catalog import CheckState, ServiceAddress
from router.endpoints import EndpointTable
from router.errors import CatalogUnavailable
from router.metrics import RouterMetrics
from router.planners import PlannerCandidates
from router.states import StateView
from router.watch import ConsulWatcher, next_index


def record(name: str, replicas: int = 1) -> ModelRecord:
    return ModelRecord(name=name, definition_hash="h", replicas=replicas)


def test_next_index_rules() -> None:
    assert next_index(0, 10) == 10
    assert next_index(10, 12) == 12
    assert next_index(12, 5) == 0  # went backwards: start over
    assert next_index(0, 0) == 1  # never block on 0
    assert next_index(10, 10) == 10


class FakeCatalog:
    """Answers from scripted state; blocks until the state's index moves past the asked one."""

    def __init__(self) -> None:
        self.index = 1
        self.defined: dict[str, ModelRecord] = {}
        self.registered: set[str] = set()  # models with an llmgw-<model> service
        self.healthy: dict[str, list[ServiceAddress]] = {}
        self.model_states: dict[str, StateDocument] = {}
        self.leader_record: Resolution = None
        self.planner_instances: list[ServiceAddress] = []
        self.fail_next = 0
        self.changed = asyncio.Event()
        self.health_reads: dict[str, int] = {}
        self.state_view = StateView()  # what the state watch's spacing reads
        # Models with a state key whose document is neither parked nor unplaceable.
        self.other_states: set[str] = set()
        self.state_reads = 0
        # Each watch's query now blocked at the current index, by method: one there
        # has applied every answer before it (what `settle` waits for).
        self.blocked: dict[str, int] = {}

    def bump(self, *, backwards: bool = False) -> None:
        self.index = 1 if backwards else self.index + 1
        self.changed.set()
        self.changed = asyncio.Event()

    async def _block(self, index: int, wait_s: float, who: str) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise CatalogUnavailable("scripted failure")
        if index > 0 and index == self.index:
            self.blocked[who] = index
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), wait_s)
            finally:
                del self.blocked[who]

    async def models(self, index: int, wait_s: float):
        await self._block(index, wait_s, "models")
        return self.index, dict(self.defined)

    async def services(self, index: int, wait_s: float):
        await self._block(index, wait_s, "services")
        return self.index, frozenset(self.registered)

    async def states(self, index: int, wait_s: float):
        await self._block(index, wait_s, "states")
        self.state_view.present = frozenset(self.model_states) | self.other_states
        self.state_reads += 1
        return self.index, dict(self.model_states)

    async def leader(self, index: int, wait_s: float):
        await self._block(index, wait_s, "leader")
        return self.index, self.leader_record

    async def planners(self, index: int, wait_s: float):
        await self._block(index, wait_s, "planners")
        return self.index, list(self.planner_instances)

    async def check_states(self, index: int, wait_s: float):
        await self._block(index, wait_s, "check_states")
        # A check per address (its port in the check ID), so a new address is a
        # new check, as it is in Consul; a model with an empty list has one failing.
        states = {}
        for model, addresses in self.healthy.items():
            keys = frozenset(("n", f"s-{a.port}", f"c-{a.port}", "passing") for a in addresses)
            states[model] = CheckState(
                keys or frozenset({("n", "s", "c", "critical")}), bool(addresses)
            )
        return self.index, states

    async def passing(self, model: str):
        self.health_reads[model] = self.health_reads.get(model, 0) + 1
        if self.fail_next:
            self.fail_next -= 1
            raise CatalogUnavailable("scripted failure")
        return list(self.healthy.get(model, []))


async def settle(catalog: FakeCatalog, watcher: ConsulWatcher) -> None:
    """Wait until every watch has applied the catalog's latest answer: each one's query
    is blocked again at the current index (no fixed sleep: on a loaded machine 0.15 s
    was not always enough). Polls; fails after 10 s."""
    for _ in range(2000):
        current = [w for w, at in catalog.blocked.items() if at == catalog.index]
        if len(current) == watcher.task_count and not catalog.fail_next:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"the watches did not settle: {catalog.blocked} at {catalog.index}")


def test_watcher_follows_models_and_endpoints_and_survives_errors() -> None:
    async def scenario() -> None:
        catalog = FakeCatalog()
        table = EndpointTable(RouterMetrics())
        watcher = ConsulWatcher(catalog, table, wait_s=5, backoff_max_s=0.05)  # type: ignore[arg-type]
        catalog.defined = {"a": record("a")}
        catalog.healthy = {"a": [ServiceAddress("h", 1)]}
        watcher.start()
        await settle(catalog, watcher)
        assert watcher.task_count == 4
        assert [e.address.port for e in table.get("a").endpoints] == [1]

        catalog.fail_next = 2
        catalog.healthy["a"] = [ServiceAddress("h", 2)]
        catalog.bump()
        await settle(catalog, watcher)  # through the two failures
        assert [e.address.port for e in table.get("a").endpoints] == [2]

        catalog.healthy["a"] = []
        catalog.bump(backwards=True)
        await settle(catalog, watcher)
        assert table.get("a").endpoints == ()

        catalog.defined = {"b": record("b")}
        catalog.bump()
        await settle(catalog, watcher)
        assert table.names() == ["b"]
        assert table.get("a") is None

        parked = Parked(reason="5 consecutive start failures")
        catalog.model_states = {"b": StateDocument(name="b", parked=parked)}
        catalog.bump()
        await settle(catalog, watcher)
        assert table.get("b").parked == parked
        catalog.model_states = {}
        catalog.bump()
        await settle(catalog, watcher)
        assert table.get("b").parked is None

        await watcher.stop()
        assert watcher.task_count == 0

    asyncio.run(scenario())


def test_a_serving_model_outlives_its_kv_record() -> None:
    async def scenario() -> None:
        catalog = FakeCatalog()
        table = EndpointTable(RouterMetrics())
        watcher = ConsulWatcher(catalog, table, wait_s=5, backoff_max_s=0.05)  # type: ignore[arg-type]
        catalog.defined = {"gemma": record("gemma"), "kev": record("kev")}
        catalog.registered = {"gemma", "planned-by-hand"}
        catalog.healthy = {"gemma": [ServiceAddress("h", 1)], "planned-by-hand": []}
        watcher.start()
        await settle(catalog, watcher)
        assert table.synced
        assert table.names() == ["gemma", "kev", "planned-by-hand"]

        catalog.defined = {}  # consul kv delete -recurse llmgw/
        catalog.bump()
        await settle(catalog, watcher)
        assert table.names() == ["gemma", "planned-by-hand"]
        gemma = table.get("gemma")
        assert gemma.record is None and [e.address.port for e in gemma.endpoints] == [1]

        catalog.registered = set()  # its job is stopped too: now it is gone
        catalog.bump()
        await settle(catalog, watcher)
        assert table.names() == [] and table.get("gemma") is None
        await watcher.stop()

    asyncio.run(scenario())


def test_a_bug_in_apply_does_not_kill_the_watch() -> None:
    async def scenario() -> int:
        catalog = FakeCatalog()
        table = EndpointTable(RouterMetrics())
        calls = 0
        real = table.set_models

        def flaky(models, consul_reset=False):
            nonlocal calls
            calls += 1
            if calls == 1:
                raise KeyError("bug")
            return real(models, consul_reset)

        table.set_models = flaky  # type: ignore[method-assign]
        watcher = ConsulWatcher(catalog, table, wait_s=5, backoff_max_s=0.05)  # type: ignore[arg-type]
        watcher.start()
        await settle(catalog, watcher)  # the models watch survived its bug
        await watcher.stop()
        return calls

    assert asyncio.run(scenario()) >= 2


def test_the_planner_watches_follow_the_leader_and_the_instances() -> None:
    async def scenario() -> None:
        catalog = FakeCatalog()
        table = EndpointTable(RouterMetrics())
        planners = PlannerCandidates("http://10.0.0.1:4650", RouterMetrics())
        watcher = ConsulWatcher(
            catalog,
            table,
            wait_s=5,
            backoff_max_s=0.05,  # type: ignore[arg-type]
            planners=planners,
        )
        catalog.planner_instances = [
            ServiceAddress("10.0.0.1", 4650),
            ServiceAddress("10.0.0.2", 4650),
        ]
        watcher.start()
        await settle(catalog, watcher)
        assert planners.ordered() == ["http://10.0.0.1:4650", "http://10.0.0.2:4650"]

        catalog.leader_record = LeaderRoute("b", "http://10.0.0.2:4650", "n2", "sess-b")
        catalog.planner_instances = [ServiceAddress("10.0.0.2", 4650)]  # .1's check lapsed
        catalog.bump()
        await settle(catalog, watcher)
        assert planners.ordered() == ["http://10.0.0.2:4650", "http://10.0.0.1:4650"]
        await watcher.stop()

    asyncio.run(scenario())


def test_only_models_whose_checks_changed_are_read_again() -> None:
    async def scenario() -> None:
        catalog = FakeCatalog()
        table = EndpointTable(RouterMetrics())
        watcher = ConsulWatcher(catalog, table, wait_s=5, backoff_max_s=0.05)  # type: ignore[arg-type]
        catalog.defined = {f"m{i}": record(f"m{i}") for i in range(300)}
        catalog.healthy = {"m1": [ServiceAddress("h", 1)], "m2": []}
        watcher.start()
        await settle(catalog, watcher)
        # Read once: the one with a passing check; m2 (failing) and the rest: no read.
        assert catalog.health_reads == {"m1": 1}
        assert len(table.get("m1").endpoints) == 1 and len(table.names()) == 300

        catalog.healthy["m2"] = [ServiceAddress("h", 2)]
        catalog.bump()
        await settle(catalog, watcher)
        assert catalog.health_reads == {"m1": 1, "m2": 1}
        assert len(table.get("m2").endpoints) == 1

        del catalog.healthy["m1"]  # deregistered: no read, no endpoint
        catalog.bump()
        await settle(catalog, watcher)
        assert catalog.health_reads == {"m1": 1, "m2": 1}
        assert table.get("m1").endpoints == ()
        await watcher.stop()

    asyncio.run(scenario())


def test_endpoints_read_before_their_model_is_defined_are_kept() -> None:
    async def scenario() -> None:
        catalog = FakeCatalog()
        table = EndpointTable(RouterMetrics())
        watcher = ConsulWatcher(catalog, table, wait_s=5, backoff_max_s=0.05)  # type: ignore[arg-type]
        catalog.healthy = {"late": [ServiceAddress("h", 7)]}
        watcher.start()
        await settle(catalog, watcher)
        assert table.get("late") is None
        catalog.defined = {"late": record("late")}
        catalog.bump()
        await settle(catalog, watcher)
        assert [e.address.port for e in table.get("late").endpoints] == [7]
        assert catalog.health_reads == {"late": 1}
        await watcher.stop()

    asyncio.run(scenario())


def test_a_consul_that_came_back_empty_at_a_lower_index_is_remembered() -> None:
    """Issue 20: the watches reconnect to a Consul that lost its state (a restarted dev
    agent): its KV index is lower than any read before, across the reconnect."""

    async def scenario() -> None:
        catalog = FakeCatalog()
        table = EndpointTable(RouterMetrics())
        watcher = ConsulWatcher(catalog, table, wait_s=5, backoff_max_s=0.05)  # type: ignore[arg-type]
        parked = Parked(reason="5 consecutive start failures")
        catalog.defined = {"a": record("a"), "p": record("p")}
        catalog.model_states = {"p": StateDocument(name="p", parked=parked)}
        for _ in range(5):
            catalog.bump()
        watcher.start()
        await settle(catalog, watcher)
        assert table.names() == ["a", "p"]
        catalog.fail_next = 4  # Consul down, then back with nothing, at index 1
        catalog.defined, catalog.model_states = {}, {}
        catalog.bump(backwards=True)
        await settle(catalog, watcher)  # through the four failures
        assert table.names() == ["a", "p"] and table.remembered == {"a", "p"}
        assert table.get("p").parked == parked
        catalog.defined = {"a": record("a"), "p": record("p")}
        catalog.model_states = {"p": StateDocument(name="p", parked=parked)}
        catalog.bump()
        await settle(catalog, watcher)
        assert table.remembered == frozenset() and table.get("p").parked == parked
        await watcher.stop()

    asyncio.run(scenario())


def test_a_state_key_back_but_not_parked_ends_what_a_reset_kept() -> None:
    """A Consul reset keeps a parked model's state; when its state key is back with a
    document the router does not keep (the planner un-parked the model), the model
    is no longer refused as parked, even though its record never left."""

    async def read_state(catalog: FakeCatalog) -> None:
        # The watch applies a read as soon as it returns: a read counted is applied.
        reads = catalog.state_reads
        catalog.bump()
        for _ in range(500):
            if catalog.state_reads > reads:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the state watch did not read again within 5 s")

    async def scenario() -> None:
        catalog = FakeCatalog()
        table = EndpointTable(RouterMetrics())
        watcher = ConsulWatcher(catalog, table, wait_s=5, backoff_max_s=0.05)  # type: ignore[arg-type]
        parked = Parked(reason="5 consecutive start failures")
        catalog.defined = {"p": record("p")}
        catalog.model_states = {"p": StateDocument(name="p", parked=parked)}
        catalog.index = 5
        watcher.start()
        await read_state(catalog)
        assert table.get("p").parked == parked
        catalog.model_states = {}  # Consul lost the state; the record was written back
        catalog.index = 0  # bump: 1, lower than any read before
        await read_state(catalog)
        assert table.get("p").parked == parked
        catalog.other_states = {"p"}
        await read_state(catalog)
        assert table.get("p").parked is None
        await watcher.stop()

    asyncio.run(scenario())
