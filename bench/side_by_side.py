"""What a client gets from each proxy in front of the same upstream, side by side in one run.

Starts, all on 127.0.0.1 and all stopped at exit:

- one stub upstream that answers every ``POST /v1/completions`` with one fixed
  OpenAI completion: nginx (``return 200``, one worker) when nginx installs
  (bench/tools.py), else bench/router_overhead.py's asyncio stub;
- the targets, each a proxy to that stub: ``nginx`` (``proxy_pass`` over an
  upstream keep-alive pool, one worker), ``forwarder`` (bench/forwarder.py: bare
  Starlette + aiohttp under uvicorn, the reference issue 10 holds the router
  to), ``router`` (``router serve``: Consul, the stub registered as the only
  replica of model ``bench``), ``router-2w`` / ``router-4w`` with ``--workers``
  (``--workers 2,4``), and ``litellm`` (the LiteLLM proxy, ``openai/bench`` at the
  stub, in its own venv) when it installs; ``direct`` is the stub itself.

Then ``--rounds`` rounds: in each, every target gets ``--duration`` seconds of
wrk (one thread, ``--connections`` keep-alive connections; Debian's wrk, else a
Python aiohttp generator, ``--generator python`` forces it), the order turned by
one place each round so that the machine's drifting load falls on all alike.
Per target: req/s, p50 and p99 (medians over rounds, with their min-max), and
the CPU the target's processes spent per request (user + system, from /proc:
the figure the other programs on the machine do not bend). Paired per round:
router / forwarder req/s and p99, whose medians are held to the targets.

Client, stub and proxy share the machine's cores: on a 2-core machine every
figure includes their contention, and several worker processes cannot run at
once more than the cores allow. Usage::

    python bench/side_by_side.py [--duration 8] [--rounds 5] [--connections 16]
        [--targets direct,nginx,forwarder,router,litellm] [--workers 2,4]
        [--generator wrk|python] [--output json]

Exit codes: 0 the router met its targets (>= 1.0x the forwarder's req/s, p99
no worse), 1 it did not, 2 setup failed.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import tools
from _support import (
    Children,
    define_model,
    exit_on_sigterm,
    free_port,
    http,
    percentile,
    report,
    tree_cpu_seconds,
    wait_for,
    wrk_load,
)
from router_overhead import MODEL, REQUEST_BODY, STUB_BODY, rps_python

TARGETS = {"rps_ratio": 1.0, "p99_ratio": 1.0}

# LiteLLM refuses to start without a master key (1.108: UnsafeMasterKeyError) and
# then asks every request for it. Every target gets the same header: the router
# drops it (no router keys), the others pass it to the stub, which ignores it.
MASTER_KEY = "sk-" + secrets.token_hex(16)
HEADERS = {"Authorization": f"Bearer {MASTER_KEY}"}

_NGINX_COMMON = """
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    keepalive_requests 1000000;
    {body}
}}
"""
_NGINX_STUB = """
    server {{
        listen 127.0.0.1:{port};
        location / {{ default_type application/json; return 200 '{answer}'; }}
    }}
