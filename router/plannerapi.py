"""The router's client of the planner's activator API: activate a model, report usage.

Two calls, both ``POST`` with ``Authorization: Bearer <token>`` (the planner's
``LLMGW_ADMIN_TOKEN``):

- ``/v1/models/{name}/activate`` -> 200 and an
  :class:`llmgw_contract.ActivationAnswer` (its ``status`` one of
  :class:`llmgw_contract.ActivationStatus`), decoded with
  :func:`llmgw_contract.decode`; an answer that does not decode (a status the
  contract does not have) is :class:`router.errors.PlannerUnavailable`. The
  planner makes a fresh placement attempt if the model is not placed or
  starting, waits up to ~2 s for Nomad's answer, and says what it saw;
- ``/v1/usage`` with an :class:`llmgw_contract.UsageReport` (``{"models": [...],
  "router", "interval_s", "load": {model: {"inflight", "waiting"}}}``) -> 204: those
  models were used now, and this router's requests per model now (load-based scaling).

Called by :mod:`router.activation` (one activate call per model at a time) and
:mod:`router.usage` (one usage call per interval). Every aiohttp, timeout,
status and decoding failure leaves this module as
:class:`router.errors.PlannerUnavailable` (a 404 on activate as
:class:`router.errors.ModelNotFound`), so nothing above sees aiohttp's types.

**Which planner.** Several ``planner serve`` instances may run; the leader
acts, and a follower forwards a POST to it (or answers 503 ``no_leader``
during an election). Each call goes through the addresses
:meth:`router.planners.PlannerCandidates.ordered` lists (the leader where its
lock session registered it, never the text of Consul ``llmgw/leader`` alone;
the planner that answered last, the configured ``--planner-url``, the passing
``llmgw-planner`` instances) and moves to the
next only when a planner could not be reached at all: no connection could be
made (refused, reset, unreachable, name or TLS handshake failure:
``aiohttp.ClientConnectorError`` and its subclasses) or making it timed out
(``aiohttp.ConnectionTimeoutError``). The request never went out, so nothing
ran. Anything after that is final: an HTTP answer of any status, even 503
``no_leader`` (passed on as today: ``planner_unavailable`` with
``Retry-After``), a timeout while waiting for the answer, a connection that
broke after the request was sent. The planner may have acted, and an activate
call run twice is a second placement attempt. The planner that answered is
remembered (:meth:`router.planners.PlannerCandidates.answered`, which logs
and counts a switch). Redirects are not followed: the token goes only to the
addresses listed.

An ``https://`` planner (``planner serve --tls-cert``) is verified with the
context :meth:`router.settings.RouterSettings.planner_ssl_context` builds
(``LLMGW_PLANNER_CACERT``, else the system's CAs); a certificate that does not
verify is :class:`router.errors.PlannerUnavailable` saying so (without
``Retry-After`` when no planner verified: that is configuration).

Its own aiohttp session, not the upstream pool: short timeouts, per attempt,
so a dead candidate costs at most the connect timeout (2 s; a refused
connection costs nothing) and a planner that accepts connections and then
hangs costs a request ``timeout_s``, not minutes; and nothing here competes
with proxied requests for connections.
"""

from __future__ import annotations

import json
import logging
import ssl
import urllib.parse
from collections.abc import Sequence

import aiohttp

from llmgw_contract import ActivationAnswer, UsageReport, decode
from router import errors
from router.planners import PlannerCandidates

log = logging.getLogger(__name__)

# Connection refused answers at once; this bounds a host that drops SYNs, and
# so what a dead candidate costs a call.
_CONNECT_TIMEOUT_S = 2.0
# Under uvicorn's keep-alive (timeout_keep_alive, 5 s), which `planner serve`
# runs: a call never goes out on a connection the planner is closing, which
# would fail after the request was sent and so could not move on.
_KEEPALIVE_S = 4.0
_DETAIL_LIMIT = 300
# The failures after which the request provably never reached the planner (the
# same rule as router.proxy's for replicas): no connection (refused, reset,
# unreachable, name or TLS handshake failure) or a connect timeout.
_NEVER_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


