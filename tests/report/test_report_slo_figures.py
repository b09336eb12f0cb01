"""A study judged on `ttft_p90` and `tpot_p95` shows those figures: the study records them (`Scorer.record`), and
`tuner trials` (narrow and wide), its CSV and JSON, and the front print them, the registry's TTFT and e2e P95 after
them where they fit in 80 columns. Before, such a study showed TTFT P95 and e2e P95 only: the figure its verdicts
were made on was nowhere in the table."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

import optuna
import pytest
from optuna.distributions import IntDistribution

from tests.conftest import run_main
from tuner.catalog import load_model, resolve_gpu
from tuner.flags import VllmFlags
from tuner.load.results import LoadResult, RequestRecord
from tuner.record import TrialRecord
from tuner.scoring import parse_slo, summarize
from tuner.study.measure import Measurement
from tuner.study.trial import TrialResult
from tuner.study.verdict import Scorer

STUDY = "p90"
SLOS = [parse_slo(s) for s in ("ttft_p90<=2s", "tpot_p95<=40ms", "success_rate>=0.99")]
DURATION_S = 10.0
SEQS = {0: 256, 1: 64, 2: 128, 3: 32}  # trial number: max_num_seqs (0, the baseline, vLLM's default)
SCALE = {0: 1.0, 1: 0.6, 2: 0.8, 3: 1.4}  # how slow each trial's requests are


def records(scale: float) -> list[RequestRecord]:
    """20 requests whose TTFT and TPOT rise steadily, so the P90 and the P95 of each differ."""
    out = []
    for i in range(20):
        ttft, tpot = scale * 0.1 * (i + 1), scale * 0.001 * (i + 1)
        out.append(
            RequestRecord(
                index=i, start_s=i * 0.4, ttft_s=ttft, itl_s=[tpot] * 32, e2e_s=ttft + 32 * tpot,
                prompt_tokens=128, completion_tokens=33, ok=True,
            )
        )  # fmt: skip
    return out


def scorer() -> Scorer:
    return Scorer(SLOS, "e2e_p95", 60.0, resolve_gpu("h100-80gb"), load_model("llama-3.1-8b"))


def scored(number: int) -> tuple[TrialRecord, tuple[float, float], dict[str, float]]:
    """Trial `number` as the study scores and records it."""
    recs = records(SCALE[number])
    summary = summarize(recs, duration_s=DURATION_S, slos=SLOS)
    result = TrialResult(
        outcome="measured",
        flags=VllmFlags(max_num_seqs=SEQS[number]),
        measurement=Measurement(LoadResult(summary=summary, records=recs)),
    )
    values, constraints = scorer().values_and_constraints(result)
    known = TrialRecord(flags={"max_num_seqs": SEQS[number]}, baseline=number == 0)
    return scorer().record(result, constraints, known), values, constraints


def figure(number: int, metric: str, stat: str) -> float:
    return getattr(summarize(records(SCALE[number]), duration_s=DURATION_S), metric).stat(stat)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A study as `tuner tune` writes it, its SLOs `ttft_p90<=2s` and `tpot_p95<=40ms`, e2e_p95 minimised."""
    url = f"sqlite:///{tmp_path_factory.mktemp('slo-figures') / 'p90.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(url)
    study = optuna.create_study(study_name=STUDY, storage=storage, directions=["maximize", "minimize"])
    for key, value in {"slos": [str(s) for s in SLOS], "objective": "throughput", "gpu": "h100-80gb"}.items():
        study.set_user_attr(key, value)
    for number in SEQS:
        record, values, constraints = scored(number)
        study.add_trial(
            optuna.trial.create_trial(
                params={"max_num_seqs": SEQS[number]},
                distributions={"max_num_seqs": IntDistribution(8, 1024, log=True)},
                values=list(values),
                constraints=constraints,
                user_attrs=record.to_attrs(),
            )
        )
    storage.engine.dispose()
    return url


def tuner(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, url: str, *args: str, columns: int = 80
) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    code, out, err = run_main([*args, "--storage", url], capsys, monkeypatch)
    assert code == 0, err
    return out


def header(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("┃"))


def rows(out: str) -> list[list[str]]:
    """The body rows of the Rich tables in `out`, cells stripped."""
    return [
        [c.strip() for c in line.strip().strip("│").split("│")] for line in out.splitlines() if line.startswith("│")
    ]


