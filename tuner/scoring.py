"""Scoring of a load run: percentiles, throughput, goodput and SLO checks — pure functions of the request records.

Nothing here measures or sleeps: a stored study can be re-scored under new SLOs from its records alone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, cast

from pydantic import BaseModel, ConfigDict, Field

from tuner.errors import ConfigError

__all__ = [
    "FIGURES",
    "LATENCY_METRICS",
    "METRICS",
    "NO_DATA_VIOLATION",
    "OBJECTIVE_FALLBACK",
    "RATE_METRICS",
    "STATS",
    "Figure",
    "LoadSummary",
    "Metric",
    "Percentiles",
    "RequestLike",
    "Slo",
    "closest",
    "figures",
    "goodput_bound",
    "headline_figures",
    "in_table_order",
    "is_good",
    "latency_metrics",
    "latency_of",
    "named_figures",
    "objective_latency",
    "parse_slo",
    "percentile",
    "request_value",
    "study_figures",
    "summarize",
    "total_violation",
]


class RequestLike(Protocol):
    """What scoring reads of one request (`tuner.load.results.RequestLike` is one): scoring depends on no loader."""

    @property
    def warmup(self) -> bool: ...
    @property
    def ok(self) -> bool: ...
    @property
    def ttft_s(self) -> float | None: ...
    @property
    def itl_s(self) -> list[float]: ...
    @property
    def e2e_s(self) -> float: ...
    @property
    def tpot_s(self) -> float | None: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def error_class(self) -> str | None: ...
    @property
    def error_message(self) -> str | None: ...
    @property
    def usage_from_server(self) -> bool: ...


STATS = ("mean", "p50", "p90", "p95", "p99", "max")


@dataclass(frozen=True)
class Metric:
    """One metric an SLO can name, a summary reports and a table shows.

    A latency (`samples` set) is named with a statistic in an SLO (`ttft_p95`, seconds, written with a time unit) and
    summarised as a `Percentiles` field of `LoadSummary` of the same name; a rate is a plain `LoadSummary` field.
    """

    name: str
    unit: str  # what a value is in: "s" for every latency; "fraction", "req/s", "tok/s" for the rates
    label: str  # its short name in a table
    # latency: its values in one successful request (pooled over the run); None for a rate
    samples: Callable[[RequestLike], Sequence[float]] | None = None
    # latency: one request's own value under a statistic (goodput, the early stop); None: it has none
    own: Callable[[RequestLike, str], float | None] | None = None
    per_request: bool = False  # one value per request, so a percentile's miss is certain early (the SLO guard)
    # latency: the vLLM Prometheus histogram that answers it in production (the alert rules and the dashboard ask it)
    histogram: str | None = None
    title: str | None = None  # its name in an alert or a dashboard panel; None: the label

    @property
    def long_label(self) -> str:
        return self.title or self.label

    @property
    def is_latency(self) -> bool:
        return self.samples is not None


def _one(value: float | None) -> Sequence[float]:
    return () if value is None else (value,)


def _own_itl(record: RequestLike, stat: str) -> float | None:
    # A request's own gaps under the same statistic; a one-token reply has no gap and cannot miss an ITL SLO.
    return Percentiles.of(record.itl_s).stat(stat) if record.itl_s else 0.0


def _own_tpot(record: RequestLike, _: str) -> float | None:
    # A reply of one token has no decode: it meets any TPOT bound (DistServe's goodput counts it by its TTFT).
    if record.tpot_s is None and record.ttft_s is not None:
        return 0.0
    return record.tpot_s


# vLLM's histograms (vllm/v1/metrics/loggers.py): TPOT is one value a request, as ours; ITL one a gap, as ours.
_METRICS = (
    Metric(
        "ttft",
        "s",
        "TTFT",
        lambda r: _one(r.ttft_s),
        lambda r, _: r.ttft_s,
        per_request=True,
        histogram="vllm:time_to_first_token_seconds",
    ),
    Metric(
        "tpot",
        "s",
        "TPOT",
        lambda r: _one(r.tpot_s),
        _own_tpot,
        per_request=True,
        histogram="vllm:request_time_per_output_token_seconds",
    ),
    # pools every gap: its count is not the requests'
    Metric(
        "itl",
        "s",
        "ITL",
        lambda r: r.itl_s,
        _own_itl,
        histogram="vllm:inter_token_latency_seconds",
        title="Inter-token latency",
    ),
    Metric(
        "e2e",
        "s",
        "e2e",
        lambda r: (r.e2e_s,),
        lambda r, _: r.e2e_s,
        per_request=True,
        histogram="vllm:e2e_request_latency_seconds",
        title="End-to-end latency",
    ),
    Metric("success_rate", "fraction", "success"),
    Metric("request_throughput", "req/s", "req/s"),
    Metric("output_throughput", "tok/s", "tok/s"),
    Metric("total_throughput", "tok/s", "total tok/s"),
    # DistServe's goodput: requests that succeeded and met every latency SLO's bound on their own, per second
    Metric("goodput", "req/s", "goodput"),
    Metric("good_share", "fraction", "good"),  # those requests' share of the measured ones (failures count)
)
METRICS: dict[str, Metric] = {m.name: m for m in _METRICS}
"""Every metric by name, latencies first in the order tables show them. A new one is an entry here (and, for a
latency, its `Percentiles` field in `LoadSummary`; for a rate, its field and its line in `summarize`)."""

LATENCY_METRICS = tuple(m.name for m in _METRICS if m.is_latency)
RATE_METRICS = tuple(m.name for m in _METRICS if not m.is_latency)


def latency_metrics() -> list[Metric]:
    return [m for m in METRICS.values() if m.is_latency]


def latency_of(name: str) -> tuple[Metric, str] | None:
    """The latency metric and statistic an SLO name holds (`ttft_p95` -> ttft, p95), None if it names none.

    Matched against the registry, not split at the first underscore: a metric's own name may hold one
    (`decode_time_p95`). No statistic holds an underscore, so the name is the longest registered prefix before it.
    """
    base, _, stat = name.rpartition("_")
    metric = METRICS.get(base)
    if metric is None or not metric.is_latency or stat not in STATS:
        return None
    return metric, stat


@dataclass(frozen=True)
class Figure:
    """A latency statistic every trial records and shows: `ttft_p95` is the ttft metric under p95.

    It is stored flat in the trial's user attributes as `<name>_s` (seconds), written to the CSV/JSON of
    `tuner trials` and `tuner rescore`, and, when a `headline`, shown in their tables under `label` and quoted in an
    export's provenance.
    """

    metric: str
    stat: str
    headline: bool = True  # a column of `tuner trials` and a figure of the export's provenance

    @classmethod
    def named(cls, name: str) -> Figure | None:
        """The figure an SLO name holds (`ttft_p99`), registered or not; None if it names no latency."""
        latency = latency_of(name)
        return cls(latency[0].name, latency[1]) if latency is not None else None

    @property
    def name(self) -> str:
        return f"{self.metric}_{self.stat}"

    @property
    def attr(self) -> str:
        """Its key in a trial's user attributes and in the CSV/JSON rows, in seconds."""
        return f"{self.name}_s"

    @property
    def entry(self) -> Metric:
        """Its metric's registry entry."""
        return METRICS[self.metric]

    @property
    def label(self) -> str:
        return f"{self.entry.label} {self.stat.upper()}"

    @property
    def quantile(self) -> float | None:
        """A percentile's quantile (`p99` -> 0.99, as Prometheus's histogram_quantile takes it); None otherwise."""
        return int(self.stat[1:]) / 100 if self.stat.startswith("p") else None

    def of(self, summary: LoadSummary) -> float | None:
        """Its value in a run; None when no request succeeded or it is not finite (nothing to record)."""
        if summary.requests_succeeded == 0:
            return None
        value = float(summary.metric(self.name))
        return value if math.isfinite(value) else None


