"""`tuner calibrate --study`: a profile fitted to the trials a study already measured, each replayed on its own
flags in the emulator's engine, no server started. The studies are tuned against a server whose step times are
known (tests/calibration/twin_study.py): the fit must find them again, and refuse, in one line, what it cannot
fit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from tests.calibration.test_calibrate_cli import run_cli
from tests.calibration.test_fit import TRUE, _profile
from tests.calibration.twin_study import tune_against_twin, twin_job
from tuner.launch.owner import pid_alive
from tuner.launch.registry import ProcessRegistry
from tuner.step_profile import StepCoefficients, StepProfile, load_profile

pytestmark = pytest.mark.slow

# A Llama of a few million parameters (a config is all the emulator reads of a model).
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


def tuned(tmp: Path, refuse: tuple[int, ...] = (), **changes: Any) -> tuple[str, dict[str, Any]]:
    """A study of the twin job (with `changes`) tuned in `tmp` against the known server; its URL and its job."""
    known = tmp / "known.json"
    _profile(TRUE).write(known)
    url = f"sqlite:///{tmp / 'study.db'}"
    data = twin_job(known, url, **changes)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # the CPU server's KV space, as its start-up would read it
        tune_against_twin(data, refuse)
    return url, data


def assert_recovers(profile: StepProfile, rel: float) -> None:
    for name, want in TRUE.model_dump().items():
        assert getattr(profile.coefficients, name) == pytest.approx(want, rel=rel), name


def test_a_cpu_study_gives_back_its_servers_step_times_from_the_trials_measured_in_full(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # max_num_seqs 32 never starts and a 1 s request timeout fails the slowest trials' requests: neither counts
    url, _ = tuned(tmp_path, refuse=(32,), request_timeout=1)
    out = tmp_path / "fitted.json"
    code, text = run_cli(["calibrate", "--study", "fit", "--storage", url, "-o", str(out)], capsys, monkeypatch)
    assert code == 0, text
    assert (
        "6 of 14 trials measured in full (4 repeats of another trial, 1 not measured (refused, failed or crashed), "
        "3 with failed requests left out)" in text
    )
    assert text.count("\ntrial ") == 6 and f"wrote {out}" in text
    assert "rms relative error over 18 figures from 6 trials (vLLM 0.32.0, cpu)" in text
    profile = load_profile(out)
    assert_recovers(profile, rel=1e-6)
    fitted = profile.fitted_from
    assert (fitted.source, fitted.study, fitted.url) == ("study", "fit", None)
    assert fitted.relative_rms_error < 1e-6
    assert (profile.device, profile.model, profile.vllm_version) == ("cpu", "llama-3.1-8b", "0.32.0")
    assert len({p.trial for p in fitted.points}) == 6 and all(p.concurrency == 16 for p in fitted.points)
    assert {p.flags["max_num_seqs"] for p in fitted.points} <= {1, 2, 4, 8, 16, 128}  # 128: the CPU default
    for p in fitted.points:
        assert p.predicted_output_tok_s == pytest.approx(p.measured_output_tok_s, rel=1e-6)
        assert p.predicted_ttft_mean_s == pytest.approx(p.measured_ttft_mean_s, rel=1e-6)
        assert p.predicted_tpot_mean_s == pytest.approx(p.measured_tpot_mean_s, rel=1e-6)


def test_a_gpu_study_named_by_its_job_file_gives_back_the_step_times_of_a_server_scheduling_asynchronously(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, data = tuned(tmp_path, target={"gpu": "h100-80gb"})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data))
    out = tmp_path / "h100.json"
    code, text = run_cli(["calibrate", "--job", str(job), "-o", str(out)], capsys, monkeypatch)
    assert code == 0, text
    assert "10 of 14 trials measured in full" in text and "(vLLM 0.32.0, h100-80gb)" in text
    profile = load_profile(out)
    assert profile.device == "h100-80gb" and profile.device_name == "NVIDIA H100 80GB HBM3"
    assert_recovers(profile, rel=1e-6)


def test_an_open_loop_study_gives_back_the_step_times_closely(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests sent at the recorded times whatever the server's speed: which step each joins moves with every
    coefficient, so the fit settles near the known server, not on it."""
    url, _ = tuned(tmp_path, arrival={"rate": 8, "requests": 48, "warmup_requests": 3})
    out = tmp_path / "fitted.json"
    code, text = run_cli(["calibrate", "--study", "fit", "--storage", url, "-o", str(out)], capsys, monkeypatch)
    assert code == 0, text
    profile = load_profile(out)
    assert all(p.concurrency is None for p in profile.fitted_from.points)
    assert_recovers(profile, rel=0.03)
    assert profile.fitted_from.relative_rms_error < 0.005


def test_too_few_trials_measured_in_full_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = tuned(tmp_path, refuse=(1, 2, 4, 8, 16, 32), budget={"n_trials": 3})
    code, text = run_cli(["calibrate", "--storage", url, "-o", str(tmp_path / "x.json")], capsys, monkeypatch)
    assert code == 2, text
    assert text.count("\n") == 1 and "Traceback" not in text
    assert "study 'fit': 1 of 3 trials measured in full (2 not measured (refused, failed or crashed) left out)" in text
    assert "the five step-time coefficients needs at least 3: let the study measure more, or probe" in text
    assert not (tmp_path / "x.json").exists()


