"""A real Consul + Nomad cluster on 127.0.0.1, for the demo and the tests: one dev
node, plus up to three extra Nomad client nodes on the same machine.

Called by `python -m devcluster up|down|status` (the demo, `make down`), by the
integration tests' session fixture, and by tests that need several nodes
(`Cluster(..., clients=(ClientNode("node-b", env=...),))`). The dev node is a
`consul agent -dev` and a `nomad agent -dev` (server + client). Each extra node
is a `nomad agent -config` in client mode, joined to the dev node's Nomad server,
with its own `consul agent` in client mode joined to the dev Consul server. All
state, logs and pid files live under one folder (`root`). Two clusters can run
side by side when given different `port_offset`s: the demo uses the standard
ports (so `nomad` and `consul` CLIs work with no settings), the tests add 11000
(and step by 10). Every port stays below Linux's ephemeral range (32768+), where
an outgoing connection could already hold it.

What several Nomad clients on one host fight over, found by running two
(Nomad 1.6.3, Consul 1.8.7, a cgroups v1 host), and how each node is kept apart:

- Consul: a Nomad client deregisters from its Consul agent every `_nomad-task-`
  service it does not know, once its first minute is over, on each 30 s sync
  (`ServiceClient.sync`, command/agent/consul/service_client.go). Two clients on
  one Consul agent removed each other's task services every 30 s. Hence one
  Consul agent per node, as Nomad expects; a service instance's Consul node is
  its Nomad node's name.
- cgroups: the cpuset manager (client/lib/cgutil) owns its `cgroup_parent`
  (default `/nomad` on v1, `nomad.slice` on v2). On v1 each client rewrites
  `<parent>/shared` and removes the `<parent>/reserved/*` groups it does not
  know every 30 s: a job with `resources { cores = 1 }` on one node had its
  reservation undone by the other every 30 s. On v2 (read in the source, not
  run) each client removes the empty task scopes it does not know, which can
  race another node's task start. Hence `cgroup_parent` per node,
  `/llmgw-dev-<offset>.slice` and `/llmgw-<offset>-<node>.slice`, removed by
  `down`. raw_exec tasks on v1 join only a freezer group, `/nomad/<random
  uuid>` whatever the parent, so those do not collide.
- Node identity: `no_host_uuid = true` (the default, stated) gives each node a
  random ID kept in its own data_dir (`client/client-id`); the host's UUID
  would make two nodes one (from the source).
- Ports: a client-only agent binds just its HTTP port. Each node hands out
  dynamic ports from its own bookkeeping, so each gets a disjoint quarter of
  the cluster's range; static ports would collide across nodes (none used).
- Resources: every node fingerprints the whole machine, so the scheduler counts
  the host's CPU and memory once per node; `memory_total_mb` and
  `cpu_total_compute` set what a client node advertises.
- The environment: raw_exec tasks inherit their client agent's environment, so
  `ClientNode.env` is how a node differs from another for a task.

What a client agent does that `-dev` did for the dev node: it needs its
advertise addresses set and `network_interface = "lo"` (else its tasks' service
addresses, so Consul's check targets, are the host's external IP); it keeps its
allocations when it stops, tmpfs `secrets`/`private` mounts included, to
reattach (`down` unmounts them); and it is marked ready only by its first
heartbeat, staggered by up to 10 s unless a server-list update comes first,
which with a new data_dir it does (so `up` starts client nodes from an empty
one whenever it starts the in-memory server).

Seen in 2 of about 150 test runs, under load: a client Consul agent passed a
check but told the servers 16 s later (and, logs not kept, likely 27 s). Its
anti-entropy skips partial syncs while it waits 15-30 s to retry a full sync
that found it paused (agent/ae/ae.go, a FIXME there); a test that waits for a
passing check allows 60 s.

`down` leaves no process behind: it stops every job (so Nomad's executors end
their tasks), stops the agents, then kills anything still running out of the
cluster's folder, as raw_exec tasks outlive a killed Nomad client by design
(the client reattaches to them on restart); then it unmounts what the client
nodes left mounted and removes every node's cgroup parent.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from devcluster.bootstrap import BIN

# Each cluster owns ten ports from each base below (offsets step by 10):
#   dev node   consul 8300-8302, 8500, 8502, 8600; nomad 4646-4648
#   client k   nomad http 4650+k; consul http 8503+k, serf LAN 8303+k  (k = 1..3)
# 4649 and 4650 stay free: 4650 is the demo planner's admin port.
MAX_CLIENTS = 3
_DEV_PORTS = (8300, 8301, 8302, 8500, 8502, 8600, 4646, 4647, 4648)
_NODE_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?")
_CGROUP_ROOTS = (Path("/sys/fs/cgroup/cpuset"), Path("/sys/fs/cgroup"))  # v1 cpuset, v2


@dataclass(frozen=True)
class ClientNode:
    """An extra Nomad client node: its name (its Nomad and Consul node name), the
    environment its agent gets on top of the cluster's (so every raw_exec task on
    it does), its node meta, and, when set, the memory (MiB) and CPU (MHz) it
    advertises instead of the whole machine's."""

    name: str
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    meta: Mapping[str, str] = field(default_factory=dict, hash=False)
    memory_total_mb: int | None = None
    cpu_total_compute: int | None = None


