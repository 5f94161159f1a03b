"""The CI examples (examples/ci/) replayed on the dev cluster: the scripts the pipelines
run, read from the example files (so they cannot drift), run with bash as the runners
run them, in a local git repository of model YAML at each of its commits:

1. adds two models (`a` serving, `b` with no replica): the default branch's job
   applies them;
2. changes `a` (its context) and removes `b`: the merge request's plan exits 2 with a
   Markdown summary naming both and changes nothing; the default branch's job then
   updates `a` and prunes `b`; a plan of the same commit says "no changes" (exit 0);
3. adds `c`, which asks for a GPU no node has: the plan warns it would not be placed,
   and the default branch's job fails, naming it unplaceable.

What is not replayed: installing the wheel (the test's own environment has llmgw),
and posting the plan (GitHub's `gh`, GitLab's API); the forge variables are stubbed
(GITHUB_OUTPUT is a file the test reads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from devcluster.bootstrap import REPO
from devcluster.cluster import Cluster
from tests.conftest import PlannerDaemon, forget_models, nomad_get

pytestmark = pytest.mark.integration

EXAMPLES = REPO / "examples" / "ci"
SMALL = 'cpu: 100\n  memory: 256MiB\n  args: ["--threads", "1"]'


def github_scripts(job: str) -> list[str]:
    """The `run:` scripts of a GitHub Actions job's steps that call `planner`."""
    workflow = yaml.safe_load((EXAMPLES / "github-actions.yml").read_text())
    return [
        step["run"] for step in workflow["jobs"][job]["steps"] if "planner " in step.get("run", "")
    ]


def gitlab_scripts(job: str) -> list[str]:
    """A GitLab CI job's `script:`, its lines run in one shell as the runner does."""
    pipeline = yaml.safe_load((EXAMPLES / "gitlab-ci.yml").read_text())
    return ["\n".join(pipeline[job]["script"])]


@dataclass
class Pipeline:
    """One forge's two jobs, as scripts, and where they run."""

    forge: str
    plan: list[str]
    apply: list[str]
    checkout: Path
    env: dict[str, str]

    def run(self, scripts: list[str]) -> subprocess.CompletedProcess[str]:
        """Run the scripts in order as the runner does (bash -e -o pipefail; a step that
        fails ends the job); the last result, stdout and stderr of all."""
        out, err, code = "", "", 0
        for script in scripts:
            done = subprocess.run(
                ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script],
                cwd=self.checkout,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            out, err, code = out + done.stdout, err + done.stderr, done.returncode
            if code:
                break
        return subprocess.CompletedProcess(scripts, code, out, err)

    def plan_exitcode(self) -> str:
        """What the GitHub job recorded in $GITHUB_OUTPUT (GitLab records nothing)."""
        lines = Path(self.env["GITHUB_OUTPUT"]).read_text().splitlines()
        return lines[-1].removeprefix("exitcode=") if lines else ""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, timeout=60
    ).stdout.strip()


def model(name: str, source: Path, context: int = 512, replicas: int = 1, gpus: int = 0) -> str:
    return (
        f"name: {name}\nsource: file://{source}\nprofile:\n  context: {context}\n"
        f"  gpus: {gpus}\n  {SMALL}\nreplicas: {replicas}\n"
    )


def commits(repo: Path, prefix: str, source: Path) -> list[str]:
    """The repository's three commits (the module docstring's), oldest first."""
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.email", "ci@example.invalid")
    git(repo, "config", "user.name", "ci")
    models = repo / "models"
    models.mkdir()
    (models / "a.yaml").write_text(model(f"{prefix}-a", source))
    (models / "b.yaml").write_text(model(f"{prefix}-b", source, replicas=0))
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "add a and b")
    (models / "a.yaml").write_text(model(f"{prefix}-a", source, context=1024))
    (models / "b.yaml").unlink()
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "a: context 1024; remove b")
    (models / "c.yaml").write_text(model(f"{prefix}-c", source, gpus=1))
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "add c, which needs a GPU")
    return git(repo, "rev-list", "--reverse", "HEAD").split()


