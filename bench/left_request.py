"""How soon a replica stops a non-streaming completion whose client left, while the
router reads the replicas' load (issue 21 item 8: within a second).

Two real llama-servers (the bootstrap's cached build and Gemma 3 270M, ``-np 1``,
CPU, 127.0.0.1) behind the router in process, with the other routers' load read
every 0.1 s (:class:`router.replicaload.LoadSampler`, the default). Y streams a
3,000-token story on one replica, so the model is busy and the sampler reads both;
X, the same story without streaming, goes to the other replica and its client
leaves after 2 s. The figure is the time from the leave to llama-server's
``stop: cancel task`` line in X's replica's log (its own clock, from its start), so
nothing polls X's replica but the router. Each round runs with the router's quiet
after a leave (:data:`router.replicaload.QUIET_AFTER_LEAVE_S`) and without it
(set to 0), alternating. Needs ``make demo`` or ``make test`` to have filled
``~/.cache/llmgw`` first.

    .venv/bin/python bench/left_request.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from devcluster.ports import free_port  # noqa: E402
from router import replicaload  # noqa: E402
from router.catalog import ServiceAddress  # noqa: E402
from router.settings import RouterSettings  # noqa: E402
from tests.support.router_harness import asgi_messages, in_process_router  # noqa: E402

CACHE = Path.home() / ".cache/llmgw"
BINARY = CACHE / "bin/llama-server"
GEMMA = CACHE / "models/gemma-3-270m-q4_k_m.gguf"
STORY = {"model": "m", "prompt": "Write a very long story:", "max_tokens": 3000, "ignore_eos": True}
LEAVE_AFTER_S = 2.0
# Y streams this long; X's replica is watched until then.
WATCH_S = 16.0
# llama-server's log time: minutes.seconds.milliseconds.microseconds since its start.
CANCEL = re.compile(rb"^(\d+)\.(\d+)\.(\d+)\.(\d+) W srv +stop: cancel task", re.M)


class Replica:
    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.log = folder / f"llama-server-{self.port}.log"
        command = [str(BINARY), "-m", str(GEMMA), "--host", "127.0.0.1", "--port", str(self.port),
                   "-np", "1", "-c", "4096", "--metrics", "-t", "1"]  # fmt: skip
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            command, stdout=self.log.open("wb"), stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return
            time.sleep(0.25)
        raise SystemExit(f"llama-server on {self.port} not ready in {timeout_s} s: {self.log}")

    def cancelled_at(self) -> float | None:
        """Seconds after its start that it cancelled a task (its log), or None."""
        found = CANCEL.search(self.log.read_bytes())
        if found is None:
            return None
        minutes, seconds, ms, us = (int(g) for g in found.groups())
        return minutes * 60 + seconds + ms / 1e3 + us / 1e6

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()


async def one_round(folder: Path, quiet: bool) -> float | None:
    """Seconds from X's client leaving to its replica cancelling it; None: not within
    the watch."""
    replicaload.QUIET_AFTER_LEAVE_S = 2.0 if quiet else 0.0
    replicas = [Replica(folder), Replica(folder)]
    try:
        for replica in replicas:
            replica.wait_ready()
        async with in_process_router(RouterSettings(activation=False), replicas=2) as app:
            table, proxy = app.state.table, app.state.proxy
            table.set_endpoints("m", [ServiceAddress("127.0.0.1", r.port) for r in replicas])
            sampler = replicaload.LoadSampler(
                lambda: (e.endpoints for e in table.entries()), lambda: proxy.control, 0.1
            )
            sampler.start()
            y = asyncio.ensure_future(
                asgi_messages(app, {**STORY, "stream": True}, leave_after_s=WATCH_S)
            )
            await asyncio.sleep(1.5)
            free = [e.address.port for e in table.get("m").endpoints if e.inflight == 0]
            x_replica = next(r for r in replicas if r.port == free[0])
            await asgi_messages(app, STORY, leave_after_s=LEAVE_AFTER_S)
            left = time.monotonic() - x_replica.started
            await y
            await sampler.close()
        cancelled = x_replica.cancelled_at()
        return None if cancelled is None else cancelled - left
    finally:
        for replica in replicas:
            replica.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not (BINARY.exists() and GEMMA.exists()):
        raise SystemExit(f"needs {BINARY} and {GEMMA}: run `make demo` once")
    folder = Path(f"/tmp/llmgw-left-request-{time.time_ns()}")
    folder.mkdir()
    results: dict[str, list[float | None]] = {"quiet after a leave": [], "no quiet": []}
    for n in range(args.rounds):
        for label, quiet in (("quiet after a leave", True), ("no quiet", False)):
            results[label].append(asyncio.run(one_round(folder, quiet)))
        print(f"round {n + 1}/{args.rounds} done", file=sys.stderr)
    for label, delays in results.items():
        shown = ", ".join(
            f"{d:.2f} s" if d is not None else f"> {WATCH_S - 3.5:.0f} s" for d in delays
        )
        print(f"{label:20} X cancelled after its client left: {shown}")


if __name__ == "__main__":
    main()
