"""The noise-aware study: before it ends it starts the baseline, the leader and what it cannot tell from the leader
again, within `budget.confirm`, keeps every start, and says how sure its result is.

The servers here have a known noise: each start's figures move by a seeded 3% (log-normal) between starts, and a
request's latency by 10% within a run. No test asserts a noise figure: only what the study did about it."""

from __future__ import annotations

import math
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState
from study_fakes import FakeLauncher, FakeServer, job

from tuner.cli.trial_lines import trial_line
from tuner.config import Job
from tuner.errors import LaunchError
from tuner.flags import VllmFlags
from tuner.load import LoadResult, RequestRecord
from tuner.scoring import Slo, summarize
from tuner.store import open_store
from tuner.study import Measurement, TuningRun
from tuner.study.confirm import CI_RUN_ATTR, CONFIRM_ATTR, MAX_STARTS, REPEAT_OF, Confirmation, closing_lines

BASELINE = 256  # the fake's reading of vLLM's default max_num_seqs


@dataclass
class NoisyServers:
    """Output tok/s and the median e2e per max_num_seqs; each start draws its own factor (`between`)."""

    tok_s: dict[int, float]
    e2e_s: dict[int, float]
    between: float = 0.03
    seed: int = 0
    starts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    async def __call__(self, server: FakeServer, j: Job, flags: VllmFlags) -> Measurement:
        seqs = flags.max_num_seqs or BASELINE
        self.starts.append(seqs)
        factor = math.exp(self.rng.gauss(0.0, self.between))
        records = [
            RequestRecord(
                index=i, start_s=i * 0.01, ttft_s=0.05, itl_s=[0.01] * 31,
                e2e_s=self.e2e_s[seqs] / factor * math.exp(self.rng.gauss(0.0, 0.1)),
                prompt_tokens=256, completion_tokens=32, ok=True,
            )
            for i in range(40)
        ]  # fmt: skip
        duration = 40 * 32 / (self.tok_s[seqs] * factor)
        summary = summarize(records, duration_s=duration, slos=j.parsed_slos())
        return Measurement(LoadResult(summary=summary, records=records), rate=summary.request_throughput)


SPACE = {"max_num_seqs": {"choices": [8, 16, 32, 64]}, "max_model_len": 4096}
# 32 and 64 within 1% of each other (not separable under a 3% noise), the rest far below.
TOK_S = {BASELINE: 600.0, 8: 300.0, 16: 500.0, 32: 1000.0, 64: 1010.0}
E2E_S = {BASELINE: 1.0, 8: 1.0, 16: 1.0, 32: 1.0, 64: 1.0}


def confirming_job(confirm: int, *, slos: list[str] | None = None) -> Job:
    return job(
        space=SPACE,
        sampler={"name": "grid"},
        budget={"n_trials": 5, "confirm": confirm},
        slos=slos or ["e2e_p95 <= 30s", "success_rate >= 0.9"],
    )


def run(j: Job, url: str, servers: NoisyServers, launcher: FakeLauncher, **kwargs: Any) -> tuple[list[str], Any]:
    tuning = TuningRun(j, launcher, storage_url=url, measure=servers, poll_s=0.05, **kwargs)
    try:
        report = tuning.run()
        return report.closing, tuning.study
    finally:
        tuning.close()


def starts_of(study: optuna.Study) -> dict[int, list[int]]:
    """max_num_seqs -> the numbers of the trials that started it (first trials and confirmation starts)."""
    out: dict[int, list[int]] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.user_attrs.get("duplicate_of") is not None and t.user_attrs.get(REPEAT_OF) is None:
            continue
        out.setdefault(t.user_attrs["flags"].get("max_num_seqs") or BASELINE, []).append(t.number)
    return out


