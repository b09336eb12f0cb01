"""The job file: one YAML a user writes before going home. Pydantic models (extra="forbid"), loaded with errors that
name the file, the field path and what is allowed, never a traceback.

    study:    {name: my-study, storage: null}     # null: a SQLite file beside the job file
    target:   {launcher: emulator, model: llama-3.1-8b, gpu: l4, emulator: {time_scale: 20}}
    space:    {max_num_seqs: {low: 8, high: 128, log: true}, max_model_len: 8192, ...}
    workload: {input_len: 512, output_len: 128}
    arrival:  {concurrency: 16, requests: 100}
    slos:     ["e2e_p95 <= 20s", "success_rate >= 0.99"]
    objective: throughput                          # or max_rate (highest SLO-meeting request rate)
    budget:   {n_trials: 12, timeout: 8h}
    sampler:  {name: tpe, seed: 0}
"""

from __future__ import annotations

import difflib
import json
import math
import re
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, cast, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from tuner.calibration.profile import StepProfile, load_profile
from tuner.catalog import load_model
from tuner.catalog.gpus import GpuProfile, resolve_gpu
from tuner.catalog.models import ModelProfile
from tuner.errors import ConfigError
from tuner.load import Arrival, Workload
from tuner.load.workload import FixedLength, LengthDist, UniformLength
from tuner.scoring import Slo, parse_slo
from tuner.space import KNOWN_FLAGS, Choices, ParamSpec, Range, SearchSpace
from tuner.vllm_args import vllm_args
from tuner.vllm_pin import PINNED_VLLM

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h|d)?\s*$")
_UNIT_SECONDS = {None: 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_T = TypeVar("_T")
# The samplers a job may name; each has its factory in tuner.study.samplers.
SamplerName = Literal["tpe", "gp", "nsga2", "random", "grid", "twin"]
SAMPLERS: tuple[str, ...] = get_args(SamplerName)


def parse_duration(value: Any) -> float:
    """Seconds from `90`, `90s`, `30m`, `8h`, `1.5h`, `500ms`."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration; write e.g. 90s, 30m, 8h")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ValueError(f"{value!r} is not a duration; write e.g. 90s, 30m, 8h (or a number of seconds)")
        seconds = float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    if seconds <= 0:
        raise ValueError(f"{value!r}: a duration must be > 0")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]


def _check_slo(text: str) -> str:
    try:
        parse_slo(text)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    return text


SloText = Annotated[str, AfterValidator(_check_slo)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StudySection(_Model):
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


def _env_names(names: list[str]) -> list[str]:
    for n in names:
        if not _ENV_NAME.match(n):
            raise ValueError(
                f"{n!r} is not an environment variable name; list names only (e.g. HF_TOKEN), the value is read "
                "from the environment when the server starts and never stored"
            )
    return names


# vLLM arguments whose value is a secret, and the environment variable vLLM reads it from instead.
_SECRET_ARGS = {"--api-key": "VLLM_API_KEY", "--hf-token": "HF_TOKEN"}


def secret_arg(args: list[str]) -> tuple[str, str] | None:
    """The first vLLM argument in `args` that carries a secret, and the variable to pass it by instead."""
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in _SECRET_ARGS:
            return name, _SECRET_ARGS[name]
    return None


def _no_secret_args(args: list[str]) -> list[str]:
    if (found := secret_arg(args)) is not None:
        name, env = found
        raise ValueError(
            f"{name} would write the secret into the job, the study database and every export; pass it by "
            f"name instead: env: [{env}] (vLLM reads {env} from its environment)"
        )
    return args


ExtraArgs = Annotated[list[str], BeforeValidator(_no_secret_args)]


class EmulatorOptions(_Model):
    time_scale: float = Field(default=1.0, gt=0, description="the emulator runs this many times faster than the GPU")
    memory_in_use_gib: float = Field(default=0.0, ge=0, description="GPU memory other processes hold")
    seed: int | None = None
    extra_args: ExtraArgs = Field(default_factory=list)


class DockerOptions(_Model):
    image: str = Field(default=f"vllm/vllm-openai:v{PINNED_VLLM}", description="the vLLM image to run")
    model_id: str | None = Field(default=None, description="Hugging Face id passed as --model (default: the model's)")
    env: Annotated[list[str], BeforeValidator(_env_names)] = Field(
        default_factory=list, description="names of environment variables passed through (HF_TOKEN, ...)"
    )
    volumes: dict[str, str] = Field(default_factory=dict, description="host path -> container path")
    extra_args: ExtraArgs = Field(default_factory=list, description="more vLLM arguments, e.g. [--load-format, dummy]")
    options: dict[str, Any] = Field(default_factory=dict, description="further DockerLauncher keyword arguments")


class ProcessOptions(_Model):
    command: list[str] = Field(
        default_factory=lambda: ["vllm", "serve", "{model}"],
        min_length=1,
        description="the server command; {model}, {host}, {port} are filled in",
    )
    model_id: str | None = None
    env: Annotated[list[str], BeforeValidator(_env_names)] = Field(default_factory=list)
    extra_args: ExtraArgs = Field(default_factory=list)
    options: dict[str, Any] = Field(default_factory=dict, description="further ProcessLauncher keyword arguments")


class TargetSection(_Model):
    launcher: Literal["emulator", "process", "docker"] = "emulator"
    model: str = Field(
        description="a Hugging Face id (Qwen/Qwen3-8B), a directory with config.json, or a built-in profile "
        "(llama-3.1-8b, qwen2.5-7b, ...)"
    )
    gpu: str | dict[str, Any] = Field(
        default="auto",
        description="auto (this machine's GPUs through NVML or amd-smi; docker and process launchers only), a "
        "catalog name (a10g, l4, l40s, h100-80gb, ...), cpu (vLLM's CPU build), or the GPU's figures "
        "{name, memory_gib, bandwidth_gbps?, bf16_tflops?}",
    )
    startup_timeout: Duration = Field(default=1200.0, description="how long a server may take to become ready")
    profile: Path | None = Field(
        default=None,
        description="a device profile `tuner calibrate` wrote (JSON; relative to the job file): the twin's step "
        "times, fitted to a real server of this target, instead of the GPU's roofline",
    )
    emulator: EmulatorOptions = Field(default_factory=EmulatorOptions)
    docker: DockerOptions = Field(default_factory=DockerOptions)
    process: ProcessOptions = Field(default_factory=ProcessOptions)

    @model_validator(mode="after")
    def _emulated_gpu_is_named(self) -> TargetSection:
        # The emulator imitates a card from its figures: there is no machine GPU to read, and `tuner emulate --gpu`
        # takes a name.
        if self.launcher == "emulator" and (not isinstance(self.gpu, str) or self.gpu.strip().lower() == "auto"):
            raise ValueError(
                "gpu: the emulator imitates a named GPU (rtx4090, l4, a100-80gb, h100-80gb, ...); auto and a GPU's "
                "figures are for the docker and process launchers"
            )
        return self


class CapacitySearch(_Model):
    requests_per_step: int = Field(default=100, ge=1)
    max_steps: int = Field(default=6, ge=1)


# -- budget.confirm (issue 27, the noise-aware study): one field, kept apart so it moves whole ----------------------
CONFIRM_DEFAULT = 6
"""Extra starts a study spends re-measuring before it ends: the baseline and the leader a second time (2), then
the contenders whose intervals overlap the leader's. Counted in starts, not server-minutes: a start's cost is not
known before it runs, so a cap in minutes could only be checked after the start that overran it; the minutes
spent are counted and printed."""


def _confirm_field() -> Any:
    return Field(
        default=CONFIRM_DEFAULT,
        ge=0,
        le=1000,
        description="extra server starts spent re-measuring the baseline, the leader and the flag sets within the "
        "noise of it before the study ends (0: off; every figure is then one start)",
    )


# -- end of budget.confirm ------------------------------------------------------------------------------------------


class Budget(_Model):
    n_trials: int = Field(default=30, ge=1, description="trials of the whole study, over every worker")
    timeout: Duration | None = Field(default=None, description="stop starting trials after this long (e.g. 8h)")
    confirm: int = _confirm_field()  # see the budget.confirm block above


class SamplerSection(_Model):
    name: SamplerName | None = Field(
        default=None,
        description="default: twin where the GPU and model are known to the start-up arithmetic and the objective "
        "is throughput, else tpe",
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


class FeasibilitySection(_Model):
    enabled: bool = True
    margin: float = Field(default=0.03, ge=0, le=1, description="launch flag sets predicted short by less than this")


# A length of at least one token: `Workload` itself takes any integer and fails on a zero only deep in a trial.
PositiveLength = Annotated[int, Field(ge=1, description="tokens")]


class WorkloadSection(Workload):
    """The workload as a job file gives it, with the lengths' bounds in the schema."""

    input_len: PositiveLength | LengthDist = 512
    output_len: PositiveLength | LengthDist = 128


class Job(_Model):
    """A tuning job: what to tune, on what, under which load and SLOs, with which budget."""

    study: StudySection
    target: TargetSection
    space: dict[str, ParamSpec] = Field(
        description="per vLLM flag: {low, high, step?, log?}, {choices: [...]}, a value"
    )
    workload: WorkloadSection = Field(default_factory=WorkloadSection)
    arrival: Arrival
    slos: list[Annotated[str, AfterValidator(_check_slo)]] = Field(
        default_factory=lambda: ["e2e_p95 <= 10s", "success_rate >= 0.99"]
    )
    objective: Literal["throughput", "max_rate"] = "throughput"
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
            self.space, self.gpu_profile(), self.model_profile(), longest_request=self.workload.max_request_tokens()
        )

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


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out or "(top level)"


