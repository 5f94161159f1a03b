"""Why Nomad could not place a model, in one sentence, and when to say so again.

Called by the event watcher and the activator for every completed Evaluation
of an llmgw job, and by `planner apply --dry-run` for a plan answer. Pure: an
evaluation's FailedTGAllocs (one AllocMetric per task group, as
/v1/evaluation/:id and /v1/job/:id/plan return it), the task group count, what
one replica asks of GPUs and the cluster's GPU inventory become a `Shortfall`:

    needs 1 nvidia/gpu with ≥ 24 GiB: 2 nodes have GPUs, none with enough memory (largest 16 GiB)
    1 of 3 replicas placed; memory exhausted on 3 of 3 nodes

Nomad files every device mismatch (no GPU, too few, a `${device.attr.memory}`
constraint not met) under one ConstraintFiltered name, "missing devices", so
the inventory is what tells those apart. Nodes of a computed class already
rejected in the same evaluation are filed as "computed class ineligible"; they
failed for the same reason as the first node of their class, so they are
counted under that reason and the name is never shown.

The placement warning is logged when the reason changes, or every
`REPEAT_WARNING` while it persists: the cluster this project comes from logged
"no placement" 250 times in two days, once per evaluation, and nobody read it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from fnmatch import fnmatchcase
from typing import Any

from planner.spec.definitions import parse_bytes

REPEAT_WARNING = timedelta(minutes=10)

# The one device the job template asks for (planner/jobspecs/model.nomad.hcl,
# `device "nvidia/gpu"`).
GPU_VENDOR, GPU_TYPE = "nvidia", "gpu"
GPU = f"{GPU_VENDOR}/{GPU_TYPE}"

# Nomad 1.6.3's ConstraintFiltered names (scheduler/feasible.go): FilterConstraintDevices,
# and the FeasibilityWrapper's fast path for a computed class it already rejected.
MISSING_DEVICES = "missing devices"
COMPUTED_CLASS_INELIGIBLE = "computed class ineligible"
_CONSTRAINT_WORDS = {"missing drivers": "no node has the task driver"}
# Node metadata that records an installed engine (planner/spec/engine_definitions.py).
ENGINE_META_PREFIX = "llmgw_engine_"

# DimensionExhausted names for devices that exist but are taken: the BinPackIterator's
# "devices: <AssignDevice error>" (scheduler/rank.go, errors in scheduler/device.go, e.g.
# "devices: no devices match request") and AllocsFit's (nomad/structs/funcs.go).
_DEVICE_DIMENSION_PREFIX = "devices: "
_DEVICE_OVERSUBSCRIBED = "device oversubscribed"


@dataclass(frozen=True)
class GpuNeed:
    """What one replica asks for: `count` nvidia/gpu devices (profile.gpus), each with at
    least `memory_bytes` of memory (profile.gpu_memory; None: any)."""

    count: int
    memory_bytes: int | None = None


@dataclass(frozen=True)
class NodeGpus:
    """One schedulable node's healthy nvidia/gpu instances: `memory_bytes` has one entry per
    instance (None where the device reports no memory attribute); empty for a node with none.

    Nomad places a device request on instances of one device model (scheduler/feasible.go
    `hasDevices`); a node mixing GPU models is counted here as if they were one."""

    node: str
    memory_bytes: tuple[int | None, ...]


@dataclass(frozen=True)
class EngineNeed:
    """The engine a model's job constrains on: `name` at `version`, recorded in node
    metadata `llmgw_engine_<name>` by its install job (planner/daemon/engine_install.py);
    `installed` of `nodes` schedulable nodes have it (None: not counted); `crashed`:
    (node, how it died) where its install's run-once check crashed."""

    name: str
    version: str
    installed: int | None = None
    nodes: int | None = None
    crashed: tuple[tuple[str, str], ...] = ()

    @property
    def constraint(self) -> str:
        """The constraint as Nomad names it in ConstraintFiltered (structs.Constraint's
        String: "LTarget Operand RTarget"), as the job template writes it."""
        return f"${{meta.{ENGINE_META_PREFIX}{self.name}}} = {self.version}"


@dataclass(frozen=True)
class Shortfall:
    """An evaluation left replicas unplaced: `reason` is one sentence an operator can act on;
    `placed` and `desired` are replica counts."""

    reason: str
    placed: int
    desired: int