def test_the_study_starts_again_what_overlaps_the_leader_and_says_what_is_not_separable(tmp_path: Path) -> None:
    servers, launcher = NoisyServers(TOK_S, E2E_S), FakeLauncher()
    lines, study = run(confirming_job(8), f"sqlite:///{tmp_path / 's.db'}", servers, launcher)
    starts = starts_of(study)
    # The baseline and both close flag sets were started again; the far ones never.
    assert len(starts[BASELINE]) >= 2 and len(starts[32]) >= 2 and len(starts[64]) >= 2
    assert len(starts[8]) == 1 and len(starts[16]) == 1
    # Each flag set goes to MAX_STARTS; the leader, the partner of every pair, may go further.
    assert sorted(len(s) for s in starts.values())[-2] <= MAX_STARTS
    # Every start is a launch of its own, and the launcher saw exactly those.
    assert len(launcher.launches) == sum(len(s) for s in starts.values()) == len(servers.starts)
    text = "\n".join(lines)
    leader = next(n for n in (32, 64) if f"#{starts[n][0]} beats the baseline by +" in text)
    other = 64 if leader == 32 else 32
    assert f"#{starts[leader][0]} and #{starts[other][0]} are not separable (" in text and "either will do" in text
    assert "95% CI +" in text
    # The headline rests on the pairs of starts made one after the other, not on starts taken far apart.
    assert "1 pair of starts, one after the other" in text
    # What it decided is kept for the readers, and every start has its within-run intervals.
    summary = study.user_attrs[CONFIRM_ATTR]
    assert summary["leader"] == starts[leader][0] and summary["lines"] == lines
    assert summary["flag_sets"][str(starts[32][0])]["starts"] == starts[32]
    for numbers in starts.values():
        for n in numbers:
            ci = study.trials[n].user_attrs[CI_RUN_ATTR]
            assert ci["output_tok_s"][1] <= ci["output_tok_s"][0] <= ci["output_tok_s"][2]
    # The progress line of a confirmation start says it was launched again, not answered from the first.
    assert f"[#{starts[32][0]} started again, to confirm it]" in trial_line(study.trials[starts[32][1]])


def test_the_confirmation_never_spends_more_than_its_budget(tmp_path: Path) -> None:
    for confirm in (0, 1, 3):  # none, one, and more than one (each a whole study)
        servers, launcher = NoisyServers(TOK_S, E2E_S), FakeLauncher()
        lines, study = run(confirming_job(confirm), f"sqlite:///{tmp_path / f'{confirm}.db'}", servers, launcher)
        repeats = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(REPEAT_OF) is not None]
        assert len(repeats) == confirm  # the close pair always wants more than 3
        assert len(launcher.launches) == 5 + confirm
        assert study.user_attrs[CONFIRM_ATTR]["starts_spent"] == confirm
        said = "budget.confirm is 0" if confirm == 0 else f"{confirm} of {confirm} extra starts"
        assert said in lines[-1]
    # The first extra start goes to the baseline: the headline must not rest on the first server started.
    assert seqs_of(repeats[0]) == BASELINE


def seqs_of(t: FrozenTrial) -> int:
    return int(t.user_attrs["flags"].get("max_num_seqs") or BASELINE)


