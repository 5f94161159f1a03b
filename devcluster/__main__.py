"""`python -m devcluster up|down|status|demo`: the demo's dev cluster from a shell."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from devcluster import demo
from devcluster.cluster import down, status, up


def _stop(root: Path, name: str) -> None:
    """Stop a background llmgw process the demo started (SIGTERM: it drains, then exits)."""
    pidfile = root / f"{name}.pid"
    with contextlib.suppress(OSError, ValueError):
        pid = int(pidfile.read_text())
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if Path(f"/proc/{pid}").exists():
            os.killpg(pid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m devcluster", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status", "demo"])
    args = parser.parse_args()
    cluster = demo.demo_cluster()
    if args.command == "demo":
        demo.main()
    elif args.command == "up":
        up(cluster)
        print(f"consul {cluster.consul_addr}  nomad {cluster.nomad_addr}  state {cluster.root}")
    elif args.command == "down":
        _stop(cluster.root, "router")
        _stop(cluster.root, "planner")
        down(cluster)
        print("stopped: router, planner, nomad (jobs purged), consul", file=sys.stderr)
    else:
        running = status(cluster)
        print(" ".join(f"{agent}={'up' if ok else 'down'}" for agent, ok in running.items()))
        sys.exit(0 if all(running.values()) else 1)


if __name__ == "__main__":
    main()
