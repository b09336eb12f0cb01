"""The search space: which vLLM flags a study varies, over which values, and vLLM's rules applied before a launch.

A job file gives per flag a range (`low`/`high`, optional `step`/`log`), a list of `choices`, or one fixed value.
Ranges stay static Optuna distributions (every sampler, grid and NSGA-II included, can then use every past trial);
relational rules vLLM enforces at start-up are applied to the sampled values instead ("repairs"), so a flag set vLLM
would refuse is never proposed to a launcher:

- `max_model_len` ranges are clipped at the model's limit when the space is built;
- `max_num_batched_tokens` is raised to `max_num_seqs` (vLLM: "must be greater than or equal to max_num_seqs"), and to
  `max_model_len` when chunked prefill is off (vLLM refuses a smaller token budget then).

Two proposals that repair to the same flags are the same flag set: the study launches it once.
"""

from __future__ import annotations

import difflib
import math
import re
import warnings
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal, Protocol

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from pydantic import BaseModel, ConfigDict, Discriminator, Field, PlainValidator, Tag, WithJsonSchema, model_validator

from tuner.catalog.gpus import GpuProfile
from tuner.catalog.models import ModelProfile
from tuner.errors import ConfigError
from tuner.flags import BLOCK_SIZES, KV_CACHE_DTYPES, VllmFlags, default_flags, parse_model_len, resolve

Scalar = bool | int | float | str


def _one_of(kinds: tuple[type, ...], allowed: str) -> Any:
    """A plain check for a union of plain types: one error line ("... is not allowed; use ...") instead of one
    per member of the union, which is what pydantic reports for `bool | int | float | str`."""

    def check(value: Any) -> Any:
        if isinstance(value, kinds):
            return value
        raise ValueError(f"{value!r} is not allowed; use {allowed}")

    return check


ScalarValue = Annotated[
    Scalar,
    PlainValidator(_one_of((bool, int, float, str), "a string, number or true/false"), json_schema_input_type=Scalar),
]
Bound = Annotated[
    int | float | str,
    PlainValidator(
        _one_of((int, float, str), "a number (or a length such as 8k)"), json_schema_input_type=int | float | str
    ),
]
# The schema says > 0 by hand: pydantic cannot attach `gt` to a plain validator's schema (Range checks it).
Step = Annotated[
    int | float,
    PlainValidator(_one_of((int, float), "a number > 0")),
    WithJsonSchema({"type": "number", "exclusiveMinimum": 0}),
]

INT_FLAGS = ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "tensor_parallel_size", "block_size")
FLOAT_FLAGS = ("gpu_memory_utilization",)
BOOL_FLAGS = ("enable_chunked_prefill", "enable_prefix_caching", "enforce_eager")
STR_FLAGS = ("kv_cache_dtype",)
KNOWN_FLAGS = INT_FLAGS + FLOAT_FLAGS + BOOL_FLAGS + STR_FLAGS
# Lengths may be written as vLLM writes them on its command line: 8k = 8000, 8K = 8192.
LENGTH_FLAGS = ("max_model_len", "max_num_batched_tokens")
# The order parameters are suggested in: stable, so a seeded study proposes the same sequence every run.
_ORDER = {name: i for i, name in enumerate(KNOWN_FLAGS)}
_EXTRA_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
MAX_GRID_POINTS = 100_000


class Range(BaseModel):
    """`{low, high}` with an optional `step` (grid spacing) or `log` (sample on a log scale)."""

    model_config = ConfigDict(extra="forbid")

    low: Bound
    high: Bound
    step: Step | None = None
    log: bool = False

    @model_validator(mode="after")
    def _step_or_log(self) -> Range:
        if self.step is not None and self.log:
            raise ValueError("a range takes `step` or `log: true`, not both")
        if isinstance(self.step, bool) or (self.step is not None and not self.step > 0):
            raise ValueError(f"step must be > 0, got {self.step}")
        return self


class Choices(BaseModel):
    """`{choices: [...]}`: a categorical parameter."""

    model_config = ConfigDict(extra="forbid")

    choices: list[ScalarValue] = Field(min_length=1)


def _spec_kind(value: Any) -> str:
    """Which form a flag's value takes, told by its keys, so a mistake is reported against that form only."""
    if isinstance(value, Range | Choices):
        return "range" if isinstance(value, Range) else "choices"
    if not isinstance(value, dict):
        return "value"
    if "choices" in value:
        return "choices"
    return "range" if "low" in value or "high" in value else "form"


def _no_form(value: Any) -> Any:
    keys = ", ".join(map(str, value)) or "none"
    hints = {h for k in value for h in difflib.get_close_matches(str(k), ("low", "high", "step", "log", "choices"), 1)}
    hint = f" (did you mean {', '.join(sorted(hints))}?)" if hints else ""
    raise ValueError(
        f"a flag takes {{low, high, step?, log?}}, {{choices: [...]}} or one value; this mapping has keys {keys}{hint}"
    )


