"""Model definitions: the YAML schema operators keep in git, and its loader.

Called by `planner apply` (through `load_definitions`) before anything is
changed: every file is read and checked, and every problem is collected, so
one run names all of them. Nothing here talks to Nomad or Consul.

One file holds one model:

    name: gemma-3-270m                  # DNS label: Nomad job ID, Consul service llmgw-<name>
                                        # (none of llmgw's own: llmgw_contract.reserved)
    source: file:///opt/llmgw/models/m.gguf  # or https://..., or hf://org/repo[@rev]/path.gguf
    sha256: <64 hex>                    # optional; checked by Nomad's artifact download
                                        # (a split source: a list, one per shard)
    profile:
      engine: llama.cpp                 # which engine build runs it
      context: 4096                     # tokens each request can use, in every slot
      gpus: 0                           # count of nvidia/gpu devices
      gpu_memory: 24GiB                 # minimum memory per GPU (only with gpus > 0)
      cpu: 2000                         # MHz, as Nomad counts it
      memory: 2GiB
      load_timeout: 10m                 # how long a start may take before health checks count
      args: ["--threads", "2"]          # extra llama-server arguments, one argv element each
    replicas: 1
    on_demand: {idle_after: 15m}        # optional: run only while used (0 replicas when idle)
    scaling: {min: 1, max: 4, target: 2}  # optional, instead of replicas: follow demand
    shutdown_delay: 30s                 # a stopping replica's drain: out of the routers'
                                        # tables at once, its signal this long after
    restart_delay: 5s                   # Nomad's pause before starting a failed server again

The definition hash covers what the server runs (source, sha256, profile) and
not `replicas`, `on_demand`, `scaling`, `shutdown_delay` or `restart_delay`: a changed
hash lifts parking and rolls out, a changed count, bound, drain or pause must not lift
parking.

`restart_delay` is the `delay` of the job group's restart policy: how long Nomad waits
after a start failed before it starts the server again, in place (plus up to 25 %
jitter: client/allocrunner/taskrunner/restarts/restarts.go). A replica that cannot
start is started 5 times, so it is stopped (and the model parked, when no replica
serves) about 4 delays after its first start. 1s to 4m (Nomad would read 0 as 1 ns:
five starts back to back, nothing on the node given a moment to clear), default 5s: the
template's
value before the field existed, so a definition that does not write it renders the job
it always did. The bound above keeps 4 delays with their jitter and 5 runs of up to the
2 min stability window within the restart policy's 30 m interval
(planner/jobspecs/model.nomad.hcl), so Nomad's count of starts and the planner's count
of failures stay one count. It is part of the rendered job (the spec hash, not the
definition hash): a change rolls out, as a Nomad client keeps a running task's restart
policy as it started (it never updates its restart tracker in place).

`shutdown_delay` (issue 22, items 2 and 6) is Nomad's task `shutdown_delay`: when a
replica is stopped (a scale-down, a rollout's old replicas, an idle model's last, a
job stop), Nomad removes its service from Consul (the routers drop it from their
tables within one blocking query and send it nothing new), waits this long, then
signals llama-server, which stops at once and cuts what it still serves. So a
request that runs longer than the delay after the stop began is cut; every stop
takes the whole delay, busy or not (Nomad has no "until idle"). 0s to 10m; 30 s is
Kubernetes' terminationGracePeriodSeconds default. Nomad updates it in place
(scheduler/util.go, tasksUpdated, does not compare it), so a change restarts nothing
and holds for every later stop of the running replicas.

`scaling` (issue 22) replaces `replicas` for a model whose replicas follow demand:
`min` <= `max` <= 100 (the replicas limit), `target` requests in flight and waiting
per replica (summed over every router), averaged over `window`; up after `up_after`,
down after `down_after`. With `on_demand`, `min` is 0 (idle goes to 0, activation
starts 1); `min: 0` without `on_demand` is refused (nothing would say when to stop
the last replica). The model's `replicas` is then max(min, 1): what a new job and an
activation start with.

A model file reaches nothing on a node beyond its model: a file:// source lies under
the models root (LLMGW_MODELS_ROOT; `planner.spec.sources.outside_root`), `args` carry
only the llama-server flags that change serving (`planner.engines.llama_server_flags`),
and no field Nomad interpolates (source, args) may hold `${`, nor may anything the
planner derives from the source (a split's shard names, decoded from its URL, must be
plain names; a node path is used as written, so '%', '\\', '.' and '..' are refused).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Protocol, TypeVar
from urllib.parse import quote, urlparse

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from llmgw_contract import ModelRecord, ScalingBounds, reserved_name, service_name
from planner.engines.llama_server_flags import judge
from planner.errors import DefinitionError, InvalidDefinitions
from planner.spec.sources import (
    DEFAULT_MODELS_ROOT,
    Shard,
    expand,
    interpolated,
    node_path_problem,
    outside_root,
    plain_name_problem,
    source_name,
    split_of,
)

# Nomad job IDs and Consul service names both accept this; "llmgw-" + name
# must stay within a DNS label's 63 characters (RFC 1035).
NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,55}[a-z0-9])?$"

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600}
# The error type of a refused `profile.args` element: its message is whole (no "got").
ARG_ERROR = "llmgw_arg"


def parse_bytes(value: object) -> int:
    """'2GiB' / '512 MiB' / '24GB' / 1024 -> bytes. Raises ValueError naming the units."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size such as 2GiB or 512MiB, got {value!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_seconds(value: object) -> int:
    """'90s' / '10m' / '1h' / 600 -> seconds. Raises ValueError naming the units."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = re.fullmatch(r"\s*(\d+)\s*([smh])\s*", str(value))
    if not match:
        raise ValueError(f"expected a duration such as 90s or 10m, got {value!r}")
    return int(match.group(1)) * _DURATION_UNITS[match.group(2)]


Bytes = Annotated[int, BeforeValidator(parse_bytes), Field(gt=0)]
Seconds = Annotated[int, BeforeValidator(parse_seconds), Field(gt=0)]


def _judge_args(value: object, handler: ValidatorFunctionWrapHandler) -> tuple[str, ...]:
    """`profile.args` as llama-server will read them, judged against the flag table of
    `planner.engines.llama_server_flags`: one error per element at `profile.args.N`."""
    args: tuple[str, ...] = handler(value)
    problems = judge(args)
    if problems:
        raise ValidationError.from_exception_data(
            "args",
            [
                InitErrorDetails(
                    type=PydanticCustomError(ARG_ERROR, message), loc=(index,), input=args[index]
                )
                for index, message in problems
            ],
        )
    return args


Args = Annotated[tuple[str, ...], WrapValidator(_judge_args)]


class Profile(BaseModel):
    """How the model server runs: engine, resources, and extra engine arguments."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: str = Field("llama.cpp", pattern=r"^[a-z0-9][a-z0-9._-]*$")
    context: int = Field(4096, ge=128, le=1 << 20)
    gpus: int = Field(0, ge=0, le=64)
    gpu_memory: Bytes | None = None
    cpu: int = Field(1000, ge=100)
    memory: Bytes = parse_bytes("1GiB")
    load_timeout: Seconds = 600
    args: Args = ()

    @model_validator(mode="after")
    def _gpu_memory_needs_gpus(self) -> Profile:
        if self.gpu_memory is not None and self.gpus == 0:
            raise ValueError("gpu_memory is only meaningful with gpus > 0")
        return self


