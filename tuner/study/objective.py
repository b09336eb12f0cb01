"""One trial, orchestrated: suggest -> claim the flag set -> place it (its GPUs, their memory in use) -> predict the
start -> launch and measure -> verdict -> record. Each step is delegated (the space, `Claims`, `placed`, the
feasibility model, `launch_and_measure`, `Scorer`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from tuner.box import shape_refusal
from tuner.catalog.nvml import machine_devices
from tuner.config import Job
from tuner.errors import EngineGone
from tuner.feasibility import FeasibilityModel, Prediction
from tuner.flags import VllmFlags
from tuner.launch import Launcher
from tuner.load import RequestRecord
from tuner.record import (
    CRASHED,
    INTERRUPTED,
    LAUNCH_FAILED,
    MEASURED,
    SKIPPED_INFEASIBLE,
    WORKLOAD_INVALID,
    TrialRecord,
)
from tuner.scoring import Slo
from tuner.space import SearchSpace
from tuner.store import Store, flag_key
from tuner.store.waiting import StorageGone
from tuner.study.claims import Claims
from tuner.study.journal import Kept, ResultKept
from tuner.study.launching import Attempt, launch_and_measure
from tuner.study.measure import Measure, measure_load
from tuner.study.placement import DeviceRead, in_use_gib, placed
from tuner.study.preflight import Check, Preflight, WorkloadRejected, check_workload, workload_fault
from tuner.study.trial import TrialLike, TrialResult
from tuner.study.verdict import Scorer, Values

__all__ = ["Objective"]


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
        preflight: Check | None = None,
        read_devices: DeviceRead = machine_devices,
    ) -> None:
        self.job = job
        self.launcher = launcher
        self.store = store
        self.study_name = study_name or job.study.name
        self.measure = measure
        self.space: SearchSpace = job.search_space()
        self.slos: list[Slo] = job.parsed_slos()
        self.latency_metric = job.primary_latency()
        # The memory other processes hold is read per trial, on its GPUs (`in_use_gib`).
        self.feasibility = feasibility or FeasibilityModel(
            job.gpu_profile(), job.model_profile(), margin=job.feasibility.margin
        )
        self.read_devices = read_devices
        self.on_event = on_event or (lambda _msg: None)
        self.scorer = Scorer(
            job.judged_slos(),
            self.latency_metric,
            float(job.request_timeout),
            job.gpu_profile(),
            job.model_profile(),
            box_gpus=job.box_gpus(),
            gpu_hour_usd=job.gpu_hour_usd(),
            cost_load=job.cost_load() if job.objective == "cost" else None,
        )
        self.claims = Claims(store, self.study_name, self.on_event, poll_s)
        # The real load is preceded by the real probes; a load of one's own (a test's fake) has no server to probe
        # unless it brings its own check.
        check = preflight or (check_workload if measure is measure_load else None)
        self.preflight = Preflight(check, self.on_event) if check is not None else None
        self._local_observations: list[tuple[int, int]] = []

    def __call__(self, trial: TrialLike) -> Values:
        baseline = bool(trial.user_attrs.get("baseline", False))
        suggestion = self.space.suggest(trial, baseline=baseline)
        flags = suggestion.flags
        key = flag_key(flags.as_dict())
        known = TrialRecord(
            flags=flags.as_dict(),
            baseline=baseline,
            repairs=list(suggestion.repairs),
            warnings=list(suggestion.warnings),
        )
        _write(trial, known.model_dump(include={"flags", "baseline", "repairs", "warnings"}))
        for note in suggestion.repairs + suggestion.warnings:
            self.on_event(f"trial {trial.number}: {note}")

        copied = self._duplicate(trial, key)
        if copied is not None:
            return copied
        try:
            result, known = self._evaluate(trial, flags, known)
        except KeyboardInterrupt:
            self._record_interrupted(trial, flags, baseline)
            raise
        except EngineGone as e:
            # Not the flags' doing and not infeasible: the run waits for the engine and runs the flags again.
            self._record_interrupted(trial, flags, baseline, reason=e.reason, message=str(e))
            self.claims.release(trial, key)
            raise
        except WorkloadRejected as e:
            self._record_rejected(trial, flags, baseline, e)
            self.claims.release(trial, key)
            raise
        except BaseException:
            self.claims.release(trial, key)
            raise
        return self._finish(trial, result, known, key)

    def _duplicate(self, trial: TrialLike, key: str) -> Values | None:
        return self.claims.duplicate(trial, key)

    def _evaluate(self, trial: TrialLike, flags: VllmFlags, known: TrialRecord) -> tuple[TrialResult, TrialRecord]:
        self._calibrate(trial)
        refusal = shape_refusal(self.job.box_gpus(), flags.world_size)
        if refusal is not None:
            self.on_event(f"trial {trial.number}: {refusal}")
            return TrialResult(SKIPPED_INFEASIBLE, flags, "shape_does_not_fit", refusal), known
        # Memory other processes hold only takes from a start: flags that cannot start on idle GPUs borrow none.
        prediction = self.feasibility.predict(flags, memory_in_use_gib=0.0)
        if not self._may_start(trial, prediction):
            return self._skipped(flags, prediction), self._predicted(trial, known, prediction)
        # The trial's GPUs are held from the prediction, which reads their memory, until its server is done.
        with placed(self.launcher, flags, trial.number) as placement:
            in_use = in_use_gib(self.job, placement, flags, self.read_devices)
            prediction = self.feasibility.predict(flags, memory_in_use_gib=in_use)
            known = self._predicted(trial, known, prediction)
            if not self._may_start(trial, prediction):
                return self._skipped(flags, prediction), known
            attempt = Attempt(
                placement.launcher, self.job, self.measure, self.study_name, trial.number, self.on_event, self.preflight
            )
            result = launch_and_measure(attempt, flags, prediction)
        loaded = result.measurement.result if result.measurement is not None else None
        if result.outcome == MEASURED and loaded is not None:
            fault = workload_fault(self.job, flags, loaded.records)
            if fault is not None:
                raise fault  # every request refused alike: nothing about these flags was measured
        return result, known

    def _may_start(self, trial: TrialLike, prediction: Prediction) -> bool:
        if prediction.ok or not self.job.feasibility.enabled:
            return True
        self.on_event(f"trial {trial.number}: predicted not to start ({prediction.reason}); not launched")
        return False

    @staticmethod
    def _skipped(flags: VllmFlags, prediction: Prediction) -> TrialResult:
        return TrialResult(SKIPPED_INFEASIBLE, flags, prediction.reason, prediction.message, prediction)

    @staticmethod
    def _predicted(trial: TrialLike, known: TrialRecord, prediction: Prediction) -> TrialRecord:
        known = known.model_copy(
            update={
                "predicted_kv_tokens": prediction.kv_tokens,
                "predicted_kv_tokens_raw": prediction.raw_kv_tokens,
                "kv_scale": prediction.kv_scale,
            }
        )
        _write(trial, known.model_dump(include={"predicted_kv_tokens", "predicted_kv_tokens_raw", "kv_scale"}))
        return known

    def _finish(self, trial: TrialLike, result: TrialResult, known: TrialRecord, key: str) -> Values:
        values, constraints = self.scorer.values_and_constraints(result)
        record = self.scorer.record(result, constraints, known)
        detail = self._detail(result, record.baseline)
        try:
            for name, value in constraints.items():
                trial.set_constraint(name, value)
            _write(trial, record.to_attrs())
            self._save_detail(trial, result, detail)
        except (StorageGone, UpdateFinishedTrialError) as e:
            # The database stayed away past the wait, or the trial was failed as dead meanwhile: what was measured is
            # handed up to be kept, not lost.
            m = result.measurement
            loaded = m.result if m is not None else None
            kept = Kept(
                number=trial.number,
                values=list(values),
                user_attrs=trial.user_attrs | record.to_attrs(),
                constraints=dict(constraints),
                detail=detail,
                requests=[r.model_dump(mode="json") for r in (loaded.records if loaded else ())],
                step=m.scored_step if m else 0,
            )
            raise ResultKept(str(e), kept, taken=isinstance(e, UpdateFinishedTrialError)) from e
        if result.outcome in (MEASURED, CRASHED) and result.prediction is not None:
            self._local_observations.append((result.prediction.raw_kv_tokens, int(record.kv_tokens or 0)))
        self.claims.remember(key, trial.number, values, trial.user_attrs, constraints)
        return values

    @staticmethod
    def _detail(result: TrialResult, baseline: bool) -> dict[str, Any]:
        """The trial's detail row (Store.save_trial's fields), plain JSON: it may have to wait in a journal."""
        m = result.measurement
        loaded = m.result if m is not None else None
        return {
            "flags": result.flags.as_dict(),
            "baseline": baseline,
            "outcome": result.outcome,
            "reason": result.reason,
            "message": result.message,
            "prediction": result.prediction.as_dict() if result.prediction else None,
            "startup_facts": result.facts,
            "load_summary": loaded.summary.model_dump(mode="json") if loaded else None,
            "capacity_steps": [s.model_dump(mode="json") for s in m.steps] if m and m.steps else None,
            "scored_step": m.scored_step if m else None,
            "server_metrics": loaded.server.model_dump(mode="json") if loaded and loaded.server else None,
            "diagnosis": loaded.diagnosis if loaded else None,
            "log_tail": result.log_tail,
            "attempts": result.attempts,
            "server_seconds": result.server_seconds,
        }

    def _save_detail(self, trial: TrialLike, result: TrialResult, detail: dict[str, Any]) -> None:
        if self.store is None or not isinstance(trial, optuna.Trial):
            return
        m = result.measurement
        loaded = m.result if m is not None else None
        self.store.save_trial(self.study_name, trial.number, **detail)
        records: Sequence[RequestRecord] = loaded.records if loaded else ()
        self.store.save_requests(self.study_name, trial.number, records, step=m.scored_step if m else 0)

    def _record_interrupted(
        self, trial: TrialLike, flags: VllmFlags, baseline: bool, reason: str = "interrupted", message: str = ""
    ) -> None:
        attrs: dict[str, object] = {"outcome": INTERRUPTED, "reason": reason, "feasible": False}
        _write(trial, attrs | ({"message": message} if message else {}))
        if self.store is not None and isinstance(trial, optuna.Trial):
            self.store.save_trial(
                self.study_name,
                trial.number,
                flags=flags.as_dict(),
                baseline=baseline,
                outcome=INTERRUPTED,
                reason=reason,
                message=message or None,
            )

    def _record_rejected(self, trial: TrialLike, flags: VllmFlags, baseline: bool, error: WorkloadRejected) -> None:
        """The trial's record: no measurement, the server's refusal and what to change (the study stops on it)."""
        message = str(error)[:1000]
        _write(trial, {"outcome": WORKLOAD_INVALID, "reason": error.reason, "message": message, "feasible": False})
        if self.store is not None and isinstance(trial, optuna.Trial):
            self.store.save_trial(
                self.study_name,
                trial.number,
                flags=flags.as_dict(),
                baseline=baseline,
                outcome=WORKLOAD_INVALID,
                reason=error.reason,
                message=message,
            )

    def _calibrate(self, trial: TrialLike) -> None:
        """The feasibility model, calibrated from every start this study has seen (or this objective, when fixed)."""
        self.feasibility.reset()
        if isinstance(trial, optuna.Trial):
            for t in trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
                r = TrialRecord.from_attrs(t.user_attrs)
                if not r.is_duplicate and r.outcome in (MEASURED, CRASHED, LAUNCH_FAILED):
                    self.feasibility.observe(r.predicted_kv_tokens_raw, r.kv_tokens)
        else:
            for raw, observed in self._local_observations:
                self.feasibility.observe(raw, observed)


def _write(trial: TrialLike, attrs: dict[str, object]) -> None:
    """User attributes in `attrs` order; the notes only when there are some (as the record writes them)."""
    for name, value in attrs.items():
        if name in ("repairs", "warnings") and not value:
            continue
        trial.set_user_attr(name, value)
