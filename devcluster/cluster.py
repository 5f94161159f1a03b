"""A real single-node Consul + Nomad cluster on 127.0.0.1, for the demo and the tests.

Called by `python -m devcluster up|down|status` (the demo, `make down`) and by
the integration tests' session fixture. Both agents run in dev mode with
their state, logs and pid files under one folder (`root`); Nomad registers
services in this Consul. Two clusters can run side by side when given
different `port_offset`s: the demo uses the standard ports (so `nomad` and
`consul` CLIs work with no settings), the tests add 11000. Every port stays
below Linux's ephemeral range (32768+), where an outgoing connection could
already hold it.

`down` leaves no process behind: it stops every job (so Nomad's executors end
their tasks), stops the agents, then kills anything still running out of the
cluster's folder, as raw_exec tasks outlive a killed Nomad client by design
(the client reattaches to them on restart).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from devcluster.bootstrap import BIN


@dataclass(frozen=True)
class Cluster:
    """Where one dev cluster lives and which ports it uses."""

    root: Path
    port_offset: int = 0

    @property
    def consul_http_port(self) -> int:
        return 8500 + self.port_offset

    @property
    def nomad_http_port(self) -> int:
        return 4646 + self.port_offset

    @property
    def consul_addr(self) -> str:
        return f"http://127.0.0.1:{self.consul_http_port}"

    @property
    def nomad_addr(self) -> str:
        return f"http://127.0.0.1:{self.nomad_http_port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment for CLIs (ours and HashiCorp's) that should talk to this cluster."""
        return {
            "NOMAD_ADDR": self.nomad_addr,
            "CONSUL_HTTP_ADDR": f"127.0.0.1:{self.consul_http_port}",
        }

    def pidfile(self, agent: str) -> Path:
        return self.root / f"{agent}.pid"

    def log(self, agent: str) -> Path:
        return self.root / f"{agent}.log"


