"""The tuning study: an Optuna study whose trials launch a vLLM server with proposed flags and measure it.

Directions: maximize output tok/s, minimize the job's primary latency P95 (seconds). SLOs are Optuna constraints
(`trial.set_constraint`, <= 0 met), so `study.best_trials` is the feasible Pareto front. Trial 0 is vLLM's own defaults
(the baseline). One trial:

    suggest (vLLM's rules applied) -> claim the flag set (launched once per study, across workers)
      -> predict the start (skip what cannot start) -> launch -> load -> values + constraints -> store the detail

What a failure tells the sampler: a failed start, a crash and a predicted refusal are COMPLETE trials with the worst
values (0 tok/s, the request timeout as latency) and a positive "startup" constraint, graded by how far from starting
the flags were. TPE ranks infeasible trials by total violation into its "bad" group, NSGA-II by constrained
domination, GP models the constraint: all three then steer away from the region. A FAIL trial would be ignored by
every sampler, which keeps proposing the region that failed (auto-tuning-vllm #93). FAIL is kept for what says
nothing about the flags: a killed worker (retried once through the heartbeat) and Ctrl-C (retried on the next run).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import optuna
from optuna.exceptions import ExperimentalWarning
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback, fail_stale_trials
from optuna.trial import FrozenTrial, TrialState

from tuner import __version__
from tuner.clock import Clock
from tuner.config import Job
from tuner.errors import ConfigError, LaunchError, StorageError, TunerError
from tuner.feasibility import FeasibilityModel, Prediction
from tuner.flags import VllmFlags, resolve
from tuner.launch import DockerLauncher, EmulatorLauncher, Launcher, ProcessLauncher, Server
from tuner.load import CapacityStep, LoadResult, RequestRecord, find_max_rate, run_load
from tuner.scoring import LoadSummary, Slo
from tuner.space import SearchSpace, Suggestion
from tuner.store import Store, flag_key, open_store, safe_url

MEASURED = "measured"
LAUNCH_FAILED = "launch_failed"
CRASHED = "crashed"
SKIPPED_INFEASIBLE = "skipped_infeasible"
INTERRUPTED = "interrupted"
OUTCOMES = (MEASURED, LAUNCH_FAILED, CRASHED, SKIPPED_INFEASIBLE, INTERRUPTED)

DIRECTIONS: list[Literal["maximize", "minimize"]] = ["maximize", "minimize"]
STARTUP_CONSTRAINT = "startup"
LOG_TAIL_LINES = 40
_SCHEMA_LOCK = "\x00tuner-schema"

# How far from starting a refusal is, as the "startup" constraint (> 0: infeasible). Above any SLO violation a
# measured trial usually has, so the sampler ranks "ran but slow" above "did not run"; graded within a reason.
_STARTUP_VIOLATION = {
    "invalid_flags": 13.0,
    "insufficient_free_memory": 12.0,
    "no_kv_memory": 12.0,
    "cuda_oom": 11.0,
    "kv_cache_too_small": 10.0,  # + the missing fraction of max_model_len
    "crashed_under_load": 10.5,
    "start_timeout": 10.0,
    "unknown": 10.0,
}
# Failures that say nothing about the flags: retried once within the trial.
TRANSIENT_REASONS = ("start_timeout", "unknown")
# Stops the whole run: no flag set can start.
FATAL_REASONS = ("image_missing", "cannot_launch")


class _TrialLike(Protocol):
    """What the objective uses of optuna.Trial and optuna.trial.FixedTrial."""

    @property
    def number(self) -> int: ...

    @property
    def user_attrs(self) -> dict[str, Any]: ...

    def set_user_attr(self, key: str, value: Any) -> None: ...

    def set_constraint(self, key: str, value: float) -> None: ...

    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False) -> int: ...

    def suggest_float(
        self, name: str, low: float, high: float, *, step: float | None = None, log: bool = False
    ) -> float: ...

    def suggest_categorical(self, name: str, choices: Any) -> Any: ...


@dataclass
class Measurement:
    """What a load phase gave: the scored result, and for a capacity search every step and the rate found."""

    result: LoadResult | None
    steps: list[CapacityStep] = field(default_factory=list)
    scored_step: int = 0
    rate: float | None = None


Measure = Callable[[Server, Job, VllmFlags], Awaitable[Measurement]]


async def measure_load(server: Server, job: Job, flags: VllmFlags) -> Measurement:
    """The job's load phase against a ready server, timed on the server's clock (emulated seconds)."""
    clock = Clock(server.time_scale)
    seqs = resolve(flags, job.gpu_profile(), job.model_profile()).max_num_seqs
    slos = job.parsed_slos()
    if job.objective == "throughput":
        result = await run_load(
            server.base_url,
            server.model,
            job.workload,
            job.arrival,
            slos=slos,
            clock=clock,
            request_timeout_s=job.request_timeout,
            max_num_seqs=seqs,
            stop_on_slo_miss=job.stop_early,
        )
        return Measurement(result, rate=result.summary.request_throughput)
    search = await find_max_rate(
        server.base_url,
        server.model,
        job.workload,
        slos,
        clock=clock,
        requests_per_step=job.capacity_search.requests_per_step,
        max_steps=job.capacity_search.max_steps,
        request_timeout_s=job.request_timeout,
        seed=job.workload.seed,
        max_num_seqs=seqs,
        stop_on_slo_miss=job.stop_early,
    )
    scored = 0
    if search.best_rate is not None:
        scored = next((i for i, s in enumerate(search.steps) if s.rate == search.best_rate and s.meets_slos), 0)
    return Measurement(search.best, list(search.steps), scored, search.best_rate)


@dataclass
class TrialResult:
    """One trial's verdict, before it is told to Optuna and stored."""

    outcome: str
    flags: VllmFlags
    reason: str | None = None
    message: str | None = None
    prediction: Prediction | None = None
    measurement: Measurement | None = None
    facts: dict[str, Any] | None = None
    log_tail: str | None = None
    attempts: int = 0
    server_seconds: float = 0.0


