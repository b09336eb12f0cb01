"""The interval arithmetic against distributions whose answers are known."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from tuner.intervals import (
    PRIORS,
    Interval,
    Noise,
    bootstrap,
    format_with_ci,
    learn_noise,
    mean_interval,
    paired_difference,
    platform_prior,
    pool,
    relative_difference,
    run_intervals,
    separable,
    slo_verdict,
    spotless,
    t_quantile,
    wilson,
)
from tuner.load import RequestRecord


@pytest.mark.parametrize(
    ("df", "table"),
    [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571), (10, 2.228), (30, 2.042), (math.inf, 1.960)],
)
def test_t_quantile_matches_the_tables(df: float, table: float) -> None:
    assert t_quantile(0.975, df) == pytest.approx(table, rel=2e-3)
    assert t_quantile(0.025, df) == pytest.approx(-table, rel=2e-3)


def test_bootstrap_of_a_mean_of_normal_samples_matches_the_analytic_interval() -> None:
    samples = np.random.default_rng(7).normal(100.0, 15.0, size=400)
    analytic = mean_interval(list(samples))
    boot = bootstrap(samples, lambda rows: rows.mean(axis=1), seed=3, resamples=4000)
    assert boot.value == pytest.approx(analytic.value)
    assert boot.low == pytest.approx(analytic.low, abs=0.15 * analytic.half_width)
    assert boot.high == pytest.approx(analytic.high, abs=0.15 * analytic.half_width)


def test_bootstrap_is_seeded() -> None:
    samples = list(np.random.default_rng(1).exponential(2.0, size=50))

    def mean(rows: np.ndarray) -> np.ndarray:
        return np.asarray(rows.mean(axis=1))

    assert bootstrap(samples, mean, seed=5) == bootstrap(samples, mean, seed=5)
    assert bootstrap(samples, mean, seed=5) != bootstrap(samples, mean, seed=6)


def test_the_mean_interval_covers_the_true_mean_about_95_times_in_100() -> None:
    rng = np.random.default_rng(11)
    covered = sum(mean_interval(list(rng.normal(5.0, 2.0, size=8))).contains(5.0) for _ in range(1000))
    assert 930 <= covered <= 970


@pytest.mark.parametrize(
    ("k", "n", "low", "high"),
    # Wilson's intervals as published (Newcombe 1998, table I; and 0 or all of n, closed forms).
    [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (200, 200, 0.9812, 1.0)],
)
def test_success_rate_interval_is_wilsons(k: int, n: int, low: float, high: float) -> None:
    ci = wilson(k, n)
    assert ci.value == pytest.approx(k / n)
    assert ci.low == pytest.approx(low, abs=6e-4)
    assert ci.high == pytest.approx(high, abs=6e-4)


def _records(e2e: list[float], *, tokens: int = 32, failed: int = 0) -> list[RequestRecord]:
    return [
        RequestRecord(
            index=i, start_s=0.0, ttft_s=0.1 * v, e2e_s=v, completion_tokens=tokens if i >= failed else 0,
            ok=i >= failed, error_class=None if i >= failed else "timeout",
        )
        for i, v in enumerate(e2e)
    ]  # fmt: skip


def test_run_intervals_hold_every_figure_around_its_point_value() -> None:
    e2e = list(np.random.default_rng(2).lognormal(0.0, 0.3, size=200))
    cis = run_intervals(_records(e2e, failed=10), duration_s=20.0)
    assert cis["output_tok_s"].value == pytest.approx(190 * 32 / 20.0)
    assert cis["success_rate"] == wilson(190, 200)
    ok = sorted(e2e[10:])
    assert cis["e2e_p50_s"].value == pytest.approx(statistics.median(ok))
    assert cis["e2e_p99_s"].value == pytest.approx(float(np.percentile(ok, 99)))
    assert set(cis) >= {f"{m}_p{q}_s" for m in ("ttft", "tpot", "e2e") for q in (50, 95, 99)}
    for ci in cis.values():
        assert ci.low <= ci.value <= ci.high
    assert cis["e2e_p50_s"].half_width > 0


def test_throughput_of_identical_requests_has_no_within_run_spread() -> None:
    cis = run_intervals(_records([1.0] * 50), duration_s=10.0)
    assert cis["output_tok_s"] == Interval(160.0, 160.0, 160.0)


def _starts(rng: np.random.Generator, mean: float, rel_sd: float, k: int) -> list[Interval]:
    """k starts whose figure moves by `rel_sd` between starts, each with a tight within-run interval."""
    values = mean * np.exp(rng.normal(0.0, rel_sd, size=k))
    return [Interval(float(v), float(v) * 0.99, float(v) * 1.01) for v in values]


def test_difference_of_identical_distributions_contains_zero() -> None:
    rng = np.random.default_rng(4)
    a, b = _starts(rng, 1000.0, 0.05, 5), _starts(rng, 1000.0, 0.05, 5)
    d = relative_difference(pool(a), pool(b))
    assert d.contains(0.0)
    assert not separable(pool(a), pool(b))


def test_difference_interval_covers_the_true_difference_about_95_times_in_100() -> None:
    rng = np.random.default_rng(9)
    truth = 1.2 / 1.0 - 1
    covered = 0
    for _ in range(400):
        a, b = _starts(rng, 1200.0, 0.1, 3), _starts(rng, 1000.0, 0.1, 3)
        covered += relative_difference(pool(a), pool(b)).contains(truth)
    assert 360 <= covered <= 396  # 90-99%: the log-scale Welch interval is near, not exactly, nominal


def test_far_apart_flag_sets_are_separable_and_the_sign_is_kept() -> None:
    rng = np.random.default_rng(5)
    fast, slow = pool(_starts(rng, 1300.0, 0.03, 3)), pool(_starts(rng, 1000.0, 0.03, 3))
    assert separable(fast, slow)
    d = relative_difference(fast, slow)
    assert 0.2 < d.low < d.value < d.high < 0.4


def test_one_start_each_is_only_as_sure_as_the_noise_the_study_has_learnt() -> None:
    a, b = [Interval(1100.0, 1090.0, 1110.0)], [Interval(1000.0, 990.0, 1010.0)]
    # The within-run intervals alone separate them ...
    assert separable(pool(a), pool(b))
    # ... but starts of one flag set were seen 20% apart: one start each decides nothing.
    noise = learn_noise([[1000.0, 1250.0], [800.0, 650.0]])
    assert noise.df == 2 and 0.1 < noise.relative_sd < 0.3
    assert not separable(pool(a, noise), pool(b, noise))


def test_pooled_interval_of_lognormal_starts_matches_the_analytic_one() -> None:
    rng = np.random.default_rng(3)
    starts = _starts(rng, 500.0, 0.2, 12)
    logs = [math.log(s.value) for s in starts]
    analytic = mean_interval(logs)
    ci = pool(starts).interval
    assert math.log(ci.low) == pytest.approx(analytic.low, rel=1e-9)
    assert math.log(ci.high) == pytest.approx(analytic.high, rel=1e-9)


def test_noise_needs_a_flag_set_started_twice() -> None:
    assert learn_noise([[1000.0], [900.0]]) == Noise()


@pytest.mark.parametrize(
    ("ci", "op", "threshold", "verdict"),
    [
        (Interval(0.40, 0.38, 0.42), "<=", 0.5, "met"),
        (Interval(0.60, 0.58, 0.62), "<=", 0.5, "missed"),
        (Interval(0.49, 0.46, 0.53), "<=", 0.5, "marginal"),
        (Interval(0.99, 0.97, 1.0), ">=", 0.9, "met"),
        (Interval(0.85, 0.80, 0.88), ">=", 0.9, "missed"),
    ],
)
def test_slo_verdict_is_marginal_within_the_interval(ci: Interval, op: str, threshold: float, verdict: str) -> None:
    assert slo_verdict(ci, op, threshold) == verdict


@pytest.mark.parametrize(
    ("args", "text"),
    [
        ((312.4, 303.0, 321.0, "tok/s"), "312 ± 9 tok/s"),
        ((1218.0, 1158.0, 1278.0, "tok/s"), "1,218 ± 60 tok/s"),
        ((0.4213, 0.401, 0.441, "s"), "421 ± 20 ms"),
        ((2.345, 2.31, 2.39, "s"), "2.35 ± 0.04 s"),
        ((0.98, 0.96, 0.99, "fraction"), "98.0 ± 1.5%"),
        ((286.0, 286.0, 286.0, "tok/s"), "286 tok/s"),
    ],
)
def test_format_with_ci(args: tuple[float, float, float, str], text: str) -> None:
    assert format_with_ci(*args) == text


def test_spotless_is_every_run_without_a_failure_and_only_for_the_success_rate() -> None:
    assert spotless("success_rate", [1.0, 1.0])
    assert not spotless("success_rate", [1.0, 0.99])
    assert not spotless("success_rate", [])
    assert not spotless("output_tok_s", [1.0])


def test_the_t_interval_at_two_or_three_starts_is_wider_than_one_that_takes_the_spread_as_known() -> None:
    """Two or three starts estimate their spread badly: the interval over them takes Student's t at that many
    degrees of freedom, not the normal quantile of a spread known exactly."""
    for figures in ([1000.0, 1140.0], [1000.0, 1140.0, 920.0]):
        starts = [Interval(v, v, v) for v in figures]
        own = pool(starts)  # their own spread, len - 1 degrees of freedom
        logs = [math.log(v) for v in figures]
        known = pool(starts, Noise(statistics.variance(logs), 10**9))  # the same spread, taken as known
        assert own.df == len(figures) - 1
        assert own.interval.high / own.interval.low > 2 * (known.interval.high / known.interval.low - 1) + 1


def test_a_prior_joins_the_learnt_spread_as_the_repeats_it_stands_for() -> None:
    learnt = Noise(0.01, 2)
    joined = learnt.with_prior(PRIORS["cpu"].noise)
    assert joined.df == 2 + PRIORS["cpu"].df
    assert joined.log_var == pytest.approx((0.01 * 2 + PRIORS["cpu"].noise.log_var * PRIORS["cpu"].df) / joined.df)
    assert Noise().with_prior(PRIORS["gpu"].noise) == PRIORS["gpu"].noise
    # Wide for the CPU build, narrow for a GPU; each says where its figure comes from.
    assert platform_prior(cpu=True).relative_sd > platform_prior(cpu=False).relative_sd
    assert "benchmarks/README.md" in PRIORS["cpu"].source and "assumption" in PRIORS["gpu"].source


def test_paired_differences_cancel_a_steady_drift_and_never_make_a_zero_width_interval() -> None:
    # A drift of 10% a start: the first of each pair reads 11% high against the second, alternately a and b.
    pairs = [(1000.0 * 0.9**0, 1000.0 * 0.9**1), (1000.0 * 0.9**3, 1000.0 * 0.9**2)]
    d = paired_difference(pairs)
    assert d is not None and d.contains(0.0) and d.value == pytest.approx(0.0, abs=1e-12)
    # Identical pairs and no prior: no spread to estimate from, so no interval rather than a point.
    assert paired_difference([(1100.0, 1000.0), (1100.0, 1000.0)]) is None
    assert paired_difference([(1100.0, 1000.0)]) is None  # one pair, no prior
    one = paired_difference([(1100.0, 1000.0)], PRIORS["gpu"].noise)
    assert one is not None and one.low < 0.1 < one.high
    # A real gain well beyond the noise is separated by a few pairs.
    gain = paired_difference([(1500.0, 1000.0), (1440.0, 1010.0), (1530.0, 990.0)], PRIORS["gpu"].noise)
    assert gain is not None and gain.low > 0.3
