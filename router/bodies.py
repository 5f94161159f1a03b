"""Finding ``model`` in a request body without stalling the event loop.

Measured by a new user: ``json.loads`` of a 32 MiB body takes 0.76 s on one
core, during which every stream the router relays stalls. A thread does not
help (the C decoder never releases the GIL), so :func:`find_model`:

- parses a body of at most :data:`INLINE_PARSE_BYTES` on the loop (a few ms
  at most: ~24 ms per MiB);
- for a larger one, first reads the model from the body's start when
  ``model`` is its first key (curl and most hand-written clients), a bounded
  match on the first bytes;
- else parses it in a worker process (one, started on first use and shared;
  huge bodies queue there, not on the loop), which sends back only the model.

Errors are the same whichever way: :class:`router.errors.InvalidRequest` for a
body that is not a JSON object with a non-empty string ``model``. Used by
:mod:`router.proxy`; :class:`BodyParser` is opened and closed by its owner.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import re
from concurrent.futures import ProcessPoolExecutor

from router import errors

# Parsed on the loop up to this size: about 6 ms of decoding.
INLINE_PARSE_BYTES = 256 * 1024

# {"model": "name" as the first key (a JSON string without escapes).
_FIRST_KEY_MODEL = re.compile(rb'\s*\{\s*"model"\s*:\s*"([^"\\]{1,256})"\s*[,}]')

# What the worker sends back instead of a model name.
_NOT_JSON, _NOT_OBJECT, _NO_MODEL = "\0json", "\0object", "\0model"


def extract_model(body: bytes) -> str:
    """Return the ``model`` field of a JSON request body.

    Raises :class:`router.errors.InvalidRequest` when the body is not a JSON
    object or ``model`` is missing or not a non-empty string.
    """
    return _checked(_model_of(body), body)


def _model_of(body: bytes) -> str:
    """The model, or a marker saying what is wrong (runs in the worker too)."""
    try:
        doc = json.loads(body)
    except ValueError as exc:
        return f"{_NOT_JSON}{exc}"
    if not isinstance(doc, dict):
        return _NOT_OBJECT
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        return _NO_MODEL
    return model


def _checked(found: str, body: bytes) -> str:
    if not found.startswith("\0"):
        return found
    if found.startswith(_NOT_JSON):
        raise errors.InvalidRequest(
            f"The request body is not valid JSON: {found[len(_NOT_JSON) :]}"
        )
    if found == _NOT_OBJECT:
        raise errors.InvalidRequest("The request body must be a JSON object.")
    raise errors.InvalidRequest(
        "You must provide a model parameter (a non-empty string).", param="model"
    )


class BodyParser:
    """:func:`find_model` with its worker process, started on first use."""

    def __init__(self, inline_bytes: int = INLINE_PARSE_BYTES) -> None:
        self.inline_bytes = inline_bytes
        self._pool: ProcessPoolExecutor | None = None

    async def find_model(self, body: bytes) -> str:
        """The body's ``model``; raises :class:`router.errors.InvalidRequest`."""
        if len(body) <= self.inline_bytes:
            return extract_model(body)
        first = _FIRST_KEY_MODEL.match(body, 0, 512)
        if first is not None:
            try:
                return first.group(1).decode()
            except UnicodeDecodeError:
                pass  # the full parse says what is wrong
        if self._pool is None:
            # spawn: a fresh interpreter, nothing of the router's threads or
            # sockets inherited.
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        loop = asyncio.get_running_loop()
        return _checked(await loop.run_in_executor(self._pool, _model_of, body), body)

    def close(self) -> None:
        """Stop the worker, if one was started."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