@dataclass(frozen=True)
class Cluster:
    """Where one dev cluster lives, which ports it uses, and its extra client nodes.

    Raises ValueError for more than MAX_CLIENTS clients, a name used twice (or the
    dev node's), or a name that is not a lower-case DNS label."""

    root: Path
    port_offset: int = 0
    clients: tuple[ClientNode, ...] = ()

    def __post_init__(self) -> None:
        names = [node.name for node in self.clients]
        if len(names) > MAX_CLIENTS:
            raise ValueError(f"at most {MAX_CLIENTS} client nodes, got {len(names)}")
        if len({*names, self.node_name}) != len(names) + 1:
            raise ValueError(f"node names must differ from each other and {self.node_name}")
        if bad := [name for name in names if not _NODE_NAME.fullmatch(name)]:
            raise ValueError(f"node names must be lower-case DNS labels: {bad}")

    @property
    def node_name(self) -> str:
        """The dev node's name, in Nomad and in Consul."""
        return f"llmgw-dev-{self.port_offset}"

    @property
    def node_names(self) -> tuple[str, ...]:
        """Every node's name, the dev node's first."""
        return (self.node_name, *(node.name for node in self.clients))

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


def _slot(cluster: Cluster, node: ClientNode) -> int:
    """1 for the first client node, 2 for the second... (0 is the dev node)."""
    return cluster.clients.index(node) + 1


def _client_ports(cluster: Cluster, node: ClientNode) -> dict[str, int]:
    k = _slot(cluster, node) + cluster.port_offset
    return {"nomad_http": 4650 + k, "consul_http": 8503 + k, "consul_serf_lan": 8303 + k}


def _nomad_data(cluster: Cluster, node: ClientNode) -> Path:
    """A client node's Nomad data_dir; its Consul agent's is `<name>.consul` (names
    have no dots, so neither meets the dev node's `nomad` or another node's)."""
    return cluster.root / f"{node.name}.nomad"


