"""Router exceptions and their OpenAI error-object rendering.

The tree, split by what the caller can do::

    RouterError                    anything the router answers itself
    ├── RequestRefused             told no: fix the request, do not retry as-is
    │   ├── InvalidRequest         400 invalid_request (a query string no URL may carry)
    │   │   ├── InvalidJson        400 invalid_json (not JSON, or not a JSON object)
    │   │   └── MissingModel       400 missing_required_parameter (no ``model`` string)
    │   ├── BodyTooLarge           413 request_too_large (over the body limit, or over
    │   │                          the bytes all bodies may hold at once)
    │   ├── RequestTimeout         408 request_timeout (headers or body not received
    │   │                          in time: router.intake, router.serving)
    │   ├── HeadersTooLarge        431 request_header_fields_too_large (router.serving)
    │   ├── InvalidHttpRequest     400 invalid_http_request (not HTTP/1.1 the parser can
    │   │                          read: request line, headers, chunk sizes; router.serving)
    │   ├── InvalidApiKey          401 invalid_api_key (router keys on: none, or unknown)
    │   ├── RateLimited            429 rate_limit_exceeded (the key's requests per minute
    │   │                          or concurrent requests, router.limits; Retry-After)
    │   ├── QuotaExceeded          429 insufficient_quota (the key's token budget of the
    │   │                          day or month is spent, router.limits; Retry-After)
    │   ├── ModelNotFound          404 model_not_found (no KV record, no Consul service;
    │   │                          or a name llmgw reserves, llmgw_contract.reserved)
    │   └── ModelNotAllowed        404 model_not_found (the API key may not use it; as
    │                              OpenAI, the answer does not say whether it exists)
    ├── ModelUnavailable           503: defined, but nothing can serve it now
    │   ├── ModelNotReady          503 model_not_ready (no passing endpoint; Retry-After)
    │   ├── ModelParked            503 model_parked (the planner gave up starting it)
    │   ├── ModelUnplaceable       503 model_unplaceable (Nomad: fits on no node)
    │   ├── ModelStopped           503 model_stopped (the planner wants no replica of it:
    │   │                          `replicas: 0`, or its job is stopped)
    │   ├── ModelLoading           503 model_loading (activated, or room being made for
    │   │                          it, and not ready within the activation window;
    │   │                          Retry-After)
    │   ├── ReplicasBusy           503 replicas_busy (every replica at its concurrency
    │   │                          limit for the whole queue timeout; Retry-After)
    │   └── PlannerUnavailable     503 planner_unavailable (the activator API did not
    │                              answer usefully; the model's state is unknown)
    ├── RouterUnavailable          503: the router itself cannot take the request now
    │   ├── RouterStarting         503 router_starting (Consul not read yet; Retry-After)
    │   └── RouterOverloaded       503 router_overloaded (its limit of requests held, or
    │                              of request-body bytes held, at once; Retry-After)
    └── UpstreamError              the chosen replica failed us
        ├── UpstreamUnavailable    502 upstream_unavailable (connect refused, or the
        │                          connection broke after the request went out)
        └── UpstreamTimeout        504 upstream_timeout (silent past the read timeout,
                                   or no first byte from any replica tried)

    CatalogError                   reading Consul failed; never reaches a client,
    ├── CatalogUnavailable         the watch loops back off and retry
    └── CatalogDenied              Consul denied the router's ACL token a rule it
                                   needs (the message names it and the policy file);
                                   ``router serve`` checks before it starts (exit 3)

Raised by :mod:`router.proxy`, :mod:`router.catalog`, :mod:`router.plannerapi`
and :mod:`router.activation`; rendered by
:func:`error_body` in the proxy and the app's exception handlers. aiohttp
errors are translated where they are caught, so nothing above the
proxy or the catalog sees a library's exception types.

Every error has a string ``code`` (issue 21: one error shape, ``code`` a string
for every answer, the router's or a replica's): the first word an SDK user
branches on. A class that is not raised itself still has one, so a new
subclass without its own code says at least what kind it is.

Errors the router answers instead of a model carry a :class:`Refusal`
(``refusal``), the ``reason`` label of ``llmgw_router_refusals_total``.
Parked, unplaceable and stopped refusals carry no ``Retry-After``: none ends
on a timer, and clients that honour the header would retry forever. They carry
``x-should-retry: false`` instead, which the OpenAI SDKs honour (without it
they retry a 503 twice, tripling the time to the answer and the planner's
work). Loading, replicas-busy and planner-unavailable refusals carry
``Retry-After``: each usually ends within seconds.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import ClassVar

from llmgw_contract import KVPrefix, kv_key, reserved_name, service_name


class Refusal(StrEnum):
    """Why the router answered for a model instead of proxying to it."""

    PARKED = "parked"
    UNPLACEABLE = "unplaceable"
    STOPPED = "stopped"
    NOT_READY = "not_ready"
    LOADING = "loading"
    REPLICAS_BUSY = "replicas_busy"
    PLANNER_UNAVAILABLE = "planner_unavailable"
    UNKNOWN_MODEL = "unknown_model"
    # Router API keys (router.keys): counted under the unknown-model label, as
    # the model is not the client's to learn about.
    UNAUTHORIZED = "unauthorized"
    NOT_ALLOWED = "not_allowed"
    # A key over its limits (router.limits): checked before the body names a model.
    RATE_LIMITED = "rate_limited"
    # A key whose token budget of the day or month is spent (router.limits).
    OVER_BUDGET = "over_budget"
    # Router-wide, counted under model="": no model was looked at.
    ROUTER_STARTING = "router_starting"
    ROUTER_OVERLOADED = "router_overloaded"


ROUTER_REFUSALS = frozenset({Refusal.ROUTER_STARTING, Refusal.ROUTER_OVERLOADED})


class RouterError(Exception):
    """An error the router answers itself, in OpenAI's error-object shape."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str] = "internal_error"
    # Set on the errors that refuse a model (counted in llmgw_router_refusals_total).
    refusal: ClassVar[Refusal | None] = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Extra response headers (for example ``Retry-After``)."""
        return []


class RequestRefused(RouterError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class InvalidRequest(RequestRefused):
    status = 400


class InvalidJson(InvalidRequest):
    """The body is not JSON, or not a JSON object (:mod:`router.bodies`)."""

    code = "invalid_json"


class MissingModel(InvalidRequest):
    """The body names no model (``model`` missing, not a string, or empty)."""

    code = "missing_required_parameter"


class BodyTooLarge(RequestRefused):
    status = 413
    code = "request_too_large"


class RequestTimeout(RequestRefused):
    """The client did not send its headers, or its body, within the router's read
    timeouts (:mod:`router.serving`, :mod:`router.intake`)."""

    status = 408
    code = "request_timeout"


class HeadersTooLarge(RequestRefused):
    """The request line and headers exceed :data:`router.serving.MAX_HEADER_BYTES`, or
    hold a line or a count of lines a replica would refuse (:mod:`router.proxy`)."""

    status = 431
    code = "request_header_fields_too_large"


class UriTooLong(RequestRefused):
    """The request's path and query exceed what the router passes to a replica
    (:data:`router.proxy.REPLICA_TARGET_MAX`)."""

    status = 414
    code = "uri_too_long"


class InvalidHttpRequest(RequestRefused):
    """The bytes are not an HTTP/1.1 request the parser can read: a bad request line,
    header or chunk size, a ``Content-Length`` beside a ``Transfer-Encoding``, the
    HTTP/2 preface (:mod:`router.serving`). The message is the parser's reason."""

    status = 400
    code = "invalid_http_request"


