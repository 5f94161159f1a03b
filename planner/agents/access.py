"""The ACL permissions each planner command needs, checked before it acts.

Called by `planner.cli.main` (every command checks first: `apply` validates its
token before it changes anything, as it validates its files) and by the
clients, which name the permission of a call Nomad or Consul denies later.
The rules are those of acl/nomad/planner.hcl and acl/consul/planner.hcl; the
names and the message are `llmgw_contract.acl`'s.

How each is checked without changing anything:

- Consul: one /v1/internal/acl/authorize call answers for every rule
  (`ConsulClient.denied`), exactly as Consul would decide it.
- Nomad has no such endpoint; each capability is asked with a call Nomad
  authorizes before it looks anything up (nomad/job_endpoint.go), on a job ID
  no model can have (`PROBE_JOB`: model names have no underscore), so an
  allowed call answers "job not found" and a denied one 403
  (`NomadClient.denied`): `GET /v1/jobs?prefix=` (list-jobs), `GET /v1/job/:id`
  (read-job), `POST /v1/job/:id/evaluate` (submit-job, which also grants
  parse-job and scale-job), `GET /v1/nodes?prefix=` (node read).
  read-logs cannot be asked without an allocation: the leader checks it on the
  first stderr it reads, and a denial is logged naming it (`NomadClient.task_stderr_tail`).

Nomad's capabilities are namespace capabilities: the lists below name them in
`default`, and the Nomad client, which holds NOMAD_NAMESPACE, asks for them and names
a denied one in its own namespace (`in_namespace`: `submit-job on namespace "llm"`).
"""

from __future__ import annotations

from typing import Protocol

from llmgw_contract.acl import (
    CONSUL_KV_READ,
    CONSUL_KV_WRITE,
    CONSUL_NODES_READ,
    CONSUL_PLANNER_SERVICE_WRITE,
    CONSUL_SERVICES_READ,
    CONSUL_SESSION_WRITE,
    PLANNER_POLICIES,
    Agent,
    Permission,
    TokenStatus,
    denial,
)
from planner.errors import PermissionDenied


class AnswersDenied(Protocol):
    """An agent's client (`NomadClient`, `ConsulClient`): which of `needs` its token
    lacks, with the token's status and the agent's words; None when none (a protocol,
    so this module, which the clients import, imports neither of them)."""

    def denied(
        self, needs: list[Permission]
    ) -> tuple[list[Permission], TokenStatus, str] | None: ...


DEFAULT_NAMESPACE = "default"
PROBE_JOB = "_llmgw-acl-probe"
NAMESPACE_RESOURCE = "namespace"


def capability(name: str, namespace: str = DEFAULT_NAMESPACE) -> Permission:
    """Nomad namespace capability `name` (list-jobs, read-job...) on `namespace`, named as
    a policy grants it: `read-job on namespace "llm"` (acl/nomad/planner.hcl's
    `namespace "<name>" { capabilities = [...] }`)."""
    return Permission(
        Agent.NOMAD, f'{name} on namespace "{namespace}"', NAMESPACE_RESOURCE, namespace, name
    )


def in_namespace(permission: Permission, namespace: str) -> Permission:
    """`permission` as asked in `namespace`: a namespace capability is named in it, any
    other (node read, Consul's) is returned as it is. The per-command lists below name
    the capabilities in the default namespace; the Nomad client (`NomadClient`, which
    holds NOMAD_NAMESPACE) says every one it asks for or is denied through this."""
    if permission.agent is not Agent.NOMAD or permission.resource != NAMESPACE_RESOURCE:
        return permission
    return capability(permission.access, namespace)


NOMAD_LIST_JOBS = capability("list-jobs")
NOMAD_READ_JOB = capability("read-job")
NOMAD_PARSE_JOB = capability("parse-job")
NOMAD_SUBMIT_JOB = capability("submit-job")
NOMAD_SCALE_JOB = capability("scale-job")
NOMAD_READ_LOGS = capability("read-logs")
NOMAD_NODE_READ = Permission(Agent.NOMAD, 'node { policy = "read" }')

# Per command: what it calls (a read-only command needs no write).
APPLY = (NOMAD_LIST_JOBS, NOMAD_READ_JOB, NOMAD_SUBMIT_JOB, CONSUL_KV_WRITE)
# --dry-run plans (submit-job: Nomad's plan is a dry run of a submit) and writes nothing.
APPLY_DRY_RUN = (NOMAD_LIST_JOBS, NOMAD_READ_JOB, NOMAD_SUBMIT_JOB, CONSUL_KV_READ)
# `planner status --nodes` and `planner engines apply`: the install jobs (sysbatch, one
# per engine), the nodes' metadata they record (planner/daemon/engine_install.py) and
# the engines' records in Consul KV (planner/daemon/engine_records.py).
ENGINES_STATUS = (NOMAD_LIST_JOBS, NOMAD_READ_JOB, NOMAD_NODE_READ, CONSUL_KV_READ)
ENGINES_APPLY = (
    NOMAD_LIST_JOBS,
    NOMAD_READ_JOB,
    NOMAD_SUBMIT_JOB,
    NOMAD_NODE_READ,
    CONSUL_KV_WRITE,
)
STATUS = (NOMAD_READ_JOB, CONSUL_KV_READ, CONSUL_SERVICES_READ, CONSUL_NODES_READ)
# A retry observes the model as the leader does (`planner.daemon.observe`: Nomad's
# index is a job list's, the placement answer reads the nodes) before it decides.
RETRY = (
    NOMAD_LIST_JOBS,
    NOMAD_READ_JOB,
    NOMAD_SUBMIT_JOB,
    NOMAD_NODE_READ,
    CONSUL_KV_WRITE,
    CONSUL_SERVICES_READ,
    CONSUL_NODES_READ,
)
SERVE = (
    NOMAD_LIST_JOBS,
    NOMAD_READ_JOB,
    NOMAD_SUBMIT_JOB,
    NOMAD_NODE_READ,
    CONSUL_KV_WRITE,
    CONSUL_SESSION_WRITE,
    CONSUL_PLANNER_SERVICE_WRITE,
    CONSUL_SERVICES_READ,
    CONSUL_NODES_READ,
)


def denied_error(
    agent: Agent, rules: list[str], token: TokenStatus, action: str = "", detail: str = ""
) -> PermissionDenied:
    """The planner's PermissionDenied for `rules` denied by `agent`."""
    return PermissionDenied(
        denial(agent, rules, token, PLANNER_POLICIES[agent], action, detail), agent, rules
    )


def check(nomad: AnswersDenied, consul: AnswersDenied, needs: tuple[Permission, ...]) -> None:
    """Raise PermissionDenied naming every permission in `needs` the tokens lack, both
    agents' in one message (NomadUnavailable / ConsulUnavailable when an agent cannot
    be asked)."""
    errors = []
    for agent, client in ((Agent.NOMAD, nomad), (Agent.CONSUL, consul)):
        denied = client.denied([p for p in needs if p.agent is agent])
        if denied is not None:
            permissions, token, detail = denied
            errors.append(denied_error(agent, [p.rule for p in permissions], token, detail=detail))
    if errors:
        raise PermissionDenied(
            "; and ".join(str(e) for e in errors),
            errors[0].agent,
            [rule for e in errors for rule in e.rules],
        )