def _dynamic_ports(cluster: Cluster, slot: int) -> tuple[int, int]:
    """The dynamic port range of node `slot`, inclusive. The demo's cluster has
    20000-24999, others 1000 each from 25000 by offset, all below 32768; each
    node gets its own quarter, as a client only avoids ports its own tasks hold."""
    o = cluster.port_offset
    low, size = (20000, 5000) if o == 0 else (25000 + (o // 10 % 5) * 1000, 1000)
    part = size // (MAX_CLIENTS + 1)
    return low + slot * part, low + (slot + 1) * part - 1


def _cgroup_parent(cluster: Cluster, name: str) -> str:
    """Absolute, as cgroups v1 needs (v2 takes it too); unique across clusters."""
    if name == cluster.node_name:
        return f"/{name}.slice"
    return f"/llmgw-{cluster.port_offset}-{name}.slice"


def _get_json(url: str, timeout: float = 2.0) -> object:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def _wait(what: str, check: Callable[[], bool], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (OSError, urllib.error.URLError, ValueError) as exc:
            last = str(exc)
        time.sleep(0.25)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else ""
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s ({last}); log {log}:\n{tail}")


def free_offset(candidates: range) -> int:
    """The first port offset whose ports (the dev node's and every client slot's) are
    all free, so two test runs, e.g. two checkouts, each get a cluster of their own."""
    slots = range(1, MAX_CLIENTS + 1)
    ports = [*_DEV_PORTS, *(base + k for k in slots for base in (4650, 8503, 8303))]
    for offset in candidates:
        if not any(_port_taken(port + offset) for port in ports):
            return offset
    raise OSError(f"no free port offset in {candidates}")


def _port_taken(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


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


def _start(cluster: Cluster, agent: str, argv: list[str], port: int,
           env: Mapping[str, str] | None = None, config: tuple[Path, str] | None = None) -> None:
    """Start `agent` (after writing its config file) unless it is already running."""
    if _running_pid(cluster, agent) is not None:
        return
    if _port_taken(port):
        raise OSError(f"{agent}: 127.0.0.1:{port} is already in use, by an agent this "
                      f"cluster ({cluster.root}) did not start; stop it first")
    if config is not None:
        config[0].parent.mkdir(parents=True, exist_ok=True)
        config[0].write_text(config[1])
    with cluster.log(agent).open("ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, **(env or {})})
    cluster.pidfile(agent).write_text(str(proc.pid))


def _consul_argv(cluster: Cluster) -> list[str]:
    o = cluster.port_offset
    return [
        str(BIN / "consul"), "agent", "-dev", "-node", cluster.node_name,
        "-bind", "127.0.0.1", "-client", "127.0.0.1",
        "-http-port", str(8500 + o), "-dns-port", str(8600 + o),
        "-serf-lan-port", str(8301 + o), "-serf-wan-port", str(8302 + o),
        "-server-port", str(8300 + o), "-grpc-port", str(8502 + o),
    ]


def _consul_client_argv(cluster: Cluster, node: ClientNode) -> list[str]:
    ports = _client_ports(cluster, node)
    # A client agent binds only HTTP and serf LAN (DNS and gRPC off); it joins the
    # dev server's serf LAN, retrying every second rather than Consul's 30 s. It
    # skips the graceful leave on SIGINT (4 s): `down` stops its server too.
    return [
        str(BIN / "consul"), "agent", "-node", node.name, "-disable-host-node-id",
        "-data-dir", str(cluster.root / f"{node.name}.consul"),
        "-bind", "127.0.0.1", "-client", "127.0.0.1",
        "-http-port", str(ports["consul_http"]), "-dns-port", "-1", "-grpc-port", "-1",
        "-serf-lan-port", str(ports["consul_serf_lan"]),
        "-retry-join", f"127.0.0.1:{8301 + cluster.port_offset}", "-retry-interval", "1s",
        "-hcl", "skip_leave_on_interrupt = true",
    ]


def _client_block(cluster: Cluster, name: str, slot: int, own: list[str]) -> str:
    """The `client` block and raw_exec plugin every node has; `own` are a node's
    other client settings, one HCL line each."""
    low, high = _dynamic_ports(cluster, slot)
    lines = "".join(f"  {line}\n" for line in own)
    return f"""client {{
{lines}  cgroup_parent     = "{_cgroup_parent(cluster, name)}"
  no_host_uuid      = true
  network_interface = "lo"  # task addresses, so Consul check targets, on loopback
  min_dynamic_port  = {low}
  max_dynamic_port  = {high}
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
plugin "raw_exec" {{
  config {{
    enabled = true
  }}
}}
"""


def _nomad_config(cluster: Cluster) -> str:
    """The dev node's agent config (run with -dev, which makes it server and client)."""
    o = cluster.port_offset
    return f"""
data_dir  = "{cluster.root / 'nomad'}"
bind_addr = "127.0.0.1"
name      = "{cluster.node_name}"
ports {{
  http = {4646 + o}
  rpc  = {4647 + o}
  serf = {4648 + o}
}}
consul {{
  address = "127.0.0.1:{8500 + o}"
}}
{_client_block(cluster, cluster.node_name, 0, [])}"""


def _nomad_client_config(cluster: Cluster, node: ClientNode) -> str:
    """A client node's agent config: client only, registered with the dev node's server."""
    ports, data = _client_ports(cluster, node), _nomad_data(cluster, node)
    own = [
        "enabled   = true",
        f'servers   = ["127.0.0.1:{4647 + cluster.port_offset}"]',
        f'state_dir = "{data / "client"}"',
        f'alloc_dir = "{data / "alloc"}"',
        *(f"{key} = {value}" for key, value in (("memory_total_mb", node.memory_total_mb),
                                                 ("cpu_total_compute", node.cpu_total_compute))
          if value is not None),
        "meta {", *(f"  {json.dumps(k)} = {json.dumps(v)}" for k, v in node.meta.items()), "}",
    ]
    # Outside -dev mode an agent bound to loopback will not guess its advertise
    # addresses; a client binds only HTTP, so rpc and serf stay at their defaults.
    return f"""
data_dir             = "{data}"
bind_addr            = "127.0.0.1"
name                 = "{node.name}"
disable_update_check = true
advertise {{
  http = "127.0.0.1"
  rpc  = "127.0.0.1"
  serf = "127.0.0.1"
}}
ports {{
  http = {ports["nomad_http"]}
}}
consul {{
  address = "127.0.0.1:{ports["consul_http"]}"
}}
{_client_block(cluster, node.name, _slot(cluster, node), own)}"""


def up(cluster: Cluster, timeout: float = 60.0, extra_env: dict[str, str] | None = None) -> None:
    """Start every agent not already running, and wait until each Nomad node is ready
    with raw_exec healthy.

    `extra_env` goes to every Nomad agent (the tests pass SSL_CERT_FILE so the
    downloader trusts their CA); a client node's own `env` goes on top. Raises
    TimeoutError, with the agent's log tail, when an agent is not ready in time,
    and OSError when one of the cluster's ports is held by another agent.
    """
    env = extra_env or {}
    cluster.root.mkdir(parents=True, exist_ok=True)
    fresh = _running_pid(cluster, "nomad") is None
    _start(cluster, "consul", _consul_argv(cluster), cluster.consul_http_port)
    _wait("consul", lambda: _has_leader(cluster.consul_addr, cluster.node_name), timeout,
          cluster.log("consul"))
    config = cluster.root / "nomad.hcl"
    _start(cluster, "nomad", [str(BIN / "nomad"), "agent", "-dev", "-config", str(config)],
           cluster.nomad_http_port, env, (config, _nomad_config(cluster)))
    for node in cluster.clients:
        _start(cluster, f"consul-{node.name}", _consul_client_argv(cluster, node),
               _client_ports(cluster, node)["consul_http"])
    # Client nodes start once the server has a leader: a Nomad client that finds
    # no server waits 15 s before it tries to register again.
    _wait("nomad server", lambda: _has_leader(cluster.nomad_addr, cluster.node_name), timeout,
          cluster.log("nomad"))
    for node in cluster.clients:
        _start_nomad_client(cluster, node, env, timeout, fresh)
    _wait("nomad node", lambda: _node_ready(cluster, cluster.node_name), timeout,
          cluster.log("nomad"))
    for node in cluster.clients:
        _wait(f"nomad node {node.name}", lambda node=node: _client_node_ready(cluster, node),
              timeout, cluster.log(f"nomad-{node.name}"))


def _start_nomad_client(cluster: Cluster, node: ClientNode, env: Mapping[str, str],
                        timeout: float, fresh: bool) -> None:
    """Start a client node's Nomad agent once its Consul agent has joined; with a
    `fresh` (in-memory, so empty) server, from an empty data_dir: the node's old
    state describes a cluster that is gone, and delays its readiness by 5-12 s."""
    ports = _client_ports(cluster, node)
    if fresh and _running_pid(cluster, f"nomad-{node.name}") is None:
        _unmount(_nomad_data(cluster, node))
        shutil.rmtree(_nomad_data(cluster, node), ignore_errors=True)
    _wait(f"consul agent {node.name}",
          lambda: _has_leader(f"http://127.0.0.1:{ports['consul_http']}", node.name), timeout,
          cluster.log(f"consul-{node.name}"))
    config = cluster.root / f"nomad-{node.name}.hcl"
    _start(cluster, f"nomad-{node.name}", [str(BIN / "nomad"), "agent", "-config", str(config)],
           ports["nomad_http"], {**env, **node.env}, (config, _nomad_client_config(cluster, node)))


def _check_ours(addr: str, name: str) -> None:
    """Raise OSError unless the agent answering at `addr` (Consul or Nomad) is node
    `name`, i.e. ours and not another one holding the port."""
    me = _get_json(f"{addr}/v1/agent/self")
    config = me.get("Config") or me.get("config")  # type: ignore[union-attr]
    if config["NodeName"] != name:
        raise OSError(f"{addr} is held by another agent, {config['NodeName']}")


def _has_leader(addr: str, name: str) -> bool:
    """Ours, and it knows a leader (a Consul client agent only once it has joined)."""
    _check_ours(addr, name)
    return bool(_get_json(f"{addr}/v1/status/leader"))


def _client_node_ready(cluster: Cluster, node: ClientNode) -> bool:
    _check_ours(f"http://127.0.0.1:{_client_ports(cluster, node)['nomad_http']}", node.name)
    return _node_ready(cluster, node.name)


def _node_ready(cluster: Cluster, name: str) -> bool:
    """The server lists a node of that name as ready, with raw_exec healthy."""
    nodes = _get_json(f"{cluster.nomad_addr}/v1/nodes")
    for node in nodes if isinstance(nodes, list) else []:
        drivers = node.get("Drivers") or {}
        if (node.get("Name") == name and node.get("Status") == "ready"
                and drivers.get("raw_exec", {}).get("Healthy")):
            return True
    return False


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


def _stop_agents(cluster: Cluster, agents: list[str], timeout: float) -> None:
    """SIGINT to each agent's process group at once, SIGKILL to those left after `timeout`."""
    pids = [pid for agent in agents if (pid := _running_pid(cluster, agent)) is not None]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGINT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        _alive(pid)  # reap it if it is our child
    for agent in agents:
        cluster.pidfile(agent).unlink(missing_ok=True)


def leftovers(root: Path) -> list[int]:
    """Processes whose command line or working folder is inside `root` (agents, Nomad
    executors, tasks): what `down` kills, and what must be none after it."""
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


def _client_names(cluster: Cluster) -> list[str]:
    """Declared client nodes, and any whose agent a pid file shows (started from a
    `Cluster` value that declared more clients than this one)."""
    started = [p.name[len("nomad-"):-len(".pid")] for p in cluster.root.glob("nomad-*.pid")]
    return sorted({*(node.name for node in cluster.clients), *started})


def _remove_cgroups(cluster: Cluster, names: list[str]) -> None:
    """Remove the nodes' (empty) cgroup parents, deepest first; Nomad leaves them."""
    for name in names:
        for root in _CGROUP_ROOTS:
            top = root / _cgroup_parent(cluster, name).lstrip("/")
            for folder, _, _ in os.walk(top, topdown=False):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)


def _unmount(root: Path) -> None:
    """Unmount what Nomad mounted inside `root`, deepest first: the tmpfs `secrets` and
    `private` folders of each task. A -dev agent destroys its allocations when it
    stops; a client agent keeps them, to reattach to its tasks when it restarts."""
    needle = str(root.resolve()) + "/"
    with open("/proc/self/mountinfo") as mounts:
        points = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4])
                  for line in mounts]
    for point in sorted((p for p in points if p.startswith(needle)), key=len, reverse=True):
        subprocess.run(["umount", point], check=False, capture_output=True)


def down(cluster: Cluster, timeout: float = 30.0) -> None:
    """Stop every job, every agent, and anything left running from the cluster's folder."""
    if _running_pid(cluster, "nomad") is not None:
        _stop_jobs(cluster, timeout)
    clients = _client_names(cluster)
    # Nomad agents first: on the way out they deregister from their Consul agent.
    _stop_agents(cluster, [*(f"nomad-{name}" for name in clients), "nomad"], timeout)
    _stop_agents(cluster, [*(f"consul-{name}" for name in clients), "consul"], timeout)
    for pid in leftovers(cluster.root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _unmount(cluster.root)
    _remove_cgroups(cluster, [cluster.node_name, *clients])


def status(cluster: Cluster) -> dict[str, bool]:
    """Which agents of this cluster are running: `consul`, `nomad`, and
    `consul-<node>`, `nomad-<node>` for each client node."""
    agents = ["consul", "nomad", *(f"{kind}-{node.name}" for node in cluster.clients
                                   for kind in ("consul", "nomad"))]
    return {agent: _running_pid(cluster, agent) is not None for agent in agents}
