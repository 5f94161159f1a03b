"""Consul parsing, table diffing and the endpoint table (router.catalog, router.endpoints)."""

from __future__ import annotations

import asyncio
import base64
import json

from router.balancer import Endpoint
from router.catalog import ModelDefinition, ServiceAddress, parse_endpoints, parse_models
from router.endpoints import EndpointTable, diff_endpoints, diff_models
from router.metrics import RouterMetrics


def kv(key: str, value: object) -> dict:
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    return {"Key": key, "Value": base64.b64encode(raw).decode()}


def health(host: str | None, port: int, node: str = "10.9.9.9") -> dict:
    return {"Node": {"Address": node}, "Service": {"Address": host or "", "Port": port}}


def test_parse_models_ignores_unknown_keys_and_bad_values() -> None:
    models = parse_models(
        [
            kv(
                "llmgw/models/a",
                {
                    "name": "a",
                    "definition_hash": "h",
                    "replicas": 2,
                    "source": "s",
                    "profile": {"gpu": 1},
                    "later": True,
                },
            ),
            kv("llmgw/models/broken", b"{not json"),
            kv("llmgw/models/a/state", {"parked": True}),
            kv("llmgw/models/", {}),
        ]
    )
    assert list(models) == ["a"]
    assert models["a"] == ModelDefinition("a", "h", 2, "s")
    assert models["a"].profile == {"gpu": 1}
    assert parse_models(None) == {}


def test_parse_endpoints_falls_back_to_node_address() -> None:
    found = parse_endpoints([health("10.0.0.2", 80), health(None, 81), health("10.0.0.2", 80)])
    assert found == [ServiceAddress("10.0.0.2", 80), ServiceAddress("10.9.9.9", 81)]
    assert parse_endpoints([{"Service": {"Address": "x"}}]) == []


def test_diff_models() -> None:
    old = {"a": ModelDefinition("a", "1"), "b": ModelDefinition("b", "1")}
    new = {"b": ModelDefinition("b", "2"), "c": ModelDefinition("c", "1")}
    diff = diff_models(old, new)
    assert (diff.added, diff.removed, diff.changed) == (("c",), ("a",), ("b",))


def test_diff_endpoints_keeps_objects_and_counts() -> None:
    a, b = ServiceAddress("h", 1), ServiceAddress("h", 2)
    kept, gone = Endpoint(a), Endpoint(b)
    kept.inflight, gone.inflight = 3, 1
    diff = diff_endpoints([kept, gone], [a, ServiceAddress("h", 3)])
    assert diff.kept == (kept,) and diff.left == (gone,)
    assert [e.address.port for e in diff.joined] == [3]
    assert diff.endpoints[0] is kept and kept.inflight == 3
    assert not diff_endpoints([kept], [a])


def test_table_follows_models_and_endpoints() -> None:
    metrics = RouterMetrics()
    table = EndpointTable(metrics)
    assert not table.synced and table.get("a") is None
    table.set_models({"a": ModelDefinition("a", replicas=1)})
    entry = table.get("a")
    assert entry is not None and entry.endpoints == ()
    assert not table.synced  # states not read yet: a parked model could slip through
    table.set_states({})
    assert table.synced
    assert metrics.endpoints.labels(model="a")._value.get() == 0

    table.set_endpoints("a", [ServiceAddress("h", 1), ServiceAddress("h", 2)])
    first = entry.endpoints[0]
    first.inflight = 1
    table.set_endpoints("a", [ServiceAddress("h", 1)])
    assert entry.endpoints == (first,) and first.inflight == 1
    assert metrics.endpoints.labels(model="a")._value.get() == 1
    assert table.ready_count() == 1
    assert table.set_endpoints("unknown", [ServiceAddress("h", 1)]) is None

    table.set_models({})
    assert table.get("a") is None and table.definitions() == []
    exposed = metrics.exposition()[0].decode()
    assert 'model="a"' not in exposed


def test_wait_ready_wakes_on_first_endpoint() -> None:
    async def scenario() -> tuple[bool, bool]:
        table = EndpointTable(RouterMetrics())
        table.set_models({"a": ModelDefinition("a")})
        entry = table.get("a")
        assert entry is not None
        timed_out = await entry.wait_ready(0.01)
        asyncio.get_running_loop().call_later(
            0.01, table.set_endpoints, "a", [ServiceAddress("h", 1)]
        )
        return timed_out, await entry.wait_ready(2)

    assert asyncio.run(scenario()) == (False, True)