ParamSpec = Annotated[
    Annotated[Range, Tag("range")]
    | Annotated[Choices, Tag("choices")]
    | Annotated[ScalarValue, Tag("value")]
    | Annotated[dict[str, Any], PlainValidator(_no_form), Tag("form")],
    Discriminator(_spec_kind),
]
"""What a job file gives for one flag: a range, choices, or a fixed value."""
# The tags above appear in pydantic's error locations; the job's error messages leave them out of the field path.
PARAM_SPEC_TAGS = ("range", "choices", "value", "form")


class _Trial(Protocol):
    """The part of optuna.Trial (and FixedTrial) that suggesting needs."""

    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False) -> int: ...

    def suggest_float(
        self, name: str, low: float, high: float, *, step: float | None = None, log: bool = False
    ) -> float: ...

    def suggest_categorical(self, name: str, choices: Any) -> Any: ...


@dataclass(frozen=True)
class Suggestion:
    """The flags of one trial, after vLLM's rules; `repairs` and `warnings` say what was changed or is suspect."""

    flags: VllmFlags
    params: dict[str, Any]
    repairs: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class SearchSpace:
    """Optuna distributions for the varied flags and the fixed ones, checked against the model and GPU."""

    distributions: dict[str, BaseDistribution]
    fixed: dict[str, Scalar]
    gpu: GpuProfile
    model: ModelProfile
    longest_request: int | None = None
    notes: tuple[str, ...] = field(default=())

    @classmethod
    def build(
        cls,
        spec: dict[str, ParamSpec],
        gpu: GpuProfile,
        model: ModelProfile,
        *,
        longest_request: int | None = None,
        where: str = "space",
    ) -> SearchSpace:
        """Compile a job file's `space` section; ConfigError names `where.<flag>` and what is allowed."""
        distributions: dict[str, BaseDistribution] = {}
        fixed: dict[str, Scalar] = {}
        notes: list[str] = []
        problems: list[str] = []
        for name in sorted(spec, key=lambda n: (_ORDER.get(n, len(_ORDER)), n)):
            path = f"{where}.{name}"
            # Every flag is checked, so a file with three mistakes says all three at once, one line each.
            try:
                _compile_one(name, spec[name], path, model, distributions, fixed, notes)
            except ConfigError as e:
                problems.append(str(e))
        if problems:
            raise ConfigError("\n".join(problems))
        if not distributions:
            raise ConfigError(f"{where}: nothing to tune; give at least one flag a range or choices")
        space = cls(distributions, fixed, gpu, model, longest_request, ())
        notes += space._length_notes()
        return cls(distributions, fixed, gpu, model, longest_request, tuple(notes))

    def suggest(self, trial: _Trial, *, baseline: bool = False) -> Suggestion:
        """Sample every varied flag (in a fixed order), add the fixed ones, apply vLLM's rules.

        The baseline trial (enqueued with `baseline_params()`) records vLLM's defaults as its parameters, so every
        sampler learns from it, and its flags are exactly `baseline()`: a varied flag vLLM has no default for in our
        model of it is left unset rather than sampled.
        """
        params: dict[str, Any] = {}
        names = self.baseline_params() if baseline else self.distributions
        with warnings.catch_warnings():
            # vLLM's defaults may lie outside the job's ranges: the baseline is meant to be exactly them.
            warnings.filterwarnings("ignore", message=r"(Fixed parameter|The value) .* out of (the )?range")
            for name in names:
                params[name] = _suggest_one(trial, name, self.distributions[name])
        if baseline:
            return replace(self._baseline_suggestion(), params=params)
        return self.repair(params)

    def repair(self, params: dict[str, Any]) -> Suggestion:
        """Flags from sampled params + fixed values, with vLLM's relational rules applied."""
        values: dict[str, Any] = {**self.fixed, **params}
        flags = VllmFlags.from_dict(values)
        r = resolve(flags, self.gpu, self.model)
        repairs: list[str] = []
        budget = r.max_num_batched_tokens
        if budget < r.max_num_seqs:
            repairs.append(f"max_num_batched_tokens {budget} -> {r.max_num_seqs}: vLLM requires it >= max_num_seqs")
            budget = r.max_num_seqs
        if not r.enable_chunked_prefill and budget < r.max_model_len:
            repairs.append(
                f"max_num_batched_tokens {budget} -> {r.max_model_len}: with chunked prefill off vLLM requires it "
                f">= max_model_len ({r.max_model_len})"
            )
            budget = r.max_model_len
        if repairs:
            values["max_num_batched_tokens"] = budget
            flags = VllmFlags.from_dict(values)
        notes: list[str] = []
        if self.longest_request is not None and r.max_model_len < self.longest_request:
            notes.append(
                f"max_model_len {r.max_model_len} is below the workload's longest request ({self.longest_request} "
                "tokens): vLLM rejects longer requests with HTTP 400, counted as failures"
            )
        return Suggestion(flags, params, tuple(repairs), tuple(notes))

    def baseline(self) -> VllmFlags:
        """vLLM's defaults for this GPU and model, with the job's fixed flags applied (they hold for every trial)."""
        return self._baseline_suggestion().flags

    def _baseline_suggestion(self) -> Suggestion:
        defaults = default_flags(self.gpu, self.model).as_dict()
        return self.repair({k: v for k, v in defaults.items() if k not in self.fixed})

    def baseline_params(self) -> dict[str, Any]:
        """The baseline as trial parameters: the value of every varied flag (vLLM's default where it has one)."""
        base = self.baseline().as_dict()
        r = resolve(self.baseline(), self.gpu, self.model)
        out: dict[str, Any] = {}
        for name, dist in self.distributions.items():
            value = base.get(name, getattr(r, name, None))
            if isinstance(dist, CategoricalDistribution) and value not in dist.choices:
                # A categorical cannot record a value outside its choices: the baseline trial leaves it unset
                # (its flags are still vLLM's defaults; samplers treat the parameter as missing there).
                continue
            if value is not None:
                out[name] = value
        return out

    def grid(self) -> dict[str, list[Any]]:
        """Every value of every varied flag, for the grid sampler; ConfigError for a continuous range."""
        grid: dict[str, list[Any]] = {}
        for name, dist in self.distributions.items():
            if isinstance(dist, CategoricalDistribution):
                grid[name] = list(dist.choices)
            elif isinstance(dist, IntDistribution) and not dist.log:
                grid[name] = list(range(dist.low, dist.high + 1, dist.step))
            elif isinstance(dist, FloatDistribution) and dist.step is not None:
                n = round((dist.high - dist.low) / dist.step)
                grid[name] = [round(dist.low + i * dist.step, 10) for i in range(n + 1)]
            else:
                raise ConfigError(
                    f"space.{name}: the grid sampler needs a finite set of values; give `choices` or a range with "
                    "`step` (not `log`)"
                )
        points = math.prod(len(v) for v in grid.values())
        if points > MAX_GRID_POINTS:
            raise ConfigError(f"space: the grid has {points} points (at most {MAX_GRID_POINTS}); give coarser steps")
        return grid

    def _length_notes(self) -> list[str]:
        if self.longest_request is None:
            return []
        dist = self.distributions.get("max_model_len")
        low: Any = self.fixed.get("max_model_len")
        if isinstance(dist, IntDistribution):
            low = dist.low
        elif isinstance(dist, CategoricalDistribution):
            low = min(int(c) for c in dist.choices if c is not None)
        if isinstance(low, int) and low < self.longest_request:
            return [
                f"space.max_model_len: values from {low} are below the workload's longest request "
                f"({self.longest_request} tokens); trials with them will see HTTP 400 for the longer requests"
            ]
        return []


