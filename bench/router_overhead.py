"""Measure what the router adds on top of a replica: latency, throughput, memory.

Starts, all on 127.0.0.1 and all stopped at exit:

- a Consul dev agent (``$LLMGW_CONSUL_BIN``, else ``consul`` on PATH, else
  /tmp/aptb/x/usr/bin/consul);
- a stub upstream in its own process: a raw asyncio HTTP/1.1 server that
  answers every request with one fixed OpenAI completion (so it costs far less
  than the router and the difference is the router's);
- the router (``python -m router serve``), after registering the stub as
  service ``llmgw-bench`` with a passing TTL check and writing
  ``llmgw/models/bench`` to KV;
- the reference: a bare Starlette + aiohttp forwarder to the same stub
  (bench/forwarder.py, under uvicorn with the router's settings), which the
  router is held to (issue 10: added p50 <= 0.3 ms, req/s >= the forwarder's,
  p99 at 16 connections <= the forwarder's).

Then it sends the same ``POST /v1/completions`` direct, through the router and
through the forwarder:

1. one connection, interleaved triples (``--requests`` each): added latency at
   p50 / p99 = percentile(router or forwarder) - percentile(direct);
2. 16 connections: requests/s and p99 direct, then router and forwarder in
   ``--rounds`` alternating rounds of ``--duration`` seconds each (so a burst
   of load from elsewhere on the machine hits both alike), with ``wrk`` (on PATH,
   else Debian's package, installed by bench/tools.py), else a Python aiohttp
   generator; the two ratios router / forwarder;
3. the router's RSS (VmRSS) after the load.

Client, router and stub share the machine's cores, so on a small machine
the figures include their contention. Usage::

    python bench/router_overhead.py [--requests 5000] [--duration 10] [--rounds 3]
                                    [--output json]

Exit codes: 0 all targets met, 1 a target missed, 2 setup failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tools
from _support import (
    Children,
    RawClient,
    cpu_seconds,
    define_model,
    free_port,
    http,
    percentile,
    report,
    rss_mb,
    wait_for,
    wrk_load,
)

# The load generator: wrk (on PATH, else its Debian package, bench/tools.py),
# else None and a Python one. Set in main.
WRK: tuple[list[str], dict[str, str]] | None = None

MODEL = "bench"
TARGETS = {
    "p50_added_ms": 0.3,
    "p99_added_ms": 2.0,
    "router_rps": 3000.0,
    "rss_mb": 100.0,
    "rps_ratio": 1.0,
    "p99_16_ratio": 1.0,
}

STUB_BODY = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "text": " world", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
    }
).encode()
REQUEST_BODY = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode()


# --- stub upstream ---------------------------------------------------------


class _StubProtocol(asyncio.Protocol):
    response = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(STUB_BODY)).encode()
        + b"\r\n\r\n"
        + STUB_BODY
    )

    def connection_made(self, transport):
        self.transport = transport
        self.buffer = b""

    def data_received(self, data):
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            length = 0
            for line in self.buffer[:end].split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            total = end + 4 + length
            if len(self.buffer) < total:
                return
            self.buffer = self.buffer[total:]
            self.transport.write(self.response)


def serve_stub(port: int) -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(
        loop.create_server(_StubProtocol, "127.0.0.1", port, backlog=1024)
    )
    loop.add_signal_handler(signal.SIGTERM, loop.stop)
    with contextlib.suppress(KeyboardInterrupt):
        loop.run_forever()
    server.close()


# --- processes ---------------------------------------------------------------


class Cluster(Children):
    """Consul + stub + router + forwarder as child processes; ``close`` kills them all."""

    def __init__(self, workdir: str) -> None:
        super().__init__(workdir)
        self.consul_port = free_port()
        self.stub_port = free_port()
        self.router_port = free_port()
        self.forwarder_port = free_port()
        self.router: subprocess.Popen | None = None

    def start(self) -> None:
        self.spawn([sys.executable, __file__, "--serve-stub", str(self.stub_port)], "stub")
        self.spawn(
            [
                sys.executable,
                str(Path(__file__).with_name("forwarder.py")),
                "--port",
                str(self.forwarder_port),
                "--upstream",
                f"http://127.0.0.1:{self.stub_port}",
            ],
            "forwarder",
        )
        consul = self.consul(self.consul_port)
        wait_for(lambda: socket.create_connection(("127.0.0.1", self.stub_port)), 10, "stub")
        service = {
            "ID": "llmgw-bench-1",
            "Name": f"llmgw-{MODEL}",
            "Address": "127.0.0.1",
            "Port": self.stub_port,
            "Meta": {"llmgw_model": MODEL, "llmgw_definition_hash": "bench"},
            "Check": {"CheckID": "bench-ttl", "TTL": "1h", "Status": "passing"},
        }
        http("PUT", f"{consul}/v1/agent/service/register", json.dumps(service).encode())
        define_model(consul, MODEL)
        self.router = self.router_process(self.router_port, self.consul_port)
        url = f"http://127.0.0.1:{self.router_port}/v1/completions"
        wait_for(lambda: http("POST", url, REQUEST_BODY) == STUB_BODY, 30, "router to route")
        url = f"http://127.0.0.1:{self.forwarder_port}/v1/completions"
        wait_for(lambda: http("POST", url, REQUEST_BODY) == STUB_BODY, 30, "forwarder")


# --- measurements --------------------------------------------------------------


def latency(direct_port: int, router_port: int, forwarder_port: int, requests: int) -> dict:
    clients = {
        name: RawClient(port, REQUEST_BODY)
        for name, port in (
            ("direct", direct_port),
            ("router", router_port),
            ("forwarder", forwarder_port),
        )
    }
    for _ in range(200):  # warm every path (pool, caches)
        for client in clients.values():
            client.roundtrip()
    times: dict[str, list[float]] = {name: [] for name in clients}
    for _ in range(requests):
        for name, client in clients.items():
            times[name].append(client.roundtrip())
    ms = 1000.0
    d = times["direct"]
    result: dict = {
        "requests_each": requests,
        "direct_p50_ms": percentile(d, 0.5) * ms,
        "direct_p99_ms": percentile(d, 0.99) * ms,
    }
    for name in ("router", "forwarder"):
        r = times[name]
        prefix = "" if name == "router" else "forwarder_"
        result.update(
            {
                f"{name}_p50_ms": percentile(r, 0.5) * ms,
                f"{name}_p99_ms": percentile(r, 0.99) * ms,
                f"{prefix}p50_added_ms": (percentile(r, 0.5) - percentile(d, 0.5)) * ms,
                f"{prefix}p99_added_ms": (percentile(r, 0.99) - percentile(d, 0.99)) * ms,
                f"{prefix}mean_added_ms": (statistics.fmean(r) - statistics.fmean(d)) * ms,
            }
        )
    return result


Load = tuple[float, int, list[float]]
"""(seconds run, requests done, latencies in seconds or [p99] from wrk)."""


def use_wrk() -> None:
    """Set WRK: wrk on PATH, else its Debian package (bench/tools.py); where neither
    is there, say so on stderr and leave it None (the Python generator)."""
    global WRK
    found = shutil.which("wrk")
    if found:
        WRK = ([found], dict(os.environ))
        return
    got = tools.wrk()
    if isinstance(got, str):
        print(f"no wrk ({got}): a Python load generator instead", file=sys.stderr)
    else:
        WRK = got


def rps_wrk(port: int, connections: int, duration: float, workdir: str) -> Load:
    assert WRK is not None
    seconds, done, _, p99 = wrk_load(
        WRK, f"http://127.0.0.1:{port}/v1/completions", REQUEST_BODY, connections, duration, workdir
    )
    return seconds, done, [p99]


def rps_python(
    port: int, connections: int, duration: float, headers: dict[str, str] | None = None
) -> Load:
    import aiohttp

    async def run() -> Load:
        url = f"http://127.0.0.1:{port}/v1/completions"
        latencies: list[float] = []
        deadline = time.perf_counter() + duration
        connector = aiohttp.TCPConnector(limit=connections)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def worker() -> None:
                while (sent := time.perf_counter()) < deadline:
                    async with session.post(url, data=REQUEST_BODY, headers=headers) as resp:
                        await resp.read()
                        if resp.status != 200:
                            raise RuntimeError(f"HTTP {resp.status}")
                    latencies.append(time.perf_counter() - sent)

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(connections)))
            return time.perf_counter() - started, len(latencies), latencies

    return asyncio.run(run())


def load(args: argparse.Namespace, port: int, workdir: str, generator: str) -> Load:
    if generator == "wrk":
        return rps_wrk(port, args.connections, args.duration, workdir)
    return rps_python(port, args.connections, args.duration)


def throughput(cluster: Cluster, args: argparse.Namespace, workdir: str) -> dict:
    """Requests/s and p99 at ``args.connections``: direct once, then router and
    forwarder in alternating rounds; the router's CPU per request."""
    assert cluster.router is not None
    generator = "wrk" if WRK else "python-aiohttp"
    result: dict = {
        "load_generator": generator,
        "connections": args.connections,
        "rounds": args.rounds,
    }
    seconds, done, lat = load(args, cluster.stub_port, workdir, generator)
    result["direct_rps"] = done / seconds
    result["direct_p99_16_ms"] = percentile(lat, 0.99) * 1000
    runs: dict[str, list[Load]] = {"router": [], "forwarder": []}
    router_cpu = router_requests = 0.0
    for i in range(args.rounds):
        order = ("router", "forwarder") if i % 2 == 0 else ("forwarder", "router")
        for name in order:
            port = cluster.router_port if name == "router" else cluster.forwarder_port
            cpu_before = cpu_seconds(cluster.router.pid)
            runs[name].append(load(args, port, workdir, generator))
            if name == "router":
                router_cpu += cpu_seconds(cluster.router.pid) - cpu_before
                router_requests += runs[name][-1][1]
    for name, loads in runs.items():
        latencies = [x for _, _, lat in loads for x in lat]
        result[f"{name}_rps"] = sum(d for _, d, _ in loads) / sum(s for s, _, _ in loads)
        # wrk gives one p99 per run: the worst of them stands for the whole.
        result[f"{name}_p99_16_ms"] = (
            percentile(latencies, 0.99) if generator != "wrk" else max(latencies)
        ) * 1000
    # CPU the router spent per request: the figure contention does not bend.
    result["router_cpu_us_per_request"] = router_cpu / max(router_requests, 1) * 1e6
    result["rps_ratio"] = result["router_rps"] / result["forwarder_rps"]
    result["p99_16_ratio"] = result["router_p99_16_ms"] / result["forwarder_p99_16_ms"]
    return result


