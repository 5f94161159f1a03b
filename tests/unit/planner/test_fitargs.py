"""planner.fitargs: the args that change llama-server's memory need, read as it reads them."""

from __future__ import annotations

import pytest

from planner.fitargs import DEFAULT, ServerArgs, bytes_per_element, server_args


def test_no_args_are_llama_servers_defaults() -> None:
    assert server_args([]) == (ServerArgs(None, "f16", "f16", 4, 512), [])
    assert server_args(["--threads", "2"]) == (DEFAULT, [])


def test_each_flag_in_its_forms_and_the_last_occurrence_wins() -> None:
    args = ["-ngl", "10", "--n-gpu-layers", "20", "-ctk", "q8_0", "--cache-type-v", "q4_0",
            "-np", "1", "-ub", "128"]
    assert server_args(args) == (ServerArgs(20, "q8_0", "q4_0", 1, 128), [])
    assert server_args(["--gpu-layers", "all"])[0].gpu_layers is None
    assert server_args(["-ngl", "auto"])[0].gpu_layers is None
    assert server_args(["--parallel", "-1"])[0].parallel == 4  # -1: auto


@pytest.mark.parametrize(("cache_type", "expected"), [
    ("f16", 2.0), ("f32", 4.0), ("bf16", 2.0), ("q8_0", 34 / 32), ("q4_0", 18 / 32),
    ("q5_1", 24 / 32), ("iq4_nl", 18 / 32)])
def test_bytes_per_element_come_from_ggmls_block_sizes(cache_type: str,
                                                       expected: float) -> None:
    assert bytes_per_element(cache_type) == expected


def test_values_llama_server_refuses_are_problems_at_their_index() -> None:
    args, problems = server_args(["-ngl", "many", "-ctk", "q3_k", "-np", "x", "-ub", "1.5"])
    assert args == DEFAULT
    assert [i for i, _ in problems] == [1, 3, 5, 7]
    assert problems[1][1].startswith("expected a cache type, one of f32, f16")
