"""``router serve --workers N``: N router processes behind one port (``SO_REUSEPORT``).

Called by :mod:`router.cli`. One router process runs one event loop on one core;
on a node with cores to spare, N workers serve N times the requests a core
allows (measured in docs/benchmarks.md). The process started with ``--workers
N`` (env ``LLMGW_ROUTER_WORKERS``; N > 1) serves nothing itself: it starts N
copies of its own command line, each marked with :data:`WORKER_ENV` (its
index), and each binds the port with ``SO_REUSEPORT`` (:func:`listen_socket`),
so the kernel spreads new connections over the workers by a hash of the
connection's addresses (nginx's ``reuseport``: no worker wakes for a connection
another takes). A keep-alive connection stays with the worker that accepted it.

What the workers share: the port, nothing else. Each has its own Consul
watches and endpoint table (N times the watch connections to Consul), its own
in-flight counts and admission queue per replica (each admits up to a
replica's slot count by itself, as separate router instances do: N workers
may send a replica N times its slots, the rest waiting in llama-server's own
queue), its own ejections (a dead replica costs each worker its own first
request there), its own prefix ring loads (the ring and the hash are the same
everywhere, so a prefix maps to the same replica until a worker's local load
spills it), its own activation calls and usage reports (the planner takes
them from any number of routers), and its own ``/metrics``: a scrape through
the shared port reads the worker that accepted it. Where exact metrics or one
view of ejections matter, run more router instances (the router job's count)
rather than workers.

Supervision: SIGTERM or SIGINT is passed to every worker, each drains as one
router does, and the command exits 0 when all exited 0. A worker that exits
with 2 (invalid settings) or 3 (ACL denied), or with 1 within
:data:`START_GRACE_S` of its start (could not start: the port, a lifespan
error), stops the others and the command exits with that code; one that dies
later is logged and started again, the others serving meanwhile. Workers run
in a process group of their own and end with the supervisor, even one killed
outright (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from types import FrameType

log = logging.getLogger(__name__)

# Set in a worker's environment: its index (0..N-1). A worker serves, never supervises.
WORKER_ENV = "LLMGW_ROUTER_WORKER"
START_GRACE_S = 5.0
_FATAL = (2, 3)  # invalid settings, ACL denied: every worker would fail alike
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def worker_index() -> int | None:
    """This process's worker index, or ``None`` when it is not a worker."""
    raw = os.environ.get(WORKER_ENV)
    return int(raw) if raw is not None and raw.isdigit() else None


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (and
    ``SO_REUSEADDR``), not listening yet: uvicorn listens once the app has started,
    and the kernel hands connections only to listening sockets of the group, so a
    worker (started again) gets none while it starts; the others take them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class Supervisor:
    """Starts ``workers`` copies of ``command`` and keeps them running (see above)."""

    def __init__(self, command: list[str], workers: int) -> None:
        self.command = command
        self.workers = workers
        self.procs: dict[int, tuple[int, subprocess.Popen[bytes], float]] = {}
        self.stopping = False

    def _start(self, index: int) -> None:
        env = {**os.environ, WORKER_ENV: str(index)}
        # A process group of its own: a terminal's Ctrl-C reaches the supervisor
        # alone, which passes it on once (a second signal would force the worker
        # out without draining); and a supervisor killed outright takes its
        # workers with it (PR_SET_PDEATHSIG), never leaving them on the port.
        proc = subprocess.Popen(self.command, env=env, process_group=0, preexec_fn=_die_with_parent)
        self.procs[proc.pid] = (index, proc, time.monotonic())

    def _signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        for _, proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    def run(self) -> int:
        """Run until every worker ended; the command's exit code."""
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self._signal) for sig in signals}
        try:
            for index in range(self.workers):
                self._start(index)
            log.info("started %d router workers sharing the port", self.workers)
            return self._wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _wait(self) -> int:
        code = 0
        while self.procs:
            pid, status = os.wait()
            if pid not in self.procs:
                continue
            index, proc, started = self.procs.pop(pid)
            exit_code = os.waitstatus_to_exitcode(status)
            proc.returncode = exit_code
            if self.stopping:
                code = code or (0 if exit_code == 0 else 1)
                continue
            early = time.monotonic() - started < START_GRACE_S
            if exit_code in _FATAL or (exit_code == 1 and early):
                log.error("router worker %d exited with %d: stopping the others", index, exit_code)
                self._signal(signal.SIGTERM, None)
                code = exit_code
                continue
            log.error("router worker %d exited with %d: starting another", index, exit_code)
            self._start(index)
        return code


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the supervisor dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def supervise(workers: int) -> int:
    """Run ``workers`` copies of this command line as workers; the exit code."""
    command = [sys.executable, "-m", "router", *sys.argv[1:]]
    return Supervisor(command, workers).run()
