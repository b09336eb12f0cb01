"""Confirming a winner before it ships: its flags launched again, the study's load run several times on that one
server, every run judged against the SLOs, and the median against what the study recorded.

A study measures each flag set once; on a shared or noisy machine one lucky run can top the front, and one unlucky
run can sink a record (a baseline recorded at 286 tok/s measured 1,218 when started again). Confirmed means: every
run meets every SLO (a miss within the noise of its bound, "marginal", is decided by the runs' majority, never one
run), the median output tok/s is not more than `tolerance` below the recorded figure, and the record is reproduced:
a record beyond `tolerance` and outside the runs' interval, in either direction, was wrong, and the verdict says by
how much. The runs' interval pools each run's within-run bootstrap with the between-start noise the study learnt
(`tuner.intervals`): the runs share one server, so their own spread understates how far another start can land.

`retest_against_baseline` asks the question a ranking needs instead: the trial and the baseline started again on
fresh servers, alternately, and judged by each pair's ratio, never against a figure stored at another time (the
record read 680 on a quiet machine; the same server started while another process ran reads less, and a verdict
against the record flipped between two calls three minutes apart).
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tuner.config import Job
from tuner.flags import VllmFlags
from tuner.intervals import (
    NOT_SEPARABLE,
    Interval,
    Noise,
    figure_of,
    format_with_ci,
    paired_difference,
    pool,
    run_intervals,
    slo_verdict,
    spotless,
)
from tuner.launch import Launcher, Server
from tuner.load.contention import Contention
from tuner.scoring import LoadSummary, Slo, named_figures
from tuner.study.measure import Measure, measure_load

__all__ = [
    "NOT_REPRODUCED",
    "NOT_SEPARABLE",
    "REPRODUCED",
    "SEPARATED",
    "Retest",
    "Verification",
    "VerifyRun",
    "retest_against_baseline",
    "study_claim",
    "verify_flags",
]


@dataclass(frozen=True)
class VerifyRun:
    output_tok_s: float
    latency_p95_s: float
    success_rate: float
    missed: tuple[str, ...]  # the SLOs this run missed
    diagnosis: str = ""
    figures: dict[str, Interval] = field(default_factory=dict)  # within-run intervals (tuner.intervals keys)
    contention: Contention | None = None  # what the machine was doing during the run (tuner.load.contention)

    @property
    def meets(self) -> bool:
        return not self.missed


@dataclass(frozen=True)
class Verification:
    recorded_tok_s: float | None
    latency_metric: str
    tolerance: float
    runs: list[VerifyRun] = field(default_factory=list)
    noise: Noise = field(
        default_factory=Noise
    )  # the between-start noise the study learnt (none: the runs' own spread only)
    slos: tuple[Slo, ...] = ()

    @property
    def median_tok_s(self) -> float:
        return statistics.median(r.output_tok_s for r in self.runs) if self.runs else 0.0

    @property
    def median_latency_s(self) -> float:
        return statistics.median(r.latency_p95_s for r in self.runs) if self.runs else 0.0

    @property
    def spread(self) -> float:
        """(max - min) / median of output tok/s: how much one run varies from the next."""
        values = [r.output_tok_s for r in self.runs]
        median = self.median_tok_s
        return (max(values) - min(values)) / median if values and median > 0 else 0.0

    @property
    def change(self) -> float | None:
        """Median output tok/s against the recorded figure, as a fraction (-0.08: 8% lower)."""
        if not self.recorded_tok_s:
            return None
        return self.median_tok_s / self.recorded_tok_s - 1.0

    @property
    def interval(self) -> Interval | None:
        """The runs' output tok/s interval (each run's bootstrap, their spread and the study's noise pooled)."""
        tput = [
            r.figures.get("output_tok_s") or Interval(r.output_tok_s, r.output_tok_s, r.output_tok_s) for r in self.runs
        ]
        if not any(i.value > 0 for i in tput):
            return None
        # The study's noise (other flag sets, other starts) or these runs' own spread, whichever is wider.
        wider = [pool(tput, self.noise).interval, pool(tput).interval]
        return max(wider, key=lambda i: i.high / i.low if i.low > 0 else math.inf)

    @property
    def reproduced(self) -> bool:
        """False when the record is beyond `tolerance` of the median and outside the runs' interval."""
        change, interval = self.change, self.interval
        if change is None or abs(change) <= self.tolerance or interval is None:
            return True
        return interval.contains(float(self.recorded_tok_s or 0.0))

    def slo_misses(self) -> dict[str, str]:
        """SLO -> why it is missed: by runs beyond the noise, or by most runs where its bound is within the noise
        (a marginal miss in a minority of runs is not a miss: one run does not decide it)."""
        out: dict[str, str] = {}
        for name in sorted({m for r in self.runs for m in r.missed}):
            missed_by = sum(name in r.missed for r in self.runs)
            slo = next((s for s in self.slos if str(s) == name), None)
            if slo is not None and self._marginal(slo) and missed_by * 2 < len(self.runs):
                continue
            out[name] = f"{missed_by} of {len(self.runs)} runs missed {name}"
        return out

    def marginal(self) -> list[str]:
        """SLOs within the noise of their bound over the runs (met or missed, by the runs' majority)."""
        return [str(s) for s in self.slos if self._marginal(s)]

    def _marginal(self, slo: Slo) -> bool:
        key = figure_of(slo.metric)
        figures = [
            r.figures[key] for r in self.runs if key is not None and key in r.figures and r.figures[key].value > 0
        ]
        if not figures or (key is not None and spotless(key, [f.value for f in figures])):
            return False
        return slo_verdict(pool(figures, Noise()).interval, slo.op, slo.threshold) == "marginal"

    @property
    def confirmed(self) -> bool:
        if not self.runs or self.slo_misses() or not self.reproduced:
            return False
        change = self.change
        return change is None or change >= -self.tolerance

    def verdict(self) -> str:
        if not self.runs:
            return "not confirmed: no run finished"
        misses = self.slo_misses()
        if misses:
            if len(misses) == 1 and all(not r.meets for r in self.runs):
                return f"not confirmed: {next(iter(misses.values()))}"
            return "not confirmed: " + "; ".join(misses.values())
        change = self.change
        if not self.reproduced:
            return f"not confirmed: {self._not_reproduced()}"
        if change is not None and change < -self.tolerance:
            return (
                f"not confirmed: median {self.median_tok_s:,.1f} tok/s is {-change:.0%} below the recorded "
                f"{self.recorded_tok_s:,.1f} (tolerance {self.tolerance:.0%})"
            )
        against = f", {change:+.1%} against the recorded {self.recorded_tok_s:,.1f}" if change is not None else ""
        meets = sum(r.meets for r in self.runs)
        marginal = self.marginal()
        note = f" ({', '.join(marginal)} within the noise of its bound)" if marginal else ""
        return (
            f"confirmed: {meets} of {len(self.runs)} runs meet every SLO{note}; median "
            f"{self._median_text()}{against}; spread {self.spread:.1%}"
        )

    def _median_text(self) -> str:
        interval = self.interval
        if interval is None:
            return f"{self.median_tok_s:,.1f} tok/s"
        return format_with_ci(self.median_tok_s, interval.low, interval.high, "tok/s")

    def _not_reproduced(self) -> str:
        change = self.change or 0.0
        n = len(self.runs)
        return (
            f"record {self.recorded_tok_s:,.0f} tok/s not reproduced: {n} run{'s' if n > 1 else ''} median "
            f"{self._median_text()} ({change:+.0%}); the record was {'low' if change > 0 else 'high'} by "
            f"{abs(self.median_tok_s - float(self.recorded_tok_s or 0.0)):,.0f} tok/s"
        )


