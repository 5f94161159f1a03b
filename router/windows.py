"""Window arithmetic and lease accounting of the per-key limits shared by routers:
pure functions and values, no I/O (tests drive them with a fixed clock).

Called by :mod:`router.sharedlimits` (what a compare-and-set writes) and
:mod:`router.limits` (what a router serves from its lease).

The shared state of one (key, kind) is a :class:`Tally`: the window it counts
(``"29301234"``: minutes since the epoch; ``"2026-12-02"``: a UTC day;
``"2026-12"``: a UTC month) and the units used in it, granted to routers or
owed by them. A tally of an older window counts as 0 used, so one document per
(key, kind) is reused for ever: old windows never accumulate.

A router takes a *lease* of units from the tally (:func:`take`) and serves
from it locally (:class:`Lease`), so most requests cost no Consul round trip.
Granted units are counted as used at once: routers together never grant more
than the limit in a window; the price is that units a router leased and did
not use before the window ended are lost (at most the lease size per router and
window; a router that stops gives them back, :func:`returned`), and a key gets
up to ``routers x (lease - 1)`` fewer than its limit when its load is spread
thin. Tokens are charged after the answer (the actual usage
is known only then): what a request used beyond the lease it was admitted on is
*owed* and added to the tally at the router's next compare-and-set, so a budget
can be overrun by what the requests in flight when it ran out use.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from enum import StrEnum


class Period(StrEnum):
    """The windows a limit counts over (UTC, aligned: a minute starts at :00)."""

    MINUTE = "minute"
    DAY = "day"
    MONTH = "month"


def window_of(period: Period, wall: float) -> tuple[str, float]:
    """The window ``wall`` (seconds since the epoch, UTC) falls in, and the seconds
    until it ends (> 0)."""
    if period is Period.MINUTE:
        minute, into = divmod(wall, 60.0)
        return str(int(minute)), 60.0 - into
    now = dt.datetime.fromtimestamp(wall, dt.UTC)
    if period is Period.DAY:
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        end = start + dt.timedelta(days=1)
        return start.strftime("%Y-%m-%d"), (end - now).total_seconds()
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = (start + dt.timedelta(days=32)).replace(day=1)
    return start.strftime("%Y-%m"), (end - now).total_seconds()


@dataclass(frozen=True, slots=True)
class Tally:
    """Units used in ``window`` by every router together (the shared document)."""

    window: str
    used: int

    def encode(self) -> bytes:
        return json.dumps({"window": self.window, "used": self.used}).encode()

    def used_in(self, window: str) -> int:
        """Units used in ``window``: 0 when this tally counts another (older) one."""
        return self.used if self.window == window else 0


def decode_tally(raw: bytes | None) -> Tally | None:
    """The tally a document holds; ``None`` for none or one that does not decode (it is
    then written afresh: a counter is worth less than a key that serves)."""
    if not raw:
        return None
    try:
        doc = json.loads(raw)
        window, used = doc["window"], doc["used"]
    except (ValueError, TypeError, KeyError, RecursionError):
        return None
    if not isinstance(window, str) or not isinstance(used, int) or isinstance(used, bool):
        return None
    return Tally(window, max(0, used))


def take(
    tally: Tally | None, window: str, limit: int, want: int, owed: int = 0
) -> tuple[Tally, int]:
    """What one compare-and-set writes: ``owed`` units added (used beyond a lease,
    whatever the limit), then up to ``want`` granted within ``limit``. Returns the new
    tally and the units granted (0: the window's limit is spent)."""
    if tally is not None and later(tally.window, window):
        # Another router already counts a newer window: this one is over.
        return tally, 0
    used = (tally.used_in(window) if tally is not None else 0) + max(0, owed)
    granted = max(0, min(want, limit - used))
    return Tally(window, used + granted), granted


def returned(tally: Tally | None, window: str, units: int) -> Tally | None:
    """What a stopping router writes to give back ``units`` of its lease it did not use:
    the tally with ``units`` fewer used in ``window``; ``None`` (nothing to write) when
    the tally counts another window (the lease's is over) or nothing is given."""
    if tally is None or tally.window != window or units <= 0:
        return None
    return Tally(window, max(0, tally.used - units))


def later(a: str, b: str) -> bool:
    """Whether window ``a`` comes after window ``b`` of the same period (minute numbers
    compare by length first; days and months are fixed-width ISO dates)."""
    return (len(a), a) > (len(b), b)


def lease_size(limit: int, fraction: float) -> int:
    """Units a router asks for at once: ``fraction`` of the limit, at least 1."""
    return max(1, int(limit * fraction))


class Lease:
    """The units one router holds of one (key, kind) in one window.

    ``left``: granted and not yet used; ``owed``: used beyond what was granted (to be
    added at the next :func:`take`); ``spent``: the shared tally granted nothing in
    this window at this limit (refuse without asking again until it ends, or until the
    limit changes: a raised limit is asked again).
    """

    __slots__ = ("left", "limit", "owed", "seen", "spent", "window")

    def __init__(self, window: str, limit: int) -> None:
        self.window = window
        self.limit = limit
        self.left = 0
        self.owed = 0
        self.spent = False
        # The window's units used (granted) by every router, as the last take answered.
        self.seen = 0

    def remaining(self) -> int:
        """What is left of the window's limit as this router knows it: what no router
        had been granted at the last take, less what this router owes, and what this
        lease has not used (what the other routers hold and have not used counts as
        used)."""
        return max(0, self.limit - self.seen - self.owed) + self.left

    def current(self, window: str, limit: int) -> bool:
        """Whether this lease is of ``window`` at ``limit`` (else a new one is due;
        what was left of it is lost, what is owed to an older window is forgiven)."""
        return self.window == window and self.limit == limit

    def use(self, units: int = 1) -> bool:
        """Take ``units`` from what is left; ``False`` (nothing taken) when fewer are left."""
        if self.left >= units:
            self.left -= units
            return True
        return False

    def give_back(self, units: int = 1) -> None:
        """Units taken by :meth:`use` that were not used (a request the router refused
        itself): served again from this lease."""
        self.left += units

    def charge(self, units: int) -> None:
        """``units`` used after admission (an answer's tokens): from what is left, the
        rest owed."""
        if units <= self.left:
            self.left -= units
        else:
            self.owed += units - self.left
            self.left = 0

    def adjust(self, units: int) -> None:
        """Correct an earlier :meth:`charge` by ``units`` (an estimate against what was
        used): more is charged; less is given back, to what is owed first."""
        if units >= 0:
            self.charge(units)
            return
        back = -units
        paid = min(back, self.owed)
        self.owed -= paid
        self.left += back - paid

    def granted(self, units: int, owed_sent: int, wanted: int, seen: int = 0) -> None:
        """A :func:`take` that asked for ``wanted`` units granted ``units`` and took
        ``owed_sent`` of what was owed (what was charged while it was under way stays
        owed), leaving ``seen`` used in the window. Nothing granted of something asked:
        the window's limit is spent."""
        self.left += units
        self.seen = seen
        self.owed = max(0, self.owed - owed_sent)
        if wanted > 0:
            self.spent = units == 0
