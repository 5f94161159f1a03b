"""terraform/ and jobspecs/ hold together (issue "Deploying llmgw itself", item 4), as
far as a machine that cannot reach the provider registry can check: no `tofu init`,
so no `validate` or `plan`. Parsed with python-hcl2: every variable is described and
used, the README lists every input and output, the module passes each job only
variables its jobspec declares (and every required one), and the examples set only
the module's variables. Formatting with `tofu fmt` and `nomad fmt` when the bootstrap
built them (skipped otherwise)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import hcl2
import pytest

from devcluster.bootstrap import BIN

ROOT = Path(__file__).resolve().parents[2]
MODULE = ROOT / "terraform"
JOBSPECS = {"planner": ROOT / "jobspecs" / "planner.nomad.hcl",
            "router": ROOT / "jobspecs" / "router.nomad.hcl"}
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
    return {_name(label): body for block in parse(path).get(kind, [])
            for label, body in block.items()}


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
    [local_values] = [block for block in parse(MODULE / "main.tf")["locals"]
                      if "planner_vars" in block]
    for job, path in JOBSPECS.items():
        passed = _keys(local_values[f"{job}_vars"])
        declared = labelled(path, "variable")
        assert passed <= set(declared), f"{job}: not in {path.name}: {passed - set(declared)}"
        required = {name for name, body in declared.items() if "default" not in body}
        assert required <= passed, f"{job}: {path.name} needs {required - passed}"


# The router never calls Nomad, so it has no Nomad policy (acl/README.md).
POLICIES = ("nomad/planner", "consul/planner", "consul/router")


def test_the_module_reads_the_acl_policy_files() -> None:
    main = (MODULE / "main.tf").read_text()
    referenced = set(re.findall(r'file\("\$\{local.policy_dir\}/(\w+/\w+)\.hcl"\)', main))
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


@pytest.mark.skipif(not (BIN / "tofu").exists(), reason="the bootstrap built no tofu "
                    "(`python3 -m devcluster.bootstrap --with-tofu`)")
def test_tofu_fmt() -> None:
    done = subprocess.run([str(BIN / "tofu"), "fmt", "-check", "-recursive", "-diff",
                           str(MODULE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(not (BIN / "nomad").exists(), reason="the bootstrap built no nomad")
def test_nomad_fmt_of_the_jobspecs() -> None:
    done = subprocess.run([str(BIN / "nomad"), "fmt", "-check", "-list=true",
                           *map(str, JOBSPECS.values())], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"not formatted: {done.stdout}{done.stderr}"
