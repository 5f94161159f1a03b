"""How each node of a dev cluster is laid out and configured: the `Cluster` and
`ClientNode` types, the ports, each node's dynamic port range and cgroup parent,
and the argv and config files of its Consul and Nomad agents.

Called by devcluster/cluster.py, which starts and stops the agents with what this
module renders, and re-exports `Cluster` and `ClientNode` (callers import them
from there). Nothing here starts a process or writes a file.

Two clusters can run side by side when given different `port_offset`s: the demo
uses the standard ports (so `nomad` and `consul` CLIs work with no settings), the
tests add 11000 (and step by 10). Every port stays below Linux's ephemeral range
(32768+), where an outgoing connection could already hold it.

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

Fake GPUs: a client node with `gpus=FakeGpus(count, memory_mib, name)` gets the
fake nvidia/gpu device plugin (devcluster/fakegpu, a fake: no GPU exists here)
through `plugin_dir` and a `plugin "fake-nvidia-gpu"` block; other nodes load no
device plugin at all.

What a client agent's config must say that `-dev` did for the dev node: its
advertise addresses, and `network_interface = "lo"` (else its tasks' service
addresses, so Consul's check targets, are the host's external IP).

A TLS cluster (`Cluster(..., tls=TlsFiles(...))`, dev node only) serves both HTTP
APIs over HTTPS only, on the same ports, and both require a client certificate
signed by the CA: Consul with `ports { http = -1, https = ... }`, `ca_file`,
`cert_file`, `key_file` and `verify_incoming_https` (Consul 1.8's top-level TLS
keys); Nomad with `tls { http = true ... verify_https_client = true }`, and its
`consul {}` block talking to that Consul over TLS with the agents' certificate
as its client certificate. Nomad's own services are not advertised in Consul
there: their HTTPS checks carry no client certificate, so they would only ever
be critical.

An ACL cluster (`Cluster(..., acl=AclTokens(...))`, dev node only; off by default)
enforces ACLs in both agents with a default-deny policy, as a production cluster
does: Consul with `acl { enabled, default_policy = "deny", tokens { master, agent } }`
(Consul 1.8's names; `master` is 1.11's `initial_management`), its agent token the
master token so the node registers itself; Nomad with `acl { enabled = true }`,
bootstrapped by `up` with `AclTokens.nomad` as the bootstrap secret (Nomad >= 1.4's
`BootstrapSecret`), and its `consul` block holding Consul's master token, so the
Nomad agent registers the jobs' services (a production agent gets a token of its
own). The two secrets are the clusters' management tokens: the tests create the
planner's and router's policies and tokens with them (acl/).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from devcluster.bootstrap import BIN, FAKE_GPU, PLUGIN_DIR

# Each cluster owns ten ports from each base below (offsets step by 10):
#   dev node   consul 8300-8302, 8500, 8502, 8600; nomad 4646-4648
#   client k   nomad http 4650+k; consul http 8503+k, serf LAN 8303+k  (k = 1..3)
# 4649 and 4650 stay free: 4650 is the demo planner's admin port.
MAX_CLIENTS = 3
DEV_PORTS = (8300, 8301, 8302, 8500, 8502, 8600, 4646, 4647, 4648)
_NODE_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?")


@dataclass(frozen=True)
class FakeGpus:
    """`count` fake nvidia/gpu devices of one model, `name`, each reporting `memory_mib`
    of memory: what the test-only plugin devcluster/fakegpu fingerprints on a node (no
    GPU, no CUDA: placement and the reservation's environment only)."""

    count: int
    memory_mib: int
    name: str = "Fake GPU"

    def __post_init__(self) -> None:
        if self.count < 1 or self.memory_mib < 1:
            raise ValueError(f"fake GPUs: count and memory_mib must be positive, got {self}")


@dataclass(frozen=True)
class ClientNode:
    """An extra Nomad client node: its name (its Nomad and Consul node name), the
    environment its agent gets on top of the cluster's (so every raw_exec task on
    it does), its node meta, and, when set, the memory (MiB) and CPU (MHz) it
    advertises instead of the whole machine's, and the fake GPUs it reports."""

    name: str
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    meta: Mapping[str, str] = field(default_factory=dict, hash=False)
    memory_total_mb: int | None = None
    cpu_total_compute: int | None = None
    gpus: FakeGpus | None = None


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a TLS cluster: the CA that signed every certificate; the agents'
    certificate and key (for 127.0.0.1: they serve HTTPS with it, and Nomad presents it
    to Consul); the client certificate and key the cluster's clients present (the
    readiness checks, and the CLIs through `Cluster.env`)."""

    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path


@dataclass(frozen=True)
class AclTokens:
    """Management secrets of an ACL cluster: Consul's master token and the SecretID
    Nomad's ACL bootstrap gives its management token (a UUID, as Nomad requires)."""

    consul: str = field(repr=False)
    nomad: str = field(repr=False)

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers that carry both (each agent reads only its own)."""
        return {"X-Consul-Token": self.consul, "X-Nomad-Token": self.nomad}


@dataclass(frozen=True)
class Cluster:
    """Where one dev cluster lives, which ports it uses, its extra client nodes, and,
    with `tls`, the files that make both agents serve HTTPS only; with `acl`, the
    management tokens of agents that enforce ACLs (default deny). `event_buffer_size`
    sets the dev server's event buffer (Nomad's `server.event_buffer_size`, default
    100 items): a tiny one makes a slow event reader lose events, for the tests.

    Raises ValueError for more than MAX_CLIENTS clients, a name used twice (or the
    dev node's), a name that is not a lower-case DNS label, or client nodes in a TLS
    or ACL cluster (not rendered yet)."""

    root: Path
    port_offset: int = 0
    clients: tuple[ClientNode, ...] = ()
    tls: TlsFiles | None = None
    acl: AclTokens | None = None
    event_buffer_size: int | None = None

    def __post_init__(self) -> None:
        if (self.tls is not None or self.acl is not None) and self.clients:
            raise ValueError(
                "a TLS or ACL cluster has only its dev node (client nodes "
                "would need TLS or tokens in their own agents' configs)"
            )
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
    def scheme(self) -> str:
        return "http" if self.tls is None else "https"

    @property
    def consul_addr(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.consul_http_port}"

    @property
    def nomad_addr(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.nomad_http_port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment for CLIs (ours and HashiCorp's) that should talk to this cluster:
        with TLS, the CA and client certificate under both CLIs' names (Consul's scheme
        from CONSUL_HTTP_SSL, as its CLI reads it)."""
        env = {
            "NOMAD_ADDR": self.nomad_addr,
            "CONSUL_HTTP_ADDR": f"127.0.0.1:{self.consul_http_port}",
        }
        if self.tls is not None:
            for agent in ("NOMAD", "CONSUL"):
                env[f"{agent}_CACERT"] = str(self.tls.ca)
                env[f"{agent}_CLIENT_CERT"] = str(self.tls.client_cert)
                env[f"{agent}_CLIENT_KEY"] = str(self.tls.client_key)
            env["CONSUL_HTTP_SSL"] = "true"
        return env

    @property
    def management_env(self) -> dict[str, str]:
        """`env` with the management tokens of an ACL cluster (NOMAD_TOKEN,
        CONSUL_HTTP_TOKEN), for the `nomad` and `consul` CLIs of an operator; `env`
        alone for a cluster without ACLs."""
        if self.acl is None:
            return self.env
        return {**self.env, "NOMAD_TOKEN": self.acl.nomad, "CONSUL_HTTP_TOKEN": self.acl.consul}

    def pidfile(self, agent: str) -> Path:
        return self.root / f"{agent}.pid"

    def log(self, agent: str) -> Path:
        return self.root / f"{agent}.log"


def _slot(cluster: Cluster, node: ClientNode) -> int:
    """1 for the first client node, 2 for the second... (0 is the dev node)."""
    return cluster.clients.index(node) + 1


def client_ports(cluster: Cluster, node: ClientNode) -> dict[str, int]:
    k = _slot(cluster, node) + cluster.port_offset
    return {"nomad_http": 4650 + k, "consul_http": 8503 + k, "consul_serf_lan": 8303 + k}


def nomad_data(cluster: Cluster, node: ClientNode) -> Path:
    """A client node's Nomad data_dir; its Consul agent's is `<name>.consul` (names
    have no dots, so neither meets the dev node's `nomad` or another node's)."""
    return cluster.root / f"{node.name}.nomad"


def _dynamic_ports(cluster: Cluster, slot: int) -> tuple[int, int]:
    """The dynamic port range of node `slot`, inclusive. The demo's cluster has
    20000-24999, others 500 each from 25000 by offset (offsets 11000-11130, the
    tests' and the benchmarks', each get their own: with 1000 each, 11000 and 11050
    shared one and their tasks' ports could collide), all below 32768; each node
    gets its own quarter, as a client only avoids ports its own tasks hold."""
    o = cluster.port_offset
    low, size = (20000, 5000) if o == 0 else (25000 + (o // 10 % 14) * 500, 500)
    part = size // (MAX_CLIENTS + 1)
    return low + slot * part, low + (slot + 1) * part - 1


def cgroup_parent(cluster: Cluster, name: str) -> str:
    """Absolute, as cgroups v1 needs (v2 takes it too); unique across clusters."""
    if name == cluster.node_name:
        return f"/{name}.slice"
    return f"/llmgw-{cluster.port_offset}-{name}.slice"


def consul_argv(cluster: Cluster) -> list[str]:
    o = cluster.port_offset
    return [
        str(BIN / "consul"),
        "agent",
        "-dev",
        "-node",
        cluster.node_name,
        "-bind",
        "127.0.0.1",
        "-client",
        "127.0.0.1",
        "-http-port",
        str(8500 + o if cluster.tls is None else -1),
        "-dns-port",
        str(8600 + o),
        "-serf-lan-port",
        str(8301 + o),
        "-serf-wan-port",
        str(8302 + o),
        "-server-port",
        str(8300 + o),
        "-grpc-port",
        str(8502 + o),
        *_consul_tls_argv(cluster),
        *_consul_acl_argv(cluster),
    ]


def _consul_acl_argv(cluster: Cluster) -> list[str]:
    """ACLs enforced, default deny; the master token is also the agent's own."""
    if (acl := cluster.acl) is None:
        return []
    secret = json.dumps(acl.consul)
    return [
        "-hcl",
        f'acl {{ enabled = true  default_policy = "deny"  '
        f"enable_token_persistence = false  "
        f"tokens {{ master = {secret}  agent = {secret} }} }}",
    ]


def _consul_tls_argv(cluster: Cluster) -> list[str]:
    """HTTPS only, on the HTTP port's number, asking every client for a certificate."""
    if (tls := cluster.tls) is None:
        return []
    lines = [
        f"ports {{ https = {cluster.consul_http_port} }}",
        f"ca_file = {_hcl(tls.ca)}",
        f"cert_file = {_hcl(tls.cert)}",
        f"key_file = {_hcl(tls.key)}",
        "verify_incoming_https = true",
    ]
    return [arg for line in lines for arg in ("-hcl", line)]


def _hcl(path: Path) -> str:
    """A path as an HCL string (JSON's quoting is HCL's for these)."""
    return json.dumps(str(path))


def _nomad_tls_blocks(cluster: Cluster) -> tuple[str, str]:
    """(the `tls` block, the lines the `consul` block adds) of a TLS dev node."""
    if (tls := cluster.tls) is None:
        return "", ""
    files = (
        f"ca_file   = {_hcl(tls.ca)}\n  cert_file = {_hcl(tls.cert)}\n  key_file  = {_hcl(tls.key)}"
    )
    return (
        f"tls {{\n  http = true\n  {files}\n  verify_https_client = true\n}}\n",
        f"  ssl            = true\n  verify_ssl     = true\n  auto_advertise = false\n  {files}\n",
    )


def consul_client_argv(cluster: Cluster, node: ClientNode) -> list[str]:
    ports = client_ports(cluster, node)
    # A client agent binds only HTTP and serf LAN (DNS and gRPC off); it joins the
    # dev server's serf LAN, retrying every second rather than Consul's 30 s. It
    # skips the graceful leave on SIGINT (4 s): `down` stops its server too.
    return [
        str(BIN / "consul"),
        "agent",
        "-node",
        node.name,
        "-disable-host-node-id",
        "-data-dir",
        str(cluster.root / f"{node.name}.consul"),
        "-bind",
        "127.0.0.1",
        "-client",
        "127.0.0.1",
        "-http-port",
        str(ports["consul_http"]),
        "-dns-port",
        "-1",
        "-grpc-port",
        "-1",
        "-serf-lan-port",
        str(ports["consul_serf_lan"]),
        "-retry-join",
        f"127.0.0.1:{8301 + cluster.port_offset}",
        "-retry-interval",
        "1s",
        "-hcl",
        "skip_leave_on_interrupt = true",
    ]


def _client_block(cluster: Cluster, name: str, slot: int, own: list[str]) -> str:
    """The `client` block and raw_exec plugin every node has; `own` are a node's
    other client settings, one HCL line each."""
    low, high = _dynamic_ports(cluster, slot)
    lines = "".join(f"  {line}\n" for line in own)
    return f"""client {{
{lines}  cgroup_parent     = "{cgroup_parent(cluster, name)}"
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


def nomad_config(cluster: Cluster) -> str:
    """The dev node's agent config (run with -dev, which makes it server and client)."""
    o = cluster.port_offset
    tls, consul_tls = _nomad_tls_blocks(cluster)
    acl = ""
    if cluster.acl is not None:
        acl = "acl {\n  enabled = true\n}\n"
        consul_tls += f"  token = {json.dumps(cluster.acl.consul)}\n"
    server = (
        ""
        if cluster.event_buffer_size is None
        else f"server {{\n  event_buffer_size = {cluster.event_buffer_size}\n}}\n"
    )
    return f"""
data_dir  = "{cluster.root / "nomad"}"
bind_addr = "127.0.0.1"
name      = "{cluster.node_name}"
ports {{
  http = {4646 + o}
  rpc  = {4647 + o}
  serf = {4648 + o}
}}
{tls}{acl}{server}consul {{
  address = "127.0.0.1:{8500 + o}"
{consul_tls}}}
{_client_block(cluster, cluster.node_name, 0, [])}"""


def nomad_client_config(cluster: Cluster, node: ClientNode) -> str:
    """A client node's agent config: client only, registered with the dev node's server."""
    ports, data = client_ports(cluster, node), nomad_data(cluster, node)
    own = [
        "enabled   = true",
        f'servers   = ["127.0.0.1:{4647 + cluster.port_offset}"]',
        f'state_dir = "{data / "client"}"',
        f'alloc_dir = "{data / "alloc"}"',
        *(
            f"{key} = {value}"
            for key, value in (
                ("memory_total_mb", node.memory_total_mb),
                ("cpu_total_compute", node.cpu_total_compute),
            )
            if value is not None
        ),
        "meta {",
        *(f"  {json.dumps(k)} = {json.dumps(v)}" for k, v in node.meta.items()),
        "}",
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
{_client_block(cluster, node.name, _slot(cluster, node), own)}{_fake_gpu_plugin(node)}"""


def _fake_gpu_plugin(node: ClientNode) -> str:
    """A node with fake GPUs loads the fake plugin (the only one in its plugin_dir)."""
    if (gpus := node.gpus) is None:
        return ""
    return f"""plugin_dir = "{PLUGIN_DIR}"
plugin "{FAKE_GPU.name}" {{
  config {{
    count      = {gpus.count}
    name       = {json.dumps(gpus.name)}
    memory_mib = {gpus.memory_mib}
  }}
}}
"""
