"""planner.daemon.engine_follow: a node lacking an engine gets its install job evaluated,
once per job version, or registered again from the engine's KV record when Nomad's GC
removed it; ineligible nodes, nodes that have it and stopped install jobs are left
alone."""

from __future__ import annotations

from typing import Any

from llmgw_contract import EngineRecord
from planner.daemon.engine_follow import EngineFollower, missing
from planner.daemon.engine_install import META_VERSION
from planner.daemon.engine_records import META_COMMAND, META_ENGINE, META_RECORD, record
from planner.spec.engine_definitions import EngineDefinition


def engine_job(name: str = "llama.cpp", version: str = "11434", index: int = 10) -> dict:
    definition = EngineDefinition(name=name, version=version, path="/bin/llama-server")
    return {
        "ID": f"llmgw-engine-{name}",
        "JobModifyIndex": index,
        "Meta": {
            META_ENGINE: name,
            META_VERSION: version,
            META_RECORD: definition.model_dump_json(),
            META_COMMAND: "/bin/llama-server",
        },
    }


def engine_record(name: str = "llama.cpp", version: str = "11434") -> EngineRecord:
    job = engine_job(name, version)
    return record(EngineDefinition.model_validate_json(job["Meta"][META_RECORD]), job)


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
    """The install jobs Nomad has (by ID), what was evaluated and registered."""

    def __init__(self, *jobs: dict[str, Any]) -> None:
        self.jobs_ = {j["ID"]: j for j in jobs}
        self.evaluated: list[str] = []
        self.registered: list[dict[str, Any]] = []

    def jobs(self) -> list[dict[str, Any]]:
        return list(self.jobs_.values())

    def nodes(self) -> list[dict[str, Any]]:
        return []

    def job(self, job_id: str) -> dict[str, Any] | None:
        return self.jobs_.get(job_id)

    def evaluate(self, job_id: str, force_reschedule: bool = False) -> str:
        self.evaluated.append(job_id)
        return "e1"

    def register(self, job: dict[str, Any], enforce_index: int | None = None) -> dict[str, Any]:
        assert enforce_index == 0  # only while Nomad has none
        self.registered.append(job)
        self.jobs_[job["ID"]] = {**job, "JobModifyIndex": 30}
        return {"EvalID": "e2", "JobModifyIndex": 30}


class Consul:
    def __init__(self, *records: EngineRecord) -> None:
        self.records = {r.name: r for r in records}

    def engine_records(self) -> dict[str, EngineRecord]:
        return dict(self.records)


def test_missing_compares_the_recorded_version() -> None:
    records = {"llama.cpp": engine_record(), "other": engine_record("other", "2")}
    assert missing(node({"llmgw_engine_llama.cpp": "11434"}), records) == ["other"]
    assert missing(node({"llmgw_engine_llama.cpp": "11000"}), records) == ["llama.cpp", "other"]


def test_a_node_lacking_an_engine_is_evaluated_once_per_job_version() -> None:
    nomad = Nomad(engine_job())
    follower = EngineFollower(nomad)  # type: ignore[arg-type]
    follower.on_job(engine_job())
    assert follower.on_node(node(eligible=False)) == []
    assert follower.on_node(node()) == ["llmgw-engine-llama.cpp"]
    assert follower.on_node(node()) == []  # its re-registrations do not evaluate again
    nomad.jobs_["llmgw-engine-llama.cpp"] = engine_job(index=20)  # a new version of the job
    follower.on_job(engine_job(index=20))
    assert follower.on_node(node()) == ["llmgw-engine-llama.cpp"]
    assert follower.on_node(node({"llmgw_engine_llama.cpp": "11434"})) == []
    nomad.jobs_["llmgw-engine-llama.cpp"] = {**engine_job(index=21), "Stop": True}
    follower.on_job(nomad.jobs_["llmgw-engine-llama.cpp"])
    assert follower.on_node(node()) == []  # stopped, and no record: not defined
    assert nomad.evaluated == ["llmgw-engine-llama.cpp"] * 2


def test_after_nomads_gc_the_record_registers_the_install_job_again_for_a_new_node() -> None:
    """Issue 20: GC removed the dead sysbatch job; the KV record still defines the
    engine, and a node that lacks it gets the job registered again, as recorded."""
    nomad, consul = Nomad(), Consul(engine_record())
    follower = EngineFollower(nomad, consul=consul)  # type: ignore[arg-type]
    follower.on_job({**engine_job(), "Stop": False})  # the GC's deregistration event
    assert follower.on_node(node({"llmgw_engine_llama.cpp": "11434"})) == []
    assert follower.on_node(node()) == ["llmgw-engine-llama.cpp"]
    [again] = nomad.registered
    assert again == consul.records["llama.cpp"].install_job
    assert "JobModifyIndex" not in again  # as rendered, not as Nomad stored it
    # Now Nomad has it again: a later event for that node evaluates at most once.
    assert follower.on_node(node()) == ["llmgw-engine-llama.cpp"]
    assert follower.on_node(node()) == []
    assert len(nomad.registered) == 1


def test_a_stopped_install_job_is_left_stopped_even_with_a_record() -> None:
    stopped = {**engine_job(), "Stop": True}
    nomad, consul = Nomad(stopped), Consul(engine_record())
    follower = EngineFollower(nomad, consul=consul)  # type: ignore[arg-type]
    follower.reconcile()  # reads nodes: none in this Nomad
    assert follower.on_node(node()) == []
    assert (nomad.evaluated, nomad.registered) == ([], [])