def _user_path(loc: tuple[int | str, ...], data: Any, missing: bool) -> tuple[int | str, ...]:
    """The part of pydantic's error location that is in the job file: the keys and indexes found in `data`.

    The rest are union members and tags (`int`, `range`, `tagged-union[...]`), which say nothing to a user and
    would split one mistake into several lines."""
    path: list[int | str] = []
    node = data
    for i, part in enumerate(loc):
        in_file = isinstance(node, dict) and part in node
        in_file = in_file or (isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node))
        if in_file:
            node = node[part]
        elif not (missing and i == len(loc) - 1):
            continue
        path.append(part)
    return tuple(path)


def _unwrap(tp: Any) -> Any:
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp


def _members(tp: Any) -> list[Any]:
    """A union's members, nested unions (a discriminated LengthDist inside `int | LengthDist`) flattened."""
    out: list[Any] = []
    for m in get_args(tp):
        if get_origin(_unwrap(m)) in (Union, types.UnionType):
            out += _members(_unwrap(m))
        elif m is not type(None):
            out.append(m)
    return out


def _member_matches(member: Any, part: int | str) -> bool:
    if get_origin(member) is Annotated and any(getattr(m, "tag", None) == part for m in get_args(member)[1:]):
        return True
    inner = _unwrap(member)
    if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
        return False
    return inner.__name__ == part or any(f.default == part for f in inner.model_fields.values())


