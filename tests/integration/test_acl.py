"""ACLs on real agents: a Consul and a Nomad dev agent that enforce ACLs with a
default-deny policy (devcluster's `Cluster(..., acl=AclTokens(...))`), the policies
created from the files in acl/ with the `nomad` and `consul` CLIs, as an operator
would, and the planner and the router each given a token of exactly its policy.

They work with those tokens: `planner apply --wait`, `planner serve` leading, a
failing model's last error read from its task's stderr (read-logs), `planner
status`, the router serving the model with only its Consul token and no Nomad
token. And each refuses clearly with an empty, unknown or too weak token: exit 3
naming the rule it lacks and the policy file, no traceback, nothing changed.

The cluster is this module's own, at an offset outside the session cluster's
range (11060+; free_offset steps over the benchmarks' clusters).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devcluster.bootstrap import BIN, REPO
from devcluster.cluster import AclTokens, Cluster
from tests.conftest import ADMIN_TOKEN, PlannerDaemon, http_json, own_cluster, run_router, wait_for
from tests.support.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.integration

ACL_PORT_OFFSETS = range(11060, 11140, 10)
SMALL = 'context: 512\n  cpu: 100\n  memory: 256MiB\n  args: ["--threads", "1"]'
KEV_ERROR = "unknown model architecture: 'kev'"


@dataclass(frozen=True)
class Tokens:
    """Secrets of the tokens created from acl/: the planner's (Nomad and Consul) and
    the router's (Consul only)."""

    planner_nomad: str
    planner_consul: str
    router_consul: str


