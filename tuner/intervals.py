"""How sure a figure is: 95% intervals for one run's figures, for one flag set over several starts, and for the
relative difference of two flag sets.

Two kinds of noise move a figure. Within a run, which requests happened to be slow: a seeded bootstrap over the run's
requests measures it. Between starts of the same flags, where the server's threads and memory landed (a CPU build's
worker sharing its core, a GPU's clocks and graph capture): only starting it again measures it, and on a small
machine it is much the larger (the same flags read 24% apart between starts, 1-3% within a run). A flag set's
interval over its starts takes the larger of the two, with the between-start spread learnt over the whole study
(`learn_noise`), since one flag set rarely has enough starts of its own to estimate it. A spread learnt from two or
three repeats is itself unsure: it is joined with a stated prior for the platform (`PRIORS`, counted as the repeats
it stands for) and every interval over starts takes Student's t at the degrees of freedom it rests on. Two flag sets
started one after the other are compared by the log-ratio of each pair (`paired_difference`), so a machine that
drifts between pairs does not decide the comparison.

Figures that are ratios (throughput, latency) are combined on a log scale, so a relative difference has a symmetric
interval and a noise learnt on a slow flag set carries over to a fast one. Pure: numpy and the standard library.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tuner.scoring import METRICS, Figure, Metric, RequestLike, latency_of

__all__ = [
    "LEVEL",
    "NOT_SEPARABLE",
    "PRIORS",
    "RUN_PERCENTILES",
    "Interval",
    "Noise",
    "Pooled",
    "Prior",
    "bootstrap",
    "figure_of",
    "format_with_ci",
    "interval_metrics",
    "learn_noise",
    "mean_interval",
    "paired_difference",
    "platform_prior",
    "pool",
    "relative_difference",
    "run_intervals",
    "scaled",
    "separable",
    "slo_verdict",
    "spotless",
    "t_quantile",
    "wilson",
]

LEVEL = 0.95
NOT_SEPARABLE = "not separable"
"""The one wording of a difference whose interval includes zero, or that has no interval (one start, nothing to
judge it by): the study's closing lines, the front and `tuner verify` all say it so."""
RESAMPLES = 1000
RUN_PERCENTILES = (50, 95, 99)
_CELLS = 2_000_000  # resampled values held at once: a run of 10,000 requests resamples in chunks of 200

Floats = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Interval:
    """A figure and its interval at `LEVEL`."""

    value: float
    low: float
    high: float

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def contains(self, x: float) -> bool:
        return self.low <= x <= self.high

    def as_list(self) -> list[float]:
        return [self.low, self.high]


def scaled(interval: Interval, value: float) -> Interval:
    """`interval` brought to `value` by one factor: a run measured on one replica to the box's figure, or a capacity
    step's own tok/s to the tokens its rate asks for (what the trial was scored by)."""
    if interval.value <= 0:
        return interval
    k = value / interval.value
    return Interval(value, interval.low * k, interval.high * k)


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile (`p` in (0, 1)): exact for 1 and 2 degrees of freedom, a Cornish-Fisher expansion of
    the normal quantile above (within 0.2% of the tables from 3 on), the normal one for df = inf."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"quantile {p} outside (0, 1)")
    if df <= 0:
        raise ValueError(f"degrees of freedom {df} <= 0")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = statistics.NormalDist().inv_cdf(p)
    if math.isinf(df):
        return z
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def _two_sided(level: float, df: float = math.inf) -> float:
    return t_quantile(0.5 + level / 2, df)


def mean_interval(samples: Sequence[float], level: float = LEVEL) -> Interval:
    """The t-interval of the mean of `samples` (at least two)."""
    if len(samples) < 2:
        raise ValueError("an interval of a mean needs at least two samples")
    mean = statistics.fmean(samples)
    se = statistics.stdev(samples) / math.sqrt(len(samples))
    t = _two_sided(level, len(samples) - 1)
    return Interval(mean, mean - t * se, mean + t * se)


def wilson(successes: int, n: int, level: float = LEVEL) -> Interval:
    """Wilson's score interval of a proportion. Not a bootstrap: at 100% success, most trials, a bootstrap collapses
    to the point 1.0, while 200 of 200 still leaves room for a failure rate of 1.9%."""
    if n <= 0:
        return Interval(0.0, 0.0, 1.0)
    z = _two_sided(level)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half))


