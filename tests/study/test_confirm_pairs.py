"""Intervals honest at two or three starts, on a machine that drifts: each server started later is slower than the
one before, whatever its flags. The contenders' true speeds are equal; only the order of their starts differs.

A A A B B B (every start of one, then every start of the other) puts the drift between them and calls a winner;
the confirmation's pairs (A B, then B A) leave the drift inside each pair, where it cancels, and say "not
separable"."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial
from study_fakes import FakeLauncher, FakeServer

from tuner.config import Job
from tuner.flags import VllmFlags
from tuner.intervals import PRIORS, platform_prior
from tuner.load import LoadResult
from tuner.scoring import Slo
from tuner.study import Measurement
from tuner.study.confirm import CI_RUN_ATTR, PAIR_ATTR, REPEAT_OF, Confirmation, closing_lines, summary_attr

SLO = Slo(metric="e2e_p95", op="<=", threshold=2.0)
DRIFT = 0.9  # each start reads 10% less than the one before it


def drifting(start_index: int, true_tok_s: float = 1000.0) -> float:
    return true_tok_s * DRIFT**start_index


def start(number: int, seqs: int, tok_s: float, **attrs: Any) -> FrozenTrial:
    t = optuna.trial.create_trial(
        params={"max_num_seqs": seqs},
        distributions={"max_num_seqs": optuna.distributions.CategoricalDistribution([8, 16, 32, 64, 256])},
        values=[tok_s, 1.0],
        user_attrs={
            "flags": {"max_num_seqs": seqs},
            "outcome": "measured",
            "output_tok_s": tok_s,
            "feasible": True,
            "constraint_names": ["startup", f"slo:{SLO}"],
            "constraints": [0.0, 0.0],
            CI_RUN_ATTR: {"output_tok_s": [tok_s, tok_s * 0.99, tok_s * 1.01], "e2e_p95_s": [1.0, 0.9, 1.1]},
            **attrs,
        },
    )
    t.number = number
    return t


def repeat(number: int, seqs: int, tok_s: float, first: int, **attrs: Any) -> FrozenTrial:
    return start(number, seqs, tok_s, **{REPEAT_OF: first, "duplicate_of": first, **attrs})


BASE, CAND = 256, 64  # the baseline's and the candidate's max_num_seqs


def test_a_a_b_b_on_a_drifting_machine_calls_a_winner_the_paired_confirmation_does_not() -> None:
    # Every start of the candidate first, then every start of the baseline: the drift lies between them.
    grouped = [
        start(0, CAND, drifting(0)),
        repeat(1, CAND, drifting(1), 0),
        repeat(2, CAND, drifting(2), 0),
        start(3, BASE, drifting(3), baseline=True),
        repeat(4, BASE, drifting(4), 3, baseline=True),
        repeat(5, BASE, drifting(5), 3, baseline=True),
    ]
    said = closing_lines(Confirmation.of(grouped, [SLO]), starts_spent=4, server_seconds=0.0, budget=4)
    assert said[0].startswith("#0 beats the baseline by +")  # wrong: both run at 1,000 tok/s
    # The same two flag sets, their confirmation starts in pairs, the first of each pair alternating.
    paired = [
        start(0, CAND, drifting(0)),
        start(1, BASE, drifting(1), baseline=True),
        repeat(2, CAND, drifting(2), 0, **{PAIR_ATTR: "0-1-0"}),
        repeat(3, BASE, drifting(3), 1, baseline=True, **{PAIR_ATTR: "0-1-0"}),
        repeat(4, BASE, drifting(4), 1, baseline=True, **{PAIR_ATTR: "0-1-1"}),
        repeat(5, CAND, drifting(5), 0, **{PAIR_ATTR: "0-1-1"}),
    ]
    c = Confirmation.of(paired, [SLO])
    lead, base = c.leader, c.baseline
    assert lead is not None and base is not None and lead is not base
    assert sorted(c.pairs(lead, base)) == sorted([(drifting(2), drifting(3)), (drifting(5), drifting(4))])
    said = closing_lines(c, starts_spent=4, server_seconds=0.0, budget=4)
    assert said[0].startswith(f"{lead.label} and the baseline are not separable (")
    assert "2 pairs of starts, one after the other" in said[0]


def test_the_confirmation_starts_its_pairs_alternately() -> None:
    """The decision loop as the study runs it: each step's flag set started (on the drifting machine) and read back."""
    trials = [start(0, BASE, drifting(0, 1000.0), baseline=True), start(1, CAND, drifting(1, 1500.0))]
    order = []
    for _ in range(4):
        step = Confirmation.of(trials, [SLO], platform_prior(cpu=True)).next_step()
        assert step is not None
        g, attrs = step
        true = 1000.0 if g.baseline else 1500.0
        n = len(trials)
        trials.append(
            repeat(n, CAND if not g.baseline else BASE, drifting(n, true), g.number, baseline=g.baseline, **attrs)
        )
        order.append((g.number, attrs[PAIR_ATTR]))
    # Baseline then candidate, then candidate then baseline: A B B A.
    assert order == [(0, "0-1-0"), (1, "0-1-0"), (1, "0-1-1"), (0, "0-1-1")]


