"""The whole box (`target.gpus`): replicas of a trial's shape, each under its share of the load, the box's figure the
study maximises, the refusal of a shape wider than the box, and what a million tokens and requests cost."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import FixedTrial, create_trial
from study_fakes import JOB, FakeLauncher, FakeServer, job, records_for

from tuner.box import box_figures, replica_arrival, replicas, shape_refusal
from tuner.cli.show import box_line
from tuner.cli.tune import box_text
from tuner.config import Job, load_job, schema
from tuner.cost import tokens_per_request
from tuner.emulator import Emulator
from tuner.errors import ConfigError
from tuner.flags import VllmFlags
from tuner.launch import StartupFacts
from tuner.load import Arrival
from tuner.record import StudyRecord
from tuner.report.rescore import rescore
from tuner.report.views import study_view, trial_view
from tuner.scoring import Slo
from tuner.study import Measurement, Objective, measure_load
from tuner.study.confirm import CI_RUN_ATTR, Confirmation
from tuner.twin.simulate import simulate

SPACE: dict[str, Any] = {
    "tensor_parallel_size": {"choices": [1, 2, 4]},
    "max_num_seqs": 16,
    "gpu_memory_utilization": 0.9,
    "max_model_len": 4096,
}


def box_job(gpus: int | None, **changes: Any) -> Job:
    target = {**JOB["target"], **({"gpus": gpus} if gpus is not None else {})}
    return job(target=target, space=SPACE, **changes)


@pytest.mark.parametrize(
    ("box", "world", "expected"), [(8, 1, 8), (8, 2, 4), (8, 3, 2), (8, 8, 1), (4, 8, 0), (1, 1, 1)]
)
def test_replicas_are_the_shapes_that_fit_whole(box: int, world: int, expected: int) -> None:
    assert replicas(box, world) == expected
    assert (shape_refusal(box, world) is None) is (expected > 0)


@pytest.mark.parametrize(("users", "n", "share"), [(8, 2, 4), (5, 2, 3), (1, 4, 1), (16, 1, 16), (10, 4, 3)])
def test_a_replica_gets_its_share_of_the_users_rounded_up(users: int, n: int, share: int) -> None:
    arrival = Arrival(concurrency=users, requests=40)
    assert replica_arrival(arrival, n).concurrency == share
    assert replica_arrival(arrival, n).requests == 40  # each replica's run is as long as a lone server's


def test_a_replica_gets_its_share_of_the_rate_and_the_in_flight_cap() -> None:
    shared = replica_arrival(Arrival(rate=10.0, max_in_flight=5, requests=40), 4)
    assert shared.rate == pytest.approx(2.5) and shared.max_in_flight == 2


def test_box_figures_on_known_numbers() -> None:
    # Two TP-2 replicas on a 4-GPU box at $2 a GPU-hour, each doing 1000 tok/s and 2 req/s.
    box = box_figures(1000.0, 2.0, n_replicas=2, box_gpus=4, gpu_hour_usd=2.0)
    assert box.output_tok_s == 2000 and box.request_rate == 4 and box.tok_s_per_gpu == 500
    # $8 an hour buys 2000 x 3600 = 7.2M tokens: $1.111 per million.
    assert box.usd_per_m_tokens == pytest.approx(8 / 7.2)
    # 4 GPUs serve 4 x 3600 = 14,400 requests an hour: 4 / 14,400 x 1e6 = 277.8 GPU-hours per million.
    assert box.gpu_hours_per_m_requests == pytest.approx(4e6 / 14_400)


def test_a_shape_leaving_gpus_idle_still_pays_for_them_and_no_price_means_no_cost() -> None:
    box = box_figures(1000.0, None, n_replicas=2, box_gpus=8, gpu_hour_usd=None)  # TP 3 on 8: 2 idle
    assert box.tok_s_per_gpu == 250 and box.usd_per_m_tokens is None and box.gpu_hours_per_m_requests is None
    priced = box_figures(1000.0, None, n_replicas=2, box_gpus=8, gpu_hour_usd=1.0)
    assert priced.usd_per_m_tokens == pytest.approx(8 / (2000 * 3600) * 1e6)


def test_the_box_defaults_to_one_gpu_on_the_emulator_and_the_price_to_the_job() -> None:
    assert box_job(None).box_gpus() == 1 and box_job(None).gpu_hour_usd() == 0.468  # the catalog's, for the L4
    assert job(target={**JOB["target"], "gpu": "a10g"}).gpu_hour_usd() is None  # a card with no catalog price
    priced = job(target={**JOB["target"], "gpus": 8, "gpu_hour_usd": 2.5})
    assert priced.box_gpus() == 8 and priced.gpu_hour_usd() == 2.5


def _emulated(seen: list[Measurement]) -> Any:
    """The load phase against an in-process emulator of the trial's shape; the measurements kept in `seen`."""

    async def measure(_server: FakeServer, j: Job, flags: VllmFlags) -> Measurement:
        args = ["--model", "llama-3.1-8b", "--gpu", "l4", "--max-model-len", "4096", "--time-scale", "50"]
        args += ["--tensor-parallel-size", str(flags.tensor_parallel_size), "--seed", "1"]
        emu = Emulator.from_args(args, log_stream=io.StringIO())
        async with emu.serve_http(host="127.0.0.1", port=0) as base:
            server = FakeServer(base_url=base, model="llama-3.1-8b", facts=StartupFacts(), time_scale=50)
            m = await measure_load(server, j, flags)  # type: ignore[arg-type]
        seen.append(m)
        return m

    return measure