def describe_distribution(dist: BaseDistribution) -> str:
    """A searched flag's range in words (`one of 16, 32, 64`, `0.86 to 0.98, step 0.04`), short enough for an
    80-column line where Optuna's repr is not."""
    if isinstance(dist, CategoricalDistribution):
        return "one of " + ", ".join(str(c) for c in dist.choices)
    if isinstance(dist, (IntDistribution, FloatDistribution)):
        text = f"{dist.low:g} to {dist.high:g}"
        if dist.step is not None and dist.step != 1:
            text += f", step {dist.step:g}"
        return text + (", log scale" if dist.log else "")
    return str(dist)


def _compile_one(
    name: str,
    value: ParamSpec,
    path: str,
    model: ModelProfile,
    distributions: dict[str, BaseDistribution],
    fixed: dict[str, Scalar],
    notes: list[str],
) -> None:
    if name not in KNOWN_FLAGS and not _EXTRA_NAME.match(name):
        raise ConfigError(f"{path}: not a vLLM flag name; write it with underscores, e.g. max_num_seqs")
    if isinstance(value, Range):
        distributions[name] = _range_distribution(name, value, path, model, notes)
    elif isinstance(value, Choices):
        choices = [_check_value(name, v, path, model) for v in value.choices]
        if len(choices) == 1:
            fixed[name] = choices[0]
        else:
            distributions[name] = CategoricalDistribution(choices)
    else:
        fixed[name] = _check_value(name, value, path, model)


def _suggest_one(trial: _Trial, name: str, dist: BaseDistribution) -> Any:
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
    if isinstance(dist, FloatDistribution):
        return trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)
    assert isinstance(dist, CategoricalDistribution)
    return trial.suggest_categorical(name, dist.choices)