FIGURES: tuple[Figure, ...] = (Figure("ttft", "p95"), Figure("e2e", "p95"), Figure("tpot", "p95", headline=False))
"""The figures every trial records, in the order the CSV's columns show them; a study also records the figures its
SLOs and objective name (`study_figures`: a `ttft_p90` SLO's TTFT P90). Another (`Figure("ttft", "p90")`) is an
entry here: the study records it from then on, and the morning tables, CSV/JSON, rescore and exports show it."""


def figures() -> tuple[Figure, ...]:
    """The registry's figures, read when called (so a test may register one)."""
    return FIGURES


def named_figures(names: Iterable[str]) -> tuple[Figure, ...]:
    """The latency figures SLO and objective metric names hold (`ttft_p90`, `tpot_p95`), in order, each once, each a
    headline (the figure a verdict was made on is shown); a rate's name or an unknown one holds none."""
    out: dict[str, Figure] = {}
    for name in names:
        figure = Figure.named(name)
        if figure is not None:
            out.setdefault(figure.name, figure)
    return tuple(out.values())


def study_figures(names: Iterable[str]) -> tuple[Figure, ...]:
    """What a study whose SLOs and objective name `names` records and may show: the figures they name, then the
    registry's (`figures()`) not among them."""
    named = named_figures(names)
    taken = {f.name for f in named}
    return (*named, *(f for f in figures() if f.name not in taken))


