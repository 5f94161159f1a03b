"""Count start failures per replica and decide parking: pure functions over Nomad allocations.

Called by the watcher (`planner.daemon.watcher`) for every Allocation it sees (from
the event stream or a reconcile listing; the same allocation may come many
times), for every allocation Consul starts reporting as passing, and on a
periodic tick that notices runs that stayed healthy. The rules
(docs/architecture.md, "Failures"):

- A **run** of a replica is one start of its task, from its `Started` event to
  the event that ended it (`Terminated`, `Driver Failure`, ...).
- A run that ended before the replica ever passed its health check is a
  **start failure**; one that passed and ended within the stability window
  (`Rules.stable_after_ns`, 2 min by default, like Kubernetes' crash-loop
  back-off reset) is a **crash after ready**: a failure too. A stop the
  scheduler or an operator asked for (`Killing` after the start) is neither.
- A run healthy for the whole window is **stable**: it resets its replica's
  count and the model's.
- Counts are kept per replica (a Nomad allocation) and for the model
  (consecutive failures across replicas since the last stable run), and only
  for allocations of the model's current definition: a new definition starts
  over, and a late event of an old one never counts against it.
- The model is **parked** when its count reaches `Rules.park_after` and no
  replica of the current definition protects it: one passing its check now
  (whatever it failed before), or one running with no failure of its own
  (still loading).
  A replica that keeps failing beside a healthy one leaves the model
  `degraded`, never parked; Nomad stops that replica by itself after its
  restart attempts (planner/jobspecs/model.nomad.hcl: no reschedule).

Each failure is counted once, keyed by allocation, task and event time, so
replayed events and planner restarts change nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from llmgw_contract import lasterror
from llmgw_contract.documents import (
    MAX_HEALTHY_ENTRIES,
    Parked,
    ReplicaRecord,
    StateDocument,
)
from planner.engines import llama_cpp

PARK_AFTER = 5  # consecutive start failures; `planner serve --park-after` overrides
STABLE_AFTER_S = 120  # a healthy run this long resets the counts; `--stable-after` overrides

# Nomad's task event types (nomad/structs/structs.go, TaskEvent constants).
ENDS_A_START = frozenset(
    {
        "Terminated",
        "Driver Failure",
        "Failed Artifact Download",
        "Setup Failure",
        "Failed Validation",
    }
)
STOP_REQUESTED = frozenset({"Killing", "Killed", "Sibling Task Failed"})
NEW_START = frozenset({"Started", "Restarting", "Received"})
RESTART_SIGNALED = "Restart Signaled"
# `nomad alloc restart` (an operator) signals a restart with this reason; it is
# a stop asked for, not a failure (client/allocrunner/alloc_runner.go).
_USER_RESTART = "User requested"

# Client statuses of an allocation whose task may still run or start.
LIVE_CLIENT_STATUSES = frozenset({"pending", "running"})


@dataclass(frozen=True)
class Rules:
    park_after: int = PARK_AFTER
    stable_after_ns: int = STABLE_AFTER_S * 10**9


@dataclass(frozen=True)
class StartFailure:
    """One run that ended on its own. `started_ns` is its Started event (0: it never
    started, e.g. a driver or artifact failure)."""

    key: str  # "<alloc id>/<task>/<event time ns>"
    alloc_id: str
    task: str
    message: str  # "Terminated: Exit Code: 1", or "crashed: SIGSEGV (exit 139)"
    at_ns: int
    started_ns: int
    signal: int = 0  # the signal the task died of (0: it exited, or never ran)

    @property
    def crashed(self) -> bool:
        return self.signal != 0


@dataclass(frozen=True)
class AllocInfo:
    """What the counting needs of one allocation besides its events."""

    alloc_id: str
    name: str
    node: str
    definition_hash: str
    client_status: str
    desired_status: str
    replaced: bool = False  # Nomad placed a replacement (NextAllocation)

    @property
    def live(self) -> bool:
        return self.desired_status == "run" and self.client_status in LIVE_CLIENT_STATUSES

    @property
    def stopped(self) -> bool:
        """Nomad gave up on it after its restart attempts: failed, still wanted, and
        nothing placed in its stead (the job never reschedules by itself)."""
        return self.desired_status == "run" and self.client_status == "failed" and not self.replaced


def iso(nanos: int) -> str:
    return datetime.fromtimestamp(nanos / 1e9, tz=UTC).isoformat(timespec="seconds")


def _stop_asked(event: dict[str, Any]) -> bool:
    kind = event.get("Type", "")
    if kind in STOP_REQUESTED:
        return True
    reason = event.get("RestartReason") or event.get("DisplayMessage") or ""
    return kind == RESTART_SIGNALED and reason.startswith(_USER_RESTART)


def start_failures(alloc: dict[str, Any]) -> Iterator[StartFailure]:
    """Every run that ended on its own in this allocation's task events, oldest first."""
    for task, task_state in sorted((alloc.get("TaskStates") or {}).items()):
        stopping, started = False, 0
        for event in sorted(task_state.get("Events") or [], key=lambda e: e.get("Time", 0)):
            kind, at = event.get("Type", ""), int(event.get("Time", 0))
            if kind in NEW_START:
                stopping = False
                started = at if kind == "Started" else started
            elif _stop_asked(event):
                stopping = True
            elif kind in ENDS_A_START and not stopping:
                signal, message = ended(alloc, task, event)
                yield StartFailure(
                    f"{alloc['ID']}/{task}/{at}", alloc["ID"], task, message, at, started, signal
                )


