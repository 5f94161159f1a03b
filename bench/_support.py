"""Helpers the router benchmarks share: child processes, Consul, the router, a raw client.

Imported by ``bench/router_overhead.py``, ``bench/side_by_side.py`` and
``bench/refusal_latency.py`` (run as scripts, so ``bench/`` is on ``sys.path``).
Everything listens on 127.0.0.1; :class:`Children` stops whatever it started, on any exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # devcluster, llmgw_contract, router: imported where used

from devcluster.ports import free_port  # noqa: E402  (after the path it needs)


def consul_binary() -> str:
    """``$LLMGW_CONSUL_BIN``, else ``consul`` on PATH, else the dev cluster's copy."""
    explicit = os.environ.get("LLMGW_CONSUL_BIN")
    if explicit:
        return explicit
    for candidate in (
        shutil.which("consul"),
        str(Path.home() / ".cache/llmgw/bin/consul"),
        "/tmp/aptb/x/usr/bin/consul",
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit("no consul binary: set LLMGW_CONSUL_BIN")


def call(
    method: str, url: str, body: object | None = None, token: str | None = None, timeout: float = 10
) -> bytes:
    """One JSON request (`body` encoded when given, a bearer `token` when given); the
    answer's bytes. Raises urllib's errors (an HTTP error status among them)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def get_json(url: str) -> object:
    return json.loads(call("GET", url) or b"null")


def serve_models(
    children: Children,
    cluster: Any,
    models: Path,
    models_root: Path,
    token: str,
    planner_url: str,
    router_url: str,
    router_args: list[str],
) -> None:
    """On a started dev `cluster` (devcluster.cluster.Cluster): `planner apply` the
    folder `models` (GGUF files under `models_root`), then `planner serve` on
    `planner_url` once it is ready (60 s), then `router serve` on `router_url` with that
    planner and `router_args`, both as `children`. Raises RuntimeError when apply fails."""
    from devcluster.bootstrap import BIN  # the repository is on sys.path by now

    env = {
        **os.environ,
        **cluster.env,
        "PYTHONPATH": str(REPO),
        "LLMGW_ENGINES": f"llama.cpp={BIN / 'llama-server'}",
        "LLMGW_MODELS_ROOT": str(models_root),
        "LLMGW_ADMIN_TOKEN": token,
    }
    applied = subprocess.run(
        [sys.executable, "-m", "planner.cli.main", "apply", str(models)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if applied.returncode != 0:
        raise RuntimeError(f"planner apply failed:\n{applied.stdout}{applied.stderr}")
    port = planner_url.rsplit(":", 1)[1]
    children.spawn(
        [sys.executable, "-m", "planner.cli.main", "serve", "--port", port],
        "planner",
        env=env,
        cwd=REPO,
    )
    wait_for(lambda: get_json(f"{planner_url}/health")["ready"], 60, "planner serve")
    children.spawn(
        [
            sys.executable,
            "-m",
            "router",
            "serve",
            "--port",
            router_url.rsplit(":", 1)[1],
            "--consul-addr",
            f"127.0.0.1:{cluster.consul_http_port}",
            "--planner-url",
            planner_url,
            "--planner-token",
            token,
            *router_args,
        ],
        "router",
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )


def http(method: str, url: str, body: bytes | None = None, timeout: float = 5) -> bytes:
    req = urllib.request.Request(url, data=body, method=method)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def define_model(consul: str, model: str) -> None:
    """Write the planner's KV record for `model` (what makes the router know it)."""
    definition = {
        "name": model,
        "definition_hash": "bench",
        "replicas": 1,
        "source": "stub",
        "profile": {},
    }
    http("PUT", f"{consul}/v1/kv/llmgw/models/{model}", json.dumps(definition).encode())


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so a bench's finally blocks stop its children."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Children:
    """Child processes logging to ``workdir``; :meth:`close` stops them, newest first."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen] = []

    def spawn(self, args: list[str], name: str, **kw) -> subprocess.Popen:
        log = open(os.path.join(self.workdir, f"{name}.log"), "wb")  # noqa: SIM115
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, **kw)
        self.procs.append(proc)
        return proc

    def logs(self, tail: int = 2000) -> dict[str, str]:
        """The last ``tail`` characters of every child's log, for a setup failure."""
        return {
            name: Path(self.workdir, name).read_text(errors="replace")[-tail:]
            for name in os.listdir(self.workdir)
            if name.endswith(".log")
        }

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def consul(self, port: int, name: str = "consul") -> str:
        """Start ``consul agent -dev`` on ``port`` (others free, DNS and gRPC off), logging
        to ``<name>.log``; its URL."""
        self.spawn(
            [
                consul_binary(),
                "agent",
                "-dev",
                "-bind",
                "127.0.0.1",
                "-client",
                "127.0.0.1",
                "-http-port",
                str(port),
                "-dns-port",
                "-1",
                "-grpc-port",
                "-1",
                "-serf-lan-port",
                str(free_port()),
                "-serf-wan-port",
                str(free_port()),
                "-server-port",
                str(free_port()),
                "-log-level",
                "warn",
            ],
            name,
        )
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http("GET", f"{url}/v1/status/leader") != b'""', 20, "consul leader")
        return url

    def router_process(
        self, port: int, consul_port: int, workers: int = 1, name: str = "router"
    ) -> subprocess.Popen:
        """Start ``python -m router serve`` on ``port`` against the Consul on ``consul_port``,
        with ``workers`` worker processes (``--workers``).

        The benches' upstreams are stubs with no slots to count (no ``/props``), so the
        router's per-replica limit is set above any load a bench sends: what is
        measured is the proxy path, not the router's queue."""
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "LLMGW_REPLICA_CONCURRENCY": "1024",
            "LLMGW_ROUTER_WORKERS": str(workers),
        }
        return self.spawn(
            [
                sys.executable,
                "-m",
                "router",
                "serve",
                "--port",
                str(port),
                "--consul-addr",
                f"127.0.0.1:{consul_port}",
                "--log-level",
                "warning",
            ],
            name,
            cwd=REPO,
            env=env,
        )