def _sha256s(value: object) -> str | tuple[str, ...] | None:
    """A sha256 (64 hex digits, any case) or a list of them -> lower case."""
    if value is None:
        return None
    values = value if isinstance(value, list | tuple) else [value]
    for one in values:
        if not re.fullmatch(r"[0-9a-fA-F]{64}", str(one)):
            raise ValueError(f"expected a sha256 (64 hex digits) or a list of them, got {one!r}")
    lowered = tuple(str(one).lower() for one in values)
    return lowered if isinstance(value, list | tuple) else lowered[0]


class OnDemand(BaseModel):
    """Run only while used: registered with 0 instances, started by a request (the
    router's activation), stopped again after `idle_after` without requests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    idle_after: Seconds = 900


MAX_REPLICAS = 100
# How long a stopping replica keeps serving what it has (`shutdown_delay`): Kubernetes'
# default grace period (terminationGracePeriodSeconds, 30 s), at most 10 minutes.
DEFAULT_SHUTDOWN_DELAY_S = 30
MAX_SHUTDOWN_DELAY_S = 600


def _drain_within_bounds(seconds: int) -> int:
    if not 0 <= seconds <= MAX_SHUTDOWN_DELAY_S:
        raise ValueError(f"expected a duration from 0s to 10m, got {seconds} s")
    return seconds


Drain = Annotated[int, BeforeValidator(parse_seconds), AfterValidator(_drain_within_bounds)]

# How long Nomad waits before it starts a failed server again (`restart_delay`; see the
# module's docstring for the bounds).
DEFAULT_RESTART_DELAY_S = 5
MIN_RESTART_DELAY_S = 1
MAX_RESTART_DELAY_S = 240


def _pause_within_bounds(seconds: int) -> int:
    if not MIN_RESTART_DELAY_S <= seconds <= MAX_RESTART_DELAY_S:
        raise ValueError(f"expected a duration from 1s to 4m, got {seconds} s")
    return seconds


Pause = Annotated[int, BeforeValidator(parse_seconds), AfterValidator(_pause_within_bounds)]


class Scaling(BaseModel):
    """Load-based scaling (`llmgw_contract.ScalingBounds`; the decision is
    `planner.model.autoscale`). Durations as `Seconds`; `target` > 0 requests per replica."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min: int = Field(ge=0, le=MAX_REPLICAS)
    max: int = Field(ge=1, le=MAX_REPLICAS)
    target: float = Field(gt=0, le=10_000)
    window: Seconds = 30
    up_after: Seconds = 15
    down_after: Seconds = 300

    @field_validator("window")
    @classmethod
    def _window_is_kept(cls, window: int) -> int:
        # The leader keeps 10 minutes of router load (planner.daemon.demand.KEEP_S).
        if window > 600:
            raise ValueError(f"expected at most 10m, got {window} s")
        return window

    @model_validator(mode="after")
    def _min_within_max(self) -> Scaling:
        if self.min > self.max:
            raise ValueError(f"min must not exceed max (got min {self.min}, max {self.max})")
        return self


