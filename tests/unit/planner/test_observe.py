"""observe (planner.daemon.observe): the document first, versions cached and bounded,
stderr tails only of failures not counted. Nomad and Consul are stand-ins serving
tests/support/nomad_mock.py shapes and recording the order of the reads."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from llmgw_contract import KVPrefix, ModelRecord, StateDocument, encode, kv_key
from planner.daemon.observe import Observer, VersionCache
from tests.support import nomad_mock as nm

NOW = datetime(2026, 12, 1, tzinfo=UTC)


class Reads:
    def __init__(self) -> None:
        self.log: list[str] = []


class FakeConsul:
    def __init__(self, reads: Reads, texts: dict[str, str]) -> None:
        self.reads, self.texts = reads, texts

    def get_indexed(self, key: str) -> tuple[int, str | None]:
        self.reads.log.append(f"kv {key}")
        text = self.texts.get(key)
        return (7 if text else 0), text


class FakeNomad:
    def __init__(self, reads: Reads) -> None:
        self.reads = reads
        self.job_: dict[str, Any] | None = nm.job("m", CreateIndex=5, Version=1)
        self.versions_ = [nm.job("m", CreateIndex=5, Version=v) for v in (1, 0)]
        self.allocs: list[dict[str, Any]] = []
        self.tails: list[str] = []
        self.own_jobs: dict[str, dict[str, Any]] = {}  # alloc id -> the job it was placed with

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.reads.log.append(name)
            return {
                "current_index": 40,
                "job": self.job_,
                "allocations": self.allocs,
                "deployments": [],
                "evaluations": [],
                "versions": self.versions_,
            }[name]

        return call

    def allocation(self, alloc_id: str) -> dict[str, Any] | None:
        self.reads.log.append(f"allocation {alloc_id}")
        own = self.own_jobs.get(alloc_id)
        return None if own is None else {"ID": alloc_id, "Job": own}

    def task_stderr_tail(self, alloc_id: str, task: str) -> str:
        self.tails.append(alloc_id)
        return f"stderr of {alloc_id}"


class Store:
    def __init__(self, reads: Reads, document: StateDocument) -> None:
        self.reads, self.document = reads, document

    def read(self, name: str) -> tuple[int, StateDocument]:
        self.reads.log.append("state")
        return 3, self.document


def observer(document: StateDocument | None = None) -> tuple[Observer, FakeNomad, Reads]:
    reads = Reads()
    record = ModelRecord(
        name="m", definition_hash="d1", source="file:///m.gguf", profile={}, replicas=1
    )
    consul = FakeConsul(reads, {kv_key(KVPrefix.MODELS, "m"): encode(record)})
    nomad = FakeNomad(reads)
    store = Store(reads, document or StateDocument(name="m", definition_hash="d1"))
    return Observer(nomad, consul, store), nomad, reads  # type: ignore[arg-type]


def test_the_document_is_read_before_anything_of_nomad() -> None:
    obs, _, reads = observer()
    _, observation = obs.observe("m", {}, NOW)
    assert reads.log[0] == "state" and reads.log[1].startswith("kv ")
    assert observation.state_index == 3 and observation.nomad_index == 40
    assert observation.record is not None and observation.job_version == 1
    assert [v["Version"] for v in observation.versions] == [1, 0]


def test_versions_are_read_once_and_again_only_for_a_version_not_cached() -> None:
    obs, nomad, reads = observer()
    for _ in range(5):
        obs.observe("m", {}, NOW)
    assert reads.log.count("versions") == 1
    # A version Nomad no longer keeps (older than its oldest) is not asked for again.
    nomad.allocs = [nm.alloc("a1", version=0)]
    obs.observe("m", {}, NOW)
    assert reads.log.count("versions") == 1
    nomad.job_ = nm.job("m", CreateIndex=5, Version=2)  # a new version
    nomad.versions_ = [nm.job("m", CreateIndex=5, Version=v) for v in (2, 1)]
    obs.observe("m", {}, NOW)
    assert reads.log.count("versions") == 2
    assert len(obs.versions) == 2  # version 0, no longer listed, dropped


def test_a_purged_job_leaves_nothing_cached_and_a_new_incarnation_starts_over() -> None:
    obs, nomad, _ = observer()
    obs.observe("m", {}, NOW)
    nomad.job_ = None
    obs.observe("m", {}, NOW)
    assert len(obs.versions) == 0
    nomad.job_ = nm.job("m", CreateIndex=90, Version=0)
    nomad.versions_ = [nomad.job_]
    observation = obs.observe("m", {}, NOW)[1]
    assert [v["CreateIndex"] for v in observation.versions] == [90]


def test_stderr_is_read_only_for_failures_not_counted() -> None:
    failed = nm.alloc("a1", *nm.run(10, 11), *nm.run(20, 21), version=1)
    counted = f"a1/{nm.TASK}/{11 * nm.S}"
    obs, nomad, _ = observer(StateDocument(name="m", definition_hash="d1", counted=(counted,)))
    nomad.allocs = [failed]
    observation = obs.observe("m", {"a1": 5, "other-model-alloc": 6}, NOW)[1]
    assert list(observation.stderr) == [f"a1/{nm.TASK}/{21 * nm.S}"]
    assert nomad.tails == ["a1"]
    assert observation.passing == {"a1": 5}


def test_the_cache_is_bounded_by_the_models_kept() -> None:
    cache = VersionCache()
    nomad = FakeNomad(Reads())
    for i in range(50):
        job = nm.job(f"m{i}", CreateIndex=5, Version=1)
        nomad.versions_ = [job]
        cache.versions(nomad, job, {1})  # type: ignore[arg-type]
    cache.keep_only({"m1", "m2"})
    assert len(cache) == 2


def test_only_a_failed_replica_of_a_version_nomad_dropped_has_its_own_job_read() -> None:
    """A scaling model makes a version per scale; Nomad keeps the last 6. A failed replica
    a forced reschedule would place again, of a version no longer kept, is judged by the
    job it was placed with (`planner.model.resurrect.failed_elsewhere`): one read each,
    of those alone."""
    obs, nomad, reads = observer()
    nomad.job_ = nm.job("m", CreateIndex=5, Version=9)
    nomad.versions_ = [nm.job("m", CreateIndex=5, Version=v) for v in range(9, 3, -1)]
    nomad.allocs = [
        nm.alloc("dropped", version=2, client="failed"),
        nm.alloc("gone", version=2, client="failed"),  # Nomad no longer has it
        nm.alloc("kept", version=9, client="failed"),
        nm.alloc("running", version=1),
        nm.alloc("replaced", version=1, client="failed", NextAllocation="x"),
    ]
    nomad.own_jobs = {"dropped": nm.job("m", definition_hash="d1", Version=2)}
    observation = obs.observe("m", {}, NOW)[1]
    assert observation.own_definitions == {"dropped": "d1"}
    assert [r for r in reads.log if r.startswith("allocation ")] == [
        "allocation dropped",
        "allocation gone",
    ]