class ModelNotFound(RequestRefused):
    status = 404
    code = "model_not_found"
    refusal = Refusal.UNKNOWN_MODEL

    def __init__(self, model: str, why: str | None = None) -> None:
        why = why or _not_defined(model)
        super().__init__(f"The model `{model}` does not exist: {why}.", param="model")
        self.model = model


def _not_defined(model: str) -> str:
    """Why no model `model` exists, saying only what is true: a name llmgw keeps for
    itself (whose service may well exist, as llmgw-planner does) names that rule."""
    key = kv_key(KVPrefix.MODELS, model)
    reserved = reserved_name(model)
    if reserved is not None:
        return f"the name is reserved ({reserved}); no model has it (no Consul KV key {key})"
    service = service_name(model)
    return f"it is not defined in llmgw (no Consul KV key {key} and no Consul service {service})"


class InvalidApiKey(RequestRefused):
    status = 401
    code = "invalid_api_key"
    refusal = Refusal.UNAUTHORIZED

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"www-authenticate", b'Bearer realm="llmgw"')]


class RateLimited(RequestRefused):
    """The request's key is over one of its limits (:mod:`router.limits`). OpenAI's
    shape: type ``requests`` (a request limit) or ``tokens`` (tokens per minute), code
    ``rate_limit_exceeded``, and its ``x-ratelimit-*`` headers besides ``Retry-After``."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"
    refusal = Refusal.RATE_LIMITED

    def __init__(
        self, message: str, headers: list[tuple[bytes, bytes]], kind: str | None = None
    ) -> None:
        super().__init__(message)
        self._headers = headers
        if kind is not None:
            self.type = kind

    def headers(self) -> list[tuple[bytes, bytes]]:
        return self._headers


class QuotaExceeded(RateLimited):
    """The request's key spent its token budget of the day or month (:mod:`router.limits`).
    OpenAI's shape for a spent quota: 429, type and code ``insufficient_quota``; the
    OpenAI SDKs do not retry it. ``Retry-After``: when the budget's period ends."""

    type = "insufficient_quota"
    code = "insufficient_quota"
    refusal = Refusal.OVER_BUDGET


