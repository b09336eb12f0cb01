"""The tune's trial line, its progress bar's best and its front agree: each shows the figure the study compared the
trial by, and the bar's best is a flag set at its figure pooled over its starts, never a confirmation start."""

from __future__ import annotations

import math
from typing import Any

import optuna

from tuner.cli.trial_lines import best_text, trial_line


def add(study: optuna.Study, tok_s: float, seqs: int, **attrs: Any) -> None:
    study.add_trial(
        optuna.trial.create_trial(
            params={"max_num_seqs": seqs},
            distributions={"max_num_seqs": optuna.distributions.CategoricalDistribution([8, 16, 64])},
            values=[tok_s, 1.0],
            user_attrs={"flags": {"max_num_seqs": seqs}, "outcome": "measured", "feasible": True, **attrs},
        )
    )


def test_the_best_is_a_flag_set_at_its_pooled_figure_never_a_confirmation_start() -> None:
    study = optuna.create_study(directions=["maximize", "minimize"])
    add(study, 100.0, 8, baseline=True)  # 0
    add(study, 200.0, 64, output_tok_s=200.0)  # 1
    add(study, 215.0, 16, output_tok_s=215.0)  # 2
    add(study, 260.0, 64, repeat_of=1, duplicate_of=1)  # 3: a lucky confirmation start of #1
    add(study, 205.0, 64, repeat_of=1, duplicate_of=1)  # 4
    pooled = math.exp((math.log(200.0) + math.log(260.0) + math.log(205.0)) / 3)
    assert best_text(study) == f"best feasible: #1 {pooled:.1f} tok/s over 3 starts"
    add(study, 150.0, 64, repeat_of=1, duplicate_of=1)  # 5: now #2's one start leads
    assert best_text(study) == "best feasible: #2 215.0 tok/s"


def test_the_trial_line_shows_the_figure_the_study_compared_it_by() -> None:
    # A box of two replicas: the run measured one (103.2 tok/s), the study compared the box's 206.4.
    study = optuna.create_study(directions=["maximize", "minimize"])
    add(study, 206.4, 64, output_tok_s=103.2, replicas=2)
    line = trial_line(study.trials[0])
    assert "206.4 tok/s" in line and "103.2" not in line
    assert best_text(study) == "best feasible: #0 206.4 tok/s"