def _tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _is_transient(error: LaunchError) -> bool:
    if error.reason in TRANSIENT_REASONS:
        return True
    if error.reason == "crashed_under_load":
        # A runtime CUDA OOM is the flags' doing (headroom at high utilization); another crash (Xid, NCCL, a
        # segfault) says nothing about them.
        text = (str(error) + "\n" + (error.log_tail or "")).lower()
        return "out of memory" not in text and "outofmemory" not in text
    return False


class Objective:
    """One trial: `Objective(job, launcher)(trial) -> (output tok/s, latency P95 s)`.

    Works with an `optuna.Trial` of a study (then `store` keeps the detail and the flag claims across workers) and with
    `optuna.trial.FixedTrial({...})` (no database: duplicates are remembered in memory).
    """

    def __init__(
        self,
        job: Job,
        launcher: Launcher,
        *,
        store: Store | None = None,
        study_name: str | None = None,
        measure: Measure = measure_load,
        feasibility: FeasibilityModel | None = None,
        on_event: Callable[[str], None] | None = None,
        poll_s: float = 1.0,
    ) -> None:
        self.job = job
        self.launcher = launcher
        self.store = store
        self.study_name = study_name or job.study.name
        self.measure = measure
        self.space: SearchSpace = job.search_space()
        self.slos: list[Slo] = job.parsed_slos()
        self.latency_metric = job.primary_latency()
        self.feasibility = feasibility or FeasibilityModel(
            job.gpu_profile(),
            job.model_profile(),
            memory_in_use_gib=job.target.emulator.memory_in_use_gib if job.target.launcher == "emulator" else 0.0,
            margin=job.feasibility.margin,
        )
        self.on_event = on_event or (lambda _msg: None)
        self.poll_s = poll_s
        self._local: dict[str, tuple[int, tuple[float, float], dict[str, Any], dict[str, float]]] = {}
        self._local_observations: list[tuple[int, int]] = []

    # -- the trial ------------------------------------------------------------------------------------------------

    def __call__(self, trial: _TrialLike) -> tuple[float, float]:
        baseline = bool(trial.user_attrs.get("baseline", False))
        suggestion = self.space.suggest(trial, baseline=baseline)
        flags = suggestion.flags
        key = flag_key(flags.as_dict())
        trial.set_user_attr("flags", flags.as_dict())
        trial.set_user_attr("baseline", baseline)
        if suggestion.repairs:
            trial.set_user_attr("repairs", list(suggestion.repairs))
        if suggestion.warnings:
            trial.set_user_attr("warnings", list(suggestion.warnings))
        for note in suggestion.repairs + suggestion.warnings:
            self.on_event(f"trial {trial.number}: {note}")

        copied = self._duplicate(trial, key)
        if copied is not None:
            return copied
        try:
            result = self._evaluate(trial, flags)
        except KeyboardInterrupt:
            self._record_interrupted(trial, flags, baseline)
            raise
        except BaseException:
            self._release(trial, key)
            raise
        return self._finish(trial, result, baseline, suggestion, key)

    def _evaluate(self, trial: _TrialLike, flags: VllmFlags) -> TrialResult:
        self._calibrate(trial)
        prediction = self.feasibility.predict(flags)
        trial.set_user_attr("predicted_kv_tokens", prediction.kv_tokens)
        trial.set_user_attr("predicted_kv_tokens_raw", prediction.raw_kv_tokens)
        trial.set_user_attr("kv_scale", prediction.kv_scale)
        if self.job.feasibility.enabled and not prediction.ok:
            self.on_event(f"trial {trial.number}: predicted not to start ({prediction.reason}); not launched")
            return TrialResult(SKIPPED_INFEASIBLE, flags, prediction.reason, prediction.message, prediction)
        attempts = 0
        server_seconds = 0.0
        while True:
            attempts += 1
            started = time.monotonic()
            crash: LaunchError | None = None
            try:
                measurement, facts, log_tail, crash = asyncio.run(self._launch_and_measure(flags, trial.number))
            except LaunchError as e:
                server_seconds += time.monotonic() - started
                if e.reason in FATAL_REASONS:
                    raise
                if _is_transient(e) and attempts < 2:
                    self.on_event(f"trial {trial.number}: {e.reason} (transient), retrying once")
                    continue
                return TrialResult(
                    LAUNCH_FAILED,
                    flags,
                    e.reason,
                    str(e),
                    prediction,
                    facts=self._failed_start_facts(e),
                    log_tail=_tail(e.log_tail or ""),
                    attempts=attempts,
                    server_seconds=server_seconds,
                )
            server_seconds += time.monotonic() - started
            if crash is not None:
                if _is_transient(crash) and attempts < 2:
                    self.on_event(f"trial {trial.number}: server crashed, not from the flags; retrying once")
                    continue
                return TrialResult(
                    CRASHED,
                    flags,
                    crash.reason,
                    str(crash),
                    prediction,
                    measurement,
                    facts,
                    log_tail or _tail(crash.log_tail or ""),
                    attempts,
                    server_seconds,
                )
            return TrialResult(
                MEASURED, flags, None, None, prediction, measurement, facts, log_tail, attempts, server_seconds
            )

    async def _launch_and_measure(
        self, flags: VllmFlags, number: int
    ) -> tuple[Measurement, dict[str, Any], str, LaunchError | None]:
        async with self.launcher.start(flags, study=self.study_name, trial=number) as server:
            facts = server.facts.model_dump()
            measurement = await self.measure(server, self.job, flags)
            crash = server.failure()
            log_tail = _tail(server.logs())
        return measurement, facts, log_tail, crash

    @staticmethod
    def _failed_start_facts(error: LaunchError) -> dict[str, Any] | None:
        est = getattr(error, "estimated_max_model_len", None)
        if error.reason == "kv_cache_too_small" and est:
            # vLLM's "estimated maximum model length" is the KV tokens the start would have had.
            return {"kv_tokens": int(est)}
        return None

    # -- values, constraints, attributes --------------------------------------------------------------------------

    def _worst_latency(self) -> float:
        return float(self.job.request_timeout)

    def _scored_summary(self, result: TrialResult) -> tuple[LoadSummary | None, list[float] | None]:
        """The summary the trial is scored on, and (for a capacity search that met no SLOs) its step's violations."""
        m = result.measurement
        if m is None:
            return None, None
        if m.result is not None:
            return m.result.summary, None
        if m.steps:
            # No rate met the SLOs: score the step that came closest, so the sampler sees how far off it was.
            step = min(m.steps, key=lambda s: sum(max(0.0, v) for v in s.violations) if s.violations else math.inf)
            return step.summary, list(step.violations) or None
        return None, None

    def _values_and_constraints(self, result: TrialResult) -> tuple[tuple[float, float], dict[str, float]]:
        zero_slos = {f"slo:{s}": 0.0 for s in self.slos}
        if result.outcome == MEASURED:
            summary, violations = self._scored_summary(result)
            if summary is not None:
                tput = float(summary.output_throughput)
                latency = self._latency(summary)
                if violations is not None and len(violations) == len(self.slos):
                    slo_c = {f"slo:{s}": float(v) for s, v in zip(self.slos, violations, strict=True)}
                else:
                    slo_c = {f"slo:{s}": float(s.violation(summary)) for s in self.slos}
                return (tput, latency), {STARTUP_CONSTRAINT: 0.0, **slo_c}
            # A load phase that produced nothing: as bad as a crash, and counted as one.
            return (0.0, self._worst_latency()), {STARTUP_CONSTRAINT: _STARTUP_VIOLATION["unknown"], **zero_slos}
        severity = _STARTUP_VIOLATION.get(result.reason or "unknown", 10.0)
        if result.reason == "kv_cache_too_small":
            need = resolve(result.flags, self.job.gpu_profile(), self.job.model_profile()).max_model_len
            have = (result.prediction.estimated_max_model_len if result.prediction else None) or 0
            if result.facts and result.facts.get("kv_tokens"):
                have = int(result.facts["kv_tokens"])
            severity += max(0.0, min(1.0, (need - have) / need)) if need else 1.0
        return (0.0, self._worst_latency()), {STARTUP_CONSTRAINT: severity, **zero_slos}

    def _latency(self, summary: LoadSummary) -> float:
        if summary.requests_succeeded == 0:
            return self._worst_latency()
        value = float(summary.metric(self.latency_metric))
        return value if math.isfinite(value) else self._worst_latency()

    def _finish(
        self, trial: _TrialLike, result: TrialResult, baseline: bool, suggestion: Suggestion, key: str
    ) -> tuple[float, float]:
        values, constraints = self._values_and_constraints(result)
        for name, value in constraints.items():
            trial.set_constraint(name, value)
        summary, _ = self._scored_summary(result)
        measured = result.outcome == MEASURED and summary is not None
        m = result.measurement
        diagnosis = (m.result.diagnosis if m is not None and m.result is not None else None) or None
        kv_tokens = (result.facts or {}).get("kv_tokens")
        attrs: dict[str, Any] = {
            "outcome": result.outcome,
            "reason": result.reason,
            "output_tok_s": float(summary.output_throughput) if measured and summary else None,
            "request_rate": (m.rate if m is not None and m.rate is not None else None) if measured else None,
            "success_rate": float(summary.success_rate) if measured and summary else None,
            "e2e_p95_s": _p95(summary, "e2e") if measured else None,
            "ttft_p95_s": _p95(summary, "ttft") if measured else None,
            "tpot_p95_s": _p95(summary, "tpot") if measured else None,
            "goodput": float(summary.goodput) if measured and summary else None,
            "diagnosis": diagnosis,
            "slo_stop": (m.result.slo_stop if m is not None and m.result is not None else None) if measured else None,
            "kv_tokens": int(kv_tokens) if kv_tokens else None,
            "feasible": all(v <= 0 for v in constraints.values()),
            "server_seconds": round(result.server_seconds, 3),
            "constraints": list(constraints.values()),
            "constraint_names": list(constraints),
            "attempts": result.attempts,
            "latency_metric": self.latency_metric,
        }
        if result.message:
            attrs["message"] = result.message[:500]
        for name, value in attrs.items():
            trial.set_user_attr(name, value)
        if result.outcome in (MEASURED, CRASHED) and result.prediction is not None:
            self._local_observations.append((result.prediction.raw_kv_tokens, int(kv_tokens or 0)))
        self._save_detail(trial, result, baseline, suggestion)
        self._local[key] = (trial.number, values, dict(trial.user_attrs), constraints)
        return values

    def _save_detail(self, trial: _TrialLike, result: TrialResult, baseline: bool, suggestion: Suggestion) -> None:
        if self.store is None or not isinstance(trial, optuna.Trial):
            return
        m = result.measurement
        self.store.save_trial(
            self.study_name,
            trial.number,
            flags=result.flags.as_dict(),
            baseline=baseline,
            outcome=result.outcome,
            reason=result.reason,
            message=result.message,
            prediction=result.prediction.as_dict() if result.prediction else None,
            startup_facts=result.facts,
            load_summary=m.result.summary.model_dump(mode="json") if m and m.result else None,
            capacity_steps=[s.model_dump(mode="json") for s in m.steps] if m and m.steps else None,
            scored_step=m.scored_step if m else None,
            server_metrics=m.result.server.model_dump(mode="json") if m and m.result and m.result.server else None,
            diagnosis=m.result.diagnosis if m and m.result else None,
            log_tail=result.log_tail,
            attempts=result.attempts,
            server_seconds=result.server_seconds,
        )
        records: Sequence[RequestRecord] = m.result.records if m and m.result else ()
        self.store.save_requests(self.study_name, trial.number, records, step=m.scored_step if m else 0)

    def _record_interrupted(self, trial: _TrialLike, flags: VllmFlags, baseline: bool) -> None:
        trial.set_user_attr("outcome", INTERRUPTED)
        trial.set_user_attr("reason", "interrupted")
        trial.set_user_attr("feasible", False)
        if self.store is not None and isinstance(trial, optuna.Trial):
            self.store.save_trial(
                self.study_name, trial.number, flags=flags.as_dict(), baseline=baseline, outcome=INTERRUPTED
            )

    # -- never the same flags twice -------------------------------------------------------------------------------

    def _duplicate(self, trial: _TrialLike, key: str) -> tuple[float, float] | None:
        """The stored result when this flag set was launched before (or is being launched by another worker)."""
        if self.store is None or not isinstance(trial, optuna.Trial):
            local = self._local.get(key)
            return None if local is None else self._copy(trial, *local)
        study = trial.study
        while True:
            owner = self.store.claim(self.study_name, key, trial.number)
            if owner == trial.number:
                return None
            previous = _trial_by_number(study, owner)
            if previous is None or previous.state in (TrialState.FAIL, TrialState.PRUNED):
                # The launch of this flag set died with its worker or was interrupted: this trial launches it.
                if self.store.take_over_claim(self.study_name, key, owner, trial.number):
                    return None
                continue
            if previous.state == TrialState.COMPLETE:
                assert previous.values is not None
                values = (float(previous.values[0]), float(previous.values[1]))
                return self._copy(trial, owner, values, previous.user_attrs, previous.constraints)
            # RUNNING or WAITING: another worker is measuring it now; wait for its result rather than launch again.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ExperimentalWarning)
                fail_stale_trials(study)
            time.sleep(self.poll_s)

    def _copy(
        self,
        trial: _TrialLike,
        owner: int,
        values: tuple[float, float],
        attrs: dict[str, Any],
        constraints: dict[str, float],
    ) -> tuple[float, float]:
        skip = {"flags", "baseline", "repairs", "warnings"}
        for name, value in attrs.items():
            if name not in skip:
                trial.set_user_attr(name, value)
        trial.set_user_attr("duplicate_of", owner)
        trial.set_user_attr("server_seconds", 0.0)
        trial.set_user_attr("attempts", 0)
        for name, value in constraints.items():
            trial.set_constraint(name, value)
        self.on_event(f"trial {trial.number}: same flags as trial {owner}; its result is reused, nothing launched")
        if self.store is not None and isinstance(trial, optuna.Trial):
            self.store.save_trial(
                self.study_name,
                trial.number,
                flags=trial.user_attrs.get("flags", {}),
                baseline=bool(trial.user_attrs.get("baseline")),
                outcome=str(attrs.get("outcome", MEASURED)),
                reason=attrs.get("reason"),
                message=f"duplicate of trial {owner}: not launched again",
                attempts=0,
                server_seconds=0.0,
            )
        return values

    def _release(self, trial: _TrialLike, key: str) -> None:
        if self.store is not None and isinstance(trial, optuna.Trial):
            with contextlib.suppress(StorageError):
                self.store.release_claim(self.study_name, key, trial.number)

    # -- calibration from the starts seen ---------------------------------------------------------------------------

    def _calibrate(self, trial: _TrialLike) -> None:
        self.feasibility.reset()
        if isinstance(trial, optuna.Trial):
            for t in trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
                a = t.user_attrs
                if a.get("duplicate_of") is None and a.get("outcome") in (MEASURED, CRASHED, LAUNCH_FAILED):
                    self.feasibility.observe(a.get("predicted_kv_tokens_raw"), a.get("kv_tokens"))
        else:
            for raw, observed in self._local_observations:
                self.feasibility.observe(raw, observed)


