"""What the router answers, at once, for a model it cannot serve, and in what words.

Two decisions, both pure and both read from the in-memory table (no Consul
call per request):

- :func:`gate`: a **parked** model is refused whatever its endpoints say
  (503 ``model_parked``). The proxy inlines it (checks ``entry.parked``, then
  calls :func:`parked`) so a model that is fine pays one attribute read.
- :func:`when_no_endpoint`: a defined model with no passing endpoint is
  **unplaceable** (503 ``model_unplaceable``, with Nomad's reason) only when
  Nomad placed none of its replicas (:attr:`llmgw_contract.Unplaceable.refuses`);
  **loading** while room is being made for it (a provisional unplaceable
  record) or while the replicas placed in part start (503 ``model_loading``
  with ``Retry-After``), or **not ready** (503
  ``model_not_ready`` with ``Retry-After``; for a model remembered after Consul
  lost its record, :func:`forgotten`, the message says so).

:func:`refuse_at_once` wraps the second as a :data:`router.proxy.NoEndpoint`
policy (the router's with ``--no-activation``). On-demand activation
(:mod:`router.activation`, the default policy) asks the planner for a fresh
placement attempt first, and refuses in this module's words (:func:`parked`,
:func:`unplaceable`, :func:`stopped`, :func:`room_being_made`) when that is
the answer.

Parked, unplaceable and stopped refusals carry no ``Retry-After``: clients
retry that forever, and none of these states ends by waiting (parked and
stopped need an operator; an unplaceable model places by itself only when
capacity appears).

The records are the contract's (:class:`llmgw_contract.Parked`,
:class:`llmgw_contract.Unplaceable`): frozen and hashable, so the messages
are cached per record.

Messages stay under :data:`MESSAGE_LIMIT` characters: the planner's last error
holds a stderr tail of up to 2 KB, of which :func:`summarize_error` keeps the
first line (the task event, e.g. ``Terminated: Exit Code: 1``) and the lines
that say what went wrong (``... unknown model architecture: 'kev'``).
"""

from __future__ import annotations

import functools

from llmgw_contract import Parked, Unplaceable
from llmgw_contract.lasterror import CRASHED, is_error, is_warning, strip_prefix
from router import errors
from router.endpoints import ModelEntry

MESSAGE_LIMIT = 1000
# Retry-After of a model that is starting (or waiting for room): loads take seconds.
NOT_READY_RETRY_AFTER_S = 5
# Share of the message the last error may take; the rest is reason and remedy.
ERROR_LIMIT = 600
_LINE_LIMIT = 300
# Lines of the stderr tail kept: llama.cpp names the cause first, then repeats it.
_MAX_LINES = 3
_SEPARATOR = " | "


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def summarize_error(text: str, limit: int = ERROR_LIMIT) -> str:
    """The useful part of a planner ``last_error``, on one line, at most ``limit`` chars.

    Keeps the first line (the task event, or "crashed: SIGSEGV (exit 139)") and
    the first three distinct lines that say what went wrong
    (`llmgw_contract.lasterror.is_error`: llama.cpp's level E, or trouble words on a
    line that is no warning), in their original order (llama.cpp names the cause
    first: "failed to open GGUF file", "unknown model architecture"), joined by
    `` | ``; failing those, for a run that ended by itself, its last line that is no
    warning (a process's last words are usually its reason; a crashed one's are
    not). So it starts with the words `planner status` shows
    (`llmgw_contract.lasterror.headline`). llama.cpp's time/level prefixes and
    runs of blanks are dropped.
    """
    raw = [line for line in text.splitlines() if line.strip()]
    if not raw:
        return ""
    lines = [strip_prefix(line) for line in raw]
    head, rest = _clip(lines[0], _LINE_LIMIT), lines[1:]
    wanted = [i for i, line in enumerate(raw[1:]) if is_error(line)]
    if not wanted and rest and not lines[0].startswith(CRASHED):
        wanted = [i for i, line in enumerate(raw[1:]) if not is_warning(line)][-1:]
    budget = limit - len(head)
    chosen = [head]
    for i in wanted:
        piece = _clip(rest[i], _LINE_LIMIT)
        if len(chosen) > _MAX_LINES:
            break
        if piece in chosen or len(piece) + len(_SEPARATOR) > budget:
            continue
        chosen.append(piece)
        budget -= len(piece) + len(_SEPARATOR)
    return _clip(_SEPARATOR.join(chosen), limit)


