"""Settings: the TLS variables under the `nomad` and `consul` CLIs' names, checked at start
(a bad file is a ValueError naming its variable), and a failed handshake with a real TLS
server explained (which agent, why, which files)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from planner.agents.consul import ConsulClient
from planner.agents.events import stream_events
from planner.agents.nomad import NomadClient
from planner.errors import ConsulUnavailable, NomadUnavailable
from planner.spec.settings import Settings
from tests.support.tls import FileServer, TlsCA, issue, make_ca, serve_https


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TlsCA:
    return make_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> TlsCA:
    return make_ca(tmp_path_factory.mktemp("other-ca"))


@pytest.fixture(scope="module")
def server(ca: TlsCA, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FileServer]:
    """A real HTTPS server with `ca`'s certificate (a file server: only the handshake
    matters here)."""
    served = serve_https(tmp_path_factory.mktemp("www"), ca)
    yield served
    served.close()


def test_tls_variables_and_the_consul_scheme() -> None:
    settings = Settings.from_env(
        {
            "NOMAD_ADDR": "https://nomad.example:4646",
            "NOMAD_CACERT": "/n/ca.pem",
            "NOMAD_CLIENT_CERT": "/n/c.pem",
            "NOMAD_CLIENT_KEY": "/n/c.key",
            "CONSUL_HTTP_ADDR": "consul.example:8501",
            "CONSUL_HTTP_SSL": "true",
            "CONSUL_CACERT": "/c/ca.pem",
            "LLMGW_TLS_CERT": "/p/s.pem",
            "LLMGW_TLS_KEY": "/p/s.key",
            "LLMGW_PLANNER_CACERT": "/p/ca.pem",
        }
    )
    assert settings.consul_url == "https://consul.example:8501"
    assert settings.nomad_tls.verify == "/n/ca.pem"
    assert settings.nomad_tls.cert == ("/n/c.pem", "/n/c.key")
    assert settings.consul_tls.cert is None and settings.serves_tls
    # Keys are not certificates; the serving certificate and the planners' CA are.
    assert settings.certificate_files() == [
        "/n/ca.pem",
        "/n/c.pem",
        "/c/ca.pem",
        "/p/ca.pem",
        "/p/s.pem",
    ]
    plain = Settings.from_env({})
    assert plain.consul_url == "http://127.0.0.1:8500" and plain.nomad_tls.verify is True
    # TLS asked for by either the address or CONSUL_HTTP_SSL is never turned off.
    assert (
        Settings.from_env(
            {"CONSUL_HTTP_ADDR": "https://c:8501", "CONSUL_HTTP_SSL": "false"}
        ).consul_url
        == "https://c:8501"
    )
    assert Settings.from_env({"CONSUL_HTTP_SSL": "1"}).consul_url == "https://127.0.0.1:8500"
    with pytest.raises(ValueError, match="CONSUL_HTTP_SSL='yes'"):
        Settings.from_env({"CONSUL_HTTP_SSL": "yes"})


def test_validate_names_the_variable_of_each_bad_file(
    ca: TlsCA, other_ca: TlsCA, tmp_path: Path
) -> None:
    client_cert, client_key = issue(ca, tmp_path, "client", client=True)
    good = Settings(
        nomad_addr="https://127.0.0.1:4646",
        nomad_cacert=str(ca.ca_cert),
        nomad_client_cert=str(client_cert),
        nomad_client_key=str(client_key),
        consul_cacert=str(ca.ca_cert),
        tls_cert=str(ca.cert),
        tls_key=str(ca.key),
        planner_cacert=str(ca.ca_cert),
    )
    good.validate()
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not PEM")
    cases = {
        "NOMAD_CACERT=/nowhere/ca.pem: No such file": {"nomad_cacert": "/nowhere/ca.pem"},
        "CONSUL_CLIENT_KEY is set but CONSUL_CLIENT_CERT is not": {
            "consul_client_key": str(client_key)
        },
        "LLMGW_PLANNER_CACERT=.*not a PEM CA": {"planner_cacert": str(garbage)},
        # A key that belongs to another certificate.
        "NOMAD_CLIENT_CERT=.* and NOMAD_CLIENT_KEY=.* do not load": {
            "nomad_client_key": str(other_ca.key)
        },
        r"--tls-cert \(LLMGW_TLS_CERT\) is set but --tls-key": {"tls_key": None},
        "NOMAD_ADDR='unix:///run/nomad.sock'": {"nomad_addr": "unix:///run/nomad.sock"},
    }
    for message, change in cases.items():
        bad = Settings(**{**good.__dict__, **change})
        with pytest.raises(ValueError, match=message):
            bad.validate()


def test_a_wrong_ca_is_a_failed_handshake_naming_the_agent_and_files(
    server: FileServer, other_ca: TlsCA
) -> None:
    settings = Settings(
        nomad_addr=server.url,
        consul_addr=server.url,
        nomad_cacert=str(other_ca.ca_cert),
        consul_cacert=str(other_ca.ca_cert),
    )
    nomad = NomadClient(settings.nomad_addr, tls=settings.nomad_tls)
    with pytest.raises(
        NomadUnavailable,
        match=r"list jobs: TLS with Nomad at https://127\.0\.0"
        r"\.1:\d+ failed \(certificate verify failed: .*\); check NOMAD_CACERT="
        r".*; not set: NOMAD_CLIENT_CERT, NOMAD_CLIENT_KEY",
    ):
        nomad.jobs()
    consul = ConsulClient(settings.consul_url, tls=settings.consul_tls)
    with pytest.raises(ConsulUnavailable, match=r"TLS with Consul at .*certificate verify failed"):
        consul.model_records()

    async def first_event() -> None:
        async with aiohttp.ClientSession() as session:
            async for _ in stream_events(session, nomad.address, 1, ssl=nomad.ssl_context):
                break

    with pytest.raises(
        NomadUnavailable,
        match=r"event stream: TLS with Nomad .*certificate "
        r"verify failed.*check NOMAD_CACERT",
    ):
        asyncio.run(first_event())


def test_the_right_ca_gets_through_the_handshake(server: FileServer, ca: TlsCA) -> None:
    """The file server answers 404 to Nomad's API: an answer, so TLS worked."""
    nomad = NomadClient(server.url, tls=Settings(nomad_cacert=str(ca.ca_cert)).nomad_tls)
    assert nomad.job("anything") is None