@pytest.mark.parametrize(("tp", "n", "users"), [(2, 2, 4), (1, 4, 2)])
def test_on_a_4_gpu_emulated_box_a_replica_gets_its_share_and_the_box_multiplies(tp: int, n: int, users: int) -> None:
    seen: list[Measurement] = []
    j = box_job(4, arrival={"concurrency": 8, "requests": 16}, slos=["success_rate >= 0.9"])
    objective = Objective(j, FakeLauncher(), measure=_emulated(seen))
    trial = FixedTrial({"tensor_parallel_size": tp})
    values = objective(trial)
    (m,) = seen
    assert m.result is not None and m.result.mode == f"closed loop, {users} users" and m.replicas == n
    assert m.result.peak_in_flight <= users
    a = trial.user_attrs
    replica = m.result.summary.output_throughput
    assert a["outcome"] == "measured" and a["output_tok_s"] == pytest.approx(replica)
    assert values[0] == pytest.approx(n * replica) == pytest.approx(a["box_output_tok_s"])
    assert a["replicas"] == n and a["box_gpus"] == 4 and a["tok_s_per_gpu"] == pytest.approx(n * replica / 4)
    # The job gave no price: the catalog's for the L4, for the box's four GPUs.
    assert a["usd_per_m_tokens"] == pytest.approx(4 * 0.468 / (values[0] * 3600) * 1e6)


def test_a_shape_wider_than_the_box_is_refused_before_launch() -> None:
    launcher = FakeLauncher()
    events: list[str] = []
    objective = Objective(box_job(2), launcher, measure=_emulated([]), on_event=events.append)
    trial = FixedTrial({"tensor_parallel_size": 4})
    values = objective(trial)
    a = trial.user_attrs
    assert launcher.launches == []
    assert a["outcome"] == "skipped_infeasible" and a["reason"] == "shape_does_not_fit" and a["feasible"] is False
    assert "needs 4 GPUs" in a["message"] and "the box has 2 (target.gpus)" in a["message"]
    assert values[0] == 0.0 and any("needs 4 GPUs" in e for e in events)


def _frozen(attrs: dict[str, Any], value: float) -> Any:
    return create_trial(
        params={"x": 0.5},
        distributions={"x": FloatDistribution(0, 1)},
        values=[value, 1.0],
        user_attrs={"outcome": "measured", "flags": {"tensor_parallel_size": 2}, **attrs},
    )


