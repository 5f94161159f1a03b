"""The wheel is what a user installs (issue "Deploying llmgw itself", item 1: an
installed wheel died with FileNotFoundError for the job template): built from this
checkout, pip-installed into a fresh, empty venv, its `planner` and `router` commands
work, `planner apply --dry-run models/` plans against the test cluster, and a real
`planner apply --wait` places a model that serves."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from devcluster.cluster import Cluster
from planner.spec.settings import DEFAULT_JOBSPEC
from tests.conftest import forget_models, nomad_get, passing_endpoints
from tests.support.wheel import ROOT, build_wheel, install_fresh

pytestmark = pytest.mark.integration

MODEL = "pkg-tiny"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin folder of a fresh venv holding only the wheel and its dependencies."""
    return install_fresh(wheel, tmp_path_factory.mktemp("venv") / "venv")


def run(
    bin_dir: Path, *argv: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run a command of the installed venv from an empty folder, so nothing of this
    checkout can be imported by accident."""
    clean = {k: v for k, v in (env or os.environ).items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(bin_dir / argv[0]), *argv[1:]],
        env=clean,
        cwd=bin_dir.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_wheel_carries_the_job_template(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "planner/jobspecs/model.nomad.hcl" in names, names
    assert "planner/jobspecs/engine.nomad.hcl" in names, names  # `planner engines apply`
    # The planner reads it beside its own modules, wherever it is installed.
    beside = Path(sys.modules["planner"].__file__).parent
    assert beside / "jobspecs" / "model.nomad.hcl" == DEFAULT_JOBSPEC
    assert DEFAULT_JOBSPEC.is_file()


def test_the_installed_commands_come_from_the_venv(installed: Path) -> None:
    where = run(
        installed,
        "python",
        "-c",
        "import planner, router; print(planner.__file__); print(router.__file__)",
    )
    assert where.returncode == 0, where.stderr
    for line in where.stdout.split():
        assert Path(line).is_relative_to(installed.parent), where.stdout
    helped = run(installed, "router", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "serve" in helped.stdout
    helped = run(installed, "planner", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "apply" in helped.stdout


def test_apply_dry_run_of_the_repos_models(
    installed: Path, cluster: Cluster, planner_env: dict[str, str]
) -> None:
    before = nomad_get(cluster, "/v1/jobs?prefix=gemma-3-270m")
    planned = run(installed, "planner", "apply", "--dry-run", str(ROOT / "models"), env=planner_env)
    # 0 or 2 (changes planned, with a detailed exit code): never a traceback.
    assert planned.returncode in (0, 2), planned.stdout + planned.stderr
    assert "gemma-3-270m" in planned.stdout + planned.stderr
    assert "Traceback" not in planned.stderr
    assert nomad_get(cluster, "/v1/jobs?prefix=gemma-3-270m") == before, "a dry run changed it"


def test_apply_from_the_installed_wheel_places_a_serving_model(
    installed: Path, cluster: Cluster, planner_env: dict[str, str], model_files: Callable[..., Path]
) -> None:
    try:
        applied = run(
            installed,
            "planner",
            "apply",
            "--wait",
            "--timeout",
            "120",
            str(model_files(MODEL)),
            env=planner_env,
        )
        assert applied.returncode == 0, applied.stdout + applied.stderr
        job = nomad_get(cluster, f"/v1/job/{MODEL}")
        assert job["Meta"]["llmgw_model"] == MODEL
        assert passing_endpoints(cluster, f"llmgw-{MODEL}")
    finally:
        forget_models(cluster, MODEL)