def test_a_pair_whose_second_half_did_not_start_is_not_waited_for_again() -> None:
    trials = [start(0, BASE, 1000.0, baseline=True), start(1, CAND, 1500.0)]
    trials.append(repeat(2, BASE, 1000.0, 0, baseline=True, **{PAIR_ATTR: "0-1-0"}))
    failed = repeat(3, CAND, 0.0, 1, **{PAIR_ATTR: "0-1-0"})
    failed.user_attrs["outcome"] = "launch_failed"
    step = Confirmation.of([*trials, failed], [SLO]).next_step()
    assert step is None or step[1].get(PAIR_ATTR) != "0-1-0"


def test_one_start_each_shows_no_interval_and_is_never_a_zero_width_one() -> None:
    """`budget.confirm: 0`: the same figure for both once printed "+0% (95% CI +0..+0%, 1 start each)"."""
    once = [start(0, BASE, 1000.0, baseline=True), start(1, CAND, 1000.0)]
    once[0].user_attrs[CI_RUN_ATTR]["output_tok_s"] = [1000.0, 1000.0, 1000.0]  # a run with no within-run spread
    once[1].user_attrs[CI_RUN_ATTR]["output_tok_s"] = [1000.0, 1000.0, 1000.0]
    # Without a platform prior: nothing to judge one start by, so no interval and not separable.
    text = "\n".join(closing_lines(Confirmation.of(once, [SLO]), starts_spent=0, server_seconds=0.0, budget=0))
    assert "not separable" in text and "no interval from one start" in text and "1 start each" in text
    assert "+0..+0%" not in text and "beats the baseline" not in text
    # With the platform's prior: an interval as wide as the platform's noise, never a point.
    c = Confirmation.of(once, [SLO], platform_prior(cpu=False))
    text = "\n".join(closing_lines(c, starts_spent=0, server_seconds=0.0, budget=0))
    assert "+0..+0%" not in text and "beats the baseline" not in text
    summary = summary_attr(c, [], starts_spent=0, server_seconds=0.0)
    assert summary["prior"]["source"] == PRIORS["gpu"].source


def test_the_leader_shown_alone_from_one_start_says_so() -> None:
    c = Confirmation.of([start(0, CAND, 1234.5)], [SLO], platform_prior(cpu=True))
    line = closing_lines(c, starts_spent=0, server_seconds=0.0, budget=0)[0]
    assert "1,234.5 tok/s, 1 start" in line and "±" not in line