def _p95(summary: LoadSummary | None, base: str) -> float | None:
    if summary is None or summary.requests_succeeded == 0:
        return None
    value = float(summary.metric(f"{base}_p95"))
    return value if math.isfinite(value) else None


def _trial_by_number(study: optuna.Study, number: int) -> FrozenTrial | None:
    for t in study.get_trials(deepcopy=False):
        if t.number == number:
            return t
    return None


# -- the study around the objective -------------------------------------------------------------------------------


def build_launcher(job: Job) -> Launcher:
    """The job's launcher with its settings (secrets by name: values are read from the environment at start)."""
    t = job.target
    hf_id = job.model_profile().name
    if t.launcher == "emulator":
        e = t.emulator
        extra = [*e.extra_args, *(["--seed", str(e.seed)] if e.seed is not None else [])]
        return EmulatorLauncher(
            model=t.model,
            gpu=t.gpu,
            time_scale=e.time_scale,
            memory_in_use_gib=e.memory_in_use_gib,
            extra_args=extra,
            startup_timeout_s=t.startup_timeout,
        )
    if t.launcher == "docker":
        d = t.docker
        return DockerLauncher(
            image=d.image,
            model=d.model_id or hf_id,
            env=tuple(d.env),
            volumes=d.volumes,
            extra_args=d.extra_args,
            startup_timeout_s=t.startup_timeout,
            **d.options,
        )
    p = t.process
    return ProcessLauncher(
        command=p.command,
        model=p.model_id or hf_id,
        extra_args=p.extra_args,
        secret_env=tuple(dict.fromkeys([*p.env, "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"])),
        startup_timeout_s=t.startup_timeout,
        **p.options,
    )