class ModelDefinition(BaseModel):
    """One model, as written in one YAML file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN)
    source: str
    # One file's sha256, or a list: one per shard of a split source, in shard order.
    sha256: Annotated[str | tuple[str, ...] | None, BeforeValidator(_sha256s)] = None
    profile: Profile
    replicas: int = Field(1, ge=0, le=MAX_REPLICAS)  # on demand: how many when active
    on_demand: OnDemand | None = None
    scaling: Scaling | None = None  # replicas follow demand (then replicas = max(min, 1))
    shutdown_delay: Drain = DEFAULT_SHUTDOWN_DELAY_S  # seconds a stopping replica drains
    restart_delay: Pause = DEFAULT_RESTART_DELAY_S  # seconds between a failed start and the next

    @model_validator(mode="after")
    def _replicas_from_scaling(self) -> ModelDefinition:
        """With `scaling`, `replicas` is max(min, 1) (refused when written: one count or
        the other); min 0 goes with `on_demand` only, and `on_demand` with min 0."""
        if self.scaling is None:
            return self
        low, problems = self.scaling.min, []
        if "replicas" in self.model_fields_set:
            problems.append(
                (
                    ("replicas",),
                    "replicas is a fixed count; a model with scaling has min and max "
                    "instead (remove replicas)",
                )
            )
        if self.on_demand is not None and low != 0:
            problems.append(
                (
                    ("scaling", "min"),
                    f"on_demand scales an unused model to 0, so its min is 0 (got {low}); "
                    "remove on_demand to keep at least min replicas",
                )
            )
        if self.on_demand is None and low == 0:
            problems.append(
                (
                    ("scaling", "min"),
                    "min 0 needs on_demand: {idle_after: ...} (it says when the last "
                    "replica stops; demand alone never scales below 1)",
                )
            )
        if problems:
            raise ValidationError.from_exception_data(
                "ModelDefinition",
                [
                    InitErrorDetails(
                        type=PydanticCustomError(ARG_ERROR, message), loc=loc, input=None
                    )
                    for loc, message in problems
                ],
            )
        # Frozen: set once, while the model is being built (what a new job and an
        # activation start with).
        object.__setattr__(self, "replicas", max(low, 1))
        return self

    @field_validator("name")
    @classmethod
    def _name_is_not_llmgws_own(cls, name: str) -> str:
        return name_is_not_reserved(name)

    @field_validator("source")
    @classmethod
    def _source_is_supported(cls, source: str, info: ValidationInfo) -> str:
        _refuse_interpolation(source)
        resolved = resolve_source(source)
        shards = _derived_shards(resolved)
        root = (info.context or {}).get("models_root")
        if root is not None and resolved.local_path is not None:
            for shard in shards:
                problem = outside_root(shard.local_path or "", root)
                if problem:
                    raise ValueError(
                        f"{problem} (LLMGW_MODELS_ROOT): the model task "
                        "opens this path on every node"
                    )
        return source

    @field_validator("sha256")
    @classmethod
    def _sha256_fits_the_source(
        cls, sha256: str | tuple[str, ...] | None, info: ValidationInfo
    ) -> str | tuple[str, ...] | None:
        # Judged against a valid source only (fields are validated in order); an invalid
        # one has its own error.
        source = info.data.get("source")
        if sha256 is None or source is None:
            return sha256
        resolved = resolve_source(source)
        if resolved.download_url is None:
            raise ValueError(
                "sha256 is checked when Nomad downloads the source; "
                "a file:// source is not downloaded"
            )
        split = split_of(source_name(resolved.local_path, resolved.download_url))
        if isinstance(sha256, tuple) and (split is None or len(sha256) != split.count):
            raise ValueError(
                f"sha256 is a list of {len(sha256)}: a list is one sha256 per shard of a "
                f"split source ({split.count} here)"
                if split
                else "sha256 is a list, but the source is one file: give its sha256 alone"
            )
        if isinstance(sha256, str) and split is not None:
            raise ValueError(
                f"the source is split in {split.count} files: give sha256 as a "
                f"list of {split.count}, one per shard in order"
            )
        return sha256

    @property
    def shards(self) -> list[Shard]:
        """Every file of the source, the first the one llama-server is given."""
        resolved = resolve_source(self.source)
        return expand(resolved.local_path, resolved.download_url, self.sha256)

    @property
    def definition_hash(self) -> str:
        """16 hex chars of sha256 over source, sha256 and profile (not replicas)."""
        body = {
            "source": self.source,
            "sha256": self.sha256,
            "profile": self.profile.model_dump(mode="json"),
        }
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @property
    def service_name(self) -> str:
        return service_name(self.name)

    def record(self) -> ModelRecord:
        """The KV record the router and the planner's daemons read (llmgw/models/<name>);
        the job's meta carries a copy, so a wiped KV can be restored from Nomad."""
        return ModelRecord(
            name=self.name,
            definition_hash=self.definition_hash,
            replicas=self.replicas,
            source=self.source,
            sha256=list(self.sha256) if isinstance(self.sha256, tuple) else self.sha256,
            profile=self.profile.model_dump(mode="json"),
            on_demand=self.on_demand.model_dump(mode="json") if self.on_demand else None,
            scaling=ScalingBounds(**self.scaling.model_dump()) if self.scaling else None,
        )


