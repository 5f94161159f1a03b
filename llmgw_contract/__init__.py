"""llmgw's contract: what the planner writes and the router reads, written once.

Both `planner` and `router` import this package; it imports neither (the
import-linter contracts in pyproject.toml check both). It holds:

- `states`: the model states every view shows (`ModelState`), a replica's
  (`ReplicaState`) and the answers of the activation API (`ActivationStatus`);
- `keys`: the Consul KV layout, the Consul service names and the Nomad job
  meta keys;
- `reserved`: the job IDs and services llmgw uses for itself, which no model
  may be named after, and the sentence that says so;
- `documents`: the pydantic documents stored in Consul KV and sent over the
  activation API, with the functions that encode and decode them.

- `certificates`: the certificate series both publish, and their collector.
- `acl`: the ACL rules both need from Consul (acl/), and the sentence that
  names a denied one.
- `lasterror`: a model's last error in words written once: how a crash by a
  signal is named, which stderr lines say what went wrong, the headline every
  view shows.
- `tlsfiles`: the one `ssl.SSLContext` builder both use, its errors naming the
  setting.
- `leadership`: where the planner that holds the leader lock registered its
  admin API (`resolve_leader`), the only address followers and routers send the
  admin token to.

Two contract tests: tests/unit/contract/test_router_reads.py proves the router
acts on every value these types allow, tests/unit/contract/test_planner_writes.py
that it reads every document and answer the planner's own code produces.
docs/architecture.md explains the states.
"""

from llmgw_contract.documents import (
    ROOM_IDS_KEPT,
    ActivationAnswer,
    EngineRecord,
    LeaderRecord,
    ModelLoad,
    ModelRecord,
    Parked,
    ReplicaRecord,
    RoutingDocument,
    ScalingBounds,
    ScalingDecision,
    ScalingState,
    StateDocument,
    Unplaceable,
    UpdateFailed,
    UsageRecord,
    UsageReport,
    decode,
    encode,
    routing_of,
)
from llmgw_contract.keys import (
    LEADER_KEY,
    OWN_SERVICES,
    PARKED_META,
    PLANNER_SERVICE,
    ROUTER_API_KEYS_KEY,
    ROUTER_LIMITS_PREFIX,
    ROUTER_SERVICE,
    SERVICE_PREFIX,
    JobMeta,
    KVPrefix,
    alloc_from_service_id,
    kv_key,
    model_from_key,
    model_from_service,
    service_name,
)
from llmgw_contract.reserved import ENGINE_JOB_PREFIX, PLANNER_JOB, ROUTER_JOB, reserved_name
from llmgw_contract.states import SATISFIED_STATES, ActivationStatus, ModelState, ReplicaState

__all__ = [
    "ENGINE_JOB_PREFIX",
    "LEADER_KEY",
    "OWN_SERVICES",
    "PARKED_META",
    "PLANNER_JOB",
    "PLANNER_SERVICE",
    "ROOM_IDS_KEPT",
    "ROUTER_API_KEYS_KEY",
    "ROUTER_JOB",
    "ROUTER_LIMITS_PREFIX",
    "ROUTER_SERVICE",
    "SATISFIED_STATES",
    "SERVICE_PREFIX",
    "ActivationAnswer",
    "ActivationStatus",
    "EngineRecord",
    "JobMeta",
    "KVPrefix",
    "LeaderRecord",
    "ModelLoad",
    "ModelRecord",
    "ModelState",
    "Parked",
    "ReplicaRecord",
    "ReplicaState",
    "RoutingDocument",
    "ScalingBounds",
    "ScalingDecision",
    "ScalingState",
    "StateDocument",
    "Unplaceable",
    "UpdateFailed",
    "UsageRecord",
    "UsageReport",
    "alloc_from_service_id",
    "decode",
    "encode",
    "kv_key",
    "model_from_key",
    "model_from_service",
    "reserved_name",
    "routing_of",
    "service_name",
]
