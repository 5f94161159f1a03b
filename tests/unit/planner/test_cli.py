"""The planner CLI's failures with --output json: a script reads what went wrong from
stdout, as JSON, with the same exit code (found by a new user: apply printed nothing
on stdout for invalid files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmgw_contract import ModelState
from planner.cli.main import _rollout, advertised_url, app
from planner.model.status import ModelStatus, ReplicaState, ReplicaStatus

# Nothing listens here: validation must fail before any agent is asked. The models
# root is the default whatever the shell (or the integration tests) set.
UNREACHABLE = {
    "NOMAD_ADDR": "http://127.0.0.1:9",
    "CONSUL_HTTP_ADDR": "127.0.0.1:9",
    "LLMGW_MODELS_ROOT": "/opt/llmgw/models",
}


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
    result = CliRunner().invoke(app, list(args), env={**UNREACHABLE, **(env or {})})
    return result.exit_code, json.loads(result.stdout)


def test_invalid_files_are_reported_as_json_with_every_problem(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(
        "name: a\nsource: file:///opt/llmgw/models/m.gguf\nprofile:\n  context: abc\n"
    )
    code, answer = run("apply", str(tmp_path), "--output", "json")
    assert code == 2
    error = answer["error"]
    assert (error["kind"], error["exit_code"]) == ("InvalidDefinitions", 2)
    [problem] = error["problems"]
    assert problem["file"] == str(tmp_path / "a.yaml")
    assert problem["field"] == "profile.context"


def test_an_unreachable_agent_is_exit_3_in_json() -> None:
    code, answer = run("status", "--output", "json")
    assert (code, answer["error"]["exit_code"]) == (3, 3)
    assert answer["error"]["kind"].endswith("Unavailable")


@pytest.mark.parametrize("command", [["status"], ["retry", "m"]])
def test_a_wrong_setting_is_exit_2_in_json(command: list[str]) -> None:
    code, answer = run(*command, "--output", "json", env={"NOMAD_CACERT": "/nonexistent/ca.pem"})
    assert code == 2
    assert answer["error"]["kind"] == "InvalidSettings"
    assert "/nonexistent/ca.pem" in answer["error"]["message"]


def test_detailed_exitcode_turns_every_error_into_1_and_says_it_in_markdown(tmp_path: Path) -> None:
    """terraform plan -detailed-exitcode's codes: an invalid file is 1, not 2 (2 would
    read as "changes"); the merge request gets the problems as a Markdown table."""
    (tmp_path / "a.yaml").write_text(
        "name: a\nsource: file:///opt/llmgw/models/m.gguf\nprofile:\n  context: abc\n"
    )
    result = CliRunner().invoke(
        app,
        ["apply", str(tmp_path), "--dry-run", "--detailed-exitcode", "--output", "markdown"],
        env=UNREACHABLE,
    )
    assert result.exit_code == 1
    assert result.stdout.startswith("### llmgw plan failed\n")
    assert f"| `{tmp_path / 'a.yaml'}` | `profile.context` |" in result.stdout
    # Unreachable agents: also 1 (3 without the flag).
    (tmp_path / "a.yaml").write_text(
        "name: a\nsource: file:///opt/llmgw/models/m.gguf\nprofile:\n  context: 512\n"
    )
    result = CliRunner().invoke(
        app, ["apply", str(tmp_path), "--dry-run", "--detailed-exitcode"], env=UNREACHABLE
    )
    assert result.exit_code == 1


def test_detailed_exitcode_needs_dry_run(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["apply", str(tmp_path), "--detailed-exitcode"], env=UNREACHABLE
    )
    assert result.exit_code == 1 and "goes with --dry-run" in result.stderr


def _replica(version: int, state: str) -> ReplicaStatus:
    return ReplicaStatus(
        replica="server[0]",
        alloc_id="a",
        node="n",
        state=state,
        consecutive_failures=0,
        last_error=None,
        last_error_at=None,
        job_version=version,
    )


def _row(state: ModelState, *replicas: ReplicaStatus) -> ModelStatus:
    return ModelStatus(
        name="m",
        state=state,
        desired=1,
        running=1,
        ready=0,
        consecutive_failures=0,
        start_failures_total=0,
        reason="r",
        last_error=None,
        since=None,
        replicas=replicas,
        job_version=1,
    )


def test_wait_progress_says_a_rollout_only_while_one_runs() -> None:
    old_failing = _replica(0, ReplicaState.FAILING)
    assert _rollout(_row(ModelState.PARKED, old_failing)) == ""
    assert (
        _rollout(_row(ModelState.LOADING, old_failing))
        == "; rolling out version 1: no new replica placed yet, 0 old serving meanwhile"
    )
    assert (
        _rollout(
            _row(
                ModelState.LOADING,
                _replica(0, ReplicaState.SERVING),
                _replica(1, ReplicaState.LOADING),
            )
        )
        == "; rolling out version 1: 0 of 1 new replica(s) healthy, 1 old serving meanwhile"
    )


def test_advertise_without_a_scheme_follows_the_admin_apis_tls() -> None:
    """The planner job passes --advertise HOST:PORT: https when LLMGW_TLS_CERT (maybe
    from KV) makes the admin API serve TLS, else http (QA on issue 11)."""
    assert advertised_url("10.0.0.1:4650", serves_tls=True) == "https://10.0.0.1:4650"
    assert advertised_url("10.0.0.1:4650", serves_tls=False) == "http://10.0.0.1:4650"
    assert advertised_url("http://lb:4650", serves_tls=True) == "http://lb:4650"


def test_under_detailed_exitcode_the_json_error_says_the_exit_code_the_process_exits_with(
    tmp_path: Path,
) -> None:
    """QA on issue 11: the body said 2 (or 3) while the process exited 1."""
    (tmp_path / "a.yaml").write_text(
        "name: a\nsource: file:///opt/llmgw/models/m.gguf\nprofile:\n  context: abc\n"
    )
    flags = ("--dry-run", "--detailed-exitcode", "--output", "json")
    code, answer = run("apply", str(tmp_path), *flags)
    assert (code, answer["error"]["exit_code"]) == (1, 1)
    assert answer["error"]["kind"] == "InvalidDefinitions"
    # An agent that does not answer: 3 without the flag, 1 with it, in both places.
    (tmp_path / "a.yaml").write_text(
        "name: a\nsource: file:///opt/llmgw/models/m.gguf\nprofile:\n"
        "  context: 512\n  cpu: 100\n  memory: 256MiB\n"
    )
    code, answer = run("apply", str(tmp_path), *flags)
    assert (code, answer["error"]["exit_code"]) == (1, 1)
    assert answer["error"]["kind"].endswith("Unavailable")
    code, answer = run("apply", str(tmp_path), "--output", "json")
    assert (code, answer["error"]["exit_code"]) == (3, 3)


@pytest.mark.parametrize(
    "advertise", ["http://h:1/prefix", "ftp://h:1", "http://h:1?x=1", "http://user@h:1"]
)
def test_serve_refuses_an_advertised_url_it_could_not_register(advertise: str) -> None:
    """Followers and routers reach a planner only at scheme://host:port as registered in
    Consul (llmgw_contract.leadership): anything more is refused before any agent is
    asked."""
    result = CliRunner().invoke(app, ["serve", "--advertise", advertise], env=UNREACHABLE)
    assert result.exit_code == 2
    assert "error: --advertise:" in result.output