def name_is_not_reserved(name: str) -> str:
    """A model name that is none of llmgw's own job IDs or services
    (`llmgw_contract.reserved`). Raises ValueError naming the rule."""
    why = reserved_name(name)
    if why is not None:
        raise ValueError(f"{name!r} is reserved ({why}); choose another name")
    return name


@dataclass(frozen=True)
class ResolvedSource:
    """Where the server reads the weights: a path on the node, or a URL Nomad downloads."""

    local_path: str | None
    download_url: str | None


def resolve_source(source: str) -> ResolvedSource:
    """file:// -> a node path; https:// -> a download; hf://org/repo[@rev]/path -> its https URL.

    Raises ValueError for anything else. The hf:// mapping follows the Hub's
    file URL scheme: https://huggingface.co/<org>/<repo>/resolve/<rev>/<path>.
    """
    url = urlparse(source)
    if url.scheme == "file":
        if url.netloc or not url.path.startswith("/"):
            raise ValueError(f"expected file:///absolute/path, got {source!r}")
        return ResolvedSource(local_path=url.path, download_url=None)
    if url.scheme == "https":
        if not url.netloc or not url.path.strip("/"):
            raise ValueError(f"expected https://host/path/to/file.gguf, got {source!r}")
        return ResolvedSource(local_path=None, download_url=source)
    if url.scheme == "hf":
        parts = url.path.strip("/").split("/")
        if not url.netloc or len(parts) < 2 or not parts[-1]:
            raise ValueError(f"expected hf://org/repo[@revision]/path/file.gguf, got {source!r}")
        repo, _, revision = parts[0].partition("@")
        file_path = quote("/".join(parts[1:]))
        return ResolvedSource(
            local_path=None,
            download_url=(
                f"https://huggingface.co/{url.netloc}/{repo}/resolve/"
                f"{revision or 'main'}/{file_path}"
            ),
        )
    raise ValueError(f"expected a file://, https:// or hf:// source, got {source!r}")