@pytest.fixture(params=["github", "gitlab"])
def pipeline(
    request: pytest.FixtureRequest,
    cluster: Cluster,
    planner_env: dict[str, str],
    planner_daemon: PlannerDaemon,
    tmp_path: Path,
) -> Iterator[Pipeline]:
    forge = request.param
    scripts = github_scripts if forge == "github" else gitlab_scripts
    job_names = ("plan", "apply") if forge == "github" else ("llmgw:plan", "llmgw:apply")
    env = {
        **planner_env,
        "GITHUB_OUTPUT": str(tmp_path / "github-output"),
        # `planner` as the runner finds it once the wheel is installed.
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    Path(env["GITHUB_OUTPUT"]).touch()
    yield Pipeline(forge, scripts(job_names[0]), scripts(job_names[1]), tmp_path / "repo", env)
    forget_models(cluster, *(f"ci-{forge}-{m}" for m in "abc"))


def test_the_pipelines_plan_apply_prune_and_fail_on_an_unplaceable_model(
    pipeline: Pipeline, cluster: Cluster, tiny_model: Path
) -> None:
    assert pipeline.plan and pipeline.apply, "no planner command found in the example"
    prefix = f"ci-{pipeline.forge}"
    pipeline.checkout.mkdir()
    first, second, third = commits(pipeline.checkout, prefix, tiny_model)

    # 1. merged: the default branch's job applies both.
    git(pipeline.checkout, "checkout", "-q", first)
    applied = pipeline.run(pipeline.apply)
    assert applied.returncode == 0, applied.stderr
    version = nomad_get(cluster, f"/v1/job/{prefix}-a")["Version"]

    # 2. the merge request: a plan with changes, in Markdown; nothing changed.
    git(pipeline.checkout, "checkout", "-q", second)
    planned = pipeline.run(pipeline.plan)
    assert planned.returncode == 0, planned.stderr
    plan = (pipeline.checkout / "plan.md").read_text()
    print(plan)
    assert plan.startswith("### llmgw plan: 1 to update, 1 to remove\n")
    assert f"| `{prefix}-a` | **update** |" in plan
    assert f"| `{prefix}-b` | **deregister** |" in plan
    assert "```diff" in plan and "context" in plan
    if pipeline.forge == "github":
        assert pipeline.plan_exitcode() == "2"
    assert nomad_get(cluster, f"/v1/job/{prefix}-a")["Version"] == version
    assert nomad_get(cluster, f"/v1/job/{prefix}-b")["ID"] == f"{prefix}-b"

    # ... merged: updated, pruned; the same plan again has nothing to do.
    applied = pipeline.run(pipeline.apply)
    assert applied.returncode == 0, applied.stderr
    job = nomad_get(cluster, f"/v1/job/{prefix}-a")
    assert job["Version"] > version and "1024" in json.dumps(job["TaskGroups"])
    assert prefix + "-b" not in {j["ID"] for j in nomad_get(cluster, "/v1/jobs")}
    assert pipeline.run(pipeline.plan).returncode == 0
    assert (pipeline.checkout / "plan.md").read_text().startswith("### llmgw plan: no changes\n")
    if pipeline.forge == "github":
        assert pipeline.plan_exitcode() == "0"

    # 3. a model no node can place: the plan says so; the default branch's job fails.
    git(pipeline.checkout, "checkout", "-q", third)
    planned = pipeline.run(pipeline.plan)
    assert planned.returncode == 0, planned.stderr
    plan = (pipeline.checkout / "plan.md").read_text()
    assert plan.startswith("### llmgw plan: 1 to create\n")
    assert f"`{prefix}-c` would not be placed" in plan and "nvidia/gpu" in plan
    failed = pipeline.run(pipeline.apply)
    assert failed.returncode == 1
    assert f"error: {prefix}-c is unplaceable" in failed.stderr, failed.stderr
