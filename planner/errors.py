"""The planner's exceptions, split by what the caller can do about them.

    PlannerError
    ├── InvalidDefinitions      the operator's files are wrong: fix them (exit 2)
    ├── InvalidSettings         a setting names what the agent does not have, e.g. a
    │                           NOMAD_NAMESPACE Nomad has no namespace of: fix it (exit 2)
    ├── Unavailable             Nomad or Consul did not answer: retry later (exit 3)
    │   ├── NomadUnavailable
    │   └── ConsulUnavailable
    ├── Rejected                an agent answered no: read why (exit 1)
    │   └── NomadRejected       e.g. a job the parser or the scheduler refused
    ├── PermissionDenied        an ACL token lacks a permission (or the agent does not
    │                           know the token): fix the token, the message names the
    │                           rule and the policy file (exit 3)
    └── NotLeader               this planner no longer holds the leader lock: stop acting

Nomad's, Consul's and the HTTP clients' own exceptions are translated into
these in `nomad_client` and `consul_client`; nothing above those modules sees
a library's types. `DefinitionError` is one problem in one file, a value
rather than an exception: a run collects all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DefinitionError:
    """One problem: which file, which field path (dotted; '' for the whole file), what was wrong."""

    file: Path
    field: str
    message: str

    def __str__(self) -> str:
        return (
            f"{self.file}: {self.field}: {self.message}"
            if self.field
            else f"{self.file}: {self.message}"
        )


class PlannerError(Exception):
    """Base of every error the planner raises on purpose."""

    exit_code = 1


class InvalidDefinitions(PlannerError):
    """One or more model files are invalid; `errors` lists every problem found."""

    exit_code = 2

    def __init__(self, errors: list[DefinitionError]) -> None:
        self.errors = errors
        super().__init__("\n".join(str(e) for e in errors))


class InvalidSettings(PlannerError):
    """A setting the agents answer does not hold (a NOMAD_NAMESPACE that Nomad has no
    namespace of); the message names the setting and what to do. The CLI's exit 2, as
    for a malformed setting."""

    exit_code = 2


class Unavailable(PlannerError):
    """An agent could not be reached or failed (5xx): the same call may work later."""

    exit_code = 3


class NomadUnavailable(Unavailable):
    pass


class ConsulUnavailable(Unavailable):
    pass


# What an operator reads for a connection that failed, from the words urllib3 and the
# kernel put in requests' exception text (which also holds the pool's repr).
_CONNECTION_FAILURES = (
    ("Connection refused", "connection refused"),
    ("Name or service not known", "the host name does not resolve"),
    ("Temporary failure in name resolution", "the host name does not resolve"),
    ("No route to host", "no route to host"),
    ("Network is unreachable", "network unreachable"),
    ("timed out", "timed out"),
    ("Connection reset", "the connection was reset"),
    ("RemoteDisconnected", "it closed the connection without answering"),
)


def no_answer(agent: str, variable: str, address: str, exc: BaseException) -> str:
    """`Nomad at NOMAD_ADDR=http://127.0.0.1:4646 did not answer (connection refused)`:
    the agent, the setting that points at it and the failure in a few words, without
    the HTTP library's pool and exception names; `exc`'s class name when its text says
    nothing known."""
    text = str(exc)
    why = next((said for words, said in _CONNECTION_FAILURES if words in text), type(exc).__name__)
    return f"{agent} at {variable}={address} did not answer ({why})"


class PermissionDenied(PlannerError):
    """Nomad or Consul denied a permission to the planner's ACL token. Not a Rejected:
    no caller may take it for an answer about the job or the key (a 403 is never
    "the job changed meanwhile"); the message is `llmgw_contract.acl.denial`'s."""

    exit_code = 3

    def __init__(self, message: str, agent: str, rules: list[str]) -> None:
        super().__init__(message)
        self.agent = agent
        self.rules = rules


class Rejected(PlannerError):
    """An agent answered and refused (4xx); the message says why."""


class NomadRejected(Rejected):
    pass


class NotLeader(PlannerError):
    """A leader's write was fenced off: its session no longer holds `llmgw/leader`
    (it was deposed, e.g. after being paused longer than its check's TTL)."""