def test_a_resumed_study_keeps_every_start_and_finishes_within_the_budget(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    servers, launcher = NoisyServers(TOK_S, E2E_S), FakeLauncher()
    holder: dict[str, TuningRun] = {}

    def stop_after_first_repeat(t: FrozenTrial) -> None:
        if t.user_attrs.get(REPEAT_OF) is not None:
            holder["run"].stop()

    tuning = TuningRun(
        confirming_job(4), launcher, storage_url=url, measure=servers, poll_s=0.05,
        on_trial_end=stop_after_first_repeat,
    )  # fmt: skip
    holder["run"] = tuning
    try:
        assert tuning.run().stopped_by == "stopped"
    finally:
        tuning.close()
    first = starts_of(tuning.study)
    assert sum(len(s) for s in first.values()) == 6  # the search's 5 and one confirmation start

    lines, study = run(confirming_job(4), url, servers, launcher)
    again = starts_of(study)
    assert sum(len(s) for s in again.values()) == 5 + 4
    for seqs, numbers in first.items():
        assert again[seqs][: len(numbers)] == numbers  # nothing measured before was lost or run again
    assert len(launcher.launches) == 9
    with open_store(url) as store:
        for numbers in again.values():
            for n in numbers:
                assert len(store.request_records("fake", n)) == 40
    assert "4 of 4 extra starts" in lines[-1]


def test_a_marginal_slo_verdict_is_decided_by_repeats_not_one_draw(tmp_path: Path) -> None:
    # 64 is much faster than 32, but its e2e p95 sits right on the bound: one run could land on either side.
    p95 = math.exp(1.6449 * 0.1)
    tok_s = {BASELINE: 500.0, 8: 300.0, 16: 400.0, 32: 1000.0, 64: 2000.0}
    e2e_s = {BASELINE: 1.0, 8: 1.0, 16: 1.0, 32: 1.0, 64: 2.0}
    j = confirming_job(8, slos=[f"e2e_p95 <= {2.0 * p95:.3f}s"])
    lines, study = run(j, f"sqlite:///{tmp_path / 's.db'}", NoisyServers(tok_s, e2e_s, seed=3), FakeLauncher())
    starts = starts_of(study)
    assert len(starts[64]) == MAX_STARTS
    verdict = study.user_attrs[CONFIRM_ATTR]["flag_sets"][str(starts[64][0])]["slos"]
    assert list(verdict.values()) in (["met"], ["missed"])
    assert any(line.startswith(f"#{starts[64][0]}: e2e_p95") and "by repeats" in line for line in lines)


def test_a_flag_set_that_no_longer_starts_is_not_started_again_and_again(tmp_path: Path) -> None:
    def second_start_fails(flags: VllmFlags, attempt: int) -> LaunchError | None:
        return LaunchError("no room", reason="cuda_oom") if flags.max_num_seqs == 32 and attempt >= 1 else None

    servers, launcher = NoisyServers(TOK_S, E2E_S), FakeLauncher(fail=second_start_fails)
    _, study = run(confirming_job(8), f"sqlite:///{tmp_path / 's.db'}", servers, launcher)
    first = starts_of(study)[32][0]
    again = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(REPEAT_OF) == first]
    assert 1 <= len(again) <= MAX_STARTS - 1
    assert all(t.user_attrs["outcome"] != "measured" for t in again)
    assert study.user_attrs[CONFIRM_ATTR]["starts_spent"] <= 8


# -- the decision itself, on trials written by hand ------------------------------------------------------------

SLO = Slo(metric="e2e_p95", op="<=", threshold=2.0)


def start(number: int, seqs: int, tok_s: float, e2e: tuple[float, float, float], **attrs: Any) -> FrozenTrial:
    met = e2e[0] <= SLO.threshold
    t = optuna.trial.create_trial(
        params={"max_num_seqs": seqs},
        distributions={"max_num_seqs": optuna.distributions.CategoricalDistribution([8, 16, 32, 64])},
        values=[tok_s, e2e[0]],
        user_attrs={
            "flags": {"max_num_seqs": seqs},
            "outcome": "measured",
            "output_tok_s": tok_s,
            "feasible": met,
            "constraint_names": ["startup", f"slo:{SLO}"],
            "constraints": [0.0, 0.0 if met else 0.1],
            CI_RUN_ATTR: {"output_tok_s": [tok_s, tok_s * 0.99, tok_s * 1.01], "e2e_p95_s": list(e2e)},
            **attrs,
        },
    )
    t.number = number
    return t


def test_one_start_within_the_noise_of_a_bound_is_marginal_and_started_again() -> None:
    trials = [
        start(0, 8, 500.0, (1.0, 0.9, 1.1), baseline=True),
        start(1, 8, 505.0, (1.0, 0.9, 1.1), baseline=True, repeat_of=0, duplicate_of=0),
        start(2, 32, 900.0, (1.5, 1.4, 1.6)),
        start(3, 32, 910.0, (1.5, 1.4, 1.6), repeat_of=2, duplicate_of=2),
        start(4, 64, 1500.0, (2.1, 1.9, 2.3)),  # missed by one draw, but the bound is inside its interval
    ]
    c = Confirmation.of(trials, [SLO])
    by = {g.number: g for g in c.flag_sets}
    assert by[4].slos[str(SLO)] == "marginal" and by[4].status == "marginal"
    assert c.leader is by[2]
    assert c.next_start() is by[4]


