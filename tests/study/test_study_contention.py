"""Each trial records what the machine was doing; an emulator that lagged is measured again, and where it lags
every time the study stops with the time_scale the machine can hold; a winner measured under other contention than
the baseline says so. Fakes throughout: a lag reader standing for an engine slowed on purpose, no timing bound."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import optuna
import pytest
from study_fakes import FakeLauncher, FakeServer, IdleHandle, fake_measure, job

from tests.conftest import run_main
from tuner.config import Job
from tuner.flags import VllmFlags
from tuner.launch import Server, StartupFacts
from tuner.launch.redact import Redactor
from tuner.load.contention import Contention
from tuner.load.host_contention import HostReading
from tuner.record import TrialRecord
from tuner.study import Measurement, TuningRun
from tuner.study.contention import compared_under
from tuner.study.lag import TimeScaleNotHeld
from tuner.study.measure import REMEASURES, measure_watched, watch_server


@pytest.fixture(autouse=True)
def _the_products_lag_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the lag itself: the study's own limit, not the suite's (tests/conftest.py)."""
    monkeypatch.delenv("TUNER_EMULATOR_LAG_LIMIT", raising=False)


class _Host:
    """Readings 10 wall seconds apart, others using `other_cores` of two CPUs."""

    def __init__(self, other_cores: float = 0.0) -> None:
        self.other = other_cores
        self.n = 0

    def read(self) -> HostReading:
        self.n += 1
        span = self.n // 2  # before/after pairs: each phase 10 s = 2000 jiffies on two CPUs
        busy = int(1000 * self.other) * span
        return HostReading(10.0 * self.n, 0.5, total=2000 * span, idle=2000 * span - busy, steal=0, own=0, cpus=2)


def _engine(lost_per_run: list[float]) -> Callable[[str], Awaitable[float | None]]:
    """An emulator's lag counter whose engine loses lost_per_run[i] emulated seconds in run i (the last repeats)."""
    state = {"reads": 0, "lag": 0.0}

    async def read(_url: str) -> float | None:
        run = state["reads"] // 2
        if state["reads"] % 2 == 1:  # the read after the run
            state["lag"] += lost_per_run[min(int(run), len(lost_per_run) - 1)]
        state["reads"] += 1
        return state["lag"]

    return read


def _runs() -> tuple[Callable[[], Awaitable[Measurement]], list[int]]:
    calls: list[int] = []

    async def run() -> Measurement:
        calls.append(1)
        return Measurement(None)

    return run, calls


async def _no_reset(_url: str) -> None:
    return None


async def test_a_lagged_run_is_measured_again_cold_and_kept_once_on_time() -> None:
    run, calls = _runs()
    resets: list[str] = []

    async def reset(url: str) -> None:
        resets.append(url)

    # 10 wall s at time_scale 4 is 40 emulated s: 8 s lost is 20%, 0.4 s is 1%
    m = await measure_watched(run, "http://emu", 4.0, sampler=_Host(), read_lag=_engine([8.0, 0.4]), reset=reset)
    assert len(calls) == 2 and resets == ["http://emu"]  # the prefix cache emptied before the run again
    assert m.contention is not None and not m.contention.lagged and m.contention.measured_again == 1
    assert m.contention.emulator_lag_share == pytest.approx(0.01)


async def test_a_run_lagged_every_time_is_kept_marked_lagged() -> None:
    run, calls = _runs()
    m = await measure_watched(run, "http://emu", 4.0, sampler=_Host(1.5), read_lag=_engine([8.0]), reset=_no_reset)
    assert len(calls) == 1 + REMEASURES
    assert m.contention is not None and m.contention.lagged and m.contention.measured_again == REMEASURES
    assert m.contention.other_cores == pytest.approx(1.5) and m.contention.time_scale == 4.0


async def test_a_server_without_lag_figures_is_measured_once() -> None:
    run, calls = _runs()

    async def vllm(_url: str) -> float | None:
        return None

    m = await measure_watched(run, "http://vllm", 1.0, sampler=_Host(), read_lag=vllm)
    assert len(calls) == 1 and m.contention is not None and m.contention.emulator_lag_s is None
    assert m.contention.other_cores == 0.0 and not m.contention.lagged