def _descend(tp: Any, part: int | str) -> Any:
    """The type found at `part` of pydantic's location inside `tp` (a model, dict, list or union)."""
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        field = tp.model_fields.get(str(part))
        return None if field is None else field.annotation
    origin, args = get_origin(tp), get_args(tp)
    if origin is dict:
        return args[1]
    if origin is list:
        return args[0]
    if origin in (Union, types.UnionType):
        members = _members(tp)
        matched = [m for m in members if _member_matches(m, part)]
        if matched:
            return matched[0]
        # Not a member's name: a field of the union's only model, or pydantic's name of an inner union.
        models = [m for m in members if isinstance(_unwrap(m), type) and issubclass(_unwrap(m), BaseModel)]
        return _descend(models[0], part) if len(models) == 1 and str(part) in _unwrap(models[0]).model_fields else tp
    return None


def _allowed_keys(loc: tuple[int | str, ...]) -> list[str] | None:
    """The field names allowed where an unknown key was found, by walking the models along the path."""
    tp: Any = Job
    for part in loc[:-1]:
        tp = _descend(tp, part)
        if tp is None:
            return None
    tp = _unwrap(tp)
    if get_origin(tp) in (Union, types.UnionType):
        models = [_unwrap(m) for m in _members(tp) if isinstance(_unwrap(m), type)]
        tp = next((m for m in models if issubclass(m, BaseModel)), None)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [k for k in tp.model_fields if k != "source"]
    return None


