"""The report layer on the demo study: trial views, the front and its picks, status counts, re-scoring by hand."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import optuna
import pytest
from morning_demo import DURATION_S, SLOS, SPECS, STUDY
from optuna.trial import FrozenTrial

from tuner.load.results import RequestRecord
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
    trial_view,
)
from tuner.report.views import StudyView
from tuner.scoring import parse_slo, summarize
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
    assert by[9].objective_latency_s == pytest.approx(4.8) and by[9].latency("e2e_p95") == pytest.approx(4.8)


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
    # 13 trials: 11 finished and 1 running count against the budget; 1 interrupted is counted apart
    assert (li.trials, li.running, li.feasible, li.best_trial, li.state) == (12, 1, 6, 9, "running")
    assert li.interrupted == 1
    st = status(view)
    assert st.budget == 16 and st.finished == 11 and [t.number for t in st.running] == [11]
    assert st.failures == {"kv_cache_too_small": 1, "crashed_under_load": 1} and st.interrupted == 1
    assert st.skipped == {"no_kv_memory": 1}
    launched = [s.server_seconds for s in SPECS if s.outcome in ("measured", "launch_failed", "crashed", "interrupted")]
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
        before = dict(zip(r.before.constraint_names, r.before.constraints, strict=True))
        after = dict(zip(r.after.constraint_names, r.after.constraints, strict=True))
        assert {k: before[k] for k in after} == pytest.approx(after)


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


class FakeRecords:
    """A RecordSource in memory: the shape tuner.store.Store answers with."""

    def __init__(self, details: dict[int, Any], records: dict[tuple[int, int], list[RequestRecord]]) -> None:
        self.details, self.records = details, records

    def trial_detail(self, study: str, number: int) -> Any:
        return self.details.get(number)

    def request_records(self, study: str, number: int, step: int | None = None) -> list[RequestRecord]:
        return self.records.get((number, step or 0), [])

    def request_steps(self, study: str, number: int) -> list[int]:
        return sorted(s for n, s in self.records if n == number)


@dataclass(frozen=True)
class Detail:
    load_summary: dict[str, Any] | None
    capacity_steps: list[Any] | None
    scored_step: int | None


def _uniform(e2e: float, tokens: int, n: int = 10, duration: float = 10.0) -> list[RequestRecord]:
    return [
        RequestRecord(index=i, start_s=i * 0.5, ttft_s=0.1, e2e_s=e2e, completion_tokens=tokens, ok=True)
        for i in range(n)
    ]


def _measured(number: int, tput: float, lat: float, **attrs: Any) -> FrozenTrial:
    trial = optuna.trial.create_trial(
        values=[tput, lat],
        params={},
        distributions={},
        user_attrs={"outcome": "measured", "flags": {"max_num_seqs": number + 1}, **attrs},
        constraints={"startup": 0.0, "slo:e2e_p95<=5s": lat / 5 - 1},
    )
    trial.number = number
    return trial


def test_max_rate_rescore_walks_down_the_stored_steps() -> None:
    """Records exist for the scored step only (as the study keeps them); lower steps are re-judged from their
    stored summaries. Steps: 2 req/s at e2e 1.5 s, 4 req/s at 2.5 s, 8 req/s at 4.0 s (scored under <= 5 s)."""
    steps = []
    for rate, e2e in ((2.0, 1.5), (4.0, 2.5), (8.0, 4.0)):
        recs = _uniform(e2e, tokens=int(rate * 100))
        steps.append({"rate": rate, "summary": summarize(recs, duration_s=10.0).model_dump(mode="json")})
    source = FakeRecords({0: Detail(None, steps, 2)}, {(0, 2): _uniform(4.0, tokens=800)})
    view = StudyView(STUDY, {"objective": "max_rate", "slos": ["e2e_p95<=5s"]}, [trial_view(_measured(0, 800, 4.0))])
    loose = rescore(view, source, [parse_slo("e2e_p95<=5s")]).trials[0]
    assert (loose.step, loose.source, loose.after.request_rate) == (2, "records", 8.0)
    tight = rescore(view, source, [parse_slo("e2e_p95<=3s")]).trials[0]
    # 8 req/s misses 3 s (4.0 s), 4 req/s meets it (2.5 s): the highest rate that still meets the SLO
    assert (tight.step, tight.source, tight.after.request_rate) == (1, "stored summary", 4.0)
    assert tight.after.feasible and tight.after.objective_latency_s == pytest.approx(2.5)
    # scored at the tokens its rate asks for (4 req/s x 400 tokens), not the step's 400 tok/s diluted by its drain
    assert tight.after.throughput == pytest.approx(1600.0) and tight.after.output_tok_s == pytest.approx(400.0)
    none = rescore(view, source, [parse_slo("e2e_p95<=1s")]).trials[0]
    assert not none.after.feasible and none.step == 0  # closest miss, as the study scores it


def test_goodput_rescore_judges_each_step_by_its_share_of_good_requests() -> None:
    """Steps of 10 requests: at 2 req/s all take 1.5 s; at 4, two take 3.5 s; at 8, five do. Every step meets
    e2e_p50<=3s; the share of requests within 3 s on their own is 1.0, 0.8 and 0.5."""
    steps, records = [], {}
    for i, (rate, slow) in enumerate(((2.0, 0), (4.0, 2), (8.0, 5))):
        recs = [
            RequestRecord(index=j, start_s=j * 0.5, ttft_s=0.1, e2e_s=3.5 if j < slow else 1.5, completion_tokens=50,
                          ok=True)
            for j in range(10)
        ]  # fmt: skip
        steps.append({"rate": rate, "summary": summarize(recs, duration_s=10.0).model_dump(mode="json")})
        records[(0, i)] = recs
    source = FakeRecords({0: Detail(None, steps, 2)}, records)
    view = StudyView(STUDY, {"objective": "goodput", "slos": ["e2e_p50<=3s"]}, [trial_view(_measured(0, 50, 2.5))])
    # The bound is the new success_rate SLO's share: 0.9 holds at 2 req/s only, 0.8 up to 4.
    strict = rescore(view, source, [parse_slo("e2e_p50<=3s"), parse_slo("success_rate>=0.9")])
    assert strict.slos[-1] == "good_share>=0.9" and strict.trials[0].after.request_rate == 2.0
    loose = rescore(view, source, [parse_slo("e2e_p50<=3s"), parse_slo("success_rate>=0.8")]).trials[0]
    assert loose.after.request_rate == 4.0 and loose.after.good_share == pytest.approx(0.8)
    # A max_rate study of the same steps is judged by the percentile: 8 req/s meets it.
    mr = StudyView(STUDY, {"objective": "max_rate", "slos": ["e2e_p50<=3s"]}, view.trials)
    assert rescore(mr, source, [parse_slo("e2e_p50<=3s")]).trials[0].after.request_rate == 8.0


def test_a_load_stopped_at_a_certain_miss_is_never_found_feasible_under_looser_slos() -> None:
    """Its records are the part of the run up to the certain miss: they may meet a looser SLO, the run might not."""
    stop = "e2e_p95<=5s cannot be met: 6 of the 96 measured requests are already over 5s (at most 5 may be)"
    view = StudyView(STUDY, {"slos": ["e2e_p95<=5s"]}, [trial_view(_measured(0, 100.0, 6.0, slo_stop=stop))])
    assert view.trials[0].slo_stop == stop
    source = FakeRecords({0: Detail(None, None, 0)}, {(0, 0): _uniform(6.0, tokens=100)})
    loose = rescore(view, source, [parse_slo("e2e_p95<=10s")]).trials[0]
    assert not loose.after.feasible and loose.note is not None and "run it again" in loose.note
    tighter = rescore(view, source, [parse_slo("e2e_p95<=1s")]).trials[0]
    assert not tighter.after.feasible and tighter.note is None  # a miss on part of the run is a miss
    # A capacity-search step stopped so is not a meeting step either, whatever its partial summary says.
    steps = [
        {"rate": 2.0, "summary": summarize(_uniform(1.5, 200), duration_s=10.0).model_dump(mode="json")},
        {"rate": 4.0, "summary": summarize(_uniform(2.0, 400), duration_s=10.0).model_dump(mode="json"),
         "slo_stop": stop},
    ]  # fmt: skip
    capacity = FakeRecords({0: Detail(None, steps, 0)}, {})
    mr = StudyView(STUDY, {"objective": "max_rate", "slos": ["e2e_p95<=5s"]}, [trial_view(_measured(0, 200, 1.5))])
    assert rescore(mr, capacity, [parse_slo("e2e_p95<=10s")]).trials[0].after.request_rate == 2.0


def test_duplicates_are_no_point_of_their_own_and_follow_their_original() -> None:
    original, duplicate = trial_view(_measured(0, 100.0, 2.0)), trial_view(_measured(1, 100.0, 2.0, duplicate_of=0))
    view = StudyView(STUDY, {"slos": ["e2e_p95<=5s"]}, [original, duplicate])
    assert [t.number for t in pareto_front(view.trials)] == [0]
    assert view.trials[1].verdict == "duplicate of #0"
    source = FakeRecords({0: Detail(None, None, 0)}, {(0, 0): _uniform(2.0, tokens=100)})
    result = rescore(view, source, [parse_slo("e2e_p95<=1s")])
    assert [r.after.feasible for r in result.trials] == [False, False]
    assert result.trials[1].after.number == 1 and result.trials[1].note == "duplicate"


def test_a_confirmation_start_is_rescored_on_its_own_records_and_pools_into_its_flag_set() -> None:
    """#1 is #0's flag set started again (a confirmation start, which also carries duplicate_of): it ran, so it is
    judged on what it measured, and #0 stands at the figure pooled over both starts, as the study showed it."""
    first = trial_view(_measured(0, 100.0, 2.0))
    again = trial_view(_measured(1, 140.0, 6.0, duplicate_of=0, repeat_of=0))
    view = StudyView(STUDY, {"slos": ["e2e_p95<=5s"]}, [first, again])
    source = FakeRecords(
        {0: Detail(None, None, 0), 1: Detail(None, None, 0)},
        {(0, 0): _uniform(2.0, tokens=100), (1, 0): _uniform(6.0, tokens=140)},
    )
    result = rescore(view, source, [parse_slo("e2e_p95<=4s")])
    zero, one = result.trials
    assert one.note is None and one.source == "records"
    assert not one.after.feasible  # its own 6 s, not #0's 2 s
    assert zero.after.feasible and zero.after.starts == 2
    own = sorted([zero.after.output_tok_s or 0.0, one.after.output_tok_s or 0.0])
    assert own[0] < own[1] and own[0] < (zero.after.throughput or 0.0) < own[1]  # pooled over both starts
    assert [t.number for t in result.front] == [0]


def test_the_studys_repairs_and_warnings_are_notes() -> None:
    t = trial_view(_measured(0, 1.0, 1.0, repairs=["max_num_seqs 600 > max_num_batched_tokens 512: raised"]))
    assert t.notes == ("max_num_seqs 600 > max_num_batched_tokens 512: raised",)
    assert t.as_dict()["notes"] == list(t.notes)


def test_named_constraints_map_to_slos() -> None:
    t = trial_view(_measured(0, 100.0, 6.0), ["e2e_p95<=5s"])
    assert set(t.constraint_names) == {"startup", "e2e_p95<=5s"} and t.violated == ("e2e_p95<=5s",)
    assert not t.feasible and t.verdict == "misses e2e_p95<=5s"
    # the study's own order, when it lists its constraint names
    ordered = trial_view(_measured(0, 100.0, 6.0, constraint_names=["startup", "slo:e2e_p95<=5s"]))
    assert ordered.constraint_names == ("startup", "e2e_p95<=5s")
    assert ordered.constraints == pytest.approx((0.0, 0.2))
