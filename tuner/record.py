"""One trial's record: what the study writes into Optuna's user attributes and every reader reads back.

The study writes it once per trial (`TrialRecord.to_attrs`), the morning commands, re-scoring, exports and the
tune CLI read it (`TrialRecord.from_attrs`). The attributes stay flat, one per field, under the names tuner 0.1.0
used, so optuna-dashboard and `optuna.load_study` show what they always showed, and a study written before the
record existed (no `record_version`) reads as version 0 of the same shape. A new field is one line here, with a
default, so older studies keep reading.
"""

from __future__ import annotations

from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tuner import scoring

__all__ = [
    "CRASHED",
    "INTERRUPTED",
    "LAUNCH_FAILED",
    "MEASURED",
    "OUTCOMES",
    "RECORD_VERSION",
    "SKIPPED_INFEASIBLE",
    "WORKLOAD_INVALID",
    "StoredJob",
    "StudyRecord",
    "TrialRecord",
]

MEASURED: Final = "measured"
LAUNCH_FAILED: Final = "launch_failed"
CRASHED: Final = "crashed"
SKIPPED_INFEASIBLE: Final = "skipped_infeasible"
INTERRUPTED: Final = "interrupted"
# The server refused the job's requests whatever the flags (tuner.study.preflight): the study stopped on it.
WORKLOAD_INVALID: Final = "workload_invalid"
OUTCOMES = (MEASURED, LAUNCH_FAILED, CRASHED, SKIPPED_INFEASIBLE, INTERRUPTED, WORKLOAD_INVALID)

RECORD_VERSION: Final = 1
"""1: the record as a model (adds `record_version`, `vllm_version`); 0: tuner 0.1.0's attributes, the same names."""

# Written only when they say something, as tuner 0.1.0 did: a trial without them shows no empty attribute.
_ONLY_WHEN_SET = (
    "repairs",
    "warnings",
    "message",
    "duplicate_of",
    "repeat_of",
    "ci_run",
    "vllm_version",
    "twin_predicted_tok_s",
    "devices",
    "ttft_p95_first_turn_s",
    "ttft_p95_later_turns_s",
    "prefix_cache_hit_rate",
    "cost_load_rate",
    "cost_gpu_hours_per_m_tokens",
    "cost_usd_per_hour",
    "cost_usd_per_m_tokens",
    "contention",
)