def gpu_inventory(
    nodes: Sequence[Mapping[str, Any]],
    *,
    datacenters: Sequence[str] = ("*",),
    node_pool: str | None = None,
) -> list[NodeGpus]:
    """Nomad's `GET /v1/nodes?resources=true` stubs -> one NodeGpus per node the scheduler
    would evaluate, in the order given.

    Only nodes that are ready, not draining and eligible (Nomad's `Node.Ready()`), in one of
    `datacenters` (globs, as in a job) and in `node_pool` (None or "all": any pool): the same
    set scheduler/util.go `readyNodesInDCsAndPool` hands the scheduler, so the inventory
    explains the nodes the AllocMetric counted and a down node's large GPU does not make
    "none with enough memory" false. Only NodeResources.Devices with Vendor "nvidia" and Type
    "gpu", only instances with Healthy true (Nomad allocates no unhealthy instance,
    nomad/structs/devices.go). The memory attribute is {"Int"|"Float": n, "Unit": "MiB"}
    (plugins/shared/structs/attribute.go). Raises ValueError for a stub without
    NodeResources: it was listed without `resources=true`, and would read as "no GPU".
    """
    inventory = []
    for node in nodes:
        if not _schedulable(node, datacenters, node_pool):
            continue
        resources = node.get("NodeResources")
        if resources is None:
            raise ValueError(
                f"node {node.get('Name')!r} has no NodeResources: "
                "list nodes with GET /v1/nodes?resources=true"
            )
        memory: list[int | None] = []
        for device in resources.get("Devices") or []:
            if (device.get("Vendor"), device.get("Type")) != (GPU_VENDOR, GPU_TYPE):
                continue
            size = _attribute_bytes((device.get("Attributes") or {}).get("memory"))
            memory += [
                size for instance in device.get("Instances") or [] if instance.get("Healthy")
            ]
        inventory.append(NodeGpus(node=node.get("Name", ""), memory_bytes=tuple(memory)))
    return inventory


def evaluation_shortfall(
    evaluation: Mapping[str, Any],
    desired: int,
    need: GpuNeed | None = None,
    gpus: Sequence[NodeGpus] = (),
    *,
    engine: EngineNeed | None = None,
) -> Shortfall | None:
    """What an evaluation (or plan answer) left unplaced and why; None when it left nothing.

    `desired` is the task group's count. Each failed task group stands for
    1 + CoalescedFailures unplaced allocations (Nomad keeps the first failure's metric and
    counts the rest, scheduler/generic_sched.go); `desired` is raised to that number if it
    is lower. `need` is None for a model without GPUs; `gpus` is `gpu_inventory(...)`, empty
    when unknown (then device mismatches are told without naming which). `engine` is the
    versioned engine the job constrains on (None: an LLMGW_ENGINES engine, no constraint).
    """
    failed = {
        group: metric or {} for group, metric in (evaluation.get("FailedTGAllocs") or {}).items()
    }
    if not failed:
        return None
    unplaced = sum(1 + int(metric.get("CoalescedFailures") or 0) for metric in failed.values())
    desired = max(desired, unplaced)
    reasons = dict.fromkeys(
        metric_reason(failed[group], need, gpus, engine=engine) for group in sorted(failed)
    )
    reason = "; ".join(reasons)
    placed = desired - unplaced
    if placed:
        reason = f"{_partly_placed(placed, desired)}{reason}"
    return Shortfall(reason=reason, placed=placed, desired=desired)


def _partly_placed(placed: int, desired: int) -> str:
    """The head of a partial placement's reason: "2 of 3 replicas placed; "."""
    return f"{placed} of {desired} replicas placed; "


def scale_shortfall(reason: str, placed: int, desired: int) -> str:
    """A scale-up that fits nowhere, in the words of issue 22 ("capacity is honest"):
    `evaluation_shortfall`'s "2 of 3 replicas placed; memory exhausted on 1 of 1 nodes"
    with placed 2 and desired 3 -> "wants 3, 2 placed: memory exhausted on 1 of 1 nodes".
    Shown by `planner status`, the admin API and the planner's log for a scaling model
    that serves what it has."""
    cause = reason.removeprefix(_partly_placed(placed, desired))
    return f"wants {desired}, {placed} placed: {cause}"


def evaluation_reason(
    evaluation: Mapping[str, Any], *, engine: EngineNeed | None = None
) -> str | None:
    """The reason an evaluation left allocations unplaced, or None if it placed them all;
    for callers without the task group count or an inventory (e.g. `apply --dry-run`)."""
    shortfall = evaluation_shortfall(evaluation, desired=0, engine=engine)
    return shortfall.reason if shortfall else None


