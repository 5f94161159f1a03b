"""Measure load-based scaling (issue 22): a step load through the router on a model with
`scaling: {min: 1, max: 3}` beside the same model at a fixed `replicas: 1`.

Starts, all on 127.0.0.1 and all stopped at exit (SIGTERM and Ctrl-C included): a dev
Consul + Nomad cluster (``devcluster.cluster``, port offset 10000, as bench/cold_start.py:
its allocations use Nomad's dynamic ports 25000-29999 like the integration tests'
cluster, so **do not run it while integration tests run**), ``planner apply`` of two
models of the tiny random GGUF (tests/support/tiny_gguf.py), ``planner serve`` and one
router (``--usage-interval 1``):

- ``as-fixed``: ``replicas: 1``;
- ``as-scaling``: ``scaling: {min: 1, max: 3, target: --target, window: 10s,
  up_after: 5s, down_after: --down-after}``.

Each round runs the step once per model, one model after the other (the order
alternates between rounds, so neither always runs on a warmer machine): ``--base`` s
of 1 client, then ``--clients`` clients for ``--step`` s, then none; each client sends
``POST /v1/completions`` (``max_tokens`` --tokens) in a loop and records latency and
errors. For each step it reports p50/p99 latency and errors during the step, and for
the scaling model the seconds from the step to the job's first scale-up
(``scale_up_s``, Nomad's count) and from the load's end back to min (``back_to_min_s``);
requests during the scale-down are counted in ``failed_requests``. Both models drain a
stopping replica for ``--shutdown-delay`` s (the definitions' ``shutdown_delay``, default
30 s as theirs): a request that outlives it is cut, and counted there too.

Usage::

    python bench/autoscaling.py [--rounds 1] [--clients 8] [--output json] [--keep]

Exit codes: 0 measured with no failed request, 1 a request failed or it never scaled,
2 setup failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
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

PORT_OFFSET = 10000
FIXED, SCALING = "as-fixed", "as-scaling"
PROFILE = (
    "profile:\n  engine: llama.cpp\n  context: 512\n  cpu: 100\n  memory: 256MiB\n"
    '  args: ["--threads", "1"]\n'
)
BACK_TO_MIN_TIMEOUT_S = 300.0


class Clients:
    """`n` threads sending completions until `stop`; latencies (s) and failures with the
    time each happened (monotonic)."""

    def __init__(self, router: str, model: str, n: int, tokens: int) -> None:
        self.router, self.model, self.tokens = router, model, tokens
        self.latencies: list[tuple[float, float]] = []  # (sent at, seconds)
        self.failures: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": self.tokens}
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                answer = json.loads(call("POST", f"{self.router}/v1/completions", body, timeout=60))
                if not answer.get("choices"):
                    raise ValueError(f"no choices: {answer}")
                with self._lock:
                    self.latencies.append((sent, time.monotonic() - sent))
            except (urllib.error.URLError, OSError, ValueError) as exc:
                with self._lock:
                    self.failures.append((sent, repr(exc)[:200]))

    def start(self) -> Clients:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)


class Bench:
    def __init__(self, workdir: Path, children: Children, args: argparse.Namespace) -> None:
        self.workdir, self.children, self.args = workdir, children, args
        self.cluster = Cluster(workdir / "cluster", PORT_OFFSET)
        self.token = secrets.token_hex(16)
        self.planner_url = f"http://127.0.0.1:{free_port()}"
        self.router_url = f"http://127.0.0.1:{free_port()}"

    def setup(self) -> None:
        up(self.cluster)
        from tests.support.tiny_gguf import write_tiny_gguf

        path = write_tiny_gguf(self.workdir / "tiny.gguf")
        models = self.workdir / "models"
        models.mkdir()
        source = f"source: file://{path}\n"
        drain = f"shutdown_delay: {self.args.shutdown_delay}s\n"
        (models / f"{FIXED}.yaml").write_text(
            f"name: {FIXED}\n{source}{PROFILE}replicas: 1\n{drain}"
        )
        (models / f"{SCALING}.yaml").write_text(
            f"name: {SCALING}\n{source}{PROFILE}"
            f"scaling: {{min: 1, max: 3, target: {self.args.target}, window: 10s, "
            f"up_after: 5s, down_after: {self.args.down_after}s}}\n{drain}"
        )
        serve_models(
            self.children,
            self.cluster,
            models,
            path.resolve().parent,
            self.token,
            self.planner_url,
            self.router_url,
            ["--usage-interval", "1"],
        )
        for model in (FIXED, SCALING):
            wait_for(
                lambda m=model: call(
                    "POST",
                    f"{self.router_url}/v1/completions",
                    {"model": m, "prompt": "a", "max_tokens": 1},
                    timeout=10,
                ),
                180,
                f"{model} to serve through the router",
            )

    def count(self, model: str) -> int:
        job = get_json(f"{self.cluster.nomad_addr}/v1/job/{model}")
        return int(job["TaskGroups"][0]["Count"])  # type: ignore[index]

    def step(self, model: str) -> dict:
        """One step load on `model`; the figures of it."""
        args = self.args
        base = Clients(self.router_url, model, 1, args.tokens).start()
        time.sleep(args.base)
        stepped = time.monotonic()
        crowd = Clients(self.router_url, model, args.clients - 1, args.tokens).start()
        scale_up_s = None
        while time.monotonic() - stepped < args.step:
            if scale_up_s is None and self.count(model) > 1:
                scale_up_s = time.monotonic() - stepped
            time.sleep(0.25)
        peak = self.count(model)
        crowd.stop()
        base.stop()
        ended = time.monotonic()
        back_to_min_s = None
        # Keep one client on through the scale-down: a request failing then is counted.
        tail = Clients(self.router_url, model, 1, args.tokens).start()
        try:
            if model == SCALING and peak > 1:
                while time.monotonic() - ended < BACK_TO_MIN_TIMEOUT_S:
                    if self.count(model) == 1:
                        back_to_min_s = time.monotonic() - ended
                        break
                    time.sleep(0.5)
                # The stopped replica leaves Consul, then the router: a few more seconds.
                time.sleep(6)
        finally:
            tail.stop()
        during = [s for sent, s in crowd.latencies + base.latencies if sent >= stepped]
        failed = crowd.failures + base.failures + tail.failures
        return {
            "model": model,
            "requests_during_step": len(during),
            "p50_ms": round(percentile(during, 0.5) * 1000, 1) if during else None,
            "p99_ms": round(percentile(during, 0.99) * 1000, 1) if during else None,
            "errors_during_step": sum(1 for sent, _ in failed if stepped <= sent < ended),
            "failed_requests": len(failed),
            "failures": [why for _, why in failed[:5]],
            "scale_up_s": round(scale_up_s, 1) if scale_up_s is not None else None,
            "peak_replicas": peak,
            "back_to_min_s": round(back_to_min_s, 1) if back_to_min_s is not None else None,
            "scale_down_requests": len(tail.latencies),
        }


def measure(args: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="llmgw-autoscaling-"))
    children = Children(str(workdir))
    bench = Bench(workdir, children, args)
    steps: list[dict] = []
    try:
        try:
            bench.setup()
        except Exception as exc:
            print(f"setup failed: {exc}", file=sys.stderr)
            print(json.dumps(children.logs(), indent=1), file=sys.stderr)
            sys.exit(2)
        for round_ in range(args.rounds):
            order = (FIXED, SCALING) if round_ % 2 == 0 else (SCALING, FIXED)
            for model in order:
                steps.append({"round": round_ + 1, **bench.step(model)})
                print(f"step: {steps[-1]}", file=sys.stderr)
        decision = get_json(f"{bench.planner_url}/v1/models/{SCALING}")
    finally:
        children.close()
        down(bench.cluster)
        if args.keep:
            print(f"logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    fixed = [s for s in steps if s["model"] == FIXED]
    scaling = [s for s in steps if s["model"] == SCALING]

    def worst(rows: list[dict], key: str) -> float | None:
        values = [r[key] for r in rows if r[key] is not None]
        return max(values) if values else None

    return {
        "model": "tiny random GGUF",
        "clients": args.clients,
        "target": args.target,
        "down_after_s": args.down_after,
        "shutdown_delay_s": args.shutdown_delay,
        "scale_up_s": worst(scaling, "scale_up_s"),
        "back_to_min_s": worst(scaling, "back_to_min_s"),
        "failed_requests": sum(s["failed_requests"] for s in steps),
        "p50_ms_fixed": worst(fixed, "p50_ms"),
        "p99_ms_fixed": worst(fixed, "p99_ms"),
        "p50_ms_scaling": worst(scaling, "p50_ms"),
        "p99_ms_scaling": worst(scaling, "p99_ms"),
        "last_decision": (decision.get("scaling") or {}).get("last"),  # type: ignore[union-attr]
        "steps": steps,
        "cpus": os.cpu_count(),
    }


def print_table(r: dict) -> None:
    print(
        f"step load 1 -> {r['clients']} clients, tiny model, target {r['target']:g} "
        f"per replica ({r['cpus']} CPUs)"
    )
    print(
        f"{'round':>5} {'model':>11} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} "
        f"{'up after':>9} {'peak':>4} {'to min':>7}"
    )
    for s in r["steps"]:
        up_s = f"{s['scale_up_s']:.1f}s" if s["scale_up_s"] is not None else "-"
        down_s = f"{s['back_to_min_s']:.1f}s" if s["back_to_min_s"] is not None else "-"
        print(
            f"{s['round']:>5} {s['model']:>11} {s['p50_ms']:>8} {s['p99_ms']:>8} "
            f"{s['failed_requests']:>6} {up_s:>9} {s['peak_replicas']:>4} {down_s:>7}"
        )
    print(f"last decision: {(r['last_decision'] or {}).get('reason')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--clients", type=int, default=8, help="clients during the step")
    parser.add_argument("--base", type=float, default=10.0, help="seconds of 1 client first")
    parser.add_argument("--step", type=float, default=60.0, help="seconds of the step")
    parser.add_argument("--tokens", type=int, default=32, help="max_tokens per request")
    parser.add_argument("--target", type=float, default=2.0, help="requests per replica")
    parser.add_argument("--down-after", type=int, default=30, help="seconds")
    parser.add_argument(
        "--shutdown-delay", type=int, default=30, help="seconds a stopping replica drains"
    )
    parser.add_argument("--output", choices=("table", "json"), default="table")
    parser.add_argument("--keep", action="store_true", help="keep the work folder and logs")
    args = parser.parse_args()
    if args.rounds < 1 or args.clients < 2:
        parser.error("--rounds must be at least 1 and --clients at least 2")
    exit_on_sigterm()
    with contextlib.suppress(KeyboardInterrupt):
        result = measure(args)
        if args.output == "json":
            print(json.dumps(result, indent=2))
        else:
            print_table(result)
        sys.exit(0 if result["failed_requests"] == 0 and result["scale_up_s"] is not None else 1)
    sys.exit(130)


if __name__ == "__main__":
    main()
