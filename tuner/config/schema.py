"""The job's schema: its sections as pydantic models (extra="forbid"), and `Job`, which keeps its SLOs, GPU, model
and device profile parsed once. The target and its launcher kinds are in tuner.config.target."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, cast, get_args

from pydantic import Field, PrivateAttr, model_validator

from tuner.catalog import load_model
from tuner.catalog.gpus import GpuProfile, resolve_gpu
from tuner.catalog.models import ModelProfile
from tuner.catalog.nvml import machine_devices
from tuner.config.fields import Duration, SloText, StrictModel
from tuner.config.target import TargetSection
from tuner.cost import JobLoad
from tuner.errors import ConfigError
from tuner.load import Arrival, Workload
from tuner.load.workload import LengthDist
from tuner.scoring import Slo, goodput_bound, parse_slo
from tuner.space import ParamSpec, SearchSpace
from tuner.step_profile import StepProfile, load_profile

__all__ = [
    "SAMPLER_NAMES",
    "Budget",
    "CapacitySearch",
    "FeasibilitySection",
    "Job",
    "SamplerName",
    "SamplerSection",
    "StudySection",
    "WorkloadSection",
    "job_schema",
]

_T = TypeVar("_T")
# The samplers a job may name; each has its factory in tuner.study.samplers.
SamplerName = Literal["tpe", "gp", "nsga2", "random", "grid", "twin"]
SAMPLER_NAMES: tuple[str, ...] = get_args(SamplerName)


class StudySection(StrictModel):
    name: str = Field(min_length=1, max_length=200, description="Optuna study name; the same name continues it")
    storage: str | None = Field(
        default=None,
        description="SQLAlchemy URL; null = sqlite file <name>.db beside the job file; postgresql+psycopg://... "
        "for several workers",
    )
    heartbeat_interval: int = Field(default=10, ge=1, description="seconds between a running trial's heartbeats")
    grace_period: int = Field(
        default=60, ge=2, description="a RUNNING trial without a heartbeat this long is failed and retried once"
    )
    storage_wait_s: int = Field(
        default=300,
        ge=0,
        description="seconds the study waits for a database that stopped answering (a restart, a failover) before "
        "it stops, keeping a measured result in a journal beside the job for the next run",
    )


class CapacitySearch(StrictModel):
    requests_per_step: int = Field(default=100, ge=1)
    max_steps: int = Field(default=6, ge=1)


# Extra starts a study spends re-measuring before it ends: the baseline and the leader a second time (2), then the
# contenders whose intervals overlap the leader's. Counted in starts, not server-minutes: a start's cost is not known
# before it runs, so a cap in minutes could only be checked after the start that overran it; the minutes spent are
# counted and printed.
CONFIRM_DEFAULT = 6


class Budget(StrictModel):
    n_trials: int = Field(default=30, ge=1, description="trials of the whole study, over every worker")
    timeout: Duration | None = Field(default=None, description="stop starting trials after this long (e.g. 8h)")
    confirm: int = Field(
        default=CONFIRM_DEFAULT,
        ge=0,
        le=1000,
        description="extra server starts spent re-measuring the baseline, the leader and the flag sets within the "
        "noise of it before the study ends (0: off; every figure is then one start)",
    )
    stop_when_unreachable: bool = Field(
        default=True,
        description="stop the study once the twin predicted that no flag set meets an SLO and the baseline and "
        "the twin's nearest flag sets measured missing it (false: spend the budget anyway)",
    )


class SamplerSection(StrictModel):
    name: SamplerName | None = Field(
        default=None,
        description="default: twin where the GPU and model are known to the start-up arithmetic and the objective "
        "is throughput or cost, else tpe",
    )
    seed: int | None = 0
    n_startup_trials: int | None = Field(default=None, ge=0, description="random trials before the model (tpe, gp)")
    population_size: int | None = Field(default=None, ge=2, description="nsga2 population")
    multivariate: bool | None = Field(
        default=None,
        description="tpe, and twin's fallback: model the flags jointly (default true); false: one flag at a time",
    )
    group: bool | None = Field(
        default=None,
        description="tpe, and twin's fallback: Optuna's group decomposition, flags that trials give together "
        "modelled together (default true: the baseline lacks some); false: only the flags every trial gives",
    )


class FeasibilitySection(StrictModel):
    enabled: bool = True
    margin: float = Field(default=0.03, ge=0, le=1, description="launch flag sets predicted short by less than this")


# A length of at least one token: `Workload` itself takes any integer and fails on a zero only deep in a trial.
PositiveLength = Annotated[int, Field(ge=1, description="tokens")]


class WorkloadSection(Workload):
    """The workload as a job file gives it, with the lengths' bounds in the schema."""

    input_len: PositiveLength | LengthDist = 512
    output_len: PositiveLength | LengthDist = 128


