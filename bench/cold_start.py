"""Measure on-demand cold start: what the control plane adds to a model's own load time.

Starts, all on 127.0.0.1 and all stopped at exit (SIGTERM and Ctrl-C included):

- a dev Consul + Nomad cluster (``devcluster.cluster``) with port offset
  10000 (Consul 18500, Nomad 14646). Not 12000: that puts Consul's ports
  (20300-20600) inside the demo cluster's Nomad dynamic port range
  (20000-24999). Its allocations use Nomad's dynamic ports 25000-29999, the
  same range as the integration tests' cluster (offset 11000), and two Nomad
  clients on one host do not know each other's ports: **do not run this bench
  while the integration tests run.** It can run beside the demo;
- ``planner apply`` of one on-demand model (``on_demand: {idle_after: 15m}``,
  ``replicas: 1``): the Gemma 3 270M GGUF at
  ~/.cache/llmgw/models/gemma-3-270m-q4_k_m.gguf if present, else a tiny
  random GGUF (tests/support/tiny_gguf.py, needs the dev extras);
- ``planner serve`` (admin API, ``LLMGW_ADMIN_TOKEN`` a random token) and the
  router with ``--planner-url`` / ``--planner-token`` and a 120 s activation
  window, so that the first request of a cold model is held, not refused.

Then, ``--cycles`` times (3): with the model at 0 instances, send ``POST
/v1/completions`` (``stream: true``, ``max_tokens`` 4) and time it to the
first token; read llama-server's stderr of the allocation that served it
(Nomad's ``/v1/client/fs/logs``) and take the elapsed time on its "model
loaded" / "listening on" line (llama.cpp's prefix ``M.SS.mmm.uuu``: minutes,
seconds, milliseconds, microseconds since the process started). Cold-start
overhead = time to first token - that load time: the activate call, Nomad's
placement and task start, the Consul health check noticing (its interval is
2 s), the router's watch, the forward and the first token itself. Then scale
the job back to 0 through Nomad's scale API and wait until the router sees no
endpoint.

Prints p50 / max overhead (target p50 <= 3 s, and max reported) with the
per-cycle breakdown, or ``--output json``. Usage::

    python bench/cold_start.py [--cycles 3] [--output json] [--keep]

Exit codes: 0 target met, 1 target missed, 2 setup failed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import http.client
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _support import (
    REPO,
    Children,
    call,
    exit_on_sigterm,
    free_port,
    get_json,
    percentile,
    serve_models,
    wait_for,
)

sys.path.insert(0, str(REPO))

from devcluster.cluster import Cluster, down, up

MODEL = "cold-bench"
PORT_OFFSET = 10000
TARGET_P50_S = 3.0
GEMMA = Path.home() / ".cache/llmgw/models/gemma-3-270m-q4_k_m.gguf"
# Bounds: no step waits longer than these.
FIRST_TOKEN_TIMEOUT_S = 180.0
ACTIVATION_WINDOW_S = 120.0
SCALE_DOWN_TIMEOUT_S = 60.0
# llama.cpp's log prefix: minutes.seconds.milliseconds.microseconds since start.
_ELAPSED = re.compile(r"^(\d+)\.(\d{2})\.(\d{3})\.(\d{3}) ")
_READY_LINE = re.compile(r"model loaded|listening on", re.IGNORECASE)


def load_seconds(stderr: str) -> float | None:
    """Elapsed time on llama-server's last "model loaded" / "listening on" line."""
    found = None
    for line in stderr.splitlines():
        match = _ELAPSED.match(line)
        if match and _READY_LINE.search(line):
            minutes, seconds, ms, us = (int(g) for g in match.groups())
            found = minutes * 60 + seconds + ms / 1e3 + us / 1e6
    return found


def model_file(workdir: Path) -> tuple[Path, str]:
    if GEMMA.exists():
        return GEMMA, "gemma-3-270m-q4_k_m"
    from tests.support.tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(workdir / "tiny.gguf"), "tiny random GGUF (no Gemma in the cache)"


