"""The study around the objective: a job's study run to its budget, one trial at a time, by one of many workers."""

from __future__ import annotations

import copy
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from optuna.exceptions import ExperimentalWarning, UpdateFinishedTrialError
from optuna.storages import RetryHeartbeatStaleTrialCallback, fail_stale_trials
from optuna.trial import FrozenTrial, TrialState

from tuner.config import Job
from tuner.errors import ENGINE_GONE, GPU_LOST, ConfigError, EngineGone, GpuLost, StorageError, TunerError
from tuner.intervals import Prior, platform_prior
from tuner.launch import Launcher
from tuner.record import INTERRUPTED, MEASURED, WORKLOAD_INVALID, StudyRecord, TrialRecord
from tuner.scoring import named_figures
from tuner.store import flag_key, open_store, safe_url
from tuner.store.waiting import StorageGone, StorageWait
from tuner.study.claims import repeats_stop_line
from tuner.study.confirm import (
    CI_RUN_ATTR,
    CONFIRM_ATTR,
    REPEAT_OF,
    Confirmation,
    RepeatingObjective,
    ci_run_attr,
    closing_lines,
    is_repeat,
    spent,
    summary_attr,
)
from tuner.study.contention import contention_lines
from tuner.study.heartbeat import Heartbeat
from tuner.study.job_change import JobChange
from tuner.study.job_check import Rejudge, settle_job
from tuner.study.journal import Journal, Kept, ResultKept, kept_from, store_kept
from tuner.study.lag import stop_if_lagged
from tuner.study.measure import Measure, measure_load
from tuner.study.preflight import Check, WorkloadRejected
from tuner.study.samplers import make_sampler, sampler_name
from tuner.study.space_carry import in_space
from tuner.study.storage import make_storage, study_attrs
from tuner.study.surroundings import disk_full, full_disk_error, wait_until
from tuner.study.unreachable import UnreachableWatch
from tuner.study.verdict import DIRECTIONS
from tuner.twin.sampler import SAME_AS_ATTR, TwinSampler

__all__ = ["REPEAT_CAP", "STOPPED_ATTR", "GpuLostStop", "RunReport", "TuningRun", "feasible_front", "retry_trial"]


class GpuLostStop(TunerError):
    """This worker stopped on a GPU of its own that was lost; the box's other workers, on their GPUs, go on."""


_SCHEMA_LOCK = "\x00tuner-schema"
STOPPED_ATTR = "stopped"
"""The study's attribute while its last run stopped on a workload the server refuses: {"reason", "message",
"trial"}; None again once a trial of a later run measures."""


_WHY_IT_FAILED = ("outcome", "reason", "message", "feasible")
REPEAT_CAP = 2
"""A run ends once the study's finished trials, repeats included, reach this many times its budget: a sampler that
proposes only flag sets already tried (a small discrete space, every point of it seen) would otherwise never end."""


@dataclass
class RunReport:
    study: optuna.Study
    trials_run: int
    # "budget", "timeout", "stopped", "grid done" (every grid point measured), "repeats" (REPEAT_CAP), "unreachable"
    # (an SLO the twin predicted nothing meets, and the measurements agreed: tuner.study.unreachable)
    stopped_by: str
    closing: list[str] = field(default_factory=list)  # how sure the result is (the confirmation's lines)

    @property
    def distinct(self) -> int:
        """Finished trials that tried a flag set of their own (the budget counts these)."""
        return len(_finished(self.study, repeats=False))

    @property
    def measured(self) -> int:
        """Of those, the flag sets whose server started and ran the load (not skipped, failed or crashed)."""
        tried = _finished(self.study, repeats=False)
        return sum(TrialRecord.from_attrs(t.user_attrs).outcome == MEASURED for t in tried)

    @property
    def repeats(self) -> int:
        """Finished trials whose flag set an earlier trial had tried: answered from its result, not launched."""
        return len(_finished(self.study)) - self.distinct

    @property
    def twin_answers(self) -> int:
        """Of the repeats, flag sets of their own the twin simulates as a measured trial (answered from it)."""
        answered = [t for t in _finished(self.study) if t.user_attrs.get("duplicate_of") is not None]
        return sum(isinstance(t.user_attrs.get(SAME_AS_ATTR), int) for t in answered)

    def repeats_said(self) -> str:
        """The finished line's count of trials answered without a launch: the sampler's repeats, and apart from them
        the flag sets the twin answered from the trial it simulates them as."""
        twin = self.twin_answers
        said = f"{self.repeats - twin} sampler repeats answered from their first trial"
        return said + (f", {twin} flag sets the twin answered from a measured trial alike" if twin else "")

    @property
    def confirmation_starts(self) -> int:
        """Finished trials that started a flag set again to confirm it (`budget.confirm` counts these)."""
        return sum(is_repeat(t) for t in _finished(self.study, confirmations=True))


