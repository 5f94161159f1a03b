"""A model's last error, in words written once: how a crash is named, which stderr
lines say what went wrong, and the one-line headline every view shows.

The planner writes `last_error` (planner.model.failures.judge: the task event's line, then
the engine's chosen stderr lines); `planner status`, `planner models`, the admin API,
the parked job's meta and the router's `model_parked` refusal all read it, and each
shows `headline` of it first, so an operator reads the same words everywhere.

A process that died of a signal is **crashed**, and its first line says so before
any stderr line (`crash_line`): "crashed: SIGSEGV (exit 139)". A log line at warning
level is never a headline: llama.cpp warns about harmless things (a token type in
the vocabulary) just before a crash, and a headline quoting the warning hid the
crash (issue 17).

Signal numbers are Linux's (signal(7)): Nomad clients run on Linux. The exit status
of a process killed by signal N is reported as 128 + N by Nomad's executor
(drivers/shared/executor: `exitSignalBase + signal`) and by a POSIX shell for its
child (`$?`), so either the event's `Signal` or such an exit status names it.
"""

from __future__ import annotations

import re

CRASHED = "crashed: "
# A shell's and Nomad's exit status of a process killed by signal N: 128 + N.
SIGNAL_EXIT_BASE = 128
_LAST_SIGNAL = 64  # Linux's SIGRTMAX
SIGKILL = 9
# Linux signal numbers -> (name, what it means to an operator; "" when the name says it).
SIGNALS: dict[int, tuple[str, str]] = {
    1: ("SIGHUP", "hangup"),
    2: ("SIGINT", "interrupted"),
    3: ("SIGQUIT", "quit"),
    4: ("SIGILL", "illegal instruction (the engine build uses CPU instructions this node lacks)"),
    5: ("SIGTRAP", "trace trap"),
    6: ("SIGABRT", "aborted (a failed assertion, or an uncaught C++ exception)"),
    7: ("SIGBUS", "bus error (a memory-mapped file shrank or could not be read)"),
    8: ("SIGFPE", "arithmetic exception"),
    SIGKILL: ("SIGKILL", "killed (out of memory?)"),
    11: ("SIGSEGV", ""),
    13: ("SIGPIPE", "broken pipe"),
    15: ("SIGTERM", "terminated"),
    24: ("SIGXCPU", "CPU time limit exceeded"),
    25: ("SIGXFSZ", "file size limit exceeded"),
    31: ("SIGSYS", "bad system call"),
}

# llama.cpp's log prefix: elapsed time and level, "0.00.008.710 E " (common/log.cpp).
LOG_PREFIX = re.compile(r"^\d+(?:\.\d+)+ ([A-Z]) +")
# Words of a line that says what went wrong (llama.cpp names the cause on such a line:
# "error loading model", "failed to open GGUF file", "unknown model architecture").
TROUBLE = re.compile(
    r"error|fail|unknown|unsupported|invalid|cannot|can't|unable|not found|no such|"
    r"denied|out of memory|\boom\b|abort|exception|panic|fatal|segmentation|"
    r"not a GGUF file",
    re.IGNORECASE,
)
_WARNING = re.compile(r"\bwarn(ing)?\b", re.IGNORECASE)


def crash_signal(exit_code: int | None, signal: int | None) -> int:
    """The signal a process died of (0: it exited by itself): Nomad's `Signal`, else
    an exit status of 128 + N (a shell reports its child's death so)."""
    if signal:
        return int(signal)
    if exit_code is not None and SIGNAL_EXIT_BASE < exit_code <= SIGNAL_EXIT_BASE + _LAST_SIGNAL:
        return exit_code - SIGNAL_EXIT_BASE
    return 0


def describe(
    signal: int,
    exit_code: int | None = None,
    *,
    oom_killed: bool = False,
    memory_limit_mib: int | None = None,
) -> str:
    """A death by `signal` in words: "SIGSEGV (exit 139)", "SIGILL (exit 132): illegal
    instruction (...)", "SIGKILL (exit 137): killed (out of memory?); memory limit
    256 MiB". `oom_killed`: Nomad says the kernel killed it at its memory limit."""
    name, meaning = SIGNALS.get(signal, (f"signal {signal}", ""))
    text = name + (f" (exit {exit_code})" if exit_code else "")
    if oom_killed:
        meaning = "out of memory (the kernel killed it at its memory limit)"
    if memory_limit_mib and (oom_killed or signal == SIGKILL):
        meaning += f"; memory limit {memory_limit_mib} MiB"
    return f"{text}: {meaning}" if meaning else text


def crash_line(
    signal: int,
    exit_code: int | None = None,
    *,
    oom_killed: bool = False,
    memory_limit_mib: int | None = None,
) -> str:
    """The first line of a crash's last error: "crashed: " and `describe`."""
    return CRASHED + describe(
        signal, exit_code, oom_killed=oom_killed, memory_limit_mib=memory_limit_mib
    )


def strip_prefix(line: str) -> str:
    """A log line without llama.cpp's time and level prefix, its blanks collapsed."""
    return " ".join(LOG_PREFIX.sub("", line.strip()).split())


def is_warning(line: str) -> bool:
    """A warning-level line: llama.cpp's level W, or one that calls itself a warning."""
    match = LOG_PREFIX.match(line.strip())
    return (match is not None and match.group(1) == "W") or bool(_WARNING.search(line))


def is_error(line: str) -> bool:
    """A line that says what went wrong: llama.cpp's level E, or words of trouble on a
    line that is not a warning."""
    match = LOG_PREFIX.match(line.strip())
    if match is not None and match.group(1) == "E":
        return True
    return not is_warning(line) and bool(TROUBLE.search(line))


def headline(last_error: str | None) -> str:
    """One line of a last error for a table, a log and a refusal: its first line (the
    task event, or the crash), then the first stderr line kept with it that says what
    went wrong; for a run that ended by itself without one, its last line that is
    not a warning (a process's last words are usually its reason). A crash's last
    lines were written before it died and explain nothing, and a warning never heads:
    "crashed: SIGSEGV (exit 139)" stands alone."""
    if not last_error:
        return ""
    first, *rest = last_error.splitlines()
    rest = [line for line in rest if line.strip()]
    chosen = next((line for line in rest if is_error(line)), None)
    if chosen is None and not first.startswith(CRASHED):
        chosen = next((line for line in reversed(rest) if not is_warning(line)), None)
    return f"{first} | {strip_prefix(chosen)}" if chosen else first


def clipped(last_error: str, limit: int) -> str:
    """`last_error` in at most `limit` characters with its first line kept (the
    headline starts there): what does not fit is cut from the start of the lines
    after it, whose end (the process's last words) stays."""
    if len(last_error) <= limit:
        return last_error
    first, _, rest = last_error.partition("\n")
    first = first[: max(limit // 2, 1)]
    room = limit - len(first) - len("\n…\n")
    return f"{first}\n…\n{rest[-room:]}" if room > 0 and rest else first
