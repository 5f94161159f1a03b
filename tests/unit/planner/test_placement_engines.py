"""A model whose engine is not installed: the scheduler's constraint filter on
`${meta.llmgw_engine_<name>}` becomes "engine X V is installed on N of M nodes".

Uses the canonical AllocMetric and evaluation factories of test_placement."""

from __future__ import annotations

from planner.model.placement import EngineNeed, GpuNeed, evaluation_shortfall
from planner.model.unplaceable import engine_need
from tests.unit.planner.test_placement import evaluation, exhausted, filtered

NEED = EngineNeed("llama.cpp", "11434")
CONSTRAINT = "${meta.llmgw_engine_llama.cpp} = 11434"


def reason(metric: dict, engine: EngineNeed | None = NEED, desired: int = 1) -> str:
    shortfall = evaluation_shortfall(evaluation(metric), desired, engine=engine)
    assert shortfall is not None
    return shortfall.reason


def test_the_constraint_is_named_as_nomad_files_it() -> None:
    assert NEED.constraint == CONSTRAINT


def test_an_engine_on_no_node_is_one_sentence_with_the_counts() -> None:
    # Two nodes of one computed class: Nomad checks the first, files the second as
    # "computed class ineligible"; both lack the engine.
    metric = filtered(2, {CONSTRAINT: 1, "computed class ineligible": 1})
    counted = EngineNeed("llama.cpp", "11434", installed=0, nodes=2)
    assert reason(metric, counted) == "engine llama.cpp 11434 is installed on 0 of 2 nodes"
    # Not counted (the metadata could not be read): the scheduler's own numbers.
    assert reason(metric) == "engine llama.cpp 11434 is installed on 0 of 2 nodes"


def test_a_missing_engine_comes_first_and_other_shortfalls_follow() -> None:
    metric = filtered(3, {CONSTRAINT: 2}) | {
        "NodesExhausted": 1,
        "DimensionExhausted": {"memory": 1},
    }
    counted = EngineNeed("llama.cpp", "11434", installed=1, nodes=3)
    assert reason(metric, counted) == (
        "engine llama.cpp 11434 is installed on 1 of 3 nodes; memory exhausted on 1 of 3 nodes"
    )


def test_without_an_engine_need_the_constraint_is_told_as_any_other() -> None:
    assert reason(filtered(1, {CONSTRAINT: 1}), None) == (
        f'constraint {CONSTRAINT} not met: 1 of 1 node filtered ("{CONSTRAINT}")'
    )
    assert reason(exhausted(1, {"memory": 1})) == "memory exhausted on 1 of 1 node"


def test_the_engine_need_is_read_from_the_jobs_constraint() -> None:
    job = {
        "TaskGroups": [
            {
                "Constraints": [
                    {
                        "LTarget": "${attr.consul.version}",
                        "Operand": "semver",
                        "RTarget": ">= 1.7.0",
                    },
                    {
                        "LTarget": "${meta.llmgw_engine_llama.cpp}",
                        "Operand": "=",
                        "RTarget": "11434",
                    },
                ]
            }
        ]
    }
    assert engine_need(job) == NEED
    assert engine_need({"TaskGroups": [{"Constraints": None}]}) is None
    assert engine_need(None) is None


def test_an_engine_only_where_the_gpus_are_not_says_no_node_has_both() -> None:
    # Two nodes: the GPU node lacks the engine, the node with the engine lacks GPUs.
    metric = filtered(2, {CONSTRAINT: 1, "missing devices": 1})
    counted = EngineNeed("llama.cpp", "11434", installed=1, nodes=2)
    shortfall = evaluation_shortfall(evaluation(metric), 1, GpuNeed(1, 24 * 2**30), engine=counted)
    assert shortfall is not None
    assert shortfall.reason.startswith(
        "no node has both engine llama.cpp 11434 and 1 nvidia/gpu with ≥ 24 GiB; "
        "engine llama.cpp 11434 is installed on 1 of 2 nodes; needs 1 nvidia/gpu"
    ), shortfall.reason
    # On no node at all: the engine alone is the reason, told as before.
    nowhere = EngineNeed("llama.cpp", "11434", installed=0, nodes=2)
    assert (
        "no node has both"
        not in evaluation_shortfall(
            evaluation(filtered(2, {CONSTRAINT: 1, "missing devices": 1})),
            1,
            GpuNeed(1, None),
            engine=nowhere,
        ).reason
    )


def test_nodes_where_the_engine_crashed_alike_are_named_together() -> None:
    metric = filtered(2, {CONSTRAINT: 1, "computed class ineligible": 1})
    crashed = EngineNeed(
        "llama.cpp",
        "11434",
        installed=0,
        nodes=2,
        crashed=(("n2", "SIGSEGV (exit 139)"), ("n1", "SIGSEGV (exit 139)")),
    )
    assert reason(metric, crashed).startswith(
        "engine llama.cpp 11434 crashed on nodes n1, n2: SIGSEGV (exit 139) "
        "(installed on 0 of 2 nodes)"
    )
