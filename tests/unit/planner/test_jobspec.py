"""Rendering inputs: the variable file and the spec hash."""

from __future__ import annotations

from planner.spec.definitions import ModelDefinition
from planner.spec.jobspec import replicas_of, spec_hash, variable_file, variables
from planner.spec.settings import Settings
from tests.support.nomad_mock import job


def definition(**profile: object) -> ModelDefinition:
    return ModelDefinition.model_validate(
        {"name": "m", "source": "hf://org/repo/m.gguf", "profile": profile, "replicas": 2}
    )


def test_variable_file_escapes_templates_and_keeps_types() -> None:
    text = variable_file({"a": "x${y}%{z}", "n": 3, "b": True, "l": ["p", "q"]})
    assert text == 'a = "x$${y}%%{z}"\nn = 3\nb = true\nl = ["p", "q"]\n'


def test_variables_map_profile_units_for_nomad() -> None:
    values = variables(
        definition(gpus=1, gpu_memory="24GiB", memory="512MiB", load_timeout="90s"), Settings()
    )
    assert values["gpu_memory"] == "24576 MiB"
    assert values["memory_mb"] == 512
    assert values["load_grace"] == "90s"
    # A single download keeps the name every https:// model has had (its job unchanged).
    assert values["artifacts"] == [
        {
            "url": "https://huggingface.co/org/repo/resolve/main/m.gguf",
            "sha256": "",
            "file": "model.gguf",
        }
    ]
    assert values["source_path"] == ""


def test_spec_hash_ignores_its_own_key() -> None:
    assert spec_hash(job(meta={"llmgw_spec_hash": "a"})) == spec_hash(
        job(meta={"llmgw_spec_hash": "b"})
    )
    # The count is compared apart (replicas_of): Nomad compares job meta, and a hash
    # that moved with the count would replace every allocation on a scale.
    assert spec_hash(job(count=1)) == spec_hash(job(count=2))
    assert spec_hash(job(count=1)) != spec_hash(job(count=1, Datacenters=["dc2"]))


def with_replicas(replicas: int, count: int) -> dict:
    served = job(count=count)
    served["TaskGroups"][0]["Tasks"] = [{"Services": [{"Meta": {"llmgw_replicas": str(replicas)}}]}]
    served["TaskGroups"][0]["Update"] = {"Canary": count, "AutoPromote": count > 0}
    return served


def test_replicas_live_in_the_service_meta_and_leave_the_spec_hash_alone() -> None:
    assert spec_hash(with_replicas(1, 1)) == spec_hash(with_replicas(3, 3))
    assert replicas_of(with_replicas(3, 3)) == 3
    # A job rendered before: its replicas are in the record in its meta.
    assert replicas_of(job(meta={"llmgw_record": '{"replicas": 2}'})) == 2


def test_the_record_in_the_job_meta_is_the_kv_record() -> None:
    record = definition(gpus=1).record()
    assert (record.name, record.replicas, record.profile["gpus"]) == ("m", 2, 1)
    assert record.definition_hash == definition(gpus=1).definition_hash


def test_the_task_user_is_a_template_variable() -> None:
    assert variables(definition(), Settings())["user"] == ""
    assert variables(definition(), Settings(task_user="nobody"))["user"] == "nobody"
