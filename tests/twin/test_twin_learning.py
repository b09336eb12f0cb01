"""What the twin learns from its trials: no launch for an answer it knows, an error along one flag learnt along that
flag, exploring only where a trial can change the answer, and the hand-over when its residual cannot explain a miss.

The fake twin of test_twin_sampler.py (throughput 10 x seqs x utilization, E2E seqs / 32 s) for its pure functions;
the real study with a fake launcher and load for what is launched.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna
import pytest
from study_fakes import FakeLauncher, FakeServer, job, records_for
from test_twin_sampler import KV, fake_simulate, fake_tok_s, run_trial, twin_study
from test_twin_slos import fake_e2e, study_of, tell, twin

from tuner.capacity import runtime_need_bytes
from tuner.config import Job
from tuner.flags import VllmFlags, resolve
from tuner.load import LoadResult
from tuner.record import CRASHED, MEASURED, TrialRecord
from tuner.scoring import summarize
from tuner.store import flag_key
from tuner.study import Measurement, TuningRun
from tuner.twin.crashes import crash_risk, unbounding
from tuner.twin.explore import expected_gain, explore, leader_bound
from tuner.twin.model import Candidate, Observation, Predicted, Twin, candidates
from tuner.twin.residual import GLOBAL, STEP_NEAR, along_one, flags_alike, kernels_for
from tuner.twin.sampler import PREDICTED_ATTR, SAME_AS_ATTR, _reversed_pairs
from tuner.twin.simulate import GIB, Coefficients, SimPoint

SLOS = ["e2e_p95 <= 2.5s", "success_rate >= 0.9"]


async def served_alike(server: FakeServer, j: Job, flags: VllmFlags) -> Measurement:
    """A real server that serves four users the same whatever the flags (as the twin simulates it), within the SLOs."""
    records = records_for(flags.model_copy(update={"max_num_seqs": 8}))
    summary = summarize(records, duration_s=1.25, slos=j.parsed_slos())
    return Measurement(LoadResult(summary=summary, records=records, diagnosis="fake"), rate=summary.request_throughput)


def test_a_flag_set_the_twin_simulates_as_one_measured_is_answered_from_it_not_launched(tmp_path: Path) -> None:
    # Four users: every max_num_seqs admits them all and every utilization holds their KV, so the twin simulates the
    # twelve flag sets (and the baseline) alike. Once the baseline is measured (its verdict as the twin said) nothing
    # else can teach: no proposal launches a server, each is answered with the baseline's figures and says so.
    j = job(sampler={"name": "twin", "seed": 1}, budget={"n_trials": 3})
    launcher = FakeLauncher()
    log: list[str] = []
    tuning = TuningRun(
        j, launcher, storage_url=f"sqlite:///{tmp_path / 't.db'}", measure=served_alike, on_event=log.append
    )
    try:
        report = tuning.run()
        trials = tuning.study.trials
    finally:
        tuning.close()
    assert len(launcher.launches) == 1  # the baseline's
    answered = [t for t in trials if t.number > 0]
    assert answered and all(t.user_attrs.get(SAME_AS_ATTR) == 0 for t in answered)
    assert all(TrialRecord.from_attrs(t.user_attrs).duplicate_of == 0 for t in answered)
    assert all(t.values == trials[0].values for t in answered)
    assert "trial 1: the twin simulates these flags as trial 0's (the same batch, the same steps); its result is " \
        "reused, nothing launched" in log  # fmt: skip
    # The run ends at the repeat cap saying what happened: the twin's answers, not a sampler repeating itself, and
    # what would tell the flag sets apart.
    (end,) = [line for line in log if "stopping at" in line]
    assert end.startswith(f"the twin simulates {len(answered)} proposed flag sets as behaving like trial #0 (the same ")
    assert "they differ from it only in " in end and "max_num_seqs" in end
    assert "stopping at 1 distinct flag set tried of the budget's 3" in end and "widen the space" in end
    assert "already tried" not in end and "may hold no other" not in end
    said = f"0 sampler repeats answered from their first trial, {len(answered)} flag sets the twin answered from a "
    assert report.repeats_said() == said + "measured trial alike"


def alike_above_32(job_: Any, flags: VllmFlags, c: Coefficients) -> SimPoint:
    """The fake twin under 32 users: 64 sequences admit no more than 32 do, so they simulate alike."""
    capped = flags.model_copy(update={"max_num_seqs": min(flags.max_num_seqs or 0, 32)})
    point = fake_simulate(job_, capped, c)
    point.peak_running = min(flags.max_num_seqs or 0, 32)
    return point


def test_the_twin_does_not_propose_a_known_answer_while_another_can_teach() -> None:
    j, sampler, _ = twin(simulate_fn=alike_above_32)
    study = study_of(sampler)
    seen = []

    def as_simulated(f: VllmFlags) -> tuple[float, float]:  # a server that admits no more than its 32 users either
        return fake_tok_s(f.model_copy(update={"max_num_seqs": min(f.max_num_seqs or 0, 32)})), 1.0

    for _ in range(5):
        trial = tell(study, j, as_simulated)
        seen.append((trial.user_attrs["flags"]["max_num_seqs"], trial.user_attrs["flags"]["gpu_memory_utilization"]))
        assert SAME_AS_ATTR not in trial.user_attrs
    for util in (0.85, 0.9, 0.95):
        assert not {(32, util), (64, util)} <= set(seen)  # never both of a pair the twin cannot tell apart


def swept(simulate_fn: Any) -> tuple[Twin, dict[tuple[int | None, float | None], Candidate]]:
    """The twin over the fake job's space, swept with `simulate_fn`, and its candidates by (sequences, utilization)."""
    j = job(slos=SLOS, sampler={"name": "twin", "seed": 1})
    pool = candidates(j.search_space(), 400, 1)
    t = Twin(j, pool, simulate_fn)
    t.sweep()
    return t, {(c.flags.max_num_seqs, c.flags.gpu_memory_utilization): c for c in pool}