# Nomad keeps a task's last 10 events (structs.TaskState, appendTaskEvent): five
# starts make about 17, so a cold read of a replica that failed five times shows
# three of its failures (issue 19's third QA, D4).
UNSEEN = "unseen"


def unseen_failures(
    alloc: dict[str, Any], counted: Iterable[str], stable_after_ns: int
) -> list[StartFailure]:
    """The failures of `alloc` whose events Nomad no longer keeps and that `counted`
    (the keys counted so far) does not hold, oldest first; keyed
    `<alloc>/<task>/unseen-<n>`, so a later read counts none of them again.

    Only for an allocation Nomad failed after its restart attempts (ClientStatus
    failed) whose whole life, from its CreateTime to its last ModifyTime (both the
    Nomad server's clock), was shorter than the stability window: every run in it
    then ended before it could be stable, so each ended run was a failure. Its ended
    runs are the task's Restarts + 1, less the restarts asked for that are still
    shown; what `counted` already holds of it (its shown failures, ones counted while
    they were shown, earlier unseen ones) is not counted again."""
    if alloc.get("ClientStatus") != "failed":
        return []
    created, modified = int(alloc.get("CreateTime") or 0), int(alloc.get("ModifyTime") or 0)
    if not created or not modified or modified - created >= stable_after_ns:
        return []
    shown = list(start_failures(alloc))
    known = set(counted) | {f.key for f in shown}
    unseen: list[StartFailure] = []
    for task, task_state in sorted((alloc.get("TaskStates") or {}).items()):
        events = task_state.get("Events") or []
        asked = sum(1 for e in events if e.get("Type") == RESTART_SIGNALED and _stop_asked(e))
        ended = int(task_state.get("Restarts") or 0) + 1 - asked
        prefix = f"{alloc['ID']}/{task}/"
        have = sum(1 for key in known if key.startswith(prefix))
        first = min((int(e.get("Time", 0)) for e in events), default=0)
        numbered = sum(1 for key in known if key.startswith(prefix + UNSEEN))
        missing = max(0, ended - have)
        for n in range(numbered + 1, numbered + missing + 1):
            unseen.append(
                StartFailure(
                    f"{prefix}{UNSEEN}-{n}",
                    alloc["ID"],
                    task,
                    "a start failure whose event Nomad no longer keeps (a task's last 10)",
                    max(0, first - (numbered + missing + 1 - n)),
                    0,
                )
            )
    return unseen


