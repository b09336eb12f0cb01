from __future__ import annotations

from typing import Any

import pytest
from optuna.trial import FixedTrial
from study_fakes import FakeLauncher, fake_measure, job, records_for

from tuner.errors import LaunchError
from tuner.flags import VllmFlags
from tuner.load.results import CapacityStep, LoadResult, RequestRecord
from tuner.scoring import summarize
from tuner.study import Measurement, Objective

CONTRACT_ATTRS = {
    "flags",
    "baseline",
    "outcome",
    "reason",
    "output_tok_s",
    "request_rate",
    "success_rate",
    "e2e_p95_s",
    "ttft_p95_s",
    "tpot_p95_s",
    "goodput",
    "diagnosis",
    "kv_tokens",
    "predicted_kv_tokens",
    "feasible",
    "server_seconds",
    "constraints",
}


def run(
    objective: Objective, params: dict[str, object], baseline: bool = False
) -> tuple[tuple[float, float], FixedTrial]:
    trial = FixedTrial(params)
    if baseline:
        trial.set_user_attr("baseline", True)
    return objective(trial), trial


def test_measured_trial_reports_values_constraints_and_the_contracts_attributes() -> None:
    launcher = FakeLauncher()
    objective = Objective(job(), launcher, measure=fake_measure())
    values, trial = run(objective, {"max_num_seqs": 16, "gpu_memory_utilization": 0.9})
    summary = summarize(records_for(VllmFlags(max_num_seqs=16)), duration_s=10 / 16)
    assert values == (pytest.approx(summary.output_throughput), pytest.approx(summary.e2e.p95))
    a = trial.user_attrs
    assert set(a) >= CONTRACT_ATTRS
    assert a["outcome"] == "measured" and a["reason"] is None and a["baseline"] is False
    assert a["flags"] == {"max_num_seqs": 16, "max_model_len": 4096, "gpu_memory_utilization": 0.9}
    assert a["kv_tokens"] == 40_000 and a["predicted_kv_tokens"] > 0
    assert a["e2e_p95_s"] == pytest.approx(1.0) and a["success_rate"] == 1.0
    assert a["feasible"] is True and a["constraints"] == [0.0, pytest.approx(-0.5), pytest.approx(-1 / 9)]
    assert trial.constraints == dict(zip(a["constraint_names"], a["constraints"], strict=True))
    assert launcher.launches == [{"flags": a["flags"], "study": "fake", "trial": 0}]


def test_slo_miss_is_measured_but_infeasible() -> None:
    values, trial = run(
        Objective(job(), FakeLauncher(), measure=fake_measure()), {"max_num_seqs": 64, "gpu_memory_utilization": 0.9}
    )
    a = trial.user_attrs
    assert a["outcome"] == "measured" and a["feasible"] is False
    assert a["constraints"][1] == pytest.approx((2.5 - 2) / 2)  # e2e_p95 2.5s against 2s
    assert values[0] > 0


def test_errored_requests_are_failures_never_throughput() -> None:
    objective = Objective(job(), FakeLauncher(), measure=fake_measure(failures=3))
    values, trial = run(objective, {"max_num_seqs": 16, "gpu_memory_utilization": 0.9})
    # 7 successful requests x 32 tokens over 10/16 s; the failed ones' 7 streamed tokens each do not count.
    assert values[0] == pytest.approx(7 * 32 / (10 / 16))
    assert trial.user_attrs["success_rate"] == pytest.approx(0.7)
    assert trial.user_attrs["feasible"] is False  # success_rate >= 0.9 missed


def test_predicted_refusal_is_not_launched_and_teaches_the_sampler() -> None:
    launcher = FakeLauncher()
    space = {"max_num_seqs": {"choices": [8, 16]}, "max_model_len": {"choices": [4096, 131072]}}
    objective = Objective(
        job(space=space, target={"model": "llama-3.1-8b", "gpu": "rtx4090"}), launcher, measure=fake_measure()
    )
    values, trial = run(objective, {"max_num_seqs": 8, "max_model_len": 131072})
    a = trial.user_attrs
    assert launcher.launches == []
    assert a["outcome"] == "skipped_infeasible" and a["reason"] == "kv_cache_too_small"
    assert values == (0.0, 30.0)  # worst values: nothing served, the request timeout as latency
    startup = trial.constraints["startup"]
    assert 10 < startup <= 11  # graded: how much of max_model_len the KV cache lacks
    assert a["feasible"] is False and a["output_tok_s"] is None