def _detail(body: bytes) -> str:
    """The planner's error message (its ``{"error": {"message"}}``), else the body, clipped."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")
    return _clip(" ".join(str(message).split()))


def _clip(text: str) -> str:
    return text if len(text) <= _DETAIL_LIMIT else text[: _DETAIL_LIMIT - 1] + "…"


class PlannerAPI:
    """The two activator calls over a private aiohttp session, to the planners
    ``planners`` lists.

    :meth:`start` and :meth:`close` run inside the event loop (the router's
    lifespan, or a test's). ``timeout_s`` bounds each attempt.
    """

    def __init__(
        self,
        planners: PlannerCandidates,
        token: str | None,
        timeout_s: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.planners = planners
        self.timeout_s = timeout_s
        self._token = token
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        self._session = aiohttp.ClientSession(
            headers=headers,
            connector=aiohttp.TCPConnector(ssl=self._ssl or True, keepalive_timeout=_KEEPALIVE_S),
            # The connect timeout under the total, so a connect that times out is
            # told apart (ConnectionTimeoutError: never sent) from a slow answer.
            timeout=aiohttp.ClientTimeout(
                total=self.timeout_s, sock_connect=min(_CONNECT_TIMEOUT_S, self.timeout_s / 2)
            ),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def activate(self, model: str) -> ActivationAnswer:
        """Ask the planner to bring ``model`` up (or say why it cannot).

        Raises :class:`router.errors.PlannerUnavailable` or
        :class:`router.errors.ModelNotFound` (the planner never applied it).
        """
        path = f"/v1/models/{urllib.parse.quote(model, safe='')}/activate"
        what = f"activate the model `{model}`"
        base, status, body = await self._post(path, None, what)
        if status == 404:
            # Defined in KV, unknown to the planner: removed a moment ago.
            raise errors.ModelNotFound(
                model, f"the planner at {base} does not know it ({_detail(body)})"
            )
        if status != 200:
            raise _refused(base, status, body, what)
        try:
            return decode(ActivationAnswer, body)
        except ValueError as exc:
            log.error("the planner at %s answered outside the contract: %s", base, exc)
            raise errors.PlannerUnavailable(
                f"The planner at {base} gave an answer this router does not "
                f"understand when asked to {what}: {_clip(' '.join(str(exc).split()))}."
            ) from None

    async def report_usage(self, models: Sequence[str], report: UsageReport | None = None) -> None:
        """Tell the planner ``models`` were used now, with ``report``'s load when given.
        Raises :class:`PlannerUnavailable`."""
        what = f"record the use of {len(models)} model(s)"
        payload = report.model_dump(mode="json") if report is not None else {"models": list(models)}
        base, status, body = await self._post("/v1/usage", payload, what)
        if status not in (200, 204):
            raise _refused(base, status, body, what)

    async def _post(self, path: str, payload: object, what: str) -> tuple[str, int, bytes]:
        """``(base URL that answered, status, body)`` from the first candidate reached."""
        if self._session is None:
            raise RuntimeError("PlannerAPI used before start()")
        unreached: list[tuple[str, aiohttp.ClientError]] = []
        for base in self.planners.ordered():
            try:
                async with self._session.post(
                    base + path, json=payload, allow_redirects=False
                ) as resp:
                    status, body = resp.status, await resp.read()
            except _NEVER_SENT as exc:
                log.debug("planner at %s not reached (%r); trying the next", base, exc)
                unreached.append((base, exc))
                continue
            except TimeoutError:
                raise errors.PlannerUnavailable(
                    f"The planner at {base} did not answer within {self.timeout_s:g} s "
                    f"when asked to {what}."
                ) from None
            except aiohttp.ClientError as exc:
                raise errors.PlannerUnavailable(
                    f"The planner at {base} failed after it was asked to {what} "
                    f"({type(exc).__name__}: {exc}); not asked elsewhere, as it may have acted."
                ) from None
            self.planners.answered(base)
            return base, status, body
        raise _unreached(unreached, what)


def _refused(base: str, status: int, body: bytes, what: str) -> errors.PlannerUnavailable:
    detail = _detail(body)
    if status in (401, 403):
        # Configuration, not a passing state: no Retry-After.
        log.error("the planner at %s refused this router's token: %s", base, detail)
        return errors.PlannerUnavailable(
            f"The planner at {base} refused this router's token when asked to "
            f"{what} (HTTP {status}: {detail}). Set the router's --planner-token / "
            f"LLMGW_PLANNER_TOKEN to the planner's LLMGW_ADMIN_TOKEN.",
            retry_after_s=None,
        )
    return errors.PlannerUnavailable(
        f"The planner at {base} could not {what} (HTTP {status}: {detail})."
    )


_NONE_KNOWN = (
    "none is known (no leader in Consul llmgw/leader, no passing llmgw-planner "
    "instance, and LLMGW_PLANNER_URL is none)"
)


def _unreached(
    unreached: list[tuple[str, aiohttp.ClientError]], what: str
) -> errors.PlannerUnavailable:
    """No candidate could be reached: each one and why, in the order tried.

    Without ``Retry-After`` only when every one failed its TLS handshake (the
    router's ``LLMGW_PLANNER_CACERT`` does not match: waiting does not fix it).
    """
    tls = [base for base, exc in unreached if isinstance(exc, aiohttp.ClientSSLError)]
    for base, exc in unreached:
        if base in tls:
            log.error("TLS with the planner at %s failed: %s", base, exc)
    retry_after = None if tls and len(tls) == len(unreached) else 5
    if len(unreached) == 1:
        [(base, exc)] = unreached
        why = f"{type(exc).__name__}: {exc}"
        if tls:
            message = (
                f"The planner at {base} could not be verified when asked to {what} ({why}); "
                "check LLMGW_PLANNER_CACERT."
            )
        else:
            message = f"The planner at {base} could not be reached to {what} ({why})."
        return errors.PlannerUnavailable(message, retry_after_s=retry_after)
    tried = "; ".join(f"{base} ({type(exc).__name__}: {exc})" for base, exc in unreached)
    message = f"No planner could be reached to {what}: {tried or _NONE_KNOWN}."
    if tls:
        message += f" TLS failed with {', '.join(tls)}: check LLMGW_PLANNER_CACERT."
    return errors.PlannerUnavailable(message, retry_after_s=retry_after)