def _watched(lost_per_run: list[float], other_cores: float = 0.0) -> Callable[..., Awaitable[Measurement]]:
    inner = fake_measure()
    lag = _engine(lost_per_run)

    async def measure(server: FakeServer, j: Job, flags: VllmFlags) -> Measurement:
        return await measure_watched(
            lambda: inner(server, j, flags),
            server.base_url,
            4.0,
            sampler=_Host(other_cores),
            read_lag=lag,
            reset=_no_reset,
        )

    return measure


def _tune(tmp_path: Path, measure: Callable[..., Awaitable[Measurement]], events: list[str]) -> optuna.Study:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    tuning = TuningRun(job(), FakeLauncher(), storage_url=url, measure=measure, poll_s=0.1, on_event=events.append)
    try:
        tuning.run()
        return tuning.study
    finally:
        tuning.close()


def test_every_trial_records_its_machine(tmp_path: Path) -> None:
    events: list[str] = []
    # the baseline's first run lags (10 of 40 emulated s lost), every later run is on time
    study = _tune(tmp_path, _watched([10.0, 0.0], other_cores=0.2), events)
    assert any("trial 0: the emulator fell behind its clock in 1 run, measured again" in e for e in events)
    records = [TrialRecord.from_attrs(t.user_attrs) for t in study.trials]
    assert records and all(r.contention is not None for r in records)
    c = Contention.of(records[0].contention)
    assert c is not None and c.other_cores == pytest.approx(0.2) and c.emulator_lag_s == 0.0 and not c.lagged


