"""`tuner verify` re-tests a trial against the baseline in pairs of fresh servers, started alternately, on a machine
that drifts (each server started later reads 10% less than the one before, whatever its flags): two calls in a row
give the same verdict, where a comparison against the stored record flips with the machine; and on a machine that
does not change but whose starts scatter as widely as the CPU prior says, two calls in a row give the same verdict
class too (not separable for equal flag sets, reproduced for a real gain)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
from study_fakes import FakeLauncher, FakeServer, job

from tuner.config import Job
from tuner.flags import VllmFlags
from tuner.intervals import PRIORS, Noise
from tuner.load import LoadResult, RequestRecord
from tuner.scoring import summarize
from tuner.study import Measurement
from tuner.verify import (
    NOT_REPRODUCED,
    NOT_SEPARABLE,
    REPRODUCED,
    SEPARATED,
    Retest,
    retest_against_baseline,
    verify_flags,
)

TRIAL = VllmFlags(max_num_seqs=64, gpu_memory_utilization=0.9)
BASELINE = VllmFlags()
DRIFT = 0.9


@dataclass
class DriftingMachine:
    """Each start's throughput: its flags' true tok/s x DRIFT ** (servers started before it)."""

    true_tok_s: dict[int | None, float]
    launcher: FakeLauncher = field(default_factory=FakeLauncher)

    async def measure(self, server: FakeServer, j: Job, flags: VllmFlags) -> Measurement:
        tok_s = self.true_tok_s[flags.max_num_seqs] * DRIFT ** (len(self.launcher.launches) - 1)
        records = [
            RequestRecord(
                index=i, start_s=i * 0.01, ttft_s=0.05, itl_s=[0.01] * 31, e2e_s=0.5, prompt_tokens=64,
                completion_tokens=32, ok=True,
            )
            for i in range(40)
        ]  # fmt: skip
        summary = summarize(records, duration_s=40 * 32 / tok_s, slos=j.parsed_slos())
        return Measurement(LoadResult(summary=summary, records=records))


def retested(
    machine: DriftingMachine | NoisyMachine, *, claimed_above: bool | None = True, pairs: int = 3,
    prior: Noise = PRIORS["gpu"].noise,
) -> Retest:  # fmt: skip
    return retest_against_baseline(
        job(), machine.launcher, TRIAL, BASELINE, pairs=pairs, claimed_above=claimed_above,
        latency_metric="e2e_p95", measure=machine.measure, prior=prior,
    )  # fmt: skip


def retest(machine: DriftingMachine, *, claimed_above: bool = True, pairs: int = 3) -> str:
    return retested(machine, claimed_above=claimed_above, pairs=pairs).ranking


def test_the_pairs_alternate_on_fresh_servers() -> None:
    machine = DriftingMachine({64: 1000.0, None: 1000.0})
    r = retested(machine, prior=Noise())
    seqs = [launch["flags"].get("max_num_seqs") for launch in machine.launcher.launches]
    assert seqs == [64, None, None, 64, 64, None]  # T B, B T, T B: one server a run
    assert len(r.pairs) == 3


def test_equal_flag_sets_on_a_drifting_machine_are_not_separable_twice_in_a_row() -> None:
    machine = DriftingMachine({64: 1000.0, None: 1000.0})
    assert [retest(machine), retest(machine)] == [NOT_SEPARABLE, NOT_SEPARABLE]
    # The re-measure against a stored record, on a machine as fresh: the record is its first start's, and by the
    # second call the machine has slowed past the tolerance, so that verdict flips with the machine alone.
    fresh = DriftingMachine({64: 1000.0, None: 1000.0})
    verdicts = [
        verify_flags(
            job(), fresh.launcher, TRIAL, runs=1, recorded_tok_s=1000.0, latency_metric="e2e_p95",
            measure=fresh.measure, tolerance=0.05,
        ).confirmed
        for _ in range(2)
    ]  # fmt: skip
    assert verdicts == [True, False]


def test_a_real_gain_is_reproduced_twice_in_a_row_and_a_reversed_claim_is_not() -> None:
    machine = DriftingMachine({64: 1600.0, None: 1000.0})
    assert [retest(machine), retest(machine)] == [REPRODUCED, REPRODUCED]
    assert retest(machine, claimed_above=False) == NOT_REPRODUCED


def test_one_pair_without_a_prior_is_not_separable_and_says_why() -> None:
    machine = DriftingMachine({64: 1600.0, None: 1000.0})
    r = retested(machine, pairs=1, prior=Noise())
    assert r.ranking == NOT_SEPARABLE and r.verdict() == "not separable: no interval from 1 pair of starts"


def test_the_pairs_table_fits_80_columns_and_the_json_names_each_pair() -> None:
    from rich.console import Console

    from tuner.cli.verify import _pairs_table, _retest_dict
    from tuner.report.views import StudyView, TrialView

    machine = DriftingMachine({64: 1600.0, None: 1000.0})
    r = retested(machine, pairs=2)

    def trial(n: int, tok_s: float) -> TrialView:
        return TrialView(
            number=n, state="COMPLETE", baseline=n == 0, outcome="measured", reason=None, flags={},
            throughput=tok_s, objective_latency_s=0.5,
        )  # fmt: skip

    view = StudyView("night", {}, [trial(0, 1000.0), trial(4, 1600.0)])
    console = Console(width=80, record=True)
    console.print(_pairs_table(view, view.trials[1], view.trials[0], r))
    text = console.export_text()
    assert "#4 then #0" in text and "#0 then #4" in text and "95% CI" in text
    assert max(len(line) for line in text.splitlines()) <= 80
    doc = _retest_dict(view, view.trials[1], view.trials[0], r)
    assert doc["ranking"] == REPRODUCED and [p["trial_first"] for p in doc["pairs"]] == [True, False]


def test_the_study_s_claim_is_its_confirmation_not_its_point_figures() -> None:
    from tuner.verify import study_claim

    confirm = {
        "leader": 3,
        "beats_baseline": False,
        "paired": {"0-3": {"difference": [-0.3, -0.6, 0.2]}, "5-0": {"difference": [0.25, 0.1, 0.4]}},
    }
    assert study_claim(confirm, 3, 0) is None  # the leader, not separated from the baseline
    assert study_claim({**confirm, "beats_baseline": True}, 3, 0) is True
    assert study_claim(confirm, 5, 0) is True  # "5-0" holds #5 / #0 - 1, its interval above zero
    flipped = {"paired": {"0-5": {"difference": [0.25, 0.1, 0.4]}}}
    assert study_claim(flipped, 5, 0) is False  # the baseline above #5
    assert study_claim(confirm, 7, 0) is None  # never paired: no claim


def test_two_the_study_could_not_separate_hold_when_the_re_test_cannot_either() -> None:
    same = DriftingMachine({64: 1000.0, None: 1000.0})
    r = retested(same, claimed_above=None, prior=PRIORS["cpu"].noise)
    assert r.ranking == NOT_SEPARABLE and r.held and r.verdict().endswith("within the noise, as the study said")
    apart = DriftingMachine({64: 1000.0, None: 2000.0})
    r = retested(apart, claimed_above=None, prior=PRIORS["cpu"].noise)
    assert r.ranking == SEPARATED and not r.held
    assert "could not separate the trial from the baseline; re-tested below it by -4" in r.verdict()  # 2x, drifting


@dataclass
class NoisyMachine:
    """An unchanged machine whose starts scatter: each start's throughput its flags' true tok/s x a log-normal draw
    as wide as the CPU build's stated prior (14% between starts), from a seeded generator."""

    true_tok_s: dict[int | None, float]
    seed: int
    launcher: FakeLauncher = field(default_factory=FakeLauncher)

    def __post_init__(self) -> None:
        self.draw = random.Random(self.seed)

    async def measure(self, server: FakeServer, j: Job, flags: VllmFlags) -> Measurement:
        spread = math.sqrt(PRIORS["cpu"].noise.log_var)
        tok_s = self.true_tok_s[flags.max_num_seqs] * math.exp(self.draw.gauss(0.0, spread))
        records = [
            RequestRecord(
                index=i, start_s=i * 0.01, ttft_s=0.05, itl_s=[0.01] * 31, e2e_s=0.5, prompt_tokens=64,
                completion_tokens=32, ok=True,
            )
            for i in range(40)
        ]  # fmt: skip
        summary = summarize(records, duration_s=40 * 32 / tok_s, slos=j.parsed_slos())
        return Measurement(LoadResult(summary=summary, records=records))


def noisy_retest(machine: NoisyMachine) -> str:
    return retested(machine, prior=PRIORS["cpu"].noise).ranking


@pytest.mark.parametrize("seed", range(5))
def test_a_noisy_unchanged_machine_gives_the_same_verdict_twice_in_a_row(seed: int) -> None:
    # Equal flag sets scatter 14% a start: within the noise both times, never a winner by chance of one call.
    equal = NoisyMachine({64: 1000.0, None: 1000.0}, seed)
    assert [noisy_retest(equal), noisy_retest(equal)] == [NOT_SEPARABLE, NOT_SEPARABLE]
    # A real doubling through the same scatter: reproduced both times.
    better = NoisyMachine({64: 2000.0, None: 1000.0}, seed)
    assert [noisy_retest(better), noisy_retest(better)] == [REPRODUCED, REPRODUCED]
