"""Stop a load run once an SLO is missed for certain, whatever the requests still to come do.

Only exact bounds, no extrapolation: with N measured requests in all, a `success_rate >= t` is lost once more
than N·(1-t) have failed; a latency `pXX <= X` is lost once as many successful requests took longer than X as
the percentile's rank leaves above it even if every remaining request is fast (N - floor(XX/100·(N-1)) for
numpy's linear interpolation, which `tuner.scoring.percentile` uses); `max` at the first, `mean` once the sum
already seen exceeds N·X. Whatever the run's final size, the summary of the requests seen so far misses the SLO
too, so a run stopped here scores as it would have, only sooner. A `good_share >= t` (the goodput search's) is
lost as a success rate is, counting every request that is not good (failed, or over a latency bound on its own; the
bounds are `bounds`, the job's SLOs). SLOs with no such bound (ITL, which pools every
gap; throughputs; lower bounds on latency) never stop a run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tuner.load.results import RequestRecord
from tuner.scoring import METRICS, Slo, is_good, latency_of, request_value

__all__ = ["SloGuard"]

# One value per request (ITL pools every gap, so its count is unknown): a percentile's miss is certain early.
_BOUNDED = tuple(m.name for m in METRICS.values() if m.per_request)


@dataclass
class _Latency:
    slo: Slo
    base: str
    stat: str
    over: int = 0  # successful requests beyond the threshold so far
    total: float = 0.0  # sum of the values seen (for mean)


class SloGuard:
    """Feed it each measured record as it completes; it returns why the run can stop, once it can."""

    def __init__(self, slos: Sequence[Slo], measured_requests: int, *, bounds: Sequence[Slo] | None = None) -> None:
        self.n = measured_requests
        self.failed = 0
        self.not_good = 0
        self._success = [s for s in slos if s.metric == "success_rate" and s.op in (">=", ">")]
        self._good = [s for s in slos if s.metric == "good_share" and s.op in (">=", ">")]
        self._bounds = list(slos if bounds is None else bounds)
        self._latency: list[_Latency] = []
        for s in slos:
            latency = latency_of(s.metric)  # the registry's reading: a metric's name may hold an underscore
            if latency is not None and latency[0].name in _BOUNDED and s.op in ("<=", "<"):
                self._latency.append(_Latency(s, latency[0].name, latency[1]))

    @property
    def active(self) -> bool:
        return self.n > 0 and bool(self._success or self._latency or self._good)

    def add(self, record: RequestRecord) -> str | None:
        if record.warmup:
            return None
        if self._good and not is_good(record, self._bounds):
            self.not_good += 1
            lost = self._share_lost(self._good, self.not_good, "are not good (failed or over a latency bound)")
            if lost:
                return lost
        if not record.ok:
            self.failed += 1
            return self._share_lost(self._success, self.failed, "failed")
        return self._latency_lost(record)

    def _share_lost(self, slos: Sequence[Slo], missed: int, what: str) -> str | None:
        """Why a share SLO is lost with `missed` of the n requests outside it, if it is."""
        for s in slos:
            # The best final share is with every remaining request inside it: (n - missed) / n.
            best = (self.n - missed) / self.n
            if best < s.threshold or (s.op == ">" and best == s.threshold):
                allowed = math.floor(self.n * (1 - s.threshold) + 1e-9) - (1 if s.op == ">" else 0)
                return (
                    f"{s} cannot be met: {missed} of the {self.n} measured requests {what} "
                    f"(at most {max(allowed, 0)} may)"
                )
        return None

    def _latency_lost(self, record: RequestRecord) -> str | None:
        for lat in self._latency:
            value = request_value(record, lat.base, lat.stat)
            if value is None:
                continue
            lat.total += value
            if value > lat.slo.threshold or (lat.slo.op == "<" and value == lat.slo.threshold):
                lat.over += 1
            needed = self._needed(lat)
            if needed is not None and lat.over >= needed:
                return (
                    f"{lat.slo} cannot be met: {lat.over} of the {self.n} measured requests are already over "
                    f"{_threshold(lat.slo)} (at most {needed - 1} may be)"
                )
            if lat.stat == "mean" and lat.total / self.n > lat.slo.threshold:
                return (
                    f"{lat.slo} cannot be met: the requests so far already add up to more than {self.n} × "
                    f"{_threshold(lat.slo)}"
                )
        return None

    def _needed(self, lat: _Latency) -> int | None:
        """How many values beyond the threshold make the statistic miss it, whatever the others are."""
        if lat.stat == "max":
            return 1
        if lat.stat.startswith("p"):
            q = float(lat.stat[1:])
            return self.n - math.floor(q / 100.0 * (self.n - 1))
        return None


def _threshold(slo: Slo) -> str:
    return str(slo).split(slo.op, 1)[1]