@functools.lru_cache(maxsize=256)
def parked_message(model: str, parked: Parked) -> str:
    """Why ``model`` is refused and what lifts it. Cached: a parked model's
    clients keep asking, and the record changes only when the planner writes."""
    since = f" since {parked.since}" if parked.since else ""
    last = summarize_error(parked.last_error or "")
    last_part = f" Last error: {last}." if last else ""
    remedy = (
        f" Requests are refused until it is unparked: change its source or profile, "
        f"or run `planner retry {model}` (`planner apply` first if its Nomad job is gone)."
    )
    head = f"The model `{model}` is parked{since}: {_clip(parked.reason, _LINE_LIMIT)}."
    return _clip(head + last_part, MESSAGE_LIMIT - len(remedy)) + remedy


@functools.lru_cache(maxsize=256)
def unplaceable_message(model: str, unplaceable: Unplaceable) -> str:
    """Why ``model`` cannot run anywhere and what changes that."""
    since = f" (since {unplaceable.since})" if unplaceable.since else ""
    # One remedy for every reason (room, GPUs, an engine missing or crashing on the
    # nodes): the reason itself says which; "has room" alone misled for an engine crash.
    remedy = (
        " Each new request asks the scheduler again, so it runs as soon as a node can"
        " take it (room, GPUs, its engine installed there: see `planner status --nodes`);"
        " or change its profile."
    )
    head = f"The model `{model}` fits on no node{since}: {unplaceable.reason}."
    return _clip(head, MESSAGE_LIMIT - len(remedy)) + remedy


@functools.lru_cache(maxsize=256)
def room_message(model: str, unplaceable: Unplaceable) -> str:
    """Why ``model`` is not placed yet although the scheduler said it does not fit: room
    is being made on the cluster, or its engine is installing (``Unplaceable.told``),
    and Nomad places it when that ends. (A planner before ``waiting`` wrote its words
    into ``reason``: the general words stand in for them.)"""
    waiting = unplaceable.waiting or (
        "waiting for room being made on the cluster: allocations are stopping, and Nomad "
        "places it when they end"
    )
    return _clip(
        f"The model `{model}` is {_clip(waiting, _LINE_LIMIT)} (scheduler: "
        f"{_clip(unplaceable.reason, _LINE_LIMIT)}).",
        MESSAGE_LIMIT,
    )


@functools.lru_cache(maxsize=256)
def partly_placed_message(model: str, unplaceable: Unplaceable) -> str:
    """Why ``model`` has no passing endpoint although Nomad placed some of its
    replicas: they are starting, and the rest fit nowhere for now."""
    return _clip(
        f"The model `{model}` is starting on the replicas placed: {unplaceable.placed} of "
        f"{unplaceable.desired}, the rest fit on no node for now (scheduler: "
        f"{_clip(unplaceable.reason, _LINE_LIMIT)}); it serves with what it has once one "
        f"passes its health check.",
        MESSAGE_LIMIT,
    )


def stopped_message(model: str, reason: str) -> str:
    """Why ``model`` is refused although it is defined, in the planner's words."""
    why = _clip(reason, _LINE_LIMIT) if reason else "the planner runs no replica of it"
    return _clip(
        f"The model `{model}` is stopped: {why}. Requests are refused until an operator "
        f"gives it replicas (its definition's `replicas`, then `planner apply`) or starts "
        f"its job again.",
        MESSAGE_LIMIT,
    )