def memory_limit_mib(alloc: dict[str, Any], task: str) -> int | None:
    """The task's memory limit in MiB (its memory_max when set, else its memory), from
    the allocation's AllocatedResources; None when the allocation does not carry them."""
    tasks = (alloc.get("AllocatedResources") or {}).get("Tasks") or {}
    memory = (tasks.get(task) or {}).get("Memory") or {}
    return int(memory.get("MemoryMaxMB") or memory.get("MemoryMB") or 0) or None


def ended(alloc: dict[str, Any], task: str, event: dict[str, Any]) -> tuple[int, str]:
    """How one run ended: (the signal it died of, 0 when none; the last error's first
    line). A death by a signal is named as a crash (`llmgw_contract.lasterror`), with
    the task's memory limit when it was killed; else Nomad's event as it reads."""
    kind = event.get("Type", "")
    details = event.get("Details") or {}
    exit_code = int(event.get("ExitCode") or details.get("exit_code") or 0)
    oom = event.get("Message") == "OOM Killed" or details.get("oom_killed") == "true"
    signal = lasterror.crash_signal(
        exit_code, int(event.get("Signal") or details.get("signal") or 0)
    )
    if kind == "Terminated" and (signal or oom):
        signal = signal or lasterror.SIGKILL
        return signal, lasterror.crash_line(
            signal, exit_code, oom_killed=oom, memory_limit_mib=memory_limit_mib(alloc, task)
        )
    message = event.get("DisplayMessage") or event.get("Message") or kind
    return 0, f"{kind}: {message}"


def new_failures(state: StateDocument, alloc: dict[str, Any]) -> list[StartFailure]:
    """Failures in `alloc` not counted yet (the caller checks the definition and the
    job's incarnation: `planner.model.fold`)."""
    return [f for f in start_failures(alloc) if f.key not in state.counted]


# One line of a last error for a table and a log (`llmgw_contract.lasterror.headline`):
# the router's refusal starts with the same words.
headline = lasterror.headline


# --- replicas -------------------------------------------------------------------------


def _with_replica(state: StateDocument, replica: ReplicaRecord) -> StateDocument:
    # No bound by count here: the records are bounded by the definition's replicas, by
    # allocations Nomad still shows (`planner.model.fold`), never evicting a live one
    # (issue 19: with more than 32 replicas healthy records went first).
    others = tuple(r for r in state.replicas if r.alloc_id != replica.alloc_id)
    return state.model_copy(update={"replicas": (*others, replica)})


def track(state: StateDocument, info: AllocInfo) -> StateDocument:
    """Keep a record of an allocation of the current definition (node, name); drop the
    record of one the scheduler stopped (a replaced or scaled-away replica)."""
    known = state.replica(info.alloc_id)
    if info.desired_status != "run":
        if known is None:
            return state
        return state.model_copy(
            update={"replicas": tuple(r for r in state.replicas if r.alloc_id != info.alloc_id)}
        )
    if info.definition_hash != state.definition_hash:
        return state
    if known is not None:
        if known.name:
            return state
        # Seeded from the passing checks alone (a recreated document): name it now.
        return _with_replica(state, known.model_copy(update={"name": info.name, "node": info.node}))
    return _with_replica(
        state,
        ReplicaRecord(
            alloc_id=info.alloc_id,
            name=info.name,
            node=info.node,
            definition_hash=info.definition_hash,
        ),
    )


def healthy_entry(replica: ReplicaRecord | None, failure: StartFailure) -> int:
    """When the failed run started passing its check (0: it never did)."""
    if replica is None:
        return 0
    inside = [e for e in replica.healthy_entries if failure.started_ns <= e <= failure.at_ns]
    return min(inside, default=0)