def _kind(name: str) -> Literal["int", "float", "bool", "str", "any"]:
    if name in INT_FLAGS:
        return "int"
    if name in FLOAT_FLAGS:
        return "float"
    if name in BOOL_FLAGS:
        return "bool"
    if name in STR_FLAGS:
        return "str"
    return "any"


def _number(name: str, value: Any, path: str) -> int | float:
    if isinstance(value, str) and name in LENGTH_FLAGS:
        try:
            return parse_model_len(value)
        except ValueError as e:
            raise ConfigError(f"{path}: {e}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{path}: {value!r} is not a number")
    return value


def _check_value(name: str, value: Any, path: str, model: ModelProfile) -> Scalar:
    kind = _kind(name)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: {value!r} is not allowed; use true or false")
        return value
    if kind == "str":
        if value not in KV_CACHE_DTYPES:
            raise ConfigError(f"{path}: {value!r} is not allowed; use one of {', '.join(KV_CACHE_DTYPES)}")
        return str(value)
    if kind == "any":
        if not isinstance(value, bool | int | float | str):
            raise ConfigError(f"{path}: {value!r} is not allowed; use a string, number or true/false")
        return value
    number = _number(name, value, path)
    if kind == "int":
        if number != int(number):
            raise ConfigError(f"{path}: {value!r} is not an integer")
        number = int(number)
    _check_bounds(name, number, path, model)
    return number


def _check_bounds(name: str, number: int | float, path: str, model: ModelProfile) -> None:
    if name == "gpu_memory_utilization" and not 0 < number <= 1:
        raise ConfigError(f"{path}: {number} is not allowed; gpu_memory_utilization is a fraction in (0, 1]")
    if name == "block_size" and number not in BLOCK_SIZES:
        raise ConfigError(f"{path}: {number} is not allowed; block_size is one of {', '.join(map(str, BLOCK_SIZES))}")
    if name == "tensor_parallel_size" and (number < 1 or model.num_attention_heads % int(number)):
        raise ConfigError(
            f"{path}: {number} is not allowed; tensor_parallel_size must divide the model's "
            f"{model.num_attention_heads} attention heads"
        )
    if name == "max_model_len" and number > model.max_position_embeddings:
        raise ConfigError(
            f"{path}: {number} is above the model's limit ({model.max_position_embeddings}, max_position_embeddings)"
        )
    if name != "gpu_memory_utilization" and number < 1:
        raise ConfigError(f"{path}: {number} is not allowed; {name} must be >= 1")


def _range_distribution(name: str, spec: Range, path: str, model: ModelProfile, notes: list[str]) -> BaseDistribution:
    kind = _kind(name)
    if kind in ("bool", "str"):
        raise ConfigError(f"{path}: {name} takes `choices` or a fixed value, not a range")
    low, high = _number(name, spec.low, path + ".low"), _number(name, spec.high, path + ".high")
    if name == "max_model_len" and high > model.max_position_embeddings:
        limit = model.max_position_embeddings
        if low > limit:
            raise ConfigError(f"{path}: the whole range is above the model's limit ({limit}, max_position_embeddings)")
        notes.append(f"{path}: high {high} clipped to the model's limit {limit}")
        high = limit
    if not low <= high:
        raise ConfigError(f"{path}: low ({low}) must be <= high ({high})")
    if spec.log and low <= 0:
        raise ConfigError(f"{path}: a log range needs low > 0")
    is_int = kind == "int" or (
        kind == "any" and isinstance(low, int) and isinstance(high, int) and isinstance(spec.step or 1, int)
    )
    if is_int:
        step = spec.step if spec.step is not None else 1
        if low != int(low) or high != int(high) or step != int(step):
            raise ConfigError(f"{path}: {name} takes integers for low, high and step")
        lo, hi, st = int(low), int(high), int(step)
        if (hi - lo) % st:
            hi = lo + (hi - lo) // st * st
            notes.append(f"{path}: high lowered to {hi} to land on the step {st}")
        for ibound in (lo, hi):
            _check_bounds(name, ibound, path, model)
        return IntDistribution(lo, hi, step=st, log=spec.log)
    for bound in (low, high):
        _check_bounds(name, bound, path, model)
    fstep = None if spec.step is None else float(spec.step)
    flow, fhigh = float(low), float(high)
    if fstep is not None:
        # Optuna would warn and move `high` itself; do it here, once, with a note.
        n = math.floor((fhigh - flow) / fstep + 1e-9)
        landed = round(flow + n * fstep, 10)
        if abs(landed - fhigh) > 1e-9:
            notes.append(f"{path}: high lowered to {landed} to land on the step {fstep}")
        fhigh = landed
    return FloatDistribution(flow, fhigh, step=fstep, log=spec.log)


__all__ = ["Choices", "ParamSpec", "Range", "SearchSpace", "Suggestion", "describe_distribution"]