def did_you_mean(name: str, known: Any) -> str:
    """`; did you mean X?` when a known name is close to `name`, else nothing."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _message(err: Any) -> str:
    loc = tuple(err["loc"])
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc) or []
        listed = f"; allowed: {', '.join(allowed)}" if allowed else ""
        return "unknown field" + listed + did_you_mean(str(loc[-1]), allowed)
    if err["type"] == "missing":
        return "required field is missing"
    if err["type"] == "too_short" and loc and loc[-1] == "choices":
        return "choices must list at least one value"
    return str(err["msg"]).removeprefix("Value error, ")


def _is_type_error(err: Any) -> bool:
    return str(err["type"]).endswith(("_type", "_parsing")) or "union" in str(err["type"])


def _prune(groups: dict[tuple[int | str, ...], list[Any]]) -> None:
    """Drop what a union's other member explains better: `not an integer` beside the errors of the mapping given
    instead, and `high: missing` beside `hgih: unknown field` (the same typo, said once)."""
    for path in list(groups):
        deeper = any(p[: len(path)] == path and p != path for p in groups)
        if deeper and all(_is_type_error(x) for x in groups[path]):
            del groups[path]
    unknown = {p for p, errs in groups.items() if any(x["type"] == "extra_forbidden" for x in errs)}
    for path in list(groups):
        if path and all(x["type"] == "missing" for x in groups[path]):
            typos = [
                u for u in unknown if u[:-1] == path[:-1] and difflib.get_close_matches(str(u[-1]), [str(path[-1])])
            ]
            if typos:
                del groups[path]


def format_validation_error(e: ValidationError, where: str, data: Any = None) -> str:
    """One line per mistake: pydantic's errors grouped by the path in the file, unions' members merged."""
    groups: dict[tuple[int | str, ...], list[Any]] = {}
    for err in e.errors(include_url=False):
        loc = tuple(err["loc"])
        path = _user_path(loc, data, err["type"] == "missing") if data is not None else loc
        groups.setdefault(path, []).append(err)
    _prune(groups)
    lines = []
    for path, errs in groups.items():
        # Of a union's errors, one that is not "wrong type" says what is wrong with the value given (0 < 1).
        specific = [x for x in errs if not _is_type_error(x)]
        chosen = specific or errs
        msgs = list(dict.fromkeys(_message(x) for x in chosen))
        if len(msgs) > 1 and not specific:
            kinds = " or ".join(m.lower().removeprefix("input should be ") for m in msgs)
            msgs = [f"{chosen[0]['input']!r} is not allowed; expected {kinds}"]
        lines.append(f"{where}: {_loc(path)}: {'; '.join(msgs)}")
    return "\n".join(lines)


def _flag_problems(job: Job) -> Iterator[str]:
    """Space keys that are not arguments of the vLLM that runs, and switches given values (or the reverse)."""
    known = vllm_args()
    for name, spec in job.space.items():
        arg = known.get(name)
        if arg is None:
            dashed = "--" + name.replace("_", "-")
            yield (
                f"space.{name}: not an argument of vLLM {PINNED_VLLM}{did_you_mean(name, known)} (a flag it does "
                f"not list goes in target.{job.target.launcher}.extra_args, e.g. [{dashed}, VALUE])"
            )
            continue
        if name in KNOWN_FLAGS:
            continue  # the space checks their values itself, with what each allows
        values = (
            spec.choices if isinstance(spec, Choices) else [spec.low, spec.high] if isinstance(spec, Range) else [spec]
        )
        switch = arg.kind in ("switch", "switch_on")
        if switch and (isinstance(spec, Range) or not all(isinstance(v, bool) for v in values)):
            yield f"space.{name}: --{name.replace('_', '-')} is a switch; give true, false or choices: [true, false]"
        elif arg.kind == "switch_on" and False in values:
            yield f"space.{name}: vLLM {PINNED_VLLM} has no --no-{name.replace('_', '-')}; leave the flag out for false"
        elif not switch and any(isinstance(v, bool) for v in values):
            yield f"space.{name}: --{name.replace('_', '-')} takes a value, not true/false"


def _lower(length: int | LengthDist) -> int:
    if isinstance(length, int):
        return length
    if isinstance(length, FixedLength):
        return length.value
    return length.low if isinstance(length, UniformLength) else length.min


def _largest_model_len(space: SearchSpace) -> tuple[int, str] | None:
    """The longest max_model_len any trial gets, and how the job gives it (None when left to vLLM)."""
    fixed = space.fixed.get("max_model_len")
    if isinstance(fixed, int):
        return fixed, f"max_model_len {fixed}"
    dist = space.distributions.get("max_model_len")
    if dist is None:
        return None
    values = [int(c) for c in getattr(dist, "choices", ()) if isinstance(c, int | float)]
    high = max(values) if values else int(getattr(dist, "high", 0))
    return high, f"every max_model_len of the space (the largest is {high})"


def _length_problems(job: Job, space: SearchSpace) -> Iterator[str]:
    """A max_model_len that no request of the workload fits in: every trial fails every request."""
    w = job.workload
    largest = _largest_model_len(space)
    if w.dataset is not None or largest is None:
        return  # a dataset's lengths are estimated, and vLLM's own default is the model's limit (checked there)
    shortest = max(_lower(w.input_len), w.prefix_len + 1) + _lower(w.output_len)
    limit, said = largest
    if shortest > limit:
        slo = next((s for s in job.slos if parse_slo(s).metric == "success_rate"), None)
        verdict = f"no trial can meet {slo!r}" if slo else "no request can succeed"
        yield (
            f"space.max_model_len: {said} is shorter than every request of the workload (at least {shortest} "
            f"tokens: input_len + output_len): vLLM refuses or cuts them all and {verdict}; raise max_model_len to at "
            f"least {w.max_request_tokens()} or shorten workload.input_len/output_len"
        )
        return
    yield from _too_many_too_long(job, limit, said)


# Requests drawn to judge a duration-bound run (whose count is not known before it runs).
_LENGTH_SAMPLE = 1000


def _too_many_too_long(job: Job, limit: int, said: str) -> Iterator[str]:
    """Some requests longer than every max_model_len: an error only where they alone miss the success-rate SLO (the
    run's own requests, drawn by its seed, counted); fewer stay the space's note."""
    rate = next((parse_slo(s) for s in job.slos if parse_slo(s).metric == "success_rate"), None)
    if rate is None or rate.op != ">=":
        return
    n = (job.arrival.requests or _LENGTH_SAMPLE) + job.arrival.warmup_requests
    totals = job.workload.request_tokens(n)[job.arrival.warmup_requests :]
    too_long = sum(t > limit for t in totals)
    allowed = math.floor(len(totals) * (1 - rate.threshold) + 1e-9)
    if too_long <= allowed:
        return
    needed = sorted(totals)[len(totals) - allowed - 1]
    yield (
        f"space.max_model_len: {said} is shorter than {too_long} of the workload's {len(totals)} measured requests "
        f"(input_len + output_len, as its seed draws them): vLLM refuses or cuts those, so no trial can meet "
        f"'{rate}'; raise max_model_len to at least {needed} or shorten workload.input_len/output_len"
    )


# What the job's own fields (or the study) give each launcher: not for `options` to give again.
_SET_BY_THE_JOB = {
    "docker": {"image", "model", "env", "volumes", "extra_args", "startup_timeout_s", "vendor", "gpus", "client"},
    "process": {"command", "model", "extra_args", "secret_env", "startup_timeout_s"},
}


def _launcher_option_problems(job: Job) -> Iterator[str]:
    """`target.<kind>.options` reach the launcher as keyword arguments: a key it does not take would fail every
    trial at its first launch, so it is named here, with the keys it does take."""
    import inspect

    from tuner.launch import DockerLauncher, ProcessLauncher

    for kind, cls, given in (
        ("docker", DockerLauncher, job.target.docker.options),
        ("process", ProcessLauncher, job.target.process.options),
    ):
        params = inspect.signature(cls.__init__).parameters
        allowed = sorted(n for n, p in params.items() if n != "self" and p.kind is not p.VAR_KEYWORD)
        allowed = [n for n in allowed if n not in _SET_BY_THE_JOB[kind]]
        for key in given:
            if key not in allowed:
                yield (
                    f"target.{kind}.options.{key}: not an option of the {kind} launcher; allowed: "
                    f"{', '.join(allowed)}{did_you_mean(key, allowed)}"
                )


def _check(job: Job, *, flags: bool = True) -> list[str]:
    """Everything pydantic cannot see alone: the catalog, the space against the model, vLLM (`flags`: the keys
    against its arguments) and the workload."""
    try:
        job.gpu_profile()
    except ConfigError as e:
        return [f"target.gpu: {e}"]
    try:
        job.model_profile()
    except ConfigError as e:
        return [f"target.model: {e}"]
    try:
        job.step_profile()
    except ConfigError as e:
        return [f"target.profile: {e}"]
    try:
        job.workload.max_request_tokens()  # reads a dataset: a missing or broken one is the workload's problem
    except ConfigError as e:
        return [f"workload.dataset: {e}"]
    problems = list(_flag_problems(job)) if flags else []
    try:
        space = job.search_space()
    except ConfigError as e:
        return [*problems, *str(e).splitlines()]
    problems += _length_problems(job, space)
    problems += _launcher_option_problems(job)
    problems += _sampler_problems(job.sampler)
    if job.sampler.name == "grid" and not problems:
        try:
            space.grid()
        except ConfigError as e:
            problems.append(str(e))
    return problems


# The options only TPE reads (the twin hands over to TPE, and a job without a name gets twin or tpe).
_TPE_OPTIONS = ("multivariate", "group")


def _sampler_problems(s: SamplerSection) -> list[str]:
    problems = [
        f"sampler.{option}: only tpe and twin (its TPE fallback) take it; sampler.name is {s.name}"
        for option in _TPE_OPTIONS
        if getattr(s, option) is not None and s.name not in (None, "tpe", "twin")
    ]
    if s.group and s.multivariate is False:
        problems.append("sampler.group: needs multivariate (true or left out); give group: false or drop it")
    return problems


def parse_job(
    data: Any,
    *,
    where: str = "job",
    source: Path | None = None,
    stored: bool = False,
    auto_gpu: GpuProfile | None = None,
) -> Job:
    """A Job from already-parsed YAML/JSON; ConfigError naming `where`, the field path and what is allowed, one
    line per problem.

    `stored`: the job a study was run with, read back from it. Its flag keys are not checked against the pinned
    vLLM's arguments again: the vLLM the study ran accepted them, and an older study's flag (swap_space, gone from
    0.32) must not lock its own trials out of `tuner verify`, `plan` or an export. `auto_gpu`: the GPU `gpu: auto`
    stands for in the checks (Job.assume_gpu), where the job runs on other machines than this one.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a job file is a mapping with study, target, space, arrival, ...")
    try:
        job = Job.model_validate({**data, "source": source})
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, where, data)) from None
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if job.workload.dataset is not None and source is not None and not job.workload.dataset.is_absolute():
        dataset = source.parent / job.workload.dataset
        job = job.model_copy(update={"workload": job.workload.model_copy(update={"dataset": dataset})})
    if auto_gpu is not None:
        job.assume_gpu(auto_gpu)
    problems = _check(job, flags=not stored)
    if problems:
        raise ConfigError("\n".join(f"{where}: {line}" for line in problems))
    return job


