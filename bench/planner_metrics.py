"""Measure the planner's /metrics with many defined models (issue "Operations view").

Starts a dev cluster of its own (the first free port offset from 11050, beside
the tests' 11000-11040), applies N on-demand model
definitions (registered with 0 instances, so nothing runs), starts `planner
serve`, and reports:

- how long `planner apply` of the N definitions took;
- how long until /metrics lists every model (the leader's first full status
  refresh: one job, allocations and health read per model);
- the scrape duration (p50, p99, max over `--scrapes` scrapes) and its size.

Run: `.venv/bin/python bench/planner_metrics.py [--models 500] [--scrapes 50]`;
prints a table, or JSON with `--json`. Stops everything it started.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _support import REPO, Children, exit_on_sigterm, free_port, percentile, wait_for

sys.path.insert(0, str(REPO))
from devcluster.bootstrap import BIN
from devcluster.cluster import Cluster, down, free_offset, up

# Offsets step by 10 and must stay under 100 apart from any other cluster's: the
# dev agents' port bases are 100 to 300 apart (8300, 8500, 8600).
PORT_OFFSETS = range(11050, 11100, 10)


def write_models(folder: Path, count: int, gguf: Path) -> None:
    folder.mkdir()
    for i in range(count):
        (folder / f"m{i:04d}.yaml").write_text(
            f"name: scale-{i:04d}\nsource: file://{gguf}\nprofile:\n  context: 512\n"
            "  cpu: 100\n  memory: 256MiB\nreplicas: 1\non_demand: {idle_after: 15m}\n"
        )


def scrape(url: str) -> tuple[float, int, str]:
    started = time.perf_counter()
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
        body = response.read()
    return time.perf_counter() - started, len(body), body.decode()


def models_listed(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.startswith("llmgw_model_desired_replicas{"))


def measure(args: argparse.Namespace, workdir: Path, children: Children) -> dict:
    cluster = Cluster(workdir / "cluster", free_offset(PORT_OFFSETS))
    up(cluster)
    try:
        gguf = workdir / "tiny.gguf"
        gguf.write_bytes(b"GGUF")  # never loaded: on-demand models stay at 0 instances
        write_models(workdir / "models", args.models, gguf)
        env = {
            **os.environ,
            **cluster.env,
            "PYTHONPATH": str(REPO),
            "LLMGW_ENGINES": f"llama.cpp={BIN / 'llama-server'}",
            "LLMGW_MODELS_ROOT": str(workdir),
        }
        started = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "planner.cli.main", "apply", str(workdir / "models")],
            env=env,
            cwd=REPO,
            check=True,
            capture_output=True,
            timeout=1800,
        )
        applied = time.monotonic() - started
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        children.spawn(
            [
                sys.executable,
                "-m",
                "planner.cli.main",
                "serve",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            "planner",
            env=env,
            cwd=REPO,
        )
        wait_for(
            lambda: models_listed(scrape(url)[2]) == args.models,
            600,
            f"/metrics listing {args.models} models",
        )
        listed = time.monotonic() - started
        durations, size = [], 0
        for _ in range(args.scrapes):
            seconds, size, _ = scrape(url)
            durations.append(seconds)
        return {
            "models": args.models,
            "apply_s": round(applied, 1),
            "all_listed_after_start_s": round(listed, 1),
            "scrape_p50_ms": round(percentile(durations, 0.5) * 1000, 1),
            "scrape_p99_ms": round(percentile(durations, 0.99) * 1000, 1),
            "scrape_max_ms": round(max(durations) * 1000, 1),
            "scrape_bytes": size,
            "scrapes": args.scrapes,
        }
    finally:
        down(cluster)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=500)
    parser.add_argument("--scrapes", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    exit_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="llmgw-metrics-bench-") as tmp:
        children = Children(tmp)
        try:
            result = measure(args, Path(tmp), children)
        finally:
            children.close()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:28} {value}")


if __name__ == "__main__":
    main()
