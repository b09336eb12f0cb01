"""How late the emulator's HTTP front answers against its virtual clock.

The engine keeps its steps on the clock its `time_scale` promises (`EngineStats.behind_s`), but a request also
passes the HTTP front: its body parsed and its prompt tokenised before it reaches the engine, and each token the
engine emits written out once the event loop gets to it. That work costs wall time, which the time scale multiplies:
a millisecond at time_scale 1000 is a second of every answer. A front that cannot keep up answers late, and at an
extreme time_scale its requests time out while the engine, idle between them, slips not at all. So the front counts
its own lateness, per request, against the times the engine promised:

- before the engine: from the handler's start to the request's hand-over (vLLM's own front end is modelled apart,
  `tuner.emulator.frontend`, so all of this is the emulator's);
- after it: how long after its last token was due its answer was complete (on a client that gave up, how overdue
  its unsent tokens were then). A hiccup mid-stream that the front then catches up costs nothing, as a late step
  the engine catches up costs nothing: what the client's figures (end-to-end latency, throughput) lose is the end.

Past a small allowance (an event loop's ordinary turn), `behind_s` turns those into the run's lost time, as the
engine's `behind_s` counts it: each request's lateness over the requests open beside it on average (a hundred
requests each a second late at once lost the run one second, not a hundred). `/emulator/stats` serves the engine's
and the front's sum, so the load phase's lag watch (`tuner.study.measure`) marks such a run lagged and measures it
again instead of failing its SLOs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tuner.clock import Clock

__all__ = ["ALLOWANCE_WALL_S", "FrontLag", "Opened"]

ALLOWANCE_WALL_S = 0.005
"""Lateness up to this many wall seconds an answer is not counted for: an event loop's ordinary turn, which vLLM's own
API server pays too. Beyond it the excess counts (at time_scale 40, past 0.2 emulated seconds; at 1000, past 5): far
below a request timeout at any time_scale a study runs, so a front too slow for its time_scale is seen before its
requests time out."""


@dataclass(frozen=True)
class Opened:
    """A request handed to the engine: when (the front's clock), the open-requests integral then, and how long the
    front held it before."""

    at: float
    integral: float
    before_s: float


@dataclass
class FrontLag:
    """The front's lateness, in emulated seconds. `clock` reads the emulator's clock (the engine's, whose times the
    answers are due at); a test gives one of its own to slow the front alone."""

    clock_of: Callable[[], Clock]
    clock: Clock | None = None
    allowance_wall_s: float = ALLOWANCE_WALL_S
    open: int = 0  # requests handed to the engine and not yet answered
    answered: int = 0
    late_answers: int = 0  # answered later than the allowance past their due time
    late_s: float = 0.0  # the requests' lateness past the allowance, summed
    behind_s: float = 0.0  # the run's time lost to it (each lateness over the requests open beside it)
    _integral: float = field(default=0.0, repr=False)  # open requests x emulated seconds so far
    _mark: float | None = field(default=None, repr=False)

    def now(self) -> float:
        return (self.clock or self.clock_of()).now()

    def opened(self, started: float) -> Opened:
        """A request the handler took at `started` (`now()`) goes to the engine now."""
        at = self.now()
        self._advance(at)
        self.open += 1
        return Opened(at, self._integral, max(0.0, at - started))

    def closed(self, opened: Opened, late_s: float) -> None:
        """The request answered (or given up by its client), complete `late_s` after it was due."""
        now = self.now()
        self._advance(now)
        allowance = self.allowance_wall_s * (self.clock or self.clock_of()).scale
        late = max(0.0, opened.before_s + max(0.0, late_s) - allowance)
        span = now - opened.at
        beside = (self._integral - opened.integral) / span if span > 0 else 1.0
        self.open = max(0, self.open - 1)
        self.answered += 1
        self.late_s += late
        self.behind_s += late / max(1.0, beside)
        self.late_answers += int(late > 0)

    def _advance(self, now: float) -> None:
        if self._mark is not None and now > self._mark:
            self._integral += self.open * (now - self._mark)
        self._mark = now if self._mark is None else max(self._mark, now)