class ModelNotAllowed(RequestRefused):
    status = 404
    code = "model_not_found"
    refusal = Refusal.NOT_ALLOWED

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
        )


class ModelUnavailable(RouterError):
    """Defined, but nothing can serve it now; ``retry_after_s`` says when to try."""

    status = 503
    type = "server_error"
    code = "model_unavailable"

    def __init__(
        self, message: str, *, retry_after_s: int | None = None, param: str | None = None
    ) -> None:
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s

    def headers(self) -> list[tuple[bytes, bytes]]:
        if self.retry_after_s is None:
            return [(b"x-should-retry", b"false")]
        return [(b"retry-after", str(self.retry_after_s).encode())]


class ModelNotReady(ModelUnavailable):
    """No passing endpoint; ``what`` (default: from the replica count) says why.

    ``desired_replicas`` is ``None`` for a model known only from its Consul
    service (its KV record is missing, so the count is unknown).
    """

    code = "model_not_ready"
    refusal = Refusal.NOT_READY

    def __init__(
        self,
        model: str,
        desired_replicas: int | None,
        retry_after_s: int | None,
        what: str | None = None,
    ) -> None:
        if what is None and desired_replicas is None:
            what = (
                f"none passing its Consul health check (service {service_name(model)}), and "
                f"its Consul KV record {kv_key(KVPrefix.MODELS, model)} is missing"
            )
        elif what is None and desired_replicas > 0:
            what = (
                f"{desired_replicas} replica(s) desired, none passing its Consul health "
                f"check (service {service_name(model)}); it is starting or failing"
            )
        elif what is None:
            what = "0 replicas desired, so nothing is scheduled to serve it"
        super().__init__(
            f"The model `{model}` is defined but has no ready endpoint: {what}.",
            retry_after_s=retry_after_s,
            param="model",
        )
        self.model = model
        self.desired_replicas = desired_replicas


class ModelParked(ModelUnavailable):
    """The planner parked the model after repeated start failures; an operator lifts it.

    ``message`` comes from :func:`router.refusals.parked_message`.
    """

    code = "model_parked"
    refusal = Refusal.PARKED

    def __init__(self, model: str, message: str) -> None:
        super().__init__(message, param="model")
        self.model = model


