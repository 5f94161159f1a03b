"""The admin token goes only to the planner that holds the lock, on real parts: a real
leader holds `llmgw/leader`, a real follower and a real router follow it, and the key's
value is rewritten (a plain KV PUT, which keeps the holder's session) to name a
recording stub, a local HTTP server standing in for an attacker's host.

The stub must receive nothing, the token least of all; writes sent to the follower are
refused with the reason (503 `leader_mismatch`), and the router's activation call goes
to a registered planner. With the record written back, writes go through again
(llmgw_contract.leadership, planner.api.admin, router.planners).
"""

from __future__ import annotations

import base64
import http.server
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devcluster.cluster import Cluster
from llmgw_contract import LEADER_KEY, LeaderRecord, decode, encode
from tests.conftest import (
    ADMIN_TOKEN,
    PlannerDaemon,
    forget_models,
    http_json,
    run_router,
    wait_for,
)
from tests.integration.test_on_demand import on_demand_model, refusal
from tests.integration.test_planner_failover import router_metric

pytestmark = pytest.mark.integration

GPU_MODEL = "forged-leader-gpu"  # fits nowhere here: the leader answers at once


class Recorder(http.server.ThreadingHTTPServer):
    """Records every request line and its Authorization header; answers 503."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None]] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _record(self) -> None:
                recorder.seen.append((self.command, self.path, self.headers.get("Authorization")))
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = do_PUT = _record

            def log_message(self, *_: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def stub() -> Iterator[Recorder]:
    server = Recorder()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def leader_key(cluster: Cluster) -> tuple[str, bytes]:
    [entry] = http_json(f"{cluster.consul_addr}/v1/kv/{LEADER_KEY}")
    return entry.get("Session") or "", base64.b64decode(entry["Value"] or "")


def put_leader_value(cluster: Cluster, value: bytes) -> None:
    """A plain PUT, as any holder of a `key_prefix "llmgw/" write` token may send."""
    request = urllib.request.Request(
        f"{cluster.consul_addr}/v1/kv/{LEADER_KEY}", data=value, method="PUT"
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert json.load(answer) is True


def write(planner_url: str) -> tuple[int, dict]:
    """POST /v1/usage with the admin token: (status, body or error)."""
    request = urllib.request.Request(
        f"{planner_url}/v1/usage",
        data=json.dumps({"models": []}).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, {}
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)["error"]


def test_a_rewritten_leader_key_gets_no_write_and_no_token(
    cluster: Cluster,
    planner: Callable,
    planner_daemon: PlannerDaemon,
    planner_env: dict[str, str],
    tiny_model: Path,
    tmp_path: Path,
    stub: Recorder,
) -> None:
    folder = on_demand_model(
        tmp_path / "m", GPU_MODEL, f"file://{tiny_model}", profile="gpus: 1\n  memory: 256MiB"
    )
    assert planner("apply", str(folder)).returncode == 0
    session, original = leader_key(cluster)
    real = decode(LeaderRecord, original)
    assert session and real.address == planner_daemon.url
    follower = PlannerDaemon(planner_env, cluster.root / "planner-forged-follower.log")
    follower.start()
    try:
        assert http_json(f"{follower.url}/health")["leader"] == {
            "id": real.id,
            "address": planner_daemon.url,
        }
        assert write(follower.url) == (204, {})  # forwarded to the registered leader

        # The key now names the stub, the real leader's id kept; the lock stays held.
        put_leader_value(cluster, encode(LeaderRecord(id=real.id, address=stub.url)).encode())
        assert leader_key(cluster)[0] == session
        refused = wait_for(
            lambda: (
                (h := http_json(f"{follower.url}/health", timeout=2))["leader"].get("refused") and h
            ),
            20,
            "the follower to refuse the rewritten key",
        )
        assert refused["role"] == "follower" and not refused["ready"]
        assert refused["leader"]["refused"]["code"] == "leader_mismatch"
        assert stub.url in refused["leader"]["refused"]["reason"]

        status, error = write(follower.url)
        assert status == 503 and error["code"] == "leader_mismatch", error
        assert "rewritten outside the lock" in error["message"]
        with run_router(cluster, "none") as router:  # only the planners Consul lists
            wait_for(
                lambda: (
                    router_metric(
                        router, "llmgw_router_planner_leader_refusals_total", code="leader_mismatch"
                    )
                    >= 1
                ),
                30,
                "the router to refuse the rewritten key",
            )
            # Its activation call reaches a registered planner: the leader acts on it, or
            # the follower refuses to pass it on; either way not the stub.
            status, error, _ = refusal(router, GPU_MODEL)
            assert status == 503 and error["code"] in (
                "model_unplaceable",
                "planner_unavailable",
            ), error
            if error["code"] == "planner_unavailable":
                assert (
                    "leader_mismatch" in error["message"]
                    or "rewritten outside the lock" in error["message"]
                ), error
        assert stub.seen == []
        log = follower.log.read_text()
        assert "writes will not be forwarded to the leader" in log

        # Written back by its holder's value: writes go through the follower again.
        put_leader_value(cluster, original)
        wait_for(
            lambda: http_json(f"{follower.url}/health", timeout=2)["ready"],
            20,
            "the follower to trust the restored key",
        )
        assert write(follower.url) == (204, {})
        assert stub.seen == []
    finally:
        if leader_key(cluster)[1] != original:
            put_leader_value(cluster, original)
        follower.stop()
        forget_models(cluster, GPU_MODEL)
