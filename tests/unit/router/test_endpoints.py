"""Consul parsing, table diffing and the endpoint table (router.catalog, router.endpoints)."""

from __future__ import annotations

import asyncio
import base64
import json

from llmgw_contract import (
    PLANNER_SERVICE,
    ROUTER_SERVICE,
    ModelRecord,
    Parked,
    StateDocument,
    encode,
)
from router import endpoints, errors, refusals
from router.catalog import (
    ServiceAddress,
    parse_check_states,
    parse_endpoints,
    parse_models,
    parse_services,
)
from router.endpoint import Endpoint
from router.endpoints import EndpointTable, diff_endpoints, diff_models
from router.metrics import RouterMetrics


def kv(key: str, value: object) -> dict:
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    return {"Key": key, "Value": base64.b64encode(raw).decode()}


def record(name: str, definition_hash: str = "h", replicas: int = 1) -> ModelRecord:
    return ModelRecord(name=name, definition_hash=definition_hash, replicas=replicas)


def health(host: str | None, port: int, node: str = "10.9.9.9") -> dict:
    return {"Node": {"Address": node}, "Service": {"Address": host or "", "Port": port}}


def test_parse_models_reads_the_contracts_record_and_skips_bad_values() -> None:
    written = ModelRecord(
        name="a",
        definition_hash="h",
        replicas=2,
        source="s",
        profile={"gpus": 1},
        on_demand={"idle_after": 900},
    )
    later = {**json.loads(encode(written)), "added_later": True}
    models = parse_models(
        [
            {"Key": "llmgw/models/a", "Value": base64.b64encode(encode(written).encode()).decode()},
            kv("llmgw/models/later", {**later, "name": "later"}),
            kv("llmgw/models/broken", b"{not json"),
            kv("llmgw/models/no-hash", {"name": "no-hash", "replicas": 1}),
            kv("llmgw/models/a/state", {"parked": True}),
            kv("llmgw/models/", {}),
            kv("llmgw/models/renamed", {**later, "name": "other"}),
        ]
    )
    assert sorted(models) == ["a", "later", "renamed"]
    assert models["a"] == written and models["a"].idle_after == 900
    assert models["renamed"].name == "renamed"  # the key names the model
    assert parse_models(None) == {}


def test_parse_services_keeps_model_services_only() -> None:
    answer = {
        "consul": [],
        "llmgw-a": ["llmgw"],
        "llmgw-b": [],
        PLANNER_SERVICE: ["leader"],
        ROUTER_SERVICE: ["llmgw", "router"],  # the router job's own (jobspecs/router.nomad.hcl)
        "nomad-client": ["http"],
        "llmgw-": [],
    }
    assert parse_services(answer) == frozenset({"a", "b"})
    assert parse_services(None) == frozenset()


def test_parse_endpoints_falls_back_to_node_address() -> None:
    found = parse_endpoints([health("10.0.0.2", 80), health(None, 81), health("10.0.0.2", 80)])
    assert found == [ServiceAddress("10.0.0.2", 80), ServiceAddress("10.9.9.9", 81)]
    assert parse_endpoints([{"Service": {"Address": "x"}}]) == []


def check(node: str, service: str, sid: str, cid: str, status: str = "passing") -> dict:
    return {
        "Node": node,
        "ServiceName": service,
        "ServiceID": sid,
        "CheckID": cid,
        "Status": status,
        "Output": "ignored",
    }


