"""When requests are sent: a closed loop of N users, or an open loop at R requests/s; when to stop; warm-up."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Arrival", "interarrival_gaps"]


class Arrival(BaseModel):
    """Exactly one of `concurrency` (closed loop) or `rate` (open loop); at least one of `requests` / `duration_s`.

    `requests` and `duration_s` count the measured phase only; warm-up requests come first and are excluded.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    concurrency: int | None = Field(default=None, ge=1)
    rate: float | None = Field(default=None, gt=0)
    process: Literal["poisson", "constant"] = "poisson"
    burstiness: float = Field(default=1.0, gt=0)
    """Gamma shape of the inter-arrival gaps: 1 is Poisson, < 1 burstier, > 1 more regular (vLLM bench's factor)."""
    max_in_flight: int | None = Field(default=None, ge=1)
    requests: int | None = Field(default=None, ge=1)
    duration_s: float | None = Field(default=None, gt=0)
    warmup_requests: int = Field(default=0, ge=0)
    warmup_s: float = Field(default=0.0, ge=0)
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> Arrival:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) or rate (open loop, requests/s)")
        if self.requests is None and self.duration_s is None:
            raise ValueError("give requests (a count) and/or duration_s to say when the run stops")
        if self.concurrency is not None and self.max_in_flight is not None:
            raise ValueError("max_in_flight applies to an open loop (rate); a closed loop has exactly concurrency")
        return self

    @property
    def closed(self) -> bool:
        return self.concurrency is not None

    def describe(self) -> str:
        if self.concurrency is not None:
            return f"closed loop, {self.concurrency} users"
        shape = self.process if self.burstiness == 1.0 or self.process == "constant" else f"gamma({self.burstiness:g})"
        cap = f", at most {self.max_in_flight} in flight" if self.max_in_flight else ""
        return f"open loop, {shape} {self.rate:g} req/s{cap}"


def interarrival_gaps(arrival: Arrival) -> Iterator[float]:
    """Endless seconds between consecutive sends of an open loop, from a seeded RNG."""
    assert arrival.rate is not None
    rate = arrival.rate
    if arrival.process == "constant":
        while True:
            yield 1.0 / rate
    rng = random.Random(arrival.seed)
    shape = arrival.burstiness
    # Gamma(shape, 1/(rate·shape)) has mean 1/rate for every shape; shape 1 is the exponential (Poisson arrivals).
    scale = 1.0 / (rate * shape)
    while True:
        yield rng.gammavariate(shape, scale)
