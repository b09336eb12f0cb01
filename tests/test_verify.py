"""Confirming a winner: one launch, several whole load runs, every SLO in every run, the median against the record,
and a record the runs cannot reproduce, in either direction, said to be wrong."""

from __future__ import annotations

from typing import Any

import pytest
from study_fakes import FakeLauncher, FakeServer, fake_measure, job, records_for

from tuner.config import Job
from tuner.errors import LaunchError
from tuner.flags import VllmFlags
from tuner.intervals import Noise
from tuner.load import LoadResult, RequestRecord
from tuner.scoring import summarize
from tuner.study import Measurement
from tuner.verify import verify_flags

FLAGS = VllmFlags(max_num_seqs=16, gpu_memory_utilization=0.9)


def recorded() -> float:
    return summarize(records_for(FLAGS), duration_s=10.0 / 16).output_throughput


def scaled_measure(factors: list[float], seen: list[Job]) -> Any:
    """The fake load phase, its throughput scaled run by run; notes the job each run was given."""

    async def measure(server: FakeServer, j: Job, flags: VllmFlags) -> Measurement:
        seen.append(j)
        factor = factors[len(seen) - 1]
        records = records_for(flags)
        summary = summarize(records, duration_s=10.0 / 16 / factor, slos=j.parsed_slos())
        return Measurement(LoadResult(summary=summary, records=records))

    return measure


def test_one_launch_whole_runs_fresh_seeds_and_a_confirmed_verdict() -> None:
    launcher, seen = FakeLauncher(), []
    j = job(stop_early=True, slos=["e2e_p95 <= 2s", "success_rate >= 0.9"])
    v = verify_flags(
        j, launcher, FLAGS, runs=3, recorded_tok_s=recorded(), latency_metric="e2e_p95",
        measure=scaled_measure([1.0, 0.97, 1.02], seen), study="fake",
    )  # fmt: skip
    assert len(launcher.launches) == 1 and launcher.launches[0]["study"] == "fake"
    assert [x.workload.seed for x in seen] == [j.workload.seed, j.workload.seed + 1, j.workload.seed + 2]
    assert all(x.stop_early is False for x in seen)  # a verification measures every request
    assert v.confirmed and v.median_tok_s == pytest.approx(recorded())
    assert v.spread == pytest.approx(0.05)
    assert v.verdict().startswith("confirmed: 3 of 3 runs meet every SLO")


def test_a_median_below_the_tolerance_or_one_missed_slo_is_not_confirmed() -> None:
    slow = verify_flags(
        job(), FakeLauncher(), FLAGS, runs=3, recorded_tok_s=recorded(), latency_metric="e2e_p95",
        measure=scaled_measure([0.85, 0.8, 0.95], []),
    )  # fmt: skip
    assert not slow.confirmed and slow.change == pytest.approx(-0.15)
    assert "15% below the recorded" in slow.verdict() and "tolerance 10%" in slow.verdict()
    failing = verify_flags(
        job(), FakeLauncher(), FLAGS, runs=2, recorded_tok_s=recorded(), latency_metric="e2e_p95",
        measure=fake_measure(failures=3),
    )  # fmt: skip
    assert not failing.confirmed
    assert failing.verdict() == "not confirmed: 2 of 2 runs missed success_rate>=0.9"


def test_a_winner_that_no_longer_starts_raises_the_launch_error() -> None:
    launcher = FakeLauncher(fail=lambda flags, attempt: LaunchError("no room", reason="kv_cache_too_small"))
    with pytest.raises(LaunchError, match="no room"):
        verify_flags(job(), launcher, FLAGS, runs=2, recorded_tok_s=1.0, latency_metric="e2e_p95")


def test_top_k_ranks_the_confirmed_front_points_by_their_medians() -> None:
    from tuner.cli.verify import _candidates, _winner
    from tuner.report import StudyView
    from tuner.report.views import TrialView
    from tuner.verify import Verification, VerifyRun

    def view_of(number: int, tput: float, lat: float) -> TrialView:
        return TrialView(number, "COMPLETE", False, "measured", None, {}, tput, lat, output_tok_s=tput, feasible=True)

    # A front of three (more throughput costs latency) and one dominated point.
    trials = [view_of(1, 300.0, 3.0), view_of(2, 280.0, 2.0), view_of(3, 250.0, 1.0), view_of(4, 200.0, 4.0)]
    view = StudyView("s", {"slos": ["e2e_p95<=5s"]}, trials)
    assert [t.number for t in _candidates(view, None, "throughput", 2)] == [1, 2]
    assert [t.number for t in _candidates(view, None, "throughput", 9)] == [1, 2, 3]

    def verified(median: float, meets: bool = True) -> Verification:
        run = VerifyRun(median, 1.0, 1.0, () if meets else ("e2e_p95<=5s",))
        return Verification(300.0, "e2e_p95", 0.5, [run])

    # #1 topped the study on one lucky run; verified, #2 is faster; #3 missed an SLO.
    results = [
        (trials[0], verified(240.0), None),
        (trials[1], verified(270.0), None),
        (trials[2], verified(299.0, False), None),
    ]
    assert _winner(results).number == 2  # type: ignore[union-attr]
    assert _winner([(trials[0], None, "did not start"), (trials[2], verified(299.0, False), None)]) is None