def first_token(router: str, timeout: float) -> float:
    """Seconds from sending a streaming completion to its first generated token."""
    host, port = router.removeprefix("http://").split(":")
    body = json.dumps(
        {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "stream": True}
    )
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    started = time.monotonic()
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"router answered {resp.status}: {resp.read()[:500]!r}")
        buffer = b""
        while True:
            chunk = resp.read1(65536)
            if not chunk:
                raise RuntimeError("stream ended before a token")
            buffer += chunk
            for line in buffer.split(b"\n"):
                if line.startswith(b"data: {"):
                    event = json.loads(line[6:])
                    if any(c.get("text") for c in event.get("choices", [])):
                        return time.monotonic() - started
            buffer = buffer[buffer.rfind(b"\n") + 1 :]
    finally:
        conn.close()


def _ns(timestamp: str) -> int:
    """Nomad's RFC 3339 (nanoseconds) as Unix nanoseconds."""
    head, _, frac = timestamp.rstrip("Z").partition(".")
    seconds = dt.datetime.fromisoformat(head).replace(tzinfo=dt.UTC).timestamp()
    return int(seconds) * 10**9 + int((frac + "000000000")[:9])


class Bench:
    def __init__(self, workdir: Path, children: Children) -> None:
        self.workdir = workdir
        self.children = children
        self.cluster = Cluster(workdir / "cluster", PORT_OFFSET)
        self.token = secrets.token_hex(16)
        self.planner_url = f"http://127.0.0.1:{free_port()}"
        self.router_url = f"http://127.0.0.1:{free_port()}"

    def setup(self) -> str:
        up(self.cluster)
        path, which = model_file(self.workdir)
        models = self.workdir / "models"
        models.mkdir()
        (models / f"{MODEL}.yaml").write_text(
            f"name: {MODEL}\nsource: file://{path}\n"
            "profile:\n  engine: llama.cpp\n  context: 512\n  cpu: 1000\n  memory: 1GiB\n"
            '  args: ["--threads", "2"]\n'
            "replicas: 1\non_demand: {idle_after: 15m}\n"
        )
        serve_models(
            self.children,
            self.cluster,
            models,
            path.resolve().parent,
            self.token,
            self.planner_url,
            self.router_url,
            ["--activation-window", str(ACTIVATION_WINDOW_S), "--log-level", "info"],
        )
        wait_for(
            lambda: MODEL in call("GET", f"{self.router_url}/v1/models").decode(),
            30,
            "the router to list the model",
        )
        self.wait_cold()
        return which

    def endpoints_seen_by_router(self) -> float:
        text = call("GET", f"{self.router_url}/metrics").decode()
        for line in text.splitlines():
            if line.startswith(f'llmgw_router_endpoints{{model="{MODEL}"}}'):
                return float(line.rsplit(" ", 1)[1])
        return -1.0

    def running_allocs(self) -> list[dict]:
        allocs = get_json(f"{self.cluster.nomad_addr}/v1/job/{MODEL}/allocations") or []
        return [a for a in allocs if a["ClientStatus"] in ("pending", "running")]  # type: ignore[union-attr]

    def wait_cold(self) -> None:
        def cold() -> bool:
            return not self.running_allocs() and self.endpoints_seen_by_router() == 0

        wait_for(cold, SCALE_DOWN_TIMEOUT_S, f"{MODEL} at 0 instances, seen by the router")

    def scale_to_zero(self) -> None:
        call(
            "POST",
            f"{self.cluster.nomad_addr}/v1/job/{MODEL}/scale",
            {"Count": 0, "Target": {"Group": "server"}, "Message": "cold-start bench"},
        )
        self.wait_cold()

    def cycle(self) -> dict:
        sent_ns = time.time_ns()
        ttft = first_token(self.router_url, FIRST_TOKEN_TIMEOUT_S)
        (alloc,) = [a for a in self.running_allocs() if a["ClientStatus"] == "running"]
        detail = get_json(f"{self.cluster.nomad_addr}/v1/allocation/{alloc['ID']}")
        logs = call(
            "GET",
            f"{self.cluster.nomad_addr}/v1/client/fs/logs/{alloc['ID']}"
            "?task=llama-server&type=stderr&plain=true&origin=start",
            timeout=30,
        )
        load = load_seconds(logs.decode(errors="replace"))
        if load is None:
            raise RuntimeError(f"no 'model loaded' line in the alloc's stderr:\n{logs[-2000:]!r}")
        started_at = detail["TaskStates"]["llama-server"]["StartedAt"]  # type: ignore[index]
        return {
            "first_token_s": ttft,
            "llama_load_s": load,
            "overhead_s": ttft - load,
            # Where the overhead goes, from the request: allocation created
            # (activate + Nomad placement), task started (the client ran it).
            "alloc_created_after_s": (alloc["CreateTime"] - sent_ns) / 1e9,
            "task_started_after_s": (_ns(started_at) - sent_ns) / 1e9,
            "alloc": alloc["ID"][:8],
        }


