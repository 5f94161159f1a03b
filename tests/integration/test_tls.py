"""TLS end to end on real agents: a Consul and a Nomad dev agent that serve HTTPS only and
require a client certificate (Nomad talking to its Consul over TLS too), with the planner
and the router reaching them through the CLIs' variables, serving HTTPS themselves, and
calling each other over it; a wrong CA or a missing client certificate is a clear error
naming the agent and the files, not a traceback.

The cluster is this module's own (`Cluster(..., tls=TlsFiles(...))`), beside the session's
plain HTTP one when both run.
"""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from devcluster.cluster import Cluster, TlsFiles, client_context
from llmgw_contract.certificates import EXPIRY, READ_SUCCESS, not_after
from tests.conftest import ADMIN_TOKEN, free_port, own_cluster, wait_for
from tests.support.tls import TlsCA, issue, make_ca

pytestmark = pytest.mark.integration

SMALL = 'context: 512\n  cpu: 100\n  memory: 256MiB\n  args: ["--threads", "1"]'


@dataclass(frozen=True)
class Pki:
    """The cluster's CA and every certificate the tests use; the planner's and router's
    serving certificates expire on days of their own, so each expiry series is told
    apart from the CA's."""

    ca: TlsCA
    client_cert: Path
    client_key: Path
    planner_cert: Path
    planner_key: Path
    router_cert: Path
    router_key: Path
    other_ca: TlsCA  # signed nothing here: the wrong CA

    def trust(self) -> ssl.SSLContext:
        """A client context that trusts the CA (the planner and router ask for no client
        certificate)."""
        return ssl.create_default_context(cafile=self.ca.ca_cert)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca = make_ca(folder)
    other = tmp_path_factory.mktemp("other-ca")
    return Pki(
        ca,
        *issue(ca, folder, "client", client=True),
        *issue(ca, folder, "planner", days=30),
        *issue(ca, folder, "router", days=20),
        make_ca(other),
    )


