"""The llama.cpp engine: its arguments, health path and error lines (real stderr, trimmed)."""

from __future__ import annotations

import pytest

from planner.engines import KINDS, MODEL_FILE, NOMAD_PORT, engine
from planner.engines.llama_cpp import ENGINE, NOT_GGUF, stderr_summary


def test_the_registry_names_llama_cpp_and_refuses_an_unknown_kind() -> None:
    assert KINDS["llama.cpp"] is ENGINE is engine("llama.cpp")
    try:
        engine("vllm")
    except KeyError as exc:
        assert "unknown engine kind 'vllm' (known: llama.cpp)" in str(exc)
    else:
        raise AssertionError("no KeyError")


def test_server_args_serve_the_model_file_on_nomads_port() -> None:
    args = ENGINE.server_args("tiny", 512, gpus=0)
    assert args[:2] == ["--model", MODEL_FILE]
    assert args[args.index("--port") + 1] == NOMAD_PORT
    assert args[args.index("--ctx-size") + 1] == "512"
    assert "--n-gpu-layers" not in args
    assert ENGINE.server_args("tiny", 512, gpus=1)[-2:] == ["--n-gpu-layers", "999"]
    assert ENGINE.health_path == "/health"


def test_server_args_always_set_the_slots_and_give_each_the_whole_context() -> None:
    # Issue 20, item 2: without --parallel llama-server picks its own slot count, and
    # --ctx-size is split between the slots.
    def value(args: list[str], flag: str) -> str:
        assert args.count(flag) == 1
        return args[args.index(flag) + 1]

    one = ENGINE.server_args("tiny", 2048, gpus=0)
    assert (value(one, "--parallel"), value(one, "--ctx-size")) == ("1", "2048")
    four = ENGINE.server_args("tiny", 2048, gpus=0, args=["--threads", "2", "--parallel", "4"])
    assert (value(four, "--parallel"), value(four, "--ctx-size")) == ("4", "8192")
    two = ENGINE.server_args("tiny", 256, gpus=1, args=["-np", "3", "-np", "2"])
    assert (value(two, "--parallel"), value(two, "--ctx-size")) == ("2", "512")


def test_stderr_summary_keeps_the_cause_first() -> None:
    tail = (
        "0.01 I loading\n0.02 E llama_model_load: error loading model: unknown model "
        "architecture: 'kev'\n0.03 E failed to load model\n0.04 E exiting due to model "
        "loading error\n"
    )
    assert "unknown model architecture: 'kev'" in stderr_summary(tail).splitlines()[0]


# Real llama-server stderr (trimmed): a missing file and a file that is not GGUF.
MISSING = """\
0.00.004.312 I srv    load_model: loading model '/m/nope.gguf'
0.00.004.400 E gguf_init_from_file: failed to open GGUF file '/m/x' (No such file or directory)
0.00.004.420 E llama_model_load: error loading model: llama_model_loader: failed to load model
0.00.004.500 E srv  llama_server: exiting due to model loading error
"""
GARBAGE = MISSING.replace(
    "failed to open GGUF file '/m/x' (No such file or directory)",
    "invalid magic characters: '??B?', expected 'GGUF'",
)


def test_stderr_summary_names_what_tells_the_failures_apart() -> None:
    assert (
        stderr_summary(MISSING).splitlines()[0]
        == "gguf_init_from_file: failed to open GGUF file '/m/x' (No such file or directory)"
    )
    assert (
        stderr_summary(GARBAGE).splitlines()[0]
        == "gguf_init_from_file: not a GGUF file (bad magic)"
    )
    repeated = MISSING + MISSING.replace("0.00.004", "0.00.009")
    assert stderr_summary(repeated) == stderr_summary(MISSING)  # repeats collapse


def test_error_lines_are_the_stderr_summary() -> None:
    assert ENGINE.error_lines(MISSING) == stderr_summary(MISSING)


# The first 4 bytes of files that are not GGUF, as llama.cpp quotes them raw: an SSH key,
# a quote, a line break, NULs, a multi-byte character (issue 18: never echoed).
@pytest.mark.parametrize("magic", ["----", "a'bc", "a\nbc", "\0\0\0\0", "\u20ac!", "ab\n'"])
@pytest.mark.parametrize(
    "template",
    [
        "gguf_init_from_file_impl: invalid magic characters: '{}', expected 'GGUF'",
        "gguf_init_from_file: invalid magic characters '{}'",
    ],
)
def test_a_file_that_is_not_gguf_is_named_without_its_bytes(magic: str, template: str) -> None:
    tail = (
        "0.00.004.312 I srv    load_model: loading model '/home/u/.ssh/id_ed25519'\n"
        + template.format(magic)
        + "\nllama_model_load: error loading model: "
        "llama_model_loader: failed to load model from /home/u/.ssh/id_ed25519\n"
    )
    summary = stderr_summary(tail)
    assert summary.splitlines()[0].endswith(NOT_GGUF)
    lines = summary.splitlines()
    assert not any(magic.strip("\n'") in line for line in lines if "/home/u" not in line), summary
    assert "\0" not in summary and "magic characters" not in summary


def test_a_grammar_llama_cpp_could_not_parse_is_not_quoted() -> None:
    summary = stderr_summary("parse: error parsing grammar: expecting name at root:x:0:0:\n")
    assert summary == "parse: error parsing grammar: (the grammar is not shown)"