def slow_at(util: float, factor: float = 0.7, flag: str = "gpu_memory_utilization") -> Any:
    """A real server whose flag sets with this value of `flag` (utilization by default) are `factor` as fast as
    simulated (E2E 1 / factor)."""

    def observe(c: Candidate) -> Observation:
        f = factor if getattr(c.flags, flag) == util else 1.0
        tok = fake_tok_s(c.flags) * f
        figures = {"output_tok_s": tok, "e2e_p95": (c.flags.max_num_seqs or 0) / 32 / f}
        return Observation(c.key, c.flags, True, False, tok, KV, figures)

    return observe


def test_a_residual_along_one_flag_is_learnt_from_three_trials_and_moves_only_flag_sets_with_that_value() -> None:
    t, at = swept(fake_simulate)
    observe = slow_at(0.85)
    trials = [observe(at[64, 0.85]), observe(at[32, 0.85]), observe(at[32, 0.95])]
    for n in range(1, 4):
        t.refit(trials[:n])
    kernel = t.choice.kernel  # the flags' (smooth, or a step along utilization): not the global terms
    assert kernel is not GLOBAL and t.choice.errors[kernel.name] < t.choice.errors[GLOBAL.name]
    measured = {o.key for o in trials}
    untried = {k: c for k, c in at.items() if c.key not in measured}
    ratio = {k: t.predict(c.key).output_tok_s / fake_tok_s(c.flags) for k, c in untried.items()}
    assert all(r < 0.75 for k, r in ratio.items() if k[1] == 0.85)  # learnt: x0.7 at 0.85
    assert all(r > 0.95 for k, r in ratio.items() if k[1] == 0.95)  # and not carried to the others
    # the flag sets without that value keep the physics' order among themselves; those with it drop below
    others = sorted((k for k in untried if k[1] != 0.85), key=lambda k: -t.predict(untried[k].key).output_tok_s)
    assert others == sorted(others, key=lambda k: -fake_tok_s(untried[k].flags))
    assert t.predict(untried[16, 0.85].key).output_tok_s < t.predict(untried[16, 0.9].key).output_tok_s * 0.85


def test_a_miss_the_global_terms_explain_better_stays_with_them() -> None:
    # Every flag set 30% slower: the terms (the whole step's scale) take it, nothing is learnt along a flag.
    t, at = swept(fake_simulate)
    everywhere = slow_at(0.85, 0.7)
    trials = [everywhere(at[64, 0.85]), everywhere(at[32, 0.85]), everywhere(at[16, 0.85])]
    trials = [Observation(o.key, o.flags, True, False, o.output_tok_s, KV, o.figures) for o in trials]
    for n in range(1, 4):
        t.refit(trials[:n])
    assert t.choice.kernel is GLOBAL
    assert t.coefficients.step_scale == pytest.approx(1 / 0.7, rel=0.1)