def measure(args: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="llmgw-cold-start-"))
    children = Children(str(workdir))
    bench = Bench(workdir, children)
    try:
        try:
            which = bench.setup()
        except Exception as exc:
            print(f"setup failed: {exc}", file=sys.stderr)
            print(json.dumps(children.logs(), indent=1), file=sys.stderr)
            sys.exit(2)
        cycles = []
        for i in range(args.cycles):
            if i:
                bench.scale_to_zero()
            cycles.append(bench.cycle())
            print(f"cycle {i + 1}: {cycles[-1]}", file=sys.stderr)
    finally:
        children.close()
        down(bench.cluster)
        if args.keep:
            print(f"logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    overheads = [c["overhead_s"] for c in cycles]
    p50 = percentile(overheads, 0.5)
    return {
        "model": which,
        "cycles": cycles,
        "overhead_p50_s": p50,
        "overhead_max_s": max(overheads),
        "target_p50_s": TARGET_P50_S,
        "met": p50 <= TARGET_P50_S,
        "cpus": os.cpu_count(),
    }


def print_table(r: dict) -> None:
    print(f"on-demand cold start, model {r['model']} ({r['cpus']} CPUs)")
    print(
        f"{'cycle':>5} {'first token':>12} {'llama load':>11} {'overhead':>9} "
        f"{'alloc at':>9} {'task at':>8}"
    )
    for i, c in enumerate(r["cycles"], 1):
        print(
            f"{i:>5} {c['first_token_s']:>11.2f}s {c['llama_load_s']:>10.2f}s "
            f"{c['overhead_s']:>8.2f}s {c['alloc_created_after_s']:>8.2f}s "
            f"{c['task_started_after_s']:>7.2f}s"
        )
    ok = "yes" if r["met"] else "NO"
    print(
        f"overhead p50 {r['overhead_p50_s']:.2f} s, max {r['overhead_max_s']:.2f} s "
        f"(target p50 <= {r['target_p50_s']:.0f} s): {ok}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=3, help="cold starts to measure")
    parser.add_argument("--output", choices=("table", "json"), default="table")
    parser.add_argument("--keep", action="store_true", help="keep the work folder and logs")
    args = parser.parse_args()
    if args.cycles < 1:
        parser.error("--cycles must be at least 1")
    exit_on_sigterm()
    with contextlib.suppress(KeyboardInterrupt):
        result = measure(args)
        if args.output == "json":
            print(json.dumps(result, indent=2))
        else:
            print_table(result)
        sys.exit(0 if result["met"] else 1)
    sys.exit(130)


if __name__ == "__main__":
    main()
