"""terraform/ and jobspecs/ hold together (issue "Deploying llmgw itself", item 4), as
far as a machine that cannot reach the provider registry can check: no `tofu init`,
so no `validate` or `plan`. Parsed with python-hcl2: every variable is described and
used, the README lists every input and output, the module passes each job only
variables its jobspec declares (and every required one), and the examples set only
the module's variables. Formatting with `tofu fmt` and `nomad fmt` when the bootstrap
built them (skipped otherwise)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import hcl2
import pytest

from devcluster.bootstrap import BIN

ROOT = Path(__file__).resolve().parents[2]
MODULE = ROOT / "terraform"
JOBSPECS = {
    "planner": ROOT / "jobspecs" / "planner.nomad.hcl",
    "router": ROOT / "jobspecs" / "router.nomad.hcl",
}
EXAMPLES = sorted((MODULE / "examples").glob("*/main.tf"))


def _name(key: str) -> str:
    """python-hcl2 keeps the quotes of block labels and strings."""
    return key.strip('"')


def _keys(body: dict[str, Any]) -> set[str]:
    """A body's attribute names, without python-hcl2's own (__is_block__, __comments__)."""
    return {_name(key) for key in body if not key.startswith("__")}


def parse(path: Path) -> dict[str, Any]:
    return hcl2.loads(path.read_text())


def labelled(path: Path, kind: str) -> dict[str, dict[str, Any]]:
    """{label: body} of the `kind` blocks (variable, output, module...) of one file."""
    return {
        _name(label): body for block in parse(path).get(kind, []) for label, body in block.items()
    }


def module_files() -> list[Path]:
    return sorted(MODULE.glob("*.tf"))


def module_blocks(kind: str) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for path in module_files():
        found.update(labelled(path, kind))
    return found


def used(name: str, text: str) -> bool:
    return re.search(rf"\bvar\.{re.escape(name)}\b", text) is not None


def test_every_module_variable_is_described_and_used() -> None:
    variables = module_blocks("variable")
    assert len(variables) > 20, variables.keys()
    text = "\n".join(p.read_text() for p in module_files())
    for name, body in variables.items():
        assert _name(body.get("description", "")).strip(), f"variable {name}: no description"
        assert used(name, text), f"variable {name} is declared but never used"


@pytest.mark.parametrize("job", sorted(JOBSPECS))
def test_every_jobspec_variable_is_described_and_used(job: str) -> None:
    path = JOBSPECS[job]
    variables = labelled(path, "variable")
    text = path.read_text()
    for name, body in variables.items():
        assert _name(body.get("description", "")).strip(), f"{path.name}: {name}: no description"
        assert used(name, text), f"{path.name}: variable {name} is declared but never used"


def _table(readme: str, section: str) -> set[str]:
    """The names in the first column of the table under `## <section>`."""
    part = readme.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(\w+)` \|", part, re.MULTILINE))


def test_the_readme_lists_every_input_and_output() -> None:
    readme = (MODULE / "README.md").read_text()
    assert _table(readme, "Inputs") == set(module_blocks("variable"))
    assert _table(readme, "Outputs") == set(module_blocks("output"))
    assert "## Usage" in readme and "## Tested with" in readme


def test_the_module_passes_each_job_only_its_variables_and_every_required_one() -> None:
    [local_values] = [
        block for block in parse(MODULE / "main.tf")["locals"] if "planner_vars" in block
    ]
    for job, path in JOBSPECS.items():
        passed = _keys(local_values[f"{job}_vars"])
        declared = labelled(path, "variable")
        assert passed <= set(declared), f"{job}: not in {path.name}: {passed - set(declared)}"
        required = {name for name, body in declared.items() if "default" not in body}
        assert required <= passed, f"{job}: {path.name} needs {required - passed}"


# The router never calls Nomad, so it has no Nomad policy (acl/README.md).
POLICIES = ("nomad/planner", "nomad/engine-install", "consul/planner", "consul/router")


def test_the_module_reads_the_acl_policy_files() -> None:
    main = (MODULE / "main.tf").read_text()
    referenced = set(re.findall(r'file\("\$\{local.policy_dir\}/(\w+/[\w-]+)\.hcl"\)', main))
    assert referenced == set(POLICIES)
    assert '"${path.module}/../acl"' in main
    for policy in POLICIES:
        assert (ROOT / "acl" / f"{policy}.hcl").is_file()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.parent.name)
def test_an_example_sets_only_module_variables_and_every_required_one(example: Path) -> None:
    variables = module_blocks("variable")
    required = {name for name, body in variables.items() if "default" not in body}
    [(_, module)] = labelled(example, "module").items()
    given = _keys(module) - {"source"}
    assert given <= set(variables), f"{example}: unknown {given - set(variables)}"
    assert required <= given, f"{example}: missing {required - given}"
    assert EXAMPLES, "terraform/examples/ has no example"


@pytest.mark.skipif(
    not (BIN / "tofu").exists(),
    reason="the bootstrap built no tofu (`python3 -m devcluster.bootstrap --with-tofu`)",
)
def test_tofu_fmt() -> None:
    done = subprocess.run(
        [str(BIN / "tofu"), "fmt", "-check", "-recursive", "-diff", str(MODULE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(not (BIN / "nomad").exists(), reason="the bootstrap built no nomad")
def test_nomad_fmt_of_the_jobspecs() -> None:
    done = subprocess.run(
        [str(BIN / "nomad"), "fmt", "-check", "-list=true", *map(str, JOBSPECS.values())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"not formatted: {done.stdout}{done.stderr}"


# --- the jobspecs as Nomad renders them (`nomad job run -output`: parsed locally) ----

NOMAD_TLS = {
    "nomad_cacert": "/tls/nomad-ca.pem",
    "nomad_client_cert": "/tls/nomad.pem",
    "nomad_client_key": "/tls/nomad-key.pem",
}
CONSUL_TLS = {
    "consul_ssl": "true",
    "consul_cacert": "/tls/consul-ca.pem",
    "consul_client_cert": "/tls/consul.pem",
    "consul_client_key": "/tls/consul-key.pem",
}


def rendered(job: str, **variables: str) -> dict[str, dict[str, Any]]:
    """{task name: task} of the job as `nomad job run -output` renders it, no agent asked."""
    argv = [str(BIN / "nomad"), "job", "run", "-output", "-var", "wheel_url=http://x/l.whl"]
    for name, value in variables.items():
        argv += ["-var", f"{name}={value}"]
    done = subprocess.run(
        [*argv, str(JOBSPECS[job])],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "NOMAD_ADDR": "http://127.0.0.1:9"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [group] = json.loads(done.stdout)["Job"]["TaskGroups"]
    return {task["Name"]: task for task in group["Tasks"]}


needs_nomad = pytest.mark.skipif(
    not (BIN / "nomad").exists(), reason="the bootstrap built no nomad"
)


@needs_nomad
def test_the_planner_job_passes_the_agents_tls_files_and_advertises_without_a_scheme() -> None:
    """QA on issue 11: the jobs could not be pointed at TLS agents, and the planner
    advertised http:// even when serving TLS (LLMGW_TLS_CERT from KV)."""
    tasks = rendered("planner", nomad_addr="https://127.0.0.1:4646", **NOMAD_TLS, **CONSUL_TLS)
    env = tasks["planner"]["Env"]
    assert env["NOMAD_ADDR"] == "https://127.0.0.1:4646"
    assert env["NOMAD_CACERT"] == "/tls/nomad-ca.pem"
    assert (env["NOMAD_CLIENT_CERT"], env["NOMAD_CLIENT_KEY"]) == (
        "/tls/nomad.pem",
        "/tls/nomad-key.pem",
    )
    assert env["CONSUL_HTTP_SSL"] == "true" and env["CONSUL_CACERT"] == "/tls/consul-ca.pem"
    assert (env["CONSUL_CLIENT_CERT"], env["CONSUL_CLIENT_KEY"]) == (
        "/tls/consul.pem",
        "/tls/consul-key.pem",
    )
    args = tasks["planner"]["Config"]["args"]
    assert args[args.index("--advertise") + 1] == "${NOMAD_ADDR_admin}"
    # Without them, none is set (the planner's defaults: plain http, the system's CAs).
    plain = rendered("planner")["planner"]["Env"]
    assert set(plain) == {"NOMAD_ADDR", "CONSUL_HTTP_ADDR"}


