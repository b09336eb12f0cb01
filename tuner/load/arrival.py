"""When requests are sent: a closed loop of N users, an open loop at R requests/s, or a trace's own times; when
to stop; warm-up."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tuner.load.trace_replay import TimedRequest, mean_rate, trace_slice
from tuner.load.traces import Trace, TraceFormat, load_trace

__all__ = ["Arrival", "interarrival_gaps", "send_offsets"]


_TRACE_ONLY = ("start_s", "speedup", "block_tokens", "format")
_RATE_ONLY = ("process", "burstiness")


class Arrival(BaseModel):
    """Exactly one of `concurrency` (closed loop), `rate` (open loop) or `trace` (an open loop at the trace's own
    times and lengths); at least one of `requests` / `duration_s` but for a trace, which ends with its slice.

    `requests` and `duration_s` count the measured phase only; warm-up requests come first and are excluded. For a
    trace, `duration_s` is the slice's length in the trace's own seconds, from `start_s`.
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
    trace: Path | None = None
    """A request log replayed at its own times: Mooncake JSONL, Azure or BurstGPT CSV, or JSONL {t, input_len,
    output_len}."""
    format: TraceFormat = "auto"
    start_s: float = Field(default=0.0, ge=0)
    """Where the slice starts, in seconds from the trace's first request."""
    speedup: float = Field(
        default=1.0,
        gt=0,
        description="a trace's time divided by this: 4 plays an hour in 15 minutes; under objective max_rate or "
        "goodput, where the search starts (it sets each step's speed-up: the rate over the slice's own)",
    )
    block_tokens: int = Field(default=512, ge=1)
    """Tokens in one Mooncake hash id's prompt block (512 in Mooncake's published traces)."""

    @model_validator(mode="after")
    def _check(self) -> Arrival:
        given = sum(x is not None for x in (self.concurrency, self.rate, self.trace))
        if given != 1:
            raise ValueError(
                "give exactly one of concurrency (closed loop), rate (open loop, requests/s) or trace (a request log)"
            )
        # A value other than the default, not a key given: a stored job's dump holds every field.
        fields = type(self).model_fields
        changed = [name for name in _TRACE_ONLY + _RATE_ONLY if getattr(self, name) != fields[name].default]
        for name in changed:
            if self.trace is None and name in _TRACE_ONLY:
                raise ValueError(f"{name} applies to a trace; give trace: FILE, or leave {name} out")
            if self.trace is not None and name in _RATE_ONLY:
                raise ValueError(f"{name} shapes a rate's gaps; a trace sends at its own times: leave {name} out")
        if self.requests is None and self.duration_s is None and self.trace is None:
            raise ValueError("give requests (a count) and/or duration_s to say when the run stops")
        if self.concurrency is not None and self.max_in_flight is not None:
            raise ValueError("max_in_flight applies to an open loop (rate); a closed loop has exactly concurrency")
        return self

    @property
    def closed(self) -> bool:
        return self.concurrency is not None

    def load_trace(self) -> Trace:
        """The trace file read (ConfigError naming the file and line for a bad row)."""
        assert self.trace is not None
        return load_trace(self.trace, self.format)

    def trace_requests(self) -> tuple[TimedRequest, ...]:
        """The slice to send, with send times from its start after the speed-up; at most `requests` after the
        warm-up ones, when a count is given."""
        sent = trace_slice(self.load_trace(), self.start_s, self.duration_s, self.speedup)
        if self.requests is not None:
            sent = sent[: self.warmup_requests + self.requests]
        return sent

    def trace_rate(self) -> float | None:
        """The slice's own mean rate in requests/s, at speed-up 1 (None: fewer than two requests at two times)."""
        rate = mean_rate(self.trace_requests())
        return rate / self.speedup if rate is not None else None

    def at_rate(self, rate: float, seed: int = 0) -> Arrival:
        """The trace sped up (or slowed) so that its slice sends `rate` requests/s on average: every time divided
        alike, so its bursts, lengths and shared blocks stay the trace's. `seed` writes its prompts afresh (the
        blocks stay shared within the replay, not with an earlier one a prefix cache may still hold)."""
        own = self.trace_rate()
        assert own is not None
        return self.model_copy(update={"speedup": rate / own, "seed": seed})

    def describe(self) -> str:
        if self.concurrency is not None:
            return f"closed loop, {self.concurrency} users"
        if self.trace is not None:
            end = f"{self.start_s + self.duration_s:g} s" if self.duration_s is not None else "its end"
            speed = f", x{self.speedup:g}" if self.speedup != 1 else ""
            cap = f", at most {self.max_in_flight} in flight" if self.max_in_flight else ""
            return f"trace {self.trace.name} from {self.start_s:g} s to {end}{speed}{cap}"
        shape = self.process if self.burstiness == 1.0 or self.process == "constant" else f"gamma({self.burstiness:g})"
        cap = f", at most {self.max_in_flight} in flight" if self.max_in_flight else ""
        return f"open loop, {shape} {self.rate:g} req/s{cap}"


def send_offsets(arrival: Arrival) -> Iterator[float]:
    """An open loop's send times in seconds from its start: a trace's slice (then never again), or the gaps summed."""
    if arrival.trace is not None:
        for req in arrival.trace_requests():
            yield req.send_s
        while True:
            yield math.inf
    t = 0.0
    for gap in interarrival_gaps(arrival):
        yield t
        t += gap


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
