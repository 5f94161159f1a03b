"""A stopping replica drains (issue 22, items 2 and 6), on real parts: Gemma on two
replicas behind a real router, long streaming completions in flight.

When Nomad stops a replica (a scale-down 2 -> 1 through `planner apply`, a rollout's old
replica), it removes the replica's service from Consul, the router drops it from its
table, and the replica finishes what it serves during its `shutdown_delay`: every long
stream ends whole (finish_reason "length", its usage), and no request sent after the
router dropped the replica reaches it (counted where it is true: the slots llama-server
launched, from its own log). A change of the drain alone is an update in place, and the
running replica's next stop waits the new delay.

The model's drain here is 5 minutes, so that a stream of 800 tokens (56 s on the shared,
loaded 2-core machine) ends within it whatever the machine's speed; nothing waits for it to
pass (the cleanup purges with no_shutdown_delay). Each step waits on a condition; the
one thing the case needs, a stream still open when its replica leaves Consul, is
asserted, never assumed."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest

from devcluster.bootstrap import GEMMA_FILE, NODE_MODELS
from devcluster.cluster import Cluster
from tests.conftest import (
    PlannerDaemon,
    forget_models,
    http_json,
    nomad_get,
    passing_endpoints,
    run_router,
    wait_for,
)

pytestmark = pytest.mark.integration

NAME = "drain-gemma"
WAITING = "Waiting for shutdown delay"  # Nomad's TaskWaitingShuttingDownDelay
PROMPT = "Tell me a long story about {}, with many chapters."


def write_model(folder: Path, replicas: int, cpu: int = 100, drain: str = "5m") -> Path:
    """Gemma with 2 slots a replica (a long stream and short requests side by side)."""
    folder.mkdir(exist_ok=True)
    (folder / f"{NAME}.yaml").write_text(
        f"name: {NAME}\nsource: file://{NODE_MODELS / GEMMA_FILE}\nprofile:\n"
        f"  context: 2048\n  cpu: {cpu}\n  memory: 1GiB\n"
        f'  args: ["--threads", "1", "--parallel", "2"]\n'
        f"replicas: {replicas}\nshutdown_delay: {drain}\n"
    )
    return folder


class Stream:
    """One streaming completion through the router, read in a thread until its end:
    the text events, the last event's finish_reason and usage, any error."""

    def __init__(self, router: str, subject: str, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.events = 0
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.error: str | None = None
        self.started = time.monotonic()
        self.ended: float | None = None
        body = {
            "model": NAME,
            "prompt": PROMPT.format(subject),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self._request = urllib.request.Request(
            f"{router}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            with urllib.request.urlopen(self._request, timeout=300) as answer:
                for line in answer:
                    data = line.decode().strip().removeprefix("data: ")
                    if not data or data == "[DONE]" or not data.startswith("{"):
                        continue
                    event = json.loads(data)
                    self.events += 1
                    for choice in event.get("choices") or []:
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
                    self.usage = event.get("usage") or self.usage
        except Exception as exc:  # any failure is the test's finding
            self.error = repr(exc)
        finally:
            self.ended = time.monotonic()

    @property
    def open(self) -> bool:
        return self.ended is None

    def whole(self) -> bool:
        """It ended as asked: all its tokens, finish_reason "length", its usage."""
        return (
            self.error is None
            and self.finish_reason == "length"
            and (self.usage or {}).get("completion_tokens") == self.max_tokens
        )


def replicas(cluster: Cluster, desired: str = "run") -> dict[str, str]:
    """{allocation ID: "ip:port"} of the job's running allocations Nomad wants `desired`
    (one told to stop is "pending" again while it waits its shutdown_delay)."""
    alive = ("running",) if desired == "run" else ("running", "pending")
    found = {}
    for stub in nomad_get(cluster, f"/v1/job/{NAME}/allocations"):
        if stub["DesiredStatus"] == desired and stub["ClientStatus"] in alive:
            alloc = nomad_get(cluster, f"/v1/allocation/{stub['ID']}")
            [port] = alloc["AllocatedResources"]["Shared"]["Ports"]
            found[stub["ID"]] = f"{port['HostIP']}:{port['Value']}"
    return found


def launches(cluster: Cluster, alloc_id: str) -> int:
    """Completions the replica started: llama-server logs one `launch_slot_` line per
    request it gives a slot (tools/server/server.cpp), health checks and /props none."""
    count = 0
    for kind in ("stdout", "stderr"):
        url = (
            f"{cluster.nomad_addr}/v1/client/fs/logs/{alloc_id}"
            f"?task=llama-server&type={kind}&plain=true&origin=start"
        )
        with urllib.request.urlopen(url, timeout=10) as answer:
            count += answer.read().decode(errors="replace").count("launch_slot_")
    return count


def router_replicas(router: str) -> int:
    """The replicas the router sends this model's requests to (its table)."""
    return http_json(f"{router}/v1/models/{NAME}", timeout=5)["llmgw"]["passing_replicas"]


def short(router: str) -> dict:
    return http_json(
        f"{router}/v1/completions",
        {"model": NAME, "prompt": "Hello", "max_tokens": 8},
        timeout=120,
    )


def left(cluster: Cluster, router: str, address: str, remaining: int) -> None:
    """Wait until `address` is out of Consul's passing instances and the router's table
    holds `remaining` replicas (polled every 50 ms)."""
    wait_for(
        lambda: (
            address not in passing_endpoints(cluster, f"llmgw-{NAME}")
            and router_replicas(router) == remaining
        ),
        120,
        f"{address} out of Consul and the router's table",
        interval=0.05,
    )


def router_dropped(cluster: Cluster, router: str, address: str) -> tuple[float, int]:
    """When the router dropped `address` from its table, in seconds since the epoch, and
    the requests it said were still in flight there: its log line (`router.endpoints`,
    "endpoint <url> left (<n> in flight finish there)", local time to the millisecond)."""
    log = cluster.root / f"router-{router.rsplit(':', 1)[1]}.log"
    for line in log.read_text().splitlines():
        found = re.match(
            rf"(\S+ \S+) INFO router.endpoints: model {NAME}: endpoint "
            rf"http://{re.escape(address)} left \((\d+) in flight",
            line,
        )
        if found:
            at = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            return at, int(found.group(2))
    pytest.fail(f"the router never logged {address} leaving")


def deregistered(cluster: Cluster, alloc_id: str) -> float:
    """When Nomad removed the replica's service (its task's "Waiting for shutdown delay"
    event, which follows the removal: client/allocrunner/taskrunner, handleKill), in
    seconds since the epoch."""
    return float(wait_for(lambda: stop_events(cluster, alloc_id).get(WAITING), 30, "the drain"))


def apply(planner: Callable, folder: Path) -> str:
    """`planner apply` of the folder; the model's change reason."""
    applied = planner("apply", str(folder), "--output", "json")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    [reason] = [c["reason"] for c in json.loads(applied.stdout)["changes"] if c["model"] == NAME]
    return reason


def stop_events(cluster: Cluster, alloc_id: str) -> dict[str, float]:
    """{event type: seconds since the epoch} of the allocation's task."""
    state = nomad_get(cluster, f"/v1/allocation/{alloc_id}")["TaskStates"]["llama-server"]
    return {e["Type"]: e["Time"] / 1e9 for e in state["Events"]}


def test_a_stopping_replica_serves_its_streams_to_the_end_and_gets_no_new_request(
    cluster: Cluster, planner: Callable, planner_daemon: PlannerDaemon, tmp_path: Path
) -> None:
    folder = tmp_path / "m"
    try:
        assert apply(planner, write_model(folder, replicas=2)) == "new model"
        wait_for(lambda: len(replicas(cluster)) == 2, 180, "2 replicas running")
        wait_for(lambda: len(passing_endpoints(cluster, f"llmgw-{NAME}")) == 2, 180, "2 pass")
        with run_router(cluster, planner_daemon.url) as router:
            wait_for(lambda: router_replicas(router) == 2, 30, "the router to know both")
            scale_down(cluster, planner, router, folder)
            rollout(cluster, planner, router, folder)
            drain_change_in_place(cluster, planner, folder)
    finally:
        forget_models(cluster, NAME)


def scale_down(cluster: Cluster, planner: Callable, router: str, folder: Path) -> None:
    """2 -> 1 with a long stream on each replica: Nomad stops one of them."""
    before = {alloc: launches(cluster, alloc) for alloc in replicas(cluster)}
    streams = [Stream(router, subject, 300) for subject in ("a dragon", "a lighthouse")]
    wait_for(lambda: all(s.events for s in streams), 120, "both streams to start")
    # Least-outstanding sends the second to the idle replica: one on each.
    wait_for(
        lambda: all(launches(cluster, a) == n + 1 for a, n in before.items()),
        30,
        "one stream launched on each replica",
    )
    assert apply(planner, write_model(folder, replicas=1)) == "replicas 2 -> 1"
    told = wait_for(lambda: replicas(cluster, desired="stop"), 60, "Nomad to stop one")
    [(stopping, address)] = told.items()
    left(cluster, router, address, remaining=1)
    gone = time.monotonic()
    assert all(s.open for s in streams), "a stream ended before its replica left: no case"
    router_at, inflight = router_dropped(cluster, router, address)
    assert inflight == 1  # the router saw its stream there, and let it finish
    lag = router_at - deregistered(cluster, stopping)
    counted = launches(cluster, stopping)
    served = [short(router) for _ in range(6)]
    assert all(answer["choices"] for answer in served)
    wait_for(lambda: not any(s.open for s in streams), 300, "both streams to end")
    assert all(s.whole() for s in streams), [(s.error, s.finish_reason, s.usage) for s in streams]
    assert launches(cluster, stopping) == counted, "a request reached the stopping replica"
    [(survivor, _)] = replicas(cluster).items()
    assert launches(cluster, survivor) == before[survivor] + 1 + len(served)
    print(
        f"scale-down: out of the router's table {lag:.2f} s after Nomad deregistered it; "
        "streams ran "
        + ", ".join(f"{(s.ended or 0) - s.started:.1f} s" for s in streams)
        + f", all {streams[0].max_tokens} tokens, ending "
        + ", ".join(f"{(s.ended or 0) - gone:.1f} s" for s in streams)
        + " after it left; 6 requests after it, none on it"
    )


def rollout(cluster: Cluster, planner: Callable, router: str, folder: Path) -> None:
    """A new definition rolls out beside the one replica; its long stream ends whole."""
    [(old, address)] = replicas(cluster).items()
    stream = Stream(router, "a mountain", 800)
    wait_for(lambda: stream.events, 120, "the stream to start")
    assert apply(planner, write_model(folder, replicas=1, cpu=101)) == "source or profile changed"
    wait_for(lambda: router_replicas(router) == 2, 180, "the canary in the router's table")
    wait_for(lambda: old in replicas(cluster, desired="stop"), 180, "the old replica stopped")
    left(cluster, router, address, remaining=1)
    left_after = time.monotonic() - stream.started
    assert stream.open, "the stream ended before its replica left: no case"
    router_at, inflight = router_dropped(cluster, router, address)
    assert inflight == 1
    lag = router_at - deregistered(cluster, old)
    counted = launches(cluster, old)
    served = [short(router) for _ in range(4)]
    assert all(answer["choices"] for answer in served)
    wait_for(lambda: not stream.open, 300, "the stream to end")
    assert stream.whole(), (stream.error, stream.finish_reason, stream.usage)
    assert launches(cluster, old) == counted, "a request reached the old replica"
    print(
        f"rollout: old replica out of the router's table {lag:.2f} s after Nomad "
        f"deregistered it, its stream {left_after:.1f} s old; the stream ran "
        f"{(stream.ended or 0) - stream.started:.1f} s, all {stream.max_tokens} tokens"
    )


def drain_change_in_place(cluster: Cluster, planner: Callable, folder: Path) -> None:
    """shutdown_delay 5m -> 5s updates the running replica in place; its stop (replicas
    0, as an idle model's) then waits 5 s, not 5 minutes."""
    [(alloc, _)] = replicas(cluster).items()
    version = nomad_get(cluster, f"/v1/job/{NAME}")["Version"]
    assert apply(planner, write_model(folder, replicas=1, cpu=101, drain="5s")) == (
        "shutdown_delay 300s -> 5s"
    )
    job = nomad_get(cluster, f"/v1/job/{NAME}")
    assert job["Version"] == version + 1
    wait_for(
        lambda: nomad_get(cluster, f"/v1/allocation/{alloc}")["Job"]["Version"] == version + 1,
        30,
        "the replica updated in place",
    )
    assert list(replicas(cluster)) == [alloc]
    stopped_at = time.time()
    assert apply(planner, write_model(folder, replicas=0, cpu=101, drain="5s")) == (
        "replicas 1 -> 0"
    )
    wait_for(
        lambda: nomad_get(cluster, f"/v1/allocation/{alloc}")["ClientStatus"] == "complete",
        60,
        "the replica stopped",
    )
    events = stop_events(cluster, alloc)
    state = nomad_get(cluster, f"/v1/allocation/{alloc}")["TaskStates"]["llama-server"]
    waited = [e["DisplayMessage"] for e in state["Events"] if e["Type"] == WAITING]
    assert waited == ["Waiting for shutdown_delay of 5s before killing the task."], waited
    print(
        f"stop with shutdown_delay 5s: {events['Killed'] - stopped_at:.1f} s from apply to "
        f"the task killed, {events['Killed'] - events[WAITING]:.1f} s of it from the "
        f"deregistration (5 s of drain, then llama-server's exit)"
    )
