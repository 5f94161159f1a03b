"""The `planner` command: apply model definitions from git, show their status.

Data goes to stdout (a table, or JSON with `--output json`), messages to
stderr. Exit codes (also in `planner --help`):
  0  done / every model has what it should
  1  an agent refused, or a model is short of what it should have
  2  invalid model files, settings (e.g. a TLS file that does not exist) or usage
  3  Nomad or Consul unreachable (retry later), or an ACL token lacks a permission
     the command needs (the message names the rule and the policy file under acl/)

`apply --dry-run --detailed-exitcode`, for CI on a merge request, exits as
`terraform plan -detailed-exitcode` does: 0 no changes, 2 changes, 1 any error
(2 then no longer means invalid input, which is why it is a flag: the codes above
stay as they are without it). `--output markdown` (apply, status) prints a
summary fit to post on the merge request; on an error, the error as Markdown.

Every command first asks Nomad and Consul whether its tokens (NOMAD_TOKEN,
CONSUL_HTTP_TOKEN) allow what it is about to do (`planner.agents.access`), so `apply`
with a token that may not write changes nothing, and a token whose Consul reads
would be filtered to nothing is refused rather than believed.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import replace
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
import uvicorn
from rich.console import Console
from rich.table import Table

from llmgw_contract import LEADER_KEY, ModelState
from llmgw_contract.acl import Permission
from llmgw_contract.leadership import parse_admin_url
from llmgw_contract.states import ReplicaState
from planner.agents import access
from planner.agents.consul import ConsulClient
from planner.agents.nomad import NomadClient
from planner.agents.state import StateStore
from planner.agents.statusreads import gather, model_status, unrecorded_models
from planner.api.admin import create_app
from planner.cli.apply import MUTATIONS, REFUSALS, Action, Outcome, execute, prepare
from planner.cli.plandiff import format_diff
from planner.cli.planmarkdown import error_markdown, outcomes_markdown, status_markdown
from planner.daemon.engine_install import NodeInstall, execute_engines, installs, prepare_engines
from planner.daemon.repair import record_or_restored
from planner.daemon.retry import retry as retry_model
from planner.daemon.serve import PlannerNode
from planner.daemon.watcher import RECONCILE_EVERY_S
from planner.engines.fitargs import slots
from planner.errors import InvalidDefinitions, PlannerError, Unavailable
from planner.model.failures import PARK_AFTER, STABLE_AFTER_S, Rules, headline
from planner.model.placement import evaluation_reason
from planner.model.status import ModelStatus
from planner.model.unplaceable import engine_need
from planner.spec.definitions import ModelDefinition
from planner.spec.fit import Fit
from planner.spec.settings import Settings

# One item per line: rich keeps a help text's line breaks and wraps each line on its
# own, so a sentence broken across source lines wrapped mid-sentence (issue 19's
# second QA).
EXIT_CODES = "\n".join(
    (
        "Exit codes:",
        "0  ok",
        "1  refused by an agent, or a model is short of what it should have (an engine not "
        "installed on some node; Nomad runs a model job Consul has no record of)",
        "2  invalid model or engine files, settings or usage",
        "3  Nomad or Consul unreachable, or its TLS certificate not verified (retry later), "
        "or an ACL token (NOMAD_TOKEN, CONSUL_HTTP_TOKEN) lacks a permission: the message "
        "names it and the policy under acl/",
        "`apply --dry-run --detailed-exitcode` exits as `terraform plan -detailed-exitcode` "
        "does instead: 0 no changes, 2 changes, 1 any error.",
    )
)

app = typer.Typer(
    help=f"llmgw planner: run llama.cpp models on Nomad.\n\n{EXIT_CODES}",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Not a terminal (CI logs, pipes, grep): no colour, and rows never wrap.
_WIDTH = None if sys.stdout.isatty() else 100_000
out = Console(highlight=False, soft_wrap=True, width=_WIDTH)
err = Console(stderr=True, highlight=False, soft_wrap=True)


# Nomad's deployment statuses that no longer change (structs.Deployment.Active).
DEPLOYMENT_DONE = frozenset({"successful", "failed", "cancelled"})


class Output(StrEnum):
    table = "table"
    json = "json"


class ReportOutput(StrEnum):
    """`apply` and `status` also write Markdown, fit to post on a merge request.
    Compared with ==, so an Output and a ReportOutput of one value are equal."""

    table = "table"
    json = "json"
    markdown = "markdown"


OutputOption = Annotated[Output, typer.Option("--output", "-o", help="table or json")]
ApplyOutputOption = Annotated[
    ReportOutput,
    typer.Option(
        "--output", "-o", help="table, json, or markdown (a plan summary for a merge request)"
    ),
]
StatusOutputOption = Annotated[
    ReportOutput, typer.Option("--output", "-o", help="table, json, or markdown")
]


def _clients(
    needs: tuple[Permission, ...],
    output: Output | ReportOutput = Output.table,
    error_exit: int | None = None,
    **overrides: str | None,
) -> tuple[Settings, NomadClient, ConsulClient]:
    """Settings from the environment (with the options in `overrides` that were given),
    checked, and the two agents' clients, once the agents said the tokens allow
    `needs`; exit 2 naming the setting that is wrong, 3 naming what a token lacks (or
    the agent that could not be asked); `error_exit`, when given, instead of either."""
    try:
        settings = replace(
            Settings.from_env(), **{k: v for k, v in overrides.items() if v is not None}
        )
        settings.validate()
        nomad = NomadClient(
            settings.nomad_addr,
            settings.nomad_token,
            tls=settings.nomad_tls,
            namespace=settings.nomad_namespace,
        )
        consul = ConsulClient(settings.consul_url, settings.consul_token, tls=settings.consul_tls)
    except ValueError as exc:
        err.print(f"error: {exc}", markup=False)
        code = 2 if error_exit is None else error_exit
        if output == Output.json:
            _print_error(code, "InvalidSettings", str(exc))
        raise typer.Exit(code) from None
    try:
        access.check(nomad, consul, needs)
    except PlannerError as exc:
        raise _fail(exc, output, error_exit=error_exit) from None
    return settings, nomad, consul


def _fail(
    exc: PlannerError,
    output: Output | ReportOutput = Output.table,
    files: str = "model",
    error_exit: int | None = None,
) -> typer.Exit:
    """Report `exc` on stderr (and, with --output json or markdown, on stdout); the exit,
    `exc.exit_code` or `error_exit` when given (--detailed-exitcode's 1), which the JSON
    error's `exit_code` repeats. `files` says which definitions a list of problems is
    about."""
    code = exc.exit_code if error_exit is None else error_exit
    problems = exc.errors if isinstance(exc, InvalidDefinitions) else []
    if problems:
        err.print(f"error: {len(problems)} problem(s) in the {files} files; nothing was changed:")
        for problem in problems:
            err.print(f"  {problem}", markup=False)
    else:
        err.print(f"error: {exc}", markup=False)
    listed = [{"file": str(p.file), "field": p.field, "message": p.message} for p in problems]
    if output == Output.json:
        _print_error(
            code,
            type(exc).__name__,
            str(exc)
            if not problems
            else f"{len(problems)} problem(s) in the {files} files; nothing was changed",
            listed,
        )
    elif output == ReportOutput.markdown:
        print(error_markdown(str(exc), listed), end="")
    return typer.Exit(code)


def _print_error(
    exit_code: int, kind: str, message: str, problems: list[dict[str, str]] | None = None
) -> None:
    """The JSON every command prints on stdout, with --output json, when it fails:
    {"error": {"kind", "message", "exit_code", "problems": [{file, field, message}]}}."""
    print(
        json.dumps(
            {
                "error": {
                    "kind": kind,
                    "message": message,
                    "exit_code": exit_code,
                    "problems": problems or [],
                }
            },
            indent=2,
        )
    )


@app.command()
def apply(
    paths: Annotated[list[Path], typer.Argument(help="model files or folders of *.yaml")],
    prune: Annotated[bool, typer.Option(help="deregister models no longer in these files")] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            help="print Nomad's plan diff and each model's memory estimate; change nothing"
        ),
    ] = False,
    detailed_exitcode: Annotated[
        bool,
        typer.Option(
            "--detailed-exitcode",
            help="with --dry-run, exit as `terraform plan "
            "-detailed-exitcode` does: 0 no changes, 2 changes, 1 any error",
        ),
    ] = False,
    wait: Annotated[bool, typer.Option(help="wait until changed models pass their checks")] = False,
    timeout: Annotated[float, typer.Option(help="seconds --wait waits at most")] = 600.0,
    output: ApplyOutputOption = ReportOutput.table,
) -> None:
    """Validate every file, then register only the models that changed.

    With --dry-run --detailed-exitcode (for CI on a merge request): exit 0 when
    nothing would change, 2 when something would, 1 on any error (invalid files,
    an agent unreachable or refusing, a token lacking a permission; the message,
    and with --output json the error's `kind`, say which; its `exit_code` is the
    process's, 1)."""
    if detailed_exitcode and not dry_run:
        err.print("error: --detailed-exitcode goes with --dry-run (it reports a plan)")
        raise typer.Exit(1)
    # Every error exits 1 then, and the JSON error says so (its `kind` says which).
    error_exit = 1 if detailed_exitcode else None
    try:
        changed = _apply(paths, prune, dry_run, wait, timeout, output, error_exit)
    except typer.Exit as exc:
        if detailed_exitcode and exc.exit_code != 0:
            raise typer.Exit(1) from None
        raise
    if detailed_exitcode and changed:
        raise typer.Exit(2)


def _apply(
    paths: list[Path],
    prune: bool,
    dry_run: bool,
    wait: bool,
    timeout: float,
    output: ReportOutput,
    error_exit: int | None = None,
) -> bool:
    """`apply`'s work; whether anything changed (or would, in a dry run). Exits 1 when a
    definition Nomad rolled back was refused or --wait saw a model give up, 2 or 3 as
    the module says."""
    settings, nomad, consul = _clients((), output, error_exit)
    try:
        definitions, changes, fits = prepare(
            paths, settings, nomad, consul, prune, access.APPLY_DRY_RUN if dry_run else access.APPLY
        )
        outcomes = execute(definitions, changes, nomad, consul, dry_run)
    except PlannerError as exc:
        raise _fail(exc, output, error_exit=error_exit) from exc
    changed = [o for o in outcomes if o.change.action in MUTATIONS]
    shown = fits if dry_run else {}
    serving = _serving(definitions) if dry_run else {}
    if output == Output.json:
        print(
            json.dumps(
                {
                    "dry_run": dry_run,
                    "changes": [_outcome_json(o, shown, serving) for o in outcomes],
                },
                indent=2,
            )
        )
    elif output == ReportOutput.markdown:
        print(
            outcomes_markdown(
                outcomes,
                dry_run,
                {model: fit.text() for model, fit in shown.items()},
                {model: _serving_text(*s) for model, s in serving.items()},
            ),
            end="",
        )
    else:
        _print_outcomes(outcomes, dry_run, shown, serving)
    if not changed:
        err.print("no changes")
    refused = [o.change for o in outcomes if o.change.action in REFUSALS]
    for change in refused:
        err.print(f"error: {change.model}: {change.reason}", markup=False)
    if wait and not dry_run:
        _wait_serving(
            [o.change.model for o in outcomes if o.change.action in (Action.CREATE, Action.UPDATE)],
            nomad,
            consul,
            timeout,
        )
    if refused:
        raise typer.Exit(1)
    return bool(changed)


def _serving(definitions: dict[str, ModelDefinition]) -> dict[str, tuple[int, int]]:
    """{model: (slots, tokens of context each request can use)}, as its job runs it:
    the profile's --parallel (1 without one) and `context` (`planner.engines.fitargs`)."""
    return {name: (slots(d.profile.args), d.profile.context) for name, d in definitions.items()}


def _serving_text(slot_count: int, context: int) -> str:
    return f"{slot_count} x {context} tokens"


def _outcome_json(
    outcome: Outcome, fits: dict[str, Fit], serving: dict[str, tuple[int, int]]
) -> dict[str, Any]:
    data = outcome.as_dict()
    if outcome.change.model in serving:
        data["slots"], data["context_per_request"] = serving[outcome.change.model]
    if outcome.change.model in fits:
        data["estimate"] = fits[outcome.change.model].as_dict()
    if outcome.plan is not None:
        data["diff"] = format_diff(outcome.plan.get("Diff"))
        data["placement"] = evaluation_reason(outcome.plan, engine=engine_need(outcome.change.job))
    return data


def _print_outcomes(
    outcomes: list[Outcome],
    dry_run: bool,
    fits: dict[str, Fit],
    serving: dict[str, tuple[int, int]],
) -> None:
    """The table of changes; in a dry run, columns with each model's slots and context
    per request (`serving`) and its memory estimate from its GGUF header (`fits`)."""
    columns = ["model", "action", "reason", "evaluation", "version"]
    table = Table(
        *columns,
        *(["slots x context"] if serving else []),
        *(["memory estimate"] if fits else []),
        box=None,
    )
    for o in outcomes:
        model = o.change.model
        served = [_serving_text(*serving[model]) if model in serving else ""] if serving else []
        estimate = [fits[model].text() if model in fits else ""] if fits else []
        table.add_row(
            model,
            str(o.change.action),
            o.change.reason,
            (o.eval_id or "")[:8],
            "" if o.job_version is None else str(o.job_version),
            *served,
            *estimate,
        )
    out.print(table)
    for o in outcomes:
        if o.plan is not None:
            out.print(f"\nplan for {o.change.model}:", markup=False)
            for line in format_diff(o.plan.get("Diff")):
                out.print(line, markup=False)
            unplaced = evaluation_reason(o.plan, engine=engine_need(o.change.job))
            if unplaced:
                out.print(f"placement: would not place: {unplaced}", markup=False)


def _wait_serving(
    models: list[str], nomad: NomadClient, consul: ConsulClient, timeout: float
) -> None:
    """Poll status every second (Consul health is what counts) and report each change."""
    deadline, last = time.monotonic() + timeout, ""
    while models:
        rows = {s.name: s for s in gather(nomad, consul) if s.name in models}
        line = ", ".join(
            f"{n}: {s.state} ({s.reason}){_rollout(s)}"
            + (f" last error: {headline(s.last_error)}" if s.state == ModelState.FAILING else "")
            for n, s in sorted(rows.items())
        )
        if line != last:
            err.print(f"waiting: {line}", markup=False)
            last = line
        if all(s.satisfied and s.rolled_out and not _deploying(nomad, s) for s in rows.values()):
            return
        # States that do not end by waiting: an operator has to act.
        given_up = {
            n: s
            for n, s in rows.items()
            if s.state in (ModelState.PARKED, ModelState.UNPLACEABLE)
            or s.update_failed is not None
            # While a rollout runs, a new replica Nomad stopped makes Nomad
            # roll the update back: wait for that verdict (update_failed).
            or (s.rolled_out and any(r.state == ReplicaState.STOPPED for r in s.replicas))
        }
        if given_up:
            for name, row in sorted(given_up.items()):
                err.print(
                    f"error: {name} is {row.state}: {row.reason}"
                    + (f"; last error: {headline(row.last_error)}" if row.last_error else ""),
                    markup=False,
                )
            raise typer.Exit(1)
        if time.monotonic() > deadline:
            err.print(f"error: not serving after {timeout:.0f} s")
            raise typer.Exit(1)
        time.sleep(1)


def _deploying(nomad: NomadClient, row: ModelStatus) -> bool:
    """The deployment of the job's current version still runs: it is not yet the
    stable version an update that fails later is rolled back to."""
    mine = [d for d in nomad.deployments(row.name) if d.get("JobVersion") == row.job_version]
    latest = max(mine, key=lambda d: d.get("CreateIndex", 0), default=None)
    return latest is not None and latest.get("Status") not in DEPLOYMENT_DONE


def _rollout(row: ModelStatus) -> str:
    """While a new version rolls out beside the old: how far it got. Nothing for a
    model that is parked or unplaceable (no rollout runs: its state says why), and
    only the old replicas that do serve are counted as serving."""
    if row.rolled_out or row.state in (ModelState.PARKED, ModelState.UNPLACEABLE):
        return ""
    new = [r for r in row.replicas if r.job_version == row.job_version]
    healthy = sum(1 for r in new if r.state == ReplicaState.SERVING)
    serving_old = sum(
        1
        for r in row.replicas
        if r.job_version != row.job_version and r.state == ReplicaState.SERVING
    )
    progress = (
        f"{healthy} of {len(new)} new replica(s) healthy" if new else "no new replica placed yet"
    )
    return (
        f"; rolling out version {row.job_version}: {progress}, {serving_old} old serving meanwhile"
    )


def _rows(output: Output | ReportOutput) -> tuple[list[ModelStatus], list[str], bool]:
    """Every applied model's status, the model jobs Nomad has without a record
    (`unrecorded_models`), and whether a planner leads (`_led`); or exit with the agents'
    error."""
    _, nomad, consul = _clients(access.STATUS, output)
    try:
        return gather(nomad, consul), unrecorded_models(nomad, consul), _led(consul)
    except PlannerError as exc:
        raise _fail(exc, output) from exc


NO_LEADER_MESSAGE = (
    f"no planner leads now ({LEADER_KEY} is not held): the states above are as a leader "
    "last wrote them, and nothing counts failures or parks until `planner serve` runs"
)


def _led(consul: ConsulClient) -> bool:
    """Whether a planner holds the leader lock now; True when that cannot be read (the
    rows were read: saying more would guess). Found by issue 19's fourth QA: with no
    planner serving, `status` showed a model Nomad had given up on as `failing`, 0
    failures, and nothing said the document was stale."""
    try:
        return consul.lock_holder(LEADER_KEY) is not None
    except PlannerError:
        return True


def unrecorded_message(names: list[str], rows: int) -> str:
    """What `status` says of model jobs Consul has no record of, and what to do."""
    listed = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    head = "no model records in Consul" if not rows else "models missing from Consul"
    return (
        f"{head}, but Nomad runs {len(names)} llmgw job(s) without one ({listed}): Consul "
        "lost them (restarted or rebuilt, or llmgw/ wiped); the leading `planner serve` "
        "restores them from the jobs' meta, or run `planner apply`"
    )


@app.command()
def status(
    output: StatusOutputOption = ReportOutput.table,
    nodes: Annotated[
        bool,
        typer.Option(
            "--nodes",
            help="the engines installed per node instead; exit 0 only when "
            "every node has every defined engine",
        ),
    ] = False,
) -> None:
    """A row per applied model; exit 0 only when every model has what it should."""
    if nodes:
        _status_nodes(output)
        return
    rows, unrecorded, led = _rows(output)
    if output == Output.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
    elif output == ReportOutput.markdown:
        print(status_markdown(rows), end="")
    else:
        _print_status(rows, quiet=bool(unrecorded))
    if unrecorded:
        err.print(unrecorded_message(unrecorded, len(rows)))
    if (rows or unrecorded) and not led:
        err.print(NO_LEADER_MESSAGE)
    if unrecorded or not all(r.satisfied for r in rows):
        raise typer.Exit(1)


def _print_status(rows: list[ModelStatus], quiet: bool = False) -> None:
    """The table; `quiet`: say nothing of an empty one (the caller says why)."""
    table = Table(
        "model",
        "state",
        "desired",
        "running",
        "ready",
        "failures",
        "reason",
        "last error",
        box=None,
    )
    for r in rows:
        table.add_row(
            r.name,
            r.state,
            _desired(r),
            str(r.running),
            str(r.ready),
            str(r.consecutive_failures),
            r.reason,
            headline(r.last_error),
        )
    out.print(table)
    for line in filter(None, map(scaling_line, rows)):
        out.print(line, highlight=False)
    if not rows and not quiet:
        err.print("no models applied yet (run `planner apply models/`)")


def _desired(row: ModelStatus) -> str:
    """`desired`, or `min/desired/max` for a model with load-based scaling."""
    if row.scaling is None:
        return str(row.desired)
    return f"{row.scaling['min']}/{row.desired}/{row.scaling['max']}"


def scaling_line(row: ModelStatus) -> str | None:
    """One line under the table for a scaling model: its demand and last decision."""
    view = row.scaling
    if view is None:
        return None
    line = (
        f"{row.name}: scaling {view['min']}/{row.desired}/{view['max']} (min/desired/max), "
        f"target {view['target']:g} per replica, average {view['average']:g}"
    )
    if view.get("average_stale"):
        line += " (stale: no load signal)"
    if view["at_max"]:
        line += "; at max, demand asks for more"
    if view["shortfall"]:
        line += f"; {view['shortfall']}"
    if view["waiting"]:
        line += f"; {view['waiting']}"
    last = view["last"]
    line += f"; last {last['reason']} at {last['at']}" if last else "; no decision yet"
    return line


def _installs(output: Output | ReportOutput) -> list[NodeInstall]:
    settings, nomad, consul = _clients(access.ENGINES_STATUS, output)
    try:
        return installs(nomad, consul, settings.datacenters)
    except PlannerError as exc:
        raise _fail(exc, output) from exc


def _status_nodes(output: Output | ReportOutput) -> None:
    """`status --nodes`: each defined engine on each schedulable node."""
    rows = _installs(output)
    if output == Output.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
    else:
        _print_installs(rows)
    if not all(r.ok for r in rows):
        raise typer.Exit(1)


def _print_installs(rows: list[NodeInstall]) -> None:
    table = Table("node", "engine", "version", "installed", "install", "error", box=None)
    for r in rows:
        table.add_row(r.node, r.engine, r.wanted, r.installed or "-", r.install or "-", r.error)
    out.print(table)
    if not rows:
        err.print("no engines defined (run `planner engines apply engines/`)")


engines_app = typer.Typer(
    help=f"Engines (engines/*.yaml): a sysbatch job installs each on "
    f"every node and records it in the node's metadata.\n\n"
    f"{EXIT_CODES}",
    no_args_is_help=True,
)
app.add_typer(engines_app, name="engines")


@engines_app.command("apply")
def engines_apply(
    paths: Annotated[list[Path], typer.Argument(help="engine files or folders of *.yaml")],
    dry_run: Annotated[bool, typer.Option(help="print Nomad's plan; change nothing")] = False,
    wait: Annotated[
        bool, typer.Option(help="wait until every node has them (exit 1 when an install fails)")
    ] = False,
    timeout: Annotated[float, typer.Option(help="seconds --wait waits at most")] = 600.0,
    output: OutputOption = Output.table,
) -> None:
    """Validate every engine file, then register the install jobs that changed, run
    again the installs that failed, and install on nodes that joined since."""
    settings, nomad, consul = _clients(access.ENGINES_APPLY, output)
    try:
        changes = prepare_engines(paths, settings, nomad, consul)
        outcomes = execute_engines(changes, nomad, consul, dry_run)
    except PlannerError as exc:
        raise _fail(exc, output, files="engine") from exc
    if output is Output.json:
        print(
            json.dumps(
                {
                    "dry_run": dry_run,
                    "changes": [
                        {k: v for k, v in o.items() if k != "plan"}
                        | ({"diff": format_diff(o["plan"].get("Diff"))} if "plan" in o else {})
                        for o in outcomes
                    ],
                },
                indent=2,
            )
        )
    else:
        table = Table("engine", "action", "reason", "job", "evaluation", box=None)
        for o in outcomes:
            table.add_row(
                o["engine"], o["action"], o["reason"], o["job_id"], (o["eval_id"] or "")[:8]
            )
        out.print(table)
    if wait and not dry_run:
        _wait_installed({o["engine"] for o in outcomes}, output, timeout)


def _wait_installed(engines: set[str], output: Output, timeout: float) -> None:
    """Poll every second until every schedulable node ran the current install job of each
    engine and records its version; once every node answered, exit 1 naming each node
    where an install failed; or exit 1 at the timeout."""
    deadline, last = time.monotonic() + timeout, ""
    while True:
        rows = [r for r in _installs(output) if r.engine in engines]
        line = ", ".join(
            f"{e}: on {sum(r.ok for r in rows if r.engine == e)} of "
            f"{sum(1 for r in rows if r.engine == e)} nodes"
            for e in sorted(engines)
        )
        if line != last:
            err.print(f"waiting: {line}", markup=False)
            last = line
        # The version recorded and this job version's install done: a changed definition
        # of the same version (a new path, a new sha256) is checked again on every node.
        if rows and all(r.ok and r.install == "complete" for r in rows):
            return
        failed = [r for r in rows if not r.ok and r.install == "failed"]
        # Every node's answer first: one that failed fast must not hide another's failure
        # (nor its crash) still on its way.
        answered = all(r.install == "failed" or (r.ok and r.install == "complete") for r in rows)
        if (failed and answered) or time.monotonic() > deadline:
            for r in failed:
                err.print(
                    f"error: {r.engine} {r.wanted} failed to install on {r.node}: {r.error}",
                    markup=False,
                )
            if not answered:
                err.print(f"error: not installed everywhere after {timeout:.0f} s")
            raise typer.Exit(1)
        time.sleep(1)


@app.command()
def models(output: OutputOption = Output.table) -> None:
    """The applied models with their state, failures, reason and last error (always exit 0)."""
    rows, unrecorded, led = _rows(output)
    if unrecorded:
        err.print(unrecorded_message(unrecorded, len(rows)))
    if (rows or unrecorded) and not led:
        err.print(NO_LEADER_MESSAGE)
    if output == Output.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
        return
    table = Table("model", "state", "failures", "reason", "since", "last error", box=None)
    for r in rows:
        table.add_row(
            r.name,
            r.state,
            str(r.consecutive_failures),
            r.reason,
            r.since or "",
            headline(r.last_error),
        )
    out.print(table)


@app.command()
def retry(
    model: Annotated[str, typer.Argument(help="the model to start again")],
    output: OutputOption = Output.table,
) -> None:
    """Lift a model's parking and start it again (the admin API's retry, run directly)."""
    _, nomad, consul = _clients(access.RETRY, output)
    try:
        # From its job where KV forgot it, as the admin API's retry (planner.daemon.repair).
        record = record_or_restored(nomad, consul, StateStore(consul), model)
        if record is None:
            err.print(f"error: model {model!r} was never applied")
            if output == Output.json:
                _print_error(2, "UnknownModel", f"model {model!r} was never applied")
            raise typer.Exit(2)
        state, done = retry_model(nomad, consul, model)
        row = model_status(nomad, consul, model, record, state)
    except PlannerError as exc:
        raise _fail(exc, output) from exc
    if output == Output.json:
        print(json.dumps({**row.as_dict(), "retry": done}, indent=2))
    else:
        err.print(f"{model}: {done} (now {row.state}: {row.reason})")


def advertised_url(advertise: str, serves_tls: bool) -> str:
    """`--advertise` as a URL: one with a scheme as given; `host:port` gets https when
    the admin API serves TLS, else http (so a jobspec need not know whether TLS is on)."""
    if "://" in advertise:
        return advertise
    return f"{'https' if serves_tls else 'http'}://{advertise}"


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="admin API listen address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="admin API port")] = 4650,
    advertise: Annotated[
        str,
        typer.Option(
            help="the admin API's URL as other planners "
            "reach it; HOST:PORT without a scheme takes "
            "https when serving TLS, else http "
            "(default HOST:PORT of --host, --port)"
        ),
    ] = "",
    park_after: Annotated[
        int, typer.Option(help="consecutive start failures that park a model")
    ] = PARK_AFTER,
    stable_after: Annotated[
        int,
        typer.Option(help="seconds a replica must stay healthy before its failures are forgiven"),
    ] = STABLE_AFTER_S,
    reconcile_every: Annotated[
        float,
        typer.Option(
            help="seconds between full reconciles "
            "of every model from Nomad (the "
            "backstop for lost events)"
        ),
    ] = RECONCILE_EVERY_S,
    tls_cert: Annotated[
        str | None,
        typer.Option(
            help="serve the admin API over HTTPS with this PEM certificate (env LLMGW_TLS_CERT)"
        ),
    ] = None,
    tls_key: Annotated[
        str | None, typer.Option(help="its PEM private key (env LLMGW_TLS_KEY)")
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error")] = "info",
) -> None:
    """Campaign for leadership; while leading, run the watcher (start failures, parking,
    placement), the idle scaler and activation; always serve the admin API (over HTTPS
    with --tls-cert/--tls-key; followers verify the leader with LLMGW_PLANNER_CACERT)."""
    settings, nomad, consul = _clients((), tls_cert=tls_cert, tls_key=tls_key)
    url = advertised_url(advertise or f"{host}:{port}", settings.serves_tls)
    try:
        # What it registers in Consul: followers and routers reach it there and
        # nowhere else (llmgw_contract.leadership).
        parse_admin_url(url)
    except ValueError as exc:
        err.print(f"error: --advertise: {exc}", markup=False)
        raise typer.Exit(2) from None
    try:
        access.check(nomad, consul, access.SERVE)
    except Unavailable as exc:
        # The node retries its agents forever; a daemon started before them must not
        # die of it. A token it lacks is said as soon as they answer (the 403s).
        err.print(f"warning: could not check the ACL tokens yet: {exc}", markup=False)
    except PlannerError as exc:
        raise _fail(exc) from None
    logging.basicConfig(
        level=log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    rules = Rules(park_after=park_after, stable_after_ns=stable_after * 10**9)
    node = PlannerNode(
        nomad,
        consul,
        url,
        rules,
        settings.datacenters,
        certificate_paths=settings.certificate_files,
        reconcile_every=reconcile_every,
    )
    forward_ssl = settings.planner_tls.context() if settings.planner_tls.configured else None
    admin = create_app(node, os.environ.get("LLMGW_ADMIN_TOKEN") or None, forward_ssl=forward_ssl)
    uvicorn.run(
        admin,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        ssl_certfile=settings.tls_cert,
        ssl_keyfile=settings.tls_key,
    )


def main() -> None:
    """Console-script entry point."""
    sys.exit(app())


if __name__ == "__main__":
    main()
