"""The morning shows each throughput with its interval: the run's own over its requests, or the confirmation's
pooled over every start of the flag set (the study's `confirm` attribute)."""

from __future__ import annotations

from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import create_trial
from rich.console import Console

from tuner.record import MEASURED, TrialRecord
from tuner.report.tables import front_table
from tuner.report.views import study_view
from tuner.study.verdict import DIRECTIONS


def measured(number_seqs: int, tok_s: float, ci: list[float] | None, **extra: Any) -> optuna.trial.FrozenTrial:
    record = TrialRecord(flags={"max_num_seqs": number_seqs}, outcome=MEASURED, output_tok_s=tok_s, feasible=True)
    attrs = {**record.to_attrs(), **extra}
    if ci is not None:
        attrs["ci_run"] = {"level": 0.95, "output_tok_s": ci}
    return create_trial(
        params={"max_num_seqs": number_seqs},
        distributions={"max_num_seqs": CategoricalDistribution([8, 16, 32])},
        values=[tok_s, 1.0],
        user_attrs=attrs,
    )


def test_a_trial_shows_its_runs_interval_and_a_confirmed_one_its_pooled_interval() -> None:
    study = optuna.create_study(directions=DIRECTIONS)
    study.add_trial(measured(8, 300.0, [300.0, 290.0, 310.0], baseline=True))
    study.add_trial(measured(16, 412.0, [412.0, 400.0, 424.0]))
    study.add_trial(measured(32, 380.0, None))
    study.set_user_attr(
        "confirm",
        {"flag_sets": {"1": {"starts": [1, 5, 6], "output_tok_s": [405.0, 396.0, 414.0], "status": "met"}}},
    )
    views = {t.number: t for t in study_view(study).trials}
    assert views[0].throughput_text == "300 ± 10"
    assert (views[1].throughput_text, views[1].starts) == ("405 ± 9", 3)  # pooled over its three starts
    assert views[2].throughput_text == "380.0"  # no interval recorded (an older study): the figure alone

    console = Console(width=80, record=True)
    console.print(front_table([views[1], views[2]], views[0], "front"))
    text = console.export_text()
    assert "405 ± 9" in text and "300 ± 10" in text
    assert max(len(line) for line in text.splitlines()) <= 80
