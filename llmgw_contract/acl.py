"""ACL permissions llmgw's processes need from Nomad and Consul, and how a denial is told.

The policies are HCL files in the repository (`acl/nomad/planner.hcl`,
`acl/consul/planner.hcl`, `acl/consul/router.hcl`; the router never calls Nomad,
so it has no Nomad policy). Each `Permission` is one rule of those files, named as
the file writes it, so an operator reads the same words in an error and in the
policy. The planner (`planner.agents.access`) and the router (`router.cli`) check their
permissions before they act, and translate a 403 met later into the same message.

Why a check first, not only the 403s: Consul answers a read its rules do not
allow (a KV prefix listed with `recurse`, `/v1/catalog/services`,
`/v1/health/service/<name>`) with an empty answer, not a refusal (Consul 1.8
`aclFilter`; `X-Consul-Results-Filtered-By-ACLs` exists only from 1.11 on), so a
token without `service_prefix "llmgw-" read` would make every model look as if no
replica passed. Consul's `/v1/internal/acl/authorize` (1.8+, the UI's) answers
for a list of (resource, segment, access) whether the caller's token allows it;
Consul answers it 401 "ACL support disabled" when ACLs are off (everything is
allowed then), and 403 "ACL not found" for a token it does not know.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from llmgw_contract.keys import (
    KV_ROOT,
    PLANNER_SERVICE,
    ROUTER_API_KEYS_KEY,
    ROUTER_LIMITS_PREFIX,
    SERVICE_PREFIX,
)


class Agent(StrEnum):
    NOMAD = "Nomad"
    CONSUL = "Consul"


# The variable each agent's token is read from (the `nomad` and `consul` CLIs' names).
TOKEN_VARIABLE = {Agent.NOMAD: "NOMAD_TOKEN", Agent.CONSUL: "CONSUL_HTTP_TOKEN"}

PLANNER_POLICIES = {Agent.NOMAD: "acl/nomad/planner.hcl", Agent.CONSUL: "acl/consul/planner.hcl"}
ROUTER_POLICIES = {Agent.CONSUL: "acl/consul/router.hcl"}


class TokenStatus(StrEnum):
    """What the agent made of the token a denied call carried."""

    EMPTY = "empty"  # none given: the agent's anonymous token's policy applied
    UNKNOWN = "unknown"  # the agent has no token with this secret (wrong, deleted, expired)
    VALID = "valid"  # a token the agent knows, whose policies lack the permission


@dataclass(frozen=True)
class Permission:
    """One rule of a policy file. `rule` is how the file (or Nomad's capability list)
    names it; for Consul, `resource`, `segment` and `access` are how
    /v1/internal/acl/authorize asks for it."""

    agent: Agent
    rule: str
    resource: str = ""
    segment: str = ""
    access: str = ""

    def authorize_request(self) -> dict[str, str]:
        """This permission as one item of Consul's /v1/internal/acl/authorize body."""
        return {"Resource": self.resource, "Segment": self.segment, "Access": self.access}


CONSUL_KV_READ = Permission(Agent.CONSUL, f'key_prefix "{KV_ROOT}" read', "key", KV_ROOT, "read")
CONSUL_KV_WRITE = Permission(Agent.CONSUL, f'key_prefix "{KV_ROOT}" write', "key", KV_ROOT, "write")
CONSUL_SESSION_WRITE = Permission(Agent.CONSUL, 'session_prefix "" write', "session", "", "write")
# The router reads the leader lock's session to find where its holder registered
# (`llmgw_contract.leadership`); the planner's `session_prefix "" write` includes it.
CONSUL_SESSIONS_READ = Permission(Agent.CONSUL, 'session_prefix "" read', "session", "", "read")
CONSUL_PLANNER_SERVICE_WRITE = Permission(
    Agent.CONSUL, f'service "{PLANNER_SERVICE}" write', "service", PLANNER_SERVICE, "write"
)
CONSUL_SERVICES_READ = Permission(
    Agent.CONSUL, f'service_prefix "{SERVICE_PREFIX}" read', "service", SERVICE_PREFIX, "read"
)
CONSUL_NODES_READ = Permission(Agent.CONSUL, 'node_prefix "" read', "node", "", "read")

CONSUL_API_KEYS_READ = Permission(
    Agent.CONSUL, f'key "{ROUTER_API_KEYS_KEY}" read', "key", ROUTER_API_KEYS_KEY, "read"
)

# What `router serve` reads (acl/consul/router.hcl); the API keys' KV document only
# with LLMGW_API_KEYS_CONSUL.
ROUTER_CONSUL_NEEDS = (
    CONSUL_KV_READ,
    CONSUL_SERVICES_READ,
    CONSUL_NODES_READ,
    CONSUL_SESSIONS_READ,
)
ROUTER_CONSUL_KEYS_NEEDS = (CONSUL_API_KEYS_READ,)
# The per-key limits every router shares (router.sharedlimits): with API keys and
# LLMGW_ROUTER_SHARED_LIMITS on (the default).
CONSUL_LIMITS_WRITE = Permission(
    Agent.CONSUL,
    f'key_prefix "{ROUTER_LIMITS_PREFIX}" write',
    "key",
    ROUTER_LIMITS_PREFIX,
    "write",
)
ROUTER_CONSUL_LIMITS_NEEDS = (CONSUL_LIMITS_WRITE,)


def denial(
    agent: Agent,
    rules: list[str],
    token: TokenStatus,
    policy_file: str,
    action: str = "",
    detail: str = "",
) -> str:
    """The one sentence an operator reads when `agent` denied `rules`, e.g.
    `Nomad denied submit-job on namespace "default" (register job tiny): the token in
    NOMAD_TOKEN lacks it; give the token the policy in acl/nomad/planner.hcl (llmgw's
    repository)`. `action` names the call that was refused (empty for a check
    before acting); `detail` is the agent's own words, for an unknown token."""
    variable = TOKEN_VARIABLE[agent]
    what = ", ".join(rules) + (f" ({action})" if action else "")
    if token is TokenStatus.EMPTY:
        why = (
            f"{variable} is empty, so {agent} applied its anonymous token's policy; "
            f"set {variable} to a token with the policy in {policy_file}"
        )
    elif token is TokenStatus.UNKNOWN:
        why = (
            f"{agent} does not know the token in {variable}"
            + (f" ({detail})" if detail else "")
            + f"; set {variable} to a token with the policy in {policy_file}"
        )
    else:
        why = (
            f"the token in {variable} lacks {'it' if len(rules) == 1 else 'them'}; "
            f"give the token the policy in {policy_file}"
        )
    return f"{agent} denied {what}: {why} (llmgw's repository)"
