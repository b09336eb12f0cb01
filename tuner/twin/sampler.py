"""`sampler: {name: twin}`: real trials go where the twin, refit to every real trial so far, puts the best.

Before the first launch the twin measures every candidate flag set (tuner.twin.model). Each proposal then:
refit the twin to the real trials, re-rank, and propose the best untried candidate (among near-equals, the one
farthest from what was tried; a flag set the twin simulates as one measured already only when nothing else is
left); every `explore_every`-th proposal goes instead where a trial most likely beats the leader (tuner.twin.explore).
After each real trial the record gets the twin's prediction (`twin_predicted_tok_s`; every SLO metric predicted and
measured in `twin_figures`) and the log a line of predicted against measured, the SLO verdict first: a trial the
twin said meets the SLOs and does not (or the reverse) is a wrong verdict (`twin_verdict_missed`), whatever its
throughput error. Where the twin stays wrong after `check_after` real trials (its throughput error above
`error_bound`, its verdicts wrong in most of the latest trials, or its ranking of the trials measured, each
predicted from the others, mostly reversed; from 3 trials, verdicts wrong that its residual cannot explain) the
sampler says so and hands over to the fallback sampler (TPE). The twin goes on refitting after that and stays its
prior: of a few flag sets the fallback draws, the one the twin expects the most feasible throughput from is proposed.

The fallback state lives in the study, not in one process: each trial's error (`twin_error`), miss
(`twin_missed`) or wrong verdict is a trial attribute and the hand-over a study attribute (`twin_fallback`), so a
rerun of `tuner tune` (or another worker) continues on the fallback where the twin gave up, and counts the errors
measured before.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState

from tuner.config import Job
from tuner.errors import TunerError
from tuner.flags import VllmFlags
from tuner.record import CRASHED, LAUNCH_FAILED, MEASURED, TrialRecord
from tuner.scoring import Slo
from tuner.space import SearchSpace
from tuner.store import flag_key
from tuner.twin.explore import expected_gain, explore
from tuner.twin.figures import THROUGHPUT, describe_miss, describe_surprise, measured_slo_values, violation_of
from tuner.twin.model import RERANK, Candidate, Observation, Predicted, Simulate, Twin, candidates, distance
from tuner.twin.residual import GLOBAL
from tuner.twin.simulate import simulate

__all__ = [
    "ERROR_ATTR",
    "FALLBACK_ATTR",
    "FIGURES_ATTR",
    "MISSED_ATTR",
    "PREDICTED_ATTR",
    "SAME_AS_ATTR",
    "VERDICT_ATTR",
    "TwinSampler",
    "twin_unsupported",
]

PREDICTED_ATTR = "twin_predicted_tok_s"
ERROR_ATTR = "twin_error"  # trial: |predicted - measured| / measured, for a trial measured in full as foreseen
MISSED_ATTR = "twin_missed"  # trial: it started, crashed or failed to start other than the twin predicted
VERDICT_ATTR = "twin_verdict_missed"  # trial: the SLO verdict the twin got wrong, said in a line
FIGURES_ATTR = "twin_figures"  # trial: {"predicted": {figure: value}, "measured": {...}, "chance": p}
FALLBACK_ATTR = "twin_fallback"  # study: {"after": real trials, "why": ...} once the twin handed over to TPE
# trial: the number of the measured trial whose flags the twin simulates alike (the same batch, the same steps);
# the study answers it with that trial's figures, as a repeat, and launches nothing (tuner.study.claims)
SAME_AS_ATTR = "twin_same_as"
VERDICT_AFTER = 3  # from this many real trials, wrong verdicts the residual cannot explain hand over to the fallback
GUIDE_DRAWS = 4  # after the hand-over: the fallback's draws the twin chooses among

Reserve = Callable[[str, int], bool]
NEAR_BEST = 0.02  # candidates predicted within this of the best are equals: the most distant from the tried wins


def twin_unsupported(job: Job) -> str | None:
    """Why the twin cannot imitate this job's target, or None: it needs a GPU (or a CPU with a fitted step-time
    profile) and a model the start-up arithmetic knows, and a throughput objective (it predicts the job's fixed
    load), a trace (whose capacity search it runs: tuner.twin.rate_search) or the cost objective (each shape's
    capacity: tuner.twin.cost)."""
    if job.objective not in ("throughput", "cost") and job.arrival.trace is None:
        return (
            f"the objective is {job.objective} on a {'closed loop' if job.arrival.closed else 'rate'} (the twin "
            "predicts throughput under the job's load, a capacity search on a trace, and the cost objective)"
        )
    try:
        gpu, model = job.gpu_profile(), job.model_profile()
    except TunerError as e:
        return str(e)
    if gpu.is_cpu and job.step_profile() is None:
        # A CPU server's step times are nothing like a GPU's roofline; a fitted profile is (tuner calibrate).
        return "gpu: cpu without target.profile (the twin knows a CPU server's step times only from `tuner calibrate`)"
    if not model.predictable:
        why = model.unknown_reason or "its architecture"
        return f"the start-up arithmetic does not know {job.target.model} ({why})"
    return None


class TwinSampler(BaseSampler):
    """An Optuna sampler; `bind(job, on_event)` before the first trial (the study does it)."""

    def __init__(
        self,
        space: SearchSpace,
        seed: int | None,
        fallback: BaseSampler,
        *,
        max_points: int = 400,
        explore_every: int = 4,
        error_bound: float = 0.25,
        check_after: int = 4,
        simulate_fn: Simulate = simulate,
    ) -> None:
        self.space = space
        self.seed = seed
        self.fallback = fallback
        self.max_points = max_points
        self.explore_every = explore_every
        self.error_bound = error_bound
        self.check_after = check_after
        self.simulate_fn = simulate_fn
        # What a prediction is worth to the study: its feasible throughput (the cost objective's: `bind`).
        self._expected: Callable[[Predicted], float] = lambda p: p.expected_tok_s
        self._optimistic: Callable[[Predicted], float] = lambda p: p.box_tok_s
        self.job: Job | None = None
        self.on_event: Callable[[str], None] = lambda _m: None
        self.twin: Twin | None = None
        self.fell_back = False
        self.errors: dict[int, float] = {}  # trial number -> |predicted - measured| / measured (in full, as foreseen)
        self.missed: dict[int, bool] = {}  # trial number -> it started or crashed other than the twin predicted
        self.verdicts: dict[int, bool] = {}  # trial number -> the twin's SLO verdict was wrong (measured in full)
        self._predicted: dict[int, Predicted] = {}
        self._fitted_on = -1
        self._proposals = 0
        self._random = RandomSampler(seed=seed)
        self._reserve: Reserve | None = None

    def reserve_with(self, reserve: Reserve) -> None:
        """`reserve(flag key, trial number)`: True when the flag set is now this trial's (the study's claims table),
        False when another trial holds it. Workers of one study share no memory and a running trial's params are
        stored only after the proposal, so without it two workers would both propose the best candidate."""
        self._reserve = reserve

    def bind(self, job: Job, on_event: Callable[[str], None] | None = None) -> None:
        self.job = job
        if job.objective == "cost":
            # Each flag set simulated at its capacity within the SLOs and ranked by the cost of the job's load.
            from tuner.twin.cost import CapacitySimulate, CostScore, capacity_simulate

            simulated = self.simulate_fn if isinstance(self.simulate_fn, CapacitySimulate) else None
            simulated = simulated or capacity_simulate(self.simulate_fn)
            self.simulate_fn = simulated
            score = CostScore(job, lambda: self.twin, simulated)
            self._expected, self._optimistic = score.expected, score.optimistic
        if on_event is not None:
            self.on_event = on_event

    # -- Optuna's sampler interface --------------------------------------------------------------------------

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return dict(self.space.distributions)

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        if "fixed_params" in trial.system_attrs:
            return {}  # an enqueued trial (the baseline): its parameters are given
        twin = self._ready()
        done = _real_trials(study)
        self._refit(twin, done)
        if self.fell_back or self._failing(twin, study, done):
            params = self._guided(twin, study, trial, done)
        else:
            choice = self._choose_reserved(twin, study, done, trial.number)
            if choice is None:
                return {}  # every candidate tried: the independent sampler draws the rest
            self._predicted[trial.number] = twin.predict(choice.key)
            params = dict(choice.params)
        self._mark_known(twin, study, trial, done, params)
        return params

    def _mark_known(
        self, twin: Twin, study: Study, trial: FrozenTrial, done: list[FrozenTrial], params: dict[str, Any]
    ) -> None:
        """A proposal the twin simulates as a trial already measured (only when nothing left can teach more, or the
        fallback's draw) is marked with that trial's number: the study answers it with those figures, as a repeat."""
        measured = _measured_keys(done)
        flags = self.space.repair(params).flags
        key = flag_key(flags.as_dict())
        twin.known.setdefault(key, flags)
        same = twin.known_answer(key, measured)
        if same is not None:
            study._storage.set_trial_user_attr(trial._trial_id, SAME_AS_ATTR, measured[same])
            trial.set_user_attr(SAME_AS_ATTR, measured[same])  # the trial the objective reads is this one, cached

    def sample_independent(
        self, study: Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        if self.fell_back:
            return self.fallback.sample_independent(study, trial, param_name, param_distribution)
        return self._random.sample_independent(study, trial, param_name, param_distribution)

    def reseed_rng(self) -> None:
        self._random.reseed_rng()
        self.fallback.reseed_rng()

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        self._restore(study)
        self._ready()  # the sweep, before the first launch: the baseline gets a prediction too
        self.fallback.before_trial(study, trial)

    def after_trial(self, study: Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None) -> None:
        self.fallback.after_trial(study, trial, state, values)
        if self.twin is None or state != TrialState.COMPLETE:
            return
        record = TrialRecord.from_attrs(trial.user_attrs)
        if record.is_duplicate or record.outcome not in (MEASURED, CRASHED, LAUNCH_FAILED):
            return
        key = flag_key(record.flags)
        self.twin.known.setdefault(key, VllmFlags.from_dict(record.flags))
        predicted = self._predicted.pop(trial.number, None) or self.twin.predict(key)
        store = study._storage
        store.set_trial_user_attr(trial._trial_id, PREDICTED_ATTR, _shown(predicted))
        foreseen, error = _error(predicted, record)
        measured = _measured_figures(record, self.twin.slos)
        if predicted.figures:
            shown = {"predicted": _rounded(predicted.figures), "measured": _rounded(measured)}
            store.set_trial_user_attr(trial._trial_id, FIGURES_ATTR, {**shown, "chance": round(predicted.chance, 4)})
        if not foreseen:
            self.missed[trial.number] = True
            store.set_trial_user_attr(trial._trial_id, MISSED_ATTR, True)
        elif error is not None and record.slo_stop is None:
            self.errors[trial.number] = error
            store.set_trial_user_attr(trial._trial_id, ERROR_ATTR, round(error, 6))
        wrong = _wrong_verdict(predicted, record, measured, self.twin.slos) if foreseen else None
        if wrong is not None:
            self.verdicts[trial.number] = True
            store.set_trial_user_attr(trial._trial_id, VERDICT_ATTR, wrong)
        self.on_event(f"trial {trial.number}: {_compare(predicted, record, foreseen, error, wrong)}")

    # -- the twin ------------------------------------------------------------------------------------------------

    def _ready(self) -> Twin:
        if self.twin is None:
            if self.job is None:
                raise RuntimeError("TwinSampler.bind(job) was not called")
            started = time.monotonic()
            pool = candidates(self.space, self.max_points, self.seed)
            self.twin = Twin(self.job, pool, self.simulate_fn)
            self.twin.sweep()
            ranked = sorted((self.twin.predict(c.key) for c in pool), key=self._rank)
            best = ranked[0] if ranked else None
            self.on_event(
                f"twin: {len(pool)} flag sets measured in the emulator's engine in virtual time "
                f"({time.monotonic() - started:.0f} s of CPU); {sum(p.feasible for p in ranked)} predicted to meet "
                f"the SLOs" + (f", the best at {self._shown_best(best)}" if best and best.feasible else "")
            )
        return self.twin

    def _refit(self, twin: Twin, done: list[FrozenTrial]) -> None:
        if len(done) == self._fitted_on:
            return
        self._fitted_on = len(done)
        observations = [_observation(t, twin.slos) for t in done]
        c = twin.refit([o for o in observations if o is not None])
        if done:
            headroom = f", runtime headroom {c.headroom_gib:+.2f} GiB" if c.headroom_gib else ""
            terms = "".join(
                f", {label} x{value:.2f}"
                for label, value in (
                    ("memory", c.memory_scale),
                    ("compute", c.compute_scale),
                    ("overhead", c.overhead_scale),
                )
                if value != 1.0
            )
            kv = f"x{c.kv_scale:.3f}"
            if twin.kv_ratios:
                kv = f"x{min(twin.kv_ratios.values()):.3f}..x{max(twin.kv_ratios.values()):.3f} by flag set"
            self.on_event(
                f"twin refit to {len(done)} real trial{'s' if len(done) > 1 else ''}: step time "
                f"x{c.step_scale:.3f}{terms}, KV tokens {kv}{headroom}{_residual_story(twin)}"
            )

    def _restore(self, study: Study) -> None:
        """What this study's earlier runs and other workers measured of the twin: the errors and misses of their
        trials, and whether it already handed over to TPE (then TPE goes on: the sweep is not redone)."""
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if isinstance(t.user_attrs.get(ERROR_ATTR), float | int):
                self.errors.setdefault(t.number, float(t.user_attrs[ERROR_ATTR]))
            if t.user_attrs.get(MISSED_ATTR) is True:
                self.missed.setdefault(t.number, True)
            if isinstance(t.user_attrs.get(VERDICT_ATTR), str):
                self.verdicts.setdefault(t.number, True)
        handed = study.user_attrs.get(FALLBACK_ATTR)
        if not self.fell_back and isinstance(handed, dict):
            self.fell_back = True
            self.on_event(
                f"twin: handed over to TPE after {handed.get('after')} real trials in an earlier run "
                f"({handed.get('why')}); TPE goes on"
            )

    def _failing(self, twin: Twin, study: Study, done: list[FrozenTrial]) -> bool:
        """Is the twin still wrong? From VERDICT_AFTER real trials: its SLO verdict wrong in most of the latest
        VERDICT_AFTER and its residual, fitted to the other trials, wrong there too (it cannot explain them). After
        `check_after`: its throughput error (the median of the latest trials measured in full) above the bound where a
        residual along the flags does not explain it, the latest `check_after` trials all not as it foresaw (a start,
        a crash), its SLO verdict wrong in most of them and in the latest (each given after what the trials before it
        taught), or its ranking of the trials measured (each predicted from the others) mostly reversed."""
        if self.fell_back or len(done) < min(self.check_after, VERDICT_AFTER):
            return False
        errors = [self.errors[t.number] for t in done if t.number in self.errors]
        latest = done[-self.check_after :]
        missed = [self.missed.get(t.number, False) for t in latest]
        unexplained = self._unexplained(twin, done[-VERDICT_AFTER:])
        wrong = sum(self.verdicts.get(t.number, False) for t in latest)
        recent = errors[-(self.check_after - 1) :]
        reversed_pairs = _reversed_pairs(done, lambda key: (twin.explained(key) or {}).get(THROUGHPUT))
        if len(done) >= VERDICT_AFTER and 2 * unexplained > VERDICT_AFTER:
            why = (
                f"its SLO verdict was wrong in {unexplained} of the last {VERDICT_AFTER} real trials and its "
                "residual, fitted to the other trials, cannot explain them"
            )
        elif len(done) < self.check_after:
            return False
        elif recent and min(statistics.median(recent), self._explained_error(twin, latest)) > self.error_bound:
            why = f"its throughput error stayed above {self.error_bound:.0%} (median of the last {len(recent)}: "
            why += f"{statistics.median(recent):.0%}) and its residual, fitted to the other trials, cannot explain it"
        elif all(missed):
            why = f"the last {len(missed)} real trials did not start or crash as it predicted"
        elif 2 * wrong > len(latest) and self.verdicts.get(latest[-1].number, False):
            # each verdict given after what the trials before it taught, the latest too: the learning is not working
            why = f"its SLO verdict was wrong in {wrong} of the last {len(latest)} real trials"
        elif reversed_pairs is not None:
            why = f"it ranked {reversed_pairs[0]} of {reversed_pairs[1]} pairs of measured trials the wrong way round"
        else:
            return False
        self.fell_back = True
        study.set_user_attr(FALLBACK_ATTR, {"after": len(done), "why": why})
        self.on_event(
            f"twin: {why} after {len(done)} real trials; falling back to TPE, which models the {len(done)} trials "
            "measured"
        )
        return True

    def _explained_error(self, twin: Twin, trials: list[FrozenTrial]) -> float:
        """The median throughput error of `trials` (those measured in full) as the twin predicts each from the other
        trials (its terms and residual fitted without it), where a residual along the flags won leave-one-out (a miss
        it explains along a flag is learnt, not a reason to hand over); infinite where none did or it cannot say."""
        if twin.choice.kernel is GLOBAL:
            return math.inf
        errors: list[float] = []
        for t in trials:
            r = TrialRecord.from_attrs(t.user_attrs)
            if t.number not in self.errors or not r.flags or not r.output_tok_s:
                continue
            again = twin.explained(flag_key(r.flags))
            if again is None or THROUGHPUT not in again:
                return math.inf
            errors.append(abs(again[THROUGHPUT] - r.output_tok_s) / r.output_tok_s)
        return statistics.median(errors) if errors else math.inf

    def _unexplained(self, twin: Twin, trials: list[FrozenTrial]) -> int:
        """Of `trials`, those whose SLO verdict the twin got wrong before they ran and still gets wrong from the
        other trials (its terms and residual fitted without it: tuner.twin.residual's leave-one-out)."""
        count = 0
        for t in trials:
            if not self.verdicts.get(t.number, False):
                continue
            r = TrialRecord.from_attrs(t.user_attrs)
            again = twin.explained(flag_key(r.flags)) if r.flags else None
            if again is None or r.feasible is None:
                count += 1
                continue
            meets = all(violation_of(slo, again) <= 0 for slo in twin.slos)
            count += meets != r.feasible
        return count

    def _guided(self, twin: Twin, study: Study, trial: FrozenTrial, done: list[FrozenTrial]) -> dict[str, Any]:
        """After the hand-over: a few of the fallback's draws (its own search, unchanged), and of them the one the
        refit twin expects the most feasible throughput from; the first draw where the twin sees no difference.
        A draw the twin simulates as a trial measured already comes after every other (it would teach nothing);
        when every draw was tried already, the twin's best untried flag set is proposed instead.
        A draw names every parameter: those outside the fallback's relative space come from its independent
        sampling, as Optuna would have asked it."""
        relative = self.fallback.infer_relative_search_space(study, trial)
        tried = _tried_keys(study, self.space)
        measured = _measured_keys(done)
        best: tuple[float, int, dict[str, Any], Predicted] | None = None
        for i in range(GUIDE_DRAWS):
            params = dict(self.fallback.sample_relative(study, trial, relative)) if relative else {}
            for name, dist in self.space.distributions.items():
                if name not in params:
                    params[name] = self.fallback.sample_independent(study, trial, name, dist)
            flags = self.space.repair(params).flags
            key = flag_key(flags.as_dict())
            twin.known.setdefault(key, flags)
            p = twin.predict(key)
            score = -1.0 if key in tried else -0.5 if twin.known_answer(key, measured) else self._expected(p)
            if best is None or score > best[0]:
                best = (score, i, params, p)
        assert best is not None
        if best[0] == -1.0:
            # Every draw was tried already (TPE repeats itself in a small space): each repeat is answered without a
            # launch, and a study of only repeats ends at the repeat cap with flag sets never measured. (A draw the
            # twin simulates as a measured one is untried: answered without a launch too, it still moves TPE on.)
            instead = self._untried(twin, study, done, trial.number)
            if instead is not None:
                p = self._predicted[trial.number] = twin.predict(instead.key)
                self.on_event(
                    f"twin: TPE drew only flag sets tried already; the twin's best untried one instead ({_describe(p)})"
                )
                return dict(instead.params)
        self._predicted[trial.number] = best[3]
        return best[2]

    def _untried(self, twin: Twin, study: Study, done: list[FrozenTrial], number: int) -> Candidate | None:
        """The twin's best flag set neither tried nor simulated as one measured, reserved for trial `number`; None
        when none is left."""

        def best(held: AbstractSet[str]) -> Candidate | None:
            teaching = self._left(twin, study, done, held)[1]
            return twin.pool[self._exploit(twin, teaching, study, self._leader(twin, done))] if teaching else None

        return self._reserved(number, best)

    def _choose_reserved(self, twin: Twin, study: Study, done: list[FrozenTrial], number: int) -> Candidate | None:
        """The choice, reserved for trial `number`; a candidate another running trial reserved is passed over, and
        the next candidate takes this turn (exploit or explore), not the one after."""
        choice = self._reserved(number, lambda held: self._choose(twin, study, done, held))
        if choice is not None:
            self._proposals += 1
        return choice

    def _reserved(self, number: int, pick: Callable[[AbstractSet[str]], Candidate | None]) -> Candidate | None:
        """`pick(held)`'s candidate, reserved for trial `number`; one another running trial holds is added to `held`
        and picked again."""
        held: set[str] = set()
        while True:
            choice = pick(held)
            if choice is None or self._reserve is None or self._reserve(choice.key, number):
                return choice
            held.add(choice.key)

    def _left(
        self, twin: Twin, study: Study, done: list[FrozenTrial], held: AbstractSet[str]
    ) -> tuple[list[str], list[str]]:
        """The pool's flag sets neither tried nor `held`; and of them those the twin does not simulate as one
        measured already (those that can teach)."""
        tried = _tried_keys(study, self.space) | held
        untried = [key for key in twin.pool if key not in tried]
        measured = _measured_keys(done)
        return untried, [key for key in untried if twin.known_answer(key, measured) is None]

    def _choose(
        self, twin: Twin, study: Study, done: list[FrozenTrial], held: AbstractSet[str] = frozenset()
    ) -> Candidate | None:
        """The proposal of this turn (`_proposals` + 1): the best untried candidate, or every `explore_every`-th turn
        the exploring one."""
        untried, teaching = self._left(twin, study, done, held)
        if not untried:
            return None
        # a flag set simulated as one measured already is proposed only when nothing else is left to learn from
        untried = teaching or untried
        best = self._exploit(twin, untried, study, self._leader(twin, done))
        if (self._proposals + 1) % self.explore_every == 0:
            explored = self._explore(twin, untried, best, done)
            if explored is not None:
                return twin.pool[explored]
        return twin.pool[best]

    def _exploit(self, twin: Twin, untried: list[str], study: Study, leader: float | None = None) -> str:
        """The best untried candidate under the refit twin, its leaders simulated again under the fit: the most
        feasible value expected, or once a trial met the SLOs the most expected over the leader's
        (tuner.twin.explore.expected_gain)."""

        def rank(p: Predicted) -> tuple[float, ...]:
            return _rank(p, self._worth(p, leader))

        for _ in range(RERANK):
            ranked = sorted((twin.predict(k) for k in untried), key=rank)
            leaders = [p.key for p in ranked[:3]]
            if all(twin.predict(k).exact for k in leaders):
                break
            twin.rerank(leaders)
        ranked = sorted((twin.predict(k) for k in untried), key=rank)
        top = ranked[0]
        if rank(top)[0] != 0:
            # none likely to meet the SLOs: of those the twin cannot tell apart, the one differing most from the
            # trials (a flag the twin treats as inert is then varied, not kept)
            equals = [p.key for p in ranked[:8] if rank(p) == rank(top)]
        else:
            bar = (1 - NEAR_BEST) * self._worth(top, leader)
            equals = [p.key for p in ranked[:3] if rank(p)[0] == 0 and self._worth(p, leader) >= bar]
        tried = self._tried_params(study)
        return max(equals, key=lambda k: (self._distance(twin.pool[k].params, tried), -equals.index(k)))

    def _explore(self, twin: Twin, untried: list[str], best: str, done: list[FrozenTrial]) -> str | None:
        """Where a trial can most likely beat the leader (tuner.twin.explore), the twin's measured error its
        uncertainty; never a flag set that could not beat the leader even if the twin were wrong by that error."""
        errors = [self.errors[t.number] for t in done if t.number in self.errors]
        u = max(statistics.median(errors) if errors else 0.2, 0.05)
        leader = self._leader(twin, done)
        found = explore([twin.predict(k) for k in untried if k != best], self._optimistic, leader, u)
        if found is None:
            return None
        p, chance = found
        against = f"beating the leader ({self._shown_value(leader)})" if leader else "meeting the SLOs (none met yet)"
        self.on_event(
            f"twin: exploring where a trial most likely changes the answer ({_describe(p)}; a {chance:.0%} "
            f"chance of {against})"
        )
        return p.key

    def _leader(self, twin: Twin, done: list[FrozenTrial]) -> float | None:
        """The best value a real trial measured meeting the SLOs (the box's tok/s; for the cost objective the twin's
        figure at its flag set, which its residual brings to what was measured), None before one did."""
        best: float | None = None
        for t in done:
            r = TrialRecord.from_attrs(t.user_attrs)
            if r.outcome != MEASURED or not r.feasible or not r.output_tok_s or not r.flags:
                continue
            p = twin.predict(flag_key(r.flags))
            value = self._optimistic(p) if self.job is not None and self.job.objective == "cost" else None
            value = value if value is not None else r.output_tok_s * p.replicas
            best = value if best is None else max(best, value)
        return best

    def _shown_value(self, value: float | None) -> str:
        if value is None:
            return "none"
        if self.job is not None and self.job.objective == "cost":
            unit = "$" if self.job.gpu_hour_usd() is not None else "GPU-h"
            return f"{1 / value:,.2f} {unit} per million output tokens" if value > 0 else "no capacity"
        return f"{value:,.0f} tok/s"

    def _shown_best(self, p: Predicted) -> str:
        if self.job is not None and self.job.objective == "cost":
            value = self._optimistic(p)
            unit = "$" if self.job.gpu_hour_usd() is not None else "GPU-h"
            return f"{1 / value:,.2f} {unit} per million output tokens" if value > 0 else "no capacity"
        return _box_figure(p)

    def _rank(self, p: Predicted) -> tuple[float, ...]:
        return _rank(p, self._expected(p))

    def _worth(self, p: Predicted, leader: float | None) -> float:
        """What a trial of `p` is expected to add: its feasible value before any trial met the SLOs, after that
        its expected gain over the leader."""
        return self._expected(p) if leader is None else expected_gain(p, self._optimistic(p), leader)

    def _tried_params(self, study: Study) -> list[dict[str, Any]]:
        return [t.params for t in study.get_trials(deepcopy=False) if t.params]

    def _distance(self, params: dict[str, Any], tried: list[dict[str, Any]]) -> float:
        """The normalised distance (0..1) to the nearest tried parameters."""
        if not tried:
            return 1.0
        return min(distance(self.space.distributions, params, other) for other in tried)


MIN_CHANCE = 0.05  # below this a flag set is ranked as missing the SLOs, by how far


def _rank(p: Predicted, expected: float) -> tuple[float, ...]:
    """By the feasible value it is expected to add (`expected`: its throughput, or for the cost objective its
    tokens per $, times its chance of meeting the SLOs); then the closest to the SLOs; what cannot start or crashes
    last."""
    if p.started and not p.crashed and p.chance >= MIN_CHANCE:
        return (0, -expected)
    if p.started and not p.crashed:  # none likely to meet them: the likeliest, nearest the SLOs in its spread
        return (1, -p.chance, p.violation - p.box_tok_s * 1e-9)
    return (2, 0.0)


def _reversed_pairs(done: list[FrozenTrial], again: Callable[[str], float | None]) -> tuple[int, int] | None:
    """(reversed, compared) when the twin ranks most pairs of trials measured in full the wrong way round. Only
    pairs it predicted more than NEAR_BEST x 5 apart count: closer ones are within its own error. A trial's
    prediction is the refit twin's from the other trials (`again(key)`: its leave-one-out) where it has one, else
    the one made before it ran: a ranking the refit has corrected is not held against it (the baseline, predicted
    before any trial, would otherwise count as reversed against every trial after the first refit)."""
    points = []
    for t in done:
        r = TrialRecord.from_attrs(t.user_attrs)
        predicted = again(flag_key(r.flags)) if r.flags else None
        predicted = predicted if predicted is not None else t.user_attrs.get(PREDICTED_ATTR)
        full = r.outcome == MEASURED and r.slo_stop is None and r.output_tok_s
        if full and isinstance(predicted, float | int) and predicted > 0:
            points.append((float(predicted), float(r.output_tok_s or 0.0)))
    pairs = [
        (a, b)
        for i, a in enumerate(points)
        for b in points[i + 1 :]
        if abs(a[0] - b[0]) > 5 * NEAR_BEST * max(a[0], b[0])
    ]
    wrong = sum((a[0] - b[0]) * (a[1] - b[1]) < 0 for a, b in pairs)
    return (wrong, len(pairs)) if len(pairs) >= 3 and 2 * wrong > len(pairs) else None


def _measured_keys(done: list[FrozenTrial]) -> dict[str, int]:
    """The flag sets real trials measured (a load run, whatever its verdict), by key: their trial numbers."""
    out: dict[str, int] = {}
    for t in done:
        r = TrialRecord.from_attrs(t.user_attrs)
        if r.outcome == MEASURED and r.flags:
            out.setdefault(flag_key(r.flags), t.number)
    return out


def _residual_story(twin: Twin) -> str:
    """What the residual says, for the refit's line: the kernel leave-one-out chose (its error against the global
    terms') and, along the flags, the flag value that carries the largest throughput error."""
    errors = twin.choice.errors
    if not errors:
        return ""
    kernel = twin.choice.kernel
    shown = ", ".join(f"{name} {e:.0%}" for name, e in errors.items() if name in (kernel.name, GLOBAL.name))
    story = f"; residual {kernel.name} (leave-one-out error: {shown})"
    if kernel.flag and twin.residual is not None:
        effects = []
        for key in twin.residuals:
            for flag, value in twin.flag_values(key).items():
                effects.append((abs(twin.residual.along(flag, key, THROUGHPUT)), flag, value, key))
        if effects:
            _, flag, value, key = max(effects)
            factor = math.exp(twin.residual.along(flag, key, THROUGHPUT))
            story += f", {flag} {value}: throughput x{factor:.2f}"
    return story


def _real_trials(study: Study) -> list[FrozenTrial]:
    """Finished trials that launched a server of their own (repeats and pre-launch skips measured nothing)."""
    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        r = TrialRecord.from_attrs(t.user_attrs)
        if not r.is_duplicate and r.outcome in (MEASURED, CRASHED, LAUNCH_FAILED):
            out.append(t)
    return sorted(out, key=lambda t: t.number)


def _tried_keys(study: Study, space: SearchSpace) -> set[str]:
    keys = set()
    for t in study.get_trials(deepcopy=False):
        flags = t.user_attrs.get("flags")
        if isinstance(flags, dict):
            keys.add(flag_key(flags))
        elif t.user_attrs.get("baseline"):
            keys.add(flag_key(space.baseline().as_dict()))
        elif t.params:
            keys.add(flag_key(space.repair(dict(t.params)).flags.as_dict()))
    return keys


def _observation(t: FrozenTrial, slos: Sequence[Slo]) -> Observation | None:
    r = TrialRecord.from_attrs(t.user_attrs)
    if not r.flags:
        return None
    full = r.outcome == MEASURED and r.slo_stop is None and r.output_tok_s
    return Observation(
        key=flag_key(r.flags),
        flags=VllmFlags.from_dict(r.flags),
        started=r.outcome in (MEASURED, CRASHED),
        crashed=r.outcome == CRASHED,
        output_tok_s=r.output_tok_s if full else None,
        kv_tokens=r.kv_tokens,
        figures=_measured_figures(r, slos) if full else {},
        predicted=_predicted_figures(t.user_attrs.get(FIGURES_ATTR)),
    )


def _predicted_figures(stored: Any) -> dict[str, float]:
    """The twin's figures before the trial ran, as after_trial stored them (FIGURES_ATTR)."""
    if not isinstance(stored, dict) or not isinstance(stored.get("predicted"), dict):
        return {}
    return {str(k): float(v) for k, v in stored["predicted"].items() if isinstance(v, int | float)}


def _measured_figures(r: TrialRecord, slos: Sequence[Slo]) -> dict[str, float]:
    """The throughput and each SLO metric a trial measured (its SLO values from its stored constraints)."""
    if r.outcome != MEASURED or not r.output_tok_s:
        return {}
    out = {THROUGHPUT: r.output_tok_s}
    if r.constraints and r.constraint_names:
        out.update(measured_slo_values(slos, r.constraint_names, r.constraints))
    return out


def _rounded(figures: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 6) for k, v in figures.items()}


def _wrong_verdict(p: Predicted, r: TrialRecord, measured: dict[str, float], slos: Sequence[Slo]) -> str | None:
    """The SLO verdict the twin got wrong for a trial measured as it foresaw, said in a line; None when right
    (or when there is no verdict to compare: a failed start, a crash, a record without one)."""
    if r.outcome != MEASURED or r.feasible is None or p.feasible == r.feasible:
        return None
    if not r.feasible:
        miss = describe_miss(slos, measured, p.figures)
        return f"misses {miss}" if miss else "misses the SLOs"
    surprise = describe_surprise(slos, measured, p.figures)
    return "meets the SLOs it was predicted to miss" + (f": {surprise}" if surprise else "")


def _shown(p: Predicted) -> float:
    """The prediction as the record keeps it: the throughput, 0 for a flag set predicted not to start or to crash."""
    return round(p.output_tok_s, 1) if p.started and not p.crashed else 0.0


CRASH_FORESEEN = 0.5  # a crash risk from which the twin counts a crash as foreseen (and a held load as not)


def _foreseen(p: Predicted) -> str:
    """The outcome the twin predicts: a failed start, a crash under load (simulated, or likelier than not near a
    crash it learnt: tuner.twin.crashes), or a measured load."""
    if not p.started:
        return LAUNCH_FAILED
    return CRASHED if p.crashed or p.crash_risk >= CRASH_FORESEEN else MEASURED


def _error(p: Predicted, r: TrialRecord) -> tuple[bool, float | None]:
    """Whether the outcome was the one predicted, and the relative throughput error where a throughput was both
    predicted and measured. A failed start or a crash the twin foresaw is agreement but no throughput error: a 0
    there would pull the median the fallback reads toward "right" while the twin's throughput went untested."""
    if r.outcome != _foreseen(p):
        return False, None
    if r.outcome == MEASURED and r.output_tok_s:
        return True, abs(p.output_tok_s - r.output_tok_s) / r.output_tok_s
    return True, None


def _describe(p: Predicted) -> str:
    if not p.started:
        return "predicted not to start"
    if p.crashed:
        return "predicted to crash under load"
    if p.violation > 0:
        slo = f"misses an SLO by {p.violation:.0%}"
    elif p.uncertain:
        slo = f"meets the SLOs, uncertain ({p.chance:.0%} chance)"
    else:
        slo = "meets the SLOs"
    risk = f", a {p.crash_risk:.0%} risk of a crash (near one it did not foresee)" if p.crash_risk >= 0.05 else ""
    return f"predicted {p.output_tok_s:,.0f} tok/s{_on_the_box(p)}, {slo}{risk}"


def _on_the_box(p: Predicted) -> str:
    """What a replica's prediction makes of the box, where the box holds more than one (the measured figure that
    follows is the one replica's, as the prediction before it is)."""
    return f" a replica ({p.replicas} on the box: {p.box_tok_s:,.0f})" if p.replicas > 1 else ""


def _box_figure(p: Predicted) -> str:
    return f"{p.box_tok_s:,.0f} tok/s" + (f" on the box ({p.replicas} replicas)" if p.replicas > 1 else "")


def _compare(p: Predicted, r: TrialRecord, foreseen: bool, error: float | None, wrong: str | None = None) -> str:
    if r.outcome == MEASURED and r.output_tok_s is not None:
        measured = f"measured {r.output_tok_s:,.0f} tok/s" + (" (stopped early)" if r.slo_stop else "")
        if wrong is not None:
            measured += f", {wrong}"
    else:
        measured = f"measured: {r.outcome} ({r.reason})"
    if not foreseen:
        verdict = "not as predicted"
    elif wrong is not None:
        verdict = "verdict wrong" + ("" if error is None else f", throughput error {error:.0%}")
    elif error is not None:
        verdict = f"error {error:.0%}"
    else:  # a failed start or a crash foreseen; or a load stopped before any token (nothing to compare)
        verdict = "as predicted" if r.outcome != MEASURED else "started as predicted, no throughput to compare"
    return f"twin {_describe(p)}; {measured}; {verdict}"
