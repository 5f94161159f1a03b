"""The engine seam: what differs between model server programs, one module per engine.

An *engine kind* is a server program (llama.cpp's `llama-server` today); each kind is
one module here holding everything the planner must know about it: the arguments
that start it on the port Nomad gives, the HTTP path its Consul check asks, and which
lines of its log say why a start failed (the model's `last_error`). The job template
(`planner/jobspecs/model.nomad.hcl`) and the failure counting (`planner.model.failures`)
take those from here and know nothing of any one engine; adding an engine (vLLM, say)
is one new module and one line in `KINDS`.

An *engine* (`engines/*.yaml`, `planner.spec.engine_definitions`) is a named, versioned
build of a kind that nodes install; a model's `profile.engine` names one.

Called by `planner.spec.jobspec` (arguments, health path), the watcher (error lines) and
the engine definitions (valid kinds). Pure: nothing here talks to Nomad or Consul.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Stands for the model file in `Engine.server_args`: the job template puts in the path
# it gives the weights (a node path, or the artifact's place in the allocation).
MODEL_FILE = "{model_file}"

# Nomad's runtime interpolation of the task's address and port (the `http` port label
# of the job template); the template keeps them literal for Nomad to fill in.
NOMAD_IP = "${NOMAD_IP_http}"
NOMAD_PORT = "${NOMAD_PORT_http}"


class Engine(Protocol):
    """One engine kind: how to start it, how to tell it is ready, how to read its failures."""

    kind: str  # the name definitions use, e.g. "llama.cpp"
    health_path: str  # HTTP path that answers 200 once the model is loaded (Consul's check)
    # Arguments that make the program print its version and exit 0: the install job runs
    # it so once on each node before recording it there (planner/jobspecs/engine.nomad.hcl).
    check_args: tuple[str, ...]
    # (path, JSON body) of a request that completes one token: the install job sends it
    # once to `server_args` serving an engine's `check_model` before recording it.
    check_request: tuple[str, str]

    def server_args(
        self, model: str, context: int, gpus: int, args: Sequence[str] = ()
    ) -> list[str]:
        """argv after the command: serve `MODEL_FILE` as `model` on NOMAD_IP:NOMAD_PORT
        with `context` tokens of context for every request, on `gpus` GPUs (0: CPU
        only), serving as many requests at once as the operator's `profile.args` (`args`)
        say. Those args follow these."""
        ...

    def error_lines(self, stderr_tail: str) -> str:
        """What of the tail of the server's stderr says why it ended: its error lines
        first (each once), then its last lines; "" when nothing is worth showing."""
        ...


def _registry() -> dict[str, Engine]:
    from planner.engines import llama_cpp

    return {engine.kind: engine for engine in (llama_cpp.ENGINE,)}


KINDS: dict[str, Engine] = _registry()
DEFAULT_KIND = "llama.cpp"


def engine(kind: str) -> Engine:
    """The engine of `kind`. Raises KeyError naming the kinds there are."""
    try:
        return KINDS[kind]
    except KeyError:
        raise KeyError(
            f"unknown engine kind {kind!r} (known: {', '.join(sorted(KINDS))})"
        ) from None


__all__ = ["DEFAULT_KIND", "KINDS", "MODEL_FILE", "NOMAD_IP", "NOMAD_PORT", "Engine", "engine"]