class ModelUnplaceable(ModelUnavailable):
    """Nomad's last placement attempt found no node the model fits on.

    ``message`` comes from :func:`router.refusals.unplaceable_message`.
    """

    code = "model_unplaceable"
    refusal = Refusal.UNPLACEABLE

    def __init__(self, model: str, message: str) -> None:
        super().__init__(message, param="model")
        self.model = model


class ModelStopped(ModelUnavailable):
    """The planner answered ``stopped``: the model is defined with ``replicas: 0``, or
    its Nomad job is stopped. Nothing starts it but an operator, so no Retry-After.

    ``message`` comes from :func:`router.refusals.stopped_message`.
    """

    code = "model_stopped"
    refusal = Refusal.STOPPED

    def __init__(self, model: str, message: str) -> None:
        super().__init__(message, param="model")
        self.model = model


class ModelLoading(ModelUnavailable):
    """The planner is starting the model (or room is being made for it), and no
    replica passed within the activation window.

    ``message`` comes from :mod:`router.activation` or :mod:`router.refusals`,
    which say what is happening and since when.
    """

    code = "model_loading"
    refusal = Refusal.LOADING

    def __init__(self, model: str, message: str, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s, param="model")
        self.model = model


class ReplicasBusy(ModelUnavailable):
    """Every passing replica of the model had its limit of requests in flight for
    the whole queue timeout (:mod:`router.admission`).

    ``message`` comes from :mod:`router.proxy`: the replicas, their limits, how
    many requests wait and how long this one did.
    """

    code = "replicas_busy"
    refusal = Refusal.REPLICAS_BUSY

    def __init__(self, model: str, message: str, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s, param="model")
        self.model = model


class PlannerUnavailable(ModelUnavailable):
    """The planner's activator API could not be reached or answered an error.

    Raised by :mod:`router.plannerapi`; the message names the planner's URL and
    what failed. ``retry_after_s`` is ``None`` for a refused token (waiting does
    not fix configuration).
    """

    code = "planner_unavailable"
    refusal = Refusal.PLANNER_UNAVAILABLE

    def __init__(self, message: str, retry_after_s: int | None = 5) -> None:
        super().__init__(message, retry_after_s=retry_after_s)


class RouterUnavailable(RouterError):
    """The router cannot take any request now; it says when to try again."""

    status = 503
    type = "server_error"
    code = "router_unavailable"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(self.retry_after_s).encode())]


class RouterStarting(RouterUnavailable):
    """The router has not read its models from Consul yet: it cannot tell a model
    that does not exist (404) from one it has not learned about."""

    code = "router_starting"
    refusal = Refusal.ROUTER_STARTING


class RouterOverloaded(RouterUnavailable):
    """The router holds its limit of requests (in flight and queued) already."""

    code = "router_overloaded"
    refusal = Refusal.ROUTER_OVERLOADED


class UpstreamError(RouterError):
    status = 502
    type = "server_error"
    code = "upstream_error"


class UpstreamUnavailable(UpstreamError):
    status = 502
    code = "upstream_unavailable"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class CatalogError(Exception):
    """Reading Consul failed. Internal: the watch loops catch it and back off."""


class CatalogUnavailable(CatalogError):
    """Consul could not be reached or answered with an error status."""


class CatalogDenied(CatalogError):
    """Consul denied the router's token a rule of acl/consul/router.hcl; the message is
    :func:`llmgw_contract.acl.denial`'s, naming the rule and the policy file."""


def error_body(
    message: str,
    *,
    type: str,
    code: str,
    param: str | None = None,
) -> bytes:
    """Render ``{"error": {"message", "type", "param", "code"}}`` as JSON bytes."""
    return json.dumps(
        {"error": {"message": message, "type": type, "param": param, "code": code}}
    ).encode()


def error_object(exc: RouterError) -> dict[str, str | None]:
    """``exc`` as the inside of OpenAI's ``{"error": ...}``."""
    return {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}


def render(exc: RouterError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Turn ``exc`` into ``(status, headers, body)`` ready for an ASGI response."""
    body = error_body(exc.message, type=exc.type, code=exc.code, param=exc.param)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *exc.headers(),
    ]
    return exc.status, headers, body