@needs_nomad
def test_the_router_job_passes_consul_tls_and_no_fixed_planner_by_default() -> None:
    tasks = rendered("router", planner_cacert="/tls/llmgw-ca.pem", **CONSUL_TLS)
    env = tasks["router"]["Env"]
    assert env["CONSUL_HTTP_SSL"] == "true" and env["CONSUL_CACERT"] == "/tls/consul-ca.pem"
    assert env["CONSUL_CLIENT_KEY"] == "/tls/consul-key.pem"
    assert env["LLMGW_PLANNER_CACERT"] == "/tls/llmgw-ca.pem"
    # An empty planner_url: the router's "none", not its default http://127.0.0.1:4650.
    assert env["LLMGW_PLANNER_URL"] == "none"
    assert (
        rendered("router", planner_url="http://p:4650")["router"]["Env"]["LLMGW_PLANNER_URL"]
        == "http://p:4650"
    )


@needs_nomad
@pytest.mark.parametrize("job", sorted(JOBSPECS))
def test_the_install_task_cpu_is_a_variable(job: str) -> None:
    """QA on issue 11: a hard-coded 500 MHz install left no CPU on the demo cluster."""
    assert rendered(job)["install"]["Resources"]["CPU"] == 200
    assert rendered(job, install_cpu="100")["install"]["Resources"]["CPU"] == 100


def test_the_module_passes_every_tls_setting_to_the_jobs_that_read_it() -> None:
    [local_values] = [
        block for block in parse(MODULE / "main.tf")["locals"] if "planner_vars" in block
    ]
    planner, router = (_keys(local_values[f"{job}_vars"]) for job in ("planner", "router"))
    assert {*NOMAD_TLS, *CONSUL_TLS, "install_cpu"} <= planner
    assert {*CONSUL_TLS, "planner_cacert", "serves_https", "install_cpu"} <= router


@needs_nomad
def test_the_router_check_asks_over_https_when_the_router_serves_it() -> None:
    [check] = rendered("router", serves_https="true")["router"]["Services"][0]["Checks"]
    assert (check["Protocol"], check["TLSSkipVerify"], check["Path"]) == ("https", True, "/health")
    [check] = rendered("router")["router"]["Services"][0]["Checks"]
    assert check["Protocol"] == "http"


@needs_nomad
@pytest.mark.parametrize("job", sorted(JOBSPECS))
def test_pem_items_of_the_nomad_variable_become_files_in_secrets(job: str) -> None:
    """The other way to give the TLS files (tests/integration/test_deploy_tls.py runs it)."""
    templates = {t["DestPath"]: t for t in rendered(job)[job]["Templates"]}
    assert templates["secrets/tls.env"]["Envvars"] is True
    assert "CONSUL_CACERT_PEM" in templates["secrets/consul_cacert.pem"]["EmbeddedTmpl"]
    assert templates["secrets/consul_client_key.pem"]["Perms"] == "0600"
    assert ("secrets/nomad_cacert.pem" in templates) == (job == "planner")
