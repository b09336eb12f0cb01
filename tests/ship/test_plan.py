"""`tuner plan` on a max_rate study the emulator ran: the replica arithmetic checked against the stored records."""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import optuna
import pytest
import yaml

from tuner.report import choose, pareto_front, study_view
from tuner.store import open_store

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Ran:
    returncode: int
    stdout: str
    stderr: str


def plan(job: Path, *args: str, command: str = "plan") -> Ran:
    """`tuner COMMAND --job JOB ARGS` through its real entry point (errors and exit code included), in this process:
    an interpreter a call would cost seconds of imports, a dozen times over."""
    from tuner.cli import main

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        for name in ("TUNER_STORAGE_URL", "TUNER_STORAGE"):
            patch.delenv(name, raising=False)
        patch.setenv("COLUMNS", "200")
        patch.setattr(sys, "argv", ["tuner", command, "--job", str(job), *args])
        try:
            main()
            code: object = 0
        except SystemExit as e:
            code = e.code
    return Ran(code if isinstance(code, int) else 0 if code is None else 1, out.getvalue(), err.getvalue())


def winner(job: Path) -> tuple[optuna.trial.FrozenTrial, str]:
    """The trial `tuner plan` sizes from: the front's throughput pick, as `tuner pareto` reads the study (a flag set
    the confirmation started again at its pooled figure, its starts not points of their own)."""
    url = f"sqlite:///{job.with_suffix('.db')}"
    study = optuna.load_study(study_name="emulator-demo-max-rate", storage=url)
    pick = choose(pareto_front(study_view(study).trials), "throughput")
    return study.trials[pick.number], url


def pooled_rate(job: Path, t: optuna.trial.FrozenTrial) -> float:
    """The winner's highest SLO-meeting rate over every start of its flag set (its first and its confirmation
    starts), pooled as a geometric mean: what a plan sizes from, never one lucky start."""
    url = f"sqlite:///{job.with_suffix('.db')}"
    study = optuna.load_study(study_name="emulator-demo-max-rate", storage=url)
    starts = [s for s in study.trials if t.number in (s.number, s.user_attrs.get("repeat_of"))]
    rates = [s.user_attrs["request_rate"] for s in starts if s.user_attrs.get("outcome") == "measured"]
    return math.exp(sum(math.log(r) for r in rates) / len(rates))


def test_replicas_follow_from_the_winners_measured_rate(max_rate_job: Path) -> None:
    done = plan(max_rate_job, "--rate", "40", "--peak", "70", "--price-per-gpu-hour", "3", "--json")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    t, url = winner(max_rate_job)
    rate = pooled_rate(max_rate_job, t)  # the highest SLO-meeting rate the study measured for it, every start
    with open_store(url) as store:
        detail = store.trial_detail("emulator-demo-max-rate", t.number)
    assert detail is not None and detail.load_summary is not None
    tokens = detail.load_summary["completion_tokens"] / detail.load_summary["requests_succeeded"]
    assert got["trial"] == t.number and got["objective"] == "max_rate"
    assert got["capacity_rps"] == pytest.approx(rate)
    assert got["replicas"] == math.ceil(40 / (rate * 0.7))
    assert got["max_replicas"] == math.ceil(70 / (rate * 0.7))
    assert got["gpus"] == got["replicas"]  # one GPU a replica: the job has no tensor parallelism
    assert got["cost_per_hour"] == pytest.approx(3 * got["gpus"])
    assert got["cost_per_million_tokens"] == pytest.approx(got["cost_per_hour"] / (40 * tokens * 3600 / 1e6))


def test_the_arithmetic_is_printed(max_rate_job: Path) -> None:
    done = plan(max_rate_job, "--rate", "40", "--headroom", "0.5")
    assert done.returncode == 0, done.stderr
    t, _ = winner(max_rate_job)
    usable = pooled_rate(max_rate_job, t) * 0.5
    assert f"replicas = ceil(40 / {usable:.3f}) = {math.ceil(40 / usable)}" in done.stdout
    assert "highest SLO-meeting rate" in done.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--rate", "0"), "--rate"),
        (("--rate", "10", "--peak", "5"), "--peak"),
        (("--rate", "10", "--headroom", "1.5"), "--headroom"),
        (("--rate", "10", "--trial", "99"), "no trial 99"),
    ],
)
def test_bad_input_is_one_line(max_rate_job: Path, args: tuple[str, ...], says: str) -> None:
    done = plan(max_rate_job, *args)
    assert done.returncode in (1, 2) and "Traceback" not in done.stderr
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1
    if says != "no trial 99":
        assert done.returncode == 2


