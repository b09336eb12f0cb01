"""A study database written by an earlier release opens in every morning command that reads it.

tests/data/study-0.1.0-693ac3b.db was written by `tuner tune` at commit 693ac3b (tuner 0.1.0, before the trial record
and the study package) from tests/data/olddb-throughput.yaml and tests/data/olddb-maxrate.yaml: study
"old-throughput" (3 trials skipped as infeasible, 3 measured, 1 duplicate) and "old-max-rate" (2 failed starts,
4 measured by a capacity search). The values asserted here are the ones that release printed.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import pytest
from morning_demo import RunCli

OLD_DB = Path(__file__).parent.parent / "data" / "study-0.1.0-693ac3b.db"


@pytest.fixture
def old_url(tmp_path: Path) -> str:
    # A copy: opening the store may migrate our own tables, and the committed file must stay as that release left it.
    copy = tmp_path / "old.db"
    shutil.copyfile(OLD_DB, copy)
    return f"sqlite:///{copy}"


def _rows(cli: RunCli, study: str, url: str) -> dict[int, dict[str, str]]:
    r = cli("trials", study, "--storage", url, "--csv")
    assert r.code == 0, r.err
    return {int(row["number"]): row for row in csv.DictReader(io.StringIO(r.out))}


def test_trials_reads_every_outcome(tuner_cli: RunCli, old_url: str) -> None:
    rows = _rows(tuner_cli, "old-throughput", old_url)
    assert [rows[n]["outcome"] for n in range(7)] == ["skipped_infeasible"] * 3 + ["measured"] * 4
    assert rows[0]["baseline"] == "True" and rows[0]["reason"] == "kv_cache_too_small"
    assert rows[0]["verdict"] == "skipped: kv_cache_too_small" and rows[0]["latency_p95_s"] == "60.0"
    assert float(rows[3]["output_tok_s"]) == pytest.approx(97.02277038517306)
    assert float(rows[3]["e2e_p95_s"]) == pytest.approx(4.7181646199995155)
    assert float(rows[3]["request_rate"]) == pytest.approx(3.031961574536658)
    assert rows[4]["verdict"] == "duplicate of #3" and rows[4]["server_seconds"] == "0.0"
    assert rows[3]["diagnosis"] == "no saturation: 0 running max, KV 0% max, no queue"
    rates = _rows(tuner_cli, "old-max-rate", old_url)
    assert [rates[n]["outcome"] for n in range(6)] == ["launch_failed"] * 2 + ["measured"] * 4
    assert rates[1]["verdict"] == "launch failed: kv_cache_too_small"
    assert float(rates[2]["request_rate"]) == pytest.approx(9.04, abs=0.01)


def test_show_reads_facts_prediction_and_load(tuner_cli: RunCli, old_url: str) -> None:
    r = tuner_cli("show", "old-throughput", "3", "--storage", old_url)
    assert r.code == 0, r.err
    assert "KV tokens: predicted 30,976, measured 30,976" in r.out
    assert "24/24 ok (100.0%)" in r.out and "97.0 output tok/s" in r.out
    assert "constraints (<= 0 met): startup +0.000, e2e_p95<=45s -0.895, success_rate>=0.99 -0.010" in r.out
    failed = tuner_cli("show", "old-max-rate", "1", "--storage", old_url)
    assert failed.code == 0, failed.err
    assert "launch failed: kv_cache_too_small" in failed.out and "estimated maximum model length is 38000" in failed.out
    assert "KV tokens: predicted 38,000, measured 38,000" in failed.out
    skipped = tuner_cli("show", "old-throughput", "0", "--storage", old_url)
    assert skipped.code == 0, skipped.err
    assert "kv_cache_too_small" in skipped.out


def test_pareto_and_status(tuner_cli: RunCli, old_url: str) -> None:
    r = tuner_cli("pareto", "old-max-rate", "--storage", old_url)
    assert r.code == 0, r.err
    assert "feasible front, 1 of 4 measured trials (latency = e2e_p95)" in r.out
    assert "export it: tuner export old-max-rate --trial 2 --format docker" in r.out
    s = tuner_cli("status", "old-throughput", "--storage", old_url)
    assert s.code == 0, s.err
    assert "best so far: trial 3: 97.0 tok/s, P95 4.718 s" in s.out
    assert "skipped as infeasible before launch: 3 (kv_cache_too_small 3)" in s.out


def test_export_and_rescore(tuner_cli: RunCli, old_url: str) -> None:
    r = tuner_cli("export", "old-max-rate", "--storage", old_url, "-f", "json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert doc["flags"] == {"max_num_seqs": 32, "max_model_len": 4096, "gpu_memory_utilization": 0.9}
    assert doc["provenance"]["trial"] == 2 and doc["provenance"]["output_tok_s"] == pytest.approx(105.20385527753596)
    assert doc["provenance"]["e2e_p95_s"] == pytest.approx(2.499589075001495)
    args = tuner_cli("export", "old-throughput", "--storage", old_url, "-f", "vllm-args")
    assert args.code == 0, args.err
    assert "# measured: 97.0 output tok/s, latency P95 4.718 s, TTFT P95 2.720 s, e2e P95 4.718 s" in args.out
    re = tuner_cli("rescore", "old-max-rate", "--storage", old_url, "--slo", "e2e_p95<=4s")
    assert re.code == 0, re.err
    assert "feasible: 4 → 4 trials (nothing written to the study)" in re.out