def predicted(key: str, tok_s: float, chance: float, spread: float) -> Predicted:
    figures = {"output_tok_s": tok_s}
    return Predicted(key, True, False, tok_s, -0.1, True, figures, chance, 1, {"output_tok_s": spread})


def test_an_exploring_proposal_never_goes_below_the_leaders_bound() -> None:
    leader, error = 300.0, 0.2
    options = [
        predicted("unsure-and-low", 192.0, 0.9, 0.8),  # the least sure; below the leader even if 20% wrong
        predicted("just-under", 245.0, 0.99, 0.03),  # under the bound, within the error: a small chance
        predicted("above", 320.0, 0.6, 0.1),
        predicted("certain-above", 330.0, 0.95, 0.03),
    ]
    chosen = explore(options, lambda p: p.box_tok_s, leader, error)
    assert chosen is not None and chosen[0].key == "certain-above"
    without = explore(options[:2], lambda p: p.box_tok_s, leader, error)
    assert without is not None and without[0].key == "just-under"  # some chance: 245 x 1.2 > the bound
    assert explore(options[:1], lambda p: p.box_tok_s, leader, error) is None
    # whatever the candidates, what is explored could beat the bound were the twin wrong by its error
    for tok_s in range(100, 400, 7):
        for spread in (0.03, 0.3, 1.0):
            found = explore([predicted("x", float(tok_s), 0.9, spread)], lambda p: p.box_tok_s, leader, error)
            assert found is None or tok_s * (1 + error) >= leader_bound(leader)


def test_the_sampler_explores_only_where_a_trial_can_beat_the_leader() -> None:
    # After the first trial (the twin's best, measured as predicted) every later proposal explores; none goes to a
    # flag set predicted under the leader by more than the twin's error.
    j, sampler, log = twin(explore_every=1)
    study = study_of(sampler)
    first = tell(study, j, lambda f: (fake_tok_s(f), (f.max_num_seqs or 0) / 32))
    leader = first.user_attrs["output_tok_s"]
    for _ in range(3):
        trial = tell(study, j, lambda f: (fake_tok_s(f), (f.max_num_seqs or 0) / 32))
        said = trial.user_attrs["twin_predicted_tok_s"]
        assert said * 1.2 >= leader_bound(leader) or not any("exploring" in x for x in log[-3:])
    after_first = log[log.index(next(x for x in log if x.startswith("trial 0:"))) :]
    assert any("exploring" in x for x in after_first)
    assert all("chance of beating the leader" in x for x in after_first if "exploring" in x)


def test_verdicts_that_stay_wrong_hand_over() -> None:
    # Reality contradicts every verdict the twin gives (a miss where it says met, and the reverse): what each trial
    # teaches fails the next, and the fallback gets the budget.
    j, sampler, log = twin()
    study = study_of(sampler)

    def contrary(f: VllmFlags) -> tuple[float, float]:
        assert sampler.twin is not None
        meets = sampler.twin.predict(flag_key(f.as_dict())).feasible
        return fake_tok_s(f), 4.0 if meets else 0.5

    for _ in range(5):
        tell(study, j, contrary)
    assert sampler.fell_back
    line = next(x for x in log if "falling back" in x)
    assert "its SLO verdict was wrong in" in line


def _ranked(predicted: float, measured: float, seqs: int) -> Any:
    attrs = {"flags": {"max_num_seqs": seqs}, "outcome": MEASURED, "output_tok_s": measured, PREDICTED_ATTR: predicted}
    return optuna.trial.create_trial(params={}, distributions={}, values=[measured, 1.0], user_attrs=attrs)


