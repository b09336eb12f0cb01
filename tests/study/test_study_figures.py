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
    attrs |= {"ttft_p95_first_turn_s": 2.0, "queue_p95_s": 3.0}
    record = TrialRecord.from_attrs(attrs)
    # ttft_p90 is a figure (an SLO may have named it): read; a value of the wrong type reads as unknown, as every
    # field does; a name the registry reads as no figure (`ttft_p95_first_turn`, an unknown metric) is not one.
    assert record.latencies == {"e2e_p95": 4.7, "ttft_p95": 2.7, "ttft_p90": 1.0}
    written = record.to_attrs()
    assert (written["e2e_p95_s"], written["ttft_p95_s"], written["tpot_p95_s"]) == (4.7, 2.7, None)
    assert written["ttft_p90_s"] == 1.0 and "latencies" not in written and "queue_p95_s" not in written


def test_the_figures_the_slos_name_are_recorded_without_a_registry_entry() -> None:
    trial = FixedTrial({"max_num_seqs": 16, "gpu_memory_utilization": 0.9})
    slos = ["ttft_p90 <= 60s", "tpot_p99 <= 2s", "success_rate >= 0.5"]
    Objective(job(slos=slos), FakeLauncher(), measure=fake_measure())(trial)
    summary = summarize(records_for(VllmFlags(max_num_seqs=16)), duration_s=10 / 16)
    attrs = trial.user_attrs
    assert attrs["ttft_p90_s"] == pytest.approx(summary.ttft.p90)
    assert attrs["tpot_p99_s"] == pytest.approx(summary.tpot.p99)
    assert attrs["e2e_p95_s"] == pytest.approx(summary.e2e.p95)  # the registry's, whatever the SLOs


def test_a_run_that_served_nothing_records_no_figure() -> None:
    summary = summarize([], duration_s=1.0)
    assert [f.of(summary) for f in scoring.figures()] == [None, None, None]
