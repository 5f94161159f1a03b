"""The wheel carries what `planner apply` reads at run time (issue "Deploying llmgw
itself": an installed wheel died with FileNotFoundError for the job template)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from planner.settings import DEFAULT_JOBSPEC

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_carries_the_job_template(tmp_path: Path) -> None:
    # Builds in isolation: pip fetches the build backend (setuptools) from the index.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                    "--wheel-dir", str(tmp_path), str(ROOT)], check=True, timeout=300)
    [wheel] = tmp_path.glob("llmgw-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "planner/jobspecs/model.nomad.hcl" in names, names
    assert "planner/jobspecs/engine.nomad.hcl" in names, names  # `planner engines apply`
    # The planner reads it beside its own modules, wherever it is installed.
    beside = Path(sys.modules["planner.settings"].__file__).parent
    assert beside / "jobspecs" / "model.nomad.hcl" == DEFAULT_JOBSPEC
    assert DEFAULT_JOBSPEC.is_file()
