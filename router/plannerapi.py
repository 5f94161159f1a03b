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
- ``/v1/usage`` with ``{"models": [...]}`` -> 204: those models were used now.

Called by :mod:`router.activation` (one activate call per model at a time) and
:mod:`router.usage` (one usage call per interval). Every aiohttp, timeout,
status and decoding failure leaves this module as
:class:`router.errors.PlannerUnavailable` (a 404 on activate as
:class:`router.errors.ModelNotFound`), so nothing above sees aiohttp's types.

An ``https://`` planner (``planner serve --tls-cert``) is verified with the
context :meth:`router.settings.RouterSettings.planner_ssl_context` builds
(``LLMGW_PLANNER_CACERT``, else the system's CAs); a certificate that does not
verify is :class:`router.errors.PlannerUnavailable` saying so.

Its own aiohttp session, not the upstream pool: short timeouts (a planner that
accepts connections and then hangs must cost a request seconds, not minutes),
and nothing here competes with proxied requests for connections.
"""

from __future__ import annotations

import json
import logging
import ssl
import urllib.parse
from collections.abc import Sequence

import aiohttp

from llmgw_contract import ActivationAnswer, decode
from router import errors

log = logging.getLogger(__name__)

# Connection refused answers at once; this bounds a host that drops SYNs.
_CONNECT_TIMEOUT_S = 2.0
_DETAIL_LIMIT = 300


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
    """The two activator calls over a private aiohttp session.

    :meth:`start` and :meth:`close` run inside the event loop (the router's
    lifespan, or a test's).
    """

    def __init__(
        self,
        base_url: str,
        token: str | None,
        timeout_s: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._token = token
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        self._session = aiohttp.ClientSession(
            headers=headers,
            connector=aiohttp.TCPConnector(ssl=self._ssl or True),
            timeout=aiohttp.ClientTimeout(
                total=self.timeout_s, sock_connect=min(_CONNECT_TIMEOUT_S, self.timeout_s)
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
        status, body = await self._post(path, None, what)
        if status == 404:
            # Defined in KV, unknown to the planner: removed a moment ago.
            raise errors.ModelNotFound(
                model, f"the planner at {self.base_url} does not know it ({_detail(body)})"
            )
        if status != 200:
            raise self._refused(status, body, what)
        try:
            return decode(ActivationAnswer, body)
        except ValueError as exc:
            log.error("the planner at %s answered outside the contract: %s", self.base_url, exc)
            raise errors.PlannerUnavailable(
                f"The planner at {self.base_url} gave an answer this router does not "
                f"understand when asked to {what}: {_clip(' '.join(str(exc).split()))}."
            ) from None

    async def report_usage(self, models: Sequence[str]) -> None:
        """Tell the planner ``models`` were used now. Raises :class:`PlannerUnavailable`."""
        what = f"record the use of {len(models)} model(s)"
        status, body = await self._post("/v1/usage", {"models": list(models)}, what)
        if status not in (200, 204):
            raise self._refused(status, body, what)

    async def _post(self, path: str, payload: object, what: str) -> tuple[int, bytes]:
        if self._session is None:
            raise RuntimeError("PlannerAPI used before start()")
        try:
            async with self._session.post(self.base_url + path, json=payload) as resp:
                return resp.status, await resp.read()
        except TimeoutError:
            raise errors.PlannerUnavailable(
                f"The planner at {self.base_url} did not answer within {self.timeout_s:g} s "
                f"when asked to {what}."
            ) from None
        except aiohttp.ClientSSLError as exc:
            log.error("TLS with the planner at %s failed: %s", self.base_url, exc)
            raise errors.PlannerUnavailable(
                f"The planner at {self.base_url} could not be verified when asked to {what} "
                f"({type(exc).__name__}: {exc}); check LLMGW_PLANNER_CACERT.",
                retry_after_s=None,  # configuration, as for a refused token
            ) from None
        except aiohttp.ClientError as exc:
            raise errors.PlannerUnavailable(
                f"The planner at {self.base_url} could not be reached to {what} "
                f"({type(exc).__name__}: {exc})."
            ) from None

    def _refused(self, status: int, body: bytes, what: str) -> errors.PlannerUnavailable:
        detail = _detail(body)
        if status in (401, 403):
            # Configuration, not a passing state: no Retry-After.
            log.error("the planner at %s refused this router's token: %s", self.base_url, detail)
            return errors.PlannerUnavailable(
                f"The planner at {self.base_url} refused this router's token when asked to "
                f"{what} (HTTP {status}: {detail}). Set the router's --planner-token / "
                f"LLMGW_PLANNER_TOKEN to the planner's LLMGW_ADMIN_TOKEN.",
                retry_after_s=None,
            )
        return errors.PlannerUnavailable(
            f"The planner at {self.base_url} could not {what} (HTTP {status}: {detail})."
        )
