"""Length distributions of a workload's prompts and outputs (tokens): fixed, uniform, normal, log-normal."""

from __future__ import annotations

import math
import random
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Dist", "FixedLength", "LengthDist", "LogNormalLength", "NormalLength", "UniformLength", "as_dist"]


class FixedLength(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    dist: Literal["fixed"] = "fixed"
    value: int = Field(ge=1)

    def sample(self, rng: random.Random) -> int:
        return self.value

    @property
    def upper(self) -> int:
        return self.value


class UniformLength(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    dist: Literal["uniform"] = "uniform"
    low: int = Field(ge=1)
    high: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> UniformLength:
        if self.high < self.low:
            raise ValueError(f"uniform length: high ({self.high}) must be >= low ({self.low})")
        return self

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    @property
    def upper(self) -> int:
        return self.high


class NormalLength(BaseModel):
    """Normal, clipped to [min, max] (max defaults to mean + 4 std)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    dist: Literal["normal"] = "normal"
    mean: float = Field(gt=0)
    std: float = Field(ge=0)
    min: int = Field(default=1, ge=1)
    max: int | None = Field(default=None, ge=1)

    def sample(self, rng: random.Random) -> int:
        return _clip(round(rng.gauss(self.mean, self.std)), self.min, self.upper)

    @property
    def upper(self) -> int:
        return self.max if self.max is not None else max(self.min, math.ceil(self.mean + 4 * self.std))


class LogNormalLength(BaseModel):
    """Log-normal with the given median and sigma (of the log), clipped to [min, max] (default median·e^(4σ))."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    dist: Literal["lognormal"] = "lognormal"
    median: float = Field(gt=0)
    sigma: float = Field(ge=0)
    min: int = Field(default=1, ge=1)
    max: int | None = Field(default=None, ge=1)

    def sample(self, rng: random.Random) -> int:
        return _clip(round(rng.lognormvariate(math.log(self.median), self.sigma)), self.min, self.upper)

    @property
    def upper(self) -> int:
        return self.max if self.max is not None else max(self.min, math.ceil(self.median * math.exp(4 * self.sigma)))


def _clip(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


Dist = FixedLength | UniformLength | NormalLength | LogNormalLength
# The job file's field: the same union, told apart by `dist`.
LengthDist = Annotated[Dist, Field(discriminator="dist")]


def as_dist(v: int | Dist) -> Dist:
    """A length as given (a number is a fixed length) as a distribution."""
    return FixedLength(value=v) if isinstance(v, int) else v
