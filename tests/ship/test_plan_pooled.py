"""`tuner plan` sizes from a flag set's rate pooled over every start of it: a lucky first start (31.704 req/s, the
max-rate demo's) with two slower confirmation starts (25.75, 27.92) sizes three replicas for 40 req/s, not two."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tuner.report.views import StudyView, TrialView
from tuner.ship.plan import make_plan, pooled_rate

RATES = (31.704, 25.75, 27.92)


def view(rates: tuple[float, ...] = RATES, confirm: dict[str, Any] | None = None) -> StudyView:
    def trial(number: int, rate: float, repeat_of: int | None) -> TrialView:
        return TrialView(
            number=number, state="COMPLETE", baseline=False, outcome="measured", reason=None,
            flags={"max_num_seqs": 64}, throughput=rate * 100, objective_latency_s=1.0, request_rate=rate,
            output_tok_s=rate * 100, feasible=True, repeat_of=repeat_of,
            duplicate_of=repeat_of,
        )  # fmt: skip

    trials = [trial(1, rates[0], None), *(trial(2 + i, r, 1) for i, r in enumerate(rates[1:]))]
    attrs: dict[str, Any] = {"objective": "max_rate"}
    if confirm is not None:
        attrs["confirm"] = confirm
    return StudyView("max-rate", attrs, trials)


def test_the_plan_sizes_from_the_rate_pooled_over_every_start() -> None:
    v = view()
    plan = make_plan(v, v.trials[0], rate=40, peak=70)
    pooled = math.exp(sum(map(math.log, RATES)) / 3)
    assert plan.capacity_rps == pytest.approx(pooled)
    assert plan.replicas == 3 and math.ceil(40 / (RATES[0] * 0.7)) == 2  # the first start alone said two
    assert "pooled over its 3 starts (31.704, 25.750, 27.920)" in plan.lines()[0]


def test_its_lower_bound_where_asked_and_none_from_one_start() -> None:
    v = view(confirm={"noise": {"output_tok_s": {"log_var": 0.01, "df": 4}}})
    ci, rates = pooled_rate(v, v.trials[0])
    low = make_plan(v, v.trials[0], rate=40, lower_bound=True)
    assert rates == list(RATES) and low.capacity_rps == pytest.approx(ci.low) and ci.low < ci.value
    assert "lower end of the 95% interval" in low.basis
    once = view(rates=(31.704,))
    plan = make_plan(once, once.trials[0], rate=40, lower_bound=True)
    assert plan.capacity_rps == pytest.approx(31.704) and "started once: no interval" in plan.basis