def _refuse_interpolation(source: str) -> None:
    """Raise ValueError when the source's own text holds Nomad's `${`, or a control
    character: URL parsing drops tabs and newlines (urllib.parse, as WHATWG URL does), so
    a '$\\n{' would reach the job as '${' past the text's check."""
    control = next((c for c in source if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if control is not None:
        raise ValueError(f"the source contains the control character {control!r}")
    if "${" in source:
        # Nomad interpolates ${...} in an artifact's source (node attributes and
        # metadata would go into the URL) and in task args; there is no escape.
        raise ValueError("the source contains '${', which Nomad would interpolate")


def _derived_shards(resolved: ResolvedSource) -> list[Shard]:
    """The source's shards, once what the planner derives from it is judged fit for the
    job: a node path as written (`node_path_problem`), a split download's decoded file
    name plain (each shard is saved under its own name: issue 18's %24%7B reached the
    artifact's destination and the args as `${`), the first shard named, and no `${` in
    any text the shards carry. Raises ValueError naming what is wrong."""
    if resolved.local_path is not None:
        problem = node_path_problem(resolved.local_path)
        if problem:
            raise ValueError(problem)
    name = source_name(resolved.local_path, resolved.download_url)
    split = split_of(name)
    if split is not None and resolved.download_url is not None:
        problem = plain_name_problem(name)
        if problem:
            raise ValueError(
                f"{problem}: each shard of a split source is saved under its own name on the node"
            )
    if split is not None and split.number != 1:
        raise ValueError(
            f"source names shard {split.number} of a {split.count}-file split model; name "
            f"its first, {split.name(1)} (llama-server opens the others from it)"
        )
    shards = expand(resolved.local_path, resolved.download_url, None)
    text = interpolated(shards)
    if text is not None:
        raise ValueError(
            f"the source gives the job {text!r}, which holds '${{', which Nomad would interpolate"
        )
    return shards


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice: PyYAML would keep the last one silently."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _field_path(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def _explain(error: dict[str, Any], model: type[BaseModel]) -> str:
    if error["type"] == "extra_forbidden":
        owners: dict[Any, type[BaseModel]] = {"profile": Profile, "scaling": Scaling}
        owner = owners.get(error["loc"][0], model) if len(error["loc"]) > 1 else model
        allowed = list(owner.model_fields)
        close = difflib.get_close_matches(str(error["loc"][-1]), allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown field (expected one of: {', '.join(allowed)}){hint}"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "string_pattern_mismatch" and error["loc"] == ("name",):
        message = (
            "expected a DNS label: lowercase letters, digits and '-', "
            "starting and ending with a letter or digit, at most 57 characters"
        )
    if error["type"] in ("tuple_type", "list_type"):
        message = 'expected a list of strings, e.g. ["--threads", "2"]'
    # The input is shown unless the message shows it already (a file:// source's path).
    shown = "got " in message or str(error.get("input")).removeprefix("file://") in message
    if error["type"] not in ("missing", ARG_ERROR) and "input" in error and not shown:
        message += f" (got {error['input']!r})"
    return message


def not_utf8(exc: UnicodeDecodeError) -> str:
    """The words for a file that is not UTF-8 text (YAML 1.2 files are UTF-8)."""
    return (
        f"expected UTF-8 text; byte 0x{exc.object[exc.start]:02x} at offset {exc.start} "
        "is not (save the file as UTF-8)"
    )


def parse_file(
    path: Path, models_root: str | None = DEFAULT_MODELS_ROOT
) -> tuple[ModelDefinition | None, list[DefinitionError]]:
    """Read and check one YAML file; returns the definition or every problem in it.
    A file:// source must lie under `models_root` (None: not checked)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        return None, [DefinitionError(path, "", f"cannot read file: {exc.strerror}")]
    except UnicodeDecodeError as exc:
        return None, [DefinitionError(path, "", not_utf8(exc))]
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        if "'\\t'" in str(exc):
            problem += " (YAML indentation must use spaces, not tabs)"
        return None, [DefinitionError(path, "", f"invalid YAML: {where}{problem}")]
    if data is None:
        return None, [
            DefinitionError(
                path,
                "",
                "file is empty; expected a mapping with name, source, profile and replicas",
            )
        ]
    if not isinstance(data, dict):
        return None, [
            DefinitionError(
                path,
                "",
                "expected a mapping with name, source, profile "
                f"and replicas, got a {type(data).__name__}",
            )
        ]
    try:
        return ModelDefinition.model_validate(data, context={"models_root": models_root}), []
    except ValidationError as exc:
        return None, [
            DefinitionError(path, _field_path(e["loc"]), _explain(e, ModelDefinition))
            for e in exc.errors()
        ]


def expand_paths(paths: list[Path]) -> list[Path]:
    """Files as given; folders expanded to their *.yaml and *.yml files, sorted."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml")))
        else:
            files.append(path)
    return files


