"""Events lost by Nomad's bounded event buffer are not lost to the planner (issue 19).

A dev Nomad of its own with a tiny `event_buffer_size`: Nomad's broker starts a
subscription at the closest index it still buffers, without an error
(nomad/stream/event_broker.go, StartAtClosest). The watcher runs in this process,
on the real agents. After it counted a model's 4th failure its stream breaks (the
one fault injected: the connection, not Nomad) and the reconcile before it
reconnects is held, as a reconcile over many models takes seconds, while the model
fails its 5th start and a burst of evaluations pushes those events out of the
buffer. Only the gap the watcher detects when its stream starts later than asked
makes it read the model again: nothing else would (the allocation is failed for
good, no event or health change will come).

The model's server is a fake of one thing (`gate_engine`): a server that fails to
start, every time, the way llama-server does for a model it cannot load; its 5th
start fails only when the test says, so that the 5th failure surely falls inside
the held reconcile, after the model's last pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from devcluster.cluster import Cluster
from llmgw_contract import StateDocument, decode
from planner.agents.consul import ConsulClient
from planner.agents.nomad import NomadClient
from planner.daemon.watcher import Watcher
from planner.errors import NomadUnavailable
from planner.model.failures import Rules
from tests.conftest import http_json, own_cluster, wait_for
from tests.integration.test_parking import QUICK_RESTARTS, SMALL, starts, write_model
from tests.support.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.integration

BUFFER = 8  # items (Raft indexes with events) Nomad keeps; a burst of 40 evaluations > 8
NAME = "gap-kev"


class HeldWatcher(Watcher):
    """The real watcher, whose stream breaks at the first event after `cut` is set; the
    reconcile after that break does not return until `release` is set, so its stream
    subscribes only after whatever happens meanwhile."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.cut = threading.Event()
        self.held = threading.Event()
        self.release = threading.Event()
        self._broken = False

    async def handle_event(self, event: dict) -> None:
        await super().handle_event(event)
        if self.cut.is_set() and not self._broken:
            self._broken = True
            raise NomadUnavailable("test: the event stream's connection broke")

    def reconcile(self) -> int:
        covered = super().reconcile()
        if self._broken and not self.held.is_set():
            self.held.set()
            assert self.release.wait(300)
        return covered


@contextlib.contextmanager
def running(watcher: Watcher) -> Iterator[None]:
    """`watcher.run` on an event loop of its own thread, cancelled at the end."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    tasks: list[asyncio.Task[None]] = []

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            await watcher.run(session)

    def run() -> None:
        asyncio.set_event_loop(loop)
        tasks.append(loop.create_task(main()))
        started.set()
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(tasks[0])
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield
    finally:
        loop.call_soon_threadsafe(tasks[0].cancel)
        thread.join(30)


def gate_engine(folder: Path, real: Path) -> Path:
    """A llama.cpp engine whose every start fails (exit 1, a line on stderr); the 5th
    waits for `folder/go` first. `--version` is the real server's (the planner proves
    engines by it)."""
    path = folder / "gate-llama.cpp"
    path.write_text(f"""#!/bin/sh
case "$1" in --version) exec {real} "$@";; esac
n=$(($(cat {folder}/starts 2>/dev/null || echo 0) + 1))
echo $n > {folder}/starts
if [ $n -ge 5 ]; then
  while [ ! -e {folder}/go ]; do sleep 0.1; done
fi
echo "gate-llama.cpp: failed to load model (start $n)" >&2
exit 1
""")
    path.chmod(0o755)
    return path


def kv_state(cluster: Cluster, name: str) -> StateDocument:
    raw = ConsulClient(cluster.consul_addr).get_indexed(f"llmgw/state/{name}")[1]
    return decode(StateDocument, raw) if raw else StateDocument(name=name)


def burst(cluster: Cluster, count: int) -> None:
    """`count` evaluations of a job that places nothing: each one Raft index or more
    of Evaluation events, none of them the model's."""
    job: dict = {
        "Job": {
            "ID": "gap-burst",
            "Name": "gap-burst",
            "Type": "service",
            "Datacenters": ["*"],
            "TaskGroups": [
                {
                    "Name": "g",
                    "Count": 0,
                    "Tasks": [
                        {"Name": "t", "Driver": "raw_exec", "Config": {"command": "/bin/true"}}
                    ],
                }
            ],
        }
    }
    http_json(f"{cluster.nomad_addr}/v1/jobs", job)
    for _ in range(count):
        http_json(f"{cluster.nomad_addr}/v1/job/gap-burst/evaluate", {"JobID": "gap-burst"})


