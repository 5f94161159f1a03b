"""planner.daemon.engine_follow: a node lacking an engine gets its install job evaluated,
once per job version; ineligible nodes and nodes that have it are left alone."""

from __future__ import annotations

from typing import Any

from planner.daemon.engine_follow import EngineFollower, missing
from planner.daemon.engine_install import META_RECORD, META_VERSION
from planner.spec.engine_definitions import EngineDefinition


def engine_job(name: str = "llama.cpp", version: str = "11434", index: int = 10) -> dict:
    definition = EngineDefinition(name=name, version=version, path="/bin/llama-server")
    return {
        "ID": f"llmgw-engine-{name}",
        "JobModifyIndex": index,
        "Meta": {
            "llmgw_engine": name,
            META_VERSION: version,
            META_RECORD: definition.model_dump_json(),
        },
    }


def node(meta: dict[str, str] | None = None, eligible: bool = True) -> dict[str, Any]:
    return {
        "ID": "n-b",
        "Name": "node-b",
        "Datacenter": "dc1",
        "Status": "ready",
        "SchedulingEligibility": "eligible" if eligible else "ineligible",
        "Meta": meta or {},
    }


class Nomad:
    def __init__(self) -> None:
        self.evaluated: list[str] = []

    def evaluate(self, job_id: str, force_reschedule: bool = False) -> str:
        self.evaluated.append(job_id)
        return "e1"


def test_missing_compares_the_recorded_version() -> None:
    jobs = {"llama.cpp": engine_job(), "other": engine_job("other", "2")}
    assert missing(node({"llmgw_engine_llama.cpp": "11434"}), jobs) == ["other"]
    assert missing(node({"llmgw_engine_llama.cpp": "11000"}), jobs) == ["llama.cpp", "other"]


def test_a_node_lacking_an_engine_is_evaluated_once_per_job_version() -> None:
    nomad = Nomad()
    follower = EngineFollower(nomad)  # type: ignore[arg-type]
    follower.on_job(engine_job())
    assert follower.on_node(node(eligible=False)) == []
    assert follower.on_node(node()) == ["llmgw-engine-llama.cpp"]
    assert follower.on_node(node()) == []  # its re-registrations do not evaluate again
    follower.on_job(engine_job(index=20))  # a new version of the job
    assert follower.on_node(node()) == ["llmgw-engine-llama.cpp"]
    assert follower.on_node(node({"llmgw_engine_llama.cpp": "11434"})) == []
    follower.on_job({**engine_job(), "Stop": True})
    assert follower.on_node(node()) == []
    assert nomad.evaluated == ["llmgw-engine-llama.cpp"] * 2