def make_sampler(job: Job, space: SearchSpace, *, seed_offset: int = 0) -> optuna.samplers.BaseSampler:
    """The job's sampler. Multi-objective everywhere; constraints come from each trial's `set_constraint`."""
    s = job.sampler
    seed = None if s.seed is None else s.seed + seed_offset
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        if s.name == "tpe":
            kwargs: dict[str, Any] = {"seed": seed, "multivariate": True, "constant_liar": True}
            if s.n_startup_trials is not None:
                kwargs["n_startup_trials"] = s.n_startup_trials
            return optuna.samplers.TPESampler(**kwargs)
        if s.name == "nsga2":
            return optuna.samplers.NSGAIISampler(seed=seed, population_size=s.population_size or 8)
        if s.name == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if s.name == "grid":
            return optuna.samplers.GridSampler(space.grid(), seed=seed)
        import importlib.util

        if importlib.util.find_spec("torch") is None or importlib.util.find_spec("scipy") is None:
            raise ConfigError(
                "sampler.name: gp needs torch and scipy, which are not installed (pip install torch scipy); "
                "use tpe, nsga2, random or grid"
            ) from None
        gp_kwargs: dict[str, Any] = {"seed": seed}
        if s.n_startup_trials is not None:
            gp_kwargs["n_startup_trials"] = s.n_startup_trials
        return optuna.samplers.GPSampler(**gp_kwargs)