def verify_flags(
    job: Job,
    launcher: Launcher,
    flags: VllmFlags,
    *,
    runs: int,
    recorded_tok_s: float | None,
    latency_metric: str,
    tolerance: float = 0.10,
    study: str | None = None,
    measure: Measure = measure_load,
    on_run: Callable[[int, VerifyRun | None], None] | None = None,
    noise: Noise = Noise(),
) -> Verification:
    """Launch `flags` once and run the job's load `runs` times on it (never stopped early: every run is whole;
    run 0 with the study's requests, each later one with the next workload seed).

    `on_run(i, run)` is called before run i (run None) and after it. LaunchError propagates: a winner that no
    longer starts is not confirmed, and the caller says why. `noise`: the between-start noise the study learnt.
    """
    whole = job.model_copy(update={"stop_early": False})
    slos = job.parsed_slos()
    result = Verification(recorded_tok_s, latency_metric, tolerance, noise=noise, slos=tuple(slos))

    async def go() -> None:
        async with launcher.start(flags, study=study) as server:
            for i in range(runs):
                if on_run is not None:
                    on_run(i, None)
                run = await _one(server, _nth_run(whole, i), flags, measure, slos, latency_metric)
                result.runs.append(run)
                if on_run is not None:
                    on_run(i, run)

    asyncio.run(go())
    return result


