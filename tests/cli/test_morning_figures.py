"""A latency figure added to the registry (`ttft_p90`) shows in every morning output without another line of code:
the trials table, its CSV and JSON, the rescore, and an export's provenance."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from morning_demo import DURATION_S, SPECS, STUDY, RunCli, build_demo_study, records_for
from test_morning_cli import table_rows

from tuner import scoring
from tuner.scoring import Figure, summarize

P90 = Figure("ttft", "p90")


@pytest.fixture
def p90_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The demo study written while the registry holds a TTFT P90 (the study records every registered figure)."""
    monkeypatch.setattr(scoring, "FIGURES", (*scoring.FIGURES, P90))
    return build_demo_study(tmp_path / "p90.db")


def ttft_p90(number: int) -> float:
    spec = next(s for s in SPECS if s.number == number)
    return summarize(records_for(spec), duration_s=DURATION_S).ttft.p90


def test_the_trials_table_csv_and_json_show_it(tuner_cli: RunCli, p90_url: str) -> None:
    assert ttft_p90(9) != pytest.approx(ttft_p90(4))  # the figure tells the trials apart
    # a figure every trial records is a column where it fits: in the narrow table after the SLOs' and the
    # registry's first ones (tests/report/test_report_slo_figures.py), in the wide one always
    r = tuner_cli("trials", STUDY, "--storage", p90_url, "--wide")
    assert r.code == 0, r.err
    header = next(line for line in r.out.splitlines() if "tok/s" in line)
    assert "TTFT P95" in header and "TTFT P90" in header
    rows = {row[0].rstrip("ᵇ"): row for row in table_rows(r.out) if row[0].rstrip("ᵇ").isdigit()}
    assert f"{ttft_p90(9):.3f} s" in rows["9"] and f"{ttft_p90(4):.3f} s" in rows["4"]
    assert "—" in rows["3"]  # a failed launch measured nothing
    out = tuner_cli("trials", STUDY, "--storage", p90_url, "--csv").out
    by_number = {r["number"]: r for r in csv.DictReader(io.StringIO(out))}
    assert float(by_number["9"]["ttft_p90_s"]) == pytest.approx(ttft_p90(9)) and by_number["3"]["ttft_p90_s"] == ""
    doc = json.loads(tuner_cli("trials", STUDY, "--storage", p90_url, "--json").out)
    assert next(t for t in doc if t["number"] == 9)["ttft_p90_s"] == pytest.approx(ttft_p90(9))


def test_rescore_recomputes_it_from_the_records(tuner_cli: RunCli, p90_url: str) -> None:
    r = tuner_cli("rescore", STUDY, "--storage", p90_url, "--slo", "ttft_p90<=0.2s", "--json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    by_number = {t["number"]: t for t in doc["trials"]}
    assert by_number[9]["ttft_p90_s"] == pytest.approx(ttft_p90(9))
    assert by_number[9]["feasible_after"] is (ttft_p90(9) <= 0.2)


def test_the_export_provenance_quotes_it(tuner_cli: RunCli, p90_url: str) -> None:
    r = tuner_cli("export", STUDY, "--storage", p90_url, "--trial", "9", "-f", "vllm-args")
    assert r.code == 0, r.err
    measured = next(line for line in r.out.splitlines() if line.startswith("# measured:"))
    assert f"TTFT P90 {ttft_p90(9):.3f} s" in measured and "latency P95 4.800 s" in measured
    doc = json.loads(tuner_cli("export", STUDY, "--storage", p90_url, "--trial", "9", "-f", "json").out)
    assert doc["provenance"]["ttft_p90_s"] == pytest.approx(ttft_p90(9))
    assert doc["provenance"]["latency_metric"] == "e2e_p95"


def test_without_it_the_outputs_are_as_before(tuner_cli: RunCli, demo_url: str) -> None:
    r = tuner_cli("trials", STUDY, "--storage", demo_url, "--csv")
    header = r.out.splitlines()[0].split(",")
    assert "ttft_p90_s" not in header
    row = next(csv.DictReader(io.StringIO(r.out)))
    assert row["objective_latency_s"] == row["latency_p95_s"] == row["e2e_p95_s"] != ""  # the demo minimises e2e_p95
    assert header[6:14] == [
        "throughput",
        "objective_latency_s",
        "latency_p95_s",
        "output_tok_s",
        "request_rate",
        "ttft_p95_s",
        "e2e_p95_s",
        "tpot_p95_s",
    ]