def test_failed_start_is_recorded_with_the_launchers_reason_and_not_retried() -> None:
    error = LaunchError("vLLM refused", reason="kv_cache_too_small", log_tail="ERROR ... To serve at least one request")
    error.estimated_max_model_len = 2000  # type: ignore[attr-defined]
    launcher = FakeLauncher(fail=lambda flags, attempt: error)
    values, trial = run(
        Objective(job(), launcher, measure=fake_measure()), {"max_num_seqs": 8, "gpu_memory_utilization": 0.85}
    )
    a = trial.user_attrs
    assert a["outcome"] == "launch_failed" and a["reason"] == "kv_cache_too_small"
    assert a["kv_tokens"] == 2000 and len(launcher.launches) == 1
    assert values == (0.0, 30.0) and trial.constraints["startup"] == pytest.approx(10 + (4096 - 2000) / 4096)


def test_transient_start_timeout_is_retried_once() -> None:
    launcher = FakeLauncher(
        fail=lambda flags, attempt: LaunchError("slow", reason="start_timeout") if attempt == 0 else None
    )
    _, trial = run(
        Objective(job(), launcher, measure=fake_measure()), {"max_num_seqs": 8, "gpu_memory_utilization": 0.85}
    )
    assert trial.user_attrs["outcome"] == "measured" and trial.user_attrs["attempts"] == 2
    assert len(launcher.launches) == 2
    always = FakeLauncher(fail=lambda flags, attempt: LaunchError("slow", reason="start_timeout"))
    _, trial = run(
        Objective(job(), always, measure=fake_measure()), {"max_num_seqs": 8, "gpu_memory_utilization": 0.85}
    )
    assert trial.user_attrs["outcome"] == "launch_failed" and trial.user_attrs["reason"] == "start_timeout"
    assert len(always.launches) == 2  # at most once more


def test_crash_under_load_is_retried_only_when_it_is_not_the_flags_doing() -> None:
    oom = LaunchError("died", reason="crashed_under_load", log_tail="torch.OutOfMemoryError: CUDA out of memory.")
    launcher = FakeLauncher(crash=lambda flags, attempt: oom)
    _, trial = run(
        Objective(job(), launcher, measure=fake_measure()), {"max_num_seqs": 8, "gpu_memory_utilization": 0.95}
    )
    assert trial.user_attrs["outcome"] == "crashed" and trial.user_attrs["reason"] == "crashed_under_load"
    assert len(launcher.launches) == 1 and trial.user_attrs["feasible"] is False
    xid = LaunchError("died", reason="crashed_under_load", log_tail="CUDA error: an illegal memory access")
    flaky = FakeLauncher(crash=lambda flags, attempt: xid if attempt == 0 else None)
    _, trial = run(Objective(job(), flaky, measure=fake_measure()), {"max_num_seqs": 8, "gpu_memory_utilization": 0.95})
    assert trial.user_attrs["outcome"] == "measured" and len(flaky.launches) == 2


def test_same_flags_are_never_launched_twice() -> None:
    launcher = FakeLauncher()
    objective = Objective(job(), launcher, measure=fake_measure())
    first, _ = run(objective, {"max_num_seqs": 16, "gpu_memory_utilization": 0.9})
    again, trial = run(objective, {"max_num_seqs": 16, "gpu_memory_utilization": 0.9})
    assert again == first and len(launcher.launches) == 1
    assert trial.user_attrs["duplicate_of"] == 0 and trial.user_attrs["server_seconds"] == 0.0


@pytest.mark.parametrize("reason", ["image_missing", "cannot_launch"])
def test_a_machine_that_cannot_launch_stops_the_run(reason: str) -> None:
    launcher = FakeLauncher(fail=lambda flags, attempt: LaunchError("no image", reason=reason))
    with pytest.raises(LaunchError, match="no image"):
        run(Objective(job(), launcher, measure=fake_measure()), {"max_num_seqs": 8, "gpu_memory_utilization": 0.85})
    assert len(launcher.launches) == 1  # not retried as transient