SEED_STRIDE = 10_007
"""Seeds a worker's identity apart (its `--parallel` index or pid): more than any study's count of resumed trials."""


def seed_offset(identity: int, resumed: int) -> int:
    """A worker's seed offset: its identity, then the trials the study held when it opened (a resumed run goes on).

    Not their sum: two workers started together, the later pid opening the study before the baseline was queued
    (0 held) and the earlier after it (1 held), summed to one offset; their random samplers then drew the same flag
    sets in the same order, each proposal made twice, and the repeats reached REPEAT_CAP short of the budget."""
    return identity * SEED_STRIDE + resumed


def _finished(study: optuna.Study, *, repeats: bool = True, confirmations: bool = False) -> list[FrozenTrial]:
    """Finished trials: every sampler trial (its repeats of a flag set too unless `repeats` is False); the
    confirmation's starts only when asked for."""
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    if not confirmations:
        done = [t for t in done if not is_repeat(t)]
    return done if repeats else [t for t in done if t.user_attrs.get("duplicate_of") is None]


class TuningRun:
    """Runs a job's study to its budget: creates or loads it, enqueues the baseline, one trial at a time.

    The budget (`n_trials`) counts finished trials (COMPLETE/PRUNED) of the whole study, over every worker, that tried
    a flag set of their own: a sampler's repeat of a flag set already tried is answered from that trial's result and
    does not count (a trial is a new measurement; REPEAT_CAP bounds a sampler that only repeats). The decision to start
    one more and its creation happen under a lock shared by the workers, so the count is exact (a running trial counts
    until it turns out a repeat). A worker
    whose remaining budget is held by other workers' running trials waits for them (a dead one's trial is failed by
    the heartbeat, retried, and run by whoever is left).
    """

    def __init__(
        self,
        job: Job,
        launcher: Launcher,
        *,
        storage_url: str | None = None,
        measure: Measure = measure_load,
        on_event: Callable[[str], None] | None = None,
        on_trial_start: Callable[[int], None] | None = None,
        on_trial_end: Callable[[FrozenTrial], None] | None = None,
        poll_s: float = 1.0,
        preflight: Check | None = None,
        worker: int | None = None,
        rejudge: Rejudge | None = None,
    ) -> None:
        """`worker`: this worker's index among the `--parallel` workers of one box (its seed offset). `rejudge`:
        how the study's trials are judged again when the job's SLOs or objective changed (tuner.report.rejudge)."""
        self.job = job
        self.launcher = launcher
        self.url = storage_url or job.storage_url()
        self.on_event = on_event or (lambda _m: None)
        self.on_trial_start = on_trial_start or (lambda _n: None)
        self.on_trial_end = on_trial_end or (lambda _t: None)
        self.poll_s = poll_s
        self.space = job.search_space()
        self.rejudge = rejudge
        self.job_change = JobChange()
        try:
            self._open(worker)
        except Exception as e:
            if not disk_full(e):
                raise
            raise full_disk_error(self.url) from None
        self.objective = RepeatingObjective(
            job,
            launcher,
            store=self.store,
            study_name=job.study.name,
            measure=measure,
            on_event=on_event,
            poll_s=poll_s,
            preflight=preflight,
        )
        self._stop = threading.Event()
        self._only_repeats = False
        self.unreachable = UnreachableWatch(job, self.on_event)

    def _open(self, worker: int | None) -> None:
        """The project's tables and Optuna's study, created when new (a full disk is the caller's one line)."""
        job = self.job
        self.store = open_store(self.url)
        # Every storage call of the run waits out a database that went away, for the job's bound, saying so once.
        self.waiting = StorageWait(safe_url(self.url), job.study.storage_wait_s, self.on_event)
        self.store.waiting = self.waiting
        self.journal = Journal(job.source.parent if job.source is not None else Path.cwd(), job.study.name)
        try:
            sampler = self._worker_sampler(worker)
            # Workers started together would race to create Optuna's tables and the study: one at a time.
            with self.store.exclusive(_SCHEMA_LOCK):
                self.storage = make_storage(
                    self.url, heartbeat_interval=job.study.heartbeat_interval, grace_period=job.study.grace_period
                )
                self.storage.waiting = self.waiting
                # The job against the study's stored one, before Optuna's cache reads a trial: refused, or the
                # study carried over to it (tuner.study.job_check).
                self.job_change = settle_job(
                    self.storage, self.store, job, self.space, self.on_event, rejudge=self.rejudge
                )
                self.study = optuna.create_study(
                    study_name=job.study.name,
                    storage=self.storage,
                    directions=DIRECTIONS,
                    sampler=sampler,
                    load_if_exists=True,
                )
            resumed = len(self.study.get_trials(deepcopy=False))
            if resumed and job.sampler.seed is not None and sampler_name(job) != "grid":
                self.study.sampler = self._worker_sampler(worker, resumed=resumed)
        except BaseException:
            self.store.close()
            raise

    def _worker_sampler(self, worker: int | None, *, resumed: int = 0) -> optuna.samplers.BaseSampler:
        """The job's sampler as this worker runs it: a seed of its own, and the twin's proposals reserved.

        `resumed`: the trials the study already holds. A seeded sampler started again on them would draw its first
        run's proposals again (each one now a repeat, answered without a launch until REPEAT_CAP ends the run short
        of its budget); offset by them, a resumed run goes on where the first left off, still reproducibly."""
        job = self.job
        distributed = not self.url.startswith("sqlite")
        # Workers of one study must not share a seed, or their first random proposals coincide.
        identity = worker if worker is not None else (os.getpid() % 100_000) if distributed else 0
        offset = seed_offset(identity, resumed)
        seeded = job
        if sampler_name(job) == "grid":
            # Except the grid: its seed shuffles the grid's order and a trial holds a grid *id*, so workers
            # with orders of their own would run one point under two ids (and skip another).
            offset = 0
            if job.sampler.seed is None:
                seeded = job.model_copy(update={"sampler": job.sampler.model_copy(update={"seed": 0})})
        sampler = make_sampler(seeded, self.space, seed_offset=offset, on_event=self.on_event)
        if isinstance(sampler, TwinSampler):
            # Deterministic: without a reservation two workers would propose the same best candidate.
            store, name = self.store, job.study.name
            sampler.reserve_with(lambda key, number: store.claim(name, key, number) == number)
        return sampler

    def close(self) -> None:
        self.store.close()
        self.storage.remove_session()
        self.storage.engine.dispose()

    def stop(self) -> None:
        """Finish the running trial, then start no other."""
        self._stop.set()

    def prepare(self) -> None:
        """The study made ready to run (created with the baseline, interrupted trials retried), nothing run: what
        `--parallel`'s parent does once before its workers start."""
        self._prepare()

    def _prepare(self) -> None:
        """Under the workers' lock: results an earlier run kept while the database was away are written first (before
        the heartbeat fails their trials); a new study gets its attributes and the baseline; interrupted trials a
        retry."""
        with self.store.exclusive(self.job.study.name):
            self.journal.write_kept(self.study, self.store, self.on_event)
            attrs = self.study.user_attrs
            if "tuner_version" not in attrs:
                self.store.delete_study(self.job.study.name)  # rows of an older, deleted study of the same name
                for k, v in study_attrs(self.job).items():
                    self.study.set_user_attr(k, v)
                self.study.enqueue_trial(self.space.baseline_params(), user_attrs={"baseline": True})
                self.on_event(f"study {self.job.study.name!r} created in {safe_url(self.url)}; trial 0 is the baseline")
            else:
                made = StudyRecord.from_attrs(attrs)
                if made.gpu != self.job.target.gpu or made.model != self.job.target.model:
                    raise ConfigError(
                        f"study {self.job.study.name!r} was created for {made.model} on {made.gpu}, "
                        f"not {self.job.target.model} on {self.job.target.gpu}; give the job another study.name"
                    )
                if made.n_trials != self.job.budget.n_trials:
                    self.study.set_user_attr("n_trials", self.job.budget.n_trials)
                self._retry_interrupted()
                self._requeue_refused_baseline()

    def _retry_interrupted(self) -> None:
        trials = self.study.get_trials(deepcopy=False)
        # Every trial a retry was made of: a retry of a retry keeps its first trial's `failed_trial`.
        retried = {n for t in trials for n in t.system_attrs.get("retry_history", ())}
        retried |= {t.system_attrs.get("failed_trial") for t in trials if "failed_trial" in t.system_attrs}
        for t in trials:
            record = TrialRecord.from_attrs(t.user_attrs)
            if t.state != TrialState.FAIL or record.outcome != INTERRUPTED or t.number in retried:
                continue
            # A trial the engine or a lost GPU interrupted is run again however often that happened; one a person
            # interrupted once (the callback refuses a second retry of a trial that was already a retry).
            max_retry = None if record.reason in (ENGINE_GONE, GPU_LOST) else 1
            retry_trial(self.study, t, max_retry=max_retry)
            if max_retry is None or len(t.system_attrs.get("retry_history", ())) < max_retry:
                self.on_event(f"trial {t.number} was interrupted; it will be run again")

    def _requeue_refused_baseline(self) -> None:
        """A baseline whose server refused the workload measured nothing: the next run (the job fixed) runs it."""
        trials = self.study.get_trials(deepcopy=False)
        records = [(t, TrialRecord.from_attrs(t.user_attrs)) for t in trials]
        if any(r.baseline and t.state != TrialState.FAIL for t, r in records):
            return
        # Interrupted again after its retry, Optuna's retry refuses it: the baseline is run again all the same.
        refused = [t for t, r in records if r.baseline and r.outcome in (WORKLOAD_INVALID, INTERRUPTED)]
        if refused:
            self.study.enqueue_trial(self.space.baseline_params(), user_attrs={"baseline": True})
            why = (
                "was interrupted"
                if refused[-1].user_attrs.get("outcome") == INTERRUPTED
                else "was refused by the server"
            )
            self.on_event(f"trial {refused[-1].number}, the baseline, {why}; it will run again")

    def _stopped_on(self, trial: optuna.Trial, error: WorkloadRejected) -> None:
        stopped = {"reason": WORKLOAD_INVALID, "message": str(error), "trial": trial.number}
        self.study.set_user_attr(STOPPED_ATTR, stopped)

    def _next_trial(self) -> optuna.Trial | bool | None:
        """Under the lock: a new trial, None when the budget is spent, False when others hold the rest of it."""
        with self.store.exclusive(self.job.study.name):
            # Just after an outage every worker's heartbeat is as old as the outage: a grace period for them to beat
            # again before any is taken for dead.
            if not self.waiting.back_within(self.job.study.grace_period):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ExperimentalWarning)
                    fail_stale_trials(self.study)
            # The confirmation's starts are neither the search's budget nor a sampler's repeats.
            trials = [t for t in self.study.get_trials(deepcopy=False) if not is_repeat(t)]
            finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
            done = sum(t.user_attrs.get("duplicate_of") is None for t in finished)
            running = sum(t.state == TrialState.RUNNING for t in trials)
            if done >= self.job.budget.n_trials:
                return None
            if len(finished) >= REPEAT_CAP * self.job.budget.n_trials:
                self._only_repeats = True
                self.on_event(repeats_stop_line(finished, self.space, REPEAT_CAP, self.job.budget.n_trials))
                return None
            if done + running >= self.job.budget.n_trials:
                return False
            with warnings.catch_warnings():
                # Our loop does what optimize() does around a trial: stale trials failed first, a heartbeat meanwhile.
                warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
                return self.study.ask()

    def run(self) -> RunReport:
        try:
            return self._run()
        except Exception as e:
            if isinstance(e, StorageError) or not disk_full(e):
                raise
            raise full_disk_error(self.url) from None

    def _run(self) -> RunReport:
        self._prepare()
        started = time.monotonic()
        ran, stopped_by = self._search(started)
        if stopped_by in ("budget", "grid done", "repeats"):
            ran += self._confirm(started)
            if self._stop.is_set():
                stopped_by = "stopped"
            elif self._timed_out(started):
                stopped_by = "timeout"
        return RunReport(self.study, ran, stopped_by, self.closing())

    def _timed_out(self, started: float) -> bool:
        return self.job.budget.timeout is not None and time.monotonic() - started > self.job.budget.timeout

    def _search(self, started: float) -> tuple[int, str]:
        """The sampler's trials to the budget: (trials this worker ran, why it stopped)."""
        ran = 0
        waiting_said = False
        while True:
            if self._stop.is_set():
                return ran, "stopped"
            if self._timed_out(started):
                return ran, "timeout"
            with self.store.exclusive(self.job.study.name):
                unreachable = self.unreachable.check(self.study)
            if unreachable is not None:
                return ran, "unreachable"
            trial = self._next_trial()
            if trial is None:
                return ran, "repeats" if self._only_repeats else "budget"
            if trial is False:
                if not waiting_said:
                    self.on_event("the rest of the budget is running on other workers (or a dead one); waiting")
                    waiting_said = True
                time.sleep(self.poll_s)
                continue
            waiting_said = False
            assert isinstance(trial, optuna.Trial)
            self._run_one(trial)
            ran += 1
            if getattr(self.study.sampler, "exhausted", False):
                return ran, "grid done"

    def _run_one(self, trial: optuna.Trial) -> None:
        self.on_trial_start(trial.number)
        gone: EngineGone | None = None
        with Heartbeat(self.storage, trial._trial_id):
            try:
                values = self.objective(trial)
                self._keep_intervals(trial)
            except ResultKept as e:
                if e.taken:
                    self._store_taken(trial, e.kept)
                    return
                self.journal.keep(e.kept)
                raise StorageGone(
                    f"{e}; trial {trial.number}'s result is kept in {self.journal.path}: the same command stores it "
                    "once the database answers, and carries on"
                ) from None
            except StorageGone:
                raise  # nothing measured to keep, and no database to tell
            except EngineGone as e:
                # Recorded as interrupted (FAIL: no sampler learns from it, no budget is spent); run again below.
                self.study.tell(trial, state=TrialState.FAIL)
                gone = e
            except BaseException as e:
                if disk_full(e):
                    # Nothing more can be written (a FAIL neither); SQLite rolled the write back whole.
                    raise full_disk_error(self.url, trial.number) from None
                # A refused workload is FAIL too: it says nothing about the flags, and spends no budget.
                self.study.tell(trial, state=TrialState.FAIL)
                if isinstance(e, WorkloadRejected):
                    self._stopped_on(trial, e)
                if not isinstance(e, KeyboardInterrupt | TunerError):
                    self.on_event(f"trial {trial.number} failed in the tuner itself: {type(e).__name__}: {e}")
                raise
        if gone is not None:
            self._wait_for_engine(trial, gone)
            return
        self._tell(trial, list(values))
        if self.study.user_attrs.get(STOPPED_ATTR) and trial.user_attrs.get("outcome") == MEASURED:
            self.study.set_user_attr(STOPPED_ATTR, None)  # the server reads the workload again
        self.on_trial_end(self.study._storage.get_trial(trial._trial_id))
        stop_if_lagged(trial.number, trial.user_attrs, self.on_event)  # a machine that cannot hold the time_scale

    def _tell(self, trial: optuna.Trial, values: list[float]) -> None:
        """The trial's result told; if a worker that could reach the database while this one could not failed the
        trial as dead meanwhile, the result is stored as a trial of its own rather than lost."""
        try:
            self.study.tell(trial, values)
        except UpdateFinishedTrialError:
            self._store_taken(trial, kept_from(trial, values, self.store))

    def _store_taken(self, trial: optuna.Trial, kept: Kept) -> None:
        number = store_kept(self.study, self.store, kept)
        self.on_event(
            f"trial {trial.number} was taken for dead by another worker while this one could not reach the "
            f"database; its result is stored as trial {number}"
        )

    def _wait_for_engine(self, trial: optuna.Trial, gone: EngineGone) -> None:
        """Until the engine answers again (then the trial is run again), at most `target.engine_wait`. A lost GPU
        stops this worker at once: it rarely comes back without a reset, and the trial stays interrupted."""
        if isinstance(gone, GpuLost):
            raise GpuLostStop(
                f"{gone}: this worker stops (the GPU is lost: an Xid error or a driver reset; `nvidia-smi` says more); "
                f"trial {trial.number} is kept as interrupted, not its flags' doing, and runs again when the same "
                "command is run once the GPU answers"
            ) from gone  # the chain, NVML's own error in it, for the log file's details
        bound = self.job.target.engine_wait
        self.on_event(
            f"trial {trial.number} interrupted: {gone}; it is not the flags' doing: waiting up to {bound:g} s "
            f"(target.engine_wait) for {gone.engine} to answer, then it runs again"
        )
        waited = wait_until(gone.answers, bound, self.poll_s, self._stop)
        if self._stop.is_set():
            return  # kept as interrupted: the next run runs it again
        if waited is None:
            raise TunerError(
                f"{gone.engine} did not answer within {bound:g} s (target.engine_wait); trial {trial.number} is "
                "kept as interrupted and runs again when the same command is run"
            ) from gone
        self.on_event(f"{gone.engine} answers again after {waited:.0f} s; trial {trial.number} runs again")
        retry_trial(self.study, self.study._storage.get_trial(trial._trial_id))

    def _keep_intervals(self, trial: optuna.Trial) -> None:
        """A measured start's within-run intervals, from the requests the objective stored (none for a sampler's
        repeat: it measured nothing of its own)."""
        attrs = trial.user_attrs
        if attrs.get("outcome") != MEASURED or (attrs.get("duplicate_of") is not None and not is_repeat(trial)):
            return
        name = self.job.study.name
        detail = self.store.trial_detail(name, trial.number)
        duration = float((detail.load_summary or {}).get("duration_s") or 0.0) if detail is not None else 0.0
        records = self.store.request_records(name, trial.number)
        if records:
            # the SLOs' own percentiles too (a `ttft_p90` SLO's), so the confirmation judges them by an interval
            names = [*(s.metric for s in self.job.parsed_slos()), self.job.primary_latency()]
            kept = ci_run_attr(records, duration, seed=trial.number, named=named_figures(names))
            trial.set_user_attr(CI_RUN_ATTR, kept)

    # -- the confirmation: flag sets started again before the study ends (tuner.study.confirm) ------------------

    def _confirm(self, started: float) -> int:
        """Starts of the confirmation this worker ran, within `budget.confirm` over every worker."""
        ran = 0
        while not self._stop.is_set() and not self._timed_out(started):
            trial = self._next_repeat()
            if trial is None:
                break
            if trial is False:
                time.sleep(self.poll_s)
                continue
            assert isinstance(trial, optuna.Trial)
            self._run_one(trial)
            ran += 1
        return ran

    def _next_repeat(self) -> optuna.Trial | bool | None:
        """Under the lock: the next confirmation start, None when the result stands or the budget is spent, False
        while another worker's start is running (the next decision reads its result)."""
        with self.store.exclusive(self.job.study.name):
            trials = self.study.get_trials(deepcopy=False)
            count, _ = spent(trials)
            pending = [t for t in trials if is_repeat(t) and t.state in (TrialState.RUNNING, TrialState.WAITING)]
            if any(t.state == TrialState.WAITING for t in pending):
                return self._ask()  # a retried start (its first attempt interrupted): run it
            if pending:
                return False
            # The confirmation ranks flag sets by tok/s intervals; a cost study ranks them by the cost of its load.
            if count >= self.job.budget.confirm or self.job.objective == "cost":
                return None
            step = Confirmation.of(self._in_space(trials), self.objective.slos, self._prior()).next_step()
            if step is None:
                return None
            target, pair = step
            attrs = {REPEAT_OF: target.number, "duplicate_of": target.number, "baseline": target.baseline, **pair}
            self.study.enqueue_trial(target.params, user_attrs=attrs, skip_if_exists=False)
            self.on_event(
                f"confirming: {target.label} started again ({len(target.starts) + 1} starts; "
                f"{count + 1} of {self.job.budget.confirm} extra starts)"
            )
            return self._ask()

    def _prior(self) -> Prior:
        """The platform's between-start spread the confirmation starts from (tuner.intervals.PRIORS)."""
        return platform_prior(self.job.gpu_profile().is_cpu)

    def _in_space(self, trials: list[FrozenTrial]) -> list[FrozenTrial]:
        """The trials whose flag sets the job's space holds: a trial measured before the space was edited and
        outside it is history, never started again (tuner.study.space_carry)."""
        return [t for t in trials if in_space(self.space, t)]

    def _ask(self) -> optuna.Trial:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
            return self.study.ask()

    def closing(self) -> list[str]:
        """How sure the study's result is (also kept in the study's `confirm` attribute)."""
        if self.job.objective == "cost":
            return ["no confirmation starts: they compare flag sets by tok/s, a cost study by what its load costs"]
        trials = self.study.get_trials(deepcopy=False)
        count, seconds = spent(trials)
        c = Confirmation.of(self._in_space(trials), self.objective.slos, self._prior())
        lines = closing_lines(c, starts_spent=count, server_seconds=seconds, budget=self.job.budget.confirm)
        lines += contention_lines(trials, c)
        self.study.set_user_attr(CONFIRM_ATTR, summary_attr(c, lines, starts_spent=count, server_seconds=seconds))
        unreachable = self.unreachable.said(self.study)  # an SLO nothing meets: the line that ends the study
        return [*lines, unreachable] if unreachable is not None else lines


def retry_trial(study: optuna.Study, trial: FrozenTrial, max_retry: int | None = None) -> None:
    """The trial's flag set queued again (Optuna's retry: `failed_trial`, `retry_history` in its system attrs),
    with what it was queued with (baseline, a confirmation's target) but not why it failed."""
    again = copy.copy(trial)
    again.user_attrs = {k: v for k, v in trial.user_attrs.items() if k not in _WHY_IT_FAILED}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        RetryHeartbeatStaleTrialCallback(max_retry=max_retry)(study, again)


def feasible_front(study: optuna.Study) -> list[FrozenTrial]:
    """The feasible Pareto front, one trial per flag set (a duplicate shows as its original)."""
    seen: set[str] = set()
    out = []
    for t in sorted(study.best_trials, key=lambda t: t.number):
        record = TrialRecord.from_attrs(t.user_attrs)
        if record.is_duplicate or is_repeat(t):
            continue
        key = flag_key(record.flags)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return sorted(out, key=lambda t: -(t.values[0] if t.values else 0.0))
