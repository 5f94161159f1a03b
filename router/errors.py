"""Router exceptions and their OpenAI error-object rendering.

The tree, split by what the caller can do::

    RouterError                    anything the router answers itself
    ├── RequestRefused             told no: fix the request, do not retry as-is
    │   ├── InvalidRequest         400 invalid_request_error (bad JSON, no model)
    │   ├── BodyTooLarge           413
    │   └── ModelNotFound          404 model_not_found (not defined in Consul KV)
    ├── ModelUnavailable           503: defined, but nothing can serve it now
    │   └── ModelNotReady          503 model_not_ready (no passing endpoint)
    └── UpstreamError              the chosen replica failed us
        ├── UpstreamUnavailable    502 upstream_unavailable (connect refused, reset)
        └── UpstreamTimeout        504 upstream_timeout

    CatalogError                   reading Consul failed; never reaches a client,
    └── CatalogUnavailable         the watch loops back off and retry

Raised by :mod:`router.proxy` and :mod:`router.catalog`; rendered by
:func:`error_body` in the proxy and the app's exception handlers. aiohttp and
py-consul errors are translated where they are caught, so nothing above the
proxy or the catalog sees a library's exception types.
"""

from __future__ import annotations

import json
from typing import ClassVar


class RouterError(Exception):
    """An error the router answers itself, in OpenAI's error-object shape."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = None

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
