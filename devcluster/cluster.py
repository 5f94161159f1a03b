"""A real Consul + Nomad cluster on 127.0.0.1, for the demo and the tests: one dev
node, plus up to three extra Nomad client nodes on the same machine. This module
starts the agents, waits for them, reports and stops them.

Called by `python -m devcluster up|down|status` (the demo, `make down`), by the
integration tests' session fixture, and by tests that need several nodes
(`Cluster(..., clients=(ClientNode("node-b", env=...),))`). The dev node is a
`consul agent -dev` and a `nomad agent -dev` (server + client). Each extra node
is a `nomad agent -config` in client mode, joined to the dev node's Nomad server,
with its own `consul agent` in client mode joined to the dev Consul server. All
state, logs and pid files live under one folder (`root`). The port layout, and
how each node is configured and kept apart from the others, is
devcluster/nodes.py; `Cluster`, `ClientNode`, `FakeGpus`, `AclTokens` and `TlsFiles`
live there and are re-exported here. A client node given `gpus=FakeGpus(...)` reports
fake nvidia/gpu devices through the test-only device plugin devcluster/fakegpu (built
by the bootstrap); `up` waits until the server lists them. With `tls`, every call
this module makes to the agents (the readiness checks, `down`'s job stops) is HTTPS
with the cluster's client certificate (`client_context`). With `acl`, `up` bootstraps
Nomad's ACLs with the cluster's own secret, and every call carries the management
tokens (`_headers`).

What a client agent does that `-dev` did for the dev node: it keeps its
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
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

from devcluster.bootstrap import BIN, FAKE_GPU
from devcluster.nodes import (
    DEV_PORTS,
    MAX_CLIENTS,
    AclTokens,
    ClientNode,
    Cluster,
    FakeGpus,
    TlsFiles,
    cgroup_parent,
    client_ports,
    consul_argv,
    consul_client_argv,
    nomad_client_config,
    nomad_config,
    nomad_data,
)

__all__ = [
    "MAX_CLIENTS",
    "AclTokens",
    "ClientNode",
    "Cluster",
    "FakeGpus",
    "TlsFiles",
    "client_context",
    "down",
    "free_offset",
    "leftovers",
    "status",
    "up",
]

_CGROUP_ROOTS = (Path("/sys/fs/cgroup/cpuset"), Path("/sys/fs/cgroup"))  # v1 cpuset, v2


def client_context(cluster: Cluster) -> ssl.SSLContext | None:
    """What a client of a TLS cluster needs: its CA, and the client certificate the
    agents ask for; None for a plain HTTP cluster."""
    if cluster.tls is None:
        return None
    context = ssl.create_default_context(cafile=cluster.tls.ca)
    context.load_cert_chain(cluster.tls.client_cert, cluster.tls.client_key)
    return context


def _headers(cluster: Cluster) -> dict[str, str]:
    """The management tokens of an ACL cluster (none otherwise)."""
    return cluster.acl.headers if cluster.acl is not None else {}


def _get_json(
    url: str,
    timeout: float = 2.0,
    context: ssl.SSLContext | None = None,
    headers: Mapping[str, str] | None = None,
) -> object:
    request = urllib.request.Request(url, headers=dict(headers or {}))
    with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
        return json.load(response)


def _bootstrap_nomad_acl(cluster: Cluster, acl: AclTokens) -> bool:
    """Bootstrap Nomad's ACLs with `acl.nomad` as the management token's secret; True
    once done (now, or before: our secret then works). Nomad answers 500 until it
    has a leader."""
    context = client_context(cluster)
    request = urllib.request.Request(
        f"{cluster.nomad_addr}/v1/acl/bootstrap",
        method="POST",
        data=json.dumps({"BootstrapSecret": acl.nomad}).encode(),
    )
    try:
        urllib.request.urlopen(request, timeout=5, context=context).close()
        return True
    except urllib.error.HTTPError as exc:
        if exc.code != 400:  # 400: bootstrap already done
            raise OSError(f"ACL bootstrap: HTTP {exc.code}: {exc.read().decode()}") from None
    _get_json(f"{cluster.nomad_addr}/v1/acl/token/self", context=context, headers=_headers(cluster))
    return True


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
    ports = [*DEV_PORTS, *(base + k for k in slots for base in (4650, 8503, 8303))]
    for offset in candidates:
        if not any(_port_taken(port + offset) for port in ports):
            return offset
    raise OSError(f"no free port offset in {candidates}")


def _port_taken(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def alive(pid: int) -> bool:
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
    return pid if alive(pid) else None


def _start(
    cluster: Cluster,
    agent: str,
    argv: list[str],
    port: int,
    env: Mapping[str, str] | None = None,
    config: tuple[Path, str] | None = None,
) -> None:
    """Start `agent` (after writing its config file) unless it is already running."""
    if _running_pid(cluster, agent) is not None:
        return
    if _port_taken(port):
        raise OSError(
            f"{agent}: 127.0.0.1:{port} is already in use, by an agent this "
            f"cluster ({cluster.root}) did not start; stop it first"
        )
    if config is not None:
        config[0].parent.mkdir(parents=True, exist_ok=True)
        config[0].write_text(config[1])
    with cluster.log(agent).open("ab") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    cluster.pidfile(agent).write_text(str(proc.pid))


def up(cluster: Cluster, timeout: float = 60.0, extra_env: dict[str, str] | None = None) -> None:
    """Start every agent not already running, and wait until each Nomad node is ready
    with raw_exec healthy.

    `extra_env` goes to every Nomad agent (the tests pass SSL_CERT_FILE so the
    downloader trusts their CA); a client node's own `env` goes on top. Raises
    TimeoutError, with the agent's log tail, when an agent is not ready in time,
    and OSError when one of the cluster's ports is held by another agent.
    """
    env = extra_env or {}
    context = client_context(cluster)
    cluster.root.mkdir(parents=True, exist_ok=True)
    fresh = _running_pid(cluster, "nomad") is None
    headers = _headers(cluster)
    _start(cluster, "consul", consul_argv(cluster), cluster.consul_http_port)
    _wait(
        "consul",
        lambda: _has_leader(cluster.consul_addr, cluster.node_name, context, headers),
        timeout,
        cluster.log("consul"),
    )
    config = cluster.root / "nomad.hcl"
    _start(
        cluster,
        "nomad",
        [str(BIN / "nomad"), "agent", "-dev", "-config", str(config)],
        cluster.nomad_http_port,
        env,
        (config, nomad_config(cluster)),
    )
    for node in cluster.clients:
        _start(
            cluster,
            f"consul-{node.name}",
            consul_client_argv(cluster, node),
            client_ports(cluster, node)["consul_http"],
        )
    if (acl := cluster.acl) is not None:
        _wait(
            "nomad ACL bootstrap",
            lambda: _bootstrap_nomad_acl(cluster, acl),
            timeout,
            cluster.log("nomad"),
        )
    # Client nodes start once the server has a leader: a Nomad client that finds
    # no server waits 15 s before it tries to register again.
    _wait(
        "nomad server",
        lambda: _has_leader(cluster.nomad_addr, cluster.node_name, context, headers),
        timeout,
        cluster.log("nomad"),
    )
    for node in cluster.clients:
        _start_nomad_client(cluster, node, env, timeout, fresh)
    _wait(
        "nomad node", lambda: _node_ready(cluster, cluster.node_name), timeout, cluster.log("nomad")
    )
    for node in cluster.clients:
        _wait(
            f"nomad node {node.name}",
            lambda node=node: _client_node_ready(cluster, node),
            timeout,
            cluster.log(f"nomad-{node.name}"),
        )


def _start_nomad_client(
    cluster: Cluster, node: ClientNode, env: Mapping[str, str], timeout: float, fresh: bool
) -> None:
    """Start a client node's Nomad agent once its Consul agent has joined; with a
    `fresh` (in-memory, so empty) server, from an empty data_dir: the node's old
    state describes a cluster that is gone, and delays its readiness by 5-12 s."""
    ports = client_ports(cluster, node)
    if node.gpus is not None and not FAKE_GPU.exists():
        raise FileNotFoundError(
            f"node {node.name} has fake GPUs, but {FAKE_GPU} is missing: "
            "run `python3 -m devcluster.bootstrap` first"
        )
    if fresh and _running_pid(cluster, f"nomad-{node.name}") is None:
        _unmount(nomad_data(cluster, node))
        shutil.rmtree(nomad_data(cluster, node), ignore_errors=True)
    _wait(
        f"consul agent {node.name}",
        lambda: _has_leader(f"http://127.0.0.1:{ports['consul_http']}", node.name),
        timeout,
        cluster.log(f"consul-{node.name}"),
    )
    config = cluster.root / f"nomad-{node.name}.hcl"
    _start(
        cluster,
        f"nomad-{node.name}",
        [str(BIN / "nomad"), "agent", "-config", str(config)],
        ports["nomad_http"],
        {**env, **node.env},
        (config, nomad_client_config(cluster, node)),
    )


def _check_ours(
    addr: str,
    name: str,
    context: ssl.SSLContext | None = None,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Raise OSError unless the agent answering at `addr` (Consul or Nomad) is node
    `name`, i.e. ours and not another one holding the port."""
    me = _get_json(f"{addr}/v1/agent/self", context=context, headers=headers)
    config = me.get("Config") or me.get("config")  # type: ignore[union-attr]
    if config["NodeName"] != name:
        raise OSError(f"{addr} is held by another agent, {config['NodeName']}")