def test_the_manifest_holds_the_plan_and_secrets_by_reference(max_rate_job: Path, tmp_path: Path) -> None:
    out = tmp_path / "vllm.yaml"
    done = plan(max_rate_job, "--rate", "40", "--peak", "70", "--manifest", str(out), "--json")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    text = out.read_text()
    docs = {d["kind"]: d for d in yaml.safe_load_all(text)}
    assert list(docs) == ["Deployment", "Service", "HorizontalPodAutoscaler", "PrometheusRule"]
    assert docs["Deployment"]["spec"]["replicas"] == got["replicas"]
    hpa = docs["HorizontalPodAutoscaler"]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (got["replicas"], got["max_replicas"])
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    assert hpa["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    alerts = {r["alert"] for g in docs["PrometheusRule"]["spec"]["groups"] for r in g["rules"]}
    assert {"VllmSloE2EP95", "VllmSloTtftP95", "VllmErrorRate", "VllmDown"} <= alerts
    for env in docs["Deployment"]["spec"]["template"]["spec"]["containers"][0].get("env", []):
        assert "value" not in env and "secretKeyRef" in env["valueFrom"]


def test_the_dashboard_draws_the_slos(max_rate_job: Path, tmp_path: Path) -> None:
    out = tmp_path / "dashboard.json"
    assert plan(max_rate_job, "--rate", "10", "--dashboard", str(out)).returncode == 0
    panels = {p["title"]: p for p in json.loads(out.read_text())["panels"]}
    assert {"Throughput", "TTFT percentiles", "TPOT percentiles", "KV cache usage", "Preemptions / s"} <= set(panels)

    def bound(title: str) -> float:
        return float(panels[title]["fieldConfig"]["defaults"]["thresholds"]["steps"][-1]["value"])

    # the job's SLOs (as the fixture loosened them): e2e_p95 <= 100s, ttft_p95 <= 20s
    bounds = (bound("End-to-end latency percentiles"), bound("TTFT percentiles"), bound("KV cache usage"))
    assert bounds == (100, 20, 0.9)
    assert any(t["legendFormat"] == "P95" for t in panels["TTFT percentiles"]["targets"])


def test_export_with_a_plan_writes_the_same_objects_as_plan_manifest(max_rate_job: Path, tmp_path: Path) -> None:
    """`tuner export -f kubernetes --plan R` is the plan's manifest: the same stream as `tuner plan --manifest`."""
    by_plan = tmp_path / "plan.yaml"
    assert plan(max_rate_job, "--rate", "40", "--peak", "70", "--manifest", str(by_plan)).returncode == 0
    done = plan(max_rate_job, "-f", "kubernetes", "--plan", "40", "--peak", "70", command="export")
    assert done.returncode == 0, done.stderr
    docs = list(yaml.safe_load_all(done.stdout))
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "HorizontalPodAutoscaler", "PrometheusRule"]
    assert docs[1:] == list(yaml.safe_load_all(by_plan.read_text()))[1:]
    assert docs[0]["spec"] == next(yaml.safe_load_all(by_plan.read_text()))["spec"]
    assert "replicas for 40 req/s" in done.stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["-f", "docker", "--plan", "40"], "--plan and --peak go with --format kubernetes, not 'docker'"),
        (["-f", "kubernetes", "--peak", "70"], "--peak needs --plan R"),
        (["-f", "kubernetes", "--plan", "40", "--peak", "10"], "--peak at least --plan"),
    ],
)
def test_export_plan_mistakes_are_one_line(max_rate_job: Path, args: list[str], said: str) -> None:
    done = plan(max_rate_job, *args, command="export")
    assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_price_defaults_to_the_jobs_gpu_hour_usd(max_rate_job: Path, tmp_path: Path) -> None:
    # A copy of the study whose stored job names a price, as `target.gpu_hour_usd: 2.5` writes it.
    job = tmp_path / max_rate_job.name
    job.write_text(max_rate_job.read_text())
    job.with_suffix(".db").write_bytes(max_rate_job.with_suffix(".db").read_bytes())
    study = optuna.load_study(study_name="emulator-demo-max-rate", storage=f"sqlite:///{job.with_suffix('.db')}")
    stored = dict(study.user_attrs["job"])
    study.set_user_attr("job", {**stored, "target": {**stored["target"], "gpu_hour_usd": 2.5}})
    done = plan(job, "--rate", "40", "--json")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["cost_per_hour"] == pytest.approx(2.5 * got["gpus"])
    given = json.loads(plan(job, "--rate", "40", "--price-per-gpu-hour", "3", "--json").stdout)
    assert given["cost_per_hour"] == pytest.approx(3 * given["gpus"])  # the command line's price wins


@pytest.mark.parametrize(
    ("objective", "basis"),
    [
        ("max_rate", "its highest SLO-meeting rate"),
        ("cost", "its highest SLO-meeting rate"),  # a cost trial's rate is its replica's capacity within the SLOs
        ("throughput", "a floor of its capacity"),
    ],
)
def test_the_plan_names_what_the_trials_rate_is(objective: str, basis: str) -> None:
    from tuner.record import MEASURED, TrialRecord
    from tuner.report.views import StudyView, trial_view
    from tuner.ship.plan import make_plan

    record = TrialRecord(flags={"max_num_seqs": 16}, outcome=MEASURED, output_tok_s=900.0, request_rate=6.0)
    trial = optuna.trial.create_trial(values=[900.0, 2.0], params={}, distributions={}, user_attrs=record.to_attrs())
    view = StudyView("s", {"objective": objective, "slos": ["e2e_p95<=5s"]}, [trial_view(trial)])
    got = make_plan(view, view.trials[0], rate=12.0, tokens_per_request=150.0)
    assert basis in got.basis and got.capacity_rps == 6.0 and got.replicas == math.ceil(12.0 / (6.0 * 0.7))