def _decode(p: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{p}: line {line}: byte 0x{raw[e.start]:02x} is not UTF-8; save the job file as UTF-8"
        ) from None


def _duplicates(node: Any, path: tuple[int | str, ...] = (), walked: set[int] | None = None) -> Iterator[str]:
    """`path: duplicate key` for every key given twice in one mapping: YAML would keep the last without a word."""
    walked = set() if walked is None else walked
    if id(node) in walked:
        return  # an alias of a node already walked (or of its own parent: `&a [*a]` would never end)
    walked.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else str(key.value)
            if name in seen and name != "<<":
                yield (
                    f"{_loc((*path, name))}: duplicate key at line {key.start_mark.line + 1} (first at line "
                    f"{seen[name]}); give each key once"
                )
            seen.setdefault(name, key.start_mark.line + 1)
            yield from _duplicates(value, (*path, name), walked)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _duplicates(item, (*path, i), walked)


def _read_yaml(p: Path, text: str) -> Any:
    try:
        duplicates = list(_duplicates(yaml.compose(text, Loader=yaml.SafeLoader)))
        if duplicates:
            raise ConfigError("\n".join(f"{p}: {line}" for line in duplicates))
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).replace("\n", " ")
        raise ConfigError(f"{p}: not valid YAML{at}: {problem}") from None


def load_job(path: str | Path, *, auto_gpu: GpuProfile | None = None) -> Job:
    """Read and validate a job file (YAML or JSON); `auto_gpu` as parse_job says."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"job file {p}: no such file") from None
    except OSError as e:
        raise ConfigError(f"job file {p}: cannot read it ({e.strerror})") from None
    data = _read_yaml(p, _decode(p, raw))
    return parse_job(data, where=str(p), source=p.resolve(), auto_gpu=auto_gpu)


__all__ = [
    "SAMPLERS",
    "Budget",
    "CapacitySearch",
    "DockerOptions",
    "EmulatorOptions",
    "FeasibilitySection",
    "Job",
    "ProcessOptions",
    "SamplerName",
    "SamplerSection",
    "StudySection",
    "TargetSection",
    "WorkloadSection",
    "did_you_mean",
    "format_validation_error",
    "job_schema",
    "load_job",
    "parse_duration",
    "parse_job",
]
