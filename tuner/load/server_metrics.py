"""The server's side of a load run: scrape vLLM's Prometheus /metrics, summarise it, and name the bottleneck."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tuner.clock import Clock
from tuner.load.arrival import Arrival
from tuner.load.results import ServerMetricsSummary
from tuner.scoring import LoadSummary

__all__ = [
    "Histogram",
    "MetricsSample",
    "MetricsScraper",
    "diagnose",
    "parse_metrics",
    "scrape_metrics",
    "summarize_samples",
]

# Current names first, then the older ones a version still serves. vLLM 0.9.2 renamed gpu_cache_usage_perc to
# kv_cache_usage_perc and gpu_prefix_cache_{queries,hits} to prefix_cache_{queries,hits} (the old ones hidden in
# 0.11, gone in 0.12); 0.11 renamed the histogram time_per_output_token_seconds to inter_token_latency_seconds.
# Counters are exposed with "_total" (the parser keeps the sample's name).
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_RUNNING = ("vllm:num_requests_running",)
_WAITING = ("vllm:num_requests_waiting",)
_PREEMPTIONS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
_GENERATION = ("vllm:generation_tokens_total", "vllm:generation_tokens")
_PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
_PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
_QUEUE_TIME = ("vllm:request_queue_time_seconds",)
_ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")

# The sample names the summary reads. A scrape asks for these alone, with prometheus_client's `name[]` filter, at
# `/metrics/`: vLLM (0.11 through 0.32: vllm/entrypoints/serve/instrumentator/metrics.py, attach_router) serves
# `/metrics` from prometheus-fastapi-instrumentator's handler, which renders the whole registry (~40 families, 48-53
# KB), and mounts prometheus_client's make_asgi_app, which honours `name[]`, on every path below it. Measured on the
# CPU build: 4 ms a filtered scrape against 16-50 ms a whole page, time its API process takes from the load.
WANTED_SAMPLES: tuple[str, ...] = (
    *_KV,
    *_RUNNING,
    *_WAITING,
    *_PREEMPTIONS,
    *_GENERATION,
    *_PREFIX_QUERIES,
    *_PREFIX_HITS,
    *(f"{name}{suffix}" for name in (*_QUEUE_TIME, *_ITL) for suffix in ("_bucket", "_count", "_sum")),
)

KV_FULL = 0.95
"""KV usage from which the cache counts as full (vLLM preempts at the last free block)."""


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram as scraped: cumulative counts by upper bound (the last one +Inf), count and sum."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    def since(self, earlier: Histogram | None) -> Histogram:
        """What was observed after `earlier` (the whole of this one when the server restarted in between)."""
        if (
            earlier is None
            or self.count < earlier.count
            or [b for b, _ in self.buckets] != [b for b, _ in earlier.buckets]
        ):
            return self
        return Histogram(
            tuple((le, n - m) for (le, n), (_, m) in zip(self.buckets, earlier.buckets, strict=True)),
            self.count - earlier.count,
            self.sum - earlier.sum,
        )

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def bound(self, q: float) -> float | None:
        """The upper bound of the bucket that holds the q-quantile: a share q of the observations were at most
        this. Not interpolated (Prometheus' histogram_quantile says 0.285 s for queue times that are all under a
        millisecond, vLLM's first bucket being 0.3 s); None when it falls in +Inf or nothing was observed."""
        total = self.buckets[-1][1] if self.buckets else 0.0
        if total <= 0:
            return None
        le = next(le for le, cumulative in self.buckets if cumulative >= q * total)
        return None if math.isinf(le) else le


@dataclass(frozen=True)
class MetricsSample:
    t: float
    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions_total: float | None = None
    generation_tokens_total: float | None = None
    prefix_queries_total: float | None = None
    prefix_hits_total: float | None = None
    queue_time: Histogram | None = None
    itl: Histogram | None = None


def parse_metrics(text: str, *, t: float = 0.0, model: str | None = None) -> MetricsSample:
    """One scrape: gauges, counters and histograms summed over engines (KV usage: the fullest engine); None where
    absent.

    Raises ValueError for text that is not Prometheus exposition format.
    """
    values: dict[str, list[float]] = {}
    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if model is not None and sample.labels.get("model_name", model) != model:
                continue
            if sample.name.endswith("_bucket") and "le" in sample.labels:
                by_le = buckets.setdefault(sample.name.removesuffix("_bucket"), {})
                le = float(sample.labels["le"])
                by_le[le] = by_le.get(le, 0.0) + float(sample.value)
            else:
                values.setdefault(sample.name, []).append(float(sample.value))

    def pick(names: Sequence[str], combine: str = "sum") -> float | None:
        for name in names:
            if name in values:
                vs = values[name]
                return max(vs) if combine == "max" else math.fsum(vs)
        return None

    def histogram(names: Sequence[str]) -> Histogram | None:
        for name in names:
            if name in buckets and f"{name}_count" in values:
                count, total = pick([f"{name}_count"]), pick([f"{name}_sum"])
                return Histogram(tuple(sorted(buckets[name].items())), count or 0.0, total or 0.0)
        return None

    return MetricsSample(
        t=t,
        kv_usage=pick(_KV, "max"),
        running=pick(_RUNNING),
        waiting=pick(_WAITING),
        preemptions_total=pick(_PREEMPTIONS),
        generation_tokens_total=pick(_GENERATION),
        prefix_queries_total=pick(_PREFIX_QUERIES),
        prefix_hits_total=pick(_PREFIX_HITS),
        queue_time=histogram(_QUEUE_TIME),
        itl=histogram(_ITL),
    )


def summarize_samples(samples: Sequence[MetricsSample], *, error: str | None = None) -> ServerMetricsSummary:
    def series(attr: str) -> list[float]:
        return [v for s in samples if (v := getattr(s, attr)) is not None]

    def delta(attr: str) -> float | None:
        vs = series(attr)
        # A counter that went down means the server restarted; count from the restart.
        return None if not vs else math.fsum(b - a if b >= a else b for a, b in itertools.pairwise(vs))

    def run_histogram(attr: str) -> Histogram | None:
        """What the run added to a histogram: its last scrape less its first (as the counters, one scrape: none)."""
        scraped: list[Histogram] = [h for s in samples if (h := getattr(s, attr)) is not None]
        return scraped[-1].since(scraped[0]) if len(scraped) > 1 else None

    kv, running, waiting = series("kv_usage"), series("running"), series("waiting")
    queries, hits = delta("prefix_queries_total"), delta("prefix_hits_total")
    queue, itl = run_histogram("queue_time"), run_histogram("itl")
    return ServerMetricsSummary(
        samples=len(samples),
        kv_usage_max=max(kv) if kv else None,
        kv_usage_mean=math.fsum(kv) / len(kv) if kv else None,
        running_max=max(running) if running else None,
        running_mean=math.fsum(running) / len(running) if running else None,
        waiting_max=max(waiting) if waiting else None,
        waiting_mean=math.fsum(waiting) / len(waiting) if waiting else None,
        preemptions=delta("preemptions_total"),
        generation_tokens=delta("generation_tokens_total"),
        prefix_cache_hit_rate=hits / queries if hits is not None and queries else None,
        queue_time_mean_s=queue.mean() if queue else None,
        queue_time_p95_bound_s=queue.bound(0.95) if queue else None,
        itl_mean_s=itl.mean() if itl else None,
        error=error,
    )


@dataclass
class MetricsScraper:
    """Samples collected by a background scrape; `failures` counts the scrapes that read nothing, `error` says why the
    last one did not.
    `filtered` is whether the server honoured the `name[]` filter (False: it is asked for whole pages)."""

    samples: list[MetricsSample] = field(default_factory=list)
    error: str | None = None
    failures: int = 0
    filtered: bool = True

    def summary(self) -> ServerMetricsSummary | None:
        """The run's server-side view; when a scrape read nothing the summary says why (the last reason), so a trial
        whose scrapes all failed shows that rather than no server figures at all. None: nothing was scraped."""
        if self.failures == 0:
            return summarize_samples(self.samples) if self.samples else None
        error = f"{self.failures} of {self.failures + len(self.samples)} scrapes read nothing; the last: {self.error}"
        return summarize_samples(self.samples, error=error)

    def failed(self, url: str, e: Exception) -> None:
        self.failures += 1
        self.error = f"{url}: {type(e).__name__}: {e}"


def _read_nothing(sample: MetricsSample) -> bool:
    return all(getattr(sample, f.name) is None for f in dataclasses.fields(sample) if f.name != "t")


async def _scrape_once(
    client: httpx.AsyncClient, base: str, clock: Clock, model: str | None, out: MetricsScraper
) -> None:
    if out.filtered:
        filtered_url = f"{base}/metrics/"
        try:
            response = await client.get(filtered_url, params={"name[]": list(WANTED_SAMPLES)}, timeout=5.0)
        except httpx.TransportError as e:
            # A busy server's late answer, or none: its state, not a sign the filter is missing. Whole pages would
            # only load it more.
            out.failed(filtered_url, e)
            return
        try:
            sample = _parse(response, clock, model)
        except Exception:
            sample = None
        if sample is not None and not _read_nothing(sample):
            out.samples.append(sample)
            return
        # No filtering app below /metrics (a redirect, a 404, another page), or a registry the filter cannot look
        # into (vLLM's multiprocess collector, with several API servers, knows no names and answers an empty
        # page): whole pages from now on.
        out.filtered = False
    url = f"{base}/metrics"
    try:
        out.samples.append(_parse(await client.get(url, timeout=5.0), clock, model))
    except Exception as e:  # the server-side view is optional; the load run goes on without it
        out.failed(url, e)


def _parse(response: httpx.Response, clock: Clock, model: str | None) -> MetricsSample:
    if response.status_code != 200:
        raise ValueError(f"HTTP {response.status_code}")
    return parse_metrics(response.text, t=clock.now(), model=model)


@contextlib.asynccontextmanager
async def scrape_metrics(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    clock: Clock,
    model: str | None = None,
    interval_s: float | None = None,
) -> AsyncIterator[MetricsScraper]:
    """Scrape `base_url`/metrics every `interval_s` wall seconds while the block runs, once more at its end.

    Default interval: one emulated second, kept within 0.25–1 wall seconds so a fast emulator is not flooded.
    """
    base = base_url.rstrip("/")
    interval = interval_s if interval_s is not None else min(1.0, max(0.25, clock.to_wall(1.0)))
    out = MetricsScraper()

    async def loop() -> None:
        while True:
            await _scrape_once(client, base, clock, model, out)
            if out.failures >= 3 and not out.samples:
                return  # no /metrics here: stop asking
            await asyncio.sleep(interval)

    task = asyncio.create_task(loop())
    try:
        yield out
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if out.samples:
        await _scrape_once(client, base, clock, model, out)


def diagnose(
    summary: LoadSummary,
    server: ServerMetricsSummary | None,
    arrival: Arrival | None = None,
    *,
    max_num_seqs: int | None = None,
    send_rate: float | None = None,
) -> str:
    """One line naming what limited the run, from the client summary and the server's metrics."""
    unread = None
    if server is not None and server.samples == 0:
        unread, server = server.error, None  # every scrape failed: nothing of the server's to judge by
    if summary.requests_sent == 0:
        return "no requests measured"
    failed_note = _failures_note(summary)
    if summary.requests_succeeded == 0:
        return f"all requests failed: {failed_note}"
    base = _server_bottleneck(server, max_num_seqs, summary.e2e.mean)
    if base is None and summary.requests_failed / summary.requests_sent >= 0.05:
        return f"server errors: {summary.requests_failed / summary.requests_sent:.0%} failed ({failed_note})"
    if base is None:
        base = _client_bound(summary, server, arrival, send_rate)
    if base is None:
        if server is None:
            base = f"no saturation seen by the client (no server metrics{f': {unread}' if unread else ''})"
        else:
            queue = "no queue" if not server.waiting_max else f"{_n(server.waiting_max)} waiting max"
            base = f"no saturation: {_n(server.running_max)} running max, KV {_pct(server.kv_usage_max)} max, {queue}"
    if summary.requests_failed:
        base += f"; {summary.requests_failed} failed ({failed_note})"
    return base


def _server_bottleneck(
    server: ServerMetricsSummary | None, max_num_seqs: int | None, e2e_mean_s: float = 0.0
) -> str | None:
    if server is None:
        return None
    kv = server.kv_usage_max
    preempted = server.preemptions or 0.0
    if (kv is not None and kv >= KV_FULL) or preempted > 0:
        return f"KV cache full: {_pct(kv)} max, {_n(preempted)} preemptions"
    waiting = server.waiting_max or 0.0
    running = server.running_max
    at_cap = max_num_seqs is not None and running is not None and running >= max_num_seqs
    # Requests waiting for the next step now and then are arrival jitter, not a bottleneck: a queue is one that
    # holds at least a request on average over the scrapes.
    if server.waiting_mean is not None:
        queued = server.waiting_mean >= 1.0
    else:
        queued = waiting >= max(2.0, 0.1 * (running or 0.0))
    # vLLM's own queue-time histogram sees every request, not only those caught waiting at a scrape: a queue is
    # one that costs the requests a tenth of their latency or more.
    queue_time = server.queue_time_mean_s
    queued = queued or (queue_time is not None and e2e_mean_s > 0 and queue_time >= 0.1 * e2e_mean_s)
    queue_note = f", queued {queue_time:.2g} s mean" if queue_time is not None and queued else ""
    if (at_cap and waiting > 0) or queued:
        if at_cap or max_num_seqs is None:
            return f"capped by max_num_seqs: {_n(running)} running, {_n(waiting)} waiting, KV {_pct(kv)}{queue_note}"
        # Room in the batch and in the KV cache, yet a queue: the per-step token budget admits no more prefills.
        return (
            f"prefill budget (max_num_batched_tokens): {_n(waiting)} waiting with {_n(running)} running "
            f"< max_num_seqs {max_num_seqs}, KV {_pct(kv)}{queue_note}"
        )
    return None


def _client_bound(
    summary: LoadSummary, server: ServerMetricsSummary | None, arrival: Arrival | None, send_rate: float | None
) -> str | None:
    """The client offered less than asked while the server had room: the numbers measure the client."""
    if arrival is None:
        return None
    n = arrival.concurrency
    # The ramp-down tail of a closed loop lowers the mean; only judge runs of several rounds.
    if n is not None and summary.requests_sent >= 4 * n and summary.concurrency < 0.8 * n:
        return f"client-bound: {summary.concurrency:.1f} in flight on average of {n} users"
    rate = arrival.rate
    enough = summary.requests_sent >= 20 and arrival.max_in_flight is None
    if rate is not None and send_rate is not None and enough and send_rate < 0.8 * rate:
        return f"client-bound: sent {send_rate:.1f} req/s of {rate:g} offered"
    return None


def _failures_note(summary: LoadSummary) -> str:
    return ", ".join(f"{cls} {n}" for cls, n in summary.failures.items())


def _pct(v: float | None) -> str:
    return "?" if v is None else f"{v:.0%}"


def _n(v: float | None) -> str:
    return "?" if v is None else f"{v:.0f}"
