"""The engine in a model's job variables: its command, its own arguments and health path,
and the version a defined engine constrains on."""

from __future__ import annotations

from planner.engines import MODEL_FILE
from planner.spec.definitions import ModelDefinition
from planner.spec.engine_definitions import EngineRef
from planner.spec.jobspec import variables
from planner.spec.settings import Settings


def definition(**profile: object) -> ModelDefinition:
    return ModelDefinition.model_validate(
        {"name": "m", "source": "file:///m.gguf", "profile": {"context": 512, **profile}}
    )


def test_an_llmgw_engines_engine_has_no_constraint() -> None:
    values = variables(definition(), Settings(engines={"llama.cpp": "/bin/llama-server"}))
    assert values["engine_command"] == "/bin/llama-server"
    assert (values["engine_version"], values["health_path"]) == ("", "/health")
    assert values["engine_args"][:2] == ["--model", MODEL_FILE]
    assert values["engine_args"][values["engine_args"].index("--ctx-size") + 1] == "512"


def test_a_defined_engine_gives_its_command_and_the_version_to_constrain_on() -> None:
    ref = EngineRef("llama.cpp", "llama.cpp", "/opt/e/llama.cpp/11434/llama-server", "11434")
    values = variables(definition(gpus=1), Settings(), ref)
    assert values["engine_command"] == "/opt/e/llama.cpp/11434/llama-server"
    assert (values["engine_meta_key"], values["engine_version"]) == (
        "llmgw_engine_llama.cpp",
        "11434",
    )
    assert values["engine_args"][-2:] == ["--n-gpu-layers", "999"]