def judge(
    state: StateDocument,
    failure: StartFailure,
    stderr_tail: str,
    rules: Rules,
    error_lines: Callable[[str], str] = llama_cpp.stderr_summary,
) -> StateDocument:
    """Account for one ended run of a replica of the current definition: a failure
    (start failure, or crash within the stability window), or the end of a stable run.
    `error_lines` is the model's engine's reading of its stderr (`Engine.error_lines`)."""
    replica = state.replica(failure.alloc_id) or ReplicaRecord(
        alloc_id=failure.alloc_id, definition_hash=state.definition_hash
    )
    # Pruned by what Nomad still shows (`planner.model.fold`), not by count: evicting by
    # count recounted old failures at the next reconcile (issue 19).
    counted = (*state.counted, failure.key)
    entry = healthy_entry(replica, failure)
    # A run the stability tick already found stable (its entry and `now` both from the
    # planner's clock) ended stable, whatever the node's clock says of its end.
    if entry and (replica.stable_entry == entry or failure.at_ns - entry >= rules.stable_after_ns):
        return stabilize(state.model_copy(update={"counted": counted}), replica.alloc_id, entry)
    detail = error_lines(stderr_tail)
    message = failure.message
    if entry:
        message += f" ({(failure.at_ns - entry) / 1e9:.0f} s after it passed its health check)"
    last_error = message + (f"\n{detail}" if detail else "")
    at = iso(failure.at_ns)
    replica = replica.model_copy(
        update={
            "consecutive_failures": replica.consecutive_failures + 1,
            "last_error": last_error,
            "last_error_at": at,
        }
    )
    state = state.model_copy(
        update={
            "consecutive_failures": state.consecutive_failures + 1,
            "start_failures_total": state.start_failures_total + 1,
            "last_error": last_error,
            "last_error_at": at,
            "counted": counted,
        }
    )
    return _with_replica(state, replica)


def passing(state: StateDocument, alloc_id: str, at_ns: int) -> StateDocument:
    """The allocation started passing its check at `at_ns` (a new healthy run)."""
    replica = state.replica(alloc_id)
    if replica is None or at_ns in replica.healthy_entries:
        return state
    entries = (*replica.healthy_entries, at_ns)[-MAX_HEALTHY_ENTRIES:]
    return _with_replica(state, replica.model_copy(update={"healthy_entries": entries}))


def stabilize(state: StateDocument, alloc_id: str, entry: int) -> StateDocument:
    """The run that started passing at `entry` stayed healthy for the stability
    window: the replica's count and the model's start over (once per run)."""
    replica = state.replica(alloc_id)
    if replica is None or replica.stable_entry == entry:
        return state
    replica = replica.model_copy(update={"consecutive_failures": 0, "stable_entry": entry})
    state = state.model_copy(update={"consecutive_failures": 0})
    return _with_replica(state, replica)


def due_stable(
    state: StateDocument, passing_since: Mapping[str, int], now_ns: int, rules: Rules
) -> list[tuple[str, int]]:
    """(alloc, entry) of replicas passing without a break for the whole stability window
    and not yet marked stable for that run. `passing_since`: alloc -> when it started
    passing, as the watcher saw it."""
    due = []
    for replica in state.replicas:
        since = passing_since.get(replica.alloc_id)
        if since is None or now_ns - since < rules.stable_after_ns:
            continue
        entry = max((e for e in replica.healthy_entries if e <= since), default=since)
        if replica.stable_entry != entry:
            due.append((replica.alloc_id, entry))
    return due


# --- the model ------------------------------------------------------------------------


def protective(
    state: StateDocument, allocs: Mapping[str, AllocInfo], passing_now: frozenset[str]
) -> list[str]:
    """Allocations of the current definition that forbid parking: live and passing their
    check now (whatever their past failures: a passing replica always protects, the
    README's "no replica healthy", issue 19), or live with no failure of their own
    (still loading)."""
    clean = {r.alloc_id for r in state.replicas if r.consecutive_failures == 0}
    return sorted(
        a.alloc_id
        for a in allocs.values()
        if a.live
        and a.definition_hash == state.definition_hash
        and (a.alloc_id in passing_now or a.alloc_id in clean)
    )