"""
_NGINX_PROXY = """
    upstream stub {{ server 127.0.0.1:{upstream}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://stub;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
"""
_LITELLM_CONFIG = """
model_list:
  - model_name: {model}
    litellm_params:
      model: text-completion-openai/{model}
      api_base: http://127.0.0.1:{upstream}/v1
      api_key: none
litellm_settings:
  telemetry: false
"""


@dataclass
class Target:
    name: str
    port: int
    pid: int
    runs: list[dict] = field(default_factory=list)


class Bench(Children):
    """The stub and every target as child processes; ``close`` stops them all."""

    def __init__(self, workdir: str) -> None:
        super().__init__(workdir)
        self.targets: list[Target] = []
        self.notes: list[str] = []
        self.stub = "python"

    def nginx(self, binary: Path, name: str, body: str) -> subprocess.Popen:
        root = Path(self.workdir, name)
        root.mkdir()
        conf = root / "nginx.conf"
        conf.write_text(_NGINX_COMMON.format(dir=root, body=body))
        return self.spawn(
            [str(binary), "-p", str(root), "-c", str(conf), "-e", str(root / "error.log")], name
        )

    def start(self, args: argparse.Namespace) -> None:
        wanted = args.targets.split(",")
        nginx = tools.nginx() if args.stub != "python" or "nginx" in wanted else "not asked for"
        stub_port = free_port()
        if isinstance(nginx, Path) and args.stub != "python":
            self.stub = "nginx"
            proc = self.nginx(
                nginx, "stub", _NGINX_STUB.format(port=stub_port, answer=STUB_BODY.decode())
            )
        else:
            router_overhead = Path(__file__).with_name("router_overhead.py")
            proc = self.spawn(
                [sys.executable, str(router_overhead), "--serve-stub", str(stub_port)], "stub"
            )
        self.stub_port = stub_port
        wait_for(lambda: socket.create_connection(("127.0.0.1", stub_port)), 10, "stub")
        self.add("direct", stub_port, proc.pid, wanted)
        if "nginx" in wanted:
            if isinstance(nginx, Path):
                port = free_port()
                body = _NGINX_PROXY.format(port=port, upstream=stub_port)
                self.add("nginx", port, self.nginx(nginx, "nginx", body).pid, wanted)
            else:
                self.notes.append(f"nginx left out: {nginx}")
        if "forwarder" in wanted:
            port = free_port()
            forwarder = Path(__file__).with_name("forwarder.py")
            upstream = f"http://127.0.0.1:{stub_port}"
            proc = self.spawn(
                [sys.executable, str(forwarder), "--port", str(port), "--upstream", upstream],
                "forwarder",
            )
            self.add("forwarder", port, proc.pid, wanted)
        if "router" in wanted:
            self.start_routers(args)
        if "litellm" in wanted:
            self.start_litellm()
        for target in self.targets:
            url = f"http://127.0.0.1:{target.port}/v1/completions"
            wait_for(lambda u=url: answers(u), 120, target.name)

    def add(self, name: str, port: int, pid: int, wanted: list[str]) -> None:
        if name in wanted:
            self.targets.append(Target(name, port, pid))

    def start_routers(self, args: argparse.Namespace) -> None:
        consul_port = free_port()
        consul = self.consul(consul_port)
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
        for workers in [1, *(int(w) for w in args.workers.split(",") if w)]:
            name = "router" if workers == 1 else f"router-{workers}w"
            port = free_port()
            proc = self.router_process(port, consul_port, workers, name)
            self.targets.append(Target(name, port, proc.pid))

    def start_litellm(self) -> None:
        command = tools.litellm()
        if isinstance(command, str):
            self.notes.append(f"litellm left out: {command}")
            return
        port = free_port()
        config = Path(self.workdir, "litellm.yaml")
        config.write_text(_LITELLM_CONFIG.format(model=MODEL, upstream=self.stub_port))
        env = {
            **os.environ,
            # No fetch of the cost map from the internet at start (none reachable).
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_LOG": "ERROR",
            "LITELLM_MASTER_KEY": MASTER_KEY,
        }
        proc = self.spawn(
            [str(command), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
            "litellm",
            env=env,
        )
        self.targets.append(Target("litellm", port, proc.pid))


def answers(url: str) -> bool:
    headers = {**HEADERS, "Content-Type": "application/json"}
    request = urllib.request.Request(url, data=REQUEST_BODY, method="POST", headers=headers)
    with urllib.request.urlopen(request, timeout=5) as resp:
        return bool(json.loads(resp.read())["choices"])


def load(args: argparse.Namespace, wrk, target: Target, workdir: str) -> dict:
    """One run at ``target``: req/s, p50, p99 (ms) and its CPU per request (us)."""
    cpu = tree_cpu_seconds(target.pid)
    if wrk is not None:
        url = f"http://127.0.0.1:{target.port}/v1/completions"
        seconds, done, p50, p99 = wrk_load(
            wrk, url, REQUEST_BODY, args.connections, args.duration, workdir, HEADERS
        )
    else:
        seconds, done, latencies = rps_python(target.port, args.connections, args.duration, HEADERS)
        p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
    cpu = tree_cpu_seconds(target.pid) - cpu
    return {
        "rps": done / seconds,
        "p50_ms": p50 * 1000,
        "p99_ms": p99 * 1000,
        "cpu_us_per_request": cpu / max(done, 1) * 1e6,
    }


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(args: argparse.Namespace) -> dict:
    wrk = None
    generator = "python-aiohttp"
    if args.generator == "wrk":
        got = tools.wrk()
        if isinstance(got, str):
            print(f"no wrk ({got}): a Python load generator instead", file=sys.stderr)
        else:
            wrk, generator = got, "wrk"
    with tempfile.TemporaryDirectory(prefix="llmgw-side-") as workdir:
        bench = Bench(workdir)
        try:
            try:
                bench.start(args)
            except Exception as exc:
                logs = json.dumps(bench.logs(), indent=1)
                print(f"setup failed: {exc}\n{logs}", file=sys.stderr)
                sys.exit(2)
            targets = bench.targets
            for target in targets:  # warm every path (pools, caches)
                load(argparse.Namespace(**{**vars(args), "duration": 1}), wrk, target, workdir)
            for r in range(args.rounds):
                turn = r % len(targets)
                for target in targets[turn:] + targets[:turn]:
                    target.runs.append(load(args, wrk, target, workdir))
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            bench.close()
    result: dict = {
        "cpus": os.cpu_count(),
        "load_generator": generator,
        "stub": bench.stub,
        "connections": args.connections,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "notes": bench.notes,
        "targets": {
            t.name: {key: spread([run[key] for run in t.runs]) for key in t.runs[0]}
            for t in targets
        },
    }
    runs = {t.name: t.runs for t in targets}
    if "router" in runs and "forwarder" in runs:
        pairs = list(zip(runs["router"], runs["forwarder"], strict=True))
        result["rps_ratio"] = spread([r["rps"] / f["rps"] for r, f in pairs])
        result["p99_ratio"] = spread([r["p99_ms"] / f["p99_ms"] for r, f in pairs])
        result["met"] = {
            "rps_ratio": result["rps_ratio"]["median"] >= TARGETS["rps_ratio"],
            "p99_ratio": result["p99_ratio"]["median"] <= TARGETS["p99_ratio"],
        }
    else:
        result["met"] = {}
    result["goals"] = TARGETS
    return result


def print_table(r: dict) -> None:
    def cell(s: dict, fmt: str) -> str:
        return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"

    print(
        f"{r['connections']} connections, {r['rounds']} rounds of {r['duration_s']:g} s, "
        f"load generator {r['load_generator']}, stub {r['stub']}, {r['cpus']} CPUs shared by "
        "client, stub and proxy; median (min-max) over rounds"
    )
    print(f"{'target':<11} {'req/s':>22} {'p50 ms':>20} {'p99 ms':>20} {'CPU us/req':>18}")
    for name, t in r["targets"].items():
        print(
            f"{name:<11} {cell(t['rps'], '{:,.0f}'):>22} {cell(t['p50_ms'], '{:.2f}'):>20} "
            f"{cell(t['p99_ms'], '{:.2f}'):>20} {cell(t['cpu_us_per_request'], '{:.0f}'):>18}"
        )
    if "rps_ratio" in r:
        print(
            f"router / forwarder, paired per round: req/s {cell(r['rps_ratio'], '{:.2f}')} "
            f"(goal >= 1.0), p99 {cell(r['p99_ratio'], '{:.2f}')} (goal <= 1.0)"
        )
    for note in r["notes"]:
        print(note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument(
        "--targets", default="direct,nginx,forwarder,router,litellm", help="comma-separated"
    )
    parser.add_argument(
        "--workers", default="", help="router worker counts to add beside 1, e.g. 2,4"
    )
    parser.add_argument("--generator", choices=("wrk", "python"), default="wrk")
    parser.add_argument(
        "--stub", choices=("nginx", "python"), default="nginx", help="nginx when it installs"
    )
    parser.add_argument("--output", choices=("table", "json"), default="table")
    args = parser.parse_args()
    exit_on_sigterm()
    result = measure(args)
    report(result, args.output, print_table)


if __name__ == "__main__":
    main()
