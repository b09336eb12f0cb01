"""The figures a trial records come from the registry: one registered is written, stored flat, and read back."""

from __future__ import annotations

import pytest
from optuna.trial import FixedTrial
from study_fakes import FakeLauncher, fake_measure, job, records_for

from tuner import scoring
from tuner.flags import VllmFlags
from tuner.record import TrialRecord
from tuner.scoring import Figure, summarize
from tuner.study import Objective


def test_a_registered_figure_is_written_flat_and_read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scoring, "FIGURES", (*scoring.FIGURES, Figure("ttft", "p90")))
    trial = FixedTrial({"max_num_seqs": 16, "gpu_memory_utilization": 0.9})
    Objective(job(), FakeLauncher(), measure=fake_measure())(trial)
    summary = summarize(records_for(VllmFlags(max_num_seqs=16)), duration_s=10 / 16)
    attrs = trial.user_attrs
    assert attrs["ttft_p90_s"] == pytest.approx(summary.ttft.p90)
    assert attrs["e2e_p95_s"] == pytest.approx(summary.e2e.p95) and "latencies" not in attrs
    expected = {"ttft_p90": summary.ttft.p90, "ttft_p95": summary.ttft.p95, "e2e_p95": summary.e2e.p95}
    assert TrialRecord.from_attrs(attrs).latencies == pytest.approx(expected | {"tpot_p95": summary.tpot.p95})


def test_a_record_of_tuner_0_1_reads_its_figures_under_their_old_names() -> None:
    attrs = {"outcome": "measured", "e2e_p95_s": 4.7, "ttft_p95_s": 2.7, "tpot_p95_s": "n/a", "ttft_p90_s": 1.0}
    record = TrialRecord.from_attrs(attrs)
    # ttft_p90 is not registered: not read; a value of the wrong type reads as unknown, as every field does.
    assert record.latencies == {"e2e_p95": 4.7, "ttft_p95": 2.7}
    written = record.to_attrs()
    assert (written["e2e_p95_s"], written["ttft_p95_s"], written["tpot_p95_s"]) == (4.7, 2.7, None)
    assert "ttft_p90_s" not in written and "latencies" not in written


def test_a_run_that_served_nothing_records_no_figure() -> None:
    summary = summarize([], duration_s=1.0)
    assert [f.of(summary) for f in scoring.figures()] == [None, None, None]
