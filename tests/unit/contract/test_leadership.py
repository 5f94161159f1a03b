"""Where the lock holder registered (llmgw_contract.leadership.resolve_leader): the key's
text is trusted only where it agrees with the registration its session is bound to.

The answers are Consul's JSON shapes: 1.8's session (`Checks`: IDs) and 1.7+'s
(`NodeChecks`, `ServiceChecks`: objects), and /v1/health/service entries.
"""

from __future__ import annotations

from typing import Any

import pytest

from llmgw_contract import LeaderRecord, encode
from llmgw_contract.leadership import (
    AdminURL,
    LeaderRefused,
    LeaderRoute,
    Refusal,
    parse_admin_url,
    resolve_leader,
)

SESSION = "6f1b2c3d-0000-4000-8000-000000000001"
CHECK = "service:llmgw-planner-abc123"


def value(planner_id: str = "abc123", address: str = "https://planner-1.example:4650") -> str:
    return encode(LeaderRecord(id=planner_id, address=address))


def session(**overrides: Any) -> dict[str, Any]:
    return {
        "ID": SESSION,
        "Node": "node-1",
        "Checks": ["serfHealth", CHECK],
        "LockDelay": 2000000000,
        "Behavior": "release",
        **overrides,
    }


def instance(
    service_id: str = "llmgw-planner-abc123",
    node: str = "node-1",
    address: str = "planner-1.example",
    port: int = 4650,
    scheme: str | None = "https",
    check: str = CHECK,
) -> dict[str, Any]:
    meta = {"llmgw_scheme": scheme} if scheme is not None else {}
    return {
        "Node": {"Node": node, "Address": "10.0.0.5"},
        "Service": {
            "ID": service_id,
            "Service": "llmgw-planner",
            "Address": address,
            "Port": port,
            "Meta": meta,
        },
        "Checks": [
            {"CheckID": "serfHealth", "Status": "passing"},
            {"CheckID": check, "Status": "passing", "ServiceID": service_id},
        ],
    }


def refused(result: object, code: Refusal) -> str:
    assert isinstance(result, LeaderRefused), result
    assert result.code is code, result
    return result.reason


def test_the_registered_address_of_the_lock_holder() -> None:
    route = resolve_leader(SESSION, value(), session(), [instance()])
    assert route == LeaderRoute("abc123", "https://planner-1.example:4650", "node-1", SESSION)


def test_consul_1_7_session_fields_and_bytes_values_are_read_too() -> None:
    newer = session(Checks=None, NodeChecks=["serfHealth"], ServiceChecks=[{"ID": CHECK}])
    route = resolve_leader(SESSION, value().encode(), newer, [instance()])
    assert isinstance(route, LeaderRoute) and route.url == "https://planner-1.example:4650"


def test_no_holder_is_an_election_not_a_refusal() -> None:
    assert resolve_leader(None, value(), session(), [instance()]) is None
    assert resolve_leader("", None, None, None) is None


def test_a_key_rewritten_to_another_address_is_refused() -> None:
    reason = refused(
        resolve_leader(SESSION, value(address="http://127.0.0.1:9"), session(), [instance()]),
        Refusal.MISMATCH,
    )
    assert "http://127.0.0.1:9" in reason and "https://planner-1.example:4650" in reason
    assert "rewritten outside the lock" in reason


@pytest.mark.parametrize(
    "address",
    [
        "http://planner-1.example:4650",  # a downgrade to clear text
        "https://planner-1.example:4651",  # another port
        "https://planner-1.example.evil:4650",  # another host
        "https://planner-1.example:4650/../x",  # a path
        "https://user@planner-1.example:4650",  # credentials
        "not a url",
    ],
)
def test_every_disagreeing_address_is_refused(address: str) -> None:
    refused(
        resolve_leader(SESSION, value(address=address), session(), [instance()]), Refusal.MISMATCH
    )


