"""The planner's only door to Nomad: python-nomad calls, with errors translated.

Called by `jobspec` (parse), `apply` (register, plan, deregister) and
`status` (jobs, allocations). Every method returns plain dicts in Nomad's
JSON shape and raises only `planner.errors` types: NomadUnavailable for a
connection failure or a 5xx (retry later), NomadRejected for a 4xx (the
message is Nomad's own), and returns None for a 404 where "absent" is an
answer (a job that does not exist yet). A failed TLS handshake is
NomadUnavailable too, saying so and naming the NOMAD_* files to check.

TLS: an https:// address is verified with NOMAD_CACERT (else the system's CAs;
python-nomad's own default is not to verify) and presents NOMAD_CLIENT_CERT and
NOMAD_CLIENT_KEY (`planner.spec.settings.ClientTLS`); `ssl_context` carries the same
for the event stream (`planner.agents.events`).

Namespace: the client works in one Nomad namespace (NOMAD_NAMESPACE, default
"default"; docs/definitions.md, "Namespace"), set here and nowhere else: every HTTP
request it makes carries `?namespace=` (its requests session's own query parameters, so
calls python-nomad does not namespace itself, /v1/evaluation(s), and the raw requests
carry it too), a job it renders says it, the event stream asks for it (`events`), and
the ACL capabilities it asks for or is denied name it (`access.in_namespace`). Only
`llmgw_jobs_elsewhere` looks past it (namespace=*), to refuse a second copy of a model.

API shapes: https://developer.hashicorp.com/nomad/api-docs/jobs (Nomad 1.6).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urlparse

import aiohttp
import nomad
import nomad.api.exceptions as nomad_exc
import requests
from requests.adapters import HTTPAdapter

from llmgw_contract import JobMeta
from llmgw_contract.acl import Agent, Permission, TokenStatus
from planner.agents.access import (
    DEFAULT_NAMESPACE,
    NOMAD_LIST_JOBS,
    NOMAD_NODE_READ,
    NOMAD_PARSE_JOB,
    NOMAD_READ_JOB,
    NOMAD_READ_LOGS,
    NOMAD_SCALE_JOB,
    NOMAD_SUBMIT_JOB,
    PROBE_JOB,
    denied_error,
    in_namespace,
)
from planner.agents.events import stream_events
from planner.errors import (
    InvalidSettings,
    NomadRejected,
    NomadUnavailable,
    PermissionDenied,
    no_answer,
)
from planner.spec.settings import NOMAD_TLS_VARS, ClientTLS
from planner.vocab import Job, group_count

log = logging.getLogger("planner.nomad")


def _response_text(exc: nomad_exc.BaseNomadException) -> str:
    resp = exc.nomad_resp
    if isinstance(resp, requests.Response):
        return f"HTTP {resp.status_code}: {resp.text.strip()}"
    return str(resp)


@contextmanager
def _translated(
    action: str, tls_failure: Callable[[BaseException], str | None], address: str = ""
) -> Iterator[None]:
    """Nomad's and requests' errors as the planner's; `action` ("" for none) prefixes
    the message, `address` names the agent a connection failed to (NOMAD_ADDR)."""
    try:
        yield
    except nomad_exc.URLNotFoundNomadException as exc:
        raise NomadRejected(f"{action}: not found ({_response_text(exc)})") from exc
    except (
        nomad_exc.BadRequestNomadException,
        nomad_exc.URLNotAuthorizedNomadException,
        nomad_exc.VariableConflict,
    ) as exc:
        raise NomadRejected(f"{action}: {_response_text(exc)}") from exc
    except (nomad_exc.BaseNomadException, requests.RequestException) as exc:
        if failure := tls_failure(exc):
            raise NomadUnavailable(f"{action}: {failure}") from exc
        prefix = f"{action}: " if action else ""
        # python-nomad wraps a failed connection in its own exception, as `nomad_resp`.
        failed = exc.nomad_resp if isinstance(exc, nomad_exc.BaseNomadException) else exc
        if isinstance(failed, requests.RequestException):
            raise NomadUnavailable(
                prefix + no_answer("Nomad", "NOMAD_ADDR", address, failed)
            ) from exc
        raise NomadUnavailable(f"{prefix}Nomad failed ({_response_text(exc)})") from exc


# How long after an allocation ended Nomad may not have re-run a blocked evaluation on
# the room yet (`NomadClient.stopping_allocations`): it re-runs at once, in well under a
# second on the test cluster; 5 s leaves room for a busy evaluation broker.
RERUN_WITHIN_S = 5.0

_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", re.I)
_JWT = re.compile(r"^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+$")


def _namespaced_session(namespace: str) -> requests.Session:
    """One requests session for every python-nomad endpoint, whose query parameters
    (`Session.params`, merged into each request's; a request's own `namespace`, as
    `llmgw_jobs_elsewhere`'s, wins) put every call in `namespace`. Its pool is sized for
    the leader's threads (without it python-nomad makes a session, with a pool of 10
    connections, per endpoint)."""
    session = requests.Session()
    session.params = {"namespace": namespace}
    adapter = HTTPAdapter(pool_maxsize=32)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


@contextmanager
def _index_conflict() -> Iterator[None]:
    """Nomad answers a lost EnforceIndex race with a 500 whose text starts "Enforcing
    job modify index" (nomad/job_endpoint.go, RegisterEnforceIndexErrPrefix; Scale uses
    the same prefix): an answer, a no, so NomadRejected rather than NomadUnavailable."""
    try:
        yield
    except NomadUnavailable as exc:
        if "Enforcing job modify index" in str(exc):
            raise NomadRejected(str(exc)) from exc
        raise


def _token_shaped(token: str) -> bool:
    """Whether `token` can be a Nomad token at all: an ACL token's secret ID (a UUID)
    or a workload identity (a JWT), nomad/structs ACLToken and IdentityClaims."""
    return bool(_UUID.match(token) or _JWT.match(token))


class NomadClient:
    """Thin, typed wrapper over python-nomad for the calls the planner makes."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        timeout: float = 10.0,
        tls: ClientTLS | None = None,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> None:
        """Raises ValueError (naming the setting) when a configured TLS file is unusable.
        `namespace`: NOMAD_NAMESPACE, the one namespace every call is made in."""
        url = urlparse(address if "://" in address else f"http://{address}")
        self.address = f"{url.scheme}://{url.netloc if url.port else url.netloc + ':4646'}"
        self.token = token
        self.tls = tls or ClientTLS("Nomad", NOMAD_TLS_VARS)
        # Built (so checked) once; aiohttp's default (the system's CAs) for plain HTTP.
        self.ssl_context = self.tls.context() if url.scheme == "https" else None
        # `address` given, so python-nomad does not read NOMAD_ADDR itself; `cert`
        # always given (or its own NOMAD_CLIENT_* lookup would apply).
        self._logs_denied = False
        self.namespace = namespace
        self._api = nomad.Nomad(
            address=self.address,
            secure=url.scheme == "https",
            token=token,
            timeout=timeout,
            verify=self.tls.verify,
            cert=self.tls.cert or ("", ""),
            # Given, so python-nomad does not read NOMAD_NAMESPACE itself.
            namespace=namespace,
            session=_namespaced_session(namespace),
        )

    def _call(self, needs: Permission, action: str, fn: Callable[[], Any]) -> Any:
        """Run `fn`, translating its errors; a 403 is PermissionDenied naming `needs`,
        the ACL capability Nomad checks for this call."""
        try:
            with _translated(action, lambda exc: self.tls.failure(self.address, exc), self.address):
                return fn()
        except NomadRejected as exc:
            if isinstance(exc.__cause__, nomad_exc.URLNotAuthorizedNomadException):
                token, detail = self.token_status()
                raise denied_error(
                    Agent.NOMAD, [in_namespace(needs, self.namespace).rule], token, action, detail
                ) from exc.__cause__
            raise

    def token_status(self) -> tuple[TokenStatus, str]:
        """What Nomad makes of this client's token, after a 403: (status, Nomad's words
        for an unknown one). Nomad answers every denied call "Permission denied",
        whether or not it knows the token; /v1/acl/token/self tells them apart."""
        if not self.token:
            return TokenStatus.EMPTY, ""
        if not _token_shaped(self.token):
            return TokenStatus.UNKNOWN, (
                "not a valid token: Nomad's ACL secret IDs are UUIDs (workload identities JWTs)"
            )
        try:
            self._api.acl.get_self_token()
        except nomad_exc.BaseNomadException as exc:
            # A 4xx to "who am I" is Nomad refusing the token itself (a 5xx says nothing).
            resp = exc.nomad_resp
            if isinstance(resp, requests.Response) and 400 <= resp.status_code < 500:
                return TokenStatus.UNKNOWN, _response_text(exc)
        except requests.RequestException:
            pass
        return TokenStatus.VALID, ""

    def denied(self, needs: list[Permission]) -> tuple[list[Permission], TokenStatus, str] | None:
        """Which of `needs` this client's token is denied, asked with calls that change
        nothing (`planner.agents.access`): None when all are allowed (or Nomad enforces no
        ACLs), else (the denied ones, the token's status, Nomad's words for an unknown
        token). Raises NomadUnavailable when Nomad cannot be asked, InvalidSettings when
        Nomad has no namespace NOMAD_NAMESPACE names (`require_namespace`)."""
        self.require_namespace()
        probe = PROBE_JOB
        probes: dict[Permission, Callable[[], Any]] = {
            NOMAD_LIST_JOBS: lambda: self._api.jobs.request(method="get", params={"prefix": probe}),
            NOMAD_READ_JOB: lambda: self._api.job.request(probe, method="get"),
            NOMAD_SUBMIT_JOB: lambda: self._api.job.request(
                probe, "evaluate", json={"JobID": probe}, method="post"
            ),
            # A hex prefix: Nomad parses a node ID prefix as hex.
            NOMAD_NODE_READ: lambda: self._api.nodes.request(
                method="get", params={"prefix": "ffffffff"}
            ),
        }
        denied = []
        for permission in needs:
            if (ask := probes.get(permission)) is None:
                continue
            try:
                # No action in a message: an agent that does not answer is no ACL matter.
                with _translated("", lambda exc: self.tls.failure(self.address, exc), self.address):
                    ask()
            except NomadRejected as exc:
                if isinstance(exc.__cause__, nomad_exc.URLNotAuthorizedNomadException):
                    denied.append(permission)
            except NomadUnavailable as exc:
                # "job not found" is a 500 from evaluate: an answer past the ACL check.
                if "not found" not in str(exc):
                    raise
        if not denied:
            return None
        token, detail = self.token_status()
        return [in_namespace(p, self.namespace) for p in denied], token, detail

    def require_namespace(self) -> None:
        """Raise InvalidSettings when Nomad has no namespace `self.namespace`: Nomad lists
        nothing and streams nothing for one it does not have, so a misspelt
        NOMAD_NAMESPACE would otherwise look like a cluster without models. "default"
        always exists. A 403 (the token may do nothing in it) is left to the ACL checks,
        which name the capabilities lacking."""
        if self.namespace == DEFAULT_NAMESPACE:
            return
        try:
            with _translated("", lambda exc: self.tls.failure(self.address, exc), self.address):
                self._api.namespace.get_namespace(self.namespace)
        except NomadRejected as exc:
            if isinstance(exc.__cause__, nomad_exc.URLNotFoundNomadException):
                raise InvalidSettings(
                    f"NOMAD_NAMESPACE={self.namespace}: Nomad at {self.address} has no "
                    f"namespace {self.namespace!r}; create it (nomad namespace apply "
                    f"{self.namespace}) or set NOMAD_NAMESPACE to the namespace the "
                    "models run in (unset: default)"
                ) from exc
            if not isinstance(exc.__cause__, nomad_exc.URLNotAuthorizedNomadException):
                raise

    def parse(self, hcl: str, variables: str) -> Job:
        """Render an HCL2 jobspec with a variable file through Nomad's parser (canonicalized).

        python-nomad's `jobs.parse` sends no `Variables`, so this posts the
        request body itself through the library's generic request method.
        """
        body = {"JobHCL": hcl, "Variables": variables, "Canonicalize": True}
        job: Job = self._call(
            NOMAD_PARSE_JOB,
            "parse jobspec",
            lambda: self._api.jobs.request("parse", json=body, method="post").json(),
        )
        # The jobspecs name no namespace (Canonicalize fills in "default"): the job is
        # the planner's namespace's, and says so (its spec hash covers it).
        job["Namespace"] = self.namespace
        return job

    def job(self, job_id: str) -> Job | None:
        """The registered job, or None when Nomad has no job with this ID."""
        try:
            return self._call(
                NOMAD_READ_JOB, f"read job {job_id}", lambda: self._api.job.get_job(job_id)
            )
        except NomadRejected as exc:
            if isinstance(exc.__cause__, nomad_exc.URLNotFoundNomadException):
                return None
            raise

    def jobs(self) -> list[Job]:
        """Every job's stub (ID, Status, Stop, Meta in Nomad >= 1.6 via `meta=true`)."""
        return self._call(
            NOMAD_LIST_JOBS,
            "list jobs",
            lambda: self._api.jobs.request(method="get", params={"meta": "true"}).json(),
        )

    def llmgw_jobs_elsewhere(self, job_ids: set[str]) -> list[Job]:
        """Stubs of llmgw's jobs (`llmgw_model` meta) with one of `job_ids` in every other
        namespace the token may list jobs in (`?namespace=*`: Nomad lists only those,
        acl.AllowNamespaceOperation; it refuses none), for `planner apply` to refuse a
        second copy of a model whose Consul service the first one already has."""
        stubs = self._call(
            NOMAD_LIST_JOBS,
            "list jobs in every namespace",
            lambda: self._api.jobs.request(
                method="get", params={"meta": "true", "namespace": "*"}
            ).json(),
        )
        return [
            s
            for s in stubs
            if s.get("ID") in job_ids
            and s.get("Namespace", DEFAULT_NAMESPACE) != self.namespace
            and JobMeta.MODEL in (s.get("Meta") or {})
        ]

    def register(self, job: Job, enforce_index: int | None = None) -> dict[str, Any]:
        """Register (create or update) a job; returns {EvalID, JobModifyIndex, ...}.
        With `enforce_index`, only if the job's JobModifyIndex is still that one
        (Nomad's EnforceIndex; 0: only if it does not exist): NomadRejected otherwise."""
        body: dict[str, Any] = {"Job": job}
        if enforce_index is not None:
            body |= {"EnforceIndex": True, "JobModifyIndex": enforce_index}
        with _index_conflict():
            return self._call(
                NOMAD_SUBMIT_JOB,
                f"register job {job['ID']}",
                lambda: self._api.job.register_job(job["ID"], body),
            )

    def plan(self, job: Job) -> dict[str, Any]:
        """Dry-run the scheduler with a diff against the registered version."""
        return self._call(
            NOMAD_SUBMIT_JOB,
            f"plan job {job['ID']}",
            lambda: self._api.job.plan_job(job["ID"], {"Job": job}, diff=True),
        )

    def scale(
        self, job_id: str, group: str, count: int, message: str, enforce_index: int | None = None
    ) -> str | None:
        """Set a task group's count (/v1/job/:id/scale); returns the evaluation ID.
        With `enforce_index`, only if the job's JobModifyIndex is still that one
        (JobScaleRequest.EnforceIndex, nomad/structs/structs.go): NomadRejected otherwise.

        Nomad answers 400 "job scaling blocked due to active deployment" while a
        deployment runs; that arrives as NomadRejected with Nomad's words."""
        body: dict[str, Any] = {"Count": count, "Target": {"Group": group}, "Message": message}
        if enforce_index is not None:
            body |= {"EnforceIndex": True, "JobModifyIndex": enforce_index}
        with _index_conflict():
            answer = self._call(
                NOMAD_SCALE_JOB,
                f"scale job {job_id}",
                lambda: self._api.job.request(job_id, "scale", json=body, method="post").json(),
            )
        return answer.get("EvalID") or None

    def evaluate(self, job_id: str, force_reschedule: bool = False) -> str | None:
        """Force a new evaluation of a job (/v1/job/:id/evaluate); returns its ID.

        With `force_reschedule`, failed allocations are placed again although the
        job's reschedule policy gave up on them (how `planner retry` starts a
        replica Nomad stopped after its restart attempts)."""
        body = {"JobID": job_id, "EvalOptions": {"ForceReschedule": force_reschedule}}
        answer = self._call(
            NOMAD_SUBMIT_JOB,
            f"evaluate job {job_id}",
            lambda: self._api.job.request(job_id, "evaluate", json=body, method="post").json(),
        )
        return answer.get("EvalID") or None

    def deregister(self, job_id: str, purge: bool = False) -> dict[str, Any]:
        """Stop a job (purge=True also removes it from Nomad's state)."""
        return self._call(
            NOMAD_SUBMIT_JOB,
            f"deregister job {job_id}",
            lambda: self._api.job.deregister_job(job_id, purge=purge),
        )

    def versions(self, job_id: str) -> list[Job]:
        """Every stored version of a job, newest first."""
        return self._call(
            NOMAD_READ_JOB,
            f"read versions of {job_id}",
            lambda: self._api.job.get_versions(job_id)["Versions"],
        )

    def deployments(self, job_id: str) -> list[dict[str, Any]]:
        """The job's deployments (JobVersion, JobCreateIndex, Status, StatusDescription);
        none for a job that does not exist."""
        try:
            return (
                self._call(
                    NOMAD_READ_JOB,
                    f"read deployments of {job_id}",
                    lambda: self._api.job.get_deployments(job_id),
                )
                or []
            )
        except NomadRejected:
            return []

    def revert(self, job_id: str, version: int, current_version: int) -> dict[str, Any]:
        """Register job version `version` again as a new version, only if the job is
        still at `current_version` (EnforcePriorVersion); returns {EvalID, ...}."""
        return self._call(
            NOMAD_SUBMIT_JOB,
            f"revert job {job_id} to version {version}",
            lambda: self._api.job.revert_job(job_id, version, current_version),
        )

    def allocations(self, job_id: str) -> list[dict[str, Any]]:
        """Allocation stubs of a job (ClientStatus, TaskStates with events)."""
        return self._call(
            NOMAD_READ_JOB,
            f"read allocations of {job_id}",
            lambda: self._api.job.get_allocations(job_id),
        )

    def allocation(self, alloc_id: str) -> dict[str, Any] | None:
        """One allocation in full (with its Job), or None when Nomad no longer has it."""
        try:
            return self._call(
                NOMAD_READ_JOB,
                f"read allocation {alloc_id[:8]}",
                lambda: self._api.allocation.get_allocation(alloc_id),
            )
        except NomadRejected as exc:
            if isinstance(exc.__cause__, nomad_exc.URLNotFoundNomadException):
                return None
            raise

    def stopping_allocations(
        self, since_index: int = 0, within_s: float = RERUN_WITHIN_S
    ) -> list[dict[str, Any]]:
        """Allocation stubs the scheduler told to stop whose tasks still run, or that ended
        after Raft index `since_index` less than `within_s` seconds ago by Nomad's clock
        (the answer's `Date`): room that is being made, or was made after a scheduler
        looked at the cluster. Nomad re-runs a blocked evaluation as soon as an allocation
        on its nodes ends (nomad/fsm.go, `applyAllocClientUpdate` unblocks the node's
        class); a re-run that still cannot place re-blocks it in memory only
        (nomad/eval_endpoint.go, `Reblock`), so an older end is room Nomad already looked
        at (found by CI: an allocation of another job that ended kept a scale-up's
        shortfall "waiting for room" until Nomad's garbage collection). A filter
        expression (Nomad >= 1.3) asks only for allocations told to stop; its grammar has
        no `>`, so the index is compared here."""
        expression = 'DesiredStatus == "stop" or DesiredStatus == "evict"'

        def read() -> tuple[requests.Response, list[dict[str, Any]]]:
            response = self._api.allocations.request(method="get", params={"filter": expression})
            return response, response.json()

        response, stubs = self._call(NOMAD_READ_JOB, "list stopping allocations", read)
        after_ns = _server_time_ns(response) - int(within_s * 1e9)
        return [
            a
            for a in stubs
            if a.get("ClientStatus") in ("running", "pending")
            or (
                since_index
                and int(a.get("ModifyIndex", 0)) > since_index
                and int(a.get("ModifyTime", 0)) >= after_ns
            )
        ]

    def nodes(self) -> list[dict[str, Any]]:
        """Every node's stub with its resources (NodeResources.Devices: the GPUs)."""
        return self._call(
            NOMAD_NODE_READ,
            "list nodes",
            lambda: self._api.nodes.request(method="get", params={"resources": "true"}).json(),
        )

    def node(self, node_id: str) -> dict[str, Any] | None:
        """One node in full (Meta: static and dynamic metadata merged), or None when
        Nomad no longer has it."""
        try:
            return self._call(
                NOMAD_NODE_READ,
                f"read node {node_id[:8]}",
                lambda: self._api.node.get_node(node_id),
            )
        except NomadRejected as exc:
            if isinstance(exc.__cause__, nomad_exc.URLNotFoundNomadException):
                return None
            raise

    def evaluation(self, eval_id: str) -> dict[str, Any]:
        return self._call(
            NOMAD_READ_JOB,
            f"read evaluation {eval_id}",
            lambda: self._api.evaluation.get_evaluation(eval_id),
        )

    def evaluations(self, job_id: str) -> list[dict[str, Any]]:
        """A job's evaluations (FailedTGAllocs, BlockedEval, Status), in no set order."""
        return self._call(
            NOMAD_READ_JOB,
            f"read evaluations of {job_id}",
            lambda: self._api.job.get_evaluations(job_id),
        )

    def current_index(self) -> int:
        """Nomad's latest Raft index (X-Nomad-Index of a cheap list call)."""
        response = self._call(
            NOMAD_LIST_JOBS,
            "read index",
            lambda: self._api.jobs.request(method="get", params={"prefix": "\x00"}),
        )
        return int(response.headers.get("X-Nomad-Index", 0))

    def latest_index(self) -> int:
        """The highest index of the tables the watcher's event topics come from (jobs,
        allocs, evals, deployment, nodes: each list's X-Nomad-Index is its table's index,
        nomad/*_endpoint.go `state.Index(...)`): no event the stream delivered can be
        newer, so a watcher that saw a higher one talks to a reset Nomad."""
        lists = (
            (NOMAD_LIST_JOBS, self._api.jobs),
            (NOMAD_READ_JOB, self._api.allocations),
            (NOMAD_READ_JOB, self._api.evaluations),
            (NOMAD_READ_JOB, self._api.deployments),
            (NOMAD_NODE_READ, self._api.nodes),
        )
        latest = 0
        for needs, endpoint in lists:
            response = self._call(
                needs,
                "read index",
                lambda e=endpoint: e.request(method="get", params={"prefix": "ffffffff-0000"}),
            )
            latest = max(latest, int(response.headers.get("X-Nomad-Index", 0)))
        return latest

    def events(
        self,
        session: aiohttp.ClientSession,
        index: int,
        on_message: Callable[[], None] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """The event stream from `index` on, in this client's namespace, with its token
        and TLS (`planner.agents.events.stream_events`: what it yields and raises)."""
        return stream_events(
            session,
            self.address,
            index,
            self.token,
            on_message=on_message,
            ssl=self.ssl_context,
            namespace=self.namespace,
        )

    def task_stderr_tail(self, alloc_id: str, task: str, size: int = 8192) -> str:
        """The last `size` bytes a task wrote to stderr, through the client filesystem
        API (/v1/client/fs/logs). Empty when the allocation's files are gone."""
        try:
            return self._call(
                NOMAD_READ_LOGS,
                f"read stderr of {alloc_id[:8]}/{task}",
                lambda: self._api.client.stream_logs.stream(
                    alloc_id, task, "stderr", offset=size, origin="end", plain=True
                ),
            )
        except (NomadRejected, NomadUnavailable):
            return ""
        except PermissionDenied as exc:
            # The one capability the checks before acting cannot ask (it needs an
            # allocation): said here, once per process, and the last error goes on
            # without llama.cpp's lines.
            if not self._logs_denied:
                log.error("%s; last errors will lack the task's stderr", exc)
                self._logs_denied = True
            return ""


__all__ = ["Job", "NomadClient", "group_count"]


def _server_time_ns(response: requests.Response) -> int:
    """Nomad's clock from an answer's `Date` header (whole seconds; Go's net/http sets
    it), rounded up so nothing ended in that second counts as older; this machine's
    clock when it is missing. Comparing Nomad's times with Nomad's clock keeps a clock
    skew between this machine and the servers out of the answer."""
    date = response.headers.get("Date")
    try:
        return int((parsedate_to_datetime(date).timestamp() + 1) * 1e9) if date else time.time_ns()
    except (TypeError, ValueError):
        return time.time_ns()
