"""End to end: a small study actually run by `tuner tune` on the emulator, then every morning command on it."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from morning_demo import RunCli

from tuner.emulator.server import VLLM_VERSION as EMULATED_VLLM
from tuner.flags import VllmFlags
from tuner.store import open_store

pytestmark = pytest.mark.slow

NAME = "morning-e2e"
JOB = {
    "study": {"name": NAME, "heartbeat_interval": 5, "grace_period": 20},
    "target": {"launcher": "emulator", "model": "llama-3.1-8b", "gpu": "l4", "emulator": {"time_scale": 50}},
    "space": {
        "max_num_seqs": {"choices": [4, 16, 64]},
        "max_num_batched_tokens": {"choices": [512, 2048]},
        "gpu_memory_utilization": {"low": 0.86, "high": 0.98, "step": 0.06},
        "max_model_len": 2048,
    },
    "workload": {"input_len": 256, "output_len": 32, "seed": 1},
    "arrival": {"concurrency": 16, "requests": 24},
    # Loose on purpose: emulated seconds are wall seconds x 50, so a busy machine inflates them; the SLO-sensitive
    # checks below take their thresholds from the stored records.
    "slos": ["e2e_p95 <= 300s", "success_rate >= 0.99"],
    "objective": "throughput",
    "request_timeout": "600s",
    "budget": {"n_trials": 4, "confirm": 0},
    "sampler": {"name": "tpe", "seed": 3, "n_startup_trials": 3},
}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(job file, storage URL) of a finished 4-trial study on the emulator (about 10 s)."""
    folder = tmp_path_factory.mktemp("e2e")
    job = folder / "job.yaml"
    job.write_text(yaml.safe_dump(JOB))
    done = subprocess.run(
        [sys.executable, "-m", "tuner", "tune", str(job)],
        capture_output=True,
        text=True,
        timeout=180,
        env={k: v for k, v in os.environ.items() if not k.startswith("TUNER_STORAGE")} | {"COLUMNS": "200"},
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return job, f"sqlite:///{folder / (NAME + '.db')}"


def _optuna_front(url: str) -> tuple[list[int], dict[int, dict[str, object]]]:
    storage = optuna.storages.RDBStorage(url)
    try:
        study = optuna.load_study(study_name=NAME, storage=storage)
        return sorted(t.number for t in study.best_trials), {t.number: t.user_attrs for t in study.trials}
    finally:
        storage.engine.dispose()


def test_status_and_trials_of_a_real_run(tuner_cli: RunCli, tuned: tuple[Path, str]) -> None:
    job, url = tuned
    st = json.loads(tuner_cli("status", "--job", job, "--json").out)
    # A sampler's repeat is answered from the first trial and counted apart: 4 distinct flag sets, maybe a repeat more.
    assert (st["state"], st["budget"], st["finished"]) == ("done", 4, 4)
    trials = json.loads(tuner_cli("trials", NAME, "--storage", url, "--json").out)
    apart = st["repeats"] + st["interrupted"] + st["confirmation_starts"]
    assert len(trials) == st["finished"] + apart and trials[0]["baseline"] is True
    assert sum(t.get("duplicate_of") is None for t in trials) == 4
    for t in trials:
        if t["outcome"] == "measured":
            assert t["throughput"] > 0 and t["e2e_p95_s"] > 0 and t["success_rate"] == 1.0


def test_pareto_is_optunas_feasible_front(tuner_cli: RunCli, tuned: tuple[Path, str], tmp_path: Path) -> None:
    _, url = tuned
    html, png = tmp_path / "f.html", tmp_path / "f.png"
    doc = json.loads(tuner_cli("pareto", NAME, "--storage", url, "--json", "--html", html, "--png", png).out)
    optuna_front, attrs = _optuna_front(url)
    # a duplicate (the same flags, values copied from the trial that ran them) is no point of its own here
    originals = [n for n in optuna_front if attrs[n].get("duplicate_of") is None]
    assert sorted(t["number"] for t in doc["front"]) == originals
    assert optuna_front, "the demo job is meant to have a feasible trial"
    assert "Plotly.newPlot" in html.read_text() and png.read_bytes()[:4] == b"\x89PNG"
    text = tuner_cli("pareto", NAME, "--storage", url).out
    assert "throughput vs latency P95" in text and "baseline" in text


def test_show_has_the_stored_detail(tuner_cli: RunCli, tuned: tuple[Path, str]) -> None:
    _, url = tuned
    r = tuner_cli("show", NAME, "0", "--storage", url)
    assert r.code == 0, r.err
    assert "baseline" in r.out and "p99" in r.out and "start-up facts" in r.out
    assert "Application startup complete" in r.out or "Uvicorn running" in r.out
    assert f"vLLM version: {EMULATED_VLLM}" in r.out  # read from the server's /version, stored with the trial
    doc = json.loads(tuner_cli("show", NAME, "0", "--storage", url, "--json").out)
    assert doc["detail"]["load_summary"]["requests_sent"] == 24


def test_export_round_trips_to_the_winners_flags(tuner_cli: RunCli, tuned: tuple[Path, str]) -> None:
    _, url = tuned
    doc = json.loads(tuner_cli("pareto", NAME, "--storage", url, "--json").out)
    winner = doc["picks"]["throughput"]["trial"]
    _, attrs = _optuna_front(url)
    stored = VllmFlags.from_dict(attrs[winner]["flags"])  # type: ignore[arg-type]
    words = shlex.split(tuner_cli("export", NAME, "--storage", url).out, comments=True)
    assert words[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    assert words[3:] == stored.to_args()
    docker = tuner_cli("export", NAME, "--storage", url, "-f", "docker").out
    # vLLM's image of the version the trial measured: the one the emulator imitates (it says so on /version)
    assert f"vllm/vllm-openai:v{EMULATED_VLLM} \\\n" in docker
    deployment, _ = yaml.safe_load_all(tuner_cli("export", NAME, "--storage", url, "-f", "kubernetes").out)
    assert deployment["spec"]["template"]["spec"]["containers"][0]["args"][2:] == stored.to_args()


def _p95(values: list[float]) -> float:
    v = sorted(values)
    pos = 0.95 * (len(v) - 1)
    return v[math.floor(pos)] + (v[math.ceil(pos)] - v[math.floor(pos)]) * (pos - math.floor(pos))


def test_rescore_a_real_run_against_its_records(tuner_cli: RunCli, tuned: tuple[Path, str]) -> None:
    _, url = tuned
    with open_store(url, migrate=False) as store:
        p95 = {
            n: _p95([r.e2e_s for r in recs if r.ok and not r.warmup])
            for n in range(4)
            if (recs := store.request_records(NAME, n)) and all(r.ok for r in recs if not r.warmup)
        }
    assert p95, "no trial was measured"
    # Just above the lowest P95: only the fastest trial(s) stay feasible.
    threshold = min(p95.values()) * 1.001
    doc = json.loads(tuner_cli("rescore", NAME, "--storage", url, "--slo", f"e2e_p95<={threshold}s", "--json").out)
    after = {t["number"] for t in doc["trials"] if t["feasible_after"]}
    meets = {n for n, v in p95.items() if v <= threshold}
    _, attrs = _optuna_front(url)
    copies = {n for n, a in attrs.items() if a.get("duplicate_of") in meets}  # a duplicate follows its original
    assert after == meets | copies
    assert doc["feasible_after"] <= doc["feasible_before"]
    if len(set(p95.values())) > 1 and doc["feasible_before"] > 1:
        assert doc["feasible_after"] < doc["feasible_before"]