def _nth_run(job: Job, i: int) -> Job:
    """Run 0 replays the study's own requests; later runs draw fresh ones from the same distributions (the next
    seeds), so prefix-cache hits on the previous run's prompts do not flatter them."""
    if i == 0:
        return job
    workload = job.workload.model_copy(update={"seed": (job.workload.seed or 0) + i})
    return job.model_copy(update={"workload": workload})


async def _one(
    server: Server, job: Job, flags: VllmFlags, measure: Measure, slos: Sequence[Slo], latency_metric: str
) -> VerifyRun:
    m = await measure(server, job, flags)
    summary: LoadSummary | None = m.result.summary if m.result is not None else None
    if summary is None:
        return VerifyRun(0.0, 0.0, 0.0, tuple(str(s) for s in slos))
    missed = tuple(str(s) for s in slos if not s.met(summary))
    latency = float(summary.metric(latency_metric)) if summary.requests_succeeded else float("inf")
    records = m.result.records if m.result is not None else []
    return VerifyRun(
        output_tok_s=float(summary.output_throughput),
        latency_p95_s=latency,
        success_rate=float(summary.success_rate),
        missed=missed,
        diagnosis=m.result.diagnosis if m.result is not None else "",
        # the SLOs' own percentiles too (a `ttft_p90` SLO's): their verdict is judged by an interval
        figures=run_intervals(records, summary.duration_s, named=named_figures(s.metric for s in slos))
        if records
        else {},
        contention=m.contention,
    )


# -- a trial against the baseline, re-tested in pairs on fresh servers -----------------------------------------

REPRODUCED = "reproduced"
NOT_REPRODUCED = "not reproduced"
# The study called the two not separable, and the re-test told them apart: its own finding, not a reversal.
SEPARATED = "separated"


def study_claim(confirm: Mapping[str, Any], trial: int, baseline: int) -> bool | None:
    """What the study concluded of `trial` against `baseline` from its confirmation (the `confirm` attribute):
    True above, False below, None not separable (or nothing measured in pairs). The point figures' order is not a
    claim: two flag sets the study could not tell apart have no ranking to reproduce."""
    if trial == confirm.get("leader") and confirm.get("beats_baseline") is not None:
        return True if confirm["beats_baseline"] else None
    paired = confirm.get("paired") or {}
    for first, second in ((trial, baseline), (baseline, trial)):  # "a-b" holds a / b - 1
        d = (paired.get(f"{first}-{second}") or {}).get("difference")
        if isinstance(d, list) and len(d) == 3:
            if d[1] <= 0.0 <= d[2]:
                return None
            return bool(d[0] > 0) == (first == trial)
    return None


