"""The spread of step times (tuner.emulator.jitter): seeded, of the configured sigma, in the emulator and the twin."""

from __future__ import annotations

import io
import math
import re
import statistics
from pathlib import Path
from typing import Any

import pytest

from tuner.config import Job, parse_job
from tuner.emulator import Emulator, parse_config
from tuner.emulator.config import build_parser
from tuner.emulator.jitter import DEFAULT_STEP_JITTER, StepJitter
from tuner.errors import ConfigError
from tuner.flags import VllmFlags
from tuner.step_profile import FittedFrom, StepCoefficients, StepProfile
from tuner.twin.simulate import Coefficients, SimPoint, simulate

JOB: dict[str, Any] = {
    "study": {"name": "jitter"},
    "target": {"launcher": "emulator", "model": "llama-3.1-8b", "gpu": "l4"},
    "space": {"max_num_seqs": {"choices": [8, 16]}, "max_model_len": 4096},
    "workload": {"input_len": 256, "output_len": 64},
    "arrival": {"concurrency": 8, "requests": 96},
    "slos": ["e2e_p95 <= 10s"],
}
FLAGS = VllmFlags(max_num_seqs=16, max_model_len=4096)


def draws(sigma: float, seed: int, n: int) -> list[float]:
    jitter = StepJitter(sigma, seed)
    return [jitter.factor() for _ in range(n)]


def test_one_seed_gives_one_sequence_of_factors() -> None:
    assert draws(0.1, 7, 50) == draws(0.1, 7, 50)
    assert draws(0.1, 7, 50) != draws(0.1, 8, 50)


def test_the_factors_have_the_configured_spread_and_mean_one() -> None:
    for sigma in (0.08, 0.3):
        factors = draws(sigma, 1, 20_000)
        assert statistics.stdev(math.log(f) for f in factors) == pytest.approx(sigma, rel=0.03)
        assert statistics.fmean(factors) == pytest.approx(1.0, abs=0.01)  # throughput keeps the model's figure
    assert draws(0.0, 1, 10) == [1.0] * 10


def test_a_sigma_below_zero_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"sigma must be a finite number >= 0, got -0\.1$"):
        StepJitter(-0.1)
    with pytest.raises(ConfigError, match=r"^emulator argument error: argument --step-jitter: must be >= 0, got -1$"):
        parse_config(["--model", "llama-3.1-8b", "--step-jitter", "-1"])


def test_the_emulator_jitters_its_steps_by_its_flag() -> None:
    def jitter(*extra: str) -> StepJitter | None:
        emu = Emulator(parse_config(["--model", "llama-3.1-8b", *extra]), log_stream=io.StringIO())
        return emu.engine.jitter

    default = jitter()
    assert default is not None and default.sigma == DEFAULT_STEP_JITTER
    chosen = jitter("--step-jitter", "0.25", "--seed", "3")
    assert chosen is not None and chosen.sigma == 0.25
    assert [chosen.factor() for _ in range(5)] == draws(0.25, 3, 5)
    off = jitter("--step-jitter", "0")
    assert off is not None and {off.factor() for _ in range(5)} == {1.0}
    # the help names the default the engine uses, with an example
    help_text = " ".join(build_parser().format_help().split())
    assert re.search(rf"\(default {DEFAULT_STEP_JITTER}, .*e\.g\. --step-jitter 0\.2", help_text)


def ttft_ratio(point: SimPoint) -> float:
    ttfts = sorted(r.ttft_s for r in point.records if r.ttft_s is not None)
    q = statistics.quantiles(ttfts, n=20)
    return q[18] / q[9]  # p95 / p50


def test_jitter_spreads_the_closed_loops_ttft_as_a_real_servers() -> None:
    """Equal requests and equal step times give every request the same TTFT (p95/p50 1.00, what the emulator read
    against a real 1.14-2.48); with the default spread the twin's closed loop of 8 users has a p95 above its p50,
    and the same throughput."""
    job = parse_job(JOB)
    still = simulate(job, FLAGS, Coefficients(step_jitter=0.0))
    spread = simulate(job, FLAGS)
    assert ttft_ratio(still) == pytest.approx(1.0)
    assert ttft_ratio(spread) > 1.05
    still_tok_s, spread_tok_s = (p.summary(job).output_throughput for p in (still, spread))  # type: ignore[union-attr]
    assert spread_tok_s == pytest.approx(still_tok_s, rel=0.02)


def test_the_twins_simulation_is_one_answer_per_job_flags_and_coefficients() -> None:
    job = parse_job(JOB)
    first, again = simulate(job, FLAGS), simulate(job, FLAGS)
    assert first.records == again.records
    # a flag that changes nothing in the run (the KV cache holds every request either way) draws the same steps:
    # every flag set of a job sees the same spread, so the twin compares the flags, not two draws
    roomier = VllmFlags(max_num_seqs=16, max_model_len=4096, gpu_memory_utilization=0.91)
    assert [r.e2e_s for r in simulate(job, roomier).records] == [r.e2e_s for r in first.records]
    assert simulate(job, FLAGS, Coefficients(step_jitter=0.2)).records != first.records
    other_load = parse_job({**JOB, "workload": {**JOB["workload"], "seed": 99}})
    assert simulate(other_load, FLAGS).records != first.records


def profiled_job(tmp_path: Path) -> Job:
    """A CPU target with a fitted profile whose request latency (9.2 ms) is run A's of benchmarks/README.md."""
    path = tmp_path / "profile.json"
    coefficients = StepCoefficients(
        step_overhead_s=2.54e-3, prefill_token_s=39.1e-6, decode_seq_s=146.8e-6, context_token_s=426e-9,
        request_latency_s=9.2e-3,
    )  # fmt: skip
    StepProfile(
        device="cpu", model="llama-3.1-8b", vllm_version="0.32.0", block_size=128, max_num_seqs=16,
        max_num_batched_tokens=1024, coefficients=coefficients,
        fitted_from=FittedFrom(source="synthetic", created="2026-01-01T00:00:00Z", points=[], relative_rms_error=0),
    ).write(path)  # fmt: skip
    target = {"launcher": "process", "model": "llama-3.1-8b", "gpu": "cpu", "profile": str(path)}
    return parse_job({**JOB, "target": target, "workload": {"input_len": 128, "output_len": 32}})


def test_users_sent_together_drift_apart_through_the_front_end(tmp_path: Path) -> None:
    """All 8 users start at once, as vllm bench serve's do. Without spread they stay in waves of 8 (every request
    of a wave is sent, scheduled and finished together); with it the front end's latency varies per request, so
    requests sent together reach the scheduler in different steps and the users' sends spread out."""
    job = profiled_job(tmp_path)
    flags = VllmFlags(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=4096)

    def send_times(point: SimPoint) -> int:
        return len({r.start_s for r in point.records})

    still = simulate(job, flags, Coefficients(step_jitter=0.0))
    assert send_times(still) == len(still.records) // 8
    assert send_times(simulate(job, flags)) > 1.5 * send_times(still)
