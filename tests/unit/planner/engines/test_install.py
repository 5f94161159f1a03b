"""planner.daemon.engine_install, its pure parts: what each engine needs, where its install
failed, what the template gets; and the per-node rows' verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from planner.daemon.engine_install import (
    META_COMMAND,
    META_RECORD,
    META_ROUND,
    META_SPEC_HASH,
    META_VERSION,
    EngineAction,
    NodeInstall,
    changed_builds,
    check_crash,
    crash_of,
    decide,
    failed_nodes,
    refs_of,
    variables,
)
from planner.daemon.engine_records import merged, record
from planner.spec.engine_definitions import EngineDefinition, EngineRef
from planner.spec.settings import Settings

SHA = "cd" * 32


def job(
    version: str = "11434", spec: str = "h1", round_: str = "0", job_version: int = 0
) -> dict[str, Any]:
    return {
        "ID": "llmgw-engine-llama.cpp",
        "Version": job_version,
        "Meta": {META_VERSION: version, META_SPEC_HASH: spec, META_ROUND: round_},
    }


def alloc(node: str, status: str, create: int, job_version: int = 0) -> dict[str, Any]:
    return {
        "NodeID": f"id-{node}",
        "NodeName": node,
        "ClientStatus": status,
        "CreateIndex": create,
        "JobVersion": job_version,
    }


def test_decide_creates_updates_retries_and_leaves_alone() -> None:
    rendered = {"new": job(), "bumped": job("11500", "h2"), "broken": job(), "same": job()}
    registered = {"bumped": job("11434", "h1"), "broken": job(round_="2"), "same": job()}
    changes = {c.engine: c for c in decide(rendered, registered, {"broken": ["node-b"]})}
    assert changes["new"].action is EngineAction.CREATE
    assert (changes["bumped"].action, changes["bumped"].reason) == (
        EngineAction.UPDATE,
        "version 11434 -> 11500",
    )
    retry = changes["broken"]
    assert retry.action is EngineAction.RETRY and retry.job is not None
    assert retry.job["Meta"][META_ROUND] == "3" and "node-b" in retry.reason
    assert (changes["same"].action, changes["same"].job) == (EngineAction.UNCHANGED, None)


def test_each_registration_is_checked_against_the_index_read() -> None:
    """Issue 19: EnforceIndex at the install job's JobModifyIndex as read; a stopped
    job Nomad still keeps (`registered` leaves it out) at its own, else 0."""
    rendered = {"new": job(), "again": job(), "bumped": job("11500", "h2")}
    registered = {"bumped": {**job(), "JobModifyIndex": 31}}
    changes = {c.engine: c for c in decide(rendered, registered, {}, {"again": 12})}
    assert (changes["new"].job_index, changes["again"].job_index, changes["bumped"].job_index) == (
        0,
        12,
        31,
    )


def test_failed_nodes_reads_each_nodes_latest_allocation_of_this_version() -> None:
    allocations = [
        alloc("a", "failed", 10),
        alloc("a", "complete", 20),  # retried, fine
        alloc("b", "failed", 30),
        alloc("c", "failed", 5, job_version=0),
        alloc("c", "complete", 40, job_version=1),
    ]
    assert failed_nodes(job(job_version=0), allocations) == ["b", "c"]
    assert failed_nodes(job(job_version=1), allocations) == []


def test_template_variables_for_an_artifact_and_a_path() -> None:
    settings = Settings(engine_root="/opt/e", engine_nomad_addr="http://127.0.0.1:4646")
    art = EngineDefinition(
        name="llama.cpp", version="11434", artifact="https://h/x/llama-server", sha256=SHA
    )
    values = variables(art, settings)
    assert (values["install_dir"], values["command_file"], values["path"]) == (
        "/opt/e/llama.cpp/11434",
        "llama-server",
        "",
    )
    assert (values["meta_key"], values["nomad_addr"]) == (
        "llmgw_engine_llama.cpp",
        "http://127.0.0.1:4646",
    )
    local = variables(EngineDefinition(name="x", version="1", path="/bin/x", sha256=SHA), settings)
    assert (
        local["path"],
        local["artifact_url"],
        local["install_dir"],
        local["artifact_sha256"],
    ) == ("/bin/x", "", "", SHA)
    assert local["check_args"] == "--version"  # the kind's (llama.cpp) run-once check
    assert "check_model" not in local and local["memory_mb"] == 64
    checked = variables(
        EngineDefinition(name="x", version="1", path="/bin/x", check_model="/m/tiny.gguf"), settings
    )
    serve = checked["check_serve_args"].split()
    assert serve[serve.index("--model") + 1] == "/m/tiny.gguf"
    assert serve[serve.index("--port") + 1] == "${NOMAD_PORT_http}"  # the job's http port
    assert (checked["check_health_path"], checked["check_request_path"]) == (
        "/health",
        "/completion",
    )
    assert '"n_predict": 1' in checked["check_request_body"] and checked["memory_mb"] == 1024


def test_a_node_is_ok_only_with_the_defined_version() -> None:
    assert NodeInstall("a", "e", "2", "2").ok
    assert not NodeInstall("a", "e", "2", "1").ok and not NodeInstall("a", "e", "2", None).ok
    assert NodeInstall("a", "e", "2", None, "failed", "boom").as_dict() == {
        "node": "a",
        "engine": "e",
        "wanted": "2",
        "installed": None,
        "install": "failed",
        "error": "boom",
        "crash": "",
        "ok": False,
    }


def test_a_run_once_check_that_died_of_a_signal_is_named_as_a_crash() -> None:
    line = "llmgw engine install: n1: /opt/x/llama-server --version exited with status 132"
    named = check_crash(line)
    assert named == (
        "llmgw engine install: n1: /opt/x/llama-server --version crashed: "
        "SIGILL (exit 132): illegal instruction (the engine build uses CPU "
        "instructions this node lacks)"
    )
    assert crash_of(named).startswith("SIGILL (exit 132): illegal instruction")
    row = NodeInstall("n1", "x", "1", None, "failed", check_crash(line.replace("132", "139")))
    assert (row.crash, row.as_dict()["crash"]) == ("SIGSEGV (exit 139)", "SIGSEGV (exit 139)")
    exited = line.replace("132", "1")
    assert check_crash(exited) == exited and crash_of(exited) == ""
    assert crash_of("llmgw engine install: n1: /x: sha256 is 00, expected 11") == ""


def test_a_changed_build_under_a_registered_version_is_refused_naming_version() -> None:
    old = EngineDefinition(name="llama.cpp", version="11434", path="/opt/a/llama-server")
    file = Path("engines/llama.cpp.yaml")
    moved = {"llama.cpp": (file, old.model_copy(update={"path": "/opt/b/llama-server"}))}
    (problem,) = changed_builds(moved, {"llama.cpp": old})
    assert (problem.file, problem.field) == (file, "version")
    assert problem.message.startswith(
        "a changed build needs a new version: path '/opt/a/llama-server' -> '/opt/b/llama-server'"
    )
    resummed = {"llama.cpp": (file, old.model_copy(update={"sha256": SHA}))}
    assert "sha256 None -> " in changed_builds(resummed, {"llama.cpp": old})[0].message
    bumped = {"llama.cpp": (file, old.model_copy(update={"path": "/opt/b/x", "version": "11500"}))}
    assert changed_builds(bumped, {"llama.cpp": old}) == []
    assert changed_builds({"llama.cpp": (file, old)}, {"llama.cpp": old}) == []
    assert changed_builds(moved, {}) == []


def test_a_models_command_is_the_one_its_engines_install_recorded() -> None:
    art = EngineDefinition(
        name="llama.cpp", version="11434", artifact="https://h/x/llama-server", sha256=SHA
    )
    meta = {META_RECORD: art.model_dump_json()}
    recorded = {
        "llama.cpp": {"Meta": {**meta, META_COMMAND: "/srv/e/llama.cpp/11434/llama-server"}}
    }
    assert refs_of(merged({}, recorded, "/elsewhere"))["llama.cpp"] == EngineRef(
        "llama.cpp", "llama.cpp", "/srv/e/llama.cpp/11434/llama-server", "11434"
    )
    # A job registered before the command was recorded: the local root places it.
    assert (
        refs_of(merged({}, {"llama.cpp": {"Meta": meta}}, "/opt/e"))["llama.cpp"].command
        == "/opt/e/llama.cpp/11434/llama-server"
    )


def test_the_kv_record_defines_an_engine_whose_install_job_is_gone() -> None:
    """Issue 20: Nomad's GC removed the install job; the engine stays defined, at its
    version and command, from its KV record (which wins over a job's meta)."""
    art = EngineDefinition(
        name="llama.cpp", version="11434", artifact="https://h/x/llama-server", sha256=SHA
    )
    job = {
        "ID": "llmgw-engine-llama.cpp",
        "Version": 3,
        "JobModifyIndex": 40,
        "Meta": {META_RECORD: art.model_dump_json(), META_COMMAND: "/srv/e/11434/llama-server"},
    }
    kept = record(art, job)
    assert "Version" not in kept.install_job and "JobModifyIndex" not in kept.install_job
    assert refs_of(merged({"llama.cpp": kept}, {}))["llama.cpp"] == EngineRef(
        "llama.cpp", "llama.cpp", "/srv/e/11434/llama-server", "11434"
    )
    older = record(art.model_copy(update={"version": "11000"}), job)
    assert merged({"llama.cpp": kept}, {"llama.cpp": job | {"Meta": {}}}) == {"llama.cpp": kept}
    assert merged({"llama.cpp": older}, {"llama.cpp": job})["llama.cpp"].version == "11000"


def test_an_engine_recorded_whose_job_is_gone_is_registered_again_saying_so() -> None:
    changes = {
        c.engine: c
        for c in decide(
            {"gone": job(), "bumped": job("11500", "h2"), "new": job()},
            {},
            {},
            recorded={"gone": "11434", "bumped": "11434"},
        )
    }
    assert {c.action for c in changes.values()} == {EngineAction.CREATE}
    assert changes["gone"].reason == (
        "its install job is gone from Nomad (garbage-collected); registered again"
    )
    assert changes["bumped"].reason == "version 11434 -> 11500"
    assert changes["new"].reason == "new engine"
