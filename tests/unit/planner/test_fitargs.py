"""planner.engines.fitargs: the args that change llama-server's memory need, read as it
reads them."""

from __future__ import annotations

import pytest

from planner.engines.fitargs import (
    DEFAULT,
    ServerArgs,
    bytes_per_element,
    server_args,
    slot_cells,
    slots,
)


def test_no_args_are_llama_servers_defaults_but_one_slot() -> None:
    assert server_args([]) == (ServerArgs(None, "f16", "f16", 1, 512), [])
    assert server_args(["--threads", "2"]) == (DEFAULT, [])


def test_each_flag_in_its_forms_and_the_last_occurrence_wins() -> None:
    args = [
        "-ngl",
        "10",
        "--n-gpu-layers",
        "20",
        "-ctk",
        "q8_0",
        "--cache-type-v",
        "q4_0",
        "-np",
        "1",
        "-ub",
        "128",
    ]
    assert server_args(args) == (ServerArgs(20, "q8_0", "q4_0", 1, 128), [])
    assert server_args(["--gpu-layers", "all"])[0].gpu_layers is None
    assert server_args(["-ngl", "auto"])[0].gpu_layers is None
    assert server_args(["--parallel", "3", "-np", "2"])[0].parallel == 2


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], 1),
        (["--threads", "2"], 1),
        (["--parallel", "4"], 4),
        (["-np", "2"], 2),
        (["-np", "2", "--parallel", "3"], 3),
        (["-np", "x"], 1),
        (["-np", "-1"], 1),
    ],
)
def test_slots_are_the_last_parallel_or_one(args: list[str], expected: int) -> None:
    assert slots(args) == expected


@pytest.mark.parametrize("value", ["-1", "0"])
def test_auto_or_no_slots_are_refused(value: str) -> None:
    args, [(index, message)] = server_args(["--threads", "2", "--parallel", value])
    assert (args.parallel, index) == (1, 3)
    assert message.startswith(
        f"expected a number of slots, 1 or more, got {value!r} (llama-server's auto"
    )


@pytest.mark.parametrize("args", [["-kvu"], ["--kv-unified"], ["--kv-unified-per-slot", "512"]])
def test_a_unified_cache_is_refused(args: list[str]) -> None:
    [(index, message)] = server_args(["--parallel", "2", *args])[1]
    assert index == 2 and message.startswith(
        f"{args[0]} is not for llmgw: every slot has its own cache of `profile.context` tokens"
    )


@pytest.mark.parametrize(
    ("context", "cells"), [(128, 256), (256, 256), (257, 512), (4096, 4096), (4097, 4352)]
)
def test_a_slot_holds_its_context_in_whole_blocks_of_256(context: int, cells: int) -> None:
    assert slot_cells(context) == cells


@pytest.mark.parametrize(
    ("cache_type", "expected"),
    [
        ("f16", 2.0),
        ("f32", 4.0),
        ("bf16", 2.0),
        ("q8_0", 34 / 32),
        ("q4_0", 18 / 32),
        ("q5_1", 24 / 32),
        ("iq4_nl", 18 / 32),
    ],
)
def test_bytes_per_element_come_from_ggmls_block_sizes(cache_type: str, expected: float) -> None:
    assert bytes_per_element(cache_type) == expected


def test_values_llama_server_refuses_are_problems_at_their_index() -> None:
    args, problems = server_args(["-ngl", "many", "-ctk", "q3_k", "-np", "x", "-ub", "1.5"])
    assert args == DEFAULT
    assert [i for i, _ in problems] == [1, 3, 5, 7]
    assert problems[1][1].startswith("expected a cache type, one of f32, f16")
