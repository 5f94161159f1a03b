"""The changes the bootstrap makes to llama.cpp's source before building llama-server.

Standard library only (the bootstrap runs before any virtual environment exists).
Each patch names one file, the exact text it replaces (which must occur once, so a
new llama.cpp release that moved or fixed the code fails the build loudly instead of
building an unpatched binary) and why. Their text is part of the cached binary's
build key (bootstrap.llama_build_key), so a changed patch is a new binary.

The two patches are one change (one wait keeps one deadline), meant for upstream;
until it lands there, a llama-server built elsewhere (an engine's `artifact:`, or
`LLMGW_ENGINES`) keeps the behaviour described in docs/router.md, where a client
disconnects. Its `--version` is the same either way: only this build has it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Patch:
    """`old` -> `new` in `path` (relative to the llama.cpp source root)."""

    path: str
    old: str
    new: str
    why: str


# Issue 21, item 8: a client that leaves a non-streaming completion must free its slot
# within a second. llama-server notices a closed connection only when its wait for the
# request's next result times out (HTTP_POLLING_SECONDS = 1, server-context.cpp), and
# server_response::recv_with_timeout restarted that 1 s wait whenever any result was
# pushed: another slot's streamed token, or any client's /metrics or /slots read. With a
# second router reading the replica's /metrics every 0.1 s (or one other stream on the
# replica) the wait never timed out and the left request ran to its end (measured: still
# running 12 s after the client left). The deadline is now set once per call.
RECV_DEADLINE = Patch(
    path="tools/server/server-queue.cpp",
    old=(
        "server_task_result_ptr server_response::recv_with_timeout("
        "const std::unordered_set<int> & id_tasks, int timeout) {\n"
        "    while (true) {\n"
    ),
    new=(
        "server_task_result_ptr server_response::recv_with_timeout("
        "const std::unordered_set<int> & id_tasks, int timeout) {\n"
        "    // llmgw: one deadline per call; results for other tasks do not restart it\n"
        "    const auto deadline = std::chrono::steady_clock::now()"
        " + std::chrono::seconds(timeout);\n"
        "    while (true) {\n"
    ),
    why="the 1 s result wait keeps its deadline when other tasks' results arrive",
)
RECV_WAIT_UNTIL = Patch(
    path="tools/server/server-queue.cpp",
    old="condition_results.wait_for(lock, std::chrono::seconds(timeout));",
    new="condition_results.wait_until(lock, deadline);",
    why="waits until that deadline",
)

PATCHES: tuple[Patch, ...] = (RECV_DEADLINE, RECV_WAIT_UNTIL)


class PatchError(Exception):
    """A patch's `old` text is not in its file exactly once."""


def key_text() -> str:
    """Every patch's path, old and new text: what the build key hashes."""
    return "\n".join(f"{p.path}\n{p.old}\n{p.new}" for p in PATCHES)


def apply(source: Path) -> list[str]:
    """Apply PATCHES to the llama.cpp tree at `source`, checking every one first.

    Returns one line per patch ("path: why"). Raises PatchError naming the file and the
    count when any `old` text occurs other than exactly once; no file is written then."""
    texts: dict[str, str] = {}
    for patch in PATCHES:
        text = texts.get(patch.path) or (source / patch.path).read_text()
        if (count := text.count(patch.old)) != 1:
            raise PatchError(
                f"{source / patch.path}: expected the text to patch ({patch.why}) once, "
                f"found it {count} times: {patch.old!r}"
            )
        texts[patch.path] = text.replace(patch.old, patch.new)
    for path, text in texts.items():
        (source / path).write_text(text)
    return [f"{patch.path}: {patch.why}" for patch in PATCHES]
