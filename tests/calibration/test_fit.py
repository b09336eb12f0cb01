"""The fit recovers the coefficients of a server whose step times are known: the twin (the emulator's engine under
a job's load, in virtual time, its step times without spread) playing a server with a given profile, measured as the
probe measures a real one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tuner.calibration.build import engine_shape, fit_profile
from tuner.calibration.fit import LoadPoint, fit_coefficients
from tuner.calibration.probe import measured
from tuner.catalog import cpu_profile, get_gpu, load_model
from tuner.config import parse_job
from tuner.flags import VllmFlags, resolve
from tuner.step_profile import FittedFrom, StepCoefficients, StepProfile, load_profile
from tuner.twin.simulate import Coefficients, simulate

TRUE = StepCoefficients(
    step_overhead_s=3.0e-3, prefill_token_s=2.5e-5, decode_seq_s=2.0e-4, context_token_s=4.0e-7, request_latency_s=0.02
)
FLAGS = VllmFlags(max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=1024)
EXACT = Coefficients(step_jitter=0.0)  # every step the profile's time: a server whose step times are known
POINTS = [
    LoadPoint(concurrency=c, input_len=n, output_len=24, requests=max(16, 4 * c), warmup=max(2, c))
    for n in (128, 512)
    for c in (1, 4, 16)
]


def _profile(c: StepCoefficients) -> StepProfile:
    return StepProfile(
        device="cpu",
        model="llama-3.1-8b",
        vllm_version="0.32.0",
        block_size=128,
        max_num_seqs=16,
        max_num_batched_tokens=1024,
        coefficients=c,
        fitted_from=FittedFrom(source="synthetic", created="2026-01-01T00:00:00Z", points=[], relative_rms_error=0),
    )


def _job(point: LoadPoint, profile: Path, gpu: str = "cpu") -> Any:
    return parse_job(
        {
            "study": {"name": "fit"},
            "target": {"launcher": "emulator", "model": "llama-3.1-8b", "gpu": gpu, "profile": str(profile)},
            "space": {"max_num_seqs": {"choices": [16, 32]}, "max_model_len": 2048, "max_num_batched_tokens": 1024},
            "workload": {"input_len": point.input_len, "output_len": point.output_len},
            "arrival": {"concurrency": point.concurrency, "requests": point.requests, "warmup_requests": point.warmup},
            "request_timeout": 600,
        }
    )


@pytest.fixture
def known_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    path = tmp_path / "true.json"
    _profile(TRUE).write(path)
    return path


def test_the_fit_recovers_known_coefficients_from_the_twins_measurements(known_server: Path) -> None:
    observed = []
    for p in POINTS:
        point = simulate(_job(p, known_server), FLAGS, EXACT)
        assert point.started and not point.crashed
        observed.append((p, measured(point.records)))
    shape = engine_shape(load_model("llama-3.1-8b"), cpu_profile({"VLLM_CPU_KVCACHE_SPACE": "1"}), FLAGS)
    fit, rounds = fit_coefficients(shape, observed)
    for name, want in TRUE.model_dump().items():
        assert getattr(fit.coefficients, name) == pytest.approx(want, rel=1e-6), name
    assert fit.relative_rms_error < 1e-6
    assert rounds >= 2  # the request latency moves arrivals: the schedule had to be re-simulated under the fit


def test_the_fit_recovers_them_from_a_gpu_server_that_schedules_asynchronously(known_server: Path) -> None:
    """A GPU server runs vLLM's scheduler one step ahead: the steps a load is made of are not the synchronous
    ones, and the fit, counting them in the same engine, still describes every measured figure exactly."""
    h100 = get_gpu("h100-80gb")
    assert resolve(FLAGS, h100, load_model("llama-3.1-8b")).async_scheduling
    observed = [(p, measured(simulate(_job(p, known_server, "h100-80gb"), FLAGS, EXACT).records)) for p in POINTS]
    fit, _ = fit_coefficients(engine_shape(load_model("llama-3.1-8b"), h100, FLAGS), observed)
    for name, want in TRUE.model_dump().items():
        assert getattr(fit.coefficients, name) == pytest.approx(want, rel=1e-6), name
    # the same figures read as a synchronous server's are not exactly reproduced: the step order matters
    sync = FLAGS.model_copy(update={"async_scheduling": False})
    other, _ = fit_coefficients(engine_shape(load_model("llama-3.1-8b"), h100, sync), observed)
    assert other.relative_rms_error > 1e-4


def test_the_profile_written_reads_back_and_reproduces_each_point(known_server: Path, tmp_path: Path) -> None:
    observed = [(p, measured(simulate(_job(p, known_server), FLAGS, EXACT).records)) for p in POINTS[:4]]
    shape = engine_shape(load_model("llama-3.1-8b"), cpu_profile({"VLLM_CPU_KVCACHE_SPACE": "1"}), FLAGS)
    profile = fit_profile(shape, observed, served_model="m", vllm_version="0.32.0", source="synthetic")
    out = tmp_path / "fitted.json"
    profile.write(out)
    back = load_profile(out)
    assert back == profile
    assert back.fitted_from.source == "synthetic" and back.vllm_version == "0.32.0"
    assert (back.block_size, back.max_num_seqs, back.max_num_batched_tokens) == (128, 16, 1024)
    for fp, (_, m) in zip(back.fitted_from.points, observed, strict=True):
        assert fp.predicted_output_tok_s == pytest.approx(m.output_tok_s, rel=1e-6)
        assert fp.predicted_ttft_mean_s == pytest.approx(m.ttft_mean_s, rel=1e-6)


def test_a_profile_moves_the_twins_prediction_as_its_coefficients_say(known_server: Path, tmp_path: Path) -> None:
    slower = tmp_path / "slower.json"
    _profile(TRUE.model_copy(update={"decode_seq_s": 2 * TRUE.decode_seq_s})).write(slower)
    p = POINTS[2]  # 16 decoding sequences a step: the per-sequence cost is most of each step
    base = measured(simulate(_job(p, known_server), FLAGS, EXACT).records)
    slow = measured(simulate(_job(p, slower), FLAGS, EXACT).records)
    per_step = TRUE.step_overhead_s + 16 * TRUE.decode_seq_s + 16 * (p.input_len + 12) * TRUE.context_token_s
    assert slow.tpot_mean_s - base.tpot_mean_s == pytest.approx(16 * TRUE.decode_seq_s, rel=0.1)
    assert base.tpot_mean_s == pytest.approx(per_step, rel=0.15)


def test_too_few_points_cannot_fix_five_coefficients(known_server: Path) -> None:
    shape = engine_shape(load_model("llama-3.1-8b"), cpu_profile({"VLLM_CPU_KVCACHE_SPACE": "1"}), FLAGS)
    observed = [(POINTS[0], measured(simulate(_job(POINTS[0], known_server), FLAGS, EXACT).records))]
    with pytest.raises(Exception, match="cannot fix 5 coefficients"):
        fit_coefficients(shape, observed)