def test_parse_check_states_per_model_with_node_checks() -> None:
    checks = [
        check("n1", "", "", "serfHealth"),
        check("n2", "", "", "serfHealth", "critical"),
        check("n1", "llmgw-a", "a1", "a1-http"),
        check("n2", "llmgw-a", "a2", "a2-http"),
        check("n1", "llmgw-b", "b1", "b1-http", "critical"),
        check("n2", "llmgw-c", "c2", "c2-http"),  # passing, on a failing node
        check("n1", PLANNER_SERVICE, "p", "p-ttl"),
        check("n1", "other", "o", "o-http"),
    ]
    states = parse_check_states(checks)
    assert sorted(states) == ["a", "b", "c"]
    assert states["a"].any_passing and not states["b"].any_passing
    assert not states["c"].any_passing
    assert ("n2", "", "serfHealth", "critical") in states["a"].checks
    # Output changes alone (HTTP check bodies) are not changes.
    again = parse_check_states([{**c, "Output": "other"} for c in checks])
    assert again == states
    # A node recovering changes the state of every model on it.
    healed = parse_check_states([checks[0], check("n2", "", "", "serfHealth"), *checks[2:]])
    assert healed["c"].any_passing and healed["a"] != states["a"] and healed["b"] == states["b"]
    assert parse_check_states(None) == {}


def test_diff_models() -> None:
    old = {"a": record("a", "1"), "b": record("b", "1"), "c": record("c")}
    new = {"b": record("b", "2"), "c": None, "d": record("d", "1")}
    diff = diff_models(old, new)
    assert (diff.added, diff.removed, diff.changed) == (("d",), ("a",), ("b", "c"))


def test_diff_endpoints_keeps_objects_counts_and_limits() -> None:
    a, b = ServiceAddress("h", 1), ServiceAddress("h", 2)
    kept, gone = Endpoint(a, 8), Endpoint(b, 4)
    kept.inflight, gone.inflight = 3, 1
    diff = diff_endpoints([kept, gone], [a, ServiceAddress("h", 3)], limit=4)
    assert diff.kept == (kept,) and diff.left == (gone,)
    assert [(e.address.port, e.limit) for e in diff.joined] == [(3, 4)]
    assert diff.endpoints[0] is kept and (kept.inflight, kept.limit) == (3, 8)
    assert not diff_endpoints([kept], [a], limit=4)


def test_table_follows_models_and_endpoints() -> None:
    metrics = RouterMetrics()
    joined: list[tuple[str, int]] = []
    table = EndpointTable(
        metrics, default_limit=3, on_joined=lambda slots, e: joined.append((e.base_url, e.limit))
    )
    assert not table.synced and table.get("a") is None
    table.set_models({"a": record("a")})
    entry = table.get("a")
    assert entry is not None and entry.endpoints == () and entry.replicas == 1
    table.set_states({})
    assert not table.synced  # services not read: a model known only there would be 404
    table.set_services(())
    assert table.synced
    assert metrics.endpoints.labels(model="a")._value.get() == 0

    table.set_endpoints("a", [ServiceAddress("h", 1), ServiceAddress("h", 2)])
    assert joined == [("http://h:1", 3), ("http://h:2", 3)]
    first = entry.endpoints[0]
    first.inflight = 1
    table.set_endpoints("a", [ServiceAddress("h", 1)])
    assert entry.endpoints == (first,) and first.inflight == 1
    assert len(joined) == 2  # staying is not joining
    assert metrics.endpoints.labels(model="a")._value.get() == 1
    assert table.ready_count() == 1
    assert table.set_endpoints("unknown", [ServiceAddress("h", 1)]) is None

    table.set_models({})
    assert table.get("a") is None and table.names() == []
    exposed = metrics.exposition()[0].decode()
    assert 'model="a"' not in exposed


def test_a_model_leaves_only_when_kv_and_its_service_both_drop_it() -> None:
    table = EndpointTable(RouterMetrics())
    table.set_models({"kv-only": record("kv-only"), "both": record("both", replicas=2)})
    diff = table.set_services({"both", "svc-only"})
    assert diff.added == ("svc-only",) and not diff.removed
    assert table.names() == ["both", "kv-only", "svc-only"]
    svc_only = table.get("svc-only")
    assert svc_only.record is None and svc_only.replicas is None
    both = table.get("both")
    table.set_endpoints("both", [ServiceAddress("h", 1)])

    # `consul kv delete -recurse llmgw/`: the KV records vanish.
    diff = table.set_models({})
    assert diff.removed == ("kv-only",) and diff.changed == ("both",)
    assert table.get("both") is both and both.record is None and len(both.endpoints) == 1
    # The planner restores the record: the same entry, its record back.
    table.set_models({"both": record("both", replicas=2)})
    assert table.get("both") is both and both.replicas == 2
    # Both sources drop it: gone.
    table.set_services({"svc-only"})
    assert table.get("both") is both
    diff = table.set_models({})
    assert diff.removed == ("both",) and both.endpoints == ()
    assert table.names() == ["svc-only"]