def in_table_order(shown: Iterable[Figure]) -> list[Figure]:
    """Figures in the order a table's columns show them: by metric as the registry lists them (TTFT, TPOT, ITL,
    e2e), then by statistic (P90 before P95), so the columns of one metric stand together."""
    order = list(METRICS)

    def key(f: Figure) -> tuple[int, int]:
        return (order.index(f.metric) if f.metric in order else len(order), STATS.index(f.stat))

    return sorted(shown, key=key)


def headline_figures(names: Iterable[str]) -> list[Figure]:
    """The figures `names` (SLO and objective metrics) name, then the registry's headline ones, in table order:
    what a table with room for them all shows."""
    shown = {f.name: f for f in (*named_figures(names), *(f for f in figures() if f.headline))}
    return in_table_order(shown.values())


OBJECTIVE_FALLBACK = "e2e_p95"
"""The latency a study minimises beside throughput when its job names none and it has no latency SLO."""


NO_DATA_VIOLATION = 1.0e6
"""Violation reported for a latency SLO when no request succeeded: finite (storable as JSON), far above any real one."""


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return ordered[lo]
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class Percentiles(BaseModel):
    """Distribution of one latency in seconds; all zeros with count 0 when nothing was measured."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    count: int = 0
    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p95: float = 0.0
    p99: float = 0.0
    max: float = 0.0

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        if not values:
            return cls()
        return cls(
            count=len(values),
            mean=math.fsum(values) / len(values),
            p50=percentile(values, 50),
            p90=percentile(values, 90),
            p95=percentile(values, 95),
            p99=percentile(values, 99),
            max=max(values),
        )

    def stat(self, name: str) -> float:
        if name not in STATS:
            raise ValueError(f"unknown statistic {name!r}; allowed: {', '.join(STATS)}")
        return float(getattr(self, name))


class LoadSummary(BaseModel):
    """What a person reads after a load run (warm-up requests excluded)."""

    model_config = ConfigDict(extra="forbid")

    requests_sent: int
    requests_succeeded: int
    requests_failed: int
    failures: dict[str, int] = Field(default_factory=dict)
    failure_examples: dict[str, str] = Field(default_factory=dict)
    success_rate: float
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_throughput: float
    ttft: Percentiles
    tpot: Percentiles
    itl: Percentiles
    e2e: Percentiles
    goodput: float
    good_share: float = 0.0
    concurrency: float
    usage_from_server: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def metric(self, name: str) -> float:
        """A scalar by SLO name: `e2e_p95`, `ttft_mean`, `success_rate`, `output_throughput`, ..."""
        metric = METRICS.get(name)
        if metric is not None and not metric.is_latency:
            return float(getattr(self, name))
        latency = latency_of(name)
        if latency is not None:
            pct: Percentiles = getattr(self, latency[0].name)
            return pct.stat(latency[1])
        raise ConfigError(f"unknown metric {name!r}; allowed: {_allowed_metrics()}")


def _allowed_metrics() -> str:
    latencies = ",".join(m.name for m in latency_metrics())
    rates = ", ".join(m.name for m in METRICS.values() if not m.is_latency)
    return f"{{{latencies}}}_{{{','.join(STATS)}}} or {rates}"


Op = Literal["<=", "<", ">=", ">"]


class Slo(BaseModel):
    """One service-level objective, e.g. e2e_p95 <= 5.0 (latencies in seconds, rates as fractions or per second)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: str
    op: Op
    threshold: float

    def __str__(self) -> str:
        if self.is_latency:
            return f"{self.metric}{self.op}{_fmt_seconds(self.threshold)}"
        return f"{self.metric}{self.op}{self.threshold:g}"

    @property
    def is_latency(self) -> bool:
        return latency_of(self.metric) is not None

    def value(self, summary: LoadSummary) -> float:
        return summary.metric(self.metric)

    def met(self, summary: LoadSummary) -> bool:
        return self.violation(summary) <= 0.0

    def violation(self, summary: LoadSummary) -> float:
        """Optuna's constraint shape: <= 0 when met; otherwise the relative distance to the threshold."""
        latency = latency_of(self.metric)
        if latency is not None and getattr(summary, latency[0].name).count == 0:
            return NO_DATA_VIOLATION
        value = self.value(summary)
        scale = abs(self.threshold) if self.threshold != 0 else 1.0
        excess = value - self.threshold if self.op in ("<=", "<") else self.threshold - value
        if self.op in ("<", ">") and excess == 0:
            # A strict bound sitting exactly on its threshold is missed by the smallest positive amount.
            return 1e-12
        return excess / scale

    def request_meets(self, record: RequestLike) -> bool:
        """Per-request reading of a latency SLO, for goodput: the request's own value against the threshold."""
        latency = latency_of(self.metric)
        if latency is None:
            return False  # a rate has no per-request reading
        value = request_value(record, latency[0].name, latency[1])
        if value is None:
            return False
        return _compare(value, self.op, self.threshold)