def metric_reason(
    metric: Mapping[str, Any],
    need: GpuNeed | None = None,
    gpus: Sequence[NodeGpus] = (),
    *,
    engine: EngineNeed | None = None,
) -> str:
    """One AllocMetric -> its reasons, a missing engine first, then devices, joined by
    '; '."""
    total = int(metric.get("NodesEvaluated") or 0)
    if total == 0:
        pools = ", ".join(sorted(metric.get("NodesAvailable") or {})) or "none"
        return f"no ready node to evaluate (datacenters with nodes: {pools})"
    parts = _filtered(metric, total, need, gpus, engine) + _exhausted(metric, total, need)
    if not parts and metric.get("NodesExhausted"):
        parts.append(f"resources exhausted on {_nodes(metric['NodesExhausted'], total)}")
    if not parts:
        parts.append(f"no node fits ({_nodes(metric.get('NodesFiltered') or 0, total)} filtered)")
    return "; ".join(parts)


def _filtered(
    metric: Mapping[str, Any],
    total: int,
    need: GpuNeed | None,
    gpus: Sequence[NodeGpus],
    engine: EngineNeed | None = None,
) -> list[str]:
    constraints = dict(metric.get("ConstraintFiltered") or {})
    same_class = constraints.pop(COMPUTED_CLASS_INELIGIBLE, 0)
    if not constraints and same_class and _lacking_gpus(need, gpus) == same_class:
        # An evaluation that rejected every node by class alone names no reason: Nomad's
        # blocked evaluation, run again when capacity changes, starts from the classes the
        # first one found ineligible (seen with fake GPUs: a second replica asking for
        # 24 GiB, gpu-b's one GPU taken). The inventory has exactly that many nodes
        # without the GPUs asked for, so it is the device request.
        constraints[MISSING_DEVICES], same_class = same_class, 0
    if len(constraints) == 1:
        # One real reason in this evaluation: every rejected class was rejected for it.
        (only,) = constraints
        constraints[only] += same_class
        same_class = 0
    parts = []
    if engine is not None and engine.constraint in constraints:
        without = constraints.pop(engine.constraint)
        parts.append(_missing_engine(without, total, engine))
        if MISSING_DEVICES in constraints and _engine_somewhere(without, total, engine):
            # The nodes with the engine lack the devices and those with the devices lack
            # the engine: each part alone reads as if the other would do.
            asked = f"{need.count} {GPU}{_at_least(need)}" if need else "the devices asked for"
            parts.insert(0, f"no node has both engine {engine.name} {engine.version} and {asked}")
    if MISSING_DEVICES in constraints:
        parts.append(_missing_devices(constraints.pop(MISSING_DEVICES), total, need, gpus))
    for constraint, count in sorted(constraints.items()):
        lead = _CONSTRAINT_WORDS.get(constraint, f"constraint {constraint} not met")
        parts.append(f'{lead}: {_nodes(count, total)} filtered ("{constraint}")')
    if same_class and parts:
        parts.append(f"{_count(same_class, 'more node')} of the same node classes filtered")
    elif same_class:
        parts.append(f"no node class is eligible: {_nodes(same_class, total)} filtered")
    return parts


def _missing_devices(
    filtered: int, total: int, need: GpuNeed | None, gpus: Sequence[NodeGpus]
) -> str:
    if need is None or need.count < 1:
        return (
            f"no node has the devices the job asks for: {_nodes(filtered, total)} "
            f'filtered ("{MISSING_DEVICES}")'
        )
    head = f"needs {need.count} {GPU}{_at_least(need)}"
    unexplained = (
        f'{head}: no node matches ({_nodes(filtered, total)} filtered, "{MISSING_DEVICES}")'
    )
    if not gpus:
        return unexplained
    with_gpus = [node for node in gpus if node.memory_bytes]
    if not with_gpus:
        return f"{head}: no node has an {GPU} device ({_nodes(filtered, total)} filtered)"
    most = max(_fitting(node, need) for node in with_gpus)
    if need.memory_bytes is not None and most == 0:
        return (
            f"{head}: {_count(len(with_gpus), 'node')} {_have(len(with_gpus))} GPUs, "
            f"none with enough memory ({_largest(with_gpus)})"
        )
    if most < need.count:
        return f"{head}: the most{_at_least(need)} on one node is {most}"
    if all(_fitting(node, need) >= need.count for node in gpus):
        # Nomad disagrees with the inventory: it is stale, or a node's GPUs are of several
        # models (one request is placed on one model).
        return unexplained
    lacking = "none" if need.count == 1 else "fewer"
    return f"{head}: {_nodes(filtered, total)} {_have(filtered)} {lacking}"


def _lacking_gpus(need: GpuNeed | None, gpus: Sequence[NodeGpus]) -> int | None:
    """How many nodes of the inventory lack the GPUs one replica asks for (None: no
    GPU need, or no inventory)."""
    if need is None or need.count < 1 or not gpus:
        return None
    return sum(1 for node in gpus if _fitting(node, need) < need.count)


