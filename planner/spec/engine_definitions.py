"""Engine definitions: the YAML schema of `engines/*.yaml`, its loader, and the engines a
model may name.

Called by `planner engines apply` (through `load_engines`) before anything is changed,
and by `planner apply`, which resolves each model's `profile.engine` to an `EngineRef`.
One file holds one engine, a versioned build of an engine kind (`planner.engines`):

    name: llama.cpp                  # what models name in profile.engine
    version: "11434"                 # the build; models run only where it is installed
    kind: llama.cpp                  # optional (default llama.cpp): which engine module
    artifact: https://host/path/llama-server   # downloaded and installed on every node
    sha256: <64 hex>                 # required with artifact; optional with path
    # or, instead of artifact:
    path: /opt/llmgw/bin/llama-server          # already on the nodes: checked, not copied
    check_model: /opt/llmgw/models/tiny.gguf   # optional: a small model on every node; the
                                     # install serves it and completes one token

Problems are reported like the model files' (`planner.spec.definitions`): every file, the
field path, what was expected; one name in two files is an error.

Nomad node metadata keys must be dotted HCL identifiers (nomad/structs/node.go,
NodeMetaApplyRequest.Validate), and each engine is recorded on a node as
`llmgw_engine_<name>`: hence names are lower-case and each dot-separated part starts
with a letter or `_`.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlparse

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from llmgw_contract import ENGINE_JOB_PREFIX
from planner.engines import DEFAULT_KIND, KINDS
from planner.errors import DefinitionError, InvalidDefinitions
from planner.spec.definitions import _UniqueKeyLoader, collect, not_utf8

ENGINE_NAME_PATTERN = r"^[a-z_][a-z0-9_-]*(\.[a-z_][a-z0-9_-]*)*$"
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"
# Node metadata key that records an engine's installed version on a node.
META_PREFIX = "llmgw_engine_"
# The Nomad job that installs an engine on every node (a name no model may take).
JOB_PREFIX = ENGINE_JOB_PREFIX
# Where `artifact` engines are installed on a node, by default (LLMGW_ENGINE_ROOT).
DEFAULT_ENGINE_ROOT = "/opt/llmgw/engines"
_FILE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._+-]*$"


def meta_key(name: str) -> str:
    """The node metadata key of engine `name`: `llmgw_engine_<name>`."""
    return f"{META_PREFIX}{name}"


def _version_text(value: object) -> object:
    """Only a YAML string is a version: YAML 1.1 reads 0011434 as the octal number 4892,
    1.10 as 1.1 and 2024-01-02 as a date, so any other scalar was already rewritten."""
    if value is None or isinstance(value, str | list | dict):
        return value  # pydantic says what is wrong with these
    kind = (
        "number"
        if isinstance(value, int | float) and not isinstance(value, bool)
        else type(value).__name__
    )
    raise ValueError(
        f"YAML read this version as the {kind} {value!r}, not as written: "
        'quote it, e.g. version: "11434"'
    )


def _hex_text(value: object) -> object:
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ValueError("YAML read this sha256 as a number: quote it")
    return value.lower() if isinstance(value, str) else value


class EngineDefinition(BaseModel):
    """One engine, as written in one YAML file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=ENGINE_NAME_PATTERN, max_length=48)
    # Quoted: YAML rewrites an unquoted 0011434 (octal 4892) or 1.10 (1.1).
    version: Annotated[str, BeforeValidator(_version_text)] = Field(pattern=VERSION_PATTERN)
    kind: str = DEFAULT_KIND
    artifact: str | None = None
    path: str | None = None
    sha256: Annotated[str, BeforeValidator(_hex_text)] | None = Field(
        None, pattern=r"^[0-9a-f]{64}$"
    )
    # A small model on every node: before recording the engine, its install serves it
    # and completes one token (a build that crashes on the first graph compute, as a
    # -march=native build with AMX kernels did, passes `--version`).
    check_model: str | None = None

    @field_validator("kind")
    @classmethod
    def _kind_is_known(cls, kind: str) -> str:
        if kind not in KINDS:
            raise ValueError(f"unknown engine kind {kind!r} (known: {', '.join(sorted(KINDS))})")
        return kind

    @field_validator("artifact")
    @classmethod
    def _artifact_is_a_file_url(cls, artifact: str | None) -> str | None:
        if artifact is None:
            return None
        if "${" in artifact:
            # Nomad interpolates ${...} in an artifact's source: node attributes and
            # metadata would go into the URL.
            raise ValueError(
                f"the artifact URL contains '${{', which Nomad would interpolate, got {artifact!r}"
            )
        url = urlparse(artifact)
        name = posixpath.basename(url.path)
        if url.scheme != "https" or not url.netloc or not name:
            raise ValueError(f"expected https://host/path/to/binary, got {artifact!r}")
        if not _matches(_FILE_NAME, name):
            raise ValueError(
                f"the URL's file name {name!r} is not a plain file name "
                "(letters, digits, '.', '_', '+', '-')"
            )
        return artifact

    @field_validator("path")
    @classmethod
    def _path_is_absolute(cls, path: str | None) -> str | None:
        if path is not None and (not path.startswith("/") or any(c in path for c in "\0\n\"'$`\\")):
            raise ValueError(f"expected an absolute path on the nodes, got {path!r}")
        return path

    @field_validator("check_model")
    @classmethod
    def _check_model_is_a_gguf_path(cls, path: str | None) -> str | None:
        # No blanks, quotes, `$`, `%` or backslashes: the install script splits its
        # check's arguments on blanks, and Nomad interpolates `${` and `%{` in them.
        if path is not None and (
            not path.startswith("/")
            or not path.endswith(".gguf")
            or any(c in path for c in "\0\n\t \"'$%`\\")
        ):
            raise ValueError(
                f"expected an absolute path of a .gguf file on the nodes, "
                f"without blanks, quotes, '$', '%' or '\\', got {path!r}"
            )
        return path

    @model_validator(mode="after")
    def _one_source(self) -> EngineDefinition:
        if (self.artifact is None) == (self.path is None):
            raise ValueError(
                "give exactly one of artifact (a URL every node downloads) and "
                "path (where the engine already is on every node)"
            )
        if self.artifact is not None and self.sha256 is None:
            raise ValueError("an artifact needs its sha256: nodes run what they download")
        return self

    @property
    def meta_key(self) -> str:
        return meta_key(self.name)

    @property
    def job_id(self) -> str:
        return f"{JOB_PREFIX}{self.name}"

    def command(self, root: str) -> str:
        """The engine's program on a node: `path`, or `<root>/<name>/<version>/<file name
        of the artifact URL>` once installed."""
        if self.path is not None:
            return self.path
        file_name = posixpath.basename(urlparse(self.artifact or "").path)
        return posixpath.join(root, self.name, self.version, file_name)

    @property
    def definition_hash(self) -> str:
        """16 hex chars of sha256 over the whole definition."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _matches(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text) is not None


@dataclass(frozen=True)
class EngineRef:
    """The engine a model's job runs: its `name` (profile.engine), `kind` (which
    `planner.engines` module), the `command` on the node, and the `version` it must
    find installed (node meta `llmgw_engine_<name>`); `version` None for an engine
    named in LLMGW_ENGINES, which is assumed present on every node, unchecked."""

    name: str
    kind: str
    command: str
    version: str | None = None

    @property
    def meta_key(self) -> str:
        return meta_key(self.name)


def unmanaged(engines: Mapping[str, str]) -> dict[str, EngineRef]:
    """LLMGW_ENGINES' {name: path} as engine references (llama.cpp, no install)."""
    return {name: EngineRef(name, DEFAULT_KIND, path) for name, path in engines.items()}


