"""The documents llmgw stores in Consul KV and sends over the activation API.

Every document is a frozen pydantic model that ignores keys it does not know,
so a router older than its planner still reads what it needs. `encode` and
`decode` are the only (de)serialisers; `decode` raises ValueError for anything
that is not a valid document of the asked type, so a reader can skip one bad
key without losing the others.

Who writes and who reads (keys in `llmgw_contract.keys`):

    ModelRecord     planner apply -> router (models it knows), planner
    StateDocument   planner       -> router (parked / unplaceable), planner CLIs
    UsageRecord     planner leader (coarse copy of router usage) -> planner
    UsageReport     router -> planner admin API (POST /v1/usage): models used, and
                    each model's requests in flight and waiting (load-based scaling)
    EngineRecord    planner engines apply -> planner (apply, status, the leader's
                    installs on new nodes); the router never reads it
    LeaderRecord    planner leader -> planner followers (where to forward writes) and
                    routers (where to send activations and usage reports)
    ActivationAnswer  planner admin API -> router
"""

from __future__ import annotations

import json
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from llmgw_contract.states import ActivationStatus

# A replica record keeps its last healthy entries only. The other lists of a state
# document are bounded by what Nomad shows, not by count (issue 19): `counted` keeps
# the keys of allocations Nomad still lists, `replicas` at most the definition's
# replicas, never dropping a live one (`planner.model.fold`).
MAX_HEALTHY_ENTRIES = 8
# A placement answer keeps the IDs of this many of the allocations it waits for (sorted):
# all of them ended says Nomad looked at room made, whatever the rest (`Unplaceable.room`).
ROOM_IDS_KEPT = 16


