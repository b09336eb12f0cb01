"""`tuner tune --parallel N` on a box of 4 fake GPUs (a stand-in `pynvml` first on PYTHONPATH) with the emulator.

The runs are real command lines in their own process group (tests/study/parallel_driver.py: `tuner tune` with a
barrier before each trial's load), so the workers, their servers, Ctrl-C and every pid are the real ones. While all
workers wait at the barrier the test reads every emulator process from /proc: its pid and the CUDA_VISIBLE_DEVICES
it was started with.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.trial import TrialState
from typer.testing import CliRunner

from tuner.cli import app
from tuner.config import parse_job
from tuner.errors import ConfigError
from tuner.record import INTERRUPTED, TrialRecord
from tuner.study.parallel import trial_gpu_range, worker_count

HERE = Path(__file__).parent
FAKE_NVML = HERE / "fake_nvml"
DRIVER = HERE / "parallel_driver.py"
WAIT_S = 600.0  # bounds a broken run; nothing here asserts a duration

JOB: dict[str, Any] = {
    "study": {"name": "par", "heartbeat_interval": 2, "grace_period": 60},
    "target": {"launcher": "emulator", "model": "llama-3.1-8b", "gpu": "l4", "emulator": {"time_scale": 50}},
    "space": {
        # Below the 4 users each admits another batch: flag sets the twin simulates alike are answered, not launched
        "max_num_seqs": {"choices": [1, 2, 3, 5]},
        "gpu_memory_utilization": {"choices": [0.86, 0.9]},
        "max_model_len": 2048,
    },
    "workload": {"input_len": 128, "output_len": 16, "seed": 1},
    "arrival": {"concurrency": 4, "requests": 8},
    "slos": ["e2e_p95 <= 60s", "success_rate >= 0.9"],
    "request_timeout": "60s",
    "budget": {"n_trials": 4, "confirm": 0},
    "sampler": {"seed": 1},  # the twin: deterministic, so only its reservations keep the workers' proposals apart
}


class Run:
    """One `tuner tune` through the driver, in a process group of its own, as a terminal would start it."""

    def __init__(self, tmp: Path, *args: str, job: dict[str, Any] | None = None, gpus: int = 4) -> None:
        self.tmp = tmp
        self.barrier = tmp / "barrier"
        self.barrier.mkdir(exist_ok=True)
        self.job_file = tmp / "job.yaml"
        self.job_file.write_text(yaml.safe_dump(job or JOB))
        self.tag = uuid.uuid4().hex
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(FAKE_NVML), str(HERE)]),
            "FAKE_NVML_GPUS": str(gpus),
            "TUNER_STATE_DIR": str(tmp / "state"),
            "TUNER_TEST_BARRIER": str(self.barrier),
            "TUNER_TEST_TAG": self.tag,  # every process of this run inherits it: how /proc tells them apart
            "COLUMNS": "200",
        }
        env.pop("CUDA_VISIBLE_DEVICES", None)
        self.proc = subprocess.Popen(
            [sys.executable, str(DRIVER), "tune", str(self.job_file), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def arrived(self, n: int) -> list[dict[str, Any]]:
        """Wait until `n` trials wait at the barrier (their servers up); what each wrote."""
        deadline = time.monotonic() + WAIT_S
        while len(files := sorted(self.barrier.glob("arrived-*.json"))) < n:
            if self.proc.poll() is not None:
                pytest.fail(f"the run ended before {n} trials ran at once:\n{self.proc.stdout.read()}")  # type: ignore[union-attr]
            assert time.monotonic() < deadline, f"{len(files)} of {n} trials reached the barrier"
            time.sleep(0.1)
        return [json.loads(f.read_text()) for f in files]

    def release(self) -> None:
        (self.barrier / "release").touch()

    def wait(self) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=WAIT_S)
        return self.proc.returncode, out

    def processes(self) -> dict[int, dict[str, str]]:
        """Every live process of this run: pid -> its cmdline and environment."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
            except OSError:
                continue
            env = dict(e.decode(errors="replace").partition("=")[::2] for e in environ if b"=" in e)
            if env.get("TUNER_TEST_TAG") == self.tag and state != "Z":
                found[int(entry.name)] = {"cmdline": cmdline, **env}
        return found

    def servers(self) -> dict[int, str]:
        """The emulator servers alive now: pid -> CUDA_VISIBLE_DEVICES."""
        return {
            pid: p.get("CUDA_VISIBLE_DEVICES", "")
            for pid, p in self.processes().items()
            if "tuner.emulator" in p["cmdline"] and "--port" in p["cmdline"]
        }

    def kill_all(self) -> None:
        for pid in self.processes():
            with _suppress():
                os.kill(pid, signal.SIGKILL)


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is ProcessLookupError