def test_a_key_naming_another_planner_at_the_holders_address_is_refused() -> None:
    reason = refused(
        resolve_leader(SESSION, value(planner_id="zzz"), session(), [instance()]), Refusal.MISMATCH
    )
    assert "'zzz'" in reason and "'abc123'" in reason


def test_an_address_written_differently_but_the_same_agrees() -> None:
    for address in ("https://PLANNER-1.example:4650/", "https://planner-1.example"):
        assert isinstance(
            resolve_leader(SESSION, value(address=address), session(), [instance()]), LeaderRoute
        )


def test_a_value_that_is_no_leader_record_is_refused() -> None:
    for raw in (b"", b"{", b'{"id": "abc123"}', b"\xff"):
        refused(resolve_leader(SESSION, raw, session(), [instance()]), Refusal.RECORD_INVALID)


def test_a_session_that_is_gone_is_a_passing_refusal() -> None:
    assert Refusal.SESSION_GONE.transient
    refused(resolve_leader(SESSION, value(), None, [instance()]), Refusal.SESSION_GONE)
    # An answer for some other session is no answer for this one.
    refused(
        resolve_leader(SESSION, value(), session(ID="other"), [instance()]), Refusal.SESSION_GONE
    )


def test_a_session_without_exactly_one_planner_check_is_refused() -> None:
    assert not Refusal.SESSION_UNBOUND.transient
    for checks in (
        ["serfHealth"],
        [],
        ["serfHealth", "service:llmgw-router-1"],
        [CHECK, "service:llmgw-planner-other"],
    ):
        refused(
            resolve_leader(SESSION, value(), session(Checks=checks), [instance()]),
            Refusal.SESSION_UNBOUND,
        )


@pytest.mark.parametrize(
    "registered",
    [
        [],  # deregistered
        [instance(node="node-2")],  # the same service ID on another node
        [instance(service_id="llmgw-planner-other")],  # another instance
        [instance(check="service:llmgw-planner-abc123:2")],  # not bound to the session's check
        [{**instance(), "Service": {**instance()["Service"], "Service": "llmgw-router"}}],
    ],
)
def test_a_holder_without_its_registration_is_refused(registered: list) -> None:
    refused(resolve_leader(SESSION, value(), session(), registered), Refusal.UNREGISTERED)


def test_a_registration_without_a_usable_address_or_scheme_is_refused() -> None:
    no_port = instance()
    no_port["Service"]["Port"] = 0
    refused(resolve_leader(SESSION, value(), session(), [no_port]), Refusal.UNREGISTERED)
    refused(
        resolve_leader(SESSION, value(), session(), [instance(scheme="ftp")]), Refusal.UNREGISTERED
    )


def test_a_registration_without_scheme_meta_is_http_so_an_https_key_disagrees() -> None:
    """A planner from before the scheme was registered: its https key is refused rather
    than the token sent in clear text."""
    refused(resolve_leader(SESSION, value(), session(), [instance(scheme=None)]), Refusal.MISMATCH)
    route = resolve_leader(
        SESSION, value(address="http://planner-1.example:4650"), session(), [instance(scheme=None)]
    )
    assert isinstance(route, LeaderRoute) and route.url.startswith("http://")


def test_the_node_address_stands_in_for_a_service_without_one() -> None:
    bare = instance(address="")
    route = resolve_leader(SESSION, value(address="https://10.0.0.5:4650"), session(), [bare])
    assert isinstance(route, LeaderRoute) and route.url == "https://10.0.0.5:4650"


def test_admin_urls() -> None:
    assert parse_admin_url("https://[FD00::2]:4650") == AdminURL("https", "fd00::2", 4650)
    assert str(AdminURL("https", "fd00::2", 4650)) == "https://[fd00::2]:4650"
    assert parse_admin_url("http://h") == AdminURL("http", "h", 4650)
    for bad, says in (
        ("ftp://h:1", "http or https"),
        ("http://:1", "no host"),
        ("http://h:1/p", "nothing after it"),
        ("http://h:99999", "not a URL"),
    ):
        with pytest.raises(ValueError, match=says):
            parse_admin_url(bad)
