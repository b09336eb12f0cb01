"""A rerun of an edited job against its study's stored job: continued, re-judged, carried into a new space, or
refused with one line; never a traceback, never a trial burned (tuner.study.job_change, job_check, space_carry)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.trial import TrialState
from study_fakes import JOB, FakeLauncher, fake_measure, job

from tests.conftest import run_main
from tuner.config import Job
from tuner.errors import ConfigError
from tuner.report.rejudge import rejudge
from tuner.report.views import study_view
from tuner.study import TuningRun
from tuner.study.job_change import MEASURED, SPACE, UNMEASURED, VERDICTS, compare, normalised


def kinds(before: Job, after: Job) -> dict[str, str]:
    return {c.path: c.kind for c in compare(normalised(before.as_record()), after.as_record()).changes}


def space(**flags: Any) -> dict[str, Any]:
    return {**JOB["space"], **flags}


# -- the classification, pure --------------------------------------------------------------------------------


def test_what_measures_nothing_continues() -> None:
    after = job(
        budget={"n_trials": 9, "confirm": 3, "timeout": "2h"},
        sampler={"name": "tpe", "seed": 4},
        target={**JOB["target"], "startup_timeout": 60},
        study={**JOB["study"], "heartbeat_interval": 5},
    )
    found = kinds(job(), after)
    assert found and set(found.values()) == {UNMEASURED}
    assert compare(normalised(job().as_record()), job().as_record()).changes == ()


def test_slos_objective_between_searches_and_latency_metric_are_verdicts() -> None:
    assert kinds(job(), job(slos=["e2e_p95<=1s", "success_rate >= 0.9"])) == {"slos": VERDICTS}
    # The same SLOs spelt otherwise are no change.
    assert kinds(job(), job(slos=["e2e_p95<=2s", "success_rate>=0.9"])) == {}
    assert kinds(job(), job(latency_metric="ttft_p95")) == {"latency_metric": VERDICTS}
    rate = {"rate": 2.0, "requests": 10}
    assert kinds(job(objective="max_rate", arrival=rate), job(objective="goodput", arrival=rate)) == {
        "objective": VERDICTS
    }


def test_a_changed_range_or_choices_is_the_space_a_fixed_flag_is_measured() -> None:
    assert kinds(job(), job(space=space(max_num_seqs={"choices": [8, 16, 48]}))) == {"space.max_num_seqs": SPACE}
    assert kinds(job(), job(space=space(max_num_batched_tokens={"low": 512, "high": 4096}))) == {
        "space.max_num_batched_tokens": SPACE
    }
    # A fixed flag is every trial's, the baseline's too.
    assert kinds(job(), job(space=space(max_model_len=8192))) == {"space.max_model_len": MEASURED}


@pytest.mark.parametrize(
    ("changes", "path"),
    [
        ({"workload": {"input_len": 1024, "output_len": 32}}, "workload.input_len"),
        ({"arrival": {"concurrency": 8, "requests": 10}}, "arrival.concurrency"),
        ({"target": {**JOB["target"], "model": "qwen2.5-7b"}}, "target.model"),
        ({"target": {**JOB["target"], "gpu": "h100-80gb"}}, "target.gpu"),
        ({"target": {**JOB["target"], "emulator": {"time_scale": 4}}}, "target.emulator.time_scale"),
        ({"target": {**JOB["target"], "launcher": "docker"}}, "target.launcher"),
        ({"objective": "max_rate", "arrival": {"rate": 2.0, "requests": 10}}, "objective"),
    ],
)
def test_what_was_measured_is_refused(changes: dict[str, Any], path: str) -> None:
    found = kinds(job(), job(**changes))
    assert found[path] == MEASURED


def test_the_image_is_measured_only_for_the_launcher_that_runs_it() -> None:
    docker = {**JOB["target"], "launcher": "docker", "gpu": "l4"}
    image = {"image": "vllm/vllm-openai:v0.9.0"}
    assert kinds(job(target=docker), job(target={**docker, "docker": image})) == {"target.docker.image": MEASURED}
    assert kinds(job(), job(target={**JOB["target"], "docker": image})) == {"target.docker.image": UNMEASURED}


def test_the_refusal_is_one_line_naming_each_difference_and_the_way_forward() -> None:
    after = job(workload={"input_len": 1024, "output_len": 32}, target={**JOB["target"], "gpu": "a100-80gb"})
    change = compare(normalised(job().as_record()), after.as_record())
    line = change.refusal("fake")
    assert "\n" not in line and "workload.input_len 256 -> 1024" in line and "target.gpu l4 -> a100-80gb" in line
    assert "--new-study NAME" in line


# -- a rerun, on a fake launcher ------------------------------------------------------------------------------


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'study.db'}"


def run(j: Job, url: str, events: list[str] | None = None) -> optuna.Study:
    said = events if events is not None else []
    tuning = TuningRun(
        j, FakeLauncher(), storage_url=url, measure=fake_measure(), poll_s=0.1, on_event=said.append, rejudge=rejudge
    )
    try:
        tuning.run()
        return optuna.load_study(study_name=j.study.name, storage=url)
    finally:
        tuning.close()


def no_trial_burned(study: optuna.Study) -> None:
    assert {t.state for t in study.get_trials(deepcopy=False)} == {TrialState.COMPLETE}


def test_an_unmeasured_edit_continues_the_study(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    run(job(), url)
    events: list[str] = []
    study = run(job(budget={"n_trials": 6}, sampler={"name": "random", "seed": 7}), url, events)
    no_trial_burned(study)
    assert sum(t.user_attrs.get("duplicate_of") is None for t in study.trials) == 6
    assert any(e.startswith("job changed (unmeasured): budget.n_trials 4 -> 6") for e in events)
    assert study.user_attrs["job"]["sampler"]["seed"] == 7


def test_new_slos_rejudge_the_stored_trials_and_status_shows_them(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    first = run(job(), url)
    # The fake's e2e grows with max_num_seqs: 32 sequences take 1.5 s, inside 2 s and outside 1.2 s.
    at_32 = [t.number for t in first.trials if t.user_attrs["flags"]["max_num_seqs"] == 32]
    assert at_32 and all(first.trials[n].user_attrs["feasible"] for n in at_32)
    events: list[str] = []
    tighter = ["e2e_p95 <= 1.2s", "success_rate >= 0.9"]
    study = run(job(slos=tighter), url, events)
    no_trial_burned(study)
    said = next(e for e in events if e.startswith("judged again under e2e_p95<=1.2s"))
    assert f"1 verdicts moved (#{at_32[0]} now misses e2e_p95<=1.2s)" in said
    for n in at_32:
        t = study.trials[n]
        assert t.user_attrs["feasible"] is False and t.constraints["slo:e2e_p95<=1.2s"] > 0
        assert "slo:e2e_p95<=2s" not in t.constraints
    assert all(t.number not in at_32 for t in study.best_trials)
    view = study_view(study)
    assert view.slos == tighter and view.job.latency_metric is None
    assert study.user_attrs["job"]["slos"] == tighter
    assert [t.verdict for t in view.trials if t.number in at_32] == ["misses e2e_p95<=1.2s"] * len(at_32)
    # Run again unchanged: nothing is judged again.
    events.clear()
    run(job(slos=tighter), url, events)
    assert not any(e.startswith(("job changed", "judged again")) for e in events)


@pytest.mark.parametrize(
    "edited",
    [
        {"choices": [8, 16, 48, 64, 128]},  # the reported case: Optuna's "dynamic value space" error
        {"choices": [8, 16]},
        {"low": 8, "high": 24},  # choices turned into a range
        {"low": 4, "high": 128, "log": True},
    ],
)
def test_an_edited_space_continues_without_burning_a_trial(tmp_path: Path, edited: dict[str, Any]) -> None:
    url = sqlite_url(tmp_path)
    first = run(job(), url)
    before = {t.number: t.user_attrs["flags"]["max_num_seqs"] for t in first.trials}
    events: list[str] = []
    edited_job = job(space=space(max_num_seqs=edited), budget={"n_trials": 7})
    study = run(edited_job, url, events)
    no_trial_burned(study)
    assert sum(t.user_attrs.get("duplicate_of") is None for t in study.trials) == 7
    assert any(e.startswith("job changed (space): space.max_num_seqs") for e in events)
    dist = edited_job.search_space().distributions["max_num_seqs"]
    for t in study.trials:
        if "max_num_seqs" in t.params:
            assert t.distributions["max_num_seqs"] == dist  # every stored value carried onto the new distribution
        elif not t.user_attrs["baseline"]:
            # Outside the new space: history, its flags kept as measured.
            assert t.number in before and t.user_attrs["flags"]["max_num_seqs"] == before[t.number]
            assert f"#{t.number}" in next(e for e in events if e.startswith("space:"))
    for t in study.trials[len(before) :]:
        if not t.user_attrs["baseline"]:
            assert dist._contains(dist.to_internal_repr(t.user_attrs["flags"]["max_num_seqs"]))


def test_a_measured_change_is_refused_with_one_line_and_nothing_written(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    first = run(job(), url)
    trials, attrs = len(first.trials), dict(first.user_attrs)
    edited = job(workload={"input_len": 1024, "output_len": 32}, slos=["e2e_p95 <= 1s", "success_rate >= 0.9"])
    with pytest.raises(ConfigError) as refused:
        TuningRun(edited, FakeLauncher(), storage_url=url, measure=fake_measure(), rejudge=rejudge)
    line = str(refused.value)
    assert "\n" not in line and "workload.input_len 256 -> 1024" in line and "--new-study NAME" in line
    after = optuna.load_study(study_name="fake", storage=url)
    assert len(after.trials) == trials and dict(after.user_attrs) == attrs


def write_job(folder: Path, name: str, **changes: Any) -> Path:
    data = {**JOB, **changes, "study": {**JOB["study"], "storage": sqlite_url(folder)}}
    path = folder / name
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def tuner(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str]:
    """`tuner ARGS` through the real entry point (tests/conftest.run_main): its exit code and all it printed."""
    monkeypatch.setenv("COLUMNS", "220")
    capsys.readouterr()
    code, out, err = run_main(list(args), capsys, monkeypatch)
    return code, out + err


def test_the_cli_refuses_with_exit_2_and_the_dry_run_says_what_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run(job(study={**JOB["study"], "storage": sqlite_url(tmp_path)}), sqlite_url(tmp_path))
    refused = write_job(tmp_path, "longer.yaml", workload={"input_len": 1024, "output_len": 32})
    code, out = tuner(capsys, monkeypatch, "tune", str(refused))
    assert code == 2 and "Traceback" not in out
    assert len([line for line in out.splitlines() if line.strip()]) == 1
    assert "workload.input_len 256 -> 1024" in out and "--new-study" in out
    code, out = tuner(capsys, monkeypatch, "tune", str(refused), "--dry-run")
    assert code == 2 and "workload.input_len 256 -> 1024" in out
    # Under a name of its own the same job is a new study in the same storage: nothing to refuse.
    code, out = tuner(capsys, monkeypatch, "tune", str(refused), "--dry-run", "--new-study", "fake-1024")
    assert code == 0 and "job file is valid" in out and "job changed" not in out
    edited = write_job(
        tmp_path,
        "edited.yaml",
        slos=["e2e_p95 <= 1.2s", "success_rate >= 0.9"],
        space=space(max_num_seqs={"choices": [8, 16]}),
    )
    code, out = tuner(capsys, monkeypatch, "tune", str(edited), "--dry-run")
    assert code == 0, out
    assert "job changed (verdicts)" in out and "verdicts would move" in out
    # The dry run wrote nothing: the study still holds its first SLOs.
    assert optuna.load_study(study_name="fake", storage=sqlite_url(tmp_path)).user_attrs["slos"] == JOB["slos"]


def test_the_confirmation_starts_no_flag_set_outside_the_space(tmp_path: Path) -> None:
    """The fake's 32 sequences lead the first run; narrowed to 8 and 16, they are history: the confirmation starts
    the baseline and the flag sets of the space again, never #32's (its parameters no longer read in the space)."""
    url = sqlite_url(tmp_path)
    first = run(job(), url)
    assert any(t.user_attrs["flags"]["max_num_seqs"] == 32 for t in first.trials)
    study = run(job(space=space(max_num_seqs={"choices": [8, 16]}), budget={"n_trials": 5, "confirm": 2}), url)
    no_trial_burned(study)
    starts = [t for t in study.trials if t.user_attrs.get("repeat_of") is not None]
    assert starts
    for t in starts:
        first = study.trials[t.user_attrs["repeat_of"]]
        assert t.user_attrs["flags"] == first.user_attrs["flags"]  # the flag set started again, not another
        assert first.user_attrs["flags"]["max_num_seqs"] in (8, 16, 256)