def _has_leader(
    addr: str,
    name: str,
    context: ssl.SSLContext | None = None,
    headers: Mapping[str, str] | None = None,
) -> bool:
    """Ours, and it knows a leader (a Consul client agent only once it has joined)."""
    _check_ours(addr, name, context, headers)
    return bool(_get_json(f"{addr}/v1/status/leader", context=context))


def _client_node_ready(cluster: Cluster, node: ClientNode) -> bool:
    """Ready, and with fake GPUs, the server lists them: a device plugin's fingerprint
    reaches the server after the node is ready (a GPU job placed before that is
    unplaceable)."""
    _check_ours(f"http://127.0.0.1:{client_ports(cluster, node)['nomad_http']}", node.name)
    return _node_ready(cluster, node.name) and (node.gpus is None or _gpus_listed(cluster, node))


def _gpus_listed(cluster: Cluster, node: ClientNode) -> bool:
    nodes = _get_json(
        f"{cluster.nomad_addr}/v1/nodes?resources=true", context=client_context(cluster)
    )
    for stub in nodes if isinstance(nodes, list) else []:
        if stub.get("Name") != node.name:
            continue
        devices = (stub.get("NodeResources") or {}).get("Devices") or []
        return any(
            d.get("Vendor") == "nvidia"
            and d.get("Type") == "gpu"
            and len(d.get("Instances") or []) == node.gpus.count
            for d in devices
        )
    return False


