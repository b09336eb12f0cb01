"""The field types the job's sections share: durations, SLO texts, environment variable names, vLLM arguments
that must not carry a secret, and the strict base model (an unknown key is a mistake, not a silent default)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict

from tuner.errors import ConfigError
from tuner.scoring import parse_slo

__all__ = [
    "Duration",
    "EnvNames",
    "ExtraArgs",
    "SloText",
    "StrictModel",
    "parse_cpu_list",
    "parse_duration",
    "secret_arg",
]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h|d)?\s*$")
_UNIT_SECONDS = {None: 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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


def parse_cpu_list(text: str) -> frozenset[int]:
    """The cores of a Linux CPU list ("0-2,5"); ValueError naming what is wrong."""
    cores: set[int] = set()
    for part in str(text).replace(" ", "").split(","):
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list; use core numbers and ranges, e.g. 1 or 2-7 or 0,2,5")
        first, last = int(low), int(high) if sep else int(low)
        if last < first:
            raise ValueError(f"{text!r}: the range {part} runs backwards")
        cores.update(range(first, last + 1))
    return frozenset(cores)


def _check_slo(text: str) -> str:
    try:
        parse_slo(text)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    return text


SloText = Annotated[str, AfterValidator(_check_slo)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _env_names(names: list[str]) -> list[str]:
    for n in names:
        if not _ENV_NAME.match(n):
            raise ValueError(
                f"{n!r} is not an environment variable name; list names only (e.g. HF_TOKEN), the value is read "
                "from the environment when the server starts and never stored"
            )
    return names


EnvNames = Annotated[list[str], BeforeValidator(_env_names)]


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