def test_show_and_the_trials_row_carry_the_box_and_its_cost() -> None:
    box = box_figures(1000.0, 2.0, n_replicas=2, box_gpus=4, gpu_hour_usd=2.0)
    attrs = {
        "output_tok_s": 1000.0,
        "request_rate": 2.0,
        "replicas": 2,
        "box_gpus": 4,
        "box_output_tok_s": box.output_tok_s,
        "box_request_rate": box.request_rate,
        "tok_s_per_gpu": box.tok_s_per_gpu,
        "usd_per_m_tokens": box.usd_per_m_tokens,
        "gpu_hours_per_m_requests": box.gpu_hours_per_m_requests,
    }
    t = trial_view(_frozen(attrs, 2000.0))
    row = t.as_dict()
    assert row["throughput"] == 2000 and row["output_tok_s"] == 1000 and row["replicas"] == 2
    assert row["usd_per_m_tokens"] == pytest.approx(1.1111, abs=1e-4)
    assert box_line(t) == (
        "box: 2 replicas on 4 GPUs: 2,000.0 tok/s (500.0 per GPU), 4.00 req/s; $1.11 per million output tokens, "
        "277.8 GPU-h per million requests"
    )


def test_the_plans_price_defaults_to_the_jobs_then_the_catalogs() -> None:
    job_priced = {"job": {"target": {"gpu_hour_usd": 3.0}}, "gpu_profile": {"usd_per_hour": 2.0}}
    assert StudyRecord.from_attrs(job_priced).gpu_hour_usd == 3.0
    assert StudyRecord.from_attrs({"gpu_profile": {"usd_per_hour": 2.0}}).gpu_hour_usd == 2.0
    assert StudyRecord.from_attrs({"gpu_profile": {"usd_per_hour": None}}).gpu_hour_usd is None


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("gpus", 0, "target.gpus: Input should be greater than or equal to 1"),
        ("gpu_hour_usd", -1, "target.gpu_hour_usd: Input should be greater than 0"),
    ],
)
def test_a_bad_box_or_price_is_one_line_and_exit_2(tmp_path: Path, field: str, value: int, expected: str) -> None:
    data = {**JOB, "target": {**JOB["target"], field: value}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=expected):
        load_job(path)
    command = [sys.executable, "-m", "tuner", "tune", "--dry-run", str(path)]
    out = subprocess.run(command, capture_output=True, text=True)
    assert out.returncode == 2 and expected in out.stderr and "Traceback" not in out.stderr


def test_the_twin_predicts_one_replica_under_its_share_as_the_study_measures_it() -> None:
    flags = VllmFlags(tensor_parallel_size=2, max_num_seqs=16, max_model_len=4096, gpu_memory_utilization=0.9)
    box = simulate(box_job(4, arrival={"concurrency": 8, "requests": 16}), flags)
    alone = simulate(box_job(2, arrival={"concurrency": 4, "requests": 16}), flags)  # a box of one TP-2 server
    crowded = simulate(box_job(2, arrival={"concurrency": 8, "requests": 16}), flags)
    assert box.started and box.peak_running == alone.peak_running == 4 and crowded.peak_running == 8
    assert [r.e2e_s for r in box.records] == [r.e2e_s for r in alone.records]


def _measured_shape(number: int, tp: int, replica_tok_s: float, n: int) -> Any:
    run = {"output_tok_s": [replica_tok_s, replica_tok_s * 0.99, replica_tok_s * 1.01], "e2e_p95_s": [1.0, 0.9, 1.1]}
    t = create_trial(
        params={"tensor_parallel_size": tp},
        distributions={"tensor_parallel_size": CategoricalDistribution([1, 2, 4])},
        values=[replica_tok_s * n, 1.0],
        user_attrs={
            "flags": {"tensor_parallel_size": tp},
            "outcome": "measured",
            "output_tok_s": replica_tok_s,
            "replicas": n,
            "feasible": True,
            "constraint_names": ["startup", "slo:e2e_p95<=2s"],
            "constraints": [0.0, 0.0],
            CI_RUN_ATTR: run,
        },
    )
    t.number = number
    return t