def test_the_ranking_the_hand_over_judges_is_the_refit_twins_not_the_one_before_the_first_trial() -> None:
    # The baseline, predicted before any trial at 1000 tok/s, measured 770; the refit then put the next three
    # within 2%. Before they ran, the baseline sat above all three: three pairs the wrong way round, every pair
    # compared. The refit twin predicts the baseline from the others at 760: no pair reversed stands.
    done = [_ranked(1000, 770, 256), _ranked(800, 800, 8), _ranked(850, 850, 16), _ranked(880, 870, 32)]
    key_of = {t.user_attrs["output_tok_s"]: flag_key(t.user_attrs["flags"]) for t in done}
    assert _reversed_pairs(done, lambda _key: None) == (3, 3)  # the predictions made before each trial ran
    refit = {key_of[770]: 760.0}
    assert _reversed_pairs(done, refit.get) is None
    # a refit twin that still ranks them the wrong way round is still handed over from
    wrong = {key_of[770]: 990.0, key_of[800]: 700.0}
    assert _reversed_pairs(done, wrong.get) == (3, 5)  # the baseline still above all three, 800 below 850 and 870


def test_a_miss_along_a_flag_the_residual_learns_does_not_hand_over() -> None:
    # Every flag set at 0.95 utilization misses the E2E SLO, the others meet it as predicted: after the first miss
    # the twin learns it along that flag and its verdicts are right again.
    j, sampler, _ = twin()
    study = study_of(sampler)
    for _ in range(5):
        tell(study, j, lambda f: (fake_tok_s(f), 5.0 if f.gpu_memory_utilization == 0.95 else 0.1))
    assert not sampler.fell_back
    assert 3 not in sampler.verdicts and 4 not in sampler.verdicts


def test_beside_a_wrong_verdict_a_flag_set_alike_is_measured_until_its_flags_are_shown_inert() -> None:
    t, at = swept(alike_above_32)
    a, b = at[32, 0.9], at[64, 0.9]
    met = {"output_tok_s": 288.0, "e2e_p95": 1.0, "success_rate": 1.0}
    missed = {"output_tok_s": 288.0, "e2e_p95": 3.0, "success_rate": 1.0}
    right = Observation(a.key, a.flags, True, False, 288.0, KV, met, predicted=met)
    t.refit([right])
    assert t.known_answer(b.key, [a.key]) == a.key  # the twin said met, it was met: its likeness stands
    wrong = Observation(a.key, a.flags, True, False, 288.0, KV, missed, predicted=met)
    t.refit([wrong])
    assert t.known_answer(b.key, [a.key]) is None  # it missed something there: 64 sequences may teach it
    other = Observation(b.key, b.flags, True, False, 200.0, KV, {"output_tok_s": 200.0, "e2e_p95": 3.0})
    t.refit([wrong, other])
    assert t.disproved == {a.key, b.key}  # alike in the twin, not on the server


def test_a_step_at_one_value_of_an_ordered_flag_moves_the_flag_sets_with_that_value_and_not_the_others() -> None:
    # 32 sequences run at 40% of the simulated speed, 16 and 64 as simulated: a step no smooth curve along the flag
    # and no global term holds. Three trials teach it (a step along max_num_seqs wins leave-one-out); the untried
    # flag sets with 32 sequences drop below those with 16, and those with 8 or 16 keep the physics' order.
    t, at = swept(fake_simulate)
    observe = slow_at(32, 0.4, "max_num_seqs")  # a cliff at one value of an ordered flag
    trials = [observe(at[32, 0.85]), observe(at[32, 0.95]), observe(at[16, 0.95])]
    for n in range(1, 4):
        t.refit(trials[:n])
    kernel = t.choice.kernel
    assert kernel.only == "max_num_seqs" and t.choice.errors[kernel.name] < 0.8 * t.choice.errors[GLOBAL.name]
    ratio = {k: t.predict(at[k].key).output_tok_s / fake_tok_s(at[k].flags) for k in ((32, 0.9), (16, 0.9))}
    ratio |= {(8, u): t.predict(at[8, u].key).output_tok_s / fake_tok_s(at[8, u].flags) for u in (0.85, 0.9, 0.95)}
    assert ratio[32, 0.9] < 0.55  # learnt: x0.4 at 32 sequences, shrunk a little by the prior
    assert ratio[16, 0.9] > 0.97  # not carried to 16 sequences (a trial measured them as simulated)
    # nor to 8: only the global terms' share of the miss (the prior's compromise) moves them, and alike
    assert all(0.85 < r < 1.0 for k, r in ratio.items() if k[0] == 8)
    assert max(ratio[8, u] for u in (0.85, 0.9, 0.95)) - min(ratio[8, u] for u in (0.85, 0.9, 0.95)) < 0.01
    assert t.predict(at[32, 0.9].key).output_tok_s < t.predict(at[16, 0.85].key).output_tok_s
    assert fake_tok_s(at[32, 0.9].flags) > fake_tok_s(at[16, 0.85].flags)  # the physics alone ranked it first