def test_repeats_decide_a_marginal_verdict_by_their_pooled_figure() -> None:
    base = [start(0, 8, 500.0, (1.0, 0.9, 1.1), baseline=True)]
    met_twice = [
        start(4, 64, 1500.0, (2.1, 1.9, 2.3)),
        start(5, 64, 1490.0, (1.9, 1.7, 2.1), repeat_of=4, duplicate_of=4),
        start(6, 64, 1510.0, (1.95, 1.75, 2.15), repeat_of=4, duplicate_of=4),
    ]
    c = Confirmation.of(base + met_twice, [SLO])
    g = next(g for g in c.flag_sets if g.number == 4)
    assert g.slos[str(SLO)] == "met" and "over 3 starts, met by 2" in g.decided[str(SLO)]
    assert c.leader is g
    missed_twice = [met_twice[0], start(5, 64, 1490.0, (2.2, 2.0, 2.4), repeat_of=4, duplicate_of=4)]
    missed_twice.append(start(6, 64, 1510.0, (1.95, 1.75, 2.15), repeat_of=4, duplicate_of=4))
    c = Confirmation.of(base + missed_twice, [SLO])
    g = next(g for g in c.flag_sets if g.number == 4)
    assert g.slos[str(SLO)] == "missed" and c.leader is not g


def test_a_gain_within_the_noise_is_said_to_be_so_and_the_headline_is_started_again() -> None:
    trials = [
        start(0, 8, 1000.0, (1.0, 0.9, 1.1), baseline=True),
        start(1, 8, 1100.0, (1.0, 0.9, 1.1), baseline=True, repeat_of=0, duplicate_of=0),
        start(2, 32, 1150.0, (1.0, 0.9, 1.1)),
        start(3, 32, 1060.0, (1.0, 0.9, 1.1), repeat_of=2, duplicate_of=2),
    ]
    c = Confirmation.of(trials, [SLO])
    lines = closing_lines(c, starts_spent=2, server_seconds=120.0, budget=6)
    assert lines[0].startswith("#2 and the baseline are not separable (+")
    assert "2 starts each" in lines[0] and lines[0].endswith("the gain is within the noise")
    assert lines[-1].endswith("confirmation: 2 of 6 extra starts, 2.0 server-min")
    # Both sides of the headline get a third start before anything else.
    assert c.next_start() in (c.leader, c.baseline) and c.leader is not c.baseline
    third = start(4, 32 if c.next_start() is c.leader else 8, 1070.0, (1.0, 0.9, 1.1), repeat_of=c.next_start().number)
    assert Confirmation.of([*trials, third], [SLO]).next_start() is not None  # the other side's third start


def test_two_workers_share_one_confirmation_budget(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    servers, launchers, errors = NoisyServers(TOK_S, E2E_S), [FakeLauncher(), FakeLauncher()], []
    # Made one after the other: threads opening one new SQLite file race to migrate it (Alembic's loader).
    runs = [
        TuningRun(confirming_job(3), launcher, storage_url=url, measure=servers, poll_s=0.05, worker=i)
        for i, launcher in enumerate(launchers)
    ]

    def worker(tuning: TuningRun) -> None:
        try:
            tuning.run()
        except BaseException as e:
            errors.append(e)
        finally:
            tuning.close()

    threads = [threading.Thread(target=worker, args=(tuning,)) for tuning in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    trials = runs[0].study.get_trials(deepcopy=False)
    repeats = [t for t in trials if t.user_attrs.get(REPEAT_OF) is not None]
    assert len(repeats) == 3 and all(t.state == TrialState.COMPLETE for t in repeats)
    assert sum(len(launcher.launches) for launcher in launchers) == 5 + 3


RATE = Slo(metric="success_rate", op=">=", threshold=0.99)


def with_success(t: FrozenTrial, rate: tuple[float, float, float]) -> FrozenTrial:
    t.user_attrs[CI_RUN_ATTR]["success_rate"] = list(rate)
    t.user_attrs["success_rate"] = rate[0]
    return t


def test_no_failed_request_is_a_met_success_rate_not_a_marginal_one() -> None:
    # 96 of 96: Wilson's interval reaches 96.2%, below the 0.99 bound, yet nothing measured points at a miss.
    trials = [with_success(start(0, 8, 500.0, (1.0, 0.9, 1.1), baseline=True), (1.0, 0.962, 1.0))]
    c = Confirmation.of(trials, [RATE])
    assert c.flag_sets[0].slos[str(RATE)] == "met"
    # One failure in 96 (98.96%): the bound is inside its interval, and repeats decide.
    trials = [with_success(start(0, 8, 500.0, (1.0, 0.9, 1.1), baseline=True), (0.9896, 0.943, 0.998))]
    assert Confirmation.of(trials, [RATE]).flag_sets[0].slos[str(RATE)] == "marginal"