def _compare(value: float, op: Op, threshold: float) -> bool:
    if op == "<=":
        return value <= threshold
    if op == "<":
        return value < threshold
    if op == ">=":
        return value >= threshold
    return value > threshold


def request_value(record: RequestLike, base: str, stat: str) -> float | None:
    """One request's own value of a latency metric (ttft, tpot, e2e; itl under `stat`); None if it has none."""
    metric = METRICS.get(base)
    if metric is None or metric.own is None:
        return None
    return metric.own(record, stat)


_SLO_RE = re.compile(r"^\s*([a-z0-9_]+)\s*(<=|>=|<|>)\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-z%]*)\s*$")
_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "m": 60.0, "min": 60.0}


def parse_slo(text: str) -> Slo:
    """`e2e_p95<=5s`, `ttft_p95 <= 500ms`, `success_rate>=0.99` (or `>=99%`), `output_throughput>=1000`."""
    m = _SLO_RE.match(text.lower().replace("µs", "us"))
    if not m:
        raise ConfigError(
            f"cannot read SLO {text!r}: write METRIC OP VALUE, e.g. 'e2e_p95<=5s', 'ttft_p95<=500ms', "
            f"'success_rate>=0.99'; metrics: {_allowed_metrics()}"
        )
    metric, op, number, unit = m.groups()
    value = float(number)
    if latency_of(metric) is not None:
        if unit not in _UNITS or unit == "%":
            raise ConfigError(f"SLO {text!r}: unit {unit!r} is not a time unit; use s, ms or us")
        value *= _UNITS[unit]
    elif metric in METRICS and not METRICS[metric].is_latency:
        if unit == "%":
            value /= 100.0
        elif unit not in ("", "/s"):
            raise ConfigError(f"SLO {text!r}: {metric} takes a plain number (or a percentage for a fraction)")
    else:
        raise ConfigError(f"SLO {text!r}: unknown metric {metric!r}; allowed: {_allowed_metrics()}")
    if metric in METRICS and METRICS[metric].unit == "fraction" and not 0.0 <= value <= 1.0:
        raise ConfigError(f"SLO {text!r}: {metric} is a fraction between 0 and 1 (or a percentage)")
    return Slo(metric=metric, op=cast(Op, op), threshold=value)


