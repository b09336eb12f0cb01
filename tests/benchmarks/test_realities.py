"""benchmarks/realities.py, the generator of drawn real servers: one seed always draws the same server, the seeds
written down cover every effect family, and a drawn server runs flag sets with its effects where they were drawn."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import realities as R
from tuning_efficiency import Point, scenario_job, simulate

from tuner.load import RequestRecord
from tuner.store import flag_key


def small(draw: R.Draw) -> R.Draw:
    """The draw with a load of a few requests, so a grid point costs little."""
    spec = {**draw.spec, "arrival": {"concurrency": 4, "requests": 8}}
    return dataclasses.replace(draw, spec=spec)


def test_a_seed_draws_the_same_server_every_time() -> None:
    for seed in (0, 5, 1003):
        a, b = R.draw_reality(seed), R.draw_reality(seed)
        assert (a.spec, a.reality, a.about, a.slo_metrics, a.slo_fractions) == (
            b.spec,
            b.reality,
            b.about,
            b.slo_metrics,
            b.slo_fractions,
        )
    assert R.draw_reality(0).spec != R.draw_reality(8).spec  # same family, another server


def test_the_written_seeds_cover_every_family_and_stay_apart() -> None:
    assert not set(R.TRAINING_SEEDS) & set(R.HELD_OUT_SEEDS)
    assert not (set(R.TRAINING_SEEDS) | set(R.HELD_OUT_SEEDS)) & set(R.FRESH_SEEDS)
    assert len(R.HELD_OUT_SEEDS) == len(R.FRESH_SEEDS) == 40
    for seeds in (R.TRAINING_SEEDS, R.HELD_OUT_SEEDS, R.FRESH_SEEDS):
        families = [R.draw_reality(s).family for s in seeds]
        assert {f: families.count(f) for f in R.FAMILIES} == dict.fromkeys(R.FAMILIES, 5)


def test_each_family_draws_its_effect() -> None:
    by_family = {R.draw_reality(s).family: R.draw_reality(s) for s in R.TRAINING_SEEDS[: len(R.FAMILIES)]}
    reality = {f: d.reality for f, d in by_family.items()}
    assert reality["figures"] == R.DrawnReality(reality["figures"].figures)
    assert reality["flag-term"].step_along is not None and not reality["flag-term"].step_along[1].steps
    assert reality["piecewise"].step_along is not None and reality["piecewise"].step_along[1].steps
    assert reality["kv-by-flag"].kv_along is not None
    assert reality["crash-region"].crash
    for family in ("prefills", "context", "mix"):
        effect = reality[family].effect
        assert effect is not None and effect.kind == family


def _grid_flags(draw: R.Draw) -> list[Any]:
    R.register(draw, ["success_rate >= 0.99"])
    return R.grid_points(scenario_job(draw.name, "grid", 0, 1))


def test_a_crash_region_crashes_inside_and_serves_outside() -> None:
    draw = small(next(d for d in map(R.draw_reality, R.TRAINING_SEEDS) if d.family == "crash-region"))
    flags = _grid_flags(draw)
    inside = [f for f in flags if all(lo <= a.position(f.as_dict()) <= hi for a, lo, hi in draw.reality.crash)]
    outside = [f for f in flags if f not in inside]
    assert inside and outside
    job = scenario_job(draw.name, "grid", 0, 1)
    assert simulate(job, inside[0], draw.reality).crashed
    served = simulate(job, outside[0], draw.reality)
    assert not served.crashed and served.reason is None
    assert sum(r.ok for r in served.records) == 8


def test_a_step_effect_slows_the_steps_it_names() -> None:
    draw = small(next(d for d in map(R.draw_reality, R.TRAINING_SEEDS) if d.family == "prefills"))
    flags = _grid_flags(draw)[0]
    job = scenario_job(draw.name, "grid", 0, 1)
    with_effect = simulate(job, flags, draw.reality)
    without = simulate(job, flags, dataclasses.replace(draw.reality, effect=None))
    ttft = [r.ttft_s for r in with_effect.records if r.ttft_s is not None]
    ttft_without = [r.ttft_s for r in without.records if r.ttft_s is not None]
    assert sum(ttft) > sum(ttft_without)  # every request's prefill step holds a prefill


def test_a_flag_curve_moves_the_kv_capacity_along_its_flag() -> None:
    draw = next(d for d in map(R.draw_reality, R.TRAINING_SEEDS) if d.family == "kv-by-flag")
    along, curve = draw.reality.kv_along or pytest.fail("no KV curve")
    ends = {along.choices[0], along.choices[-1]}
    flags = [f for f in _grid_flags(small(draw)) if f.as_dict().get(along.flag) in ends]
    kv = {f.as_dict()[along.flag]: draw.reality.at(f).kv_scale for f in flags}
    assert kv[along.choices[0]] / kv[along.choices[-1]] == pytest.approx(curve(0.0) / curve(1.0))
    assert kv[along.choices[0]] != kv[along.choices[-1]]


def _point(tpot_s: float, tokens: int) -> Point:
    """A flag set that served 4 requests of `tokens` output tokens, each at `tpot_s` a token, in one second."""
    records = [
        RequestRecord(
            index=i,
            start_s=0.0,
            ttft_s=0.1,
            itl_s=[tpot_s] * (tokens - 1),
            e2e_s=0.1 + tpot_s * (tokens - 1),
            prompt_tokens=10,
            completion_tokens=tokens,
            ok=True,
        )
        for i in range(4)
    ]
    return Point({"max_num_seqs": tokens}, None, None, None, False, records, 1.0, 1000, 1.0)


def test_the_slos_make_the_unconstrained_best_miss() -> None:
    # more throughput, slower tokens: the grid's unconstrained best is the slowest a token
    cache = {flag_key({"max_num_seqs": n}): _point(0.01 * n, 10 * n) for n in (1, 2, 3, 4, 5, 6)}
    draw = dataclasses.replace(R.draw_reality(0), slo_metrics=("tpot_p95",), slo_fractions=(0.9,))
    slos = R.choose_slos(draw, cache)
    assert slos is not None and slos[0] == "success_rate >= 0.99"
    R.register(draw, slos)
    job = scenario_job(draw.name, "grid", 0, 1)
    feasible = [n for n in (1, 2, 3, 4, 5, 6) if R.feasible_tput(cache[flag_key({"max_num_seqs": n})], job)]
    # 90% of the points would keep the best: its bound is set under the best's own, at most a point more cut
    assert feasible in ([1, 2, 3, 4, 5], [1, 2, 3, 4])