def _node_ready(cluster: Cluster, name: str) -> bool:
    """The server lists a node of that name as ready, with raw_exec healthy."""
    nodes = _get_json(
        f"{cluster.nomad_addr}/v1/nodes", context=client_context(cluster), headers=_headers(cluster)
    )
    for node in nodes if isinstance(nodes, list) else []:
        drivers = node.get("Drivers") or {}
        if (
            node.get("Name") == name
            and node.get("Status") == "ready"
            and drivers.get("raw_exec", {}).get("Healthy")
        ):
            return True
    return False


def _stop_jobs(cluster: Cluster, timeout: float) -> None:
    """Stop every job and wait for its allocations to stop, so tasks end cleanly; without
    their shutdown_delay (a model replica's drain: 30 s by default), which a cluster
    going down has no router to drain from."""
    try:
        context, headers = client_context(cluster), _headers(cluster)
        jobs = _get_json(f"{cluster.nomad_addr}/v1/jobs", context=context, headers=headers)
    except (OSError, urllib.error.URLError, ValueError):
        return
    for job in jobs if isinstance(jobs, list) else []:
        request = urllib.request.Request(
            f"{cluster.nomad_addr}/v1/job/{job['ID']}?purge=true&no_shutdown_delay=true",
            method="DELETE",
            headers=headers,
        )
        with contextlib.suppress(OSError, urllib.error.URLError):
            urllib.request.urlopen(request, timeout=5, context=context).close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            allocs = _get_json(
                f"{cluster.nomad_addr}/v1/allocations", context=context, headers=headers
            )
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
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        alive(pid)  # reap it if it is our child
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
    started = [p.name[len("nomad-") : -len(".pid")] for p in cluster.root.glob("nomad-*.pid")]
    return sorted({*(node.name for node in cluster.clients), *started})


def _remove_cgroups(cluster: Cluster, names: list[str]) -> None:
    """Remove the nodes' (empty) cgroup parents, deepest first; Nomad leaves them."""
    for name in names:
        for root in _CGROUP_ROOTS:
            top = root / cgroup_parent(cluster, name).lstrip("/")
            for folder, _, _ in os.walk(top, topdown=False):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)


def _unmount(root: Path) -> None:
    """Unmount what Nomad mounted inside `root`, deepest first: the tmpfs `secrets` and
    `private` folders of each task. A -dev agent destroys its allocations when it
    stops; a client agent keeps them, to reattach to its tasks when it restarts."""
    needle = str(root.resolve()) + "/"
    with open("/proc/self/mountinfo") as mounts:
        points = [
            re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4]) for line in mounts
        ]
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


def restart_consul(cluster: Cluster, timeout: float = 30.0) -> float:
    """Stop the dev Consul agent and start it again on the same ports: a dev agent keeps
    nothing, so its catalog, KV and sessions are gone (as after a rebuilt Consul or a
    restored snapshot). Returns when it has a leader again: the time.monotonic() of that.
    Raises TimeoutError (with its log's tail) when it does not in `timeout`."""
    _stop_agents(cluster, ["consul"], timeout)
    _start(cluster, "consul", consul_argv(cluster), cluster.consul_http_port)
    _wait(
        "consul",
        lambda: _has_leader(
            cluster.consul_addr, cluster.node_name, client_context(cluster), _headers(cluster)
        ),
        timeout,
        cluster.log("consul"),
    )
    return time.monotonic()


def status(cluster: Cluster) -> dict[str, bool]:
    """Which agents of this cluster are running: `consul`, `nomad`, and
    `consul-<node>`, `nomad-<node>` for each client node."""
    agents = [
        "consul",
        "nomad",
        *(f"{kind}-{node.name}" for node in cluster.clients for kind in ("consul", "nomad")),
    ]
    return {agent: _running_pid(cluster, agent) is not None for agent in agents}
