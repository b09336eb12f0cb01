"""A goodput trial is judged by its good-share bound as well as the job's SLOs: percentiles met are not enough."""

from __future__ import annotations

from optuna.trial import FixedTrial
from study_fakes import FakeLauncher, FakeServer, job

from tuner.config import Job
from tuner.flags import VllmFlags
from tuner.load import CapacityStep, RequestRecord
from tuner.record import TrialRecord
from tuner.scoring import summarize
from tuner.study import Objective
from tuner.study.measure import Measurement


def _records() -> list[RequestRecord]:
    # 2 of 10 requests over the 2 s bound on their own: the median meets it, the good share is 0.8.
    return [
        RequestRecord(index=i, start_s=i * 0.1, ttft_s=0.1, e2e_s=3.0 if i < 2 else 1.0, completion_tokens=8, ok=True)
        for i in range(10)
    ]


async def _no_rate_held_the_share(server: FakeServer, search: Job, flags: VllmFlags) -> Measurement:
    summary = summarize(_records(), duration_s=1.0, slos=search.parsed_slos())
    bound = search.goodput_slo()
    step = CapacityStep(rate=5.0, summary=summary, meets_slos=False, violations=[bound.violation(summary)])
    return Measurement(None, steps=[step], rate=None)


def test_a_goodput_trial_whose_share_fell_short_is_infeasible_though_its_slos_are_met() -> None:
    goodput = job(objective="goodput", slos=["e2e_p50 <= 2s", "success_rate >= 0.9"])
    trial = FixedTrial({"max_num_seqs": 16, "gpu_memory_utilization": 0.9})
    Objective(goodput, FakeLauncher(), measure=_no_rate_held_the_share)(trial)
    record = TrialRecord.from_attrs(trial.user_attrs)
    assert record.good_share == 0.8 and record.goodput == 8.0
    constraints = dict(zip(record.constraint_names or [], record.constraints or [], strict=True))
    assert constraints["slo:e2e_p50<=2s"] <= 0 and constraints["slo:success_rate>=0.9"] <= 0
    assert constraints["slo:good_share>=0.9"] > 0 and record.feasible is False