def test_a_machine_that_cannot_hold_the_time_scale_stops_the_study_with_the_one_it_can(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    with pytest.raises(TimeScaleNotHeld) as stopped:
        _tune(tmp_path, _watched([10.0]), events)  # 25% of every run lost, at time_scale 4
    message = str(stopped.value)
    assert "cannot hold time_scale 4" in message and "about time_scale 2.4" in message and "\n" not in message
    study = optuna.load_study(study_name="fake", storage=f"sqlite:///{tmp_path / 'study.db'}")
    baseline = TrialRecord.from_attrs(study.trials[0].user_attrs)
    c = Contention.of(baseline.contention)
    assert len(study.trials) == 1 and c is not None and c.lagged and c.measured_again == REMEASURES
    shown = _cli(capsys, monkeypatch, "show", "fake", "0", "--storage", f"sqlite:///{tmp_path / 'study.db'}")
    assert "(emulator lagged)" in shown.splitlines()[0]
    line = next(x for x in shown.splitlines() if x.startswith("machine during the load:"))
    assert "emulator lag 25.0% of the run" in line and "LAGGED" in line and f"measured again {REMEASURES}x" in line
    status = _cli(capsys, monkeypatch, "status", "fake", "--storage", f"sqlite:///{tmp_path / 'study.db'}")
    machine = next(x for x in status.splitlines() if x.startswith("machine over 1 load phase:"))
    assert "emulator lag up to 25.0% of a run, 1 trial lagged, 2 runs measured again" in machine


def _cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    """`tuner ARGS` through the real entry point (tests/conftest.run_main), its output at a wide terminal."""
    monkeypatch.setenv("COLUMNS", "220")
    capsys.readouterr()
    return run_main(list(args), capsys, monkeypatch)[1]


def test_a_winner_measured_beside_busy_processes_says_so() -> None:
    def trial(number: int, contention: Contention | None) -> optuna.trial.FrozenTrial:
        attrs = {"contention": contention.model_dump(mode="json")} if contention else {}
        t = optuna.trial.create_trial(values=[1.0, 1.0], user_attrs=attrs)
        t.number = number
        return t

    trials = [trial(0, Contention(other_cores=0.1)), trial(1, Contention(other_cores=1.9)), trial(2, None)]
    line = compared_under(trials, ("#1", [1]), ("the baseline (#0)", [0]))
    assert line is not None and "different contention" in line and "tuner verify" in line
    assert compared_under(trials, ("#2", [2]), ("the baseline (#0)", [0])) is None
    assert compared_under(trials, ("the baseline (#0)", [0]), ("the baseline (#0)", [0])) is None


def test_a_verify_run_carries_its_machine_and_a_record_taken_on_another_says_so() -> None:
    from tuner.load.contention import contention_warning, pooled
    from tuner.verify import verify_flags

    busy = _watched([0.0], other_cores=1.8)
    flags = VllmFlags(max_num_seqs=16)
    v = verify_flags(job(), FakeLauncher(), flags, runs=2, recorded_tok_s=1.0, latency_metric="e2e_p95", measure=busy)
    assert [r.contention.other_cores for r in v.runs if r.contention] == pytest.approx([1.8, 1.8])
    quiet_record = Contention(other_cores=0.1)
    note = contention_warning(pooled([r.contention for r in v.runs]), quiet_record, "the re-test", "the record of #4")
    assert note is not None and "1.8 cores beside the re-test" in note


def test_a_sampler_repeat_of_a_lagged_trial_does_not_stop_the_study_again() -> None:
    from tuner.study.lag import stop_if_lagged

    lagged = Contention(lagged=True, emulator_lag_share=0.3, time_scale=40.0, measured_again=2)
    attrs = {"contention": lagged.model_dump(mode="json"), "outcome": "measured"}
    stop_if_lagged(9, attrs | {"duplicate_of": 4})
    with pytest.raises(TimeScaleNotHeld, match=r"time_scale 40: .* 30% .* trial 4; it can hold about time_scale 22"):
        stop_if_lagged(4, attrs)


def test_the_closing_lines_say_when_the_baseline_ran_beside_busy_processes(tmp_path: Path) -> None:
    inner = fake_measure()

    async def measure(server: FakeServer, j: Job, flags: VllmFlags) -> Measurement:
        busy = 1.9 if flags.max_num_seqs == 256 else 0.0  # the baseline (vLLM's default max_num_seqs) beside them
        return await measure_watched(
            lambda: inner(server, j, flags), server.base_url, 1.0, sampler=_Host(busy), read_lag=_vllm, reset=_no_reset
        )

    url = f"sqlite:///{tmp_path / 'study.db'}"
    tuning = TuningRun(job(), FakeLauncher(), storage_url=url, measure=measure, poll_s=0.1)
    try:
        closing = tuning.run().closing
    finally:
        tuning.close()
    line = next(x for x in closing if "different contention" in x)
    assert "against the baseline" in line and "1.9 beside the baseline (#0)" in line


async def _vllm(_url: str) -> float | None:
    return None


def _server_of(launcher: str, trial: int) -> Server:
    return Server(
        base_url=f"http://127.0.0.1:{8000 + trial}", model="m", facts=StartupFacts(), time_scale=1.0,
        handle=IdleHandle(), redactor=Redactor(), launcher=launcher,
    )  # fmt: skip


async def test_a_real_vllm_is_never_asked_for_the_emulators_lag() -> None:
    # A study's trials on real vLLM, each a fresh server, through the process and the Docker launcher: vLLM has no
    # /emulator/ routes and would log a 404 for each question, so none is asked.
    asked: list[str] = []

    def vllm(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(404, json={"detail": "Not Found"})

    run, calls = _runs()
    for trial in range(4):
        for launcher in ("process", "docker"):
            m = await watch_server(_server_of(launcher, trial), run, transport=httpx.MockTransport(vllm))
            assert m.contention is not None and m.contention.emulator_lag_s is None and not m.contention.lagged
    assert asked == [] and len(calls) == 8


async def test_the_emulator_is_asked_before_and_after_each_run() -> None:
    asked: list[str] = []
    behind = iter([1.25, 1.25])  # on time through the run: read once before it and once after

    def emulator(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(200, json={"behind_s": next(behind)})

    run, _ = _runs()
    m = await watch_server(_server_of("emulator", 0), run, transport=httpx.MockTransport(emulator))
    assert asked == ["/emulator/stats", "/emulator/stats"]
    assert m.contention is not None and m.contention.emulator_lag_s == 0.0 and not m.contention.lagged


def test_the_docker_launcher_marks_the_emulator_image_alone() -> None:
    from tuner.launch.docker import DockerLauncher

    assert DockerLauncher.for_emulator("tuner-emulator:dev").emulator
    assert not DockerLauncher("vllm/vllm-openai:v0.32.0", "meta-llama/Llama-3.1-8B-Instruct").emulator