def make_storage(url: str, *, heartbeat_interval: int, grace_period: int) -> RDBStorage:
    """Optuna's RDB storage with a heartbeat: a trial left RUNNING by a dead worker is failed and retried once."""
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        try:
            return RDBStorage(
                url,
                heartbeat_interval=heartbeat_interval,
                grace_period=grace_period,
                heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1),
                **kwargs,
            )
        except Exception as e:  # SQLAlchemy and Optuna raise several kinds for a bad URL or a refused connection
            cause = str(getattr(e, "orig", None) or e).strip().splitlines()[0]
            raise StorageError(f"cannot open the Optuna storage {safe_url(url)!r}: {cause}") from None


def study_attrs(job: Job) -> dict[str, Any]:
    launcher = job.target.launcher
    return {
        "tuner_version": __version__,
        "gpu": job.target.gpu,
        "model": job.target.model,
        "launcher": launcher,
        "image": job.target.docker.image if launcher == "docker" else None,
        "workload_hash": job.workload.fingerprint(),
        "slos": list(job.slos),
        "objective": job.objective,
        "n_trials": job.budget.n_trials,
        "job": job.as_record(),
    }


class _Heartbeat:
    """Records the trial's heartbeat every interval while it runs (what Optuna's optimize() does for its trials)."""

    def __init__(self, storage: optuna.storages.BaseStorage, trial_id: int) -> None:
        self._storage = storage
        self._trial_id = trial_id
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _Heartbeat:
        interval = self._storage.get_heartbeat_interval() if isinstance(self._storage, RDBStorage) else None
        if interval:
            assert isinstance(self._storage, RDBStorage)
            storage = self._storage
            self._storage.record_heartbeat(self._trial_id)

            def beat() -> None:
                while not self._stop.wait(interval):
                    # A missed beat is retried next interval; the grace period absorbs it.
                    with contextlib.suppress(Exception):
                        storage.record_heartbeat(self._trial_id)

            self._thread = threading.Thread(target=beat, name="tuner-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


@dataclass
class RunReport:
    study: optuna.Study
    trials_run: int
    stopped_by: str  # "budget", "timeout", "stopped"


class TuningRun:
    """Runs a job's study to its budget: creates or loads it, enqueues the baseline, one trial at a time.

    The budget (`n_trials`) counts finished trials (COMPLETE/PRUNED) of the whole study, over every worker; the decision
    to start one more and its creation happen under a lock shared by the workers, so the count is exact. A worker
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
    ) -> None:
        self.job = job
        self.launcher = launcher
        self.url = storage_url or job.storage_url()
        self.on_event = on_event or (lambda _m: None)
        self.on_trial_start = on_trial_start or (lambda _n: None)
        self.on_trial_end = on_trial_end or (lambda _t: None)
        self.poll_s = poll_s
        self.space = job.search_space()
        self.store = open_store(self.url)
        try:
            distributed = not self.url.startswith("sqlite")
            # Workers of one study must not share a seed, or their first random proposals coincide.
            offset = (os.getpid() % 100_000) if distributed else 0
            sampler = make_sampler(job, self.space, seed_offset=offset)
            # Workers started together would race to create Optuna's tables and the study: one at a time.
            with self.store.exclusive(_SCHEMA_LOCK):
                self.storage = make_storage(
                    self.url, heartbeat_interval=job.study.heartbeat_interval, grace_period=job.study.grace_period
                )
                self.study = optuna.create_study(
                    study_name=job.study.name,
                    storage=self.storage,
                    directions=DIRECTIONS,
                    sampler=sampler,
                    load_if_exists=True,
                )
        except BaseException:
            self.store.close()
            raise
        self.objective = Objective(
            job,
            launcher,
            store=self.store,
            study_name=job.study.name,
            measure=measure,
            on_event=on_event,
            poll_s=poll_s,
        )
        self._stop = threading.Event()

    def close(self) -> None:
        self.store.close()
        self.storage.remove_session()
        self.storage.engine.dispose()

    def stop(self) -> None:
        """Finish the running trial, then start no other."""
        self._stop.set()

    def _prepare(self) -> None:
        """Under the workers' lock: a new study gets its attributes and the baseline; interrupted trials a retry."""
        with self.store.exclusive(self.job.study.name):
            attrs = self.study.user_attrs
            if "tuner_version" not in attrs:
                self.store.delete_study(self.job.study.name)  # rows of an older, deleted study of the same name
                for k, v in study_attrs(self.job).items():
                    self.study.set_user_attr(k, v)
                self.study.enqueue_trial(self.space.baseline_params(), user_attrs={"baseline": True})
                self.on_event(f"study {self.job.study.name!r} created in {safe_url(self.url)}; trial 0 is the baseline")
            else:
                if attrs.get("gpu") != self.job.target.gpu or attrs.get("model") != self.job.target.model:
                    raise ConfigError(
                        f"study {self.job.study.name!r} was created for {attrs.get('model')} on {attrs.get('gpu')}, "
                        f"not {self.job.target.model} on {self.job.target.gpu}; give the job another study.name"
                    )
                if attrs.get("n_trials") != self.job.budget.n_trials:
                    self.study.set_user_attr("n_trials", self.job.budget.n_trials)
                self._retry_interrupted()

    def _retry_interrupted(self) -> None:
        trials = self.study.get_trials(deepcopy=False)
        retried = {t.system_attrs.get("failed_trial") for t in trials if "failed_trial" in t.system_attrs}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            retry = RetryHeartbeatStaleTrialCallback(max_retry=1)
            for t in trials:
                if (
                    t.state == TrialState.FAIL
                    and t.user_attrs.get("outcome") == INTERRUPTED
                    and t.number not in retried
                ):
                    # The callback itself refuses a second retry of a trial that was already a retry.
                    retry(self.study, t)
                    self.on_event(f"trial {t.number} was interrupted; it will be run again")

    def _next_trial(self) -> optuna.Trial | bool | None:
        """Under the lock: a new trial, None when the budget is spent, False when others hold the rest of it."""
        with self.store.exclusive(self.job.study.name):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ExperimentalWarning)
                fail_stale_trials(self.study)
            trials = self.study.get_trials(deepcopy=False)
            done = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
            running = sum(t.state == TrialState.RUNNING for t in trials)
            if done >= self.job.budget.n_trials:
                return None
            if done + running >= self.job.budget.n_trials:
                return False
            with warnings.catch_warnings():
                # Our loop does what optimize() does around a trial: stale trials failed first, a heartbeat meanwhile.
                warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
                return self.study.ask()

    def run(self) -> RunReport:
        self._prepare()
        started = time.monotonic()
        ran = 0
        waiting_said = False
        while True:
            if self._stop.is_set():
                return RunReport(self.study, ran, "stopped")
            if self.job.budget.timeout is not None and time.monotonic() - started > self.job.budget.timeout:
                return RunReport(self.study, ran, "timeout")
            trial = self._next_trial()
            if trial is None:
                return RunReport(self.study, ran, "budget")
            if trial is False:
                if not waiting_said:
                    self.on_event("the rest of the budget is running on other workers (or a dead one); waiting")
                    waiting_said = True
                time.sleep(self.poll_s)
                continue
            waiting_said = False
            assert isinstance(trial, optuna.Trial)
            self.on_trial_start(trial.number)
            with _Heartbeat(self.storage, trial._trial_id):
                try:
                    values = self.objective(trial)
                except BaseException as e:
                    self.study.tell(trial, state=TrialState.FAIL)
                    if not isinstance(e, KeyboardInterrupt | TunerError):
                        self.on_event(f"trial {trial.number} failed in the tuner itself: {type(e).__name__}: {e}")
                    raise
            self.study.tell(trial, list(values))
            ran += 1
            self.on_trial_end(self.study._storage.get_trial(trial._trial_id))


def feasible_front(study: optuna.Study) -> list[FrozenTrial]:
    """The feasible Pareto front, one trial per flag set (a duplicate shows as its original)."""
    seen: set[str] = set()
    out = []
    for t in sorted(study.best_trials, key=lambda t: t.number):
        if t.user_attrs.get("duplicate_of") is not None:
            continue
        key = flag_key(t.user_attrs.get("flags", {}))
        if key not in seen:
            seen.add(key)
            out.append(t)
    return sorted(out, key=lambda t: -(t.values[0] if t.values else 0.0))


__all__ = [
    "DIRECTIONS",
    "OUTCOMES",
    "Measure",
    "Measurement",
    "Objective",
    "RunReport",
    "TrialResult",
    "TuningRun",
    "build_launcher",
    "feasible_front",
    "make_sampler",
    "make_storage",
    "measure_load",
    "study_attrs",
]