def test_a_record_far_below_what_the_runs_measure_was_wrong_and_the_verdict_says_by_how_much() -> None:
    # The baseline recorded on a cold machine: every run now measures 4.3x its record.
    v = verify_flags(
        job(), FakeLauncher(), FLAGS, runs=3, recorded_tok_s=recorded() / 4.26, latency_metric="e2e_p95",
        measure=scaled_measure([0.95, 1.0, 1.05], []),
    )  # fmt: skip
    assert not v.confirmed and not v.reproduced
    verdict = v.verdict()
    assert verdict.startswith(f"not confirmed: record {recorded() / 4.26:,.0f} tok/s not reproduced: 3 runs median ")
    assert "(+326%)" in verdict and " ± " in verdict and "the record was low by" in verdict
    # One run is enough to say so when it lies far beyond the noise.
    fast = verify_flags(
        job(), FakeLauncher(), FLAGS, runs=1, recorded_tok_s=recorded(), latency_metric="e2e_p95",
        measure=scaled_measure([1.5], []),
    )  # fmt: skip
    assert not fast.confirmed and "(+50%)" in fast.verdict() and "1 run median" in fast.verdict()


def test_a_gain_within_the_noise_is_no_evidence_against_the_record() -> None:
    # The runs disagree among themselves by 60%: a median 30% above the record says nothing about it.
    noisy = verify_flags(
        job(), FakeLauncher(), FLAGS, runs=3, recorded_tok_s=recorded(), latency_metric="e2e_p95",
        measure=scaled_measure([1.0, 1.3, 1.6], []),
    )  # fmt: skip
    assert noisy.reproduced and noisy.confirmed
    # Steady runs, but the study saw the same flags move 20% between starts: a 15% gain is within that.
    steady = verify_flags(
        job(), FakeLauncher(), FLAGS, runs=3, recorded_tok_s=recorded(), latency_metric="e2e_p95",
        measure=scaled_measure([1.15, 1.15, 1.15], []), noise=Noise(log_var=0.04, df=8),
    )  # fmt: skip
    assert steady.reproduced and steady.confirmed
    alone = verify_flags(
        job(), FakeLauncher(), FLAGS, runs=3, recorded_tok_s=recorded(), latency_metric="e2e_p95",
        measure=scaled_measure([1.15, 1.15, 1.15], []),
    )  # fmt: skip
    assert not alone.reproduced and "(+15%)" in alone.verdict()


def ramp_measure(scales: list[float]) -> Any:
    """Run i's requests take 0.8 to 1.2 s times scales[i]: its e2e p95 near 1.18 s times that."""
    seen: list[int] = []

    async def measure(server: FakeServer, j: Job, flags: VllmFlags) -> Measurement:
        scale = scales[len(seen)]
        seen.append(1)
        records = [
            RequestRecord(
                index=i, start_s=0.0, ttft_s=0.05, e2e_s=scale * (0.8 + 0.4 * i / 39), prompt_tokens=8,
                completion_tokens=32, ok=True,
            )
            for i in range(40)
        ]  # fmt: skip
        summary = summarize(records, duration_s=10.0, slos=j.parsed_slos())
        return Measurement(LoadResult(summary=summary, records=records))

    return measure


def test_an_slo_within_the_noise_of_its_bound_is_decided_by_the_runs_majority_not_one_run() -> None:
    j = job(slos=["e2e_p95 <= 1.19s"])
    one_miss = verify_flags(
        j, FakeLauncher(), FLAGS, runs=3, recorded_tok_s=None, latency_metric="e2e_p95",
        measure=ramp_measure([1.0, 1.03, 0.99]),
    )  # fmt: skip
    assert [r.meets for r in one_miss.runs] == [True, False, True]
    assert one_miss.confirmed
    assert "2 of 3 runs meet every SLO (e2e_p95<=1.19s within the noise of its bound)" in one_miss.verdict()
    two_misses = verify_flags(
        j, FakeLauncher(), FLAGS, runs=3, recorded_tok_s=None, latency_metric="e2e_p95",
        measure=ramp_measure([1.02, 1.03, 0.99]),
    )  # fmt: skip
    assert not two_misses.confirmed and "2 of 3 runs missed e2e_p95<=1.19s" in two_misses.verdict()