def test_cli_exits_2_naming_a_missing_file(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "planner.cli.main", "status"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"NOMAD_CACERT": str(tmp_path / "missing.pem"), "PATH": "/usr/bin"},
    )
    assert run.returncode == 2
    assert f"error: NOMAD_CACERT={tmp_path / 'missing.pem'}: No such file" in run.stderr
    assert "Traceback" not in run.stderr


def test_task_user_and_models_root() -> None:
    assert (Settings().task_user, Settings().models_root) == ("", "/opt/llmgw/models")
    settings = Settings.from_env({"LLMGW_TASK_USER": "nobody", "LLMGW_MODELS_ROOT": "/srv/m"})
    assert (settings.task_user, settings.models_root) == ("nobody", "/srv/m")
    with pytest.raises(ValueError, match="LLMGW_TASK_USER: expected a user name"):
        Settings.from_env({"LLMGW_TASK_USER": "root; rm"})
    with pytest.raises(ValueError, match="LLMGW_MODELS_ROOT: expected an absolute path"):
        Settings.from_env({"LLMGW_MODELS_ROOT": "models"})
    with pytest.raises(ValueError, match=r"LLMGW_ENGINES: .* contains '\$\{'"):
        Settings.from_env({"LLMGW_ENGINES": "llama.cpp=/opt/${meta.x}/llama-server"})
