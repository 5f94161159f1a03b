"""Session-wide real parts for the integration tests: one Consul + Nomad dev
cluster, one router, tiny GGUF models. Each test uses its own model names, so
tests share the cluster without stepping on each other.

Ports: the cluster uses the dev ports + 11000 (consul 19500, nomad 15646), or
the next free offset, so the tests can run while the demo's cluster (or another
test run) is up. Nothing is left running:
the cluster fixture purges every job and stops both agents at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster.bootstrap import BIN
from devcluster.cluster import Cluster, down, free_offset, up
from tests.support.engines import write_engines
from tests.support.ports import free_port
from tests.support.tiny_gguf import write_tiny_gguf
from tests.support.tls import TlsCA, make_ca

# The dev ports + 11000 (consul 19500, nomad 15646), or + 11010, 11020... when a
# concurrent test run holds them.
TEST_PORT_OFFSETS = range(11000, 11050, 10)


def wait_for(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.25
) -> Any:
    """Poll `predicate` until it returns something truthy; fail with `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:
            last_error = exc
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout} s waiting for {what} (last error: {last_error})")


def http_json(url: str, body: dict | None = None, timeout: float = 30) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


@pytest.fixture(scope="session")
def binaries() -> Path:
    for name in ("consul", "nomad", "llama-server"):
        if not (BIN / name).exists():
            pytest.fail(f"{BIN / name} is missing: run `make bootstrap` first")
    return BIN


@pytest.fixture(scope="session")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> TlsCA:
    """A throwaway CA; the Nomad agent trusts it, so https:// sources can be served locally."""
    return make_ca(tmp_path_factory.mktemp("tls"))


@contextlib.contextmanager
def own_cluster(
    root: Path,
    offsets: range = TEST_PORT_OFFSETS,
    extra_env: dict[str, str] | None = None,
    **options: Any,
) -> Iterator[Cluster]:
    """A running cluster under `root` (`options`: `Cluster`'s, e.g. more client nodes,
    TLS, ACLs) on the first free port offset of `offsets`; always brought down."""
    cluster = Cluster(root, free_offset(offsets), **options)
    try:
        up(cluster, extra_env=extra_env)
        yield cluster
    finally:
        down(cluster)


@pytest.fixture(scope="session")
def cluster(
    binaries: Path, test_ca: TlsCA, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    with own_cluster(
        tmp_path_factory.mktemp("cluster"), extra_env={"SSL_CERT_FILE": str(test_ca.bundle)}
    ) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def planner_env(
    cluster: Cluster, binaries: Path, test_ca: TlsCA, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """The planner's environment for the test cluster; its engines are the real
    llama-server and the test-only wrappers of tests/support/engines.py (fakes, each of
    one behaviour). It trusts the test CA as the Nomad agent does: `apply` reads an
    https:// source's GGUF header before registering it."""
    engines = write_engines(tmp_path_factory.mktemp("engines"), binaries / "llama-server")
    return {
        **os.environ,
        **cluster.env,
        "SSL_CERT_FILE": str(test_ca.bundle),
        "LLMGW_ENGINES": ",".join(f"{k}={v}" for k, v in engines.items()),
    }


@pytest.fixture(scope="session")
def planner(planner_env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the real `planner` CLI against the test cluster."""

    def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "planner.cli.main", *args],
            env=planner_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture
def model_files(tmp_path: Path, tiny_model: Path) -> Callable[..., Path]:
    """Write model YAML into this test's own folder: model_files(name=..., **overrides)."""
    folder = tmp_path / "models"
    folder.mkdir()

    def write(
        name: str,
        source: str | None = None,
        replicas: int = 1,
        profile: str = 'context: 512\n  cpu: 100\n  memory: 256MiB\n  args: ["--threads", "1"]',
        extra: str = "",
    ) -> Path:
        text = (
            f"name: {name}\nsource: {source or 'file://' + str(tiny_model)}\n"
            f"profile:\n  {profile}\nreplicas: {replicas}\n{extra}"
        )
        (folder / f"{name}.yaml").write_text(text)
        return folder

    return write


@contextlib.contextmanager
def run_router(cluster: Cluster, planner_url: str, **env: str) -> Iterator[str]:
    """A real router process for the test cluster and planner; yields its base URL."""
    port = free_port()
    log = cluster.root / f"router-{port}.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "router.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            env={
                **os.environ,
                **cluster.env,
                "LLMGW_PLANNER_URL": planner_url,
                "LLMGW_PLANNER_TOKEN": ADMIN_TOKEN,
                **env,
            },
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_json(f"{base}/health", timeout=2) is not None, 30, "router /health")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def router(cluster: Cluster, planner_daemon: PlannerDaemon) -> Iterator[str]:
    with run_router(cluster, planner_daemon.url) as base:
        yield base


def forget_models(cluster: Cluster, *names: str) -> None:
    """Purge models a test leaves parked or failing, so later tests' `planner status`
    (which covers every model) and the operator's view start clean: the job, purged
    without its replicas' shutdown_delay (a cleanup drains nothing; their memory is free
    for the next test at once), and the model's KV record, state and usage."""
    for name in names:
        for url in (
            f"{cluster.nomad_addr}/v1/job/{name}?purge=true&no_shutdown_delay=true",
            *(
                f"{cluster.consul_addr}/v1/kv/llmgw/{kind}/{name}"
                for kind in ("models", "state", "usage")
            ),
        ):
            with contextlib.suppress(OSError):
                urllib.request.urlopen(
                    urllib.request.Request(url, method="DELETE"), timeout=10
                ).close()


def nomad_get(cluster: Cluster, path: str) -> Any:
    return http_json(f"{cluster.nomad_addr}{path}")


def stop_job(cluster: Cluster, job: str) -> None:
    """`nomad job stop -detach`: its allocations drain their shutdown_delay, then end."""
    stop = urllib.request.Request(f"{cluster.nomad_addr}/v1/job/{job}", method="DELETE")
    urllib.request.urlopen(stop, timeout=10).close()


def running_alloc(cluster: Cluster, job: str) -> str:
    """The ID of the job's one running allocation (fails when there is not exactly one)."""
    [alloc] = [
        a["ID"]
        for a in nomad_get(cluster, f"/v1/job/{job}/allocations")
        if a["ClientStatus"] == "running"
    ]
    return alloc


def passing_endpoints(cluster: Cluster, service: str) -> list[str]:
    nodes = http_json(f"{cluster.consul_addr}/v1/health/service/{service}?passing=true")
    return [
        f"{n['Service']['Address'] or n['Node']['Address']}:{n['Service']['Port']}" for n in nodes
    ]


ADMIN_TOKEN = "test-admin-token"
# The planner's stability window in the tests: long enough for the crash-after-ready
# cases (a server that crashes 10 s after passing), short enough that a test waiting
# for a replica's failures to be forgiven waits 20 s, not the default 2 min.
STABLE_AFTER_S = 20


class PlannerDaemon:
    """`planner serve` as a subprocess that a test can stop and start again."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env = {**env, "LLMGW_ADMIN_TOKEN": ADMIN_TOKEN}
        self.log = log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "planner.cli.main",
                    "serve",
                    "--port",
                    str(self.port),
                    "--stable-after",
                    str(STABLE_AFTER_S),
                ],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_for(
            lambda: http_json(f"{self.url}/health", timeout=2)["ready"],
            30,
            "planner serve to lead and reconcile (or to know the leader)",
        )

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def model(self, name: str) -> dict:
        return http_json(f"{self.url}/v1/models/{name}")

    def kill(self) -> None:
        """SIGKILL, as a node that dies: its Consul session is not released, so the lead
        passes only when the session's checks fail."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc = None


def lead_again(daemon: PlannerDaemon, standby: PlannerDaemon, within_s: float) -> None:
    """Give the lead back to the session's `daemon` after a test made `standby` lead:
    `daemon` starts (a follower), `standby` stops (releasing its session: the lead
    passes at once), and `daemon` leads within `within_s`. `standby` stops even when
    `daemon` fails to start: left leading, it took the lead from every later test's
    planner (seen after a planner that could not start)."""
    try:
        daemon.start()
    finally:
        standby.stop()
    wait_for(
        lambda: http_json(f"{daemon.url}/health", timeout=2)["role"] == "leader",
        within_s,
        "the session's planner to lead again",
    )


@pytest.fixture(scope="session")
def planner_daemon(cluster: Cluster, planner_env: dict[str, str]) -> Iterator[PlannerDaemon]:
    daemon = PlannerDaemon(planner_env, cluster.root / "planner.log")
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
