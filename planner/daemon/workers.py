"""Per-model workers: observe → decide → apply, one model at a time per model, many at once.

Used by the watcher (`planner.daemon.watcher`: Nomad events, health changes, ticks,
reconciles), activation (`planner.daemon.activation`) and the idle scaler
(`planner.daemon.idle`). As kopf runs one worker per object, each model gets its own
serial pass loop, so:

- two passes for one model never overlap (no lock shared between models: a
  slow Nomad answer for one model never delays another's stability tick);
- a burst of events for one model while its pass runs becomes ONE more pass
  (`mark` only sets the model's pending event: the next pass reads everything
  again anyway); a pending TICK is kept apart (only a TICK pass judges stability
  windows) and runs after the pending OBSERVED one;
- memory is bounded: one slot per model with work pending or running, removed
  when its loop finds nothing more to do (the worker of a model gone ends).

A pass reads (`observe`), decides (`decide`, pure) and writes (`apply`, the
applier). `Stale` from the applier means the plan was decided on reads that are
no longer true: the pass observes and decides again, at most `max_attempts`
times, then logs and waits for the next event. Commands that need the outcome
(an activation, an idle scale-down) `submit` an event and wait for its Future;
several submissions of one event for one model while none has started share one
pass (and its outcome).

Threads: passes run on a thread pool of `max_passes` threads (observe and apply
use the blocking clients); a model waiting for a thread waits only while that
many other models' passes run at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from llmgw_contract import StateDocument
from planner.daemon.applier import Applied, Stale
from planner.errors import PlannerError
from planner.model.observation import Observation
from planner.model.transition import Event, Plan

log = logging.getLogger("planner.workers")

Observe = Callable[[str], tuple[StateDocument, Observation]]
Decide = Callable[[StateDocument, Observation, Event], Plan]
Apply = Callable[[str, StateDocument, Plan, Observation], Applied]
Guard = Callable[[], bool]

# A plan refused this many times in a row means writers racing for one model;
# the next event decides again.
MAX_ATTEMPTS = 5
MAX_PASSES = 16  # passes running at once, all models together
# Events a mark coalesces, in the order their passes run.
_BACKGROUND = (Event.OBSERVED, Event.TICK)


class Skipped(Exception):
    """A command's guard said no before its plan was applied (e.g. a model asked for
    again before its idle scale-down): nothing was written."""


@dataclass(frozen=True)
class Outcome:
    """One pass: what was read, decided and done."""

    event: Event
    document: StateDocument
    observation: Observation
    plan: Plan
    applied: Applied
    attempts: int
    # Plans of earlier attempts whose Nomad writes landed before their document's
    # check-and-set failed (`Stale.written`): what was done is theirs too.
    written: tuple[Plan, ...] = ()


@dataclass
class _Command:
    event: Event
    guard: Guard | None
    futures: list[concurrent.futures.Future[Outcome]] = field(default_factory=list)


@dataclass
class _Slot:
    background: set[Event] = field(default_factory=set)  # OBSERVED and/or TICK pending
    commands: list[_Command] = field(default_factory=list)


class Workers:
    """Serial passes per model; `mark` and `submit` may be called from any thread."""

    def __init__(
        self,
        observe: Observe,
        decide: Decide,
        apply: Apply,
        max_attempts: int = MAX_ATTEMPTS,
        max_passes: int = MAX_PASSES,
        done: Callable[[str, Outcome], None] = lambda name, outcome: None,
    ) -> None:
        """`done` is told each pass that completed (from the pass's thread)."""
        self._observe, self._decide, self._apply = observe, decide, apply
        self.max_attempts = max_attempts
        self._done = done
        self._pool = concurrent.futures.ThreadPoolExecutor(max_passes, thread_name_prefix="model")
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()  # guards _slots only; never held during a pass
        self._stopped = False
        self.passes = 0  # passes run, for tests and metrics
        self.stale = 0  # plans refused as stale
        self.given_up = 0  # passes that stopped after max_attempts

    # --- asking --------------------------------------------------------------------

    def mark(self, name: str, event: Event = Event.OBSERVED) -> None:
        """Model `name` needs a pass for `event` (OBSERVED or TICK); coalesced with
        whatever is pending for it."""
        if event not in _BACKGROUND:
            raise ValueError(f"{event} needs submit(): it has an outcome to wait for")
        with self._lock:
            if self._stopped:
                return
            slot, new = self._slot(name)
            slot.background.add(event)
        if new:
            self._start(name)

    def mark_all(self, names: list[str] | set[str]) -> None:
        for name in sorted(names):
            self.mark(name)

    def submit(
        self, name: str, event: Event, guard: Guard | None = None
    ) -> concurrent.futures.Future[Outcome]:
        """A pass for `event` whose outcome the caller waits for. `guard`, when given, is
        asked right before each decision and before the plan is applied: False ends the
        pass with Skipped and nothing written. A submission joins one of the same event
        that has not started (guards are then the first one's)."""
        future: concurrent.futures.Future[Outcome] = concurrent.futures.Future()
        with self._lock:
            if self._stopped:
                future.set_exception(PlannerError("the planner stopped leading"))
                return future
            slot, new = self._slot(name)
            waiting = next((c for c in slot.commands if c.event == event), None)
            if waiting is None:
                waiting = _Command(event, guard)
                slot.commands.append(waiting)
            waiting.futures.append(future)
        if new:
            self._start(name)
        return future

    def pending(self) -> int:
        """Models with a pass pending or running (bounded by the models known)."""
        with self._lock:
            return len(self._slots)

    def stop(self) -> None:
        """No more passes: pending commands fail, running passes finish."""
        with self._lock:
            self._stopped = True
            slots, self._slots = self._slots, {}
        for slot in slots.values():
            for command in slot.commands:
                for future in command.futures:
                    if not future.done():
                        future.set_exception(PlannerError("the planner stopped leading"))
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- the loop of one model ----------------------------------------------------------

    def _slot(self, name: str) -> tuple[_Slot, bool]:
        slot = self._slots.get(name)
        if slot is None:
            slot = self._slots[name] = _Slot()
            return slot, True
        return slot, False

    def _start(self, name: str) -> None:
        try:
            self._pool.submit(self._drain, name)
        except RuntimeError:  # shut down meanwhile
            with self._lock:
                self._slots.pop(name, None)

    def _next(self, name: str) -> tuple[Event, _Command | None] | None:
        """What the model's next pass is for; None (and its slot removed) when nothing."""
        with self._lock:
            slot = self._slots.get(name)
            if slot is None:
                return None
            if slot.commands:
                # A command's pass reads and decides everything too: it covers the
                # OBSERVED marks made before it starts (not a TICK's stability windows).
                command = slot.commands.pop(0)
                slot.background.discard(Event.OBSERVED)
                return command.event, command
            for event in _BACKGROUND:
                if event in slot.background:
                    slot.background.discard(event)
                    return event, None
            del self._slots[name]
            return None

    def _drain(self, name: str) -> None:
        while (work := self._next(name)) is not None:
            event, command = work
            try:
                outcome = self._pass(name, event, command.guard if command else None)
            except Exception as exc:
                self._failed(name, event, exc, command)
                continue
            if command is not None:
                for future in command.futures:
                    future.set_result(outcome)

    def _failed(self, name: str, event: Event, exc: Exception, command: _Command | None) -> None:
        if isinstance(exc, Skipped):
            log.info("model %s: %s not carried out: %s", name, event, _words(name, exc))
        elif isinstance(exc, PlannerError | Stale):
            log.warning(
                "model %s: %s pass: %s; the next event decides again",
                name,
                event,
                _words(name, exc),
            )
        else:
            log.error("model %s: %s pass failed", name, event, exc_info=exc)
        for future in command.futures if command else ():
            future.set_exception(exc)

    def _pass(self, name: str, event: Event, guard: Guard | None) -> Outcome:
        written: list[Plan] = []
        for attempt in range(1, self.max_attempts + 1):
            if guard is not None and not guard():
                raise Skipped(f"{event}: no longer wanted")
            document, observation = self._observe(name)
            plan = self._decide(document, observation, event)
            log.debug(
                "model %s: %s pass, attempt %d: %d effect(s)",
                name,
                event,
                attempt,
                len(plan.effects),
            )
            if guard is not None and plan.effects and not guard():
                raise Skipped(f"{event}: no longer wanted")
            try:
                applied = self._apply(name, document, plan, observation)
            except Stale as exc:
                if exc.written is not None:
                    written.append(exc.written)
                self.stale += 1
                log.info(
                    "model %s: %s (attempt %d of %d); observing again",
                    name,
                    _words(name, exc),
                    attempt,
                    self.max_attempts,
                )
                continue
            self.passes += 1
            outcome = Outcome(event, document, observation, plan, applied, attempt, tuple(written))
            self._done(name, outcome)
            return outcome
        self.given_up += 1
        raise Stale(
            f"{event}: refused {self.max_attempts} times in a row (other writers of "
            f"model {name}); waiting for the next event"
        )


def _words(name: str, exc: Exception) -> str:
    """`exc`'s message without its own "model <name>: " prefix: the writers' errors name
    the model already, and the log line names it once (a doubled prefix was logged)."""
    return str(exc).removeprefix(f"model {name}: ")
