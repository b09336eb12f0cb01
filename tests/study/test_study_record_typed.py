"""The study's own attributes read through one typed record, leniently: what tuner wrote reads back whole, an odd
attribute reads as unknown without hiding the rest, and a study written by hand reads as far as it goes."""

from __future__ import annotations

from study_fakes import job

from tuner.record import StudyRecord
from tuner.study import study_attrs


def test_what_the_study_writes_reads_back_typed() -> None:
    j = job()
    record = StudyRecord.from_attrs(study_attrs(j))
    assert (record.gpu, record.model, record.launcher) == ("l4", "llama-3.1-8b", "emulator")
    assert record.slos == list(j.slos) and record.n_trials == j.budget.n_trials
    assert record.gpu_profile is not None and record.gpu_profile["key"] == j.gpu_profile().key
    assert record.stored_job.target.launcher == "emulator"


def test_an_odd_attribute_reads_as_unknown_and_hides_nothing_else() -> None:
    record = StudyRecord.from_attrs(
        {"model": "m", "n_trials": "many", "slos": "e2e_p95 <= 5s", "twin_fallback": {"after": 4, "why": "x"}}
    )
    assert record.model == "m" and record.n_trials is None and record.slos == []
    assert record.twin_fallback == {"after": 4, "why": "x"}
    assert StudyRecord.from_attrs({}) == StudyRecord()
