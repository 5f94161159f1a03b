"""llmgw planner: turns model definitions from git into Nomad jobs and reports their state.

The public face is small: the `planner` command (`planner.cli.main`) and the
pieces below for code that embeds it. Everything else is internal.
"""

from planner.errors import (
    InvalidDefinitions,
    NomadRejected,
    PlannerError,
    Rejected,
    Unavailable,
)
from planner.spec.definitions import ModelDefinition, Profile, load_definitions
from planner.spec.settings import Settings

__all__ = [
    "InvalidDefinitions",
    "ModelDefinition",
    "NomadRejected",
    "PlannerError",
    "Profile",
    "Rejected",
    "Settings",
    "Unavailable",
    "load_definitions",
]
