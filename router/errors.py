"""Router exceptions and their OpenAI error-object rendering.

The tree, split by what the caller can do::

    RouterError                    anything the router answers itself
    ├── RequestRefused             told no: fix the request, do not retry as-is
    │   ├── InvalidRequest         400 invalid_request_error (bad JSON, no model)
    │   ├── BodyTooLarge           413
    │   └── ModelNotFound          404 model_not_found (not defined in Consul KV)
    ├── ModelUnavailable           503: defined, but nothing can serve it now
    │   ├── ModelNotReady          503 model_not_ready (no passing endpoint; Retry-After)
    │   ├── ModelParked            503 model_parked (the planner gave up starting it)
    │   └── ModelUnplaceable       503 model_unplaceable (Nomad: fits on no node)
    └── UpstreamError              the chosen replica failed us
        ├── UpstreamUnavailable    502 upstream_unavailable (connect refused, reset)
        └── UpstreamTimeout        504 upstream_timeout

    CatalogError                   reading Consul failed; never reaches a client,
    └── CatalogUnavailable         the watch loops back off and retry

Raised by :mod:`router.proxy` and :mod:`router.catalog`; rendered by
:func:`error_body` in the proxy and the app's exception handlers. aiohttp and
py-consul errors are translated where they are caught, so nothing above the
proxy or the catalog sees a library's exception types.

Errors the router answers instead of a model carry a :class:`Refusal`
(``refusal``), the ``reason`` label of ``llmgw_router_refusals_total``.
Parked and unplaceable refusals carry no ``Retry-After``: neither ends on a
timer, and clients that honour the header would retry forever.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import ClassVar


class Refusal(StrEnum):
    """Why the router answered for a model instead of proxying to it."""

    PARKED = "parked"
    UNPLACEABLE = "unplaceable"
    NOT_READY = "not_ready"
    UNKNOWN_MODEL = "unknown_model"


class RouterError(Exception):
    """An error the router answers itself, in OpenAI's error-object shape."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = None
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


class InvalidRequest(RequestRefused):
    status = 400


class BodyTooLarge(RequestRefused):
    status = 413
    code = "request_too_large"


class ModelNotFound(RequestRefused):
    status = 404
    code = "model_not_found"
    refusal = Refusal.UNKNOWN_MODEL

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist: it is not defined in llmgw "
            f"(no Consul KV key llmgw/models/{model}).",
            param="model",
        )
        self.model = model


class ModelUnavailable(RouterError):
    """Defined, but nothing can serve it now; ``retry_after_s`` says when to try."""

    status = 503
    type = "server_error"

    def __init__(
        self, message: str, *, retry_after_s: int | None = None, param: str | None = None
    ) -> None:
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s

    def headers(self) -> list[tuple[bytes, bytes]]:
        if self.retry_after_s is None:
            return []
        return [(b"retry-after", str(self.retry_after_s).encode())]


class ModelNotReady(ModelUnavailable):
    code = "model_not_ready"
    refusal = Refusal.NOT_READY

    def __init__(self, model: str, desired_replicas: int, retry_after_s: int | None) -> None:
        if desired_replicas > 0:
            what = (
                f"{desired_replicas} replica(s) desired, none passing its Consul health "
                f"check (service llmgw-{model}); it is starting or failing"
            )
        else:
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


class UpstreamError(RouterError):
    status = 502
    type = "server_error"


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


def error_body(
    message: str,
    *,
    type: str,
    code: str | None = None,
    param: str | None = None,
) -> bytes:
    """Render ``{"error": {"message", "type", "param", "code"}}`` as JSON bytes."""
    return json.dumps(
        {"error": {"message": message, "type": type, "param": param, "code": code}}
    ).encode()


def render(exc: RouterError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Turn ``exc`` into ``(status, headers, body)`` ready for an ASGI response."""
    body = error_body(exc.message, type=exc.type, code=exc.code, param=exc.param)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *exc.headers(),
    ]
    return exc.status, headers, body