class Document(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class ScalingBounds(Document):
    """A model's load-based scaling, as defined (`scaling:` in its file; issue 22).

    Replicas follow demand between `min` and `max`: `target` requests (in flight plus
    waiting, summed over every router) per replica, averaged over `window` seconds; up
    once the average asks for more for `up_after` seconds (at once for a surge of
    twice the target per replica), down once it asks for fewer for `down_after`."""

    min: int
    max: int
    target: float
    window: int = 30  # seconds
    up_after: int = 15  # seconds
    down_after: int = 300  # seconds


class ModelRecord(Document):
    """One applied model definition, as `planner apply` wrote it (llmgw/models/<name>)."""

    name: str
    definition_hash: str
    replicas: int  # for an on-demand model: how many while active
    source: str = ""
    sha256: str | list[str] | None = None  # a list: one per shard of a split source
    profile: dict[str, Any] = {}
    on_demand: dict[str, Any] | None = None  # {"idle_after": seconds}
    scaling: ScalingBounds | None = None  # None: a fixed count (`replicas`)

    @property
    def idle_after(self) -> int | None:
        """Seconds without requests before an on-demand model scales to 0; None if always on."""
        return None if self.on_demand is None else int(self.on_demand["idle_after"])


class Parked(Document):
    """The planner stopped the model after too many start failures with no healthy replica.

    Its durable copy is the stopped Nomad job's meta (`keys.PARKED_META`)."""

    reason: str
    last_error: str | None = None
    since: str = ""  # ISO 8601, UTC
    definition_hash: str = ""  # the definition that failed; a different one lifts parking


class UpdateFailed(Document):
    """An update of a serving model that Nomad rolled back: the new definition's
    replicas never became healthy (its deployment failed), so the job runs the last
    definition that did and the model keeps serving on it.

    Its durable copy is Nomad's: the job versions and the failed deployment of the
    newest version of `definition_hash` (`planner.model.rollout`). Re-applying the same
    definition does not try it again; another definition or `planner retry` does."""

    definition_hash: str  # the definition that failed to roll out
    job_version: int  # the Nomad job version that carried it
    reason: str  # Nomad's deployment status description
    consecutive_failures: int = 0  # start failures its replicas had when it was rolled back
    last_error: str | None = None
    since: str = ""  # ISO 8601, UTC: when the planner saw it rolled back


class Unplaceable(Document):
    """Nomad's last placement attempt left replicas unplaced, and why.

    `placed` of `desired` replicas were placed (0 of N: nothing runs). A
    `provisional` answer was given while allocations on the cluster were
    stopping (room being made) or an engine was installing: the router waits
    instead of refusing, and `waiting` says for what. So it does for a model
    with replicas placed (`refuses`).

    A provisional answer that follows a settled one is `standing`: the
    shortfall Nomad settled on is not over until it places the replicas or
    answers otherwise, so status, metrics and alerts keep telling it (`stands`)
    while the router waits. Without it, any allocation ending on a full node
    turned a told shortfall into "waiting for room" for seconds: the unplaced
    metrics fell to 0 (resetting an alert's `for`), `since` restarted and the
    log warned again each time (found by CI: a scale-up short of memory read
    "waiting for room" between two reads of its status).
    """

    reason: str  # the scheduler's shortfall: "2 of 3 replicas placed; memory exhausted on ..."
    since: str = ""
    eval_id: str | None = None
    placed: int = 0
    desired: int = 0
    provisional: bool = False
    # What Nomad may place it on soon (provisional answers): "waiting for room: 1
    # allocation(s) stopping or stopped on node-a; Nomad places it again when they end".
    waiting: str = ""
    standing: bool = False
    # The allocations (IDs, at most ROOM_IDS_KEPT) whose end a provisional answer first
    # waited for, kept while any of them is still stopping: once all have ended and the
    # answer is still short, Nomad looked at the room they made and could not place the
    # model, so the shortfall stands (`planner.model.unplaceable.with_unplaceable`).
    room: tuple[str, ...] = ()

    @field_validator("room", mode="before")
    @classmethod
    def _bounded_room(cls, value: object) -> object:
        """At most ROOM_IDS_KEPT IDs: a longer list (a document is untrusted input, or a
        later planner keeps more) is cut, not a reason to reject the whole document."""
        return tuple(value)[:ROOM_IDS_KEPT] if isinstance(value, list | tuple) else value

    @property
    def told(self) -> str:
        """The answer in one sentence: the waiting words with the shortfall, or the
        shortfall alone. (A planner before `waiting` wrote both into `reason`.)"""
        return f"{self.waiting} ({self.reason})" if self.waiting else self.reason

    @property
    def stands(self) -> bool:
        """The shortfall is told as settled: Nomad's settled answer, or a provisional
        answer that followed one (`standing`)."""
        return not self.provisional or self.standing

    @property
    def refuses(self) -> bool:
        """Requests are refused on this answer (503 `model_unplaceable`): it is settled
        (not provisional) and no replica was placed. A model with a replica placed,
        starting or running, serves with what it has and says what is short in status,
        metrics and the log (issue 22, "capacity is honest": never `unplaceable` for a
        model that serves). The planner (activation, status) and the router (its
        refusals, an activation's wait) all decide by this."""
        return not self.provisional and self.placed == 0


class ReplicaRecord(Document):
    """One allocation of a model and its own start failures (failures are per replica).

    `healthy_entries` are the times (Unix ns) the allocation was seen to start
    passing its check, newest last; a run is healthy if one of them falls
    between its start and its end. `stable_entry` is the entry whose run was
    healthy for the whole stability window (it reset the counts).
    """

    alloc_id: str
    name: str = ""  # Nomad's allocation name, "<job>.server[<index>]"
    node: str = ""  # node name
    definition_hash: str = ""
    consecutive_failures: int = 0
    last_error: str | None = None
    last_error_at: str | None = None
    healthy_entries: tuple[int, ...] = ()
    stable_entry: int = 0

    @property
    def index(self) -> str:
        """The replica as Nomad names it within the job: `server[1]`."""
        return self.name.partition(".")[2] or self.name or self.alloc_id[:8]


class ScalingDecision(Document):
    """One choice of the load-based scaler: `before` -> `after` replicas (equal: held),
    why in words, and the figures it was made on."""

    before: int
    after: int
    reason: str  # "3 -> 4: 2.7 in flight per replica over 30 s, target 2"
    at: str = ""  # ISO 8601, UTC
    average: float = 0.0  # requests in flight and waiting, all routers, over the window
    per_replica: float = 0.0
    direction: str = ""  # "up", "down", "" (held)


class ScalingState(Document):
    """What the load-based scaler keeps between passes, so a leader change keeps it: the
    last average it saw (and when), since when the average has asked for more or for
    fewer replicas than run (Unix s; 0: it does not), and its last decision."""

    average: float = 0.0
    average_at: float = 0.0  # Unix s of `average`
    above_since: float = 0.0
    below_since: float = 0.0
    waiting: str = ""  # why a wanted scale is not made now (a deployment runs, ...)
    last: ScalingDecision | None = None


class StateDocument(Document):
    """What the planner knows about one model beyond what Nomad and Consul show
    (llmgw/state/<name>). Written only with a check-and-set on the index read.

    The failure figures refer to `definition_hash`: a new definition starts
    them over, and failures of allocations of another definition never count.
    A document recreated after a wiped KV takes the failures Nomad's task events
    still show as `counted` (history), so none is counted twice.

    `counting_from_ns` is retired (issue 19: it compared the planner's clock with
    the nodes'): no longer written or read, kept so older documents and readers
    still decode.
    """

    name: str
    definition_hash: str = ""
    counting_from_ns: int = 0  # retired, see above
    consecutive_failures: int = 0  # across replicas, since the last stable healthy run
    start_failures_total: int = 0  # every failure counted for this model, ever
    last_error: str | None = None
    last_error_at: str | None = None
    counted: tuple[str, ...] = ()  # failure keys already counted: "alloc/task/time"
    replicas: tuple[ReplicaRecord, ...] = ()
    parked: Parked | None = None
    job_index: int = 0  # the Nomad JobModifyIndex that `parked` reflects (newer wins)
    unplaceable: Unplaceable | None = None
    update_failed: UpdateFailed | None = None
    scaling: ScalingState | None = None  # load-based scaling (`ModelRecord.scaling`)

    def replica(self, alloc_id: str) -> ReplicaRecord | None:
        return next((r for r in self.replicas if r.alloc_id == alloc_id), None)


class RoutingDocument(Document):
    """What the router acts on of one model's state (llmgw/routing/<name>): whether it
    is parked or unplaceable, and why. The planner writes it beside the state document,
    in the same Consul transaction, only when this part changes (:func:`routing_of`).

    Why a key of its own (issue 21, item 4): Consul's KV has no "changes since" read,
    so a router watching ``llmgw/state/`` read and decoded every model's document
    (12-16 KiB each, failure keys and replica errors it never uses) at every failure
    counted anywhere: with 1,000 models churning, 150 ms of router work and a 16 MiB
    answer for Consul to encode, about once a second. A failure counted wakes no
    router now; only a model becoming parked, unplaceable or neither does.
    """

    name: str
    parked: Parked | None = None
    unplaceable: Unplaceable | None = None

    @property
    def refuses(self) -> bool:
        """Parked or unplaceable: the router has something to say about the model."""
        return self.parked is not None or self.unplaceable is not None


def routing_of(state: StateDocument) -> RoutingDocument:
    """The router's part of ``state``. A parked record without its own ``last_error``
    borrows the document's (the planner's last start error is the best "why" there
    is)."""
    parked = state.parked
    if parked is not None and parked.last_error is None and state.last_error:
        parked = parked.model_copy(update={"last_error": state.last_error})
    unplaceable = state.unplaceable
    if unplaceable is not None and unplaceable.room:
        # The planner's own bookkeeping: the router never reads it, and a change of it
        # alone must not rewrite the key every router watches.
        unplaceable = unplaceable.model_copy(update={"room": ()})
    return RoutingDocument(name=state.name, parked=parked, unplaceable=unplaceable)


class UsageRecord(Document):
    """When a model was last asked for (llmgw/usage/<name>), kept coarsely by the leader."""

    last_used_at: str  # ISO 8601, UTC


# Bounds of a usage report, which the planner takes from any holder of its token and
# sums into scaling decisions (found in review: a negative count cancelled the other
# routers' load and scaled down under load, an `interval_s` of NaN or 3600 kept a
# router's load counted for hours, nothing bounded the sizes). A count above
# MAX_LOAD is not a router's: one router holds at most its admission queue plus its
# replicas' slots. The interval's bound is the router's own (`LLMGW_USAGE_INTERVAL`).
MAX_LOAD = 1_000_000
MAX_USAGE_INTERVAL_S = 300.0
MAX_REPORTED_MODELS = 10_000
MAX_NAME_CHARS = 256

Count = Annotated[int, Field(ge=0, le=MAX_LOAD)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


class ModelLoad(Document):
    """One router's requests for one model right now: `inflight` sent to a replica and
    not answered, `waiting` held for a free slot or a replica that is starting;
    `replicas` what the model's replicas say they run and queue, every client's
    together (llama-server's requests_processing + requests_deferred as this router
    last read them, `router.replicaload`; 0: it read no more than its own `inflight`);
    each within [0, MAX_LOAD]."""

    inflight: Count = 0
    waiting: Count = 0
    replicas: Count = 0


class UsageReport(Document):
    """A router's report to the planner (POST /v1/usage), every `interval_s`.

    `models` were used since the last report (idle scale-down). `load` holds the
    router's requests per model now (models absent: none); `router` names the sender,
    so the planner sums the latest report of each router and forgets one that stops
    reporting. A router older than load reporting sends `models` alone. Bounded (see
    MAX_*): a report out of bounds is refused whole (422), never clipped."""

    models: list[Name] = Field(max_length=MAX_REPORTED_MODELS)
    router: Name = ""
    interval_s: float = Field(10.0, gt=0, le=MAX_USAGE_INTERVAL_S, allow_inf_nan=False)
    load: dict[Name, ModelLoad] = Field({}, max_length=MAX_REPORTED_MODELS)


class EngineRecord(Document):
    """One defined engine, as `planner engines apply` registered it (llmgw/engines/<name>).

    The durable record of which engines exist: an engine's install job is a sysbatch
    job that goes `dead` once it ran on every node, and Nomad's GC (`nomad system gc`,
    or by itself after `job_gc_threshold`) removes it. What each node has installed
    stays in the node's metadata (`llmgw_engine_<name> = <version>`)."""

    name: str
    version: str
    # The engine file as validated (planner.spec.engine_definitions.EngineDefinition:
    # kind, artifact or path, sha256, check_model).
    definition: dict[str, Any]
    # The program's path on the nodes as the install put it: what model jobs run.
    command: str
    # The install job as rendered and registered (Nomad's JSON): registered again, as
    # it was, when Nomad no longer has it and a node needs the engine.
    install_job: dict[str, Any] = {}


class LeaderRecord(Document):
    """The planner instance holding the leader lock (llmgw/leader) and its admin API."""

    id: str
    address: str  # base URL of its admin API, e.g. http://10.0.0.5:4650
    since: str = ""


class ActivationAnswer(Document):
    """The planner's answer to `POST /v1/models/{name}/activate`."""

    name: str
    status: ActivationStatus
    reason: str = ""
    last_error: str | None = None
    since: str | None = None
    eval_id: str | None = None


D = TypeVar("D", bound=Document)


def encode(document: Document) -> str:
    """The document as compact, key-sorted JSON (what goes into KV or on the wire)."""
    return json.dumps(document.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def decode(kind: type[D], raw: str | bytes | dict[str, Any]) -> D:
    """Parse a document of type `kind` from JSON text or an already-decoded object.

    Raises ValueError (with pydantic's or json's reason) when it is not one. Every
    document comes from KV or the wire, i.e. from anyone who can write there: a
    nesting too deep for the parser (`[[[[...`, 10 KB is enough) is RecursionError in
    json, which is not a ValueError; it is one more document that is not one (a reader
    that let it out stopped reading every other key: a router kept every model's old
    state, found in review)."""
    try:
        data = json.loads(raw) if isinstance(raw, str | bytes) else raw
        return kind.model_validate(data)
    except (ValidationError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"not a {kind.__name__}: {exc}") from None


# A usage report with no models, no load and an interval of at most this many seconds
# is a router's last (`router.usage.UsageReporter.stop`): the planner forgets that
# router at once instead of counting it as gone silent (`planner.daemon.demand`). No
# router reports that often.
USAGE_GOODBYE_INTERVAL_S = 0.01