@dataclass(frozen=True)
class Retest:
    """A trial re-tested against the baseline: `pairs` pairs of fresh servers, one load run each, the trial first
    in even pairs and the baseline first in odd ones (T B, B T, ...), so a machine that slows or speeds up over the
    re-test moves both halves of a pair alike and its remainder flips sign from pair to pair.

    The ranking is judged by the pairs' log-ratios (`paired_difference`, the platform's prior joined to their own
    spread), never against a stored figure taken at another time: "reproduced" when the interval of trial /
    baseline - 1 excludes zero on the side the study claimed, "not reproduced" when it excludes zero on the other,
    and "not separable" when it includes zero. Where the study itself called them not separable (`claimed_above`
    None), "not separable" is that claim holding and "separated" the re-test telling them apart."""

    claimed_above: bool | None  # the study's conclusion: above, below, None not separable
    prior: Noise = field(default_factory=Noise)
    trial: list[VerifyRun] = field(default_factory=list)
    baseline: list[VerifyRun] = field(default_factory=list)

    @property
    def pairs(self) -> list[tuple[float, float]]:
        return [(t.output_tok_s, b.output_tok_s) for t, b in zip(self.trial, self.baseline, strict=False)]

    @property
    def difference(self) -> Interval | None:
        """trial / baseline - 1 over the pairs with its 95% interval (None: no pair measured both halves)."""
        return paired_difference(self.pairs, self.prior)

    @property
    def ranking(self) -> str:
        d = self.difference
        if d is None or d.contains(0.0):
            return NOT_SEPARABLE
        if self.claimed_above is None:
            return SEPARATED
        return REPRODUCED if (d.value > 0) == self.claimed_above else NOT_REPRODUCED

    @property
    def held(self) -> bool:
        """The study's conclusion stood: its ranking reproduced, or the two it could not separate stayed so."""
        return self.ranking == REPRODUCED or (self.claimed_above is None and self.ranking == NOT_SEPARABLE)

    def verdict(self) -> str:
        d = self.difference
        n = len(self.pairs)
        claimed = {True: "above", False: "below", None: "not separable from"}[self.claimed_above]
        if d is None:
            return f"{NOT_SEPARABLE}: no interval from {n} pair{'s' if n != 1 else ''} of starts"
        ci = f"{d.value * 100:+.1f}% (95% CI {d.low * 100:+.0f}..{d.high * 100:+.0f}%, {n} pairs of fresh starts)"
        side = "above" if d.value > 0 else "below"
        said = {
            REPRODUCED: f"the study's ranking held: the trial {claimed} the baseline by {ci}",
            NOT_REPRODUCED: f"the ranking reversed: the study had the trial {claimed} the baseline; re-tested {ci}",
            NOT_SEPARABLE: f"the trial against the baseline {ci}: within the noise"
            + (", as the study said" if self.claimed_above is None else ""),
            SEPARATED: f"the study could not separate the trial from the baseline; re-tested {side} it by {ci}",
        }[self.ranking]
        misses = sorted({m for r in self.trial for m in r.missed})
        slo = f"; the trial missed {', '.join(misses)} in some run" if misses else ""
        return f"{self.ranking}: {said}{slo}"


def retest_against_baseline(
    job: Job,
    launcher: Launcher,
    flags: VllmFlags,
    baseline: VllmFlags,
    *,
    pairs: int,
    claimed_above: bool | None,
    latency_metric: str,
    study: str | None = None,
    measure: Measure = measure_load,
    on_run: Callable[[str, int, VerifyRun | None], None] | None = None,
    prior: Noise = Noise(),
) -> Retest:
    """`pairs` pairs of fresh servers, trial and baseline alternately (T B, B T, ...), one whole load run on each
    with the study's requests. `on_run(which, i, run)`: "trial" or "baseline", the pair, before (None) and after.
    LaunchError propagates."""
    whole = job.model_copy(update={"stop_early": False})
    slos = job.parsed_slos()
    result = Retest(claimed_above, prior)

    async def one(which: str, i: int) -> None:
        if on_run is not None:
            on_run(which, i, None)
        async with launcher.start(flags if which == "trial" else baseline, study=study) as server:
            run = await _one(server, whole, flags if which == "trial" else baseline, measure, slos, latency_metric)
        (result.trial if which == "trial" else result.baseline).append(run)
        if on_run is not None:
            on_run(which, i, run)

    async def go() -> None:
        for i in range(pairs):
            for which in ("trial", "baseline") if i % 2 == 0 else ("baseline", "trial"):
                await one(which, i)

    asyncio.run(go())
    return result
