"""Whether a shortfall waits for room being made (planner.model.unplaceable)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from llmgw_contract import ModelRecord
from planner.daemon.placement_answer import answer

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
STOPPING = [{"ID": "a1", "NodeName": "node-a", "DesiredStatus": "stop", "ClientStatus": "running"}]


class Nomad:
    """Only the reads `answer` makes; an allocation is stopping on node-a."""

    def stopping_allocations(self, since_index: int = 0) -> list[dict[str, Any]]:
        return STOPPING

    def nodes(self) -> list[dict[str, Any]]:
        return [
            {
                "ID": "n1",
                "Name": "node-a",
                "Datacenter": "dc1",
                "Status": "ready",
                "NodeResources": {"Devices": []},
            }
        ]


def evaluation(**metric: Any) -> dict[str, Any]:
    return {
        "ID": "e1",
        "SnapshotIndex": 10,
        "FailedTGAllocs": {"server": {"NodesEvaluated": 1, **metric}},
    }


def record(**profile: Any) -> ModelRecord:
    return ModelRecord(
        name="m", definition_hash="d", replicas=1, profile={"memory": 2**30, **profile}
    )


def test_exhausted_memory_waits_for_the_allocation_that_stops() -> None:
    found = answer(
        Nomad(),
        record(),
        None,
        evaluation(NodesExhausted=1, DimensionExhausted={"memory": 1}),
        ("*",),
        NOW,
    )
    assert found is not None and found.provisional
    assert found.reason.startswith("waiting for room: 1 allocation(s) stopping")


def test_a_node_filtered_out_never_waits_for_room() -> None:
    found = answer(
        Nomad(),
        record(gpus=1),
        None,
        evaluation(NodesFiltered=1, ConstraintFiltered={"missing devices": 1}),
        ("*",),
        NOW,
    )
    assert found is not None and not found.provisional
    assert "waiting for room" not in found.reason
