"""What a load run produces: one record per request (kept, so a study can be re-scored) and the run's result."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from tuner.scoring import LoadSummary

__all__ = [
    "FAILURE_CLASSES",
    "CapacitySearchResult",
    "CapacityStep",
    "FailureClass",
    "LoadResult",
    "RequestRecord",
    "ServerMetricsSummary",
    "TurnFigures",
]

FailureClass = Literal[
    "timeout",
    "connection_refused",
    "connection_reset",
    "http_4xx",
    "http_5xx",
    "stream_cut",
    "malformed_sse",
    "short_output",
    "other",
]
FAILURE_CLASSES: tuple[str, ...] = get_args(FailureClass)


class RequestRecord(BaseModel):
    """One request as the client saw it. Times in (emulated) seconds; `start_s` from the start of the run, when the
    request was on the wire (where the transport says so: tuner.load.connections.on_wire; else when it was sent)."""

    model_config = ConfigDict(extra="forbid")

    index: int
    start_s: float
    ttft_s: float | None = None
    itl_s: list[float] = Field(default_factory=list)
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ok: bool = False
    error_class: FailureClass | None = None
    error_message: str | None = None
    warmup: bool = False
    usage_from_server: bool = True
    turn: int | None = None
    """Of a conversation workload: the turn within its conversation (0: the first); None for single requests."""

    @property
    def end_s(self) -> float:
        return self.start_s + self.e2e_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's definition); None for a reply of one token or less."""
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


class ServerMetricsSummary(BaseModel):
    """The server's own view during the run, from its Prometheus /metrics (vLLM names)."""

    model_config = ConfigDict(extra="forbid")

    samples: int
    kv_usage_max: float | None = None
    kv_usage_mean: float | None = None
    running_max: float | None = None
    running_mean: float | None = None
    waiting_max: float | None = None
    waiting_mean: float | None = None
    preemptions: float | None = None
    generation_tokens: float | None = None
    prefix_cache_hit_rate: float | None = None
    """Prefix-cache hits / queries (in tokens) during the run."""
    queue_time_mean_s: float | None = None
    """Mean time a request finished during the run spent waiting for admission (vllm:request_queue_time_seconds)."""
    queue_time_p95_bound_s: float | None = None
    """95% of those requests waited at most this long: the bound of vLLM's bucket (0.3, 0.5, 0.8, 1, 1.5 ... s)."""
    itl_mean_s: float | None = None
    """Mean inter-token latency the server measured (vllm:inter_token_latency_seconds)."""
    error: str | None = None


class TurnFigures(BaseModel):
    """A conversation workload's TTFT by turn: a first turn's prompt is new to the server, a later turn's history
    is the previous request's prompt and answer, which a prefix cache can serve. Seconds; None: none measured."""

    model_config = ConfigDict(extra="forbid")

    first_turns: int = 0
    later_turns: int = 0
    max_turn: int = 0
    ttft_p50_first_s: float | None = None
    ttft_p95_first_s: float | None = None
    ttft_p50_later_s: float | None = None
    ttft_p95_later_s: float | None = None


class LoadResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    summary: LoadSummary
    records: list[RequestRecord]
    server: ServerMetricsSummary | None = None
    diagnosis: str = ""
    mode: str = ""
    """What was offered, e.g. 'closed loop, 16 users' or 'open loop, poisson 8 req/s'."""
    stopped_early: bool = False
    slo_stop: str | None = None
    """Why the run stopped before its request count: an SLO was already missed for certain (None: it did not)."""
    workload_fingerprint: str = ""
    turns: TurnFigures | None = None
    """TTFT by turn, for a conversation workload."""
    peak_in_flight: int = 0
    origin_unix_s: float | None = None
    """The wall clock (Unix seconds) at the run's origin: request i began at origin_unix_s + start_s / the clock's
    scale. Lines the records up with clocks outside this process (a packet capture's timestamps)."""


class CapacityStep(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rate: float
    summary: LoadSummary
    meets_slos: bool
    speedup: float | None = None
    """A trace's step: the speed-up that sends its slice at `rate` (the rate over the slice's own mean rate)."""
    violations: list[float] = Field(default_factory=list)
    diagnosis: str = ""
    slo_stop: str | None = None


class CapacitySearchResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    best_rate: float | None
    best: LoadResult | None
    steps: list[CapacityStep]
    estimate_rate: float | None = None
    """Request throughput of the saturating closed-loop probe the search started from (a trace's speed-up given:
    the rate it plays at)."""
    probe: LoadSummary | None = None
    trace_rate: float | None = None
    """A trace's slice's own mean rate (req/s at speed-up 1): a rate over it is the speed-up that rate means."""

    @property
    def best_speedup(self) -> float | None:
        return self.best_rate / self.trace_rate if self.best_rate is not None and self.trace_rate else None
