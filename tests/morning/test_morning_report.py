"""The report layer on the demo study: trial views, the front and its picks, status counts, re-scoring by hand."""

from __future__ import annotations

import json
import math

import optuna
import pytest
from morning_demo import DURATION_S, SLOS, SPECS, STUDY

from tuner.report import (
    NoFeasibleTrial,
    choose,
    listing,
    opened_study,
    pareto_front,
    ratios,
    rescore,
    status,
    study_view,
)
from tuner.report.views import StudyView
from tuner.scoring import parse_slo
from tuner.store import open_store


@pytest.fixture
def view(demo_url: str) -> StudyView:
    with opened_study(demo_url, STUDY) as s:
        return study_view(s)


def test_trial_views_read_the_contract_attrs(view: StudyView) -> None:
    assert [t.number for t in view.trials] == [s.number for s in SPECS]
    by = {t.number: t for t in view.trials}
    assert by[0].baseline and by[0].feasible and by[0].throughput == pytest.approx(2000.0)
    assert by[2].measured and not by[2].feasible and by[2].violated == ("e2e_p95<=5s",)
    assert by[10].violated == ("success_rate>=0.99",) and by[10].success_rate == pytest.approx(0.9)
    assert by[3].verdict == "launch failed: kv_cache_too_small" and not by[3].measured
    assert by[5].verdict == "skipped: no_kv_memory"
    assert by[8].verdict == "crashed: crashed_under_load"
    assert by[11].verdict == "running" and by[11].flags["max_num_seqs"] == 96
    assert by[9].latency_p95_s == pytest.approx(4.8) and by[9].e2e_p95_s == pytest.approx(4.8)


def test_front_matches_optunas_own_best_trials(view: StudyView, demo_url: str) -> None:
    front = pareto_front(view.trials)
    assert [t.number for t in front] == [9, 6, 4, 7]
    storage = optuna.storages.RDBStorage(demo_url)
    try:
        study = optuna.load_study(study_name=STUDY, storage=storage)
        assert sorted(t.number for t in study.best_trials) == sorted(t.number for t in front)
    finally:
        storage.engine.dispose()


def test_picks_and_ratios(view: StudyView) -> None:
    front = pareto_front(view.trials)
    assert choose(front, "throughput").number == 9
    assert choose(front, "latency").number == 7
    # balanced: nearest to the ideal corner once both axes span [0, 1] over the front
    # (9: 1.0, 6: hypot(200/1400, 1.7/3) = 0.585, 4: hypot(600/1400, 0.7/3) = 0.488, 7: 1.0)
    assert choose(front, "balanced").number == 4
    r = ratios(choose(front, "throughput"), view.baseline)
    assert r.throughput == pytest.approx(3400 / 2000) and r.latency_p95 == pytest.approx(4.8 / 4.0)
    with pytest.raises(NoFeasibleTrial, match="no feasible trial in study 'x'"):
        choose([], "throughput", study="x")


def test_listing_and_status(view: StudyView) -> None:
    li = listing(view)
    assert (li.trials, li.running, li.feasible, li.best_trial, li.state) == (12, 1, 6, 9, "running")
    st = status(view)
    assert st.budget == 16 and st.finished == 11 and [t.number for t in st.running] == [11]
    assert st.failures == {"kv_cache_too_small": 1, "crashed_under_load": 1}
    assert st.skipped == {"no_kv_memory": 1}
    launched = [s.server_seconds for s in SPECS if s.outcome in ("measured", "launch_failed", "crashed")]
    assert st.server_minutes_saved == pytest.approx(sum(launched) / len(launched) / 60)
    assert st.best is not None and st.best.number == 9


def _p95_by_hand(values: list[float]) -> float:
    v = sorted(values)
    pos = 0.95 * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def test_tighter_slo_shrinks_the_feasible_set_as_the_records_say(view: StudyView, demo_url: str) -> None:
    store = open_store(demo_url, migrate=False)
    try:
        result = rescore(view, store, [parse_slo("e2e_p95<=3s"), parse_slo("success_rate>=0.99")])
        expected = set()
        for t in view.trials:
            records = store.request_records(STUDY, t.number)
            if not records:
                continue
            ok = [r for r in records if r.ok]
            if _p95_by_hand([r.e2e_s for r in ok]) <= 3.0 and len(ok) / len(records) >= 0.99:
                expected.add(t.number)
    finally:
        store.close()
    after = {r.after.number for r in result.trials if r.after.feasible}
    assert after == expected == {4, 7}
    before = {r.before.number for r in result.trials if r.before.feasible}
    assert after < before and len(before) == 6
    assert [t.number for t in result.front] == [4, 7]
    by = {r.after.number: r for r in result.trials}
    assert by[9].after.violated == ("e2e_p95<=3s",) and by[9].changed
    assert by[3].note == "no measurement" and not by[3].after.feasible
    # the same records give the same objective values the study stored
    assert by[9].after.throughput == pytest.approx(3400.0) and by[9].summary is not None
    assert by[9].summary.duration_s == DURATION_S


def test_rescore_under_the_original_slos_reproduces_the_study(view: StudyView, demo_url: str) -> None:
    with open_store(demo_url, migrate=False) as store:
        result = rescore(view, store, [parse_slo(s) for s in SLOS])
    assert [(r.before.number, r.before.feasible) for r in result.trials] == [
        (r.after.number, r.after.feasible) for r in result.trials
    ]
    for r in result.trials:
        assert r.after.constraints == pytest.approx(r.before.constraints)


def test_dropping_an_slo_can_admit_a_trial(view: StudyView, demo_url: str) -> None:
    with open_store(demo_url, migrate=False) as store:
        result = rescore(view, store, [parse_slo("e2e_p95<=3s")])
    # trial 10 sits exactly on 3.0 s and only its success rate held it back
    assert {r.after.number for r in result.trials if r.after.feasible} == {4, 7, 10}
    assert [t.number for t in result.front] == [10, 4, 7]


def test_dashboard_reads_our_attrs_through_optunas_public_api(demo_url: str) -> None:
    """optuna-dashboard opens the storage with Optuna's own loader; everything we store must be plain JSON."""
    storage = optuna.storages.RDBStorage(demo_url)
    try:
        study = optuna.load_study(study_name=STUDY, storage=storage)
        assert json.loads(json.dumps(study.user_attrs))["slos"] == SLOS
        for t in study.get_trials():
            attrs = json.loads(json.dumps(t.user_attrs))
            assert "flags" in attrs and "baseline" in attrs
        assert study.trials[9].user_attrs["outcome"] == "measured"
        assert optuna.study.get_all_study_names(storage) == [STUDY]
    finally:
        storage.engine.dispose()
