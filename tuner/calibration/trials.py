"""A study's measured trials as loads to replay: which qualify, the server each ran on, what each measured.

A trial qualifies when it was measured in full: its own flag set (not a repeat answered from another trial), a
load that ran to its end (not stopped at a certain SLO miss) with every request answered, and its per-request
records in the project's tables. Each is then a load the engine replays (tuner.calibration.replay): the requests'
lengths as the server counted them, in the order they were sent; a closed loop's users as the stored job gives
them, an open loop's send times as the client recorded them (a capacity search's scored step is one); its server
the trial's flags on the study's GPU, with the KV blocks its start-up reported.

The job is read from the study itself, leniently: the trials ran under it, and a GPU box's job file may name a
model path, a dataset or `gpu: auto` that mean nothing on the machine reading the study.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState
from pydantic import ValidationError

from tuner.calibration.fit import Measured
from tuner.calibration.probe import measured
from tuner.calibration.replay import EngineShape, Load, Request, engine_shape
from tuner.catalog import GpuProfile, ModelProfile, load_model, resolve_gpu
from tuner.errors import ConfigError, StorageError, TunerError
from tuner.flags import VllmFlags, resolve
from tuner.load import Arrival, RequestRecord
from tuner.load.trace_replay import trace_prompts
from tuner.record import MEASURED, StudyRecord, TrialRecord
from tuner.store import current_revision, open_store, safe_url

__all__ = ["MIN_TRIALS", "StoredTrial", "StudyTrials", "read_trials"]

MIN_TRIALS = 3  # nine figures for five coefficients: one trial's noise cannot decide the fit alone

# Why a finished trial was left out, in the order the summary names them.
NOT_FINISHED = "not finished"
REPEAT = "repeats of another trial"
NOT_MEASURED = "not measured (refused, failed or crashed)"
STOPPED = "stopped early at an SLO miss"
FAILED_REQUESTS = "with failed requests"
NO_RECORDS = "without per-request records"


@dataclass(frozen=True)
class StoredTrial:
    number: int
    flags: dict[str, Any]
    shape: EngineShape
    load: Load
    measured: Measured
    vllm_version: str | None


@dataclass(frozen=True)
class StudyTrials:
    study: str
    model: str  # the job's target.model, as the study ran it
    device: GpuProfile
    used: list[StoredTrial]
    skipped: dict[str, int]  # why: how many
    total: int  # the search's trials (the confirmation's starts are counted apart)
    confirmation_starts: int = 0  # flag sets the study started again to confirm them: left out, not trials

    def summary(self) -> str:
        """'4 of 9 trials measured in full (2 not measured (...), 3 repeats of another trial left out)', and the
        confirmation's starts apart."""
        why = ", ".join(f"{n} {reason}" for reason, n in self.skipped.items() if n)
        text = f"{len(self.used)} of {self.total} trials measured in full" + (f" ({why} left out)" if why else "")
        if self.confirmation_starts:
            n = self.confirmation_starts
            text += f"; {n} confirmation start{'s' if n != 1 else ''} of flags already fitted left out"
        return text

    def require(self, least: int = MIN_TRIALS) -> None:
        """ConfigError, one line, when too few trials qualify for a fit."""
        if len(self.used) < least:
            raise ConfigError(
                f"study {self.study!r}: {self.summary()}; a fit of the five step-time "
                f"coefficients needs at least {least}: let the study measure more, or probe a server (--url)"
            )


@dataclass(frozen=True)
class _Stored:
    """What a study holds for the replay, read in one pass."""

    job: dict[str, Any]
    gpu: dict[str, Any] | None
    trials: list[tuple[int, TrialState, TrialRecord]]


def read_trials(
    opened: optuna.Study, url: str, *, device: GpuProfile | None, model: ModelProfile | None
) -> StudyTrials:
    """The study's trials that qualify, as loads on their servers; `device` and `model` override the study's.

    The caller opens the study (tuner.report.storage.opened_study, which names the studies there when it is not):
    the calibration sits below the morning's readers and does not reach up to them. `url` is its storage, read
    again for the per-request records in the project's tables."""
    study = opened.study_name
    stored = _read_study(opened)
    job = stored.job
    arrival = _arrival(job, study)
    target, workload = _section(job, "target"), _section(job, "workload")
    if workload.get("conversations"):
        raise TunerError(
            f"study {study!r} ran a conversation workload: its trials replay as independent requests, without the "
            "users' think time and prefix-cache reuse, so they cannot be fitted; calibrate from a study of single "
            "requests or with --url"
        )
    model_name = str(target.get("model") or "")
    device = device or _study_device(stored.gpu, target.get("gpu"), study)
    model = model or _study_model(model_name)
    prefix = workload.get("prefix_len")
    prefix_len = prefix if isinstance(prefix, int) else 0
    # a capacity search's scored step is an open loop, whatever the job's own arrival says
    closed = arrival.concurrency if job.get("objective", "throughput") == "throughput" else None
    skipped: Counter[str] = Counter()
    used: list[StoredTrial] = []
    confirming = 0
    store = open_store(url, migrate=False)
    try:
        if current_revision(store.engine) is None:
            raise StorageError(
                f"{safe_url(url)} holds no per-request records for {study!r}: the tuner's tables are missing "
                "(a study not run by `tuner tune`?)"
            )
        for number, state, record in stored.trials:
            if record.is_repeat:
                # Its flags are fitted once, by their first trial: a second start would weigh them twice.
                confirming += 1
                continue
            why = _left_out(state, record)
            records = store.request_records(study, number) if why is None else []
            if why is None and all(r.warmup for r in records):
                why = NO_RECORDS
            elif why is None and not all(r.ok for r in records):
                why = FAILED_REQUESTS
            if why is not None:
                skipped[why] += 1
                continue
            shape = _shape(model, device, record, number)
            ids = trace_prompt_ids(arrival, records, workload.get("seed"))
            load = Load(tuple(_request(r, closed is None, ids) for r in records), closed, prefix_len)
            used.append(StoredTrial(number, record.flags, shape, load, _measured(records), record.vllm_version))
    finally:
        store.close()
    order = (NOT_FINISHED, REPEAT, NOT_MEASURED, STOPPED, NO_RECORDS, FAILED_REQUESTS)
    total = len(stored.trials) - confirming
    return StudyTrials(study, model_name, device, used, {k: skipped[k] for k in order}, total, confirming)