class RawClient:
    """Blocking keep-alive HTTP/1.1 client: a tiny, constant cost per request.

    Sends one fixed ``POST /v1/completions``; :meth:`roundtrip` raises unless
    the status is ``expect``. ``last_body`` keeps the last response body.
    """

    def __init__(
        self, port: int, body: bytes, expect: int = 200, timeout: float | None = None
    ) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.request = (
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        self.status_line = f"http/1.1 {expect} ".encode()
        self.buffer = b""
        self.last_body = b""

    def roundtrip(self) -> float:
        started = time.perf_counter()
        self.sock.sendall(self.request)
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end >= 0:
                head = self.buffer[:end].lower()
                start = head.find(b"content-length:")
                length = int(head[start + 15 :].split(b"\r\n", 1)[0])
                if len(self.buffer) >= end + 4 + length:
                    if not head.startswith(self.status_line):
                        raise RuntimeError(head.decode(errors="replace"))
                    self.last_body = self.buffer[end + 4 : end + 4 + length]
                    self.buffer = self.buffer[end + 4 + length :]
                    return time.perf_counter() - started
            chunk = self.sock.recv(65536)
            if not chunk:
                raise RuntimeError("connection closed by the server")
            self.buffer += chunk

    def close(self) -> None:
        self.sock.close()


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a server's workers), as /proc lists them now."""
    pids, i = [pid], 0
    while i < len(pids):
        for task in Path(f"/proc/{pids[i]}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                pids += [int(c) for c in task.read_text().split()]
        i += 1
    return pids


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` and its descendants so far."""
    total = 0.0
    for p in process_tree(pid):
        with contextlib.suppress(OSError):
            total += cpu_seconds(p)
    return total


WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = '%s'
wrk.headers["Content-Type"] = "application/json"
"""
WRK_HEADER = """wrk.headers["%s"] = "%s"
"""


def wrk_load(
    wrk: tuple[list[str], dict[str, str]],
    url: str,
    body: bytes,
    connections: int,
    duration: float,
    workdir: str,
    headers: dict[str, str] | None = None,
) -> tuple[float, int, float, float]:
    """``POST body`` to ``url`` from wrk (one thread, ``connections`` keep-alive
    connections) for ``duration`` s: (seconds run, requests done, p50 s, p99 s).

    ``wrk`` is its command and environment (bench/tools.py); ``headers`` are sent
    beside Content-Type. Raises RuntimeError
    when wrk saw a non-2xx answer or a socket error."""
    command, env = wrk
    script = os.path.join(workdir, "post.lua")
    extra = "".join(WRK_HEADER % item for item in (headers or {}).items())
    Path(script).write_text(WRK_SCRIPT % body.decode() + extra)
    # wrk's own timeout is 2 s: a request that long on a loaded machine is a slow
    # answer to measure, not an error.
    flags = ["-t1", f"-c{connections}", f"-d{int(duration)}s", "--timeout", "30s"]
    flags += ["--latency", "-s", script]
    out = subprocess.run(
        [*command, *flags, url],
        capture_output=True,
        text=True,
        timeout=duration + 60,
        check=True,
        env=env,
    ).stdout
    errors = [line for line in out.splitlines() if "Non-2xx" in line or "Socket errors" in line]
    if errors:
        raise RuntimeError(f"wrk saw errors: {errors}")
    total = next(line for line in out.splitlines() if " requests in " in line)
    seconds = float(total.split(" in ")[1].split("s")[0])

    def quantile(label: str) -> float:
        value = next(x for x in out.splitlines() if x.strip().startswith(label)).split()[1]
        unit = next(u for u in ("us", "ms", "s") if value.endswith(u))
        return float(value[: -len(unit)]) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]

    return seconds, int(total.split()[0]), quantile("50%"), quantile("99%")


def report(result: dict, output: str, print_table: Callable[[dict], None]) -> NoReturn:
    """Print a bench's result (``output`` "json", else its table) and exit 0 when every
    target in ``result["met"]`` was met, else 1."""
    if output == "json":
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    sys.exit(0 if all(result["met"].values()) else 1)
