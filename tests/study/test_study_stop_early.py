"""A trial's load phase ends once an SLO is missed for certain: same verdict, less GPU time, and it says so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from optuna.trial import FixedTrial
from study_fakes import FakeLauncher, FakeServer, job

from tuner.cli.tune import trial_line
from tuner.flags import VllmFlags
from tuner.launch import StartupFacts
from tuner.study import Measurement, Objective, measure_load

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "load"))
from load_fakes import BrokenServer


@pytest.mark.parametrize("stop_early", [True, False])
async def test_measure_load_stops_at_the_certain_miss_only_when_the_job_says_so(stop_early: bool) -> None:
    j = job(
        arrival={"concurrency": 2, "requests": 40},
        slos=["success_rate >= 0.95", "e2e_p95 <= 30s"],
        stop_early=stop_early,
    )
    async with BrokenServer(["ok", "http_500"]).serve() as base:
        server = FakeServer(base_url=base, model="m", facts=StartupFacts())
        m = await measure_load(server, j, VllmFlags(max_num_seqs=8))  # type: ignore[arg-type]
    assert m.result is not None
    measured = [r for r in m.result.records if not r.warmup]
    assert not j.parsed_slos()[0].met(m.result.summary)  # the same verdict either way
    if stop_early:
        assert m.result.slo_stop is not None
        assert "3 of the 40 measured requests failed (at most 2 may)" in m.result.slo_stop
        assert len(measured) < 10
    else:
        assert m.result.slo_stop is None and len(measured) == 40


def test_the_trial_records_why_its_load_stopped_and_its_line_says_so() -> None:
    async def stopped_measure(server: FakeServer, j: object, flags: VllmFlags) -> Measurement:
        async with BrokenServer(["http_500"]).serve() as base:
            real = FakeServer(base_url=base, model="m", facts=StartupFacts())
            return await measure_load(real, job(arrival={"concurrency": 1, "requests": 20}), flags)  # type: ignore[arg-type]

    objective = Objective(job(arrival={"concurrency": 1, "requests": 20}), FakeLauncher(), measure=stopped_measure)
    trial = FixedTrial({"max_num_seqs": 8, "gpu_memory_utilization": 0.85})
    objective(trial)
    a = trial.user_attrs
    assert a["outcome"] == "measured" and a["feasible"] is False
    assert a["slo_stop"].startswith("success_rate>=0.9 cannot be met: 3 of the 20 measured requests failed")

    class Frozen:
        number = 3
        user_attrs = a
        values = (0.0, 1.0)

    line = trial_line(Frozen())  # type: ignore[arg-type]
    assert "misses" in line and "success_rate>=0.9" in line and "load stopped early" in line
