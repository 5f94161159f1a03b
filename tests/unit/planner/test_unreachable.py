"""An agent that does not answer is said as such: the agent, the setting that points at
it and the failure in a few words, without the HTTP library's pool and exception
names, and not as an ACL check (QA on issue 11: `error: check list-jobs on namespace
"default": Nomad did not answer (HTTPConnectionPool(... NewConnectionError ...))`).
Real sockets: port 9 on 127.0.0.1, where nothing listens, refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmgw_contract.acl import CONSUL_KV_READ
from planner.agents.access import NOMAD_LIST_JOBS
from planner.agents.consul import ConsulClient
from planner.agents.nomad import NomadClient
from planner.cli.main import app
from planner.errors import ConsulUnavailable, NomadUnavailable

REFUSED = "127.0.0.1:9"


def test_nomad_refusing_names_nomad_addr_and_says_connection_refused() -> None:
    with pytest.raises(NomadUnavailable) as info:
        NomadClient(f"http://{REFUSED}").denied([NOMAD_LIST_JOBS])
    assert (
        str(info.value)
        == f"Nomad at NOMAD_ADDR=http://{REFUSED} did not answer (connection refused)"
    )
    with pytest.raises(
        NomadUnavailable,
        match=r"^read job x: Nomad at NOMAD_ADDR=\S+ did "
        r"not answer \(connection refused\)$",
    ):
        NomadClient(f"http://{REFUSED}").job("x")


def test_consul_refusing_names_consul_http_addr_and_says_connection_refused() -> None:
    with pytest.raises(ConsulUnavailable) as info:
        ConsulClient(REFUSED).denied([CONSUL_KV_READ])
    assert (
        str(info.value)
        == f"Consul at CONSUL_HTTP_ADDR=http://{REFUSED} did not answer (connection refused)"
    )


def test_the_cli_says_it_without_urllib3s_words(tmp_path: Path) -> None:
    # `apply` checks its permissions first: its first call to Nomad is an ACL probe.
    (tmp_path / "m.yaml").write_text(
        "name: m\nsource: file:///opt/llmgw/models/m.gguf\nprofile: {}\n"
    )
    result = CliRunner().invoke(
        app,
        ["apply", str(tmp_path), "--dry-run"],
        env={
            "NOMAD_ADDR": f"http://{REFUSED}",
            "CONSUL_HTTP_ADDR": REFUSED,
            "LLMGW_MODELS_ROOT": "/opt/llmgw/models",
        },
    )
    assert result.exit_code == 3
    assert (
        f"Nomad at NOMAD_ADDR=http://{REFUSED} did not answer (connection refused)" in result.stderr
    )
    for noise in ("HTTPConnectionPool", "NewConnectionError", "Max retries", "check "):
        assert noise not in result.stderr
