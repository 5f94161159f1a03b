"""Where llmgw keeps things: Consul KV keys, Consul service names, Nomad job meta.

KV layout (all JSON, see `llmgw_contract.documents`):

    llmgw/models/<name>   ModelRecord     written by `planner apply`; restored by the
                                          leader from the job's meta if it vanishes
    llmgw/state/<name>    StateDocument   written by the planner (every write a
                                          check-and-set); a cache of what Nomad's job
                                          meta holds durably
    llmgw/routing/<name>  RoutingDocument the router's part of the state (parked,
                                          unplaceable): written in the state's
                                          transaction only when that part changes
    llmgw/usage/<name>    UsageRecord     the leader's coarse copy of when the model
                                          was last asked for (routers report to it)
    llmgw/engines/<name>  EngineRecord    written by `planner engines apply`: the engines
                                          defined (Nomad's GC removes a finished install
                                          job; this record stays); restored by the
                                          leader from an install job's meta if it vanishes
    llmgw/leader          LeaderRecord    held with a Consul session by the planner
                                          that acts (leader election); followers
                                          forward writes to it, routers send it
                                          activations and usage reports

The router watches `llmgw/models/` and `llmgw/routing/`, never `llmgw/state/`,
`llmgw/usage/` nor `llmgw/engines/`: a failure counted or a usage heartbeat must not
wake every router, and engines are the planner's alone.

Outside `llmgw/`, written by operators only:

    llmgw-router/api-keys YAML            the router's API keys when it runs with
                                          LLMGW_API_KEYS_CONSUL (router.keys); outside
                                          `llmgw/` so the planner's token (`llmgw/`
                                          write) cannot grant itself a key

Written by routers (compare-and-set), outside `llmgw/` so the planner's token
cannot reset a key's allowance and nothing that watches `llmgw/` wakes per lease:

    llmgw-router/limits/<key name>/<kind>   JSON {"window", "used"}: what every router
                                          together has used of one API key's limit
                                          in its current window (router.windows);
                                          one document per (key, kind), reused
                                          window after window
"""

from __future__ import annotations

import re
from enum import StrEnum

KV_ROOT = "llmgw/"
LEADER_KEY = "llmgw/leader"
ROUTER_API_KEYS_KEY = "llmgw-router/api-keys"
# Per-key limits shared by every router (router.sharedlimits).
ROUTER_LIMITS_PREFIX = "llmgw-router/limits/"


class KVPrefix(StrEnum):
    MODELS = "llmgw/models/"
    STATE = "llmgw/state/"
    ROUTING = "llmgw/routing/"  # documents.RoutingDocument: the router's part of STATE
    USAGE = "llmgw/usage/"
    ENGINES = "llmgw/engines/"


def kv_key(prefix: KVPrefix, model: str) -> str:
    """`llmgw/<kind>/<model>`."""
    return f"{prefix}{model}"


def model_from_key(prefix: KVPrefix, key: str) -> str | None:
    """The model a key under `prefix` belongs to, or None for a key nested deeper."""
    name = key.removeprefix(prefix) if key.startswith(prefix) else ""
    return name if name and "/" not in name else None


# Consul service of a model's replicas. "llmgw-" + a model name (at most 57
# characters) stays within a DNS label's 63 (RFC 1035).
SERVICE_PREFIX = "llmgw-"
# The planner's own Consul service (its admin API), which carries the TTL check
# that its leadership session is bound to.
PLANNER_SERVICE = "llmgw-planner"
# The router's Consul service when it runs as a Nomad job (jobspecs/router.nomad.hcl):
# clients and load balancers find the routers there. Not a model's either.
ROUTER_SERVICE = "llmgw-router"
# Services of llmgw's own processes: no model may be named so that its service is one.
OWN_SERVICES = frozenset({PLANNER_SERVICE, ROUTER_SERVICE})


def service_name(model: str) -> str:
    """`llmgw-<model>`: the Consul service a model's replicas register."""
    return SERVICE_PREFIX + model


def model_from_service(service: str) -> str | None:
    """The model behind an `llmgw-<model>` service name; None for other services,
    including the planner's and the router's own."""
    if not service.startswith(SERVICE_PREFIX) or service in OWN_SERVICES:
        return None
    return service.removeprefix(SERVICE_PREFIX) or None


# Nomad registers a task's Consul service as
# _nomad-task-<alloc id>-<task, or group-<group>>-<service>-<port>
# (command/agent/consul/service_client.go, MakeAllocServiceID).
_NOMAD_SERVICE_ID = re.compile(r"^_nomad-task-([0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12})-")


def alloc_from_service_id(service_id: str) -> str | None:
    """The Nomad allocation ID inside a Consul service ID Nomad registered, or None."""
    match = _NOMAD_SERVICE_ID.match(service_id)
    return match.group(1) if match else None


class JobMeta(StrEnum):
    """Meta keys on a model's Nomad job (values are strings; the Nomad UI shows them).

    The parking keys are the durable record of a parked model: Consul KV is a
    cache rebuilt from them.
    """

    MODEL = "llmgw_model"
    DEFINITION_HASH = "llmgw_definition_hash"
    SPEC_HASH = "llmgw_spec_hash"
    ON_DEMAND = "llmgw_on_demand"
    RECORD = "llmgw_record"  # the ModelRecord as JSON, to restore llmgw/models/<name>
    PARKED_REASON = "llmgw_parked_reason"
    PARKED_LAST_ERROR = "llmgw_parked_last_error"
    PARKED_SINCE = "llmgw_parked_since"
    # The JobModifyIndex a registration renewed (planner.model.resurrect.renewed): a new
    # job version that replaces every allocation, so Nomad never re-places a failed one
    # at an older definition's version.
    RENEWED = "llmgw_renewed"


PARKED_META = (JobMeta.PARKED_REASON, JobMeta.PARKED_LAST_ERROR, JobMeta.PARKED_SINCE)
