"""planner.daemon.engine_records: an engine's KV record keeps its definition, command and
install job through encode and decode, and a record gone from KV is written back from the
install job Nomad still has."""

from __future__ import annotations

from llmgw_contract import EngineRecord, KVPrefix, decode, encode, kv_key
from planner.daemon import repair
from planner.daemon.engine_records import (
    META_COMMAND,
    META_ENGINE,
    META_RECORD,
    definition_of,
    record,
    record_of_job,
    restore,
)
from planner.spec.engine_definitions import EngineDefinition

SHA = "ab" * 32
DEFINITION = EngineDefinition(
    name="llama.cpp",
    version="11434",
    artifact="https://h/x/llama-server",
    sha256=SHA,
    check_model="/opt/m/tiny.gguf",
)
JOB = {
    "ID": "llmgw-engine-llama.cpp",
    "Type": "sysbatch",
    "Version": 2,
    "Meta": {
        META_RECORD: DEFINITION.model_dump_json(),
        META_COMMAND: "/srv/e/llama.cpp/11434/llama-server",
    },
}


def test_a_record_keeps_what_the_install_needs_through_kv() -> None:
    kept = decode(EngineRecord, encode(record(DEFINITION, JOB)))
    assert definition_of(kept) == DEFINITION
    assert (kept.name, kept.version, kept.command) == (
        "llama.cpp",
        "11434",
        "/srv/e/llama.cpp/11434/llama-server",
    )
    assert kept.install_job == {k: v for k, v in JOB.items() if k != "Version"}
    assert record_of_job(JOB) == kept
    assert record_of_job({"ID": "llmgw-engine-x", "Meta": {META_RECORD: "{"}}) is None


class Consul:
    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def get_texts(self, prefix: str) -> dict[str, str]:
        return {k: v for k, v in self.texts.items() if k.startswith(prefix)}


class Store:
    def __init__(self, consul: Consul) -> None:
        self.consul = consul

    def put_new(self, key: str, text: str) -> bool:
        if key in self.consul.texts:
            return False
        self.consul.texts[key] = text
        return True


def test_a_wiped_record_is_restored_from_the_install_job_and_a_present_one_kept() -> None:
    other = record(DEFINITION.model_copy(update={"name": "other", "version": "9"}), JOB)
    consul = Consul({kv_key(KVPrefix.ENGINES, "other"): encode(other)})
    jobs = {"llama.cpp": JOB, "other": JOB}
    assert restore(jobs, consul, Store(consul)) == ["llama.cpp"]  # type: ignore[arg-type]
    assert decode(EngineRecord, consul.texts[kv_key(KVPrefix.ENGINES, "llama.cpp")]) == (
        record_of_job(JOB)
    )
    assert decode(EngineRecord, consul.texts[kv_key(KVPrefix.ENGINES, "other")]) == other
    assert restore(jobs, consul, Store(consul)) == []  # type: ignore[arg-type]


class Nomad:
    def __init__(self, *jobs: dict) -> None:
        self.jobs_ = {j["ID"]: j for j in jobs}

    def jobs(self) -> list[dict]:
        return list(self.jobs_.values())

    def job(self, job_id: str) -> dict | None:
        return self.jobs_.get(job_id)


def test_the_leaders_repair_restores_engine_records_with_the_models() -> None:
    """planner.daemon.repair: a wiped `llmgw/` gets back the record of every engine whose
    install job Nomad still runs; a stopped one's is left out (an engine on its way out)."""
    running = {**JOB, "Meta": {**JOB["Meta"], META_ENGINE: "llama.cpp"}}
    other = DEFINITION.model_copy(update={"name": "other"})
    stopped = {
        **JOB,
        "ID": "llmgw-engine-other",
        "Stop": True,
        "Meta": {**JOB["Meta"], META_ENGINE: "other", META_RECORD: other.model_dump_json()},
    }
    consul = Consul({})
    nomad = Nomad(running, stopped)
    assert repair.restore(nomad, consul, Store(consul)) == []  # type: ignore[arg-type]
    assert set(consul.texts) == {kv_key(KVPrefix.ENGINES, "llama.cpp")}
    assert decode(EngineRecord, consul.texts[kv_key(KVPrefix.ENGINES, "llama.cpp")]) == (
        record_of_job(running)
    )