def test_the_step_kernel_shares_an_error_in_full_at_one_value_and_in_part_beside_it() -> None:
    at = {"max_num_seqs": 2 / 3, "gpu_memory_utilization": 0.5}
    same = {"max_num_seqs": 2 / 3, "gpu_memory_utilization": 1.0}
    beside = {"max_num_seqs": 1.0, "gpu_memory_utilization": 0.5}
    far = {"max_num_seqs": 0.0, "gpu_memory_utilization": 0.5}
    assert flags_alike(at, same, "max_num_seqs", step=True) == 1.0
    assert 0.0 < flags_alike(at, beside, "max_num_seqs", step=True) < STEP_NEAR
    assert flags_alike(at, far, "max_num_seqs", step=True) < 0.02
    step = along_one("max_num_seqs")
    assert step.only == "max_num_seqs" and step in kernels_for(["max_num_seqs", "gpu_memory_utilization"])


def test_a_crash_halo_holds_the_crashed_values_grows_toward_more_load_and_a_survivor_shrinks_it() -> None:
    crashed = {"max_num_seqs": 1.0, "gpu_memory_utilization": 0.5}
    one_step_less = {"max_num_seqs": 2 / 3, "gpu_memory_utilization": 0.5}
    one_step_more = {"max_num_seqs": 1.0, "gpu_memory_utilization": 1.0}
    one_step_less_util = {"max_num_seqs": 1.0, "gpu_memory_utilization": 0.0}
    far = {"max_num_seqs": 0.0, "gpu_memory_utilization": 0.0}
    places = {"crashed": crashed, "one_step_less": one_step_less, "one_step_more": one_step_more, "far": far}
    places["one_step_less_util"] = one_step_less_util
    risk = {name: crash_risk(p, [crashed], []) for name, p in places.items()}
    assert risk["crashed"] == 1.0
    assert risk["one_step_more"] > risk["one_step_less_util"]  # the same step in utilization, toward more load
    assert risk["one_step_less"] > 0.5 > risk["far"] > 0.0  # far along both flags: each may not bound the region
    # a start that held its load beside the crash shelters its neighbourhood, not the crash's own values
    held = crash_risk(one_step_less, [crashed], [one_step_less])
    assert held == 0.0
    assert 0.0 < crash_risk(far, [crashed], [one_step_less]) < risk["far"]
    # two crashes differing in utilization alone: it does not bound the region, every utilization is inside
    both = [crashed, one_step_more]
    assert crash_risk(one_step_less_util, both, []) == 1.0
    assert unbounding(both) == {"gpu_memory_utilization"}


def nearly_flat(job_: Any, flags: VllmFlags, c: Coefficients) -> SimPoint:
    """The fake twin with throughput 300 + seqs + 10 x utilization: every flag set within a quarter of the best."""
    point = fake_simulate(job_, flags, c)
    tok_s = (300.0 + (flags.max_num_seqs or 0) + 10 * (flags.gpu_memory_utilization or 0.0)) / c.step_scale
    return replace(point, duration_s=1000 / tok_s)


def test_after_a_crash_the_twin_proposes_away_from_it_and_a_survivor_shrinks_the_halo() -> None:
    # The real server dies under load at 64 sequences, whatever the utilization; the twin foresees no crash. Its
    # best (64 sequences) crashes; the next proposal leaves the neighbourhood (the twin alone would take 64 at
    # another utilization: still its best), and the start that holds shrinks the risk beside it.
    study, sampler, log = twin_study(simulate_fn=nearly_flat)

    def reality(f: VllmFlags) -> tuple[str, float | None]:
        return (CRASHED, None) if f.max_num_seqs == 64 else (MEASURED, 300.0 + (f.max_num_seqs or 0))

    first = run_trial(study, reality)
    assert first.max_num_seqs == 64
    assert sampler.twin is not None
    twin_ = sampler.twin
    keys = {(c.flags.max_num_seqs, c.flags.gpu_memory_utilization): c.key for c in twin_.pool.values()}
    second = run_trial(study, reality)
    assert second.max_num_seqs != 64
    assert twin_.crash_risk(keys[64, 0.9]) > 0.5 > twin_.crash_risk(keys[second.max_num_seqs, 0.85])
    before = twin_.crash_risk(keys[16, 0.85])
    run_trial(study, reality)
    assert twin_.held_at and twin_.crash_risk(keys[16, 0.85]) < before
    assert any("risk of a crash" in line for line in log)