def test_wait_ready_wakes_on_first_endpoint() -> None:
    async def scenario() -> tuple[bool, bool]:
        table = EndpointTable(RouterMetrics())
        table.set_models({"a": record("a")})
        entry = table.get("a")
        assert entry is not None
        timed_out = await entry.wait_ready(0.01)
        asyncio.get_running_loop().call_later(
            0.01, table.set_endpoints, "a", [ServiceAddress("h", 1)]
        )
        return timed_out, await entry.wait_ready(2)

    assert asyncio.run(scenario()) == (False, True)


def test_a_consul_reset_is_remembered_until_the_records_are_back(monkeypatch) -> None:
    """Issue 20: a Consul that lost its state (its index went back) drops every record,
    state and service: the models stay defined with what the table knew, a parked one
    still parked, until the planner writes them again or REMEMBER_S passed."""
    now = [1000.0]
    monkeypatch.setattr(endpoints.time, "monotonic", lambda: now[0])
    table = EndpointTable(RouterMetrics())
    table.set_models({"served": record("served"), "parked": record("parked")})
    table.set_services({"served"})
    parked = Parked(reason="5 consecutive start failures")
    table.set_states({"parked": StateDocument(name="parked", parked=parked)})
    served = table.get("served")
    table.set_endpoints("served", [ServiceAddress("h", 1)])

    table.set_states({}, consul_reset=True)
    table.set_services(())
    table.set_endpoints("served", [])
    diff = table.set_models({}, consul_reset=True)
    assert not diff.removed and table.remembered == {"served", "parked"}
    assert table.get("served") is served and served.replicas == 1
    assert served.forgotten is not None and "Consul lost its record" in served.forgotten
    assert table.get("parked").parked == parked
    assert isinstance(refusals.when_no_endpoint(served), errors.ModelNotReady)
    assert isinstance(refusals.when_no_endpoint(table.get("parked")), errors.ModelParked)

    # The planner writes the records back (then the states): live again.
    table.set_models({"served": record("served"), "parked": record("parked")})
    assert table.remembered == frozenset() and served.forgotten is None
    table.set_states({"parked": StateDocument(name="parked", parked=parked)})
    assert table.get("parked").parked == parked

    # Dropped by another reset and never written back: gone after REMEMBER_S.
    table.set_models({"served": record("served")}, consul_reset=True)
    assert table.remembered == {"parked"}
    now[0] += endpoints.REMEMBER_S - 1
    assert table.get("parked") is not None
    now[0] += 2
    assert table.get("parked") is None and table.names() == ["served"]


def test_a_state_key_back_ends_the_remembered_state_whatever_it_says() -> None:
    """After a Consul reset the table keeps a parked model's state until its state key
    is back; a key back with a document that is no longer parked (the planner
    un-parked the model meanwhile) ends it too, rather than REMEMBER_S later."""
    table = EndpointTable(RouterMetrics())
    table.set_models({"m": record("m")})
    parked = Parked(reason="5 consecutive start failures")
    table.set_states({"m": StateDocument(name="m", parked=parked)})
    table.set_states({}, consul_reset=True)
    assert table.get("m").parked == parked
    table.set_states({}, present=())  # another read without its key: still kept
    assert table.get("m").parked == parked
    table.set_states({}, present={"m"})  # its key is back, not parked
    assert table.get("m").parked is None
    assert not isinstance(refusals.when_no_endpoint(table.get("m")), errors.ModelParked)


def test_a_kv_wipe_is_no_reset_nothing_is_remembered() -> None:
    table = EndpointTable(RouterMetrics())
    table.set_models({"a": record("a")})
    table.set_models({})
    assert table.get("a") is None and table.remembered == frozenset()