def _read_study(s: optuna.Study) -> _Stored:
    record = StudyRecord.from_attrs(s.user_attrs)
    trials = [(t.number, t.state, TrialRecord.from_attrs(t.user_attrs)) for t in s.get_trials(deepcopy=False)]
    job = record.job
    if job is None:
        raise TunerError(
            f"study {s.study_name!r} holds no job (its workload and arrival): not a study `tuner tune` ran"
        )
    return _Stored(job, record.gpu_profile, trials)


def _section(job: dict[str, Any], name: str) -> dict[str, Any]:
    part = job.get(name)
    return part if isinstance(part, dict) else {}


def _left_out(state: TrialState, record: TrialRecord) -> str | None:
    if state != TrialState.COMPLETE:
        return NOT_FINISHED
    if record.is_duplicate:
        return REPEAT
    if record.outcome != MEASURED:
        return NOT_MEASURED
    if record.slo_stop:
        return STOPPED
    return None


def _arrival(job: dict[str, Any], study: str) -> Arrival:
    try:
        return Arrival.model_validate(job.get("arrival"))
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(["arrival", *(str(x) for x in err["loc"])])
        raise TunerError(f"study {study!r}: its stored job's {where}: {err['msg']}") from None


def _study_device(stored: dict[str, Any] | None, spec: object, study: str) -> GpuProfile:
    """The GPU the study resolved when it ran (stored with it: `gpu: auto` must not read this machine's)."""
    if stored is not None:
        try:
            return GpuProfile(**stored)
        except TypeError:
            pass  # written by another release: fall back to the job's own spec
    if isinstance(spec, str | dict):
        try:
            return resolve_gpu(spec)
        except ConfigError as e:
            raise ConfigError(f"study {study!r}'s target.gpu: {e}; name it with --device") from None
    raise ConfigError(f"study {study!r} does not say which GPU its trials ran on; name it with --device")


def _study_model(name: str) -> ModelProfile:
    try:
        return load_model(name)
    except TunerError as e:
        raise ConfigError(f"{e}; give --model-config (the model's config.json directory or hub id)") from None


def _shape(model: ModelProfile, device: GpuProfile, record: TrialRecord, number: int) -> EngineShape:
    """The trial's server: its flags, and the KV blocks its start-up reported (the arithmetic's when it did not)."""
    try:
        flags = VllmFlags.from_dict(record.flags)
    except ValueError as e:
        raise TunerError(f"trial {number}'s stored flags are not vLLM flags: {e}") from None
    blocks = None
    if record.kv_tokens:
        blocks = record.kv_tokens // resolve(flags, device, model).block_size
    try:
        return engine_shape(model, device, flags, blocks)
    except ConfigError as e:
        raise ConfigError(f"trial {number}: {e}") from None


def _measured(records: list[RequestRecord]) -> Measured:
    """The means, and each measured request's TTFT and TPOT: the fit weighs every request (see fit.Measured)."""
    shown = [r for r in records if not r.warmup]
    return dataclasses.replace(
        measured(records),
        each_ttft_s=tuple(r.ttft_s or 0.0 for r in shown),
        each_tpot_s=tuple(
            (r.e2e_s - (r.ttft_s or 0.0)) / (r.completion_tokens - 1) if r.completion_tokens > 1 else 0.0 for r in shown
        ),
    )


def _request(r: RequestRecord, open_loop: bool, ids: list[tuple[int, ...]] | None = None) -> Request:
    prompt = ids[r.index] if ids is not None and r.index < len(ids) else None
    return Request(r.prompt_tokens, r.completion_tokens, r.warmup, r.start_s if open_loop else None, prompt)


def trace_prompt_ids(arrival: Arrival, records: list[RequestRecord], seed: object = 0) -> list[tuple[int, ...]] | None:
    """A trace study's prompts as token ids, one per request of its slice in the order sent (a record's index),
    their hash ids' blocks shared; None without a trace, without hash ids, or where the trace file cannot be read
    here (the replay then shares no prompt text, and a prefix cache's help goes into the fitted prefill)."""
    if arrival.trace is None:
        return None
    try:
        sent = arrival.trace_requests()
    except ConfigError:
        return None
    if not any(r.hash_ids for r in sent) or len(sent) < len({r.index for r in records}):
        return None
    prompts = trace_prompts(sent, block_tokens=arrival.block_tokens, seed=seed if isinstance(seed, int) else 0)
    return [tuple(p.prompt) if isinstance(p.prompt, list) else () for p in prompts]
