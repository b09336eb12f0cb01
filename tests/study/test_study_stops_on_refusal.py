"""A study whose server refuses the workload stops at once, records no measurement and spends no budget; the job
fixed, the same command runs the baseline again and goes on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from optuna.trial import TrialState
from study_fakes import FakeLauncher, FakeServer, fake_measure, job

from tests.conftest import run_main
from tuner.config import Job
from tuner.flags import VllmFlags
from tuner.load import LoadResult, RequestRecord
from tuner.record import WORKLOAD_INVALID, TrialRecord
from tuner.scoring import summarize
from tuner.store import open_store
from tuner.study import Measurement, TuningRun
from tuner.study.preflight import PreflightResult, WorkloadRejected
from tuner.study.run import STOPPED_ATTR


class Checks:
    """A preflight check whose verdicts are given in turn (the last repeats); it counts the servers it probed."""

    def __init__(self, *verdicts: str) -> None:
        self.verdicts = list(verdicts)
        self.probed: list[dict[str, Any]] = []

    async def __call__(self, server: FakeServer, job: Job, flags: VllmFlags) -> PreflightResult:
        self.probed.append(flags.as_dict())
        verdict = self.verdicts[min(len(self.probed), len(self.verdicts)) - 1]
        if verdict == "refuse":
            answer = "POST /v1/completions answered HTTP 400: Token id 29674 is out of vocabulary"
            raise WorkloadRejected(answer, "http_4xx")
        return PreflightResult(verdict == "pass", verdict)


def run(url: str, launcher: FakeLauncher, check: Checks | None, **kwargs: Any) -> TuningRun:
    tuning = TuningRun(job(), launcher, storage_url=url, poll_s=0.1, preflight=check, **kwargs)  # type: ignore[arg-type]
    try:
        tuning.run()
    finally:
        tuning.close()
    return tuning


def test_a_refusing_server_stops_the_study_in_its_first_trial_and_the_fixed_job_runs_the_baseline_again(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    launcher = FakeLauncher()
    with pytest.raises(WorkloadRejected, match="out of vocabulary"):
        run(url, launcher, Checks("refuse"), measure=fake_measure())
    assert len(launcher.launches) == 1  # one server start, the baseline's
    tuning = TuningRun(job(), launcher, storage_url=url, measure=fake_measure())
    study = tuning.study
    tuning.close()
    (trial,) = study.get_trials(deepcopy=False)
    assert trial.state == TrialState.FAIL  # no budget spent, nothing told to the sampler
    record = TrialRecord.from_attrs(trial.user_attrs)
    assert record.baseline and record.outcome == WORKLOAD_INVALID and record.reason == "http_4xx"
    assert record.output_tok_s is None and record.message is not None and "out of vocabulary" in record.message
    assert study.user_attrs[STOPPED_ATTR]["message"].startswith("the workload is invalid for this server")
    with open_store(url) as store:
        detail = store.trial_detail("fake", 0)
        assert detail is not None and detail.outcome == WORKLOAD_INVALID and detail.load_summary is None

    # The job fixed: the baseline runs again (its claim was released), the study reaches its budget.
    check = Checks("pass")
    study = run(url, launcher, check, measure=fake_measure()).study
    trials = study.get_trials(deepcopy=False)
    assert trials[0].state == TrialState.FAIL and {t.state for t in trials[1:]} == {TrialState.COMPLETE}
    assert trials[1].user_attrs["baseline"] and trials[1].user_attrs["outcome"] == "measured"
    assert launcher.launches[1]["flags"] == launcher.launches[0]["flags"]
    assert len(check.probed) == 1  # once a run, on its first server
    assert not study.user_attrs[STOPPED_ATTR]


def test_an_inconclusive_preflight_is_tried_again_on_the_next_server(tmp_path: Path) -> None:
    check = Checks("inconclusive", "pass")
    study = run(f"sqlite:///{tmp_path / 'study.db'}", FakeLauncher(), check, measure=fake_measure()).study
    assert len(check.probed) == 2
    assert {t.state for t in study.get_trials(deepcopy=False)} == {TrialState.COMPLETE}


def refused_load(message: str) -> Any:
    async def measure(server: FakeServer, job: Job, flags: VllmFlags) -> Measurement:
        records = [
            RequestRecord(index=i, start_s=0.0, e2e_s=0.01, ok=False, error_class="http_4xx", error_message=message)
            for i in range(10)
        ]
        return Measurement(LoadResult(summary=summarize(records, duration_s=0.1), records=records))

    return measure


def test_a_trial_whose_every_request_is_refused_alike_stops_the_study(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    launcher = FakeLauncher()
    with pytest.raises(WorkloadRejected, match=r"HTTP 401: Unauthorized.*VLLM_API_KEY"):
        run(url, launcher, None, measure=refused_load("HTTP 401: Unauthorized"))
    assert len(launcher.launches) == 1
    tuning = TuningRun(job(), launcher, storage_url=url, measure=fake_measure())
    (trial,) = tuning.study.get_trials(deepcopy=False)
    tuning.close()
    assert trial.state == TrialState.FAIL and trial.user_attrs["outcome"] == WORKLOAD_INVALID


def test_a_load_refused_for_a_tuned_max_model_len_is_learned_as_today(tmp_path: Path) -> None:
    space = {"max_num_seqs": {"choices": [8, 16]}, "max_model_len": {"choices": [512, 4096]}}
    message = "HTTP 400: This model's maximum context length is 512 tokens."

    async def measure(server: FakeServer, j: Job, flags: VllmFlags) -> Measurement:
        if flags.max_model_len == 512:
            return await refused_load(message)(server, j, flags)
        return await fake_measure()(server, j, flags)

    grid = job(space=space, sampler={"name": "grid"})
    tuning = TuningRun(grid, FakeLauncher(), storage_url=f"sqlite:///{tmp_path / 'db'}", measure=measure)
    try:
        tuning.run()
    finally:
        tuning.close()
    trials = tuning.study.get_trials(deepcopy=False)
    assert all(t.state == TrialState.COMPLETE for t in trials) and len(trials) >= 4
    short = [t for t in trials if t.user_attrs["flags"]["max_model_len"] == 512]
    assert short and all(not t.user_attrs["feasible"] for t in short)


def tuner(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str]:
    """`tuner ARGS...` through run_main: the exit code, and stdout and stderr as one text."""
    code, out, err = run_main(args, capsys, monkeypatch, columns=400)
    return code, out + err


def test_the_morning_commands_say_the_study_stopped_on_a_refused_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    with pytest.raises(WorkloadRejected):
        run(url, FakeLauncher(), Checks("refuse"), measure=fake_measure())
    code, out = tuner(capsys, monkeypatch, "status", "fake", "--storage", url)
    assert code == 0
    assert "stopped: the workload is invalid for this server: POST /v1/completions" in out
    code, out = tuner(capsys, monkeypatch, "pareto", "fake", "--storage", url)
    assert code == 1 and "tok/s" not in out
    assert "study 'fake' stopped: the workload is invalid for this server" in out and "Traceback" not in out
    code, out = tuner(capsys, monkeypatch, "studies", "--storage", url, "--json")
    assert code == 0 and '"state": "stopped"' in out


EMULATED = {
    "study": {"name": "check"},
    "target": {
        "launcher": "emulator",
        "model": "llama-3.1-8b",
        "gpu": "h100-80gb",
        "emulator": {"time_scale": 40},
        "startup_timeout": "60s",
    },
    "space": {"max_num_seqs": {"choices": [4, 8]}, "max_model_len": 4096},
    "workload": {"input_len": 1024, "output_len": 64},
    "arrival": {"concurrency": 2, "requests": 4},
    "slos": ["e2e_p95 <= 30s"],
    "request_timeout": "600s",  # 15 s of wall time at 40x: the preflight's probes are answered on a busy machine too
    "budget": {"n_trials": 2},
}


@pytest.mark.slow
def test_check_probes_the_baselines_server_and_records_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TUNER_STATE_DIR", str(tmp_path / "state"))
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(EMULATED))
    code, out = tuner(capsys, monkeypatch, "tune", str(good), "--check")
    assert code == 0, out
    assert "preflight passed: 3 probe requests answered, prompt and output lengths as meant" in out
    # 1,024 + 64 tokens under a fixed max_model_len of 1,040: the job check sees it before any server starts.
    short = tmp_path / "short.yaml"
    short.write_text(yaml.safe_dump({**EMULATED, "space": {**EMULATED["space"], "max_model_len": 1040}}))
    code, out = tuner(capsys, monkeypatch, "tune", str(short), "--check")
    assert code == 2 and "space.max_model_len: max_model_len 1040 is shorter than every request" in out
    assert "preflight" not in out
    # A dataset's lengths are only estimated before a launch: the server's refusal is what stops it.
    dataset = tmp_path / "long.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": "hello " * 1000, "output_len": 64}) + "\n" for _ in range(4)))
    short.write_text(
        yaml.safe_dump(
            {**EMULATED, "space": {**EMULATED["space"], "max_model_len": 1040}, "workload": {"dataset": dataset.name}}
        )
    )
    code, out = tuner(capsys, monkeypatch, "tune", str(short), "--check")
    assert code == 1 and "Traceback" not in out
    assert "error: the workload is invalid for this server" in out and "HTTP 400" in out
    assert "space.max_model_len at least" in out
    assert not list(tmp_path.glob("*.db"))  # nothing recorded
    # The study itself stops in its baseline's start, with the same line in its log.
    log = tmp_path / "tune.log"
    code, out = tuner(capsys, monkeypatch, "tune", str(short), "--log-file", str(log))
    assert code == 1 and "error: the workload is invalid for this server" in out
    assert "error: the workload is invalid for this server" in log.read_text()
    code, out = tuner(capsys, monkeypatch, "status", "--job", str(short))
    assert code == 0 and "stopped: the workload is invalid for this server" in out
