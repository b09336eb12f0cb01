"""The capacity plan: replicas for a request rate, from the winner's measured SLO-meeting rate per server.

Every input is kept beside the answer so the arithmetic can be printed and checked, not only the replica count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tuner.errors import ConfigError, TunerError
from tuner.intervals import Interval, pool
from tuner.report.views import StudyView, TrialView
from tuner.study.confirm import noise_of

__all__ = ["Plan", "make_plan", "pooled_rate"]


@dataclass(frozen=True)
class Plan:
    trial: int
    objective: str
    capacity_rps: float  # measured per server
    basis: str  # where capacity_rps comes from
    headroom: float
    rate: float
    peak: float | None
    replicas: int
    peak_replicas: int
    gpus_per_replica: int
    tokens_per_request: float | None
    price_per_gpu_hour: float | None
    box_gpus: int | None = None  # the study's box (target.gpus): the plan's servers packed into boxes of that many

    @property
    def boxes(self) -> int | None:
        """Boxes of `box_gpus` the plan's servers fill (a box holds box_gpus // gpus_per_replica of them)."""
        per_box = (self.box_gpus or 0) // self.gpus_per_replica
        return math.ceil(self.replicas / per_box) if per_box > 0 and (self.box_gpus or 0) > 1 else None

    @property
    def usable_rps(self) -> float:
        """What one server is planned for: its measured capacity kept below the SLO edge by the headroom."""
        return self.capacity_rps * self.headroom

    @property
    def max_replicas(self) -> int:
        return max(self.replicas, self.peak_replicas)

    @property
    def gpus(self) -> int:
        return self.replicas * self.gpus_per_replica

    @property
    def cost_per_hour(self) -> float | None:
        return None if self.price_per_gpu_hour is None else self.gpus * self.price_per_gpu_hour

    @property
    def cost_per_million_tokens(self) -> float | None:
        """At the planned rate R: the hour's cost over the output tokens R requests a second bring in an hour."""
        if self.cost_per_hour is None or not self.tokens_per_request:
            return None
        return self.cost_per_hour / (self.rate * self.tokens_per_request * 3600 / 1e6)

    def lines(self) -> list[str]:
        """The arithmetic, one step a line."""
        out = [
            f"trial {self.trial} ({self.objective} study): {self.capacity_rps:.3f} req/s per server ({self.basis})",
            f"usable per server = {self.capacity_rps:.3f} x headroom {self.headroom:g} = {self.usable_rps:.3f} req/s",
            f"replicas = ceil({self.rate:g} / {self.usable_rps:.3f}) = {self.replicas}",
        ]
        if self.peak is not None:
            out.append(f"peak replicas = ceil({self.peak:g} / {self.usable_rps:.3f}) = {self.peak_replicas}")
        out.append(f"GPUs = {self.replicas} x {self.gpus_per_replica} per replica = {self.gpus}")
        if self.boxes is not None and self.box_gpus is not None:
            per_box = self.box_gpus // self.gpus_per_replica
            out.append(
                f"boxes of {self.box_gpus} GPUs (target.gpus) = ceil({self.replicas} replicas / {per_box} a box) "
                f"= {self.boxes}"
            )
        if self.cost_per_hour is not None and self.price_per_gpu_hour is not None:
            price = self.price_per_gpu_hour
            out.append(f"cost = {self.gpus} GPUs x {price:g}/GPU-hour = {self.cost_per_hour:.2f}/hour")
        if self.cost_per_million_tokens is not None and self.tokens_per_request:
            out.append(
                f"per million output tokens = {self.cost_per_hour:.2f} / ({self.rate:g} req/s x "
                f"{self.tokens_per_request:.1f} tok x 3600 / 1e6) = {self.cost_per_million_tokens:.4f}"
            )
        return out

    def as_dict(self) -> dict[str, Any]:
        names = ("usable_rps", "max_replicas", "gpus", "boxes", "cost_per_hour", "cost_per_million_tokens")
        return {**{k: getattr(self, k) for k in self.__dataclass_fields__}, **{k: getattr(self, k) for k in names}}