def test_a_throughput_error_a_step_along_one_flag_explains_does_not_hand_over() -> None:
    # Every flag set at 0.95 utilization runs at half the simulated speed, within the SLOs. The first trials' errors
    # are large (the twin learns the step from them), but once a residual along the flags predicts each trial from
    # the others the twin keeps the budget: the fallback would start from nothing the twin has learnt.
    j, sampler, log = twin()
    study = study_of(sampler)
    for _ in range(6):
        tell(study, j, lambda f: (fake_tok_s(f) * (0.5 if f.gpu_memory_utilization == 0.95 else 1.0), fake_e2e(f)))
    assert sampler.twin is not None and sampler.twin.choice.kernel is not GLOBAL
    assert not sampler.fell_back, [x for x in log if "falling back" in x]


def test_once_a_trial_met_the_slos_the_twin_exploits_what_can_beat_it_not_what_repeats_it() -> None:
    # A leader measured at 344 tok/s: a sure flag set predicted at 342 adds next to nothing, one predicted at 372
    # that meets the SLOs two times in three adds most of its margin.
    leader = 344.0
    repeat = predicted("repeat", 342.0, 0.99, 0.03)
    above = predicted("above", 372.0, 0.66, 0.03)
    assert expected_gain(above, above.box_tok_s, leader) > 5 * expected_gain(repeat, repeat.box_tok_s, leader)
    assert repeat.expected_tok_s > above.expected_tok_s  # the feasible throughput alone would repeat the leader
    assert expected_gain(repeat, 200.0, 0.0) == 0.0


def test_a_flag_the_residual_learnt_to_matter_parts_flag_sets_the_simulation_holds_alike() -> None:
    # The simulation holds 64 sequences alike to 32 (32 users); the server runs 64 at half speed. Once the trials
    # teach that, 64 sequences are no known answer from 32's measurement; where the server is as simulated, they are.
    def learnt(slow_at_64: float) -> tuple[Twin, dict[tuple[int | None, float | None], Candidate]]:
        t, at = swept(alike_above_32)

        def observe(c: Candidate) -> Observation:
            f = slow_at_64 if c.flags.max_num_seqs == 64 else 1.0
            as_simulated = c.flags.model_copy(update={"max_num_seqs": min(c.flags.max_num_seqs or 0, 32)})
            tok = fake_tok_s(as_simulated) * f
            figures = {"output_tok_s": tok, "e2e_p95": 0.5 / f, "success_rate": 1.0}
            return Observation(c.key, c.flags, True, False, tok, KV, figures, predicted={**figures, "e2e_p95": 0.5})

        t.refit([observe(at[k]) for k in ((32, 0.9), (64, 0.9), (16, 0.9), (64, 0.95))])
        return t, at

    stepped, at = learnt(0.5)
    assert stepped.choice.kernel.flag > 0  # a residual along the flags won leave-one-out
    assert stepped.alike(at[64, 0.85].key, at[32, 0.85].key)  # the simulation cannot tell them apart...
    assert stepped.known_answer(at[64, 0.85].key, [at[32, 0.85].key]) is None  # ...what the trials taught can
    as_simulated, _ = learnt(1.0)
    assert as_simulated.known_answer(at[64, 0.85].key, [at[32, 0.85].key]) == at[32, 0.85].key


def spare_by_seqs(job_: Any, flags: VllmFlags, c: Coefficients) -> SimPoint:
    """The fake twin, each flag set's fullest batch leaving 8 - 0.1 x sequences GiB spare (64: 1.6 GiB, 32: 4.8)."""
    point = fake_simulate(job_, flags, c)
    seqs = flags.max_num_seqs or 0
    r = resolve(flags, job_.gpu_profile(), job_.model_profile())
    need = runtime_need_bytes(job_.model_profile(), r, seqs)
    return replace(point, peak_running=seqs, headroom_bytes=need + int((8 - 0.1 * seqs) * GIB))


