"""`tuner calibrate --study` counts the confirmation's starts apart from the search's trials: a flag set started
again is fitted once, by its first trial, and the summary says how many starts it left out."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import create_trial

from tuner.calibration.trials import NO_RECORDS, StudyTrials, read_trials
from tuner.catalog import load_model
from tuner.catalog.gpus import get_gpu
from tuner.record import MEASURED, TrialRecord
from tuner.store import open_store
from tuner.study.verdict import DIRECTIONS


def trial(seqs: int, **extra: object) -> optuna.trial.FrozenTrial:
    record = TrialRecord(flags={"max_num_seqs": seqs}, outcome=MEASURED, output_tok_s=100.0, feasible=True)
    return create_trial(
        params={"max_num_seqs": seqs},
        distributions={"max_num_seqs": CategoricalDistribution([8, 16])},
        values=[100.0, 1.0],
        user_attrs={**record.to_attrs(), **extra},
    )


def test_confirmation_starts_are_counted_apart_and_left_out_of_the_fit(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    open_store(url).close()  # the project's tables, as `tuner tune` creates them
    study = optuna.create_study(study_name="s", storage=url, directions=DIRECTIONS)
    study.set_user_attr("job", {"arrival": {"concurrency": 4, "requests": 8}, "target": {"model": "llama-3.1-8b"}})
    study.add_trial(trial(8, baseline=True))
    study.add_trial(trial(16))
    study.add_trial(trial(8, baseline=True, repeat_of=0, duplicate_of=0))
    study.add_trial(trial(16, repeat_of=1, duplicate_of=1))
    study.add_trial(trial(16, repeat_of=1, duplicate_of=1))

    found = read_trials(study, url, device=get_gpu("h100-80gb"), model=load_model("llama-3.1-8b"))
    assert (found.total, found.confirmation_starts) == (2, 3)
    assert found.skipped[NO_RECORDS] == 2  # the search's two trials, no requests stored here; no start among them
    assert found.summary() == (
        "0 of 2 trials measured in full (2 without per-request records left out); "
        "3 confirmation starts of flags already fitted left out"
    )


def test_a_study_without_confirmation_starts_reads_as_before() -> None:
    found = StudyTrials("s", "m", get_gpu("h100-80gb"), [], {NO_RECORDS: 1}, 4)
    assert found.summary() == "0 of 4 trials measured in full (1 without per-request records left out)"