def cells(out: str, number: int, column: int = 0) -> list[str]:
    """Trial `number`'s row: the one whose `column` holds its number."""
    row = next((r for r in rows(out) if len(r) > column and r[column].rstrip("ᵇ") == str(number)), None)
    assert row is not None, f"no row #{number} in\n{out}"
    return row


def test_the_study_records_the_figures_its_slos_name() -> None:
    record, _, _ = scored(1)
    assert record.latencies["ttft_p90"] == pytest.approx(figure(1, "ttft", "p90"))
    assert record.latencies["tpot_p95"] == pytest.approx(figure(1, "tpot", "p95"))
    assert record.latencies["ttft_p90"] != pytest.approx(record.latencies["ttft_p95"])  # they tell apart
    attrs = record.to_attrs()
    assert attrs["ttft_p90_s"] == record.latencies["ttft_p90"]  # stored flat, as the registry's are
    assert {"ttft_p95_s", "e2e_p95_s", "tpot_p95_s"} <= set(attrs)
    assert TrialRecord.from_attrs(attrs).latencies == record.latencies
    # `ttft_p95_first_turn_s` ends in `_s` but names no statistic: not read as a figure
    assert "ttft_p95_first_turn" not in TrialRecord.from_attrs({**attrs, "ttft_p95_first_turn_s": 1.0}).latencies


def test_trials_shows_them_first_in_80_columns_then_what_fits(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tuner(capsys, monkeypatch, url, "trials", STUDY)
    assert all(len(line) <= 80 for line in out.splitlines()) and "…" not in out, out
    head = header(out)
    assert "TTFT P90" in head and "TPOT P95" in head, head
    assert head.index("TTFT P90") < head.index("TPOT P95")  # by metric as the registry lists them
    for number in SEQS:
        row = cells(out, number)
        assert f"{figure(number, 'ttft', 'p90'):.3f} s" in row and f"{figure(number, 'tpot', 'p95'):.3f} s" in row
    ordered = tuner(capsys, monkeypatch, url, "trials", STUDY, "--sort", "ttft_p90")
    assert [r[0].rstrip("ᵇ") for r in rows(ordered) if r[0][:1].isdigit()] == ["1", "2", "0", "3"]


def test_wide_trials_show_every_figure(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    head = header(tuner(capsys, monkeypatch, url, "trials", STUDY, "--wide", columns=240))
    labels = [label for label in ("TTFT P90", "TTFT P95", "TPOT P95", "e2e P95") if label in head]
    assert labels == ["TTFT P90", "TTFT P95", "TPOT P95", "e2e P95"], head
    assert sorted(labels, key=head.index) == labels


def test_the_csv_and_json_carry_them(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tuner(capsys, monkeypatch, url, "trials", STUDY, "--csv")
    fields = out.splitlines()[0].split(",")
    assert fields[-1] == "ttft_p90_s"  # appended: scripts read tuner 0.1's columns by place
    assert fields[11:14] == ["ttft_p95_s", "e2e_p95_s", "tpot_p95_s"]
    by_number = {r["number"]: r for r in csv.DictReader(io.StringIO(out))}
    assert float(by_number["3"]["ttft_p90_s"]) == pytest.approx(figure(3, "ttft", "p90"))
    doc: list[dict[str, Any]] = json.loads(tuner(capsys, monkeypatch, url, "trials", STUDY, "--json"))
    assert next(t for t in doc if t["number"] == 2)["ttft_p90_s"] == pytest.approx(figure(2, "ttft", "p90"))


def test_the_front_shows_them_as_far_as_they_fit(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every point of the front met the SLOs: their figures come first, while the narrow table cuts nothing (its
    pick and ratios are what it is read for); --wide has them all."""
    out = tuner(capsys, monkeypatch, url, "pareto", STUDY, "--no-plot")
    assert all(len(line) <= 80 for line in out.splitlines()) and "…" not in out, out
    head = header(out)
    assert "TTFT P90" in head and "TTFT P95" not in head, head  # the SLOs' before the registry's
    row = cells(out, 1, column=1)  # the front: trial 1 dominates (the same tok/s, the fastest)
    assert f"{figure(1, 'ttft', 'p90'):.3f} s" in row
    wide = tuner(capsys, monkeypatch, url, "pareto", STUDY, "--no-plot", "--wide", columns=240)
    assert "TTFT P90" in header(wide) and "TPOT P95" in header(wide), wide
    assert f"{figure(1, 'tpot', 'p95'):.3f} s" in cells(wide, 1, column=1)