def serving_before(
    state: StateDocument, allocs: Mapping[str, AllocInfo], passing_now: frozenset[str]
) -> bool:
    """A replica of an earlier definition still serves: an update is rolling out beside
    it (`planner.model.rollout`), and Nomad rolls the update back if it fails; parking would
    stop what serves (issue "Model updates without downtime")."""
    return any(
        a.live and a.definition_hash != state.definition_hash and a.alloc_id in passing_now
        for a in allocs.values()
    )


def all_stopped(
    state: StateDocument, allocs: Iterable[AllocInfo], rollout_failed: bool = False
) -> bool:
    """Nothing of the current definition will start again by itself: every replica of it
    the job still wants was stopped by Nomad after its restart attempts; or the job's
    current version rolled out with canaries, its deployment failed with no stable
    version to revert to (`rollout_failed`: `planner.model.rollout.rollout_failed`), and
    Nomad stopped its canaries, at least one after failing, none live. Nomad places
    nothing more for a failed deployment, and a replica of an older definition that
    failed keeps its place (found on real agents: a retry forgave a canary's first
    failures, its last ones failed the deployment, and the model was never parked while
    the router answered `model_loading`; issue 19's QA)."""
    current = [a for a in allocs if a.definition_hash == state.definition_hash and not a.replaced]
    wanted = [a for a in current if a.desired_status == "run"]
    if wanted and all(a.stopped for a in wanted):
        return True
    return (
        rollout_failed
        and not any(a.live for a in current)
        and any(a.client_status == "failed" for a in current)
    )


def decide_parking(
    state: StateDocument,
    allocs: Mapping[str, AllocInfo],
    passing_now: frozenset[str],
    now: datetime,
    rules: Rules,
    rollout_failed: bool = False,
) -> StateDocument:
    """Park once the count reaches `park_after` and no replica protects the model, or
    once Nomad stopped every replica after its restart attempts (`all_stopped`, with
    `rollout_failed`) with failures counted
    (fewer than `park_after` only when some were not counted: a document lost from KV,
    or runs that crashed after their stability window); an already parked model stays
    as it is."""
    if state.parked is not None or state.consecutive_failures == 0:
        return state
    if protective(state, allocs, passing_now) or serving_before(state, allocs, passing_now):
        return state
    if state.consecutive_failures >= rules.park_after:
        reason = f"{state.consecutive_failures} consecutive start failures"
    elif all_stopped(state, allocs.values(), rollout_failed):
        reason = (
            f"every replica stopped by Nomad after its restart attempts "
            f"({state.consecutive_failures} consecutive start failures counted)"
        )
    else:
        return state
    parked = Parked(
        reason=reason,
        last_error=state.last_error,
        since=now.isoformat(timespec="seconds"),
        definition_hash=state.definition_hash,
    )
    return state.model_copy(update={"parked": parked})


def for_definition(state: StateDocument, definition_hash: str) -> StateDocument:
    """The state for the model's current definition: a new one starts every count
    over and forgets the old replicas (parking is lifted by `apply`, not here)."""
    if state.definition_hash == definition_hash:
        return state
    return state.model_copy(
        update={
            "definition_hash": definition_hash,
            "consecutive_failures": 0,
            "replicas": (),
            "last_error": None,
            "last_error_at": None,
        }
    )


def forgiven(state: StateDocument) -> StateDocument:
    """Every count starts over (`planner retry`); parking is not touched here: it is
    lifted only together with the job's modify index (`actions.set_parked`)."""
    replicas = tuple(r.model_copy(update={"consecutive_failures": 0}) for r in state.replicas)
    return state.model_copy(update={"consecutive_failures": 0, "replicas": replicas})


def retried(state: StateDocument) -> StateDocument:
    """Lift parking (a changed definition or `planner retry`): a fresh count."""
    return forgiven(state).model_copy(update={"parked": None})