def managed(definitions: Mapping[str, EngineDefinition], root: str) -> dict[str, EngineRef]:
    """Defined engines as references, installed under `root` on the nodes."""
    return {
        name: EngineRef(name, d.kind, d.command(root), d.version) for name, d in definitions.items()
    }


def _explain(error: Mapping[str, Any]) -> str:
    if error["type"] == "extra_forbidden":
        return f"unknown field (expected one of: {', '.join(EngineDefinition.model_fields)})"
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "string_pattern_mismatch" and error["loc"] == ("name",):
        message = (
            "expected a lower-case name whose dot-separated parts each start with a "
            "letter or '_' (letters, digits, '_', '-'), e.g. llama.cpp"
        )
    elif error["type"] == "string_pattern_mismatch" and error["loc"] == ("version",):
        message = "expected a version such as 11434 or b4500 (letters, digits, '.', '_', '+', '-')"
    if error["type"] != "missing" and error["loc"] and "input" in error and "got " not in message:
        message += f" (got {error['input']!r})"
    return message


def parse_engine_file(path: Path) -> tuple[EngineDefinition | None, list[DefinitionError]]:
    """Read and check one engine file; the definition, or every problem in it."""
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except OSError as exc:
        return None, [DefinitionError(path, "", f"cannot read file: {exc.strerror}")]
    except UnicodeDecodeError as exc:
        return None, [DefinitionError(path, "", not_utf8(exc))]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        return None, [DefinitionError(path, "", f"invalid YAML: {where}{problem}")]
    if not isinstance(data, dict):
        return None, [
            DefinitionError(path, "", "expected a mapping with name, version and artifact or path")
        ]
    try:
        return EngineDefinition.model_validate(data), []
    except ValidationError as exc:
        return None, [
            DefinitionError(path, ".".join(map(str, e["loc"])) or "(top level)", _explain(e))
            for e in exc.errors()
        ]


def load_engines(paths: list[Path]) -> dict[str, tuple[Path, EngineDefinition]]:
    """Every engine in files and folders: {name: (file, definition)}. Raises
    InvalidDefinitions carrying every problem of every file; then the caller must
    change nothing."""
    engines, errors = collect(paths, parse_engine_file, "engine")
    if errors:
        raise InvalidDefinitions(errors)
    return engines