class TrialRecord(BaseModel):
    """One trial's outcome and headline figures. None: not known (not measured, or not written by that release)."""

    model_config = ConfigDict(extra="ignore", validate_assignment=False)

    record_version: int = 0
    flags: dict[str, Any] = Field(default_factory=dict)
    baseline: bool = False
    repairs: list[str] = Field(default_factory=list)  # the study's repairs of the sampled flags (vLLM's rules)
    warnings: list[str] = Field(default_factory=list)
    predicted_kv_tokens: int | None = None
    predicted_kv_tokens_raw: int | None = None
    kv_scale: float | None = None
    outcome: str | None = None
    reason: str | None = None
    message: str | None = None
    output_tok_s: float | None = None
    request_rate: float | None = None
    success_rate: float | None = None
    # The registry's figures (`tuner.scoring.FIGURES`) and those the study's SLOs and objective name (`ttft_p90`)
    # by name, in seconds: stored flat, one attribute each (`ttft_p95` as `ttft_p95_s`, the names tuner 0.1.0
    # wrote); a figure not measured is absent here.
    latencies: dict[str, float] = Field(default_factory=dict)
    goodput: float | None = None  # req/s that succeeded and met every latency SLO on their own (DistServe)
    good_share: float | None = None  # those requests' share of the measured ones
    diagnosis: str | None = None
    slo_stop: str | None = None  # the load stopped at a certain SLO miss: its figures cover part of the run
    kv_tokens: int | None = None
    vllm_version: str | None = None  # from the server's start-up facts
    devices: list[str] = Field(default_factory=list)  # the GPUs its server was given (`--parallel`); [] when all
    feasible: bool | None = None
    server_seconds: float | None = None
    constraints: list[float] | None = None
    constraint_names: list[str] | None = None
    attempts: int | None = None
    latency_metric: str | None = None
    duplicate_of: int | None = None
    # A confirmation start (tuner.study.confirm): the first trial of the flag set it started again. Such a trial is
    # also `duplicate_of` it (the search's budget skips it) but, unlike a sampler's repeat, measured on its own.
    repeat_of: int | None = None
    # The run's figures with their within-run 95% intervals, from its per-request records: {"level": 0.95,
    # "output_tok_s": [value, low, high], "success_rate": [...], "ttft_p95_s": [...], ...} (`intervals` reads it).
    ci_run: dict[str, Any] | None = None
    # The twin's output tok/s for this flag set before the trial ran (0: predicted not to start or to crash).
    twin_predicted_tok_s: float | None = None
    # A conversation workload's TTFT p95 of first turns and of later ones (whose history the prefix cache can serve).
    ttft_p95_first_turn_s: float | None = None
    ttft_p95_later_turns_s: float | None = None
    # Prefix-cache hits / queries in tokens during the scored run, as the server's /metrics counted them.
    prefix_cache_hit_rate: float | None = None
    # The whole box (`target.gpus`, tuner.box): replicas of this shape, their output tok/s and request rate (what
    # the study maximises; `output_tok_s` and `request_rate` above are the one replica measured), per GPU, and cost.
    replicas: int | None = None
    box_gpus: int | None = None
    box_output_tok_s: float | None = None
    box_request_rate: float | None = None
    tok_s_per_gpu: float | None = None
    usd_per_m_tokens: float | None = None
    gpu_hours_per_m_requests: float | None = None
    # The cost objective (tuner.cost): the box above is the one the job's load needs (`replicas` x the shape's GPUs,
    # each at its capacity within the SLOs); the load it serves (req/s) and what serving it costs.
    cost_load_rate: float | None = None
    cost_gpu_hours_per_m_tokens: float | None = None
    cost_usd_per_hour: float | None = None
    cost_usd_per_m_tokens: float | None = None
    # What the machine was doing during the load phase (`tuner.load.contention.Contention`, as a dict): the host's
    # load, other processes' CPU, steal, the emulator's lag and whether the trial was measured again for it.
    contention: dict[str, Any] | None = None

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> TrialRecord:
        """The record in a trial's user attributes, of any version; a value of the wrong type reads as unknown (a
        study written by hand or by another tool may hold anything there)."""
        values: dict[str, Any] = {}
        for name, info in cls.model_fields.items():
            if name == "latencies" or attrs.get(name) is None:
                continue
            value = _READERS[_type_name(info.annotation)](attrs[name])
            if value is not None:
                values[name] = value
        values["latencies"] = _latencies(attrs)
        return cls.model_validate(values)

    def to_attrs(self) -> dict[str, Any]:
        """The user attributes to write: every field, but the optional ones only when set."""
        out = self.model_dump(mode="json")
        del out["latencies"]
        out |= {f.attr: self.latencies.get(f.name) for f in scoring.figures()}
        out |= {f"{name}_s": value for name, value in self.latencies.items()}
        for name in _ONLY_WHEN_SET:
            if not out.get(name) and out.get(name) != 0:
                out.pop(name, None)
        return out

    @property
    def is_duplicate(self) -> bool:
        return self.duplicate_of is not None

    @property
    def is_repeat(self) -> bool:
        """A confirmation start: measured on its own, but not a flag set of the search's own."""
        return self.repeat_of is not None

    def intervals(self) -> dict[str, tuple[float, float, float]]:
        """The run's figures with their within-run intervals (`ci_run`), (value, low, high) by name; the entries
        that do not read as three numbers are left out."""
        out: dict[str, tuple[float, float, float]] = {}
        for name, v in (self.ci_run or {}).items():
            if isinstance(v, list) and len(v) == 3 and all(_number(x) is not None for x in v):
                out[name] = (float(v[0]), float(v[1]), float(v[2]))
        return out


