"""Every morning command on the demo study, through the real `tuner` entry point; outputs parsed, files checked."""

from __future__ import annotations

import csv
import io
import json
import shlex
from pathlib import Path

import optuna
import pytest
import yaml
from morning_demo import SPECS, STUDY, RunCli, build_demo_study

from tuner.flags import VllmFlags

COMMANDS = ("studies", "status", "trials", "pareto", "show", "export", "rescore", "verify")


def table_rows(text: str) -> list[list[str]]:
    """The body rows of Rich tables in `text` (box-drawn), cells stripped."""
    return [
        [c.strip() for c in line.strip().strip("│").split("│")] for line in text.splitlines() if line.startswith("│")
    ]


def flags_of(number: int) -> VllmFlags:
    return VllmFlags.from_dict(next(s.flags for s in SPECS if s.number == number))


def test_every_command_has_help_with_an_example(tuner_cli: RunCli) -> None:
    for command in COMMANDS:
        r = tuner_cli(command, "--help")
        assert r.code == 0, command
        assert "Example:" in r.out and f"tuner {command}" in r.out, command


def test_studies_lists_the_demo(tuner_cli: RunCli, demo_url: str) -> None:
    r = tuner_cli("studies", "--storage", demo_url, "--json")
    assert r.code == 0, r.err
    (row,) = json.loads(r.out)
    # 13 trials: 11 finished, 1 running, 1 interrupted (counted apart, run again on resume)
    assert row["name"] == STUDY and row["trials"] == 12 and row["running"] == 1 and row["interrupted"] == 1
    assert row["best_trial"] == 9 and row["best_throughput"] == pytest.approx(3400.0)
    assert row["state"] == "running" and row["gpu"] == "h100-80gb"
    table = tuner_cli("studies", "--storage", demo_url, "--wide")
    (cells,) = [c for c in table_rows(table.out) if c[0] == STUDY]
    assert cells[1:5] == ["running", "12", "1", "6"] and cells[5] == "3,400.0 (#9)"


