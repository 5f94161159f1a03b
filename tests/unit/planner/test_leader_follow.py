"""A follower resolves where the lock holder registered once per change of the key, and
again after Consul failed to answer (planner.daemon.leader `Leadership._follow`).

Consul is a stand-in answering its 1.8 JSON shapes (the rule itself:
tests/unit/contract/test_leadership.py; on real agents:
tests/integration/test_leader_forwarding.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from llmgw_contract import LeaderRecord, encode
from llmgw_contract.leadership import LeaderRefused, LeaderRoute, Refusal
from planner.daemon.leader import Leadership
from planner.errors import ConsulUnavailable

CHECK = "service:llmgw-planner-lead1"


class Consul:
    def __init__(self) -> None:
        self.reads = 0
        self.fail = False

    def session_info(self, session_id: str) -> dict[str, Any] | None:
        self.reads += 1
        if self.fail:
            raise ConsulUnavailable("read session: Consul did not answer")
        return {"ID": session_id, "Node": "n1", "Checks": ["serfHealth", CHECK]}

    def service_instances(self, service: str) -> list[dict[str, Any]]:
        return [
            {
                "Node": {"Node": "n1", "Address": "10.0.0.1"},
                "Service": {
                    "ID": "llmgw-planner-lead1",
                    "Service": service,
                    "Address": "10.0.0.1",
                    "Port": 4650,
                    "Meta": {"llmgw_scheme": "http"},
                },
                "Checks": [{"CheckID": CHECK, "Status": "passing"}],
            }
        ]


def key(address: str, index: int) -> dict[str, Any]:
    value = encode(LeaderRecord(id="lead1", address=address)).encode()
    return {"Key": "llmgw/leader", "Session": "s1", "ModifyIndex": index, "Value": value}


async def nothing(_: bool) -> None:
    return None


def test_resolved_once_per_change_and_again_after_a_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    consul = Consul()
    follower = Leadership(consul, "http://10.0.0.2:4650", nothing)  # type: ignore[arg-type]

    async def scenario() -> None:
        await follower._follow(key("http://10.0.0.1:4650", 5))
        assert follower.route == LeaderRoute("lead1", "http://10.0.0.1:4650", "n1", "s1")
        await follower._follow(key("http://10.0.0.1:4650", 5))  # the watch's wait ran out
        assert consul.reads == 1
        with caplog.at_level(logging.WARNING, logger="planner.daemon.leader"):
            await follower._follow(key("http://203.0.113.9:4650", 6))  # rewritten
        assert isinstance(follower.route, LeaderRefused)
        assert follower.route.code is Refusal.MISMATCH
        assert "writes will not be forwarded to the leader" in caplog.text
        consul.fail = True
        await follower._follow(key("http://10.0.0.1:4650", 7))
        assert follower.route is None  # unknown: no_leader, not the old answer
        consul.fail = False
        await follower._follow(key("http://10.0.0.1:4650", 7))  # asked again
        assert isinstance(follower.route, LeaderRoute)
        await follower._follow(None)  # this instance leads, or nobody does
        assert follower.route is None

    asyncio.run(scenario())


def test_an_advertised_address_is_registered_as_parsed() -> None:
    follower = Leadership(Consul(), "HTTPS://Planner.Example", nothing)  # type: ignore[arg-type]
    assert follower.address == "https://planner.example:4650"
    with pytest.raises(ValueError, match="nothing after it"):
        Leadership(Consul(), "http://h:1/x", nothing)  # type: ignore[arg-type]