def _fmt_seconds(s: float) -> str:
    if s != 0 and abs(s) < 1.0:
        return f"{s * 1000:g}ms"
    return f"{s:g}s"


def summarize(records: Iterable[RequestLike], *, duration_s: float, slos: Sequence[Slo] = ()) -> LoadSummary:
    """Summary of the measured (non-warm-up) records over a measured phase of `duration_s` seconds."""
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    failures: dict[str, int] = {}
    examples: dict[str, str] = {}
    for r in measured:
        if not r.ok:
            cls = r.error_class or "other"
            failures[cls] = failures.get(cls, 0) + 1
            examples.setdefault(cls, r.error_message or cls)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    completion_tokens = sum(r.completion_tokens for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    latency_slos = [s for s in slos if s.is_latency]
    good = [r for r in ok if is_good(r, latency_slos)]
    busy = math.fsum(r.e2e_s for r in measured)
    latencies = {m.name: Percentiles.of([v for r in ok for v in m.samples(r)]) for m in latency_metrics() if m.samples}
    return LoadSummary(
        **latencies,
        requests_sent=len(measured),
        requests_succeeded=len(ok),
        requests_failed=len(measured) - len(ok),
        failures=dict(sorted(failures.items(), key=lambda kv: (-kv[1], kv[0]))),
        failure_examples=examples,
        success_rate=len(ok) / len(measured) if measured else 0.0,
        duration_s=duration_s,
        request_throughput=len(ok) * per_s,
        output_throughput=completion_tokens * per_s,
        total_throughput=(prompt_tokens + completion_tokens) * per_s,
        goodput=len(good) * per_s,
        good_share=len(good) / len(measured) if measured else 0.0,
        concurrency=busy * per_s,
        usage_from_server=all(r.usage_from_server for r in ok),
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    )


def is_good(record: RequestLike, slos: Sequence[Slo]) -> bool:
    """DistServe's per-request verdict: the request succeeded and its own TTFT, TPOT, e2e (ITL under the SLO's
    statistic) each meet the bound of every latency SLO (`ttft_p95<=2s` bounds each request's TTFT at 2 s). The
    rate SLOs (success_rate, throughputs) have no per-request reading and are left out."""
    return record.ok and all(s.request_meets(record) for s in slos if s.is_latency)


def goodput_bound(slos: Sequence[Slo]) -> Slo:
    """What the goodput objective holds a rate to: the success_rate SLO's share of its requests good (0.99 where
    `slos` has no success_rate)."""
    share = next((s.threshold for s in slos if s.metric == "success_rate"), 0.99)
    return Slo(metric="good_share", op=">=", threshold=share)


def objective_latency(summary: LoadSummary, metric: str, worst: float) -> float:
    """The latency a trial is scored on (its `metric`, e.g. e2e_p95); `worst` (the request timeout) when no request
    succeeded or the value is not finite, so a run that served nothing ranks with a failed start."""
    if summary.requests_succeeded == 0:
        return worst
    value = float(summary.metric(metric))
    return value if math.isfinite(value) else worst


def total_violation(violations: Sequence[float]) -> float:
    """How far a run is from meeting its SLOs: the sum of the positive violations (0: every SLO met)."""
    return sum(max(0.0, v) for v in violations)


def closest(violations: Sequence[Sequence[float]]) -> int:
    """The index of the run that came closest to its SLOs (the first of equals); a run with no violations listed
    (it was not judged) counts as the farthest."""
    return min(range(len(violations)), key=lambda i: total_violation(violations[i]) if violations[i] else math.inf)
