"""The morning views of a confirmed study: every figure with its interval, the confirmation's starts folded into
their flag set's row (listed apart in --json, counted apart by `status`)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import optuna
import pytest
from morning_demo import RunCli
from optuna.distributions import CategoricalDistribution
from optuna.trial import create_trial
from rich.console import Console

from tuner.record import MEASURED, TrialRecord
from tuner.report.overview import status
from tuner.report.uncertainty import trial_intervals
from tuner.report.views import study_view
from tuner.scoring import parse_slo
from tuner.study.confirm import Confirmation
from tuner.study.verdict import DIRECTIONS

STUDY = "confirmed"


def measured(seqs: int, tok_s: float, half: float, **extra: Any) -> optuna.trial.FrozenTrial:
    record = TrialRecord(
        flags={"max_num_seqs": seqs},
        outcome=MEASURED,
        output_tok_s=tok_s,
        success_rate=1.0,
        latencies={"ttft_p95": 0.2, "e2e_p95": 2.0},
        feasible=True,
        server_seconds=60.0,
    )
    ci_run = {
        "level": 0.95,
        "output_tok_s": [tok_s, tok_s - half, tok_s + half],
        "success_rate": [1.0, 0.98, 1.0],
        "ttft_p95_s": [0.2, 0.18, 0.23],
        "e2e_p95_s": [2.0, 1.9, 2.1],
    }
    return create_trial(
        params={"max_num_seqs": seqs},
        distributions={"max_num_seqs": CategoricalDistribution([8, 16, 32])},
        values=[tok_s, 2.0],
        user_attrs={**record.to_attrs(), "ci_run": ci_run, **extra},
    )


def build(url: str) -> optuna.Study:
    study = optuna.create_study(study_name=STUDY, storage=url, directions=DIRECTIONS)
    study.set_user_attr("n_trials", 3)
    study.set_user_attr("slos", ["e2e_p95<=5s"])
    study.add_trial(measured(8, 300.0, 10.0, baseline=True))  # 0: the baseline
    study.add_trial(measured(16, 412.0, 12.0))  # 1
    study.add_trial(measured(32, 380.0, 9.0))  # 2
    study.add_trial(measured(8, 320.0, 10.0, baseline=True, repeat_of=0, duplicate_of=0))  # 3: baseline again
    study.add_trial(measured(16, 398.0, 12.0, repeat_of=1, duplicate_of=1))  # 4: #1 again
    study.add_trial(measured(16, 405.0, 11.0, repeat_of=1, duplicate_of=1))  # 5: #1 a third time
    return study


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'confirmed.db'}"
    build(url)
    return url


def test_trials_folds_each_confirmation_start_into_its_flag_sets_row_in_80_columns(
    tuner_cli: RunCli, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    r = tuner_cli("trials", STUDY, "--storage", url)
    assert r.code == 0, r.err
    table = r.out.split("#0ᵇ seqs=8")[0]
    rows = [line for line in table.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["0ᵇ", "1", "2"]  # flag sets, not starts
    assert "3 of 3 trials (+3 confirmation starts)" in r.out
    pooled = study_view(optuna.load_study(study_name=STUDY, storage=url)).trial(1)
    assert pooled is not None and pooled.starts == 3
    assert pooled.throughput_text in rows[1] and "×3" in rows[1]  # its tok/s pooled over #1, #4 and #5
    assert "380 ± 9" in rows[2] and "×" not in rows[2]  # started once: its run's own interval
    assert "#1: started again by #4, #5 to confirm it (3 measured starts)" in r.out
    assert max(len(line) for line in r.out.splitlines()) <= 80
    limited = tuner_cli("trials", STUDY, "--storage", url, "--sort", "throughput", "--limit", "2").out
    shown = [line.split("│")[1].strip() for line in limited.splitlines() if line.startswith("│")]
    assert "2 of 3 trials" in limited and shown == ["1", "2"]  # #4 and #5 do not take a flag set's place


def test_trials_json_and_csv_list_every_start_with_the_trial_it_repeats(tuner_cli: RunCli, url: str) -> None:
    rows = json.loads(tuner_cli("trials", STUDY, "--storage", url, "--json").out)
    assert {r["number"]: r["repeat_of"] for r in rows} == {0: None, 1: None, 2: None, 3: 0, 4: 1, 5: 1}
    assert {r["number"]: r["verdict"] for r in rows}[4] == "#1 started again"
    assert rows[4]["run_intervals"]["output_tok_s"] == [398.0, 386.0, 410.0]
    csv_rows = list(csv.DictReader(io.StringIO(tuner_cli("trials", STUDY, "--storage", url, "--csv").out)))
    assert [(r["number"], r["repeat_of"], r["starts"]) for r in csv_rows][3:] == [
        ("3", "0", "1"),
        ("4", "1", "1"),
        ("5", "1", "1"),
    ]
    assert csv_rows[1]["starts"] == "3" and json.loads(csv_rows[1]["output_tok_s_ci"])[0] == pytest.approx(405, abs=5)


def test_show_gives_each_figure_its_runs_interval_and_its_flag_sets_over_starts(tuner_cli: RunCli, url: str) -> None:
    view = study_view(optuna.load_study(study_name=STUDY, storage=url))
    cis = {ci.name: ci for ci in trial_intervals(view, 4)}  # a confirmation start: its own run, its flag set's starts
    assert set(cis) == {"output_tok_s", "success_rate", "ttft_p95_s", "e2e_p95_s"}
    assert cis["output_tok_s"].run is not None and cis["output_tok_s"].run.as_list() == [386.0, 410.0]
    over = cis["output_tok_s"].starts
    assert over is not None and cis["output_tok_s"].n_starts == 3
    assert 398.0 < over.value < 412.0  # pooled over 412, 398 and 405
    rate = cis["success_rate"].starts
    assert rate is not None and rate.high <= 1.0 and rate.low < 1.0  # pooled on a log scale, kept within 100%
    assert trial_intervals(view, 2)[0].starts is None  # started once: no interval over starts

    r = tuner_cli("show", STUDY, "1", "--storage", url)
    assert r.code == 0, r.err
    assert "its flags over 3 starts" in r.out and "412 ± 12 tok/s" in r.out and view.trial(1) is not None
    line = next(x for x in r.out.splitlines() if "output tok/s" in x)
    assert line.count("±") == 2  # the run's and the starts'
    doc = json.loads(tuner_cli("show", STUDY, "1", "--storage", url, "--json").out)
    by_name = {d["figure"]: d for d in doc["intervals"]}
    assert by_name["e2e_p95_s"]["run"] == [2.0, 1.9, 2.1] and by_name["e2e_p95_s"]["starts"] == 3


def test_show_computes_the_intervals_from_the_requests_of_a_trial_that_kept_none(
    tuner_cli: RunCli, demo_url: str
) -> None:
    r = tuner_cli("show", "demo", "1", "--storage", demo_url)  # the demo study predates `ci_run`
    assert r.code == 0, r.err
    assert "figures, ± their 95% intervals" in r.out
    assert "e2e P95" in r.out and "±" in next(x for x in r.out.splitlines() if "e2e P95" in x and "│" in x)


def test_status_and_studies_count_confirmation_starts_apart_from_the_searchs_trials(
    tuner_cli: RunCli, url: str
) -> None:
    st = status(study_view(optuna.load_study(study_name=STUDY, storage=url)))
    assert (st.finished, st.measured, st.budget, st.state) == (3, 3, 3, "done")
    assert (st.confirmation_starts, st.confirmation_measured, st.confirmation_minutes) == (3, 3, 3.0)
    out = tuner_cli("status", STUDY, "--storage", url).out
    assert "3/3 trials finished (100%)" in out
    assert "confirmation: 3 extra starts of flags already tried (3 measured, 3.0 server-min)" in out
    listed = json.loads(tuner_cli("studies", "--storage", url, "--json").out)
    assert listed[0]["trials"] == 3


def test_the_exports_provenance_gives_each_figure_its_interval(tuner_cli: RunCli, url: str) -> None:
    confirmed = tuner_cli("export", STUDY, "--storage", url, "--trial", "1", "--model", "m").out
    line = next(x for x in confirmed.splitlines() if x.startswith("# measured"))
    assert line.startswith("# measured (± 95% CI over 3 starts): 405 ± ")
    assert "output tok/s" in line and "e2e P95 2.00 ± 0.06 s" in line and "success 100.0 ± " in line
    once = tuner_cli("export", STUDY, "--storage", url, "--trial", "2", "--model", "m").out
    assert "# measured (± 95% CI within the run): 380 ± 9 output tok/s" in once
    doc = json.loads(
        tuner_cli("export", STUDY, "--storage", url, "--trial", "2", "--model", "m", "--format", "json").out
    )
    assert doc["provenance"]["intervals"]["output_tok_s"] == [380.0, 371.0, 389.0]


def test_the_record_keeps_a_starts_trial_and_its_intervals_and_a_sampler_repeat_keeps_neither() -> None:
    attrs = measured(16, 398.0, 12.0, repeat_of=1, duplicate_of=1).user_attrs
    record = TrialRecord.from_attrs(attrs)
    assert record.is_repeat and record.repeat_of == 1
    assert record.intervals()["output_tok_s"] == (398.0, 386.0, 410.0)
    assert TrialRecord.from_attrs(record.to_attrs()) == record
    plain = TrialRecord(flags={"max_num_seqs": 8}).to_attrs()
    assert "repeat_of" not in plain and "ci_run" not in plain  # written only when set, as 0.1.0 wrote nothing
    assert TrialRecord.from_attrs({"ci_run": {"output_tok_s": [1, "x", 3]}}).intervals() == {}


def test_verify_shows_each_run_and_the_record_with_their_intervals(url: str) -> None:
    from tuner.cli.verify import _ranking, _table
    from tuner.intervals import Interval
    from tuner.verify import Verification, VerifyRun

    view = study_view(optuna.load_study(study_name=STUDY, storage=url))
    t = view.trial(1)
    assert t is not None and t.throughput_ci is not None
    runs = [
        VerifyRun(v, 2.0, 1.0, (), figures={"output_tok_s": Interval(v, v - 8.0, v + 8.0)})
        for v in (400.0, 410.0, 404.0)
    ]
    v = Verification(t.throughput_ci[0], "e2e_p95", 0.1, runs)
    console = Console(width=80, record=True)
    console.print(_table(view, t, v))
    console.print(_ranking(view, [(t, v, None)], t))
    text = console.export_text()
    assert "410 ± 8" in text  # a run with its bootstrap over its requests
    recorded = next(line for line in text.splitlines() if line.startswith("│ recorded"))
    assert f"{t.throughput_text} ×3" in recorded  # the record pooled over the flag set's three starts
    ranked = next(line for line in text.splitlines() if line.startswith("│ #1"))
    assert ranked.count("±") == 2  # the record's interval and the runs'
    assert max(len(line) for line in text.splitlines()) <= 80


def test_a_box_flag_set_started_again_stands_at_its_pooled_box_figure(tmp_path: Path) -> None:
    """With `target.gpus`, each start's run measured one replica: pooled, the flag set stands at the box's figure
    (replicas x the replica's), as the confirmation pools it, not at one replica's."""
    study = optuna.create_study(study_name=STUDY, storage=f"sqlite:///{tmp_path / 'box.db'}", directions=DIRECTIONS)
    study.set_user_attr("slos", ["e2e_p95<=5s"])
    for tok_s, extra in ((400.0, {}), (420.0, {"repeat_of": 0, "duplicate_of": 0})):
        one = measured(16, tok_s, 10.0, replicas=4, box_gpus=8, **extra)
        study.add_trial(create_trial(  # the study scores the box: 4 x the replica's tok/s
            params=one.params, distributions=one.distributions, values=[4 * tok_s, 2.0], user_attrs=one.user_attrs
        ))  # fmt: skip
    first = study_view(study).trials[0]
    assert first.starts == 2
    assert 4 * 400.0 < (first.throughput or 0.0) < 4 * 420.0


def test_a_capacity_studys_flag_set_started_again_pools_the_figure_each_start_was_scored_by(tmp_path: Path) -> None:
    """A max_rate trial is scored by its rate's tokens (1,000 and 1,100 tok/s here), not its step's own tok/s (600
    and 640, diluted by the drain): the confirmation and the views pool the scored figures, so a confirmed flag set
    stands beside unconfirmed ones on the same footing."""
    study = optuna.create_study(study_name=STUDY, storage=f"sqlite:///{tmp_path / 'rate.db'}", directions=DIRECTIONS)
    study.set_user_attr("slos", ["e2e_p95<=5s"])
    study.set_user_attr("objective", "max_rate")
    for step_tok_s, scored, extra in ((600.0, 1000.0, {}), (640.0, 1100.0, {"repeat_of": 0, "duplicate_of": 0})):
        one = measured(16, step_tok_s, 10.0, **extra)
        study.add_trial(create_trial(
            params=one.params, distributions=one.distributions, values=[scored, 2.0], user_attrs=one.user_attrs
        ))  # fmt: skip
    first = study_view(study).trials[0]
    assert first.starts == 2 and 1000.0 < (first.throughput or 0.0) < 1100.0
    (group,) = Confirmation.of(study.get_trials(), [parse_slo("e2e_p95<=5s")]).flag_sets
    assert group.throughput is not None and 1000.0 < group.throughput.value < 1100.0