def test_a_fifth_failure_lost_from_the_event_buffer_is_still_counted_and_parks(
    binaries: Path, tiny_model: Path, tmp_path: Path
) -> None:
    with own_cluster(tmp_path / "cluster", event_buffer_size=BUFFER) as cluster:
        gate = tmp_path / "gate"
        gate.mkdir()
        engines = {
            "llama.cpp": str(binaries / "llama-server"),
            "gate-llama.cpp": str(gate_engine(gate, binaries / "llama-server")),
        }
        env = {
            **os.environ,
            **cluster.env,
            "LLMGW_ENGINES": ",".join(f"{k}={v}" for k, v in engines.items()),
        }
        folder = write_model(
            tmp_path / "m",
            NAME,
            tiny_model,
            profile=SMALL + "\n  engine: gate-llama.cpp",
            extra=QUICK_RESTARTS,
        )
        applied = subprocess.run(
            [sys.executable, "-m", "planner.cli.main", "apply", str(folder)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert applied.returncode == 0, applied.stderr
        nomad = NomadClient(cluster.nomad_addr)
        watcher = HeldWatcher(
            nomad,
            ConsulClient(cluster.consul_addr),
            Rules(stable_after_ns=20 * 10**9),
            reconcile_every=3600,
        )
        started = time.monotonic()
        with running(watcher):
            wait_for(
                lambda: (
                    kv_state(cluster, NAME).consecutive_failures == 4
                    and (gate / "starts").read_text().strip() == "5"
                ),
                120,
                "4 failures counted from the stream, the 5th start waiting",
            )
            watcher.cut.set()
            burst(cluster, 1)  # an event, which breaks the stream
            assert watcher.held.wait(30)
            wait_for(
                lambda: watcher.workers.pending() == 0,
                30,
                "the passes the held reconcile asked for, done",
            )
            (gate / "go").touch()  # the 5th start fails now
            wait_for(
                lambda: [a["ClientStatus"] for a in nomad.allocations(NAME)] == ["failed"],
                60,
                "Nomad to give up on the model after its 5th start",
            )
            lost = kv_state(cluster, NAME)
            assert (lost.consecutive_failures, lost.parked) == (4, None)  # not seen yet
            burst(cluster, 5 * BUFFER)
            watcher.release.set()
            wait_for(
                lambda: (nomad.job(NAME) or {}).get("Stop") is True,
                60,
                "the model parked after the gap",
            )
            took = time.monotonic() - started
        state = kv_state(cluster, NAME)
        assert watcher.gaps >= 1
        assert state.parked is not None and state.consecutive_failures == 5, state
        assert starts(cluster, NAME) == 5
        print(
            f"event gap: parked {took:.1f} s after the watcher started; gaps seen "
            f"{watcher.gaps}, resets {watcher.resets}"
        )


def test_a_document_lost_after_nomad_gave_up_still_parks_after_exactly_five_starts(
    binaries: Path, tmp_path: Path
) -> None:
    """Issue 19's fourth QA: with no planner watching, Nomad fails a model's 5th start and
    its state document is lost (Consul restarted, `llmgw/` deleted); the planner that
    comes up then wrote a new document taking every failure Nomad shows as history, and
    the model stayed `failing` with 0 counted for good (9.5 min watched), since nothing
    would ever fail again. Now it counts the failures of the replicas Nomad gave up on
    and parks: 5 counted, 5 starts, no 6th."""
    name = "lost-kev"
    with own_cluster(tmp_path / "cluster") as cluster:
        env = {
            **os.environ,
            **cluster.env,
            "LLMGW_ENGINES": f"llama.cpp={binaries / 'llama-server'}",
        }
        kev = write_tiny_gguf(tmp_path / "kev.gguf", architecture="kev")
        folder = write_model(tmp_path / "m", name, kev, extra=QUICK_RESTARTS)
        applied = subprocess.run(
            [sys.executable, "-m", "planner.cli.main", "apply", str(folder)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert applied.returncode == 0, applied.stderr
        nomad = NomadClient(cluster.nomad_addr)
        wait_for(
            lambda: [a["ClientStatus"] for a in nomad.allocations(name)] == ["failed"],
            120,
            "Nomad to give up on the model after its 5th start, no planner watching",
        )
        consul = ConsulClient(cluster.consul_addr)
        consul.delete_key(f"llmgw/state/{name}")
        watcher = Watcher(nomad, consul, Rules(stable_after_ns=20 * 10**9), reconcile_every=3600)
        with running(watcher):
            wait_for(
                lambda: (nomad.job(name) or {}).get("Stop") is True,
                60,
                "the model parked by the planner that found its document gone",
            )
        state = kv_state(cluster, name)
        assert state.parked is not None and state.consecutive_failures == 5, state
        assert state.parked.reason == "5 consecutive start failures"
        assert starts(cluster, name) == 5