def test_the_confirmation_and_the_views_compare_shapes_on_the_box() -> None:
    # TP 1: four replicas of 300 tok/s (1200 on the box); TP 2: two of 500 (1000): the narrower shape leads.
    trials = [_measured_shape(0, 1, 300.0, 4), _measured_shape(1, 2, 500.0, 2)]
    leader = Confirmation.of(trials, [Slo(metric="e2e_p95", op="<=", threshold=2.0)]).leader
    assert leader is not None and leader.number == 0 and leader.throughput is not None
    assert leader.throughput.value == pytest.approx(1200.0)
    view = study_view_of(trials)
    assert [t.throughput_ci[0] if t.throughput_ci else None for t in view] == [pytest.approx(1200.0), 1000.0]


def study_view_of(trials: list[Any]) -> list[Any]:
    study = optuna.create_study(directions=["maximize", "minimize"])
    for t in trials:
        study.add_trial(t)
    return study_view(study).trials


class _Stored:
    """One trial's stored requests, as `tuner rescore` reads them (no summary, no capacity steps)."""

    def trial_detail(self, study: str, number: int) -> Any:
        return SimpleNamespace(capacity_steps=None, scored_step=0, load_summary=None)

    def request_records(self, study: str, number: int, step: int | None = None) -> list[Any]:
        return records_for(VllmFlags(max_num_seqs=16))

    def request_steps(self, study: str, number: int) -> list[int]:
        return [0]


def test_rescore_keeps_the_box_figure() -> None:
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.add_trial(_measured_shape(0, 2, 500.0, 2))
    (rescored,) = rescore(study_view(study), _Stored(), [Slo(metric="e2e_p95", op="<=", threshold=2.0)]).trials
    assert rescored.summary is not None and rescored.after.replicas == 2
    assert rescored.after.throughput == pytest.approx(2 * rescored.summary.output_throughput)
    assert rescored.after.output_tok_s == pytest.approx(rescored.summary.output_throughput)


def test_a_real_box_defaults_to_the_gpus_the_tuner_was_given_else_the_machines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schema, "machine_devices", lambda: [object()] * 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    docker = {**JOB["target"], "launcher": "docker"}
    assert job(target=docker).box_gpus() == 8
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert job(target=docker).box_gpus() == 3
    assert job(target={**docker, "gpus": 2}).box_gpus() == 2


def test_max_rate_on_the_box_is_replicas_times_the_replicas_rate() -> None:
    seen: list[Measurement] = []
    j = box_job(
        4,
        objective="max_rate",
        arrival={"rate": 1.0, "requests": 8},
        capacity_search={"requests_per_step": 8, "max_steps": 2},
        slos=["success_rate >= 0.9"],
    )
    trial = FixedTrial({"tensor_parallel_size": 2})
    values = Objective(j, FakeLauncher(), measure=_emulated(seen))(trial)
    a = trial.user_attrs
    assert seen[0].replicas == 2 and a["outcome"] == "measured" and a["request_rate"] > 0
    assert a["box_request_rate"] == pytest.approx(2 * a["request_rate"])
    # the box's: each replica at the tokens its SLO-meeting rate asks for (`replica_tok_s`)
    assert seen[0].result is not None
    assert values[0] == pytest.approx(2 * a["request_rate"] * tokens_per_request(seen[0].result.summary))


def test_the_dry_run_says_the_box_its_share_and_its_price() -> None:
    box = job(target={**JOB["target"], "gpus": 8, "gpu_hour_usd": 2.5}, arrival={"concurrency": 64, "requests": 10})
    assert box_text(box, 2) == (
        "box: 8 GPUs (target.gpus): a shape runs as 8 // (tensor x pipeline parallel) replicas, scored together; "
        "the baseline's 4 each get closed loop, 16 users; $2.5 a GPU-hour"
    )
    assert box_text(job(), 1) is None  # one GPU and no price of the job's own: nothing changes, nothing said
