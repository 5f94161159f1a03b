"""A model whose engine is missing: the answer counts the nodes' metadata, and waits
(provisional) while an install is on its way (planner.model.unplaceable)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from llmgw_contract import ModelRecord
from planner.daemon.engine_install import META_VERSION
from planner.daemon.placement_answer import answer

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
KEY = "llmgw_engine_llama.cpp"
CONSTRAINT = "${meta.llmgw_engine_llama.cpp} = 11434"
MODEL_JOB = {
    "ID": "m",
    "TaskGroups": [
        {
            "Count": 1,
            "Constraints": [{"LTarget": f"${{meta.{KEY}}}", "Operand": "=", "RTarget": "11434"}],
        }
    ],
}


class Nomad:
    """Two ready nodes with the given metadata, and the engine's install allocations."""

    def __init__(self, meta: dict[str, dict[str, str]], installs: dict[str, str]) -> None:
        self.meta, self.installs = meta, installs
        self.stderr: dict[str, str] = {}

    def nodes(self) -> list[dict[str, Any]]:
        return [
            {
                "ID": name,
                "Name": name,
                "Datacenter": "dc1",
                "Status": "ready",
                "SchedulingEligibility": "eligible",
                "NodeResources": {"Devices": []},
            }
            for name in self.meta
        ]

    def node(self, node_id: str) -> dict[str, Any]:
        return {"ID": node_id, "Name": node_id, "Meta": self.meta[node_id]}

    def job(self, job_id: str) -> dict[str, Any] | None:
        assert job_id == "llmgw-engine-llama.cpp"
        return {"ID": job_id, "Version": 3, "Meta": {META_VERSION: "11434"}}

    def allocations(self, job_id: str) -> list[dict[str, Any]]:
        return [
            {
                "ID": f"alloc-{node}",
                "NodeID": node,
                "ClientStatus": status,
                "JobVersion": 3,
                "CreateIndex": 1,
                "TaskStates": {"install": {"Events": []}},
            }
            for node, status in self.installs.items()
        ]

    def task_stderr_tail(self, alloc_id: str, task: str, size: int = 8192) -> str:
        """The install script's last words (planner/jobspecs/engine.nomad.hcl)."""
        node = alloc_id.removeprefix("alloc-")
        return self.stderr.get(node, f"llmgw engine install: {node}: /x: no such file\n")

    def stopping_allocations(self, since_index: int = 0) -> list[dict[str, Any]]:
        return []


def evaluation() -> dict[str, Any]:
    return {
        "ID": "e1",
        "SnapshotIndex": 10,
        "FailedTGAllocs": {
            "server": {
                "NodesEvaluated": 2,
                "NodesFiltered": 2,
                "ConstraintFiltered": {CONSTRAINT: 1, "computed class ineligible": 1},
            }
        },
    }


RECORD = ModelRecord(name="m", definition_hash="d", replicas=1, profile={"engine": "llama.cpp"})


def test_failed_installs_are_a_settled_answer_with_the_count() -> None:
    nomad = Nomad({"a": {}, "b": {KEY: "11000"}}, {"a": "failed", "b": "failed"})
    found = answer(nomad, RECORD, MODEL_JOB, evaluation(), ("*",), NOW)
    assert found is not None and not found.provisional
    assert found.reason == "engine llama.cpp 11434 is installed on 0 of 2 nodes"


def test_an_install_on_its_way_makes_the_answer_provisional() -> None:
    nomad = Nomad({"a": {}, "b": {}}, {"a": "running", "b": "failed"})
    found = answer(nomad, RECORD, MODEL_JOB, evaluation(), ("*",), NOW)
    assert found is not None and found.provisional
    assert found.told == (
        "waiting for engine llama.cpp 11434 to install on 1 node(s); "
        "Nomad places it when it is recorded (engine llama.cpp 11434 is "
        "installed on 0 of 2 nodes)"
    )


def test_an_engine_that_crashed_in_its_check_is_named_with_the_signal_per_node() -> None:
    nomad = Nomad(
        {"a": {}, "b": {}, "c": {KEY: "11434"}}, {"a": "failed", "b": "failed", "c": "complete"}
    )
    check = "llmgw engine install: {}: /x/llama-server --version exited with status {}\n"
    nomad.stderr = {"a": check.format("a", 132), "b": check.format("b", 139)}
    found = answer(nomad, RECORD, MODEL_JOB, evaluation(), ("*",), NOW)
    assert found is not None and not found.provisional
    assert found.reason == (
        "engine llama.cpp 11434 crashed on node a: SIGILL (exit 132): illegal instruction "
        "(the engine build uses CPU instructions this node lacks); on node b: SIGSEGV "
        "(exit 139) (installed on 1 of 3 nodes)"
    )