def _optuna_only(tmp_path: Path, job: dict[str, Any] | None) -> str:
    """A study Optuna wrote without tuner: none of the project's tables, and the job only if given."""
    url = f"sqlite:///{tmp_path / 'plain.db'}"
    study = optuna.create_study(study_name="plain", storage=url)
    if job is not None:
        study.set_user_attr("job", job)
    return url


@pytest.mark.parametrize(
    ("with_job", "pattern"),
    [
        (True, "holds no per-request records for 'plain': the tuner's tables are missing"),
        (False, "study 'plain' holds no job (its workload and arrival): not a study `tuner tune` ran"),
    ],
)
def test_a_study_tuner_did_not_run_is_refused_in_one_line(
    with_job: bool, pattern: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    job = twin_job(tmp_path / "known.json", "sqlite:///x.db") if with_job else None
    url = _optuna_only(tmp_path, job)
    code, text = run_cli(["calibrate", "--study", "plain", "--storage", url, "-o", "x.json"], capsys, monkeypatch)
    assert code == 1, text
    assert pattern in text and text.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "code", "pattern"),
    [
        (["-o", "x.json"], 2, "give --url (probe a running server) or --study/--storage/--job"),
        (["--url", "http://h:1", "--study", "s", "-o", "x.json"], 2, "give one of the two"),
        (["--study", "s", "--concurrency", "4", "-o", "x.json"], 2, "--concurrency is for a probe (--url)"),
        (["--study", "s", "--max-num-seqs", "8", "-o", "x.json"], 2, "--max-num-seqs is for a probe (--url)"),
        (["--study", "s", "--storage", "sqlite:///{tmp}/none.db", "-o", "x.json"], 1, "no study storage at"),
        (["--study", "nope", "--storage", "sqlite:///{tmp}/plain.db", "-o", "x.json"], 1, "no study 'nope' in"),
        (["--study", "plain", "--storage", "sqlite:///{tmp}/plain.db", "--device", "v100", "-o", "x"], 2, "known GPUs"),
    ],
)
def test_bad_input_to_the_study_form_is_one_line(
    args: list[str],
    code: int,
    pattern: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _optuna_only(tmp_path, None)
    got, text = run_cli(["calibrate", *(a.format(tmp=tmp_path) for a in args)], capsys, monkeypatch)
    assert got == code, text
    assert pattern in text and "Traceback" not in text


def test_a_study_tuner_tune_ran_against_emulator_processes_gives_back_their_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole path: `tuner tune` launching emulator servers that serve the known profile (real processes, HTTP
    and time: the figures carry this machine's noise, and the latency the round trip), then `tuner calibrate
    --job` on what the study stored."""
    # A tiny model loads in no time: the servers' start-ups (an 8B's weights take 8 s each) are not tested here.
    known = tmp_path / "known.json"
    _profile(TRUE).write(known)
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    data = twin_job(known, f"sqlite:///{tmp_path / 'study.db'}", budget={"n_trials": 6})
    data["target"]["model"] = str(model)
    data["target"]["startup_timeout"] = "60s"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data))
    state = tmp_path / "state"
    env = {**os.environ, "TUNER_STATE_DIR": str(state), "VLLM_CPU_KVCACHE_SPACE": "1"}
    try:
        tune = subprocess.run(
            [sys.executable, "-m", "tuner", "tune", str(job)], env=env, capture_output=True, text=True, check=False
        )
    finally:
        for record in ProcessRegistry(state / "processes").records():  # no emulator of ours outlives the test
            if pid_alive(record.pid):
                os.killpg(record.pgid, signal.SIGKILL)
    assert tune.returncode == 0, tune.stdout + tune.stderr
    out = tmp_path / "fitted.json"
    code, text = run_cli(["calibrate", "--job", str(job), "-o", str(out)], capsys, monkeypatch)
    assert code == 0, text
    assert "6 of" in text and "trials measured in full" in text
    profile = load_profile(out)
    fitted = profile.fitted_from
    assert fitted.source == "study" and len({p.trial for p in fitted.points}) == 6

    # The fit's accuracy is the virtual-time tests' above (1e-6); here the figures carry this machine's load (under
    # stress-ng a term read 20% off, and noise may move cost from one term to another), so only what a misread record
    # would break: the time of a decode step (16 sequences of 300 tokens) and of a 1024-token prefill within a factor
    # of 3 of the server's (a unit slip is 1000x; swapping any two terms moves one of the two 6x or more).
    def steps(c: StepCoefficients) -> tuple[float, float]:
        decode = c.step_overhead_s + 16 * c.decode_seq_s + 16 * 300 * c.context_token_s
        return decode, c.step_overhead_s + 1024 * c.prefill_token_s

    for got, want in zip(steps(profile.coefficients), steps(TRUE), strict=True):
        assert 1 / 3 < got / want < 3, (profile.coefficients, TRUE)
    assert profile.coefficients.request_latency_s > 0


def test_a_conversation_study_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its records replayed as independent requests would fit a prefill the prefix cache never ran: a wrong profile.
    job = twin_job(tmp_path / "known.json", "sqlite:///x.db", workload={"conversations": {"turns": 3}})
    url = _optuna_only(tmp_path, job)
    code, text = run_cli(["calibrate", "--study", "plain", "--storage", url, "-o", "x.json"], capsys, monkeypatch)
    assert code == 1, text
    assert "study 'plain' ran a conversation workload" in text and text.count("\n") == 1
