"""Rendering inputs: the variable file and the spec hash."""

from __future__ import annotations

from planner.definitions import ModelDefinition
from planner.jobspec import spec_hash, variable_file, variables
from planner.settings import Settings
from tests.support.nomad_mock import job


def definition(**profile: object) -> ModelDefinition:
    return ModelDefinition.model_validate(
        {"name": "m", "source": "hf://org/repo/m.gguf", "profile": profile, "replicas": 2})


def test_variable_file_escapes_templates_and_keeps_types() -> None:
    text = variable_file({"a": "x${y}%{z}", "n": 3, "b": True, "l": ["p", "q"]})
    assert text == 'a = "x$${y}%%{z}"\nn = 3\nb = true\nl = ["p", "q"]\n'


def test_variables_map_profile_units_for_nomad() -> None:
    values = variables(definition(gpus=1, gpu_memory="24GiB", memory="512MiB",
                                  load_timeout="90s"), Settings())
    assert values["gpu_memory"] == "24576 MiB"
    assert values["memory_mb"] == 512
    assert values["load_grace"] == "90s"
    assert values["artifact_url"] == "https://huggingface.co/org/repo/resolve/main/m.gguf"
    assert values["source_path"] == ""


def test_spec_hash_ignores_its_own_key() -> None:
    assert spec_hash(job(meta={"llmgw_spec_hash": "a"})) == \
        spec_hash(job(meta={"llmgw_spec_hash": "b"}))
    assert spec_hash(job(count=1)) != spec_hash(job(count=2))


def test_the_record_in_the_job_meta_is_the_kv_record() -> None:
    record = definition(gpus=1).record()
    assert (record.name, record.replicas, record.profile["gpus"]) == ("m", 2, 1)
    assert record.definition_hash == definition(gpus=1).definition_hash