@pytest.mark.parametrize("variable", ["TUNER_STORAGE_URL", "TUNER_STORAGE"])
def test_storage_from_environment(
    tuner_cli: RunCli, demo_url: str, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    monkeypatch.setenv(variable, demo_url)
    r = tuner_cli("studies", "--json")
    assert r.code == 0 and json.loads(r.out)[0]["name"] == STUDY


def test_storage_and_study_from_a_job_file(tuner_cli: RunCli, demo_url: str, tmp_path: Path) -> None:
    job = tmp_path / "night.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "study": {"name": STUDY, "storage": demo_url},
                "target": {"launcher": "emulator", "model": "llama-3.1-8b", "gpu": "h100-80gb"},
                "space": {"max_num_seqs": {"low": 8, "high": 64}},
                "arrival": {"concurrency": 4, "requests": 10},
            }
        )
    )
    r = tuner_cli("status", "--job", job, "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["name"] == STUDY


def test_status(tuner_cli: RunCli, demo_url: str) -> None:
    r = tuner_cli("status", STUDY, "--storage", demo_url, "--json")
    assert r.code == 0, r.err
    st = json.loads(r.out)
    # the interrupted trial is counted apart: run again on resume, it spends no budget
    assert (st["budget"], st["finished"], st["running"], st["feasible"]) == (16, 11, [11], 6)
    assert st["failures"] == {"kv_cache_too_small": 1, "crashed_under_load": 1} and st["interrupted"] == 1
    # one skip saved the mean server time of the trials that started one: (9 x 120 s + 60 s + 30 s) / 11
    assert st["skipped"] == {"no_kv_memory": 1} and st["server_minutes_saved"] == pytest.approx(1170 / 11 / 60)
    assert st["best"]["number"] == 9
    text = tuner_cli("status", STUDY, "--storage", demo_url).out
    assert "11/16 trials finished" in text and "interrupted: 1, not counted" in text
    assert "best so far: trial 9: 3,400.0 tok/s" in text and "×1.70 throughput" in text
    assert "kv_cache_too_small 1" in text and "saving ≈ 1.8 server-minutes" in text


def test_trials_sort_filter_json_csv(tuner_cli: RunCli, demo_url: str) -> None:
    r = tuner_cli("trials", STUDY, "--storage", demo_url, "--sort", "throughput", "--json")
    rows = json.loads(r.out)
    assert [t["number"] for t in rows][:8] == [10, 2, 9, 6, 1, 4, 0, 7]
    feasible = json.loads(tuner_cli("trials", STUDY, "--storage", demo_url, "--feasible", "--json").out)
    assert {t["number"] for t in feasible} == {0, 1, 4, 6, 7, 9}
    failed = json.loads(tuner_cli("trials", STUDY, "--storage", demo_url, "--outcome", "launch_failed", "--json").out)
    assert [(t["number"], t["verdict"]) for t in failed] == [(3, "launch failed: kv_cache_too_small")]
    top = json.loads(
        tuner_cli("trials", STUDY, "--storage", demo_url, "--sort", "latency", "--limit", "2", "--json").out
    )
    assert [t["number"] for t in top] == [7, 4]
    out = tuner_cli("trials", STUDY, "--storage", demo_url, "--csv").out
    records = list(csv.DictReader(io.StringIO(out)))
    assert len(records) == 13 and records[2]["verdict"] == "misses e2e_p95<=5s"
    # Trial 2's two slowest requests (at its P95 above 5 s) miss the bound on their own: 18 of 20 are good.
    assert float(records[2]["good_share"]) == pytest.approx(0.9) and float(records[2]["goodput"]) == pytest.approx(1.8)
    assert json.loads(records[9]["flags"])["max_num_seqs"] == 256
    table = table_rows(tuner_cli("trials", STUDY, "--storage", demo_url, "--wide").out)
    by_number = {row[0].rstrip("ᵇ"): row for row in table if row[0].rstrip("ᵇ").isdigit()}
    assert by_number["10"][7] == "misses success_rate>=0.99" and by_number["2"][8].startswith("bottleneck: KV")
    assert by_number["2"][6] == "90.0%"
    assert by_number["0"][0] == "0ᵇ" and by_number["9"][2] == "3,400.0"


def test_trials_bad_sort_key_is_a_usage_error(tuner_cli: RunCli, demo_url: str) -> None:
    r = tuner_cli("trials", STUDY, "--storage", demo_url, "--sort", "speed")
    assert r.code == 2 and "allowed: number, throughput" in r.err
    r = tuner_cli("trials", STUDY, "--storage", demo_url, "--outcome", "exploded")
    assert r.code == 2 and "allowed: measured, launch_failed" in r.err


def test_pareto_table_plot_html_png(tuner_cli: RunCli, demo_url: str, tmp_path: Path) -> None:
    html, png = tmp_path / "front.html", tmp_path / "front.png"
    r = tuner_cli("pareto", STUDY, "--storage", demo_url, "--html", html, "--png", png, "--wide")
    assert r.code == 0, r.err
    rows = table_rows(r.out)
    front = [row for row in rows if row[1].isdigit() and row[0] != "baseline"]
    assert [row[1] for row in front] == ["9", "6", "4", "7"]
    assert front[0][0] == "throughput" and front[2][0] == "balanced" and front[3][0] == "latency"
    assert front[0][7:9] == ["×1.70", "×1.20"]
    (baseline,) = [row for row in rows if row[0] == "baseline"]
    assert baseline[1] == "0" and baseline[2] == "2,000.0"
    # the terminal scatter: every kind of point, and its key
    assert "x infeasible   o feasible   * front   B baseline" in r.out
    plot = r.out[r.out.index("throughput vs latency P95") :]
    for marker in ("x", "o", "*", "B", "·"):
        assert marker in plot
    page = html.read_text()
    assert "plotly" in page.lower() and "Plotly.newPlot" in page
    assert "feasible front" in page and "baseline (vLLM defaults)" in page
    assert "3400" in page and "Infeasible" in page  # Optuna's own plot marks infeasible trials
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(str(png)).shape[:2] == (500, 800)


def test_pareto_json(tuner_cli: RunCli, demo_url: str) -> None:
    doc = json.loads(tuner_cli("pareto", STUDY, "--storage", demo_url, "--json").out)
    assert [t["number"] for t in doc["front"]] == [9, 6, 4, 7]
    assert doc["picks"]["balanced"]["trial"] == 4
    assert doc["picks"]["throughput"]["throughput_ratio"] == pytest.approx(1.7)
    assert doc["baseline"]["number"] == 0 and doc["latency_metric"] == "e2e_p95"


def test_show_measured_and_failed_trials(tuner_cli: RunCli, demo_url: str) -> None:
    r = tuner_cli("show", STUDY, "2", "--storage", demo_url)
    assert r.code == 0, r.err
    assert "misses e2e_p95<=5s" in r.out and "bottleneck: KV cache" in r.out
    lat = {row[0]: row[1:] for row in table_rows(r.out) if row and row[0] in ("ttft", "tpot", "itl", "e2e")}
    assert lat["e2e"] == ["3.3000", "3.0000", "3.3000", "6.0000", "6.0000", "6.0000"]
    assert "--max-num-seqs" in r.out and "prediction" in r.out and "start-up facts" in r.out
    assert "kv_usage_max" in r.out and "Application startup complete" in r.out
    doc = json.loads(tuner_cli("show", STUDY, "2", "--storage", demo_url, "--json").out)
    assert doc["detail"]["load_summary"]["e2e"]["p95"] == pytest.approx(6.0)
    assert doc["request_steps"] == [0] and doc["trial"]["verdict"] == "misses e2e_p95<=5s"
    failed = tuner_cli("show", STUDY, "3", "--storage", demo_url)
    assert "launch failed: kv_cache_too_small" in failed.out and "ValueError: To serve" in failed.out
    fail10 = tuner_cli("show", STUDY, "10", "--storage", demo_url).out
    assert "http_5xx" in fail10 and "HTTP 503" in fail10
    running = tuner_cli("show", STUDY, "11", "--storage", demo_url)
    assert running.code == 0 and "no detail stored" in running.out


def test_export_best_round_trips(tuner_cli: RunCli, demo_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_NeverPrintMe")
    r = tuner_cli("export", STUDY, "--storage", demo_url)
    assert r.code == 0, r.err
    words = shlex.split(r.out, comments=True)
    assert words[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    assert VllmFlags.from_dict(_parse_flags(words[3:])) == flags_of(9)
    assert "trial 9" in r.out and "wl-5e1f00d" in r.out and "3,400.0 output tok/s" in r.out
    assert f"# re-verify: tuner verify {STUDY} --trial 9 --storage {demo_url}" in r.out
    for fmt in ("vllm-args", "vllm-config", "docker", "compose", "kubernetes", "json", "python"):
        out = tuner_cli("export", STUDY, "--storage", demo_url, "--best", "latency", "--format", fmt)
        assert out.code == 0 and "hf_NeverPrintMe" not in out.out, fmt
        assert "trial" in out.out and ("7" in out.out), fmt


def test_export_passes_the_jobs_secrets_by_name(
    tuner_cli: RunCli, demo_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "sk-secret-value")
    words = shlex.split(tuner_cli("export", STUDY, "--storage", demo_url, "-f", "docker").out.replace("\\\n", " "))
    names = [words[i + 1] for i, w in enumerate(words) if w == "-e"]
    assert names == ["HF_TOKEN", "VLLM_API_KEY"]
    out = tuner_cli("export", STUDY, "--storage", demo_url, "-f", "compose").out
    assert "VLLM_API_KEY: ${VLLM_API_KEY}" in out and "sk-secret-value" not in out
    custom = tuner_cli(
        "export", STUDY, "--storage", demo_url, "--model", "/models/llama", "--image", "vllm/vllm-openai:v0.12.0"
    )
    assert shlex.split(custom.out, comments=True)[2] == "/models/llama"
    docker = tuner_cli("export", STUDY, "--storage", demo_url, "-f", "docker", "--image", "vllm/vllm-openai:v0.12.0")
    assert "vllm/vllm-openai:v0.12.0" in docker.out


def _parse_flags(args: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    i = 0
    while i < len(args):
        name = args[i].removeprefix("--").replace("-", "_")
        value = args[i + 1]
        out[name] = float(value) if "." in value else int(value)
        i += 2
    return out


def test_export_kubernetes_to_a_file(tuner_cli: RunCli, demo_url: str, tmp_path: Path) -> None:
    target = tmp_path / "vllm.yaml"
    r = tuner_cli("export", STUDY, "--storage", demo_url, "--trial", "4", "-f", "kubernetes", "-o", target)
    assert r.code == 0 and "wrote" in r.err
    deployment, service = yaml.safe_load_all(target.read_text())
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["--model", "meta-llama/Llama-3.1-8B-Instruct"]
    assert VllmFlags.from_dict(_parse_flags(args[2:])) == flags_of(4)
    assert deployment["metadata"]["annotations"]["tuner/trial"] == "4" and service["kind"] == "Service"


def test_export_refusals(tuner_cli: RunCli, demo_url: str) -> None:
    r = tuner_cli("export", STUDY, "--storage", demo_url, "--trial", "3")
    assert r.code == 1 and "has no measurement (launch failed: kv_cache_too_small)" in r.err
    r = tuner_cli("export", STUDY, "--storage", demo_url, "--trial", "2")
    assert r.code == 0 and "warning: trial 2 misses e2e_p95<=5s" in r.err
    r = tuner_cli("export", STUDY, "--storage", demo_url, "--format", "helm")
    assert r.code == 2 and "allowed: vllm-args" in r.err
    r = tuner_cli("export", STUDY, "--storage", demo_url, "--best", "cheapest")
    assert r.code == 2 and "allowed: throughput, latency, balanced" in r.err


def test_rescore_with_a_tighter_slo(tuner_cli: RunCli, demo_url: str, tmp_path: Path) -> None:
    args = ("rescore", STUDY, "--storage", demo_url, "--slo", "e2e_p95<=3s", "--slo", "success_rate>=0.99")
    doc = json.loads(tuner_cli(*args, "--json").out)
    assert (doc["feasible_before"], doc["feasible_after"]) == (6, 2)
    assert [t["number"] for t in doc["front"]] == [4, 7]
    assert {t["number"] for t in doc["trials"] if t["feasible_after"]} == {4, 7}
    html = tmp_path / "rescored.html"
    r = tuner_cli(*args, "--html", html)
    assert r.code == 0, r.err
    assert "feasible: 6 → 2 trials" in r.out
    changed = {row[0] for row in table_rows(r.out) if len(row) > 2 and "(changed)" in row[2]}
    assert changed == {"0", "1", "6", "9"}
    assert "Plotly.newPlot" in html.read_text()
    # the study itself is untouched
    storage = optuna.storages.RDBStorage(demo_url)
    try:
        study = optuna.load_study(study_name=STUDY, storage=storage)
        assert sorted(t.number for t in study.best_trials) == [4, 6, 7, 9]
    finally:
        storage.engine.dispose()


def test_no_feasible_trial_is_one_line_and_exit_1(tuner_cli: RunCli, demo_url: str) -> None:
    r = tuner_cli("rescore", STUDY, "--storage", demo_url, "--slo", "e2e_p95<=100ms", "--no-plot")
    assert r.code == 1 and "feasible: 6 → 0 trials" in r.out
    assert r.err.startswith("error: no feasible trial in study 'demo'") and r.err.strip().count("\n") == 0


@pytest.mark.postgres
def test_a_study_in_postgresql(tuner_cli: RunCli, postgres_url: str) -> None:
    build_demo_study(postgres_url)
    doc = json.loads(tuner_cli("pareto", STUDY, "--storage", postgres_url, "--json").out)
    assert [t["number"] for t in doc["front"]] == [9, 6, 4, 7]
    r = tuner_cli("rescore", STUDY, "--storage", postgres_url, "--slo", "e2e_p95<=3s", "--json")
    assert [t["number"] for t in json.loads(r.out)["front"]] == [10, 4, 7]
    bad = postgres_url.replace("tuner:tuner@", "tuner:wrong@")
    r = tuner_cli("studies", "--storage", bad)
    assert r.code == 1 and "cannot open storage" in r.err and "wrong" not in r.err


def test_rescore_needs_a_valid_slo(tuner_cli: RunCli, demo_url: str) -> None:
    r = tuner_cli("rescore", STUDY, "--storage", demo_url)
    assert r.code == 2 and "--slo" in r.err
    r = tuner_cli("rescore", STUDY, "--storage", demo_url, "--slo", "e2e_p42<=3s")
    assert r.code == 2 and "e2e_p42" in r.err


@pytest.fixture
def empty_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    storage = optuna.storages.RDBStorage(url)
    optuna.create_study(study_name="fresh", storage=storage, directions=["maximize", "minimize"])
    storage.engine.dispose()
    return url


@pytest.mark.parametrize(
    "args",
    [
        ("status", "fresh"),
        ("trials", "fresh"),
        ("pareto", "fresh"),
        ("show", "fresh", "0"),
        ("export", "fresh"),
        ("rescore", "fresh", "--slo", "e2e_p95<=3s"),
        ("verify", "fresh"),
    ],
)
def test_empty_study_is_one_line_and_exit_1(tuner_cli: RunCli, empty_url: str, args: tuple[str, ...]) -> None:
    r = tuner_cli(*args, "--storage", empty_url)
    assert r.code == 1
    assert r.err.strip().count("\n") == 0 and "'fresh'" in r.err and "no trials yet" in r.err
    assert "Traceback" not in r.err


@pytest.mark.parametrize("command", ["status", "trials", "pareto", "export", "rescore", "verify"])
def test_missing_study_names_the_ones_there(tuner_cli: RunCli, demo_url: str, command: str) -> None:
    extra = ("--slo", "e2e_p95<=3s") if command == "rescore" else ()
    r = tuner_cli(command, "nope", "--storage", demo_url, *extra)
    assert r.code == 1 and r.err.strip().count("\n") == 0
    assert "no study 'nope'" in r.err and "studies there: demo" in r.err


def test_verify_refusals_start_no_server(tuner_cli: RunCli, demo_url: str) -> None:
    # The demo study stores only part of a job: verify cannot know how to launch, says why and what to give.
    r = tuner_cli("verify", STUDY, "--storage", demo_url, "--trial", "9")
    assert r.code == 2 and r.err.startswith("error: the job stored with study 'demo' (or give --job FILE): ")
    assert "target.model: required field is missing" in r.err and "Traceback" not in r.err
    r = tuner_cli("verify", STUDY, "--storage", demo_url, "--trial", "9", "--top", "2")
    assert r.code == 2 and "give --trial N or --top K, not both" in r.err
    r = tuner_cli("verify", STUDY, "--storage", demo_url, "--trial", "3")
    assert r.code == 1 and "trial 3 of 'demo' has no measurement (launch failed: kv_cache_too_small)" in r.err


def test_missing_trial(tuner_cli: RunCli, demo_url: str) -> None:
    r = tuner_cli("show", STUDY, "99", "--storage", demo_url)
    assert r.code == 1 and "no trial 99 in study 'demo'; trials are 0..12" in r.err
    r = tuner_cli("export", STUDY, "--storage", demo_url, "--trial", "99")
    assert r.code == 1 and "no trial 99" in r.err


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("not a url", "is not a database URL"),
        ("nosuchdb://x/y", "cannot open storage"),
        ("sqlite:////nonexistent/dir/night.db", "no study storage at /nonexistent/dir/night.db"),
    ],
)
def test_bad_storage_is_one_line_and_exit_1(tuner_cli: RunCli, url: str, needle: str) -> None:
    for args in (("studies",), ("status", STUDY), ("pareto", STUDY)):
        r = tuner_cli(*args, "--storage", url)
        assert r.code == 1, (args, r)
        assert needle in r.err and r.err.strip().count("\n") == 0 and "Traceback" not in r.err


def test_no_studies_in_storage(tuner_cli: RunCli, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'blank.db'}"
    optuna.storages.RDBStorage(url).engine.dispose()
    r = tuner_cli("studies", "--storage", url)
    assert r.code == 1 and "no study in" in r.err


def test_a_study_optuna_wrote_alone(tuner_cli: RunCli, tmp_path: Path) -> None:
    """No tuner tables, no user attrs: values are the measurement; show and rescore say what is missing."""
    url = f"sqlite:///{tmp_path / 'plain.db'}"
    storage = optuna.storages.RDBStorage(url)
    study = optuna.create_study(study_name="plain", storage=storage, directions=["maximize", "minimize"])
    for tput, lat in ((100.0, 2.0), (150.0, 3.0), (90.0, 2.5)):
        study.add_trial(optuna.trial.create_trial(values=[tput, lat], params={}, distributions={}))
    storage.engine.dispose()
    doc = json.loads(tuner_cli("pareto", "plain", "--storage", url, "--json").out)
    assert [t["number"] for t in doc["front"]] == [1, 0] and doc["baseline"] is None
    shown = tuner_cli("show", "plain", "1", "--storage", url)
    assert shown.code == 0 and "no detail stored" in shown.out
    r = tuner_cli("rescore", "plain", "--storage", url, "--slo", "e2e_p95<=3s")
    assert r.code == 1 and "holds no per-request records for 'plain'" in r.err
    out = tuner_cli("export", "plain", "--storage", url)
    assert out.code == 2 and "--model" in out.err
    out = tuner_cli("export", "plain", "--storage", url, "--model", "Qwen/Qwen2.5-7B-Instruct")
    assert out.code == 0 and shlex.split(out.out, comments=True) == ["vllm", "serve", "Qwen/Qwen2.5-7B-Instruct"]
