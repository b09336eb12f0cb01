"""`tuner plan --measure` keeps a study's objective: a goodput study's capacity is searched as its trials were."""

from __future__ import annotations

import pytest

from tests.study_fakes import FakeLauncher, FakeServer, job
from tuner.config import Job
from tuner.flags import VllmFlags
from tuner.ship.measure import measure_capacity
from tuner.study.measure import Measurement


@pytest.mark.parametrize(("objective", "searched"), [("goodput", "goodput"), ("throughput", "max_rate")])
def test_measure_searches_by_the_studys_own_objective(objective: str, searched: str) -> None:
    seen: list[str] = []

    async def measure(server: FakeServer, search: Job, flags: VllmFlags) -> Measurement:
        seen.append(search.objective)
        return Measurement(None, rate=3.0)

    found = measure_capacity(
        job(objective=objective), VllmFlags(), study="s", trial=0, launcher=FakeLauncher(), measure=measure
    )
    assert seen == [searched] and found.rate == 3.0