def _engine_somewhere(filtered: int, total: int, engine: EngineNeed) -> bool:
    """Some node has the engine (the metadata count, else the scheduler's)."""
    return (engine.installed if engine.installed is not None else total - filtered) > 0


def _missing_engine(filtered: int, total: int, engine: EngineNeed) -> str:
    """ "engine llama.cpp 11434 is installed on 0 of 2 nodes": the count is of the
    schedulable nodes' metadata when known, else of the nodes the scheduler did not
    filter for it."""
    installed = engine.installed if engine.installed is not None else total - filtered
    nodes = engine.nodes if engine.nodes is not None else total
    counted = f"installed on {_nodes(installed, nodes)}"
    if not engine.crashed:
        return f"engine {engine.name} {engine.version} is {counted}"
    # "engine x 1 crashed on node n1: SIGILL (exit 132): ...": the crash is the reason
    # it is missing there, so it comes first; nodes that died alike are named together.
    by_how: dict[str, list[str]] = {}
    for node, how in engine.crashed:
        by_how.setdefault(how, []).append(node)
    crashes = "; ".join(
        f"on node{'s' if len(n) > 1 else ''} {', '.join(sorted(n))}: {how}"
        for how, n in by_how.items()
    )
    return f"engine {engine.name} {engine.version} crashed {crashes} ({counted})"


def _exhausted(metric: Mapping[str, Any], total: int, need: GpuNeed | None) -> list[str]:
    parts, devices = [], 0
    for dimension, count in sorted((metric.get("DimensionExhausted") or {}).items()):
        if dimension.startswith(_DEVICE_DIMENSION_PREFIX) or dimension == _DEVICE_OVERSUBSCRIBED:
            devices += count
        else:
            parts.append(f"{dimension} exhausted on {_nodes(count, total)}")
    if devices:
        what = f"{GPU} devices{_at_least(need)}" if need else "devices"
        parts.insert(0, f"{what} in use on {_nodes(devices, total)}")
    return parts


def schedulable(
    node: Mapping[str, Any], datacenters: Sequence[str] = ("*",), node_pool: str | None = None
) -> bool:
    """A node stub the scheduler would evaluate (see `gpu_inventory`)."""
    return _schedulable(node, datacenters, node_pool)


def _schedulable(
    node: Mapping[str, Any], datacenters: Sequence[str], node_pool: str | None
) -> bool:
    return (
        node.get("Status") == "ready"
        and not node.get("Drain")
        and node.get("SchedulingEligibility") == "eligible"
        and any(fnmatchcase(node.get("Datacenter", ""), dc) for dc in datacenters)
        and node_pool in (None, "all", node.get("NodePool"))
    )


def _attribute_bytes(attribute: Mapping[str, Any] | None) -> int | None:
    """{"Int": 16384, "Unit": "MiB"} -> bytes; None when absent, not a number or not bytes."""
    if not attribute:
        return None
    value = attribute.get("Int")
    if value is None:
        value = attribute.get("Float")
    if value is None:
        return None
    try:
        return parse_bytes(f"{value} {attribute.get('Unit') or ''}")
    except ValueError:
        return None


def _fitting(node: NodeGpus, need: GpuNeed) -> int:
    # A device without a memory attribute fails a `${device.attr.memory} >=` constraint.
    if need.memory_bytes is None:
        return len(node.memory_bytes)
    return sum(1 for size in node.memory_bytes if size is not None and size >= need.memory_bytes)


def _largest(nodes: Sequence[NodeGpus]) -> str:
    sizes = [size for node in nodes for size in node.memory_bytes if size is not None]
    return f"largest {_size(max(sizes))}" if sizes else "none reports its memory"


def _at_least(need: GpuNeed | None) -> str:
    return f" with ≥ {_size(need.memory_bytes)}" if need and need.memory_bytes else ""


def _size(size: int) -> str:
    unit, scale = ("GiB", 2**30) if size >= 2**30 else ("MiB", 2**20)
    return f"{size / scale:.1f}".removesuffix(".0") + f" {unit}"


def _nodes(count: int, total: int) -> str:
    return f"{count} of {_count(total, 'node')}"


def _count(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _have(count: int) -> str:
    return "has" if count == 1 else "have"


@dataclass(frozen=True)
class WarningLog:
    """When the placement warning was last logged, and with which reason."""

    reason: str | None = None
    at: datetime | None = None


def should_warn(last: WarningLog, reason: str, now: datetime) -> bool:
    """Log when the reason is new or changed, or REPEAT_WARNING after the last time."""
    return last.reason != reason or last.at is None or now - last.at >= REPEAT_WARNING