def measure(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as workdir:
        cluster = Cluster(workdir)
        try:
            try:
                cluster.start()
            except Exception as exc:
                logs = json.dumps(cluster.logs(), indent=1)
                raise SystemExit(f"setup failed: {exc}\n{logs}") from exc
            result: dict = {"cpus": os.cpu_count()}
            result.update(
                latency(
                    cluster.stub_port, cluster.router_port, cluster.forwarder_port, args.requests
                )
            )
            result.update(throughput(cluster, args, workdir))
            assert cluster.router is not None
            result["rss_mb"] = rss_mb(cluster.router.pid)
        finally:
            cluster.close()
    result["targets"] = TARGETS
    result["met"] = {
        "p50_added_ms": result["p50_added_ms"] <= TARGETS["p50_added_ms"],
        "p99_added_ms": result["p99_added_ms"] <= TARGETS["p99_added_ms"],
        "router_rps": result["router_rps"] >= TARGETS["router_rps"],
        "rss_mb": result["rss_mb"] <= TARGETS["rss_mb"],
        # Issue 10: at least the bare forwarder's throughput, no worse a tail.
        "rps_ratio": result["rps_ratio"] >= TARGETS["rps_ratio"],
        "p99_16_ratio": result["p99_16_ratio"] <= TARGETS["p99_16_ratio"],
    }
    return result


def print_table(r: dict) -> None:
    n = r["connections"]
    rows = [
        (
            "added latency p50, 1 conn",
            f"{r['p50_added_ms']:.3f} ms",
            f"{r['forwarder_p50_added_ms']:.3f} ms",
            "<= 0.3 ms",
            "p50_added_ms",
        ),
        (
            "added latency p99, 1 conn",
            f"{r['p99_added_ms']:.3f} ms",
            f"{r['forwarder_p99_added_ms']:.3f} ms",
            "<= 2 ms",
            "p99_added_ms",
        ),
        (
            f"req/s, {n} conn",
            f"{r['router_rps']:,.0f}",
            f"{r['forwarder_rps']:,.0f}",
            ">= 3,000",
            "router_rps",
        ),
        (
            f"p99, {n} conn",
            f"{r['router_p99_16_ms']:.2f} ms",
            f"{r['forwarder_p99_16_ms']:.2f} ms",
            "",
            None,
        ),
        ("req/s router / forwarder", f"{r['rps_ratio']:.2f}", "", ">= 1.0", "rps_ratio"),
        (
            f"p99 {n} conn router / forwarder",
            f"{r['p99_16_ratio']:.2f}",
            "",
            "<= 1.0",
            "p99_16_ratio",
        ),
        ("router CPU per request", f"{r['router_cpu_us_per_request']:.0f} us", "", "", None),
        ("router RSS", f"{r['rss_mb']:.1f} MB", "", "<= 100 MB", "rss_mb"),
    ]
    print(f"{'measure':<32} {'router':>12} {'forwarder':>12}  {'target':<10} ok")
    for label, value, ref, target, key in rows:
        ok = "" if key is None else ("yes" if r["met"][key] else "NO")
        print(f"{label:<32} {value:>12} {ref:>12}  {target:<10} {ok}")
    print(
        f"(direct p50 {r['direct_p50_ms']:.3f} ms, router p50 {r['router_p50_ms']:.3f} ms; "
        f"direct {r['direct_rps']:,.0f} req/s, p99 {r['direct_p99_16_ms']:.2f} ms at {n} conn; "
        f"{r['rounds']} alternating rounds; load generator: {r['load_generator']}; "
        f"{r['cpus']} CPUs shared by client, router, forwarder and stub)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=5000, help="pairs at 1 connection")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per RPS run")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternating router / forwarder runs at --connections"
    )
    parser.add_argument("--output", choices=("table", "json"), default="table")
    parser.add_argument("--serve-stub", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_stub:
        serve_stub(args.serve_stub)
        return
    use_wrk()
    result = measure(args)
    report(result, args.output, print_table)


if __name__ == "__main__":
    main()