def test_the_front_marks_the_points_not_separable_from_its_leader() -> None:
    from tuner.report.front import separability_line
    from tuner.report.views import StudyView, TrialView

    trials = [
        start(0, BASE, 1000.0, baseline=True),
        start(1, CAND, 1500.0),
        start(2, 32, 1490.0),  # within any noise of #1
        start(3, 16, 400.0),
    ]
    c = Confirmation.of(trials, [SLO], platform_prior(cpu=False))
    attrs = {"confirm": summary_attr(c, [], starts_spent=0, server_seconds=0.0)}

    def point(n: int, tok_s: float) -> TrialView:
        return TrialView(
            number=n, state="COMPLETE", baseline=False, outcome="measured", reason=None, flags={},
            throughput=tok_s, objective_latency_s=1.0, feasible=True,
        )  # fmt: skip

    front = [point(1, 1500.0), point(2, 1490.0)]
    line = separability_line(StudyView("s", attrs, front), front)
    assert line is not None and line.startswith("#1 and #2 are not separable: either will do")
    assert "#3" not in line


def test_a_study_on_a_machine_that_speeds_up_starts_its_pairs_alternately_and_calls_no_winner(tmp_path: Path) -> None:
    """The whole loop (TuningRun, the fake launcher): each server started later reads 5% more than the one before
    (a machine warming up), so the search's later flag sets look better than the baseline, trial 0. The
    candidate's true speed is the baseline's; the confirmation's pairs say so."""
    from test_study_confirm import BASELINE as FAKE_BASELINE
    from test_study_confirm import E2E_S, NoisyServers, confirming_job, run

    @dataclass
    class Warming(NoisyServers):
        async def __call__(self, server: FakeServer, j: Job, flags: VllmFlags) -> Measurement:
            self.tok_s = {**self.tok_s}
            m = await super().__call__(server, j, flags)
            assert m.result is not None and m.result.summary is not None
            factor = 1.05 ** (len(self.starts) - 1)
            s = m.result.summary
            summary = s.model_copy(
                update={"output_throughput": s.output_throughput * factor, "duration_s": s.duration_s / factor}
            )
            return Measurement(LoadResult(summary=summary, records=m.result.records), rate=m.rate)

    tok_s = {FAKE_BASELINE: 1000.0, 8: 300.0, 16: 300.0, 32: 300.0, 64: 1000.0}
    servers = Warming(tok_s, E2E_S, between=0.0)
    lines, study = run(confirming_job(6), f"sqlite:///{tmp_path / 's.db'}", servers, FakeLauncher())
    repeats = [t for t in study.trials if t.user_attrs.get(REPEAT_OF) is not None]
    pairs = [t.user_attrs.get(PAIR_ATTR) for t in repeats]
    assert pairs[:4] == [pairs[0], pairs[0], pairs[2], pairs[2]] and pairs[0] != pairs[2]
    firsts = [t.user_attrs[REPEAT_OF] for t in repeats[:4]]
    assert firsts[0] == firsts[3] and firsts[1] == firsts[2] and firsts[0] != firsts[1]  # A B, then B A
    assert not any("beats the baseline" in line for line in lines), lines
    assert sum("not separable" in line for line in lines) == 1  # said once, in the headline


def test_starts_that_read_exactly_alike_give_no_interval_rather_than_a_point() -> None:
    alike = [
        start(0, BASE, 1000.0, baseline=True),
        repeat(1, BASE, 1000.0, 0, baseline=True),
        start(2, CAND, 1000.0),
        repeat(3, CAND, 1000.0, 2),
    ]
    for t in alike:
        t.user_attrs[CI_RUN_ATTR]["output_tok_s"] = [1000.0, 1000.0, 1000.0]
    c = Confirmation.of(alike, [SLO])
    assert all(g.throughput is not None for g in c.flag_sets)
    by = {g.number: g for g in c.flag_sets}
    assert c.difference(by[2], by[0])[0] is None and not c.separable(by[2], by[0])
    text = "\n".join(closing_lines(c, starts_spent=2, server_seconds=0.0, budget=2))
    assert "± 0.0%" not in text and "+0..+0%" not in text
