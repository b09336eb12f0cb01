"""The cost objective: what serving the job's load with a shape costs, replicas included.

A trial's capacity search finds one replica's capacity under the SLOs (the highest rate meeting them, as `max_rate`
does). The job's load then needs `ceil(load / capacity)` replicas of `world_size` GPUs each; the deployment pays
for those GPUs by the hour, and its $ per million output tokens is that price over the tokens the load asks for.

The load is the job's `arrival.rate`; a closed loop's `arrival.concurrency` users are sized by Little's law: each user
holds one request in flight, and a replica that met the SLOs at its capacity held `in_flight` requests on average
(its measured concurrency there), so it serves that many users, who send `users x capacity / in_flight` req/s.

The study maximises the inverse of the cost, million output tokens per dollar (per GPU-hour without a price), so
the study's directions stay (maximize, minimize latency); the readers show the cost itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tuner.scoring import LoadSummary

__all__ = ["CostFigures", "JobLoad", "cost_figures", "scored_tok_s", "tokens_per_request"]

_MILLION = 1_000_000
# A replica a hair short of a whole share (capacity 9.999 for a load of 10) is not a second replica: capacities are
# measured to the search's tolerance, far coarser than this.
_EPS = 1e-9


@dataclass(frozen=True)
class JobLoad:
    """What the deployment must serve: an open loop's requests per second, or a closed loop's users."""

    rate: float | None = None
    users: int | None = None

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.users is None):
            raise ValueError("a job's load is a rate or users, exactly one")


@dataclass(frozen=True)
class CostFigures:
    """A shape's cost at the job's load. `usd_*` are None without a price."""

    replicas: int
    gpus: int  # replicas x world size: what the deployment pays for
    load_rate: float  # the job's requests/s (a closed loop's by Little's law)
    load_tok_s: float  # the output tok/s the job's load asks for
    box_tok_s: float  # what those replicas do at their capacity: the headroom beside load_tok_s
    gpu_hours_per_m_tokens: float  # at the job's load
    usd_per_hour: float | None = None
    usd_per_m_tokens: float | None = None  # at the job's load

    @property
    def value(self) -> float:
        """What the study maximises: million output tokens per dollar, or per GPU-hour without a price."""
        per_m = self.usd_per_m_tokens if self.usd_per_m_tokens is not None else self.gpu_hours_per_m_tokens
        return 1.0 / per_m if per_m > 0 else 0.0


def cost_figures(
    capacity_rate: float,
    tokens_per_request: float,
    *,
    world_size: int,
    load: JobLoad,
    in_flight: float | None = None,
    gpu_hour_usd: float | None = None,
) -> CostFigures | None:
    """The cost of serving `load` with replicas of `world_size` GPUs, each of which met the SLOs at
    `capacity_rate` req/s with `in_flight` requests in flight on average (needed for users), a request asking for
    `tokens_per_request` output tokens. None when the replica has no capacity (no rate met the SLOs) or a closed loop
    has no in-flight figure.

    The tokens are counted per request, not read from the step's tok/s: a short capacity step's tok/s is diluted by
    its drain (the last requests finish after the last arrives), so tok/s / rate under-counts a request's tokens.
    """
    if capacity_rate <= 0 or tokens_per_request <= 0:
        return None
    if load.users is not None:
        if not in_flight or in_flight <= 0:
            return None
        shares = load.users / in_flight
        rate = load.users * capacity_rate / in_flight
    else:
        rate = float(load.rate or 0.0)
        shares = rate / capacity_rate
    n = max(1, math.ceil(shares - _EPS))
    gpus = n * max(1, world_size)
    load_tok_s = rate * tokens_per_request
    gpu_hours = gpus / (load_tok_s * 3600) * _MILLION
    usd_h = gpu_hour_usd * gpus if gpu_hour_usd is not None else None
    usd_m = gpu_hour_usd * gpu_hours if gpu_hour_usd is not None else None
    box_tok_s = n * capacity_rate * tokens_per_request
    return CostFigures(n, gpus, rate, load_tok_s, box_tok_s, gpu_hours, usd_h, usd_m)


def scored_tok_s(summary: LoadSummary, rate: float | None) -> float:
    """One server's output tok/s as a trial is scored: at a fixed load (`rate` None) the run's own; at a capacity
    search's rate that met the SLOs, the tokens that rate asks for (rate x a request's tokens). A step's own tok/s
    is diluted by its drain (the last requests finish after the last one is sent), more for a server whose answers
    take longer, so a higher SLO-meeting rate could read fewer tok/s and rank lower."""
    return rate * tokens_per_request(summary) if rate else float(summary.output_throughput)


def tokens_per_request(summary: LoadSummary) -> float:
    """Output tokens a request got, as the run counted them; its tok/s per req/s where it counted none."""
    if summary.completion_tokens > 0 and summary.requests_succeeded > 0:
        return summary.completion_tokens / summary.requests_succeeded
    return summary.output_throughput / summary.request_throughput if summary.request_throughput > 0 else 0.0