Statistic = Callable[[Floats], Floats]
"""Rows of resampled values (resamples x n) -> one figure per row."""


def bootstrap(
    values: Sequence[float] | Floats,
    statistic: Statistic,
    *,
    seed: int = 0,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
) -> Interval:
    """A percentile bootstrap of `statistic` over `values` (seeded: the same values give the same interval)."""
    data = np.asarray(values, dtype=np.float64)
    point = float(statistic(data[np.newaxis, :])[0])
    if data.size < 2:
        return Interval(point, point, point)
    rng = np.random.default_rng(seed)
    rows = max(1, _CELLS // data.size)
    figures: list[Floats] = []
    for start in range(0, resamples, rows):
        idx = rng.integers(0, data.size, size=(min(rows, resamples - start), data.size))
        figures.append(statistic(data[idx]))
    drawn = np.concatenate(figures)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(drawn, [tail, 100 - tail])
    return Interval(point, float(min(low, point)), float(max(high, point)))


def interval_metrics() -> list[Metric]:
    """The registry's latencies a run keeps an interval of, read when called (a test may register one): those with
    one value per request, so a bootstrap over the requests resamples independent draws (ITL pools every gap of a
    request, which are not)."""
    return [m for m in METRICS.values() if m.samples is not None and m.per_request]


def run_intervals(
    records: Sequence[RequestLike],
    duration_s: float,
    *,
    seed: int = 0,
    level: float = LEVEL,
    named: Iterable[Figure] = (),
) -> dict[str, Interval]:
    """One run's figures with their within-run intervals: output tok/s over the run, the success rate, and the
    p50/p95/p99 of each per-request latency of the registry (`interval_metrics`) over the successful requests, and
    each percentile `named` names of them (the study's SLOs': a `ttft_p90` SLO's). Keys as the trial record names
    them: `output_tok_s`, `success_rate`, `ttft_p95_s`, ..."""
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    out: dict[str, Interval] = {}
    if duration_s > 0 and measured:
        tokens = [float(r.completion_tokens) if r.ok else 0.0 for r in measured]
        n = len(measured)
        out["output_tok_s"] = bootstrap(tokens, lambda rows: rows.mean(axis=1) * n / duration_s, seed=seed, level=level)
    out["success_rate"] = wilson(len(ok), len(measured), level)
    extra = [(f.metric, round(f.quantile * 100)) for f in named if f.quantile is not None]
    for metric in interval_metrics():
        samples = metric.samples
        assert samples is not None
        # The registry's reading, as `summarize` takes it: the point value is the summary's own figure
        values = [v for r in ok for v in samples(r)]
        if not values:
            continue
        for q in sorted({*RUN_PERCENTILES, *(q for name, q in extra if name == metric.name)}):
            out[f"{metric.name}_p{q}_s"] = bootstrap(values, _percentile(q), seed=seed + q, level=level)
    return out


def _percentile(q: int) -> Statistic:
    # numpy's default (linear) method: the one tuner.scoring.percentile reproduces.
    return lambda rows: np.asarray(np.percentile(rows, q, axis=1), dtype=np.float64)


# -- one flag set over several starts --------------------------------------------------------------------------


@dataclass(frozen=True)
class Noise:
    """The between-start spread a study has seen: the variance of log(figure) between starts of one flag set,
    pooled over every flag set started more than once, and its degrees of freedom (0: not seen yet)."""

    log_var: float = 0.0
    df: int = 0

    @property
    def relative_sd(self) -> float:
        """About the relative standard deviation of one start's figure (0.05: 5%)."""
        return math.sqrt(math.exp(self.log_var) - 1) if self.df else 0.0

    def with_prior(self, prior: Noise) -> Noise:
        """This spread and a prior one joined as their degrees of freedom weigh them (the prior counts as `df`
        repeats seen before the study): two repeats alone no longer stand for a spread known exactly."""
        df = self.df + prior.df
        if not df:
            return Noise()
        return Noise((self.log_var * self.df + prior.log_var * prior.df) / df, df)


@dataclass(frozen=True)
class Prior:
    """The between-start spread assumed for a platform until the study has measured enough starts of its own: a
    relative standard deviation, the repeats it stands for (its weight against the study's), and where it comes
    from."""

    relative_sd: float
    df: int
    source: str

    @property
    def noise(self) -> Noise:
        return Noise(math.log1p(self.relative_sd**2), self.df)


PRIORS: dict[str, Prior] = {
    "cpu": Prior(
        0.14,
        2,
        "measured: vLLM 0.32.0's CPU build on 2 cores, the tiny model, 14% between starts of the same flags over "
        "3 starts (benchmarks/README.md, 'Real vLLM noise'; 24% in the grid's repeats on a shared machine)",
    ),
    "gpu": Prior(
        0.03,
        2,
        "an assumption, not a measurement: a few percent between starts of one flag set on a dedicated GPU (fixed "
        "clocks, graphs captured at start); no GPU repeat has been measured in this repository",
    ),
}
"""The between-start spread assumed per platform (`platform_prior`): wide for vLLM's CPU build, narrow for a GPU."""


def platform_prior(cpu: bool) -> Prior:
    """The prior of a job's platform: vLLM's CPU build (`gpu: cpu`) or a GPU (the emulator's too: it plays one)."""
    return PRIORS["cpu" if cpu else "gpu"]


def learn_noise(groups: Sequence[Sequence[float]]) -> Noise:
    """The pooled between-start variance of log figures over the groups (one group: one flag set's starts)."""
    sum_sq = 0.0
    df = 0
    for group in groups:
        logs = [math.log(x) for x in group if x > 0]
        if len(logs) < 2:
            continue
        mean = statistics.fmean(logs)
        sum_sq += sum((v - mean) ** 2 for v in logs)
        df += len(logs) - 1
    return Noise(sum_sq / df, df) if df else Noise()


@dataclass(frozen=True)
class Pooled:
    """A flag set's figure over its starts: the geometric mean, the variance of its log, the degrees of freedom
    that variance rests on (inf: only the within-run bootstrap), and the interval at `LEVEL`."""

    value: float
    log_mean: float
    log_var: float
    df: float
    starts: int
    level: float = LEVEL
    shared: bool = False  # its variance is the study's noise (shared with other flag sets), not its own starts'

    @property
    def interval(self) -> Interval:
        t = _two_sided(self.level, self.df)
        se = math.sqrt(self.log_var)
        return Interval(self.value, math.exp(self.log_mean - t * se), math.exp(self.log_mean + t * se))


def pool(starts: Sequence[Interval], noise: Noise = Noise(), level: float = LEVEL) -> Pooled:
    """One flag set's starts (each a figure with its within-run interval) pooled: each start counts with the
    larger of its within-run variance and the between-start spread, the study's (`noise`, pooled over every flag
    set started more than once, this one among them) or, without one, its own starts' spread."""
    figures = [s for s in starts if s.value > 0]
    if not figures:
        raise ValueError("no start with a positive figure to pool")
    logs = [math.log(s.value) for s in figures]
    k = len(logs)
    z = _two_sided(level)
    within = statistics.fmean(((math.log(s.high) - math.log(max(s.low, 1e-300))) / (2 * z)) ** 2 for s in figures)
    per_start, df, shared = within, math.inf, False
    if noise.df:
        # The study's pooled spread (this flag set's own starts among it): more degrees of freedom than its own.
        if noise.log_var > per_start:
            per_start, df, shared = noise.log_var, float(noise.df), True
    elif k >= 2:
        own = statistics.variance(logs)
        if own > per_start:
            per_start, df = own, float(k - 1)
    log_mean = statistics.fmean(logs)
    return Pooled(math.exp(log_mean), log_mean, per_start / k, df, k, level, shared)


def relative_difference(a: Pooled, b: Pooled) -> Interval:
    """a / b - 1 with its interval: Welch's degrees of freedom over two variances of their own starts, the fewer of
    the two where both rest on the study's one learnt noise (Welch's sum would count its repeats twice)."""
    diff = a.log_mean - b.log_mean
    var = a.log_var + b.log_var
    df = min(a.df, b.df) if a.shared and b.shared else _welch_df(a, b)
    t = _two_sided(min(a.level, b.level), df)
    se = math.sqrt(var)
    return Interval(math.expm1(diff), math.expm1(diff - t * se), math.expm1(diff + t * se))


def paired_difference(
    pairs: Sequence[tuple[float, float]], noise: Noise = Noise(), level: float = LEVEL
) -> Interval | None:
    """a / b - 1 over pairs of starts made one after the other (a's figure, b's), with its interval: the mean of the
    pairs' log-ratios, whose spread is their own (n - 1 degrees of freedom) joined with `noise` (a pair's
    difference holds two starts' spread). A drift of the machine moves both halves of a pair alike and cancels.
    None: no pair, or nothing to estimate a spread from (one pair without a prior): no interval rather than a
    zero-width one."""
    logs = [math.log(x / y) for x, y in pairs if x > 0 and y > 0]
    n = len(logs)
    df = n - 1 + noise.df
    if not n or not df:
        return None
    mean = statistics.fmean(logs)
    var = (sum((v - mean) ** 2 for v in logs) + noise.df * 2 * noise.log_var) / df
    if var <= 0:
        return None
    half = _two_sided(level, df) * math.sqrt(var / n)
    return Interval(math.expm1(mean), math.expm1(mean - half), math.expm1(mean + half))


def _welch_df(a: Pooled, b: Pooled) -> float:
    terms = [(p.log_var, p.df) for p in (a, b) if p.log_var > 0]
    if not terms or any(math.isinf(df) for _, df in terms):
        return math.inf
    total = sum(v for v, _ in terms)
    return total**2 / sum(v * v / df for v, df in terms)


def separable(a: Pooled, b: Pooled) -> bool:
    """Whether the two flag sets differ beyond the noise: the interval of their difference excludes 0."""
    d = relative_difference(a, b)
    return not d.contains(0.0)


def figure_of(metric: str) -> str | None:
    """The `run_intervals` key that holds an SLO metric's figure (None: no interval is kept for it): a percentile
    of a per-request latency (the p50/p95/p99 every run keeps, another where the study names it: `named`).
    Matched against the registry (`latency_of`), so a metric whose name holds an underscore is read whole."""
    latency = latency_of(metric)
    if latency is not None:
        entry, stat = latency
        kept = entry in interval_metrics() and Figure(entry.name, stat).quantile is not None
        return f"{metric}_s" if kept else None
    return {"success_rate": "success_rate", "output_throughput": "output_tok_s"}.get(metric)


def spotless(key: str, values: Sequence[float]) -> bool:
    """Every run's success rate 100%: no request failed anywhere. Its interval still reaches below a 0.99 bound (96
    of 96 gives a Wilson low of 96.2%), but nothing measured points at a miss and a repeat can show no better, so
    a success-rate SLO it meets is met, not "marginal" (which spent starts and said nothing)."""
    return key == "success_rate" and bool(values) and all(v >= 1.0 for v in values)


def slo_verdict(interval: Interval, op: str, threshold: float) -> str:
    """ "met", "missed", or "marginal" when the bound lies within the figure's interval: one more draw could
    fall on either side of it, so only repeats decide."""
    if interval.low <= threshold <= interval.high:
        return "marginal"
    below = interval.high < threshold
    meets = below if op in ("<=", "<") else not below
    return "met" if meets else "missed"


# -- how a figure is shown -------------------------------------------------------------------------------------


def format_with_ci(value: float, low: float, high: float, unit: str) -> str:
    """A figure as `312 ± 9 tok/s`: the half width of its interval, rounded to one significant digit (two when it
    starts with a 1), the figure to the same place; a latency below one second in ms, a fraction in percent."""
    if unit == "s" and abs(value) < 1:
        return format_with_ci(value * 1000, low * 1000, high * 1000, "ms")
    if unit == "fraction":
        return format_with_ci(value * 100, low * 100, high * 100, "%").replace(" %", "%")
    half = (high - low) / 2
    if not (math.isfinite(half) and half > 0):
        return f"{value:,.{_places(abs(value) / 100 if value else 1.0)}f} {unit}".rstrip()
    places = _places(half)
    return f"{value:,.{places}f} ± {half:,.{places}f} {unit}".rstrip()


def _places(half: float) -> int:
    if half <= 0:
        return 0
    exponent = math.floor(math.log10(half))
    # A leading 1 keeps a second digit: "± 1" would round 1.49 down by a third.
    leading_one = int(half / 10**exponent) == 1
    return max(0, -exponent + leading_one)