class _Named(Protocol):
    @property
    def name(self) -> str: ...


Named = TypeVar("Named", bound=_Named)


def collect(
    paths: list[Path],
    parse: Callable[[Path], tuple[Named | None, list[DefinitionError]]],
    kind: str,
) -> tuple[dict[str, tuple[Path, Named]], list[DefinitionError]]:
    """Parse every file of `paths` with `parse`: ({name: (file, definition)}, every
    problem), a file naming a `kind` another file named already being one of them.
    Shared by model and engine files (`planner.spec.engine_definitions`)."""
    files = expand_paths(paths)
    errors: list[DefinitionError] = []
    if not files:
        errors.append(
            DefinitionError(
                Path(" ".join(map(str, paths)) or "."), "", f"no {kind} files (*.yaml, *.yml) found"
            )
        )
    found: dict[str, tuple[Path, Named]] = {}
    for path in files:
        definition, problems = parse(path)
        errors.extend(problems)
        if definition is None:
            continue
        if definition.name in found:
            errors.append(
                DefinitionError(
                    path,
                    "name",
                    (
                        f"{kind} {definition.name!r} is already defined in "
                        f"{found[definition.name][0]}"
                    ),
                )
            )
            continue
        found[definition.name] = (path, definition)
    return found, errors


def load_definitions(
    paths: list[Path],
    engines: Collection[str] | None = None,
    models_root: str = DEFAULT_MODELS_ROOT,
) -> dict[str, tuple[Path, ModelDefinition]]:
    """Load every model from files and folders: {name: (file, definition)}.

    Raises InvalidDefinitions carrying every problem of every file (unknown
    keys, bad values, YAML errors, empty files, one name in two files, a
    file:// source outside `models_root` (LLMGW_MODELS_ROOT), and, when
    `engines` is given, an engine not among them); then the caller must
    change nothing.
    """
    models, errors = collect(paths, functools.partial(parse_file, models_root=models_root), "model")
    for path, definition in models.values():
        if engines is not None and definition.profile.engine not in engines:
            errors.append(
                DefinitionError(
                    path,
                    "profile.engine",
                    (
                        f"unknown engine {definition.profile.engine!r} (this planner knows: "
                        f"{', '.join(sorted(engines))}; define it in engines/*.yaml and run "
                        f"`planner engines apply`, or name it in LLMGW_ENGINES)"
                    ),
                )
            )
    if errors:
        raise InvalidDefinitions(errors)
    return models
