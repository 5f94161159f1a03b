"""planner.model.placement: an evaluation's AllocMetric, the GPU ask and the inventory ->
one reason.

The factories below build Nomad 1.6.3's JSON (api/allocations.go AllocationMetric,
api/evaluations.go Evaluation, api/nodes.go NodeListStub with NodeResources) from a canonical
object, like Nomad's nomad/mock: a test names only what differs.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from planner.model.placement import (
    GpuNeed,
    NodeGpus,
    Shortfall,
    WarningLog,
    evaluation_reason,
    evaluation_shortfall,
    gpu_inventory,
    scale_shortfall,
    should_warn,
)

GiB, MiB = 2**30, 2**20


# --- factories -----------------------------------------------------------------------------


def alloc_metric(**overrides: Any) -> dict[str, Any]:
    """An AllocationMetric for one evaluated node, nothing filtered or exhausted yet."""
    return {
        "NodesEvaluated": 1,
        "NodesFiltered": 0,
        "NodesInPool": 1,
        "NodesAvailable": {"dc1": 1},
        "ClassFiltered": None,
        "ConstraintFiltered": None,
        "NodesExhausted": 0,
        "ClassExhausted": None,
        "DimensionExhausted": None,
        "QuotaExhausted": None,
        "ResourcesExhausted": None,
        "Scores": None,
        "AllocationTime": 48_213,
        "CoalescedFailures": 0,
        "ScoreMetaData": None,
    } | overrides


def filtered(nodes: int, constraints: dict[str, int], **overrides: Any) -> dict[str, Any]:
    """`nodes` evaluated, those in `constraints` filtered (FilterNode's counters)."""
    return alloc_metric(
        NodesEvaluated=nodes,
        NodesInPool=nodes,
        NodesAvailable={"dc1": nodes},
        NodesFiltered=sum(constraints.values()),
        ConstraintFiltered=constraints,
        **overrides,
    )


def exhausted(nodes: int, dimensions: dict[str, int], **overrides: Any) -> dict[str, Any]:
    """`nodes` evaluated, those in `dimensions` exhausted (ExhaustedNode's counters)."""
    return alloc_metric(
        NodesEvaluated=nodes,
        NodesInPool=nodes,
        NodesAvailable={"dc1": nodes},
        NodesExhausted=sum(dimensions.values()),
        DimensionExhausted=dimensions,
        **overrides,
    )


def evaluation(metric: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """A completed evaluation of job "m" whose task group "server" failed with `metric`."""
    return {
        "ID": "5b4c0c1e-5b0f-4d55-a9b8-4a6a6f0d3c21",
        "Namespace": "default",
        "Priority": 50,
        "Type": "service",
        "TriggeredBy": "job-register",
        "JobID": "m",
        "JobModifyIndex": 12,
        "Status": "complete",
        "StatusDescription": "",
        "BlockedEval": "0f2c6f3a-8d4e-4b7a-9a51-2d7f3c9e8b10",
        "FailedTGAllocs": {"server": metric or alloc_metric()},
        "ClassEligibility": None,
        "EscapedComputedClass": False,
        "QueuedAllocations": {"server": 1},
        "SnapshotIndex": 14,
        "CreateIndex": 13,
        "ModifyIndex": 15,
        "CreateTime": 1_764_417_600_000_000_000,
        "ModifyTime": 1_764_417_600_050_000_000,
    } | overrides


def gpu_device(
    memory_mib: int | None,
    *healthy: bool,
    vendor: str = "nvidia",
    kind: str = "gpu",
    name: str = "Tesla T4",
) -> dict[str, Any]:
    """A NodeDeviceResource with one instance per `healthy` flag, as the nvidia plugin reports."""
    attributes: dict[str, Any] = {
        "driver_version": {
            "Float": None,
            "Int": None,
            "String": "535.104.05",
            "Bool": None,
            "Unit": "",
        },
        "cores_clock": {"Float": None, "Int": 1590, "String": None, "Bool": None, "Unit": "MHz"},
    }
    if memory_mib is not None:
        attributes["memory"] = {
            "Float": None,
            "Int": memory_mib,
            "String": None,
            "Bool": None,
            "Unit": "MiB",
        }
    return {
        "Vendor": vendor,
        "Type": kind,
        "Name": name,
        "Attributes": attributes,
        "Instances": [
            {
                "ID": f"GPU-{name}-{i}",
                "Healthy": ok,
                "HealthDescription": "" if ok else "XID error 79",
                "Locality": {"PciBusID": f"00000000:0{i}:00.0"},
            }
            for i, ok in enumerate(healthy)
        ],
    }


def node_stub(name: str, *devices: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """A NodeListStub from GET /v1/nodes?resources=true: ready, eligible, in dc1."""
    return {
        "Address": "127.0.0.1",
        "ID": f"{name}-7f3e9c2a",
        "Datacenter": "dc1",
        "Name": name,
        "NodeClass": "",
        "NodePool": "default",
        "Version": "1.6.3",
        "Drain": False,
        "SchedulingEligibility": "eligible",
        "Status": "ready",
        "StatusDescription": "",
        "Attributes": {"kernel.name": "linux", "nomad.version": "1.6.3"},
        "Drivers": {"raw_exec": {"Detected": True, "Healthy": True}},
        "NodeResources": {
            "Cpu": {"CpuShares": 16000, "TotalCpuCores": 8, "ReservableCpuCores": list(range(8))},
            "Memory": {"MemoryMB": 64000},
            "Disk": {"DiskMB": 400000},
            "Networks": None,
            "Devices": list(devices),
            "MinDynamicPort": 20000,
            "MaxDynamicPort": 32000,
        },
        "ReservedResources": {
            "Cpu": {"CpuShares": 0},
            "Memory": {"MemoryMB": 0},
            "Disk": {"DiskMB": 0},
            "Networks": {"ReservedHostPorts": ""},
        },
        "LastDrain": None,
        "CreateIndex": 7,
        "ModifyIndex": 9,
    } | overrides


def reason(
    metric: dict[str, Any],
    need: GpuNeed | None = None,
    gpus: tuple[NodeGpus, ...] = (),
    desired: int = 1,
) -> str:
    shortfall = evaluation_shortfall(evaluation(metric), desired, need, gpus)
    assert shortfall is not None
    return shortfall.reason


NO_GPU = (NodeGpus("dev", ()),)
T4S = (NodeGpus("a", (16 * GiB,)), NodeGpus("b", (16 * GiB,)))


# --- reasons -------------------------------------------------------------------------------


def test_no_gpu_anywhere_with_a_memory_constraint() -> None:
    assert (
        reason(filtered(1, {"missing devices": 1}), GpuNeed(1, 24 * GiB), NO_GPU)
        == "needs 1 nvidia/gpu with ≥ 24 GiB: no node has an nvidia/gpu device "
        "(1 of 1 node filtered)"
    )


def test_no_gpu_anywhere_without_a_memory_constraint() -> None:
    assert (
        reason(filtered(1, {"missing devices": 1}), GpuNeed(1), NO_GPU)
        == "needs 1 nvidia/gpu: no node has an nvidia/gpu device (1 of 1 node filtered)"
    )


def test_gpus_too_small_name_the_largest() -> None:
    metric = filtered(2, {"missing devices": 1, "computed class ineligible": 1})
    assert reason(metric, GpuNeed(1, 24 * GiB), T4S) == (
        "needs 1 nvidia/gpu with ≥ 24 GiB: "
        "2 nodes have GPUs, none with enough memory (largest 16 GiB)"
    )


def test_gpus_without_a_memory_attribute_never_have_enough() -> None:
    metric = filtered(1, {"missing devices": 1})
    assert reason(metric, GpuNeed(1, 8 * GiB), (NodeGpus("a", (None,)),)).endswith(
        "1 node has GPUs, none with enough memory (none reports its memory)"
    )


def test_more_gpus_asked_than_one_node_has() -> None:
    gpus = (NodeGpus("a", (16 * GiB,) * 2), NodeGpus("b", (16 * GiB,)))
    metric = filtered(2, {"missing devices": 2})
    assert reason(metric, GpuNeed(3), gpus) == "needs 3 nvidia/gpu: the most on one node is 2"


def test_more_gpus_asked_counts_only_those_with_enough_memory() -> None:
    gpus = (NodeGpus("a", (16 * GiB,) * 4), NodeGpus("b", (24 * GiB, 24 * GiB, 16 * GiB)))
    metric = filtered(2, {"missing devices": 2})
    assert (
        reason(metric, GpuNeed(3, 24 * GiB), gpus)
        == "needs 3 nvidia/gpu with ≥ 24 GiB: the most with ≥ 24 GiB on one node is 2"
    )


def test_some_nodes_have_the_gpu_the_rest_are_counted() -> None:
    gpus = (NodeGpus("big", (48 * GiB,)), *T4S)
    metric = filtered(
        3,
        {"missing devices": 1, "computed class ineligible": 1},
        NodesExhausted=1,
        DimensionExhausted={"memory": 1},
    )
    assert reason(metric, GpuNeed(1, 24 * GiB), gpus) == (
        "needs 1 nvidia/gpu with ≥ 24 GiB: 2 of 3 nodes have none; memory exhausted on 1 of 3 nodes"
    )


def test_missing_devices_without_an_inventory_does_not_guess_why() -> None:
    assert reason(filtered(1, {"missing devices": 1}), GpuNeed(1, 24 * GiB)) == (
        "needs 1 nvidia/gpu with ≥ 24 GiB: no node matches "
        '(1 of 1 node filtered, "missing devices")'
    )


def test_missing_devices_for_a_model_without_a_gpu_need_stays_generic() -> None:
    assert (
        reason(filtered(1, {"missing devices": 1}))
        == 'no node has the devices the job asks for: 1 of 1 node filtered ("missing devices")'
    )


def test_gpus_that_would_fit_are_in_use() -> None:
    metric = exhausted(2, {"devices: no devices match request": 2})
    assert (
        reason(metric, GpuNeed(1, 24 * GiB), (NodeGpus("a", (40 * GiB,)),) * 2)
        == "nvidia/gpu devices with ≥ 24 GiB in use on 2 of 2 nodes"
    )
    assert reason(metric, GpuNeed(1)) == "nvidia/gpu devices in use on 2 of 2 nodes"
    assert reason(exhausted(1, {"device oversubscribed": 1})) == "devices in use on 1 of 1 node"


def test_memory_and_cpu_exhausted() -> None:
    assert reason(exhausted(3, {"memory": 2})) == "memory exhausted on 2 of 3 nodes"
    assert (
        reason(exhausted(3, {"cpu": 1, "memory": 2}))
        == "cpu exhausted on 1 of 3 nodes; memory exhausted on 2 of 3 nodes"
    )


def test_other_constraints_keep_nomads_words() -> None:
    assert (
        reason(filtered(1, {"missing drivers": 1}))
        == 'no node has the task driver: 1 of 1 node filtered ("missing drivers")'
    )
    assert (
        reason(filtered(2, {"${attr.kernel.name} = windows": 2}))
        == "constraint ${attr.kernel.name} = windows not met: 2 of 2 nodes filtered "
        '("${attr.kernel.name} = windows")'
    )


def test_no_ready_node() -> None:
    metric = alloc_metric(NodesEvaluated=0, NodesInPool=0, NodesAvailable={"dc1": 0})
    assert reason(metric, GpuNeed(1)) == "no ready node to evaluate (datacenters with nodes: dc1)"


# --- computed classes, partial placement, nothing unplaced ---------------------------------


def test_computed_class_ineligible_is_folded_into_the_real_reason() -> None:
    # Three identical nodes: Nomad checks the first and files the other two, same computed
    # class, as "computed class ineligible" (scheduler/feasible.go FeasibilityWrapper).
    three = filtered(
        3, {"missing devices": 1, "computed class ineligible": 2}, ClassFiltered={"gpu-small": 3}
    )
    gpus = tuple(NodeGpus(name, ()) for name in "abc")
    text = reason(three, GpuNeed(1), gpus)
    assert text == "needs 1 nvidia/gpu: no node has an nvidia/gpu device (3 of 3 nodes filtered)"
    assert "class" not in text
    drivers = filtered(3, {"missing drivers": 1, "computed class ineligible": 2})
    assert (
        reason(drivers) == 'no node has the task driver: 3 of 3 nodes filtered ("missing drivers")'
    )


def test_only_computed_classes_filtered_is_the_gpu_request_when_the_inventory_says_so() -> None:
    # A blocked evaluation run again (a second replica, the one big GPU taken) files the
    # nodes it already rejected under their class alone (tests/integration/test_gpus.py).
    metric = filtered(
        3,
        {"computed class ineligible": 2},
        NodesExhausted=1,
        DimensionExhausted={"devices: no devices match request": 1},
    )
    gpus = (NodeGpus("dev", ()), NodeGpus("a", (16 * GiB, 16 * GiB)), NodeGpus("b", (80 * GiB,)))
    assert reason(metric, GpuNeed(1, 24 * GiB), gpus, desired=2) == (
        "1 of 2 replicas placed; needs 1 nvidia/gpu with ≥ 24 GiB: 2 of 3 nodes have none; "
        "nvidia/gpu devices with ≥ 24 GiB in use on 1 of 3 nodes"
    )
    # When the inventory does not account for them, the class is all there is to say.
    assert reason(metric, GpuNeed(1), gpus).startswith(
        "no node class is eligible: 2 of 3 nodes filtered"
    )


def test_computed_class_ineligible_with_two_real_reasons_is_counted_not_named() -> None:
    metric = filtered(
        4, {"missing drivers": 1, "missing devices": 1, "computed class ineligible": 2}
    )
    text = reason(metric, GpuNeed(1), tuple(NodeGpus(n, ()) for n in "abcd"))
    assert text == (
        "needs 1 nvidia/gpu: no node has an nvidia/gpu device (1 of 4 nodes filtered); "
        'no node has the task driver: 1 of 4 nodes filtered ("missing drivers"); '
        "2 more nodes of the same node classes filtered"
    )


def test_partial_placement_says_how_many_replicas_were_placed() -> None:
    metric = exhausted(3, {"memory": 3}, CoalescedFailures=1)
    assert evaluation_shortfall(evaluation(metric), 3) == Shortfall(
        reason="1 of 3 replicas placed; memory exhausted on 3 of 3 nodes", placed=1, desired=3
    )


def test_a_scale_up_short_of_room_reads_wants_n_m_placed() -> None:
    """Issue 22's words for a scaling model serving short of its scale-up."""
    metric = exhausted(2, {"memory": 2})
    short = evaluation_shortfall(evaluation(metric), 3)
    assert short is not None
    assert scale_shortfall(short.reason, short.placed, short.desired) == (
        "wants 3, 2 placed: memory exhausted on 2 of 2 nodes"
    )
    nothing = evaluation_shortfall(evaluation(exhausted(1, {"memory": 1})), 1)
    assert nothing is not None
    assert scale_shortfall(nothing.reason, nothing.placed, nothing.desired) == (
        "wants 1, 0 placed: memory exhausted on 1 of 1 node"
    )


def test_nothing_placed_has_no_prefix_and_desired_covers_the_unplaced() -> None:
    metric = exhausted(1, {"memory": 1}, CoalescedFailures=2)
    assert evaluation_shortfall(evaluation(metric), 3) == Shortfall(
        reason="memory exhausted on 1 of 1 node", placed=0, desired=3
    )
    assert evaluation_shortfall(evaluation(metric), 1) == Shortfall(
        reason="memory exhausted on 1 of 1 node", placed=0, desired=3
    )


@pytest.mark.parametrize("failed", [None, {}])
def test_an_evaluation_that_placed_everything_has_no_shortfall(failed: dict | None) -> None:
    done = evaluation(FailedTGAllocs=failed, BlockedEval="", QueuedAllocations={"server": 0})
    assert evaluation_shortfall(done, 2, GpuNeed(1), NO_GPU) is None
    assert evaluation_reason(done) is None


def test_evaluation_reason_is_the_reason_without_counts() -> None:
    metric = exhausted(3, {"memory": 3}, CoalescedFailures=1)
    assert evaluation_reason(evaluation(metric)) == "memory exhausted on 3 of 3 nodes"


# --- inventory -----------------------------------------------------------------------------


def test_gpu_inventory_reads_healthy_nvidia_gpus_of_schedulable_nodes() -> None:
    nodes = [
        node_stub(
            "gpu-1",
            gpu_device(15360, True, False),
            gpu_device(81920, True, name="NVIDIA H100 80GB HBM3"),
            gpu_device(None, True, name="Tesla K80"),
            gpu_device(16368, True, vendor="amd", name="Radeon Pro W6800"),
        ),
        node_stub("cpu-1"),
        node_stub("gpu-down", gpu_device(81920, True), Status="down"),
        node_stub("gpu-draining", gpu_device(81920, True), Drain=True),
        node_stub("gpu-ineligible", gpu_device(81920, True), SchedulingEligibility="ineligible"),
        node_stub("gpu-dc2", gpu_device(81920, True), Datacenter="dc2"),
        node_stub("gpu-batch", gpu_device(81920, True), NodePool="batch"),
    ]
    assert gpu_inventory(nodes, datacenters=["dc1"], node_pool="default") == [
        NodeGpus("gpu-1", (15 * GiB, 80 * GiB, None)),
        NodeGpus("cpu-1", ()),
    ]
    everywhere = gpu_inventory(nodes)
    assert [n.node for n in everywhere] == ["gpu-1", "cpu-1", "gpu-dc2", "gpu-batch"]
    assert [n.node for n in gpu_inventory(nodes, datacenters=["dc*"], node_pool="batch")] == [
        "gpu-batch"
    ]


def test_gpu_inventory_refuses_stubs_listed_without_resources() -> None:
    with pytest.raises(ValueError, match="resources=true"):
        gpu_inventory([node_stub("gpu-1", NodeResources=None)])


def test_inventory_from_real_stubs_explains_a_too_small_gpu() -> None:
    gpus = gpu_inventory([node_stub("gpu-1", gpu_device(16384, True, True))])
    assert reason(filtered(1, {"missing devices": 1}), GpuNeed(2, 24 * GiB), gpus) == (
        "needs 2 nvidia/gpu with ≥ 24 GiB: 1 node has GPUs, none with enough memory "
        "(largest 16 GiB)"
    )
    assert reason(filtered(1, {"missing devices": 1}), GpuNeed(2, 15 * GiB + 512 * MiB), gpus) == (
        "needs 2 nvidia/gpu with ≥ 15.5 GiB: no node matches "
        '(1 of 1 node filtered, "missing devices")'
    )


WARN_T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def test_placement_warning_once_then_on_change_or_every_ten_minutes() -> None:
    log, now, warned = WarningLog(), WARN_T0, 0
    for minute in range(0, 25):
        now = WARN_T0 + timedelta(minutes=minute)
        if should_warn(log, "no gpu", now):
            warned += 1
            log = WarningLog("no gpu", now)
    assert warned == 3  # at 0, 10 and 20 minutes, not once per evaluation
    assert should_warn(log, "memory exhausted", now + timedelta(seconds=1))