def _type_name(annotation: Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _latencies(attrs: dict[str, Any]) -> dict[str, float]:
    """Every figure stored flat (`<metric>_<stat>_s`): the registry's, and any an SLO or the objective named, told
    by the metric registry (`ttft_p95_first_turn_s` names no statistic, so it is not one)."""
    out: dict[str, float] = {}
    for key, raw in attrs.items():
        value = _number(raw)
        if value is not None and key.endswith("_s") and scoring.Figure.named(key.removesuffix("_s")) is not None:
            out[key.removesuffix("_s")] = value
    return out


def _integer(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _texts(v: Any) -> list[str] | None:
    return [str(x) for x in v if isinstance(x, str)] if isinstance(v, list) else None


# How each field type is read from an attribute: leniently, as the views always read them (text is not a number, a
# bool is not a count), so a hand-written study shows what it can.
_READERS: dict[str, Any] = {
    "int": _integer,
    "int | None": _integer,
    "float | None": _number,
    "str | None": str,
    "bool": bool,
    "bool | None": bool,
    "dict[str, Any]": lambda v: dict(v) if isinstance(v, dict) else None,
    "dict[str, Any] | None": lambda v: dict(v) if isinstance(v, dict) else None,
    "list[str]": _texts,
    "list[str] | None": lambda v: [str(x) for x in v] if isinstance(v, list) else None,
    "list[float] | None": lambda v: [float(x) for x in v if _number(x) is not None] if isinstance(v, list) else None,
}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StoredLauncherOptions(_Lenient):
    model_id: str | None = None
    image: str | None = None
    env: list[str] = Field(default_factory=list)
    options: dict[str, Any] = Field(default_factory=dict)  # the launcher's further keyword arguments


class StoredTarget(_Lenient):
    # Every launcher kind's options section is kept (a kind added later needs no line here); these two are named
    # because an export reads them whatever the launcher was.
    model_config = ConfigDict(extra="allow")

    launcher: str | None = None
    gpu_hour_usd: float | None = None  # the job's price of a GPU-hour (`tuner plan` defaults to it)
    docker: StoredLauncherOptions = Field(default_factory=StoredLauncherOptions)
    process: StoredLauncherOptions = Field(default_factory=StoredLauncherOptions)

    def section(self, name: str) -> StoredLauncherOptions | None:
        """The options section of launcher kind `name`, if the job has one that reads."""
        value = getattr(self, name, None) if name in type(self).model_fields else (self.model_extra or {}).get(name)
        if isinstance(value, StoredLauncherOptions) or not isinstance(value, dict):
            return value if isinstance(value, StoredLauncherOptions) else None
        try:
            return StoredLauncherOptions.model_validate(value)
        except ValidationError:
            return None


class StoredJob(_Lenient):
    """What the readers of a study use of the job stored with it (`study.user_attrs["job"]`, `Job.as_record()`):
    read leniently, since a study written by another release or by hand may hold any part of it, or none."""

    target: StoredTarget = Field(default_factory=StoredTarget)
    latency_metric: str | None = None
    request_timeout: float | None = None

    @classmethod
    def of(cls, attrs: dict[str, Any]) -> StoredJob:
        job = attrs.get("job")
        if not isinstance(job, dict):
            return cls()
        try:
            return cls.model_validate(job)
        except ValidationError:
            # One odd part must not hide the rest: the parts that read, alone.
            parts = {}
            for name in cls.model_fields:
                try:
                    parts[name] = getattr(cls.model_validate({name: job[name]}), name)
                except (KeyError, ValidationError):
                    continue
            return cls.model_validate(parts)


class StudyRecord(BaseModel):
    """A study's own attributes (not a trial's), as `tuner.study.storage.study_attrs` and the run write them: read
    leniently, field by field (a study written by another release or by hand may hold anything, or nothing), so
    the readers ask a typed record instead of spelling keys. None: not there, or not of the field's type."""

    model_config = ConfigDict(extra="ignore")

    tuner_version: str | None = None
    gpu: str | dict[str, Any] | None = None  # as the job gave it: auto, a catalog name, or figures
    gpu_profile: dict[str, Any] | None = None  # what it resolved to when the study was created
    model: str | None = None
    launcher: str | None = None
    image: str | None = None
    image_pinned: bool | None = None
    workload_hash: str | None = None
    slos: list[str] = Field(default_factory=list)
    objective: str | None = None
    n_trials: int | None = None
    latency_metric: str | None = None
    job: dict[str, Any] | None = None  # Job.as_record(); StoredJob reads it
    stopped: dict[str, Any] | None = None  # the last run stopped on a refused workload: {"message": ...}
    twin_fallback: dict[str, Any] | None = None  # where the twin handed over: {"after": n, "why": ...}
    confirm: dict[str, Any] | None = None  # what the confirmation decided (tuner.study.confirm.summary_attr)

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> StudyRecord:
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            if attrs.get(name) is None:
                continue
            try:
                values[name] = getattr(cls.model_validate({name: attrs[name]}), name)
            except ValidationError:
                continue  # one odd attribute must not hide the rest
        return cls.model_validate(values)

    @property
    def stored_job(self) -> StoredJob:
        return StoredJob.of({"job": self.job})

    @property
    def gpu_hour_usd(self) -> float | None:
        """The price of a GPU-hour the study ran with: the job's, else the catalog's for its card (None: neither)."""
        given = self.stored_job.target.gpu_hour_usd
        listed = (self.gpu_profile or {}).get("usd_per_hour")
        for price in (given, listed):
            if isinstance(price, int | float) and not isinstance(price, bool) and price > 0:
                return float(price)
        return None