def test_a_crash_only_a_large_or_contradicted_headroom_shift_explains_is_a_region_not_a_memory_error() -> None:
    def refit(*trials: tuple[int, float, bool]) -> Twin:
        t, at = swept(spare_by_seqs)
        t.refit([Observation(at[s, u].key, at[s, u].flags, True, crashed, None, KV) for s, u, crashed in trials])
        return t

    # 64 sequences crash with 1.6 GiB to spare and 32 held: the runtime headroom is smaller than simulated
    explained = refit((64, 0.95, True), (32, 0.95, False))
    assert not explained.crashed_at and -4.8 < explained.coefficients.headroom_gib < -1.6
    # a crash with 4.8 GiB to spare is no arithmetic error; moving the headroom that far would crash most flag sets
    far = refit((32, 0.95, True))
    assert far.coefficients.headroom_gib == 0.0 and len(far.crashed_at) == 1
    # 64 sequences held at 0.9 with as little to spare as the crash at 0.95: no headroom explains both
    contradicted = refit((64, 0.95, True), (64, 0.9, False))
    assert contradicted.coefficients.headroom_gib == 0.0 and len(contradicted.crashed_at) == 1
    for t in (far, contradicted):
        # no flag set crashes by the memory arithmetic; the region's risk is where the crash was
        assert not any(t.predict(k).crashed for k in t.pool) and t.crash_risk(t.crashed_at[0]) > 0.5


def test_while_no_trial_met_the_slos_a_flag_set_alike_to_a_measured_one_is_launched_until_shown_inert() -> None:
    # 64 sequences simulate as 32 do (32 users). Once a trial met the SLOs, the likeness stands and 64 is answered
    # from 32's measurement; while every trial missed (as predicted), the simulation's word that the rest miss alike
    # is what the budget can still test, until two alike trials show the flag they differ in inert.
    def observed(c: Candidate, e2e: float) -> Observation:
        tok = fake_tok_s(c.flags.model_copy(update={"max_num_seqs": min(c.flags.max_num_seqs or 0, 32)}))
        figures = {"output_tok_s": tok, "e2e_p95": e2e, "success_rate": 1.0}
        return Observation(c.key, c.flags, True, False, tok, KV, figures, predicted=figures)

    t, at = swept(alike_above_32)
    t.refit([observed(at[32, 0.9], 1.0)])
    assert t.known_answer(at[64, 0.9].key, [at[32, 0.9].key]) == at[32, 0.9].key
    t, at = swept(alike_above_32)
    t.refit([observed(at[32, 0.9], 5.0)])
    assert t.known_answer(at[64, 0.9].key, [at[32, 0.9].key]) is None
    trials = [observed(at[32, 0.9], 5.0), observed(at[32, 0.95], 5.0), observed(at[64, 0.95], 5.0)]
    t.refit(trials)
    assert t.inert == {"max_num_seqs"}
    assert t.known_answer(at[64, 0.9].key, [o.key for o in trials]) == at[32, 0.9].key


def test_a_kv_capacity_that_differs_by_flag_set_is_taken_from_the_nearest_starts_not_their_median() -> None:
    def started(seqs: int, util: float, kv_tokens: int) -> Observation:
        c = at[seqs, util]
        return Observation(c.key, c.flags, True, False, None, kv_tokens)

    # Half the arithmetic's KV tokens at 0.95 utilization, all of them at 0.85 (memory outside the cache that grows
    # with the flag): the median (0.5) holds near 0.95, the start at 0.85 holds near it
    t, at = swept(fake_simulate)
    t.refit([started(64, 0.95, KV // 2), started(32, 0.95, KV // 2), started(32, 0.85, KV)])
    median = t.coefficients.kv_scale
    assert median == 0.5
    assert t.kv_at(at[16, 0.85].key, median) > 0.9 and t.kv_at(at[16, 0.95].key, median) < 0.55
    # starts that agree within a percent or two: one ratio for every flag set
    t, at = swept(fake_simulate)
    t.refit([started(64, 0.95, int(KV * 0.9)), started(32, 0.85, int(KV * 0.91))])
    assert not t.kv_ratios and t.kv_at(at[16, 0.85].key, t.coefficients.kv_scale) == t.coefficients.kv_scale