def test_ctrl_c_marks_the_trial_interrupted() -> None:
    def interrupt(flags: VllmFlags, attempt: int) -> LaunchError | None:
        raise KeyboardInterrupt

    trial = FixedTrial({"max_num_seqs": 8, "gpu_memory_utilization": 0.85})
    with pytest.raises(KeyboardInterrupt):
        Objective(job(), FakeLauncher(fail=interrupt), measure=fake_measure())(trial)
    assert trial.user_attrs["outcome"] == "interrupted"


def test_baseline_trial_runs_vllms_defaults() -> None:
    launcher = FakeLauncher()
    objective = Objective(job(), launcher, measure=fake_measure())
    _, trial = run(objective, objective.space.baseline_params(), baseline=True)
    assert trial.user_attrs["baseline"] is True
    assert launcher.launches[0]["flags"] == {
        "max_num_seqs": 256,
        "max_model_len": 4096,
        "gpu_memory_utilization": 0.9,
        "max_num_batched_tokens": 2048,
    }


def test_calibration_from_the_first_start_changes_the_next_prediction() -> None:
    # The real server has 30% less KV than predicted: a max_model_len only the raw arithmetic fits is then skipped.
    space = {"max_num_seqs": {"choices": [8, 16]}, "max_model_len": {"choices": [4096, 32000]}}
    j = job(space=space, target={"model": "llama-3.1-8b", "gpu": "rtx4090"})
    objective = Objective(j, FakeLauncher(), measure=fake_measure())
    raw = objective.feasibility.predict(VllmFlags(max_num_seqs=8, max_model_len=4096)).raw_kv_tokens
    assert raw > 32000  # fits before calibration
    objective.launcher = FakeLauncher(kv_tokens=lambda flags: int(raw * 0.7))
    run(objective, {"max_num_seqs": 8, "max_model_len": 4096})
    _, trial = run(objective, {"max_num_seqs": 16, "max_model_len": 32000})
    assert trial.user_attrs["outcome"] == "skipped_infeasible" and trial.user_attrs["kv_scale"] == pytest.approx(
        0.7, abs=0.01
    )


def _capacity_measure(rates: dict[int, tuple[float, float]]) -> Any:
    """A max_rate search that found `rate` for a flag set's `max_num_seqs`, each of 40 requests taking `e2e_s`."""

    async def measure(server: Any, job: Any, flags: VllmFlags) -> Measurement:
        rate, e2e = rates[flags.max_num_seqs or 0]
        records = [
            RequestRecord(index=i, start_s=i / rate, ttft_s=0.05, e2e_s=e2e, completion_tokens=100, ok=True)
            for i in range(40)
        ]
        summary = summarize(records, duration_s=39 / rate + e2e)  # first send to last answer: the drain included
        step = CapacityStep(rate=rate, summary=summary, meets_slos=True)
        return Measurement(LoadResult(summary=summary, records=records), [step], 0, rate)

    return measure


def test_max_rate_scores_the_higher_slo_meeting_rate_higher_whatever_its_drain() -> None:
    """22 req/s with 4 s answers against 20 req/s with 0.5 s ones, both within e2e_p95 <= 5 s: the step's own tok/s
    reads 22 req/s lower (its last answers come long after its last send), the objective does not."""
    j = job(objective="max_rate", arrival={"rate": 1.0, "requests": 40}, slos=["e2e_p95 <= 5s"])
    objective = Objective(j, FakeLauncher(), measure=_capacity_measure({8: (20.0, 0.5), 16: (22.0, 4.0)}))
    (fast, _), a = run(objective, {"max_num_seqs": 8, "gpu_memory_utilization": 0.9})
    (slow, _), b = run(objective, {"max_num_seqs": 16, "gpu_memory_utilization": 0.9})
    assert b.user_attrs["output_tok_s"] < a.user_attrs["output_tok_s"]  # the steps' own figures, as measured
    assert fast == pytest.approx(20.0 * 100) and slow == pytest.approx(22.0 * 100) and slow > fast
