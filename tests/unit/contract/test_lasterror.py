"""A last error's words: a crash named by its signal, and a headline no warning heads."""

from __future__ import annotations

import pytest

from llmgw_contract.lasterror import (
    clipped,
    crash_line,
    crash_signal,
    describe,
    headline,
    is_error,
    is_warning,
)

# What the parked Gemma of issue 17 kept: a harmless llama.cpp warning just before the
# server died of SIGSEGV on the first graph compute (AMX).
WARNING = (
    "load: control-looking token: 212 '</s>' was not control-type; this is "
    "probably a bug in the model"
)


@pytest.mark.parametrize(
    ("exit_code", "signal", "expected"),
    [
        (139, 11, 11),
        (139, 0, 11),
        (132, None, 4),
        (137, 9, 9),
        (1, 0, 0),
        (0, 0, 0),
        (128, 0, 0),
        (255, 0, 0),
        (None, None, 0),
        (0, 6, 6),
    ],
)
def test_the_signal_is_nomads_or_an_exit_status_of_128_plus_n(
    exit_code: int | None, signal: int | None, expected: int
) -> None:
    assert crash_signal(exit_code, signal) == expected


def test_each_signal_is_named_with_what_it_means() -> None:
    assert crash_line(11, 139) == "crashed: SIGSEGV (exit 139)"
    assert crash_line(4, 132) == (
        "crashed: SIGILL (exit 132): illegal instruction (the "
        "engine build uses CPU instructions this node lacks)"
    )
    assert (
        crash_line(9, 137, memory_limit_mib=256)
        == "crashed: SIGKILL (exit 137): killed (out of memory?); memory limit 256 MiB"
    )
    assert crash_line(9, 137, oom_killed=True, memory_limit_mib=512) == (
        "crashed: SIGKILL (exit 137): out of memory (the kernel killed it at its memory "
        "limit); memory limit 512 MiB"
    )
    assert describe(6).startswith("SIGABRT: aborted")
    assert describe(42, 170) == "signal 42 (exit 170)"


def test_a_crash_heads_alone_never_behind_a_warning() -> None:
    last = f"crashed: SIGSEGV (exit 139)\n{WARNING}\nsrv  load_model: loading model"
    assert headline(last) == "crashed: SIGSEGV (exit 139)"
    # ... but an error line before it says more, and heads with it.
    aborted = "crashed: SIGABRT (exit 134): aborted\nGGML_ASSERT(n > 0) failed\nbye"
    assert headline(aborted) == "crashed: SIGABRT (exit 134): aborted | GGML_ASSERT(n > 0) failed"


def test_a_run_that_ended_by_itself_heads_with_its_error_else_its_last_words() -> None:
    assert (
        headline("Terminated: Exit Code: 1\n0.00.000.100 E boom\nmore")
        == "Terminated: Exit Code: 1 | boom"
    )
    assert (
        headline("Terminated: Exit Code: 1\nloading\nexiting: bye")
        == "Terminated: Exit Code: 1 | exiting: bye"
    )
    assert (
        headline("Terminated: Exit Code: 1\n0.1.2.3 W warning: failed to mlock")
        == "Terminated: Exit Code: 1"
    )
    assert headline("") == "" and headline(None) == ""


def test_warnings_are_no_errors() -> None:
    assert is_warning("0.00.01.2 W llama: failed to mlock") and not is_error(
        "0.00.01.2 W llama: failed to mlock"
    )
    assert is_warning("warning: failed to munlock buffer") and not is_error(
        "warning: failed to munlock buffer"
    )
    assert is_error("0.00.01.2 E boom") and is_error("error loading model")
    assert not is_error(WARNING)


def test_a_clipped_last_error_keeps_its_first_line_and_its_end() -> None:
    last = (
        "crashed: SIGSEGV (exit 139)\n"
        + "\n".join(f"line {i} " + "x" * 90 for i in range(40))
        + "\nlast words"
    )
    short = clipped(last, 2000)
    assert len(short) <= 2000 and short.startswith("crashed: SIGSEGV (exit 139)\n…\n")
    assert short.endswith("last words") and headline(short) == "crashed: SIGSEGV (exit 139)"
    assert clipped("short", 2000) == "short" and len(clipped("y" * 50, 10)) <= 10
