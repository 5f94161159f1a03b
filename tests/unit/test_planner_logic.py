"""Pure planner logic: variable files, the apply decision, plan diffs, status states."""

from __future__ import annotations

from planner.apply import Action, decide
from planner.consul_client import ServiceHealth
from planner.definitions import ModelDefinition
from planner.jobspec import SPEC_HASH_KEY, spec_hash, variable_file, variables
from planner.plandiff import format_diff
from planner.settings import Settings
from planner.status import observe


def definition(**profile: object) -> ModelDefinition:
    return ModelDefinition.model_validate(
        {"name": "m", "source": "hf://org/repo/m.gguf", "profile": profile, "replicas": 2})


def job(spec: str, count: int = 1, stop: bool = False, definition_hash: str = "d1") -> dict:
    return {"ID": "m", "Stop": stop, "TaskGroups": [{"Count": count}],
            "Meta": {"llmgw_model": "m", "llmgw_definition_hash": definition_hash,
                     SPEC_HASH_KEY: spec}}


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
    assert spec_hash(job("a")) == spec_hash(job("b"))
    assert spec_hash(job("a", count=1)) != spec_hash(job("a", count=2))


def test_decide_create_update_unchanged_and_prune() -> None:
    rendered = {"new": job("s1"), "same": job("s1"), "changed": job("s2", definition_hash="d2"),
                "stopped": job("s1")}
    registered = {"same": job("s1"), "changed": job("s1"), "stopped": job("s1", stop=True),
                  "gone": job("s1")}
    changes = {c.model: c for c in decide(rendered, registered, prune=False)}
    assert changes["new"].action is Action.CREATE
    assert changes["same"].action is Action.UNCHANGED
    assert (changes["changed"].action, changes["changed"].reason) == \
        (Action.UPDATE, "source or profile changed")
    assert (changes["stopped"].action, changes["stopped"].reason) == \
        (Action.UPDATE, "job was stopped")
    assert changes["gone"].action is Action.ORPHANED
    pruned = {c.model: c for c in decide(rendered, registered, prune=True)}
    assert pruned["gone"].action is Action.DEREGISTER


def test_plan_diff_reads_like_nomad() -> None:
    diff = {"Type": "Edited", "ID": "m", "Fields": [
        {"Type": "Edited", "Name": "Meta[x]", "Old": "1", "New": "2"}],
        "TaskGroups": [{"Type": "Edited", "Name": "server", "Fields": [
            {"Type": "Edited", "Name": "Count", "Old": "1", "New": "2"},
            {"Type": "None", "Name": "Same", "Old": "a", "New": "a"}]}]}
    assert format_diff(diff) == ['+/- Job: "m"', '  +/- Meta[x]: "1" => "2"',
                                 '  +/- Task Group: "server"', '    +/- Count: "1" => "2"']
    assert format_diff({"Type": "None"}) == ["(no changes)"]


def alloc(status: str, index: int, events: list[dict] | None = None,
          failed: bool = False) -> dict:
    return {"ClientStatus": status, "CreateIndex": index,
            "TaskStates": {"llama-server": {"Failed": failed, "Events": events or [],
                                            "State": "dead" if failed else "running"}}}


def test_observe_states() -> None:
    record = {"replicas": 1}
    healthy = ServiceHealth(total=1, passing=1)
    none = ServiceHealth(total=0, passing=0)
    assert observe("m", record, job("s"), [alloc("running", 1)], healthy).state == "serving"
    assert observe("m", record, job("s"), [alloc("running", 1)], none).state == "loading"
    assert observe("m", record, job("s", count=0), [], none).state == "idle"
    assert observe("m", record, None, [], none).state == "stopped"
    crash = [{"Type": "Terminated", "ExitCode": 1, "Time": 10**18,
              "DisplayMessage": "Exit Code: 1"}]
    failing = observe("m", record, job("s"), [alloc("failed", 2, crash, failed=True)], none)
    assert failing.state == "failing"
    assert failing.last_error == "Terminated: Exit Code: 1"
    assert not failing.satisfied