class Job(StrictModel):
    """A tuning job: what to tune, on what, under which load and SLOs, with which budget."""

    study: StudySection
    target: TargetSection
    space: dict[str, ParamSpec] = Field(
        description="per vLLM flag: {low, high, step?, log?}, {choices: [...]}, a value"
    )
    workload: WorkloadSection = Field(default_factory=WorkloadSection)
    arrival: Arrival
    slos: list[SloText] = Field(default_factory=lambda: ["e2e_p95 <= 10s", "success_rate >= 0.99"])
    objective: Literal["throughput", "max_rate", "goodput", "cost"] = Field(
        default="throughput",
        description="throughput: tok/s under the job's load; max_rate: the highest rate meeting every SLO; goodput: "
        "the highest rate at which the success_rate SLO's share of requests meets every latency SLO on its own; "
        "cost: the cheapest deployment for the job's load (arrival.rate, or arrival.concurrency users) within the "
        "SLOs, replicas of each shape included ($ per million output tokens with target.gpu_hour_usd, else GPUs)",
    )
    latency_metric: str | None = Field(
        default=None, description="the P95 minimised beside throughput; default: the first latency SLO, else e2e_p95"
    )
    capacity_search: CapacitySearch = Field(default_factory=CapacitySearch)
    request_timeout: Duration = 60.0
    stop_early: bool = Field(
        default=True,
        description="end a load phase once an SLO is missed for certain whatever the remaining requests do (e.g. "
        "the 2nd failure of 100 at success_rate>=0.99): the verdict is the same, the GPU time is saved",
    )
    budget: Budget = Field(default_factory=Budget)
    sampler: SamplerSection = Field(default_factory=SamplerSection)
    feasibility: FeasibilitySection = Field(default_factory=FeasibilitySection)

    # Where the job file was read from: relative paths (storage, dataset) are resolved against it.
    source: Path | None = Field(default=None, exclude=True)
    # The SLOs, GPU and model parsed from their text (see `_resolved`).
    _parsed: dict[str, tuple[Any, Any]] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _conversations(self) -> Job:
        if self.workload.conversations is None:
            return self
        if self.arrival.concurrency is None:
            raise ValueError("workload.conversations needs arrival.concurrency (users, each holding a conversation)")
        if self.objective != "throughput":
            raise ValueError(
                f"workload.conversations runs at the job's users: objective {self.objective} searches a request rate; "
                "use objective: throughput"
            )
        return self

    @model_validator(mode="after")
    def _latency_metric(self) -> Job:
        if self.latency_metric is not None:
            try:
                slo = parse_slo(f"{self.latency_metric} <= 1")
            except ConfigError:
                slo = None
            if slo is None or not slo.is_latency:
                raise ValueError(f"latency_metric {self.latency_metric!r} is not a latency (e.g. e2e_p95, ttft_p95)")
        return self

    # -- derived --------------------------------------------------------------------------------------------------

    def judged_slos(self) -> list[Slo]:
        """What a trial's constraints judge: the job's SLOs, and for the goodput objective its good-share bound (a
        search whose every step fell short of it may still meet the SLOs' percentiles)."""
        return [*self.parsed_slos(), self.goodput_slo()] if self.objective == "goodput" else self.parsed_slos()

    def goodput_slo(self) -> Slo:
        """What a step of the goodput search must meet: the success_rate SLO's share of its requests good (each met
        every latency SLO on its own); 0.99 where the job gives no success_rate SLO."""
        return goodput_bound(self.parsed_slos())

    def parsed_slos(self) -> list[Slo]:
        return list(self._resolved("slos", tuple(self.slos), lambda: tuple(parse_slo(s) for s in self.slos)))

    def primary_latency(self) -> str:
        if self.latency_metric:
            return self.latency_metric
        for slo in self.parsed_slos():
            if slo.is_latency:
                return slo.metric
        return "e2e_p95"

    def gpu_profile(self) -> GpuProfile:
        spec = self.target.gpu
        return self._resolved("gpu", json.dumps(spec, sort_keys=True), lambda: resolve_gpu(spec))

    def assume_gpu(self, profile: GpuProfile) -> None:
        """Check and plan against `profile` where the job says `gpu: auto`, for a machine that writes what other
        machines run (the cluster's workers read their own GPUs)."""
        if self.target.gpu == "auto":
            self._parsed["gpu"] = (json.dumps("auto"), profile)

    def box_gpus(self) -> int:
        """The GPUs the deployment has (`target.gpus`): 1 for the emulator unless given, else the GPUs the tuner was
        given (`CUDA_VISIBLE_DEVICES`, as `--parallel` reads it) or, without one, those NVML or amd-smi count."""
        if self.target.gpus is not None:
            return self.target.gpus
        if self.target.launcher == "emulator":
            return 1
        given = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        return len(given) or self._resolved("box_gpus", "machine", lambda: len(machine_devices()) or 1)

    def cost_load(self) -> JobLoad | None:
        """What the cost objective serves: the open loop's rate or the closed loop's users (None: a trace)."""
        if self.arrival.rate is not None:
            return JobLoad(rate=self.arrival.rate)
        if self.arrival.concurrency is not None:
            return JobLoad(users=self.arrival.concurrency)
        return None

    def gpu_hour_usd(self) -> float | None:
        """The price of one GPU-hour: the job's, else the catalog's for its card (None: unknown)."""
        if self.target.gpu_hour_usd is not None:
            return self.target.gpu_hour_usd
        return self.gpu_profile().usd_per_hour

    def gpu_hour_text(self) -> str | None:
        """`$3.35 a GPU-hour` and, for the catalog's default, where it is listed (None: no price)."""
        price = self.gpu_hour_usd()
        if price is None:
            return None
        if self.target.gpu_hour_usd is not None:
            return f"${price:g} a GPU-hour"
        listed = self.gpu_profile().price_source
        return f"${price:g} a GPU-hour, the catalog's default ({listed}; target.gpu_hour_usd for yours)"

    def model_profile(self) -> ModelProfile:
        # A model directory's config.json is read once, not at every trial.
        return self._resolved("model", self.target.model, lambda: load_model(self.target.model))

    def step_profile(self) -> StepProfile | None:
        """`target.profile` read (once), the path resolved against the job file."""
        path = self.target.profile
        if path is None:
            return None
        if not path.is_absolute() and self.source is not None:
            path = self.source.parent / path
        return self._resolved("profile", str(path), lambda: load_profile(path))

    def _resolved(self, name: str, source: Any, resolve: Callable[[], _T]) -> _T:
        """The parsed form of a field, parsed once: kept with the text it came from, so a copy with another text
        (`model_copy(update=...)`) parses its own."""
        cached = self._parsed.get(name)
        if cached is None or cached[0] != source:
            cached = (source, resolve())
            self._parsed[name] = cached
        return cast(_T, cached[1])

    def search_space(self) -> SearchSpace:
        return SearchSpace.build(
            self.space, self.gpu_profile(), self.model_profile(), longest_request=self.longest_request()
        )

    def longest_request(self) -> int:
        """The longest prompt + output the load sends: the trace slice's, or the workload's."""
        if self.arrival.trace is not None:
            return max((r.input_len + r.output_len for r in self.arrival.trace_requests()), default=1)
        return self.workload.max_request_tokens()

    def storage_url(self) -> str:
        if self.study.storage:
            return self.study.storage
        folder = self.source.parent if self.source is not None else Path.cwd()
        return f"sqlite:///{(folder / (_safe_file_name(self.study.name) + '.db')).resolve()}"

    def as_record(self) -> dict[str, Any]:
        """The job as plain JSON for the study's user_attrs (secrets appear by name only: the model has no values)."""
        return json.loads(self.model_dump_json())  # type: ignore[no-any-return]


def _safe_file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def job_schema() -> dict[str, Any]:
    """JSON Schema of the job file, for editors (yaml-language-server) and `tuner schema`."""
    schema = Job.model_json_schema(mode="validation")
    schema["title"] = "tuner job file"
    schema["properties"].pop("source", None)
    return schema