@pytest.fixture(scope="module")
def tls_cluster(
    binaries: Path, pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    files = TlsFiles(pki.ca.ca_cert, pki.ca.cert, pki.ca.key, pki.client_cert, pki.client_key)
    with own_cluster(tmp_path_factory.mktemp("tls-cluster"), tls=files) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def env(tls_cluster: Cluster, binaries: Path) -> dict[str, str]:
    """The planner's and router's environment: the cluster's TLS variables, as the
    `nomad` and `consul` CLIs read them."""
    return {
        **os.environ,
        **tls_cluster.env,
        "LLMGW_ENGINES": f"llama.cpp={binaries / 'llama-server'}",
    }


def https_json(
    url: str,
    context: ssl.SSLContext | None,
    body: dict | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
        text = response.read()
    return json.loads(text) if text else None


def refusal(url: str, context: ssl.SSLContext, body: dict) -> tuple[int, dict]:
    """(status, OpenAI error object) of a request that must be refused; the response is
    closed here, so the server's shutdown does not wait for its connection."""
    with pytest.raises(urllib.error.HTTPError) as info:
        https_json(url, context, body)
    with info.value as response:
        return response.code, json.load(response)["error"]


def scrape(url: str, context: ssl.SSLContext) -> dict[tuple[str, str], float]:
    """{(series, path label): value} of the certificate series of one scrape."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10, context=context) as response:
        text = response.read().decode()
    return {
        (s.name, s.labels.get("path", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def planner_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "planner.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def write_model(folder: Path, name: str, source: Path, replicas: int = 1, extra: str = "") -> Path:
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.yaml").write_text(
        f"name: {name}\nsource: file://{source}\nprofile:\n  {SMALL}\nreplicas: {replicas}\n{extra}"
    )
    return folder


@contextlib.contextmanager
def process(argv: list[str], env: dict[str, str], log: Path) -> Iterator[None]:
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", *argv], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def tls_planner(env: dict[str, str], pki: Pki, log: Path) -> Iterator[str]:
    """`planner serve --tls-cert` (followers verify the leader with LLMGW_PLANNER_CACERT);
    yields its https:// URL once it leads and reconciled, or knows the leader."""
    port = free_port()
    with process(
        [
            "planner.cli.main",
            "serve",
            "--port",
            str(port),
            "--tls-cert",
            str(pki.planner_cert),
            "--tls-key",
            str(pki.planner_key),
        ],
        {**env, "LLMGW_ADMIN_TOKEN": ADMIN_TOKEN, "LLMGW_PLANNER_CACERT": str(pki.ca.ca_cert)},
        log,
    ):
        url = f"https://127.0.0.1:{port}"
        wait_for(
            lambda: https_json(f"{url}/health", pki.trust(), timeout=2)["ready"],
            30,
            f"the TLS planner at {url} to be ready",
        )
        yield url


@contextlib.contextmanager
def tls_router(
    env: dict[str, str], pki: Pki, planner_url: str, log: Path, planner_ca: Path
) -> Iterator[str]:
    """`router serve --tls-cert`, calling the planner at `planner_url` trusting
    `planner_ca`; yields its https:// URL once it read the models from Consul."""
    port = free_port()
    with process(
        [
            "router.cli",
            "serve",
            "--port",
            str(port),
            "--tls-cert",
            str(pki.router_cert),
            "--tls-key",
            str(pki.router_key),
        ],
        {
            **env,
            "LLMGW_PLANNER_URL": planner_url,
            "LLMGW_PLANNER_TOKEN": ADMIN_TOKEN,
            "LLMGW_PLANNER_CACERT": str(planner_ca),
        },
        log,
    ):
        url = f"https://127.0.0.1:{port}"
        wait_for(
            lambda: https_json(f"{url}/health", pki.trust(), timeout=2),
            30,
            f"the TLS router at {url} to read Consul",
        )
        yield url


@pytest.fixture(scope="module")
def applied(
    env: dict[str, str], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """`planner apply --wait` of a tiny always-on model, over TLS to both agents."""
    folder = write_model(tmp_path_factory.mktemp("models"), "tls-tiny", tiny_model)
    run = planner_cli(env, "apply", str(folder), "--wait", "--timeout", "120")
    assert run.returncode == 0, run.stderr
    return folder


@pytest.fixture(scope="module")
def leader(env: dict[str, str], pki: Pki, tls_cluster: Cluster, applied: Path) -> Iterator[str]:
    with tls_planner(env, pki, tls_cluster.root / "planner-leader.log") as url:
        yield url


def test_apply_and_status_over_tls_with_client_certificates(
    env: dict[str, str], applied: Path, tls_cluster: Cluster
) -> None:
    status = planner_cli(env, "status", "--output", "json")
    assert status.returncode == 0, status.stderr
    [row] = json.loads(status.stdout)
    assert (row["name"], row["state"], row["ready"]) == ("tls-tiny", "serving", 1)
    # The agents really are HTTPS-only and ask for a client certificate.
    with pytest.raises(OSError, match="certificate required"):
        https_json(
            f"{tls_cluster.nomad_addr}/v1/jobs",
            ssl.create_default_context(cafile=tls_cluster.tls.ca),
        )  # type: ignore[union-attr]
    assert (
        https_json(f"{tls_cluster.nomad_addr}/v1/job/tls-tiny", client_context(tls_cluster))["ID"]
        == "tls-tiny"
    )


def test_tls_planner_leads_follows_its_event_stream_and_publishes_its_certificates(
    env: dict[str, str],
    pki: Pki,
    leader: str,
    tiny_model: Path,
    tmp_path: Path,
    tls_cluster: Cluster,
) -> None:
    health = https_json(f"{leader}/health", pki.trust())
    # The leader record carries the https:// address followers forward writes to.
    assert health["role"] == "leader" and health["leader"]["address"] == leader

    # The event stream is up over TLS: a new job's events arrive.
    run = planner_cli(
        env, "apply", str(write_model(tmp_path / "m", "tls-zero", tiny_model, replicas=0))
    )
    assert run.returncode == 0, run.stderr
    samples = wait_for(
        lambda: (
            (s := scrape(leader, pki.trust()))
            and s.get(("llmgw_planner_event_stream_last_message_timestamp_seconds", ""), 0) > 0
            and s
        ),
        40,
        "an event or heartbeat on the leader's Nomad event stream",
    )
    assert samples[("llmgw_planner_event_stream_reconnects_total", "")] == 0

    configured = {pki.ca.ca_cert, pki.client_cert, pki.planner_cert}  # NOMAD_*, CONSUL_*, own
    for path in configured:
        assert samples[(READ_SUCCESS, str(path))] == 1
        assert samples[(EXPIRY, str(path))] == not_after(path)
    assert {p for (name, p) in samples if name == READ_SUCCESS} == {str(p) for p in configured}
    assert samples[(EXPIRY, str(pki.planner_cert))] > samples[(EXPIRY, str(pki.ca.ca_cert))]

    # A follower forwards a write to the TLS leader, trusting LLMGW_PLANNER_CACERT.
    with tls_planner(env, pki, tls_cluster.root / "planner-follower.log") as follower:
        assert https_json(f"{follower}/health", pki.trust())["role"] == "follower"
        answer = https_json(
            f"{follower}/v1/models/tls-tiny/activate",
            pki.trust(),
            body={},
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        )
        assert answer["status"] == "serving"


def test_tls_router_serves_and_activates_through_the_tls_planner(
    env: dict[str, str],
    pki: Pki,
    leader: str,
    tiny_model: Path,
    tmp_path: Path,
    tls_cluster: Cluster,
) -> None:
    folder = write_model(
        tmp_path / "m", "tls-od", tiny_model, extra="on_demand:\n  idle_after: 15m\n"
    )
    assert planner_cli(env, "apply", str(folder)).returncode == 0
    with tls_router(env, pki, leader, tls_cluster.root / "router.log", pki.ca.ca_cert) as router:
        # ignore_eos: the tiny model's random weights may end a sampled answer early.
        body = {"prompt": "hi", "max_tokens": 4, "ignore_eos": True}
        served = https_json(f"{router}/v1/completions", pki.trust(), {**body, "model": "tls-tiny"})
        assert served["usage"]["completion_tokens"] == 4
        # An on-demand model with no replica: the router asks the https:// planner.
        activated = https_json(
            f"{router}/v1/completions", pki.trust(), {**body, "model": "tls-od"}, timeout=60
        )
        assert activated["usage"]["completion_tokens"] == 4
        samples = scrape(router, pki.trust())
    for path in (pki.ca.ca_cert, pki.client_cert, pki.router_cert):
        assert samples[(READ_SUCCESS, str(path))] == 1
        assert samples[(EXPIRY, str(path))] == not_after(path)


def test_a_wrong_ca_or_no_client_certificate_is_a_clear_error(
    env: dict[str, str],
    pki: Pki,
    leader: str,
    applied: Path,
    tiny_model: Path,
    tmp_path: Path,
    tls_cluster: Cluster,
) -> None:
    wrong = str(pki.other_ca.ca_cert)
    run = planner_cli({**env, "NOMAD_CACERT": wrong}, "apply", str(applied))
    assert run.returncode == 3 and "Traceback" not in run.stderr
    assert (
        f"TLS with Nomad at {tls_cluster.nomad_addr} failed (certificate verify failed"
        in run.stderr
        and f"NOMAD_CACERT={wrong}" in run.stderr
    )
    run = planner_cli({**env, "CONSUL_CACERT": wrong}, "status")
    assert run.returncode == 3 and "Traceback" not in run.stderr
    assert f"TLS with Consul at {tls_cluster.consul_addr} failed" in run.stderr
    run = planner_cli({**env, "CONSUL_CLIENT_CERT": "", "CONSUL_CLIENT_KEY": ""}, "status")
    assert run.returncode == 3 and "Traceback" not in run.stderr
    assert "not set: CONSUL_CLIENT_CERT, CONSUL_CLIENT_KEY" in run.stderr
    run = planner_cli({**env, "NOMAD_CLIENT_KEY": str(tmp_path / "missing.key")}, "status")
    assert run.returncode == 2
    assert f"NOMAD_CLIENT_KEY={tmp_path / 'missing.key'}: No such file" in run.stderr

    # A router that does not trust the planner's CA refuses with why, at once.
    folder = write_model(
        tmp_path / "m", "tls-od-wrong", tiny_model, extra="on_demand:\n  idle_after: 15m\n"
    )
    assert planner_cli(env, "apply", str(folder)).returncode == 0
    with tls_router(
        env, pki, leader, tls_cluster.root / "router-wrong.log", pki.other_ca.ca_cert
    ) as router:
        status, error = refusal(
            f"{router}/v1/completions",
            pki.trust(),
            {"model": "tls-od-wrong", "prompt": "hi", "max_tokens": 4},
        )
    assert status == 503 and error["code"] == "planner_unavailable"
    assert f"The planner at {leader} could not be verified" in error["message"]
    assert "LLMGW_PLANNER_CACERT" in error["message"]