@pytest.mark.parametrize("sampler", ["twin", "tpe", "grid"])
def test_each_kind_of_sampler_goes_on_in_an_edited_choices_list(tmp_path: Path, sampler: str) -> None:
    """The reported case, under the default sampler (the twin) and the samplers that model the stored trials."""
    url = sqlite_url(tmp_path)
    run(job(sampler={"name": sampler, "seed": 1}), url)
    edited = job(
        space=space(max_num_seqs={"choices": [8, 16, 48, 128]}),
        sampler={"name": sampler, "seed": 1},
        budget={"n_trials": 7},
    )
    study = run(edited, url)
    no_trial_burned(study)
    assert sum(t.user_attrs.get("duplicate_of") is None for t in study.trials) == 7


def test_another_vllm_is_measured() -> None:
    from tuner.study.vllm_version import version_to_run
    from tuner.vllm_pin import PINNED_VLLM

    same = job().as_record()
    change = compare(same, same, stored_vllm="0.31.0", current_vllm="0.32.0")
    assert [(c.kind, c.text()) for c in change.changes] == [(MEASURED, "vLLM 0.31.0 -> 0.32.0")]
    assert compare(same, same, stored_vllm="0.32.0", current_vllm=None).changes == ()  # not known: not compared
    assert version_to_run(job()) == PINNED_VLLM  # the emulator imitates the pinned vLLM


def test_a_trial_left_running_by_a_killed_worker_is_carried_too(tmp_path: Path) -> None:
    """Its parameters are read by the next suggest as any trial's (Optuna compares a new distribution with the
    first stored one of the name, whatever its trial's state)."""
    url = sqlite_url(tmp_path)
    run(job(), url)
    storage = optuna.storages.RDBStorage(url)
    left = optuna.load_study(study_name="fake", storage=storage).ask()
    job().search_space().suggest(left)  # a worker killed after its suggest: RUNNING, under the old choices
    storage.record_heartbeat(left._trial_id)  # its last beat: the next run fails it after the grace period
    storage.engine.dispose()
    study = run(job(space=space(max_num_seqs={"choices": [8, 16, 48]}), budget={"n_trials": 6}), url)
    assert study.trials[left.number].state == TrialState.FAIL
    others = [t for t in study.trials if t.number != left.number]
    assert {t.state for t in others} == {TrialState.COMPLETE}
    assert sum(t.user_attrs.get("duplicate_of") is None for t in others) == 6