@pytest.fixture(scope="module")
def acl_cluster(binaries: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tokens = AclTokens(consul=str(uuid.uuid4()), nomad=str(uuid.uuid4()))
    with own_cluster(
        tmp_path_factory.mktemp("acl-cluster"), ACL_PORT_OFFSETS, acl=tokens
    ) as cluster:
        yield cluster


def _cli(cluster: Cluster, *argv: str) -> str:
    """Run the `nomad` or `consul` CLI as the cluster's operator (management tokens)."""
    run = subprocess.run(
        [str(BIN / argv[0]), *argv[1:]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **cluster.management_env},
    )
    assert run.returncode == 0, f"{argv}: {run.stderr}"
    return run.stdout


@pytest.fixture(scope="module")
def tokens(acl_cluster: Cluster) -> Tokens:
    """Policies from the files in acl/, and a token of each, made with the CLIs."""
    _cli(
        acl_cluster,
        "nomad",
        "acl",
        "policy",
        "apply",
        "-description",
        "llmgw planner",
        "llmgw-planner",
        "acl/nomad/planner.hcl",
    )
    nomad_planner = json.loads(
        _cli(
            acl_cluster,
            "nomad",
            "acl",
            "token",
            "create",
            "-name",
            "llmgw-planner",
            "-policy",
            "llmgw-planner",
            "-json",
        )
    )
    secrets = {}
    for who in ("planner", "router"):
        _cli(
            acl_cluster,
            "consul",
            "acl",
            "policy",
            "create",
            "-name",
            f"llmgw-{who}",
            "-rules",
            f"@acl/consul/{who}.hcl",
        )
        secrets[who] = json.loads(
            _cli(
                acl_cluster,
                "consul",
                "acl",
                "token",
                "create",
                "-description",
                f"llmgw {who}",
                "-policy-name",
                f"llmgw-{who}",
                "-format",
                "json",
            )
        )["SecretID"]
    return Tokens(nomad_planner["SecretID"], secrets["planner"], secrets["router"])


def env_with(
    cluster: Cluster, binaries: Path, nomad: str | None, consul: str | None
) -> dict[str, str]:
    """The cluster's addresses and these tokens only (None: the variable unset)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NOMAD_TOKEN", "CONSUL_HTTP_TOKEN")}
    env |= {**cluster.env, "LLMGW_ENGINES": f"llama.cpp={binaries / 'llama-server'}"}
    for key, value in (("NOMAD_TOKEN", nomad), ("CONSUL_HTTP_TOKEN", consul)):
        if value is not None:
            env[key] = value
    return env


@pytest.fixture(scope="module")
def planner_env(acl_cluster: Cluster, binaries: Path, tokens: Tokens) -> dict[str, str]:
    return env_with(acl_cluster, binaries, tokens.planner_nomad, tokens.planner_consul)


def planner_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "planner.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def write_model(folder: Path, name: str, source: Path) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.yaml").write_text(
        f"name: {name}\nsource: file://{source}\nprofile:\n  {SMALL}\nreplicas: 1\n"
    )
    return folder


def status_of(
    url: str, headers: dict[str, str], method: str = "GET", body: bytes | None = None
) -> int:
    """The HTTP status an agent answers (a denial is 403)."""
    request = urllib.request.Request(url, headers=headers, method=method, data=body)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


@contextlib.contextmanager
def exited(
    argv: list[str], env: dict[str, str], timeout: float = 60
) -> Iterator[subprocess.CompletedProcess[str]]:
    """Run a daemon that must exit by itself (a refused token); yields how it ended."""
    proc = subprocess.Popen(
        [sys.executable, "-m", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"{argv} did not exit with a refused token within {timeout} s")
    yield subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_planner_and_router_work_with_exactly_their_policies(
    acl_cluster: Cluster,
    binaries: Path,
    tokens: Tokens,
    planner_env: dict[str, str],
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    folder = write_model(tmp_path / "models", "acl-tiny", tiny_model)
    applied = planner_cli(planner_env, "apply", str(folder), "--wait", "--timeout", "120")
    assert applied.returncode == 0, applied.stderr

    daemon = PlannerDaemon(planner_env, acl_cluster.root / "planner.log")
    try:
        daemon.start()  # in the try: a start that times out still stops the process
        assert http_json(f"{daemon.url}/health")["role"] == "leader"
        # The router: its Consul token only, no Nomad token at all.
        with run_router(
            acl_cluster, daemon.url, CONSUL_HTTP_TOKEN=tokens.router_consul, NOMAD_TOKEN=""
        ) as router:
            answer = wait_for(
                lambda: http_json(
                    f"{router}/v1/completions",
                    # ignore_eos: the tiny model's random weights may end a sampled
                    # answer before 4 tokens (the check is that the router served it).
                    {"model": "acl-tiny", "prompt": "hi", "max_tokens": 4, "ignore_eos": True},
                    timeout=30,
                ),
                60,
                "a completion through the router with its own token",
            )
            assert answer["usage"]["completion_tokens"] == 4

        # A failing model's last error carries its stderr: the leader read its logs
        # (read-logs), and counted the failure from the event stream (read-job).
        kev = write_tiny_gguf(tmp_path / "kev.gguf", architecture="kev")
        assert (
            planner_cli(planner_env, "apply", str(write_model(folder, "acl-kev", kev))).returncode
            == 0
        )
        failing = wait_for(
            lambda: (
                (m := daemon.model("acl-kev"))["consecutive_failures"] >= 1
                and KEV_ERROR in (m["last_error"] or "")
                and m
            ),
            60,
            "acl-kev's first counted failure, with llama.cpp's stderr",
        )
        assert failing["state"] in ("failing", "parked")
        retried = planner_cli(planner_env, "retry", "acl-kev")
        assert retried.returncode == 0, retried.stderr
        # status works with the token: exit 1 only because acl-kev is short of a replica.
        status = planner_cli(planner_env, "status", "--output", "json")
        assert status.returncode == 1, status.stderr
        rows = {r["name"]: r["state"] for r in json.loads(status.stdout)}
        assert rows["acl-tiny"] == "serving" and rows["acl-kev"] != "serving"
        assert "denied" not in daemon.log.read_text()
    finally:
        daemon.stop()

    # Least privilege: nothing beyond the policies.
    consul, nomad = acl_cluster.consul_addr, acl_cluster.nomad_addr
    as_planner = {"X-Consul-Token": tokens.planner_consul, "X-Nomad-Token": tokens.planner_nomad}
    assert status_of(f"{consul}/v1/kv/elsewhere", as_planner, "PUT", b"x") == 403
    assert status_of(f"{nomad}/v1/agent/self", as_planner) == 403
    assert status_of(f"{nomad}/v1/var/llmgw", as_planner) == 403
    as_router = {"X-Consul-Token": tokens.router_consul}
    assert status_of(f"{consul}/v1/kv/llmgw/models/x", as_router, "PUT", b"x") == 403
    assert status_of(f"{consul}/v1/kv/llmgw/leader", as_router) in (200, 404)
    # It reads the lock's session (where the leader registered), and changes none.
    assert status_of(f"{consul}/v1/session/list", as_router) == 200
    assert status_of(f"{consul}/v1/session/create", as_router, "PUT", b"{}") == 403


def test_a_missing_permission_is_named_with_exit_3(
    acl_cluster: Cluster,
    binaries: Path,
    tokens: Tokens,
    planner_env: dict[str, str],
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    folder = write_model(tmp_path / "models", "acl-denied", tiny_model)
    unknown = str(uuid.uuid4())

    # No tokens: both agents' anonymous policies deny everything; both are named.
    run = planner_cli(env_with(acl_cluster, binaries, None, None), "apply", str(folder))
    assert run.returncode == 3 and "Traceback" not in run.stderr
    assert (
        'Nomad denied list-jobs on namespace "default", read-job on namespace '
        '"default", submit-job on namespace "default": NOMAD_TOKEN is empty' in run.stderr
    )
    assert "acl/nomad/planner.hcl" in run.stderr and "acl/consul/planner.hcl" in run.stderr
    assert 'Consul denied key_prefix "llmgw/" write: CONSUL_HTTP_TOKEN is empty' in run.stderr

    # A token Nomad does not know.
    run = planner_cli(
        env_with(acl_cluster, binaries, unknown, tokens.planner_consul), "apply", str(folder)
    )
    assert run.returncode == 3 and "Traceback" not in run.stderr
    assert "Nomad does not know the token in NOMAD_TOKEN" in run.stderr

    # A malformed one (not a UUID, as Nomad's secret IDs are): not a valid token either,
    # not one that "lacks" permissions (QA on issue 11).
    run = planner_cli(
        env_with(acl_cluster, binaries, "not-a-token", tokens.planner_consul), "apply", str(folder)
    )
    assert run.returncode == 3 and "Traceback" not in run.stderr
    assert "Nomad does not know the token in NOMAD_TOKEN" in run.stderr, run.stderr
    assert "lacks" not in run.stderr

    # A real token with too little: the router's may only read. Nothing is changed.
    weak = env_with(acl_cluster, binaries, tokens.planner_nomad, tokens.router_consul)
    run = planner_cli(weak, "apply", str(folder), "--output", "json")
    assert run.returncode == 3 and "Traceback" not in run.stderr
    error = json.loads(run.stdout)["error"]
    assert (error["kind"], error["exit_code"]) == ("PermissionDenied", 3)
    assert error["message"].startswith(
        'Consul denied key_prefix "llmgw/" write: the token in CONSUL_HTTP_TOKEN lacks it; '
        "give the token the policy in acl/consul/planner.hcl"
    )
    management = acl_cluster.acl.headers  # type: ignore[union-attr]
    assert status_of(f"{acl_cluster.nomad_addr}/v1/job/acl-denied", management) == 404
    # ... but it may plan: a dry run only reads from Consul.
    dry = planner_cli(weak, "apply", str(folder), "--dry-run")
    assert dry.returncode == 0, dry.stderr

    run = planner_cli(env_with(acl_cluster, binaries, tokens.planner_nomad, "nope"), "status")
    assert run.returncode == 3 and "Traceback" not in run.stderr
    assert "Consul does not know the token in CONSUL_HTTP_TOKEN (ACL not found)" in run.stderr

    # The daemons refuse to start, naming what they lack.
    with exited(
        ["planner.cli.main", "serve", "--port", "1"], {**weak, "LLMGW_ADMIN_TOKEN": ADMIN_TOKEN}
    ) as serve:
        assert serve.returncode == 3 and "Traceback" not in serve.stderr
        assert (
            'Consul denied key_prefix "llmgw/" write, session_prefix "" write, '
            'service "llmgw-planner" write: the token in CONSUL_HTTP_TOKEN lacks them'
            in serve.stderr
        )
    for token, says in (
        (None, "CONSUL_HTTP_TOKEN is empty"),
        (unknown, "Consul does not know the token in CONSUL_HTTP_TOKEN"),
    ):
        with exited(
            ["router.cli", "serve", "--port", "1"], env_with(acl_cluster, binaries, None, token)
        ) as router:
            assert router.returncode == 3 and "Traceback" not in router.stderr
            assert (
                'Consul denied key_prefix "llmgw/" read, service_prefix "llmgw-" read, '
                'node_prefix "" read, session_prefix "" read' in router.stderr
            ), router.stderr
            assert says in router.stderr and "acl/consul/router.hcl" in router.stderr

    for command in (["planner.cli.main", "--help"], ["router.cli", "--help"]):
        shown = subprocess.run(
            [sys.executable, "-m", *command],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "COLUMNS": "200"},
        )
        assert "3 " in shown.stdout and "ACL token" in shown.stdout, shown.stdout


def test_a_planner_in_another_namespace_is_checked_and_refused_there(
    acl_cluster: Cluster,
    binaries: Path,
    tokens: Tokens,
    planner_env: dict[str, str],
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """NOMAD_NAMESPACE=acl-llm: the checks before acting ask for the capabilities there
    and a refusal names that namespace; a token of acl/nomad/planner.hcl with the
    namespace written in (as docs/security.md says) plans there; and the `namespace
    "*"` block's list-jobs lets apply see acl-tiny, which the default namespace runs,
    and refuse a second copy."""
    _cli(acl_cluster, "nomad", "namespace", "apply", "acl-llm")
    policy = tmp_path / "planner-llm.hcl"
    text = (REPO / "acl/nomad/planner.hcl").read_text()
    policy.write_text(text.replace('namespace "default" {', 'namespace "acl-llm" {'))
    _cli(acl_cluster, "nomad", "acl", "policy", "apply", "llmgw-planner-llm", str(policy))
    secret = json.loads(
        _cli(
            acl_cluster,
            "nomad",
            "acl",
            "token",
            "create",
            "-name",
            "llmgw-planner-llm",
            "-policy",
            "llmgw-planner-llm",
            "-json",
        )
    )["SecretID"]
    folder = write_model(tmp_path / "models", "acl-ns", tiny_model)
    in_llm = {**planner_env, "NOMAD_NAMESPACE": "acl-llm"}

    # The default namespace's token: list-jobs there too (the "*" block), nothing else.
    run = planner_cli(in_llm, "apply", "--dry-run", str(folder))
    assert run.returncode == 3, run.stderr
    assert (
        'Nomad denied read-job on namespace "acl-llm", submit-job on namespace "acl-llm"'
        in run.stderr
    )

    with_token = {**in_llm, "NOMAD_TOKEN": secret}
    planned = planner_cli(with_token, "apply", "--dry-run", str(folder))
    assert planned.returncode == 0, planned.stderr
    write_model(folder, "acl-tiny", tiny_model)
    refused = planner_cli(with_token, "apply", "--dry-run", str(folder))
    assert refused.returncode == 2, refused.stderr
    assert "model 'acl-tiny' already has an llmgw job in Nomad namespace 'default'" in (
        refused.stderr
    )


def test_the_policy_files_are_the_agents_policies_and_the_router_has_no_nomad_one(
    acl_cluster: Cluster, tokens: Tokens
) -> None:
    """The files the fixture applied are what Nomad holds, byte for byte, and acl/ holds
    what the Terraform module reads: no Nomad policy for the router, which never calls
    Nomad (it finds replicas in Consul and asks the planner's admin API)."""
    assert sorted(str(p.relative_to(REPO)) for p in (REPO / "acl").rglob("*.hcl")) == [
        "acl/consul/planner.hcl",
        "acl/consul/router.hcl",
        "acl/nomad/engine-install.hcl",
        "acl/nomad/planner.hcl",
    ]
    request = urllib.request.Request(
        f"{acl_cluster.nomad_addr}/v1/acl/policy/llmgw-planner", headers=acl_cluster.acl.headers
    )  # type: ignore[union-attr]
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.load(response)["Rules"] == (REPO / "acl/nomad/planner.hcl").read_text()


def test_an_engine_installs_with_its_job_policy_attached_and_not_without(
    acl_cluster: Cluster, binaries: Path, planner_env: dict[str, str], tmp_path: Path
) -> None:
    """acl/nomad/engine-install.hcl, attached to the engine's install job as acl/README.md
    says, is what its workload identity needs to record the engine in the node's
    metadata; without it the install fails with Nomad's refusal (QA on issue 11: the
    policy was only written inline in docs/operations.md)."""
    engine = tmp_path / "engines"
    engine.mkdir()
    (engine / "acl_engine.yaml").write_text(
        f'name: acl_engine\nversion: "1"\npath: {(binaries / "llama-server").resolve()}\n'
    )
    # The agent's HTTP API with ?node_id=: the Task API socket under pytest's deep
    # temporary folder would pass the 107-byte limit of a unix socket path.
    env = {**planner_env, "LLMGW_ENGINE_NOMAD_ADDR": acl_cluster.nomad_addr}
    denied = planner_cli(env, "engines", "apply", str(engine), "--wait", "--timeout", "120")
    assert denied.returncode == 1, denied.stderr
    assert "403: Permission denied" in denied.stderr
    assert "attach acl/nomad/engine-install.hcl to job llmgw-engine-acl_engine" in denied.stderr

    _cli(
        acl_cluster,
        "nomad",
        "acl",
        "policy",
        "apply",
        "-namespace",
        "default",
        "-job",
        "llmgw-engine-acl_engine",
        "-description",
        "llmgw engine install: acl_engine",
        "llmgw-engine-install-acl-engine",
        "acl/nomad/engine-install.hcl",
    )
    installed = planner_cli(env, "engines", "apply", str(engine), "--wait", "--timeout", "120")
    assert installed.returncode == 0, installed.stderr
    management = acl_cluster.acl.headers  # type: ignore[union-attr]
    [node] = _management_json(f"{acl_cluster.nomad_addr}/v1/nodes", management)
    meta = _management_json(f"{acl_cluster.nomad_addr}/v1/node/{node['ID']}", management)["Meta"]
    assert meta["llmgw_engine_acl_engine"] == "1"


def _management_json(url: str, headers: dict[str, str]) -> Any:
    with urllib.request.urlopen(
        urllib.request.Request(url, headers=headers), timeout=10
    ) as response:
        return json.load(response)


def test_router_keys_needs_an_operators_token_to_write_and_names_the_rule(
    acl_cluster: Cluster, binaries: Path, tokens: Tokens
) -> None:
    """`router keys --consul` with the router's own token (acl/consul/router.hcl: the
    keys read-only) may list them, and is refused an edit with exit 3 naming the rule;
    the operator's (management) token adds one."""

    def keys(token: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "router", "keys", *args, "--consul"],
            cwd=REPO,
            env=env_with(acl_cluster, binaries, None, token),
            capture_output=True,
            text=True,
            timeout=60,
        )

    operator = acl_cluster.management_env["CONSUL_HTTP_TOKEN"]
    added = keys(operator, "add", "acl-team")
    assert added.returncode == 0, added.stderr
    listed = keys(tokens.router_consul, "list", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    assert [k["name"] for k in json.loads(listed.stdout)] == ["acl-team"]
    refused = keys(tokens.router_consul, "add", "another")
    assert refused.returncode == 3 and "Traceback" not in refused.stderr
    assert 'denied CONSUL_HTTP_TOKEN `key "llmgw-router/api-keys" write`' in refused.stderr
    listed = keys(operator, "list", "-o", "json")
    assert [k["name"] for k in json.loads(listed.stdout)] == ["acl-team"]