def parked(model: str, record: Parked) -> errors.ModelParked:
    """The 503 ``model_parked`` for ``model``, parked as ``record`` says."""
    return errors.ModelParked(model, parked_message(model, record))


def unplaceable(model: str, record: Unplaceable) -> errors.ModelUnplaceable:
    """The 503 ``model_unplaceable`` for ``model``, with Nomad's reason from ``record``."""
    return errors.ModelUnplaceable(model, unplaceable_message(model, record))


def stopped(model: str, reason: str) -> errors.ModelStopped:
    """The 503 ``model_stopped`` for ``model``, with the planner's ``reason``."""
    return errors.ModelStopped(model, stopped_message(model, reason))


def room_being_made(
    model: str, record: Unplaceable, retry_after_s: int, waited: str = ""
) -> errors.ModelLoading:
    """The 503 ``model_loading`` for a model waiting for room being made (a
    provisional ``record``); ``waited`` adds how long the request waited."""
    message = f"{room_message(model, record)}{waited} Retry in {retry_after_s} s."
    return errors.ModelLoading(model, message, retry_after_s)


def partly_placed(model: str, record: Unplaceable, retry_after_s: int) -> errors.ModelLoading:
    """The 503 ``model_loading`` for a model Nomad placed in part (``record.placed`` > 0,
    not provisional): never ``model_unplaceable`` for a model that will serve."""
    message = f"{partly_placed_message(model, record)} Retry in {retry_after_s} s."
    return errors.ModelLoading(model, message, retry_after_s)


def forgotten(
    entry: ModelEntry, planner: str = "", cause: str | None = None
) -> errors.ModelNotReady:
    """The retryable 503 ``model_not_ready`` for a model the table remembers after
    Consul lost its record (``entry.forgotten``, :class:`router.endpoints.EndpointTable`),
    and no endpoint passes: never "does not exist" for a model served a moment ago.
    ``planner`` adds what the planner answered, if it was asked; ``cause`` is the
    forgetting it was asked under (default: ``entry.forgotten``)."""
    asked = f" (the planner: {_clip(planner, _LINE_LIMIT)})" if planner else ""
    what = (
        f"{cause or entry.forgotten}; the leading planner writes it again from its Nomad job's "
        f"meta, and this router keeps what it knew until then{asked}"
    )
    return errors.ModelNotReady(
        entry.name, entry.replicas, retry_after_s=NOT_READY_RETRY_AFTER_S, what=what
    )


def gate(entry: ModelEntry) -> errors.ModelParked | None:
    """The refusal that applies even while endpoints pass: a parked model."""
    return None if entry.parked is None else parked(entry.name, entry.parked)


def when_no_endpoint(entry: ModelEntry) -> errors.ModelUnavailable:
    """The refusal for a defined model with no passing endpoint, most specific first."""
    refusal = gate(entry)
    if refusal is not None:
        return refusal
    if entry.unplaceable is not None and entry.unplaceable.provisional:
        return room_being_made(entry.name, entry.unplaceable, NOT_READY_RETRY_AFTER_S)
    if entry.unplaceable is not None and entry.unplaceable.refuses:
        return unplaceable(entry.name, entry.unplaceable)
    if entry.unplaceable is not None:
        return partly_placed(entry.name, entry.unplaceable, NOT_READY_RETRY_AFTER_S)
    if entry.forgotten is not None:
        return forgotten(entry)
    replicas = entry.replicas
    retry_after = None if replicas == 0 else NOT_READY_RETRY_AFTER_S
    return errors.ModelNotReady(entry.name, replicas, retry_after_s=retry_after)


async def refuse_at_once(entry: ModelEntry) -> None:
    """:data:`router.proxy.NoEndpoint` policy without activation: raise :func:`when_no_endpoint`."""
    raise when_no_endpoint(entry)
