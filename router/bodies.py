"""Finding ``model`` in a request body without stalling the event loop.

Measured by a new user: ``json.loads`` of a 32 MiB body takes 0.76 s on one
core, during which every stream the router relays stalls. A thread does not
help (the C decoder never releases the GIL), so :func:`find_model`:

- parses a body of at most :data:`INLINE_PARSE_BYTES` on the loop (a few ms
  at most: ~24 ms per MiB);
- for a larger one, first reads the model from the body's start when
  ``model`` is its first key (curl and most hand-written clients), a bounded
  match on the first bytes;
- else parses it in a worker process (one bare ``python -I``, started on first
  use and shared; huge bodies queue there, not on the loop), which sends back
  only the model. A plain subprocess rather than ``multiprocessing``: spawn
  would re-import the router's main module in the child.

Errors are the same whichever way: :class:`router.errors.InvalidRequest` for a
body that is not a JSON object with a non-empty string ``model``. Used by
:mod:`router.proxy`; :class:`BodyParser` is opened and closed by its owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
from typing import Any

import orjson

from router import errors

# Parsed on the loop up to this size: about 6 ms of decoding.
INLINE_PARSE_BYTES = 256 * 1024

# {"model": "name" as the first key (a JSON string without escapes).
_FIRST_KEY_MODEL = re.compile(rb'\s*\{\s*"model"\s*:\s*"([^"\\]{1,256})"\s*[,}]')

# Opening brackets up to which orjson parses a body: its depth then stays far below
# json's recursion limit (1,000, less the stack under the parse), so both accept it.
_ORJSON_MAX_OPENINGS = 500
_UNPARSED = object()

# What the worker sends back instead of a model name.
_NOT_JSON, _NOT_OBJECT, _NO_MODEL = "\0json", "\0object", "\0model"


def extract_model(body: bytes) -> str:
    """Return the ``model`` field of a JSON request body.

    Raises :class:`router.errors.InvalidRequest` when the body is not a JSON
    object or ``model`` is missing or not a non-empty string.
    """
    return parse_request(body)[0]


def parse_request(body: bytes) -> tuple[str, dict[str, Any]]:
    """The ``model`` field and the whole document of a JSON request body (for the
    proxy's other choices: prefix affinity, streaming); raises as :func:`extract_model`.

    Parsed by orjson, and by :func:`json.loads` where orjson refuses: the same
    bodies are accepted as with ``json`` alone (orjson refuses ``NaN``, a lone
    surrogate escape, a byte order mark, nesting past 1,024), with ``json``'s
    error messages. Nesting too: ``json`` refuses what nests deeper than the
    recursion limit less the caller's stack (about 950 here), orjson only past
    1,024, so a body with more than :data:`_ORJSON_MAX_OPENINGS` brackets (its
    depth can be no more) goes to ``json`` alone (found in review: 1,000 levels
    were served, or failed with a 500 in :func:`router.accounting.ask_for_usage`).
    orjson reads an integer past 64 bits as a float, so the
    document is for reading only: what is sent on is the client's bytes, or a
    re-parse (:func:`router.accounting.ask_for_usage`). Why orjson: 0.44 us for
    the side-by-side bench's request against 3.4 us (measured, 2026-12-03).
    """
    doc: Any = _UNPARSED
    if body.count(b"[") + body.count(b"{") <= _ORJSON_MAX_OPENINGS:
        with contextlib.suppress(orjson.JSONDecodeError):
            doc = orjson.loads(body)
    if doc is _UNPARSED:
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError) as exc:
            _checked(f"{_NOT_JSON}{exc}", body)
    if not isinstance(doc, dict):
        _checked(_NOT_OBJECT, body)
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        _checked(_NO_MODEL, body)
    return model, doc


def _checked(found: str, body: bytes) -> str:
    if not found.startswith("\0"):
        return found
    if found.startswith(_NOT_JSON):
        raise errors.InvalidJson(f"The request body is not valid JSON: {found[len(_NOT_JSON) :]}")
    if found == _NOT_OBJECT:
        raise errors.InvalidJson("The request body must be a JSON object.")
    raise errors.MissingModel(
        "You must provide a model parameter (a non-empty string).", param="model"
    )


# The worker: a bare interpreter (nothing of the router imported, inherited or
# re-run) reading length-prefixed bodies on stdin and writing one line back,
# the model or the marker of what is wrong.
_WORKER = r"""
import json, sys
read, write = sys.stdin.buffer.read, sys.stdout.buffer
while header := read(10):
    body = read(int(header))
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        found = "\0json" + str(exc)
    else:
        model = doc.get("model") if isinstance(doc, dict) else None
        if not isinstance(doc, dict):
            found = "\0object"
        elif not isinstance(model, str) or not model:
            found = "\0model"
        else:
            found = model
    write.write(json.dumps(found).encode() + b"\n")
    write.flush()
"""


class BodyParser:
    """:func:`find_model` with its worker process, started on first use.

    One body at a time goes to the worker; a request cancelled during the
    exchange (its client left) ends the worker, and the next starts another.
    """

    def __init__(self, inline_bytes: int = INLINE_PARSE_BYTES) -> None:
        self.inline_bytes = inline_bytes
        self._worker: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def find_model(self, body: bytes) -> str:
        """The body's ``model``; raises :class:`router.errors.InvalidRequest`."""
        if len(body) <= self.inline_bytes:
            return extract_model(body)
        first = _FIRST_KEY_MODEL.match(body, 0, 512)
        # Only when "model" is the body's one key of that name: JSON's last one wins
        # in the full parse, and a body must not name one model when small and
        # another when large (found by a new user). A scan at memchr speed.
        if first is not None and body.count(b'"model"') == 1:
            try:
                return first.group(1).decode()
            except UnicodeDecodeError:
                pass  # the full parse says what is wrong
        async with self._lock:
            return _checked(await self._ask_worker(body), body)

    async def _ask_worker(self, body: bytes) -> str:
        worker = self._worker
        if worker is None or worker.returncode is not None:
            worker = self._worker = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-c", _WORKER,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
        assert worker.stdin is not None and worker.stdout is not None
        try:
            worker.stdin.write(b"%010d" % len(body))
            worker.stdin.write(body)
            await worker.stdin.drain()
            line = await worker.stdout.readline()
            if not line:
                raise ConnectionError("the body parser process ended")
            found: str = json.loads(line)
        except BaseException:
            self._worker = None
            if worker.returncode is None:
                worker.kill()  # reaped by asyncio's child watcher
            raise
        return found

    async def close(self) -> None:
        """End the worker, if one runs, and wait for it."""
        worker, self._worker = self._worker, None
        if worker is not None and worker.returncode is None:
            worker.kill()
            await worker.wait()
