"""A job whose arrival is a trace: read relative to the job file, its problems one line each (exit 2), its shape in
the dry run, and replayed by the twin in virtual time with the trace's shared blocks served by the prefix cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

from tuner.box import replica_arrival
from tuner.cli import app
from tuner.cli.trial_lines import search_trace_rate, trial_line
from tuner.config import load_job
from tuner.errors import ConfigError
from tuner.flags import VllmFlags
from tuner.load import Arrival
from tuner.load.trace_replay import reusable_tokens
from tuner.record import MEASURED, TrialRecord
from tuner.store.store import open_store
from tuner.twin.sampler import twin_unsupported
from tuner.twin.simulate import simulate

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "tests" / "data" / "traces"

JOB = """
study: {name: replay}
target: {launcher: emulator, model: llama-3.1-8b, gpu: h100-80gb, emulator: {time_scale: 20}}
space:
  max_num_seqs: {choices: [8, 16]}
  max_model_len: 4096
arrival: {trace: t.jsonl}
slos: ["e2e_p95 <= 20s", "success_rate >= 0.99"]
budget: {n_trials: 2}
"""


def _job(tmp_path: Path, trace: str, *, arrival: str = "{trace: t.jsonl}", extra: str = "") -> Path:
    (tmp_path / "t.jsonl").write_text(trace)
    path = tmp_path / "job.yaml"
    path.write_text(JOB.replace("arrival: {trace: t.jsonl}", f"arrival: {arrival}") + extra)
    return path


def test_the_trace_is_read_beside_the_job_file(tmp_path: Path) -> None:
    job = load_job(_job(tmp_path, (TRACES / "mooncake.jsonl").read_text()))
    assert job.arrival.trace == tmp_path / "t.jsonl"
    assert len(job.arrival.trace_requests()) == 4 and job.longest_request() == 1240


@pytest.mark.parametrize(
    ("trace", "arrival", "extra", "said"),
    [
        (
            '{"t": 0, "input_len": 5, "output_len": 1}\n{"t": "x", "input_len": 5, "output_len": 1}\n',
            None,
            "",
            "arrival.trace: trace {dir}/t.jsonl: line 2: 't' is 'x', not a number",
        ),
        (
            '{"t": 0, "input_len": 5, "output_len": 1}\n',
            "{trace: t.jsonl, start_s: 60}",
            "",
            "arrival: the trace's slice from 60 s to its end holds no request (the trace spans 0 s)",
        ),
        (
            '{"t": 0, "input_len": 5, "output_len": 1}\n',
            "{rate: 2, requests: 5, speedup: 2}",
            "",
            "arrival: speedup applies to a trace",
        ),
        (
            '{"t": 0, "input_len": 5, "output_len": 1}\n',
            "{trace: t.jsonl, burstiness: 0.5}",
            "",
            "arrival: burstiness shapes a rate's gaps; a trace sends at its own times",
        ),
        (
            '{"t": 0, "input_len": 5, "output_len": 1}\n',
            "{trace: t.jsonl, rate: 2}",
            "",
            "give exactly one of concurrency (closed loop), rate (open loop, requests/s) or trace",
        ),
        (
            '{"t": 0, "input_len": 5, "output_len": 1}\n',
            None,
            "objective: max_rate\n",
            "objective: max_rate plays the trace faster or slower to each rate it tries, and the slice has one "
            "request: give a slice of requests at two times at least, or objective: throughput",
        ),
        (
            '{"t": 5, "input_len": 5, "output_len": 1}\n{"t": 5, "input_len": 6, "output_len": 1}\n',
            None,
            "objective: goodput\n",
            "objective: goodput plays the trace faster or slower to each rate it tries, and the slice has every "
            "request at 0 s",
        ),
    ],
)
def test_a_bad_trace_job_is_one_line(tmp_path: Path, trace: str, arrival: str | None, extra: str, said: str) -> None:
    path = _job(tmp_path, trace, arrival=arrival or "{trace: t.jsonl}", extra=extra)
    with pytest.raises(ConfigError) as e:
        load_job(path)
    assert said.format(dir=tmp_path) in str(e.value) and "\n" not in str(e.value)


def test_a_max_model_len_shorter_than_the_trace_s_requests_is_an_error(tmp_path: Path) -> None:
    path = _job(tmp_path, (TRACES / "mooncake.jsonl").read_text())
    path.write_text(path.read_text().replace("max_model_len: 4096", "max_model_len: 1024"))
    with pytest.raises(ConfigError) as e:
        load_job(path)
    assert "is shorter than 2 of the trace slice's 4 measured requests (its input + output lengths)" in str(e.value)
    assert "raise max_model_len to at least 1240 or cut a slice without them" in str(e.value)


def test_a_bad_row_exits_2_with_one_line(tmp_path: Path) -> None:
    path = _job(tmp_path, '{"t": 0, "input_len": 5, "output_len": 1}\n{"t": 1, "input_len": -3, "output_len": 1}\n')
    done = subprocess.run(
        [sys.executable, "-m", "tuner", "tune", "--dry-run", str(path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "line 2: 'input_len' is -3; a length is a whole number of tokens >= 0" in " ".join(done.stderr.split())


def test_the_dry_run_shows_the_slice_and_the_sorting_note(tmp_path: Path) -> None:
    rows = [(3, 300), (0, 100), (70, 700)]
    text = "".join(f'{{"t": {t}, "input_len": {n}, "output_len": 9}}\n' for t, n in rows)
    result = CliRunner().invoke(app, ["tune", str(_job(tmp_path, text)), "--dry-run"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())  # as read, whatever the terminal's wrapping
    assert "its rows were not in time order; sorted by time" in out
    assert "trace slice: 3 requests over 70 s of replay" in out and "requests per 10 s: " in out
    assert "input/output tokens: p50 300/9 p90 700/9 p99 700/9" in out
    assert "reusable" not in out  # no hash ids: nothing to say about reuse


def test_the_shipped_trace_job_validates_and_shows_its_reuse() -> None:
    result = CliRunner().invoke(app, ["tune", str(ROOT / "search_spaces" / "emulator-trace.yaml"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "prompt tokens reusable (shared hash ids): 70%" in result.output


def test_the_shipped_goodput_trace_job_says_what_its_search_scales() -> None:
    path = ROOT / "search_spaces" / "emulator-trace-goodput.yaml"
    result = CliRunner().invoke(app, ["tune", str(path), "--dry-run"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "goodput search: each step replays the slice sped up to the rate it tries, speed-up = rate / 1.96" in out
    assert "234 requests a step" in out and "sampler: twin" in out


def test_the_twin_replays_the_trace_and_its_prefix_hits_are_the_reusable_share(tmp_path: Path) -> None:
    job = load_job(_job(tmp_path, (TRACES / "mooncake.jsonl").read_text(), arrival="{trace: t.jsonl, speedup: 0.5}"))
    point = simulate(job, VllmFlags(max_num_seqs=8, max_model_len=4096, enable_prefix_caching=True))
    assert [r.prompt_tokens for r in point.records] == [1200, 700, 1100, 300]
    assert [r.completion_tokens for r in point.records] == [40, 12, 80, 5]
    # sent at the trace's times, slowed by half: 0, 0.5, 3 and 8 s of virtual time
    assert [r.start_s for r in point.records] == pytest.approx([0.0, 0.5, 3.0, 8.0])
    reusable = sum(reusable_tokens(job.arrival.trace_requests(), job.arrival.block_tokens))
    assert point.prefix_queries == 3300 and point.prefix_hits == reusable == 1536
    off = simulate(job, VllmFlags(max_num_seqs=8, max_model_len=4096, enable_prefix_caching=False))
    assert off.prefix_hits == 0


@pytest.mark.slow
def test_tuner_tune_replays_a_trace_on_the_emulator(tmp_path: Path) -> None:
    """The whole loop on a trace: twin-first search in virtual time, then emulated servers sent the trace's
    requests at its times; every measured trial's requests are the trace's."""
    path = _job(tmp_path, (TRACES / "mooncake.jsonl").read_text(), arrival="{trace: t.jsonl, speedup: 2}")
    done = subprocess.run(
        [sys.executable, "-m", "tuner", "tune", str(path), "--log-file", str(tmp_path / "study.log")],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("TUNER_STORAGE")} | {"COLUMNS": "200"},
        check=False,
        timeout=1800,  # not a bound on its speed: a hang must end the run rather than block CI
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (tmp_path / "study.log").read_text()
    assert "twin: " in log and "trial 0:" in log
    url = f"sqlite:///{tmp_path / 'replay.db'}"
    trials = optuna.load_study(study_name="replay", storage=url).trials
    told = {t.number: TrialRecord.from_attrs(t.user_attrs) for t in trials}
    # a flag set the twin simulates as one measured is answered from it, with no records of its own
    measured = [n for n, r in told.items() if r.outcome == MEASURED and not r.is_duplicate]
    assert measured
    store = open_store(url, migrate=False)
    try:
        for number in measured:
            records = store.request_records("replay", number)
            assert [(r.prompt_tokens, r.completion_tokens) for r in records] == [
                (1200, 40), (700, 12), (1100, 80), (300, 5)
            ]  # fmt: skip
    finally:
        store.close()


BURSTY = TRACES / "mooncake-bursty.jsonl"  # 48 requests over 23 s: 1 req/s with two bursts of 12 within a second


def _rate_job(tmp_path: Path, objective: str, slo: str = "ttft_p95 <= 100ms") -> Path:
    path = _job(tmp_path, BURSTY.read_text(), extra=f"objective: {objective}\n")
    path.write_text(path.read_text().replace("e2e_p95 <= 20s", slo))
    return path


@pytest.mark.parametrize("objective", ["max_rate", "goodput"])
def test_the_twin_searches_the_rate_a_trace_can_be_played_at(tmp_path: Path, objective: str) -> None:
    job = load_job(_rate_job(tmp_path, objective))
    assert twin_unsupported(job) is None
    own = job.arrival.trace_rate()
    assert own == pytest.approx(47 / 23)
    found = {}
    for seqs in (8, 16):
        point = simulate(job, VllmFlags(max_num_seqs=seqs, max_model_len=4096))
        steps = point.rate_steps
        met = [s.rate for s in steps if s.meets_slos]
        assert point.rate is not None and point.rate == max(met)
        assert all(s.rate > point.rate for s in steps if not s.meets_slos) and len(steps) > len(met)
        assert all(s.speedup == pytest.approx(s.rate / own) for s in steps)
        # the point is the best step's: the whole trace, its lengths, judged as the study judges it
        assert [(r.prompt_tokens, r.completion_tokens) for r in sorted(point.records, key=lambda r: r.index)] == [
            (r.input_len, r.output_len) for r in job.arrival.trace_requests()
        ]
        summary = point.summary(job)
        assert summary is not None
        judged = [job.goodput_slo()] if objective == "goodput" else job.parsed_slos()
        assert all(slo.met(summary) for slo in judged)
        found[seqs] = point.rate
    assert found[16] > found[8]  # a batch of 16 takes a burst a batch of 8 queues


def test_a_rate_search_on_a_trace_says_what_it_scales_in_the_dry_run(tmp_path: Path) -> None:
    path = _rate_job(tmp_path, "goodput")
    path.write_text(path.read_text().replace("{trace: t.jsonl}", "{trace: t.jsonl, speedup: 4}"))
    result = CliRunner().invoke(app, ["tune", str(path), "--dry-run"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "trace slice: 48 requests over 6 s of replay (8.17 req/s on average)" in out
    assert "goodput search: each step replays the slice sped up to the rate it tries," in out
    assert "speed-up = rate / 2.04 req/s; its bursts, lengths and shared blocks kept" in out
    assert "48 requests a step (capacity_search.requests_per_step does not apply)" in out
    assert "the first step at x4 (8.17 req/s: arrival.speedup) at most 6 steps" in out
    said = result.output[result.output.index("goodput search") :].splitlines()[:5]
    assert said[-1] == "  at most 6 steps (capacity_search.max_steps)" and all(len(line) < 80 for line in said)


@pytest.mark.slow
def test_a_goodput_study_on_the_emulator_finds_the_rate_a_trace_can_be_played_at(tmp_path: Path) -> None:
    """Twin-first, then emulated servers each searched by replaying the trace faster or slower; every measured
    trial records the rate found and replays the whole trace; `tuner calibrate --study` fits the trials."""
    path = _rate_job(tmp_path, "goodput", "ttft_p95 <= 2s")
    text = (
        path.read_text().replace("time_scale: 20", "time_scale: 10").replace("choices: [8, 16]", "choices: [8, 16, 32]")
    )
    path.write_text(text.replace("n_trials: 2", "n_trials: 3, confirm: 0"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNER_STORAGE")} | {"COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "tuner", "tune", str(path), "--log-file", str(tmp_path / "study.log")],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=1800,  # not a bound on its speed: a hang must end the run rather than block CI
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (tmp_path / "study.log").read_text()
    assert "twin predicted" in log and "req/s (the trace x" in log
    url = f"sqlite:///{tmp_path / 'replay.db'}"
    records = [TrialRecord.from_attrs(t.user_attrs) for t in optuna.load_study(study_name="replay", storage=url).trials]
    measured = [r for r in records if r.outcome == MEASURED]
    assert measured and all(r.request_rate is not None and r.request_rate > 0 for r in measured)
    lengths = [(r.input_len, r.output_len) for r in load_job(path).arrival.trace_requests()]
    store = open_store(url, migrate=False)
    try:
        for number in range(len(records)):
            assert [(r.prompt_tokens, r.completion_tokens) for r in store.request_records("replay", number)] == lengths
    finally:
        store.close()
    fitted = subprocess.run(
        [
            sys.executable,
            "-m",
            "tuner",
            "calibrate",
            "--study",
            "replay",
            "--storage",
            url,
            "-o",
            str(tmp_path / "p.json"),
        ],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=600,
    )
    assert fitted.returncode == 0, fitted.stdout[-3000:] + fitted.stderr[-3000:]
    assert "3 of 3 trials measured in full" in fitted.stdout


def test_a_box_s_replica_plays_the_trace_n_times_slower() -> None:
    share = replica_arrival(Arrival(trace=TRACES / "mooncake.jsonl", speedup=2, max_in_flight=8), 4)
    assert share.rate is None and share.speedup == 0.5 and share.max_in_flight == 2
    assert [r.send_s for r in share.trace_requests()] == pytest.approx([0.0, 0.5, 3.0, 8.0])


def test_the_twin_s_rate_on_a_box_is_one_replica_s(tmp_path: Path) -> None:
    alone = load_job(_rate_job(tmp_path, "max_rate"))
    path = _rate_job(tmp_path, "max_rate")
    path.write_text(path.read_text().replace("gpu: h100-80gb,", "gpu: h100-80gb, gpus: 2,"))
    box = load_job(path)
    assert box.box_gpus() == 2
    flags = VllmFlags(max_num_seqs=8, max_model_len=4096)
    # the study's search runs on one server at each rate; the box's rate is twice it (tuner.box)
    assert simulate(box, flags).rate == simulate(alone, flags).rate is not None


def test_a_rate_search_on_a_trace_s_trial_line_says_the_speed_up(tmp_path: Path) -> None:
    job = load_job(_rate_job(tmp_path, "goodput"))
    own = search_trace_rate(job)
    assert own == pytest.approx(47 / 23)
    attrs = {
        "outcome": "measured", "flags": {"max_num_seqs": 8}, "output_tok_s": 500.0, "success_rate": 1.0,
        "feasible": True, "request_rate": 3 * own,
    }  # fmt: skip
    trial = optuna.trial.create_trial(values=[500.0, 0.05], user_attrs=attrs)
    assert "500.0 tok/s at 6.13 req/s (the trace x3)" in trial_line(trial, own)
    plain = load_job(_job(tmp_path, BURSTY.read_text()))  # throughput: the trace's rate is its own
    assert search_trace_rate(plain) is None and "(the trace" not in trial_line(trial)
