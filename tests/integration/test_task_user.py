"""LLMGW_TASK_USER (issue 18, item 2): the rendered job carries the task user, and on
the dev cluster, whose Nomad agent runs as root, the model's llama-server runs as it
(`nobody` here): its /proc status says so."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster.cluster import Cluster
from tests.conftest import forget_models, nomad_get

pytestmark = pytest.mark.integration

MODEL = "task-user"


@pytest.fixture
def readable_folder() -> Iterator[Path]:
    """A folder `nobody` can read: the test's own tmp_path lies under pytest's 0700 one."""
    folder = Path(tempfile.mkdtemp(prefix="llmgw-task-user-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def server_pids(model: str) -> list[int]:
    """The llama-server processes serving `model` (its alias is the model's name)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if b"--alias" in argv and argv[argv.index(b"--alias") + 1:][:1] == [model.encode()]:
            found.append(int(entry.name))
    return found


def uids(pid: int) -> list[int]:
    """Real, effective, saved and filesystem uid of a process (proc(5), Uid:)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return [int(field) for field in line.split()[1:]]
    raise AssertionError(f"no Uid line for {pid}")


def test_a_model_task_runs_as_the_task_user(
        cluster: Cluster, planner_env: dict[str, str], binaries: Path, tiny_model: Path,
        readable_folder: Path, tmp_path: Path) -> None:
    # What the task user costs: it must read the engine and the model (README, "Model
    # definitions"); the cache's copies lie under /root, which `nobody` cannot enter.
    engine, model = readable_folder / "llama-server", readable_folder / "tiny.gguf"
    shutil.copy2((binaries / "llama-server").resolve(), engine)
    shutil.copy2(tiny_model, model)
    engine.chmod(0o755)
    model.chmod(0o644)
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / f"{MODEL}.yaml").write_text(
        f"name: {MODEL}\nsource: file://{model}\nprofile:\n  context: 512\n  cpu: 100\n"
        '  memory: 256MiB\n  args: ["--threads", "1"]\nreplicas: 1\n')
    env = {**planner_env, "LLMGW_TASK_USER": "nobody", "LLMGW_MODELS_ROOT": str(readable_folder),
           "LLMGW_ENGINES": f"llama.cpp={engine}"}
    try:
        applied = subprocess.run(
            [sys.executable, "-m", "planner.cli", "apply", str(folder), "--wait", "--timeout",
             "180"], env=env, capture_output=True, text=True, timeout=300)
        assert applied.returncode == 0, applied.stderr
        task = nomad_get(cluster, f"/v1/job/{MODEL}")["TaskGroups"][0]["Tasks"][0]
        assert (task["Driver"], task["User"]) == ("raw_exec", "nobody")
        if os.geteuid() != 0:
            pytest.skip("the Nomad agent switches users only when it runs as root")
        [pid] = server_pids(MODEL)
        assert uids(pid) == [pwd.getpwnam("nobody").pw_uid] * 4
    finally:
        forget_models(cluster, MODEL)