def _alive(pids: set[int]) -> dict[int, str]:
    """Which of `pids` still run, after a bounded wait for the ones on their way out (a SIGKILLed process has
    released its memory, and so its cmdline, a moment before it is gone); zombies count as gone."""
    deadline = time.monotonic() + 60
    while (left := _running(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _running(pids: set[int]) -> dict[int, str]:
    out = {}
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if state != "Z":
            out[pid] = cmdline
    return out


def _trials(tmp: Path) -> list[optuna.trial.FrozenTrial]:
    study = optuna.load_study(study_name="par", storage=f"sqlite:///{tmp / 'par.db'}")
    return study.get_trials(deepcopy=False)


@pytest.mark.slow
def test_parallel_4_runs_4_trials_at_once_on_4_device_sets_and_leaves_nothing(tmp_path: Path) -> None:
    run = Run(tmp_path, "--parallel", "4")
    try:
        arrived = run.arrived(4)
        servers = run.servers()
        workers = {a["worker_pid"] for a in arrived}
        seen = set(run.processes())
        run.release()
        code, out = run.wait()
    finally:
        run.kill_all()
    assert code == 0, out
    # Four servers at once, each told a device set of its own, the one its trial borrowed.
    assert sorted(servers.values()) == ["0", "1", "2", "3"], servers
    assert len(workers) == 4
    assert sorted(",".join(a["devices"]) for a in arrived) == ["0", "1", "2", "3"]
    # No trial lost, none run twice: the budget's 4 trials, 4 distinct flag sets, every one measured.
    trials = _trials(tmp_path)
    records = [TrialRecord.from_attrs(t.user_attrs) for t in trials]
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4, [(t.number, t.state) for t in trials]
    assert all(r.outcome == "measured" and r.duplicate_of is None for r in records)
    assert len({json.dumps(r.flags, sort_keys=True) for r in records}) == 4
    assert sorted(d for r in records for d in r.devices) == ["0", "1", "2", "3"]
    assert "4 workers on GPUs 0, 1, 2, 3" in out
    for i in range(1, 5):
        assert f"worker {i}: finished (budget)" in out
    # Nothing behind: not a worker, not a server, not any process of the run.
    assert set(servers) <= seen and workers <= seen
    assert not _alive(seen), run.processes()


@pytest.mark.slow
def test_ctrl_c_stops_every_server_records_the_trials_interrupted_and_exits_130(tmp_path: Path) -> None:
    run = Run(tmp_path, "--parallel", "4")
    try:
        run.arrived(4)
        seen = run.processes()
        servers = run.servers()
        assert len(servers) == 4
        os.killpg(run.proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
        code, out = run.wait()
        left = _alive(set(seen))
    finally:
        run.kill_all()
    assert code == 130, out
    assert "interrupted: every worker's running trial is recorded as interrupted" in out
    assert "Traceback" not in out
    assert not left, f"left behind: {[seen[p]['cmdline'] for p in left]}"
    trials = _trials(tmp_path)
    assert len(trials) == 4
    assert all(t.state == TrialState.FAIL for t in trials)
    assert all(TrialRecord.from_attrs(t.user_attrs).outcome == INTERRUPTED for t in trials)


@pytest.mark.slow
def test_ctrl_c_sent_to_the_parent_alone_is_relayed_to_every_worker(tmp_path: Path) -> None:
    run = Run(tmp_path, "--parallel", "2")
    try:
        run.arrived(2)
        seen = run.processes()
        os.kill(run.proc.pid, signal.SIGINT)  # `kill -INT PID`: the workers hear of it only from the parent
        code, out = run.wait()
        left = _alive(set(seen))
    finally:
        run.kill_all()
    assert code == 130, out
    assert not left, f"left behind: {[seen[p]['cmdline'] for p in left]}"


@pytest.mark.slow
def test_a_killed_worker_s_trial_is_failed_by_the_heartbeat_and_run_again(tmp_path: Path) -> None:
    study = {"name": "par", "heartbeat_interval": 1, "grace_period": 3}
    job = {**JOB, "study": study, "budget": {"n_trials": 2, "confirm": 0}}
    run = Run(tmp_path, "--parallel", "2", job=job)
    try:
        arrived = run.arrived(2)
        victim = arrived[0]
        victim_server = next(p for p, d in run.servers().items() if d == ",".join(victim["devices"]))
        os.kill(victim["worker_pid"], signal.SIGKILL)
        (run.barrier / f"arrived-{victim['port']}.json").unlink()
        run.release()
        code, out = run.wait()
    finally:
        run.kill_all()
    assert code == 0, out
    assert "worker " in out and "died (exit -9)" in out
    trials = _trials(tmp_path)
    states = sorted(t.state.name for t in trials)
    assert states == ["COMPLETE", "COMPLETE", "FAIL"], states
    failed = next(t for t in trials if t.state == TrialState.FAIL)
    retry = next(t for t in trials if t.system_attrs.get("failed_trial") == failed.number)
    assert retry.state == TrialState.COMPLETE
    assert not _alive({victim_server}), "the killed worker's server was not removed"


@pytest.mark.parametrize(
    ("given", "needle"),
    [
        ("0", "--parallel 0: give a number of workers (1 or more) or auto"),
        ("-2", "--parallel -2: give a number of workers (1 or more) or auto"),
        ("four", "--parallel 'four': give a number of workers (1 or more) or auto"),
        ("5", "--parallel 5: more workers than GPUs; this machine has 4 GPUs (0, 1, 2, 3)"),
    ],
)
def test_bad_parallel_is_one_line_and_exit_2(tmp_path: Path, given: str, needle: str) -> None:
    code, out = Run(tmp_path, "--parallel", given).wait()
    assert code == 2, out
    assert needle in out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    assert not (tmp_path / "par.db").exists()


GPUS = ("0", "1", "2", "3")


def _tp(spec: Any) -> Any:
    return parse_job({**JOB, "space": {**JOB["space"], "tensor_parallel_size": spec}})


def test_auto_is_the_gpus_over_the_largest_trial() -> None:
    assert worker_count("auto", parse_job(JOB), GPUS) == 4
    assert worker_count("auto", _tp({"choices": [1, 2]}), GPUS) == 2
    assert worker_count("auto", _tp(4), GPUS) == 1
    assert trial_gpu_range(_tp({"choices": [1, 2, 4]})) == (1, 4)
    # A searched size: workers up to the GPUs over the smallest trial, the larger trials borrow more.
    assert worker_count("4", _tp({"choices": [1, 2]}), GPUS) == 4


@pytest.mark.parametrize(
    ("given", "spec", "gpus", "needle"),
    [
        ("3", 2, GPUS, "--parallel 3: more workers than GPUs; this machine has 4 GPUs (0, 1, 2, 3), which run at "
         "most 2 trials of 2 GPUs at once; give 1 to 2, or auto"),
        ("auto", {"choices": [1, 8]}, GPUS, "a trial of the space needs up to 8 GPUs"),
        ("2", None, (), "--parallel 2: no GPU found on this machine"),
        ("2", None, (), "name the GPUs to use in CUDA_VISIBLE_DEVICES (e.g. CUDA_VISIBLE_DEVICES=0,1), or give "
         "--parallel 1"),
    ],
)  # fmt: skip
def test_more_workers_than_the_gpus_hold_is_one_clear_line(
    given: str, spec: Any, gpus: tuple[str, ...], needle: str
) -> None:
    with pytest.raises(ConfigError) as e:
        worker_count(given, parse_job(JOB) if spec is None else _tp(spec), gpus)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_parallel_1_needs_no_gpu() -> None:
    assert worker_count("1", parse_job(JOB), ()) == 1


def test_help_shows_parallel_with_an_example() -> None:
    result = CliRunner().invoke(app, ["tune", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "--parallel" in result.stdout and "tuner tune job.yaml --parallel auto" in result.stdout


@pytest.mark.postgres
def test_parallel_workers_share_a_postgresql_study(tmp_path: Path, postgres_url: str) -> None:
    (tmp_path / "barrier").mkdir()
    (tmp_path / "barrier" / "release").touch()  # no waiting: the workers only share the study
    run = Run(tmp_path, "--parallel", "2", "--storage", postgres_url)
    try:
        code, out = run.wait()
    finally:
        run.kill_all()
    assert code == 0, out
    storage = optuna.storages.RDBStorage(postgres_url)
    try:
        trials = optuna.load_study(study_name="par", storage=storage).get_trials(deepcopy=False)
    finally:
        storage.remove_session()
        storage.engine.dispose()  # before the fixture drops the database
    records = [TrialRecord.from_attrs(t.user_attrs) for t in trials]
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    assert len({json.dumps(r.flags, sort_keys=True) for r in records}) == 4
    assert {d for r in records for d in r.devices} == {"0", "1"}
    assert not (tmp_path / "par.db").exists()
