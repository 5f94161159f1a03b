"""LLMGW_TASK_USER (issue 18, item 2): the rendered job carries the task user, and on
a dev cluster, whose Nomad agent runs as root, the model's llama-server runs as it
(`nobody` here): its /proc status says so. The cluster is this module's own, in a
folder `nobody` may traverse, its data_dir 0711: the task starts in its allocation
folder under the agent's data_dir, which Nomad makes 0700 (and pytest's temporary
folders are 0700 too)."""

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
from tests.conftest import forget_models, nomad_get, own_cluster

pytestmark = pytest.mark.integration

MODEL = "task-user"


@pytest.fixture(scope="module")
def readable_folder() -> Iterator[Path]:
    """A folder `nobody` can traverse and read (pytest's temporary folders are 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="llmgw-task-user-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def open_cluster(binaries: Path, readable_folder: Path) -> Iterator[Cluster]:
    root = readable_folder / "cluster"
    root.mkdir(mode=0o755)
    # The agent's data_dir (devcluster.nodes.nomad_config), made before Nomad makes it
    # 0700: a task starts in its allocation folder, <data_dir>/alloc/<id>/<task>.
    (root / "nomad").mkdir(mode=0o711)
    with own_cluster(root) as cluster:
        yield cluster


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
        if b"--alias" in argv and argv[argv.index(b"--alias") + 1 :][:1] == [model.encode()]:
            found.append(int(entry.name))
    return found


def uids(pid: int) -> list[int]:
    """Real, effective, saved and filesystem uid of a process (proc(5), Uid:)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return [int(field) for field in line.split()[1:]]
    raise AssertionError(f"no Uid line for {pid}")


def task_events(cluster: Cluster, job: str) -> str:
    """Each allocation's task events, for a failure's message."""
    lines = []
    for alloc in nomad_get(cluster, f"/v1/job/{job}/allocations"):
        for event in (alloc.get("TaskStates") or {}).get("llama-server", {}).get("Events", []):
            lines.append(f"{event['Type']}: {event.get('DisplayMessage', '')}")
    return "\n".join(lines)


def test_a_model_task_runs_as_the_task_user(
    open_cluster: Cluster, binaries: Path, tiny_model: Path, readable_folder: Path, tmp_path: Path
) -> None:
    cluster = open_cluster
    # What the task user costs: it must read the engine and the model (docs/definitions.md,
    # "Running model tasks as another user"); the cache's copies lie under /root, which
    # `nobody` cannot enter.
    engine, model = readable_folder / "llama-server", readable_folder / "tiny.gguf"
    shutil.copy2((binaries / "llama-server").resolve(), engine)
    shutil.copy2(tiny_model, model)
    engine.chmod(0o755)
    model.chmod(0o644)
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / f"{MODEL}.yaml").write_text(
        f"name: {MODEL}\nsource: file://{model}\nprofile:\n  context: 512\n  cpu: 100\n"
        '  memory: 256MiB\n  args: ["--threads", "1"]\nreplicas: 1\n'
    )
    env = {
        **os.environ,
        **cluster.env,
        "LLMGW_TASK_USER": "nobody",
        "LLMGW_MODELS_ROOT": str(readable_folder),
        "LLMGW_ENGINES": f"llama.cpp={engine}",
    }
    try:
        applied = subprocess.run(
            [
                sys.executable,
                "-m",
                "planner.cli.main",
                "apply",
                str(folder),
                "--wait",
                "--timeout",
                "180",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert applied.returncode == 0, applied.stderr + task_events(cluster, MODEL)
        task = nomad_get(cluster, f"/v1/job/{MODEL}")["TaskGroups"][0]["Tasks"][0]
        assert (task["Driver"], task["User"]) == ("raw_exec", "nobody")
        if os.geteuid() != 0:
            pytest.skip("the Nomad agent switches users only when it runs as root")
        [pid] = server_pids(MODEL)
        assert uids(pid) == [pwd.getpwnam("nobody").pw_uid] * 4
    finally:
        forget_models(cluster, MODEL)
