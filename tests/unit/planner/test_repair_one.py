"""planner.daemon.repair.record_or_restored / record_in_job: a model Consul forgot is
answered for from its Nomad job, never as "never applied" (found in CI: after Consul
restarted under a running planner, the new leader answered an activation "never applied"
54 ms before its first repair pass restored the record; the router said 404 for a model
it was serving). The fakes hold only what these functions read and write."""

from __future__ import annotations

import json
from typing import Any

from llmgw_contract import KVPrefix, ModelRecord, decode, kv_key
from planner.daemon import repair
from tests.support.nomad_mock import job

RECORD = {"name": "m", "definition_hash": "d1", "replicas": 1}


class Consul:
    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def get_indexed(self, key: str) -> tuple[int, str | None]:
        return 1, self.texts.get(key)


class Store:
    """put_new as StateStore's (only where no key is); parking updates recorded."""

    def __init__(self, consul: Consul) -> None:
        self.consul = consul
        self.parking: list[str] = []

    def put_new(self, key: str, text: str) -> bool:
        if key in self.consul.texts:
            return False
        self.consul.texts[key] = text
        return True

    def update(self, name: str, change: Any) -> None:
        self.parking.append(name)


class Nomad:
    def __init__(self, *jobs: dict) -> None:
        self.by_id = {j["ID"]: j for j in jobs}

    def job(self, job_id: str) -> dict | None:
        return self.by_id.get(job_id)


def model_job(**meta: str) -> dict:
    return job("m", meta={"llmgw_record": json.dumps(RECORD), **meta})


def test_a_forgotten_model_s_record_comes_back_from_its_job_at_once() -> None:
    consul = Consul({})
    store = Store(consul)
    record = repair.record_or_restored(Nomad(model_job()), consul, store, "m")  # type: ignore[arg-type]
    assert record is not None and record.name == "m"
    key = kv_key(KVPrefix.MODELS, "m")
    assert decode(ModelRecord, consul.texts[key]).definition_hash == "d1"  # written back
    assert store.parking == []


def test_a_parked_job_s_parking_comes_back_with_it() -> None:
    consul = Consul({})
    store = Store(consul)
    parked = model_job(llmgw_parked_reason="5 consecutive start failures")
    assert repair.record_or_restored(Nomad(parked), consul, store, "m") is not None  # type: ignore[arg-type]
    assert store.parking == ["m"]


def test_a_model_nomad_does_not_have_was_never_applied() -> None:
    consul = Consul({})
    other = {**model_job(), "Meta": {"llmgw_record": json.dumps(RECORD)}}  # no llmgw_model
    for nomad in (Nomad(), Nomad(other)):
        assert repair.record_or_restored(nomad, consul, Store(consul), "m") is None  # type: ignore[arg-type]
        assert repair.record_in_job(nomad, "m") is None  # type: ignore[arg-type]
    assert consul.texts == {}


def test_a_record_in_kv_is_read_not_replaced_and_a_follower_only_reads() -> None:
    key = kv_key(KVPrefix.MODELS, "m")
    kept = json.dumps({**RECORD, "definition_hash": "d2"})
    consul = Consul({key: kept})
    record = repair.record_or_restored(Nomad(model_job()), consul, Store(consul), "m")  # type: ignore[arg-type]
    assert record is not None and record.definition_hash == "d2"
    assert consul.texts == {key: kept}
    from_job = repair.record_in_job(Nomad(model_job()), "m")  # type: ignore[arg-type]
    assert from_job is not None and from_job.definition_hash == "d1"


def test_a_name_no_model_may_have_reads_no_other_model_s_job() -> None:
    """Found in review: python-nomad does not quote the job ID, so "m?x" (from a URL)
    read m's job, and retry wrote m's record under "m?x"; a job whose ID or model meta
    is another model's is not this one's either."""

    class Unquoting(Nomad):
        def job(self, job_id: str) -> dict | None:
            return super().job(job_id.split("?")[0].split("#")[0])

    consul = Consul({})
    nomad = Unquoting(model_job())
    for name in ("m?x", "m#x", "m?namespace=default", "M", ""):
        assert repair.record_or_restored(nomad, consul, Store(consul), name) is None  # type: ignore[arg-type]
        assert repair.record_in_job(nomad, name) is None  # type: ignore[arg-type]
    assert consul.texts == {}
    job_of_n = model_job()
    job_of_n["Meta"] = {**job_of_n["Meta"], "llmgw_model": "n"}  # ID m, model n
    assert repair.record_in_job(Nomad(job_of_n), "m") is None  # type: ignore[arg-type]