def make_plan(
    view: StudyView,
    t: TrialView,
    *,
    rate: float,
    peak: float | None = None,
    headroom: float = 0.7,
    price_per_gpu_hour: float | None = None,
    tokens_per_request: float | None = None,
    measured: tuple[float, str] | None = None,
    lower_bound: bool = False,
) -> Plan:
    """The plan for `t`; `tokens_per_request` is the output tokens a request brought in its measurement (the
    store's load summary), else read as output tok/s over request rate. `measured` (req/s, where it comes from)
    replaces the stored rate with one measured now (`tuner plan --measure`). The stored rate is the flag set's
    pooled over every start of it (`pooled_rate`), with `lower_bound` its interval's lower end."""
    if rate <= 0 or (peak is not None and peak < rate):
        raise ConfigError("--rate must be above 0 and --peak at least --rate")
    if not 0 < headroom <= 1:
        raise ConfigError(f"--headroom {headroom:g}: give a fraction in (0, 1], e.g. 0.7")
    if price_per_gpu_hour is not None and price_per_gpu_hour < 0:
        raise ConfigError(f"--price-per-gpu-hour {price_per_gpu_hour:g}: give a price of 0 or more")
    objective = view.record.objective or "throughput"
    if measured is not None:
        capacity, basis = measured
    elif t.request_rate is None or t.request_rate <= 0:
        raise TunerError(f"trial {t.number} recorded no request rate; measure it: {measure_hint(view, t)}")
    else:
        capacity, pooled = _capacity(view, t, lower_bound)
        basis = (
            pooled
            + "; "
            + (
                "its highest SLO-meeting rate, measured by the study"
                if objective in ("max_rate", "cost")
                else "its highest rate at which the SLOs' share of requests were good, measured by the study"
                if objective == "goodput"
                else "the rate it held under the job's fixed load, a floor of its capacity; measure: "
                + measure_hint(view, t)
            )
        )
    usable = capacity * headroom
    tokens = tokens_per_request or (t.output_tok_s / t.request_rate if t.output_tok_s and t.request_rate else None)
    return Plan(
        trial=t.number,
        objective=objective,
        capacity_rps=capacity,
        basis=basis,
        headroom=headroom,
        rate=rate,
        peak=peak,
        replicas=math.ceil(rate / usable),
        peak_replicas=math.ceil((peak if peak is not None else rate) / usable),
        gpus_per_replica=_gpus_per_replica(t.flags),
        tokens_per_request=tokens,
        price_per_gpu_hour=price_per_gpu_hour,
        box_gpus=t.box_gpus,
    )


def pooled_rate(view: StudyView, t: TrialView) -> tuple[Interval, list[float]]:
    """The flag set's request rate pooled over every start of it (its first trial and its confirmation starts: a
    lucky first start must not size the deployment alone), with its 95% interval under the study's between-start
    noise, and the starts' own rates in the order they ran."""
    first = t.repeat_of if t.repeat_of is not None else t.number
    rates = [
        s.request_rate
        for s in view.trials
        if s.measured and s.request_rate and s.request_rate > 0 and first in (s.number, s.repeat_of)
    ]
    if not rates:
        raise TunerError(f"trial {t.number} recorded no request rate; measure it: {measure_hint(view, t)}")
    pooled = pool([Interval(r, r, r) for r in rates], noise_of(view.attrs))
    return pooled.interval, rates


def _capacity(view: StudyView, t: TrialView, lower_bound: bool) -> tuple[float, str]:
    ci, rates = pooled_rate(view, t)
    each = ", ".join(f"{r:.3f}" for r in rates)
    if len(rates) < 2:
        note = "; started once: no interval, so no lower bound" if lower_bound else ""
        return ci.value, f"its one start{note}"
    if lower_bound:
        return (
            ci.low,
            f"the lower end of the 95% interval {ci.low:.3f}..{ci.high:.3f} over its {len(rates)} starts ({each})",
        )
    return ci.value, f"pooled over its {len(rates)} starts ({each})"


def measure_hint(view: StudyView, t: TrialView) -> str:
    """The commands that measure a winner's capacity when the study did not (objective throughput)."""
    slos = " ".join(f"--slo '{s}'" for s in view.slos)
    return (
        f"`tuner plan {view.name} --trial {t.number} --measure`, or serve it (`tuner verify {view.name} --trial "
        f"{t.number}`) and run `tuner bench --url URL {slos} --find-max-rate`"
    )


def _gpus_per_replica(flags: dict[str, Any]) -> int:
    n = 1
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = flags.get(name)
        if isinstance(value, int) and value > 0:
            n *= value
    return n