def _get_json(url: str, timeout: float = 2.0) -> object:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def _wait(what: str, check: object, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except (OSError, urllib.error.URLError, ValueError) as exc:
            last = str(exc)
        time.sleep(0.25)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else ""
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s ({last}); log {log}:\n{tail}")


def free_offset(candidates: range) -> int:
    """The first port offset whose consul and nomad ports are all free (so two test
    runs, e.g. two checkouts, each get a cluster of their own)."""
    for offset in candidates:
        ports = [p + offset for p in (8300, 8301, 8302, 8500, 8502, 8600, 4646, 4647, 4648)]
        if not any(_port_taken(port) for port in ports):
            return offset
    raise OSError(f"no free port offset in {candidates}")


def _port_taken(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _spawn(cluster: Cluster, agent: str, argv: list[str],
           extra_env: dict[str, str] | None = None) -> None:
    port = cluster.consul_http_port if agent == "consul" else cluster.nomad_http_port
    if _port_taken(port):
        raise OSError(f"{agent}: 127.0.0.1:{port} is already in use, by an agent this "
                      f"cluster ({cluster.root}) did not start; stop it first")
    cluster.root.mkdir(parents=True, exist_ok=True)
    with cluster.log(agent).open("ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, **(extra_env or {})})
    cluster.pidfile(agent).write_text(str(proc.pid))


def _alive(pid: int) -> bool:
    """Running, and not a zombie (an agent this process started and has not reaped)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _running_pid(cluster: Cluster, agent: str) -> int | None:
    try:
        pid = int(cluster.pidfile(agent).read_text())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def _consul_argv(cluster: Cluster) -> list[str]:
    o = cluster.port_offset
    return [
        str(BIN / "consul"), "agent", "-dev", "-node", f"llmgw-dev-{o}",
        "-bind", "127.0.0.1", "-client", "127.0.0.1",
        "-http-port", str(8500 + o), "-dns-port", str(8600 + o),
        "-serf-lan-port", str(8301 + o), "-serf-wan-port", str(8302 + o),
        "-server-port", str(8300 + o), "-grpc-port", str(8502 + o),
    ]


def _nomad_config(cluster: Cluster) -> str:
    o = cluster.port_offset
    # Dynamic ports (where llama-server listens): the demo's cluster gets
    # 20000-24999, others 1000 each from 25000 by offset, all below Linux's
    # ephemeral range (32768+).
    low, size = (20000, 5000) if o == 0 else (25000 + (o // 10 % 5) * 1000, 1000)
    return f"""
data_dir  = "{cluster.root / 'nomad'}"
bind_addr = "127.0.0.1"
name      = "llmgw-dev-{o}"
ports {{
  http = {4646 + o}
  rpc  = {4647 + o}
  serf = {4648 + o}
}}
client {{
  min_dynamic_port = {low}
  max_dynamic_port = {low + size - 1}
  options = {{
    "driver.denylist" = "docker,qemu,java,exec"
  }}
  # Nomad runs artifact downloads in a subprocess with a bare environment and
  # a Landlock sandbox that only reads system paths: pass SSL_CERT_FILE through
  # and let it read that file, so a CA given to the agent (the tests') counts.
  artifact {{
    set_environment_variables    = "SSL_CERT_FILE"
    disable_filesystem_isolation = true
  }}
}}
consul {{
  address = "127.0.0.1:{8500 + o}"
}}
plugin "raw_exec" {{
  config {{
    enabled = true
  }}
}}
"""


def up(cluster: Cluster, timeout: float = 60.0, extra_env: dict[str, str] | None = None) -> None:
    """Start both agents (if not already running) and wait until Nomad has a ready node.

    `extra_env` goes to the Nomad agent (the tests pass SSL_CERT_FILE so its
    downloader trusts their CA). Raises TimeoutError, with the agent's log
    tail, when an agent is not ready in time.
    """
    cluster.root.mkdir(parents=True, exist_ok=True)
    if _running_pid(cluster, "consul") is None:
        _spawn(cluster, "consul", _consul_argv(cluster))
    _wait("consul", lambda: _consul_ready(cluster), timeout, cluster.log("consul"))
    if _running_pid(cluster, "nomad") is None:
        config = cluster.root / "nomad.hcl"
        config.write_text(_nomad_config(cluster))
        _spawn(cluster, "nomad", [str(BIN / "nomad"), "agent", "-dev", "-config", str(config)],
               extra_env)
    _wait("nomad node", lambda: _nomad_ready(cluster), timeout, cluster.log("nomad"))


def _consul_ready(cluster: Cluster) -> bool:
    """A leader, and the agent answering is ours (not another one holding the port)."""
    me = _get_json(f"{cluster.consul_addr}/v1/agent/self")
    if me["Config"]["NodeName"] != f"llmgw-dev-{cluster.port_offset}":  # type: ignore[index]
        raise OSError(f"port {cluster.consul_http_port} is held by another consul agent")
    return bool(_get_json(f"{cluster.consul_addr}/v1/status/leader"))


def _nomad_ready(cluster: Cluster) -> bool:
    me = _get_json(f"{cluster.nomad_addr}/v1/agent/self")
    if me["config"]["NodeName"] != f"llmgw-dev-{cluster.port_offset}":  # type: ignore[index]
        raise OSError(f"port {cluster.nomad_http_port} is held by another nomad agent")
    nodes = _get_json(f"{cluster.nomad_addr}/v1/nodes")
    if not isinstance(nodes, list) or not nodes or nodes[0].get("Status") != "ready":
        return False
    drivers = nodes[0].get("Drivers") or {}
    return bool(drivers.get("raw_exec", {}).get("Healthy"))


def _stop_jobs(cluster: Cluster, timeout: float) -> None:
    """Stop every job and wait for its allocations to stop, so tasks end cleanly."""
    try:
        jobs = _get_json(f"{cluster.nomad_addr}/v1/jobs")
    except (OSError, urllib.error.URLError, ValueError):
        return
    for job in jobs if isinstance(jobs, list) else []:
        request = urllib.request.Request(
            f"{cluster.nomad_addr}/v1/job/{job['ID']}?purge=true", method="DELETE")
        with contextlib.suppress(OSError, urllib.error.URLError):
            urllib.request.urlopen(request, timeout=5).close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            allocs = _get_json(f"{cluster.nomad_addr}/v1/allocations")
        except (OSError, urllib.error.URLError, ValueError):
            return
        if not any(a.get("ClientStatus") in ("running", "pending") for a in allocs):  # type: ignore[union-attr]
            return
        time.sleep(0.25)


def _stop_pid(pid: int, timeout: float) -> None:
    try:
        os.killpg(pid, signal.SIGINT)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid):
        os.killpg(pid, signal.SIGKILL)
    _alive(pid)  # reap it if it is our child


def _leftovers(root: Path) -> list[int]:
    """Processes whose command line or working folder is inside the cluster's folder."""
    found = []
    needle = str(root.resolve())
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if needle in cmdline or cwd.startswith(needle):
            found.append(int(proc.name))
    return found


def down(cluster: Cluster, timeout: float = 30.0) -> None:
    """Stop every job, both agents, and anything left running from the cluster's folder."""
    if _running_pid(cluster, "nomad") is not None:
        _stop_jobs(cluster, timeout)
    for agent in ("nomad", "consul"):
        pid = _running_pid(cluster, agent)
        if pid is not None:
            _stop_pid(pid, timeout)
        cluster.pidfile(agent).unlink(missing_ok=True)
    for pid in _leftovers(cluster.root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def status(cluster: Cluster) -> dict[str, bool]:
    """Which agents of this cluster are running."""
    return {agent: _running_pid(cluster, agent) is not None for agent in ("consul", "nomad")}
