"""Measure how the router follows 1,000 defined models (issue 10, "Scale to 1,000 models").

Starts, all on 127.0.0.1 and all stopped at exit (SIGTERM and Ctrl-C included):

- a dev Consul + Nomad cluster (``devcluster.cluster``) at the first free port
  offset in 10000-10040 (the integration tests use 11000-11040). No
  allocation runs: every model is on demand and stays at 0 instances;
- the router (``python -m router serve``, activation off: a model with no
  passing endpoint is refused at once with 503 ``model_not_ready``, so a
  request tells whether the router sees an endpoint), and a stub upstream
  (an HTTP server on a thread) that answers every completion with 200.

Then, measured by the bench's own observers (a blocking Consul query on
``llmgw/models/?keys`` that notes when each key appears, and a poll of the
router's ``GET /v1/models`` every 50 ms):

1. ``planner apply`` of ``--models`` (1,000) on-demand definitions (the real
   CLI into the real Nomad and Consul): for each model, the time from its KV
   key appearing to the router listing it (target: max <= 5 s);
2. ``--endpoint-changes`` (20) times: register a replica of a model on the
   Consul agent (``llmgw-<model>``, the stub's address, a passing TTL check,
   as Nomad registers a replica) and time until a request through the router
   reaches the stub; then fail the check and time until the router refuses
   again (target: max <= 1 s for both);
3. ``planner apply --prune`` with one model left: time until the router lists
   only that one; then apply one more and time until it is listed;
4. throughout, the TCP connections the router holds to Consul (its sockets,
   from ``/proc``), sampled every 50 ms: the most at once is reported.

Usage::

    python bench/router_scale.py [--models 1000] [--endpoint-changes 20] [--output json]

Exit codes: 0 targets met, 1 a target missed, 2 setup failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from _support import REPO, Children, exit_on_sigterm, free_port, percentile, report, wait_for

sys.path.insert(0, str(REPO))

from devcluster.bootstrap import BIN
from devcluster.cluster import Cluster, down, free_offset, up

TARGET_KNOWN_S = 5.0
TARGET_ENDPOINT_S = 1.0
PORT_OFFSETS = range(10000, 10050, 10)
POLL_S = 0.05
PROFILE = 'context: 512\n  cpu: 100\n  memory: 256MiB\n  args: ["--threads", "1"]'
STUB_BODY = json.dumps({"object": "text_completion", "choices": [{"text": "ok"}]}).encode()


def call(
    method: str, url: str, body: object | None = None, timeout: float = 10
) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


class _Stub(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(STUB_BODY)))
        self.end_headers()
        self.wfile.write(STUB_BODY)

    def log_message(self, *args: object) -> None:
        pass


class Observer:
    """Two threads noting when each model's KV key appeared and when the router
    first (and last) listed it, and the router's Consul connections."""

    def __init__(self, consul: str, router: str, router_pid: int, consul_port: int) -> None:
        self.consul, self.router = consul, router
        self.router_pid, self.consul_port = router_pid, consul_port
        self.kv_seen: dict[str, float] = {}
        self.listed_at: dict[str, float] = {}
        self.listed: set[str] = set()
        self.max_consul_connections = 0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=f, daemon=True) for f in (self._watch_kv, self._poll_router)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch_kv(self) -> None:
        index = 0
        while not self._stop.is_set():
            url = f"{self.consul}/v1/kv/llmgw/models/?keys=true&index={index}&wait=2s"
            try:
                with urllib.request.urlopen(url, timeout=10) as resp:
                    index = int(resp.headers["X-Consul-Index"])
                    keys = json.load(resp)
            except urllib.error.HTTPError as err:
                index = int(err.headers.get("X-Consul-Index") or 0)
                keys = []
            now = time.monotonic()
            for key in keys:
                self.kv_seen.setdefault(key.rsplit("/", 1)[1], now)

    def _poll_router(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                status, body = call("GET", f"{self.router}/v1/models")
                if status == 200:
                    now = time.monotonic()
                    names = {m["id"] for m in json.loads(body)["data"]}
                    for name in names - self.listed:
                        self.listed_at.setdefault(name, now)
                    self.listed = names
            self.max_consul_connections = max(
                self.max_consul_connections, consul_connections(self.router_pid, self.consul_port)
            )
            time.sleep(POLL_S)


def consul_connections(pid: int, port: int) -> int:
    """Established TCP connections of ``pid`` to 127.0.0.1:``port`` (from /proc)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                if remote_port == port and fields[3] == "01" and fields[9] in inodes:
                    count += 1
    return count


class Bench:
    def __init__(self, workdir: Path, children: Children, models: int) -> None:
        self.workdir = workdir
        self.children = children
        self.cluster = Cluster(workdir / "cluster", free_offset(PORT_OFFSETS))
        self.router_url = f"http://127.0.0.1:{free_port()}"
        self.names = [f"scale-{i:04d}" for i in range(models)]
        self.stub: ThreadingHTTPServer | None = None
        self.observer: Observer | None = None

    def planner(self, *args: str) -> dict:
        env = {
            **os.environ,
            **self.cluster.env,
            "PYTHONPATH": str(REPO),
            "LLMGW_ENGINES": f"llama.cpp={BIN / 'llama-server'}",
            "LLMGW_MODELS_ROOT": str(self.workdir),
        }
        done = subprocess.run(
            [sys.executable, "-m", "planner.cli.main", *args, "--output", "json"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"planner {args[0]} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        return json.loads(done.stdout)

    def write(self, folder: Path, names: list[str]) -> Path:
        folder.mkdir(exist_ok=True)
        source = self.workdir / "model.gguf"
        source.write_bytes(b"GGUF")  # never read: on-demand models stay at 0 instances
        for name in names:
            (folder / f"{name}.yaml").write_text(
                f"name: {name}\nsource: file://{source}\nprofile:\n  {PROFILE}\nreplicas: 1\n"
                "on_demand:\n  idle_after: 15m\n"
            )
        return folder

    def setup(self) -> None:
        up(self.cluster)
        self.stub = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
        threading.Thread(target=self.stub.serve_forever, daemon=True).start()
        router = self.children.spawn(
            [
                sys.executable,
                "-m",
                "router",
                "serve",
                "--port",
                self.router_url.rsplit(":", 1)[1],
                "--consul-addr",
                f"127.0.0.1:{self.cluster.consul_http_port}",
                "--log-level",
                "warning",
            ],
            "router",
            env={
                **os.environ,
                "PYTHONPATH": str(REPO),
                "LLMGW_ACTIVATION": "0",
                "LLMGW_REPLICA_CONCURRENCY": "64",
            },
            cwd=REPO,
        )
        wait_for(lambda: call("GET", f"{self.router_url}/health")[0] == 200, 30, "router")
        self.observer = Observer(
            self.cluster.consul_addr, self.router_url, router.pid, self.cluster.consul_http_port
        )
        self.observer.start()

    def known_latencies(self, names: list[str], timeout: float) -> list[float]:
        obs = self.observer
        assert obs is not None
        wait_for(
            lambda: all(n in obs.listed_at and n in obs.kv_seen for n in names),
            timeout,
            f"the router to list {len(names)} models",
        )
        return [max(0.0, obs.listed_at[n] - obs.kv_seen[n]) for n in names]

    def apply_all(self) -> dict:
        started = time.monotonic()
        self.planner("apply", str(self.write(self.workdir / "models", self.names)))
        applied_s = time.monotonic() - started
        known = self.known_latencies(self.names, 120)
        return {
            "apply_s": applied_s,
            "known_p50_s": percentile(known, 0.5),
            "known_max_s": max(known),
        }

    def until_routed(self, model: str, routed: bool, started: float, timeout: float = 30) -> float:
        """Seconds from ``started`` until a request for ``model`` is (or is not) routed."""
        body = {"model": model, "prompt": "hi", "max_tokens": 1}
        while time.monotonic() - started < timeout:
            if (call("POST", f"{self.router_url}/v1/completions", body)[0] == 200) == routed:
                return time.monotonic() - started
            time.sleep(0.01)
        raise RuntimeError(f"{model}: routed={routed} not seen within {timeout} s")

    def endpoint_changes(self, count: int) -> dict:
        assert self.stub is not None
        consul = self.cluster.consul_addr
        added, removed = [], []
        for model in self.names[:: max(1, len(self.names) // count)][:count]:
            service = {
                "ID": f"bench-{model}",
                "Name": f"llmgw-{model}",
                "Address": "127.0.0.1",
                "Port": self.stub.server_address[1],
                "Check": {"CheckID": f"bench-{model}", "TTL": "10m", "Status": "passing"},
            }
            started = time.monotonic()
            call("PUT", f"{consul}/v1/agent/service/register", service)
            added.append(self.until_routed(model, True, started))
            started = time.monotonic()
            call("PUT", f"{consul}/v1/agent/check/fail/bench-{model}")
            removed.append(self.until_routed(model, False, started))
            call("PUT", f"{consul}/v1/agent/service/deregister/bench-{model}")
        return {
            "endpoint_changes": count,
            "endpoint_added_p50_s": percentile(added, 0.5),
            "endpoint_added_max_s": max(added),
            "endpoint_removed_p50_s": percentile(removed, 0.5),
            "endpoint_removed_max_s": max(removed),
        }

    def prune_and_late(self) -> dict:
        obs = self.observer
        assert obs is not None
        keep = self.write(self.workdir / "keep", ["scale-keep"])
        self.planner("apply", str(keep))
        self.known_latencies(["scale-keep"], 60)
        started = time.monotonic()
        self.planner("apply", str(keep), "--prune")
        pruned_s = time.monotonic() - started
        wait_for(lambda: not (set(self.names) & obs.listed), 120, "the pruned models to go")
        gone_s = time.monotonic() - started
        self.write(keep, ["scale-late"])
        self.planner("apply", str(keep))
        [late] = self.known_latencies(["scale-late"], 60)
        return {
            "prune_apply_s": pruned_s,
            "all_pruned_gone_after_s": gone_s,
            "late_model_known_s": late,
        }


def measure(args: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="llmgw-router-scale-"))
    children = Children(str(workdir))
    bench = Bench(workdir, children, args.models)
    result: dict = {"models": args.models, "cpus": os.cpu_count()}
    try:
        try:
            bench.setup()
        except Exception as exc:
            print(f"setup failed: {exc}", file=sys.stderr)
            print(json.dumps(children.logs(), indent=1), file=sys.stderr)
            sys.exit(2)
        result.update(bench.apply_all())
        result.update(bench.endpoint_changes(args.endpoint_changes))
        result.update(bench.prune_and_late())
        assert bench.observer is not None
        result["router_consul_connections_max"] = bench.observer.max_consul_connections
    finally:
        if bench.observer is not None:
            bench.observer.stop()
        if bench.stub is not None:
            bench.stub.shutdown()
        children.close()
        down(bench.cluster)
        if args.keep:
            print(f"logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    result["met"] = {
        "known_max_s": result["known_max_s"] <= TARGET_KNOWN_S,
        "late_model_known_s": result["late_model_known_s"] <= TARGET_KNOWN_S,
        "endpoint_added_max_s": result["endpoint_added_max_s"] <= TARGET_ENDPOINT_S,
        "endpoint_removed_max_s": result["endpoint_removed_max_s"] <= TARGET_ENDPOINT_S,
    }
    return result


def print_table(r: dict) -> None:
    print(f"router with {r['models']} on-demand models ({r['cpus']} CPUs)")
    rows = [
        ("planner apply of all", f"{r['apply_s']:.1f} s", ""),
        ("KV key -> listed, p50", f"{r['known_p50_s']:.3f} s", ""),
        ("KV key -> listed, max", f"{r['known_max_s']:.3f} s", "<= 5 s"),
        ("endpoint added -> routed, p50", f"{r['endpoint_added_p50_s']:.3f} s", ""),
        ("endpoint added -> routed, max", f"{r['endpoint_added_max_s']:.3f} s", "<= 1 s"),
        ("check failed -> refused, p50", f"{r['endpoint_removed_p50_s']:.3f} s", ""),
        ("check failed -> refused, max", f"{r['endpoint_removed_max_s']:.3f} s", "<= 1 s"),
        ("prune -> all gone from /v1/models", f"{r['all_pruned_gone_after_s']:.1f} s", ""),
        ("model applied after prune -> listed", f"{r['late_model_known_s']:.3f} s", "<= 5 s"),
        ("Consul connections held, max", str(r["router_consul_connections_max"]), ""),
    ]
    for label, value, target in rows:
        print(f"{label:<38} {value:>10}  {target}")
    print("targets met" if all(r["met"].values()) else f"MISSED: {r['met']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--endpoint-changes", type=int, default=20)
    parser.add_argument("--output", choices=("table", "json"), default="table")
    parser.add_argument("--keep", action="store_true", help="keep the logs")
    args = parser.parse_args()
    exit_on_sigterm()
    result = measure(args)
    report(result, args.output, print_table)


if __name__ == "__main__":
    main()
